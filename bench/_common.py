"""Shared helpers for the benchmarks: run in a loopback-only network namespace, medians."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from relaunch._endpoint import quiet_port


def _exit_on(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # run the benchmark's finally blocks: stop its launchers


def in_loopback_netns() -> None:
    """Re-execute this script in a new network namespace with only ``lo`` up.

    torch's TCPStore does a reverse DNS lookup per connection; on some machines one
    in ~25 stalls for 5 s. A loopback-only namespace removes that noise. Skipped
    when not permitted or when RELAUNCH_BENCH_NETNS=0. SIGTERM and SIGINT end the
    benchmark through its cleanup (the outer process forwards them to the inner one),
    so no launcher or worker is left behind.
    """
    signal.signal(signal.SIGTERM, _exit_on)
    if os.environ.get("RELAUNCH_BENCH_NETNS") in ("0", "done"):
        return
    if not shutil.which("unshare") or not shutil.which("ip"):
        print("note: no unshare or ip (iproute2) here; running on the host network")
        return
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        print("note: cannot create a network namespace; running on the host network")
        return
    env = {**os.environ, "RELAUNCH_BENCH_NETNS": "done"}
    cmd = [
        "unshare",
        "-n",
        "sh",
        "-c",
        'ip link set lo up && exec "$@"',
        "sh",
        sys.executable,
        *sys.argv,
    ]
    proc = subprocess.Popen(cmd, env=env)  # unshare and sh exec: proc is the benchmark

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    raise SystemExit(proc.wait())


STORE_SERVER = """
import sys
from relaunch.store.tcp import TCPStoreServer
server = TCPStoreServer(host="127.0.0.1", port=0).start()
print(server.port, flush=True)
sys.stdin.read()
server.close()
"""
"""``python -c`` it: relaunch's TCP store server on 127.0.0.1, in a process of its own; it
prints its port and serves until its stdin closes."""


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(values: list[float]) -> str:
    return f"median {median(values):6.2f} s  (runs: {', '.join(f'{v:.2f}' for v in values)})"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the ephemeral range (where no connection
    takes it as its source port before a server binds it)."""
    return quiet_port("127.0.0.1")


class JsonLines:
    """The JSON lines processes append to ``out/*.log``, read incrementally: each poll
    parses only what was appended since the last one (a line being written waits),
    so watching a job that logs every step costs the cores it shares little.
    ``annotate(path, record)`` may add fields from the file's name."""

    def __init__(
        self,
        out: Path,
        annotate: Callable[[Path, dict[str, Any]], dict[str, Any]] = lambda path, row: row,
    ) -> None:
        self.out = out
        self.rows: list[dict[str, Any]] = []
        self._annotate = annotate
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        for path in sorted(self.out.glob("*.log")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                if line:
                    self.rows.append(self._annotate(path, json.loads(line)))
        return self.rows


def etcd_calls(ports: list[int]) -> collections.Counter[str]:
    """The calls the etcd members serving on 127.0.0.1 at ``ports`` handled so far, by
    etcd's gRPC method (their /metrics; a lease refresh or a watch through the JSON
    gateway is one stream each), and their health checks as ``Health``."""
    calls: collections.Counter[str] = collections.Counter()
    for port in ports:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
            pattern = r'^grpc_server_started_total\{grpc_method="(\w+)".*\} (\S+)$'
            for m in re.finditer(pattern, text, re.MULTILINE):
                calls[m.group(1)] += int(float(m.group(2)))
            # the members' health checks (/health: not a gRPC call)
            pattern = r"^etcd_server_health_(?:success|failures) (\S+)$"
            for m in re.finditer(pattern, text, re.MULTILINE):
                calls["Health"] += int(float(m.group(1)))
    return calls


def calls_line(calls: collections.Counter[str], seconds: float) -> str:
    """``calls`` (of :func:`etcd_calls`) a second: the total, then by method."""
    rates = ", ".join(f"{name} {n / seconds:.1f}" for name, n in calls.most_common())
    return f"{calls.total() / seconds:.1f} ({rates})"


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` busy processes (a node's other work: a data loader's workers, other
    jobs) while the block runs; killed and reaped after it."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
