"""A worker that exited long before the workers are stopped: its pid may name another
process by then. ``close`` kills what is left of each worker's session (DataLoader
workers, shells); it must not kill the process that took an exited worker's pid, nor
that process's session (it did: a process of another user of the node, SIGKILLed).
The kernel hands out a chosen pid once ``/proc/sys/kernel/ns_last_pid`` is written
(root); skipped where it cannot be."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from multinode_support.waiting import wait_for
from relaunch.procs import Entrypoint, ProcessSpec, WorkerProcesses

pytestmark = pytest.mark.timeout(60)


def _take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A process of its own session with ``pid`` (None: another process took it first)."""
    for _ in range(50):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"cannot choose a pid here: {exc}")
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_the_process_that_took_an_exited_worker_s_pid_survives_close(tmp_path: Path) -> None:
    script = tmp_path / "done.py"
    script.write_text("import sys\nsys.exit(0)\n")
    spec = ProcessSpec(
        local_rank=0,
        env=dict(os.environ),
        stdout=str(tmp_path / "out.log"),
        stderr=str(tmp_path / "err.log"),
    )
    procs = WorkerProcesses(Entrypoint(kind="script", target=str(script)), [spec])
    procs.start()
    (pid,) = procs.pids().values()
    wait_for(lambda: procs.poll()[0] is not None, what="the worker's exit")
    other = _take_pid(pid)
    if other is None:
        procs.close()
        pytest.skip("another process took the pid first")
    try:
        assert procs.close() == {0: 0}
        assert other.poll() is None, "close() killed the process that took the worker's pid"
    finally:
        other.kill()
        other.wait()
