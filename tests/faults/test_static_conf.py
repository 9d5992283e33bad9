"""The static backend's ``--rdzv-conf``: its keys are checked (one line, exit 2), and
``secret_file`` (or ``RELAUNCH_RDZV_SECRET_FILE``) signs every record: two nodes with the
same secret train, a node with another secret or none cannot join (one line, no worker
runs). ``--standalone`` says that it ignores ``--rdzv-conf``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from multinode_support.cluster import free_port

PY = sys.executable

pytestmark = pytest.mark.timeout(120)

WORKER = """
import os, sys
with open(os.path.join(sys.argv[1], "ran_" + os.environ["RANK"]), "w") as f:
    f.write(os.environ["WORLD_SIZE"])
"""


def relaunch(tmp: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    (tmp / "worker.py").write_text(WORKER)
    return subprocess.Popen(
        [PY, "-m", "relaunch", *argv, str(tmp / "worker.py"), str(tmp)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def static(port: int, rank: int, *conf: str) -> list[str]:
    return [
        "--nnodes=2", "--rdzv-backend=static", "--master-addr=127.0.0.1",
        f"--master-port={port}", f"--node-rank={rank}", "--local-addr=127.0.0.1",
        "--rdzv-id=job", "--max-restarts=0", *conf,
    ]  # fmt: skip


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def secret(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ("last_call_timeout=5", "unknown --rdzv-conf key 'last_call_timeout'; valid keys are: "
                                "join_timeout, secret_file"),
        ("join_timeout=abc", "--rdzv-conf join_timeout must be a positive number of seconds, "
                             "got 'abc'"),
        ("join_timeout=0", "--rdzv-conf join_timeout must be a positive number of seconds"),
        ("secret_file=/nonexistent/secret", "--rdzv-conf secret_file: expected a readable file"),
    ],
)  # fmt: skip
def test_a_bad_static_conf_is_one_line_and_exit_2(tmp_path: Path, conf: str, expected: str) -> None:
    proc = relaunch(tmp_path, *static(free_port(), 0, f"--rdzv-conf={conf}"))
    [(code, err)] = finish([proc])
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("relaunch: error: "), err
    assert expected in err, err
    assert not list(tmp_path.glob("ran_*"))


def test_two_static_nodes_with_the_same_secret_train(tmp_path: Path) -> None:
    key = secret(tmp_path / "secret", "s3cret-of-the-job-42")
    port = free_port()
    procs = [
        relaunch(tmp_path, *static(port, 0, f"--rdzv-conf=secret_file={key}")),
        relaunch(tmp_path, *static(port, 1), env={"RELAUNCH_RDZV_SECRET_FILE": key}),
    ]
    results = finish(procs)
    assert [code for code, _ in results] == [0, 0], results
    assert {p.name: p.read_text() for p in tmp_path.glob("ran_*")} == {"ran_0": "2", "ran_1": "2"}


@pytest.mark.parametrize("other", ["another", "none"])
def test_a_static_node_without_the_jobs_secret_cannot_join(tmp_path: Path, other: str) -> None:
    key = secret(tmp_path / "secret", "s3cret-of-the-job-42")
    wrong = secret(tmp_path / "wrong", "not-the-secret-of-this-job")
    port = free_port()
    conf = [f"--rdzv-conf=secret_file={wrong}"] if other == "another" else []
    host = relaunch(tmp_path, *static(port, 0, f"--rdzv-conf=secret_file={key}"))
    try:
        [(code, err)] = finish([relaunch(tmp_path, *static(port, 1, *conf))])
        assert code == 1, err
        errors = [line for line in err.splitlines() if line.startswith("relaunch: error:")]
        assert len(errors) == 1, err
        assert "node/0'" in errors[0] and "this node's secret is not the job's" in errors[0], err
        assert "Traceback" not in err, err
        assert host.poll() is None  # the stranger did not end the job: it waits for rank 1
        # The real node 1 arrives: the job runs.
        results = finish([relaunch(tmp_path, *static(port, 1, f"--rdzv-conf=secret_file={key}"))])
        results += finish([host])
    finally:
        if host.poll() is None:
            host.kill()
        finish([host])
    assert [code for code, _ in results] == [0, 0], results
    host_err = results[1][1]
    assert host_err.count("node/1'") == 1 and "waiting for the node of that rank" in host_err
    assert {p.name: p.read_text() for p in tmp_path.glob("ran_*")} == {"ran_0": "2", "ran_1": "2"}


def test_standalone_says_it_ignores_rdzv_conf(tmp_path: Path) -> None:
    proc = relaunch(tmp_path, "--standalone", "--rdzv-conf=join_timeout=5")
    [(code, err)] = finish([proc])
    assert code == 0, err
    assert "--rdzv-conf=join_timeout=5 ignored: a single-node job (--standalone)" in err, err
    proc = relaunch(tmp_path, "--rdzv-conf=join_timeout=5")
    [(code, err)] = finish([proc])
    assert code == 0, err
    assert "ignored: a single-node job (--nnodes 1 without a rendezvous endpoint)" in err, err
