"""Stopping the agents a test started: SIGTERM to all at once, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable

__all__ = ["stop_sessions"]


def stop_sessions(procs: Iterable[subprocess.Popen[bytes]], grace: float = 30.0) -> None:
    """SIGTERM every process group still running (all at once: a hosting agent waits
    for the others to leave), ``grace`` s to exit, then SIGKILL to whatever is left of
    each group (workers an agent did not stop included)."""
    procs = list(procs)
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
