"""What the agent reads of a running worker: an announced exit or return, its progress,
its stacks.

These are the worker-contract files (``_contract.py``); everything here takes the
time as an argument and returns facts, so the agent loop stays a loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from relaunch._contract import STACK_SIGNAL, AttemptFiles, read_exit_file
from relaunch.errors import ErrorRecord, read_error_file, write_error_file
from relaunch.errors._file import error_data
from relaunch.procs import is_stopped

__all__ = ["announced_exit", "collect_stacks", "last_progress", "record_hang", "returned_at"]


def announced_exit(files: AttemptFiles) -> int | None:
    """The exit code of a worker that is still tearing down but has failed already.

    The runner's exit file says so; without a runner, a complete error file (``@record``)
    does. In-process workers (marker present) are left to their own restarts.
    """
    if os.path.exists(files.marker):
        return None
    record = read_exit_file(files.exit_file)
    if record is not None:
        return None if record.returned else record.exitcode
    if os.path.exists(files.error_file) and isinstance(
        read_error_file(files.error_file), ErrorRecord
    ):
        return 1
    return None


def returned_at(files: AttemptFiles) -> float | None:
    """When the worker's script returned (or exited 0), as its runner announced before
    the interpreter tore down; None when it did not (yet). Such a worker succeeded,
    whatever its process does afterwards -- an in-process worker too."""
    record = read_exit_file(files.exit_file)
    return record.time if record is not None and record.returned else None


def last_progress(files: AttemptFiles, started: float) -> float | None:
    """Wall-clock time the worker's main thread last ran Python code (its start at least);
    None while its runner has not created the progress file (not watched: a worker not
    started through the runner never creates it)."""
    try:
        return max(started, os.stat(files.progress_file).st_mtime)
    except OSError:
        return None


def collect_stacks(pid: int, files: AttemptFiles, wait: float = 1.0) -> str:
    """The worker's Python stacks, written by faulthandler on ``STACK_SIGNAL``."""
    stopped = is_stopped(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, STACK_SIGNAL)
        if stopped:
            os.kill(pid, signal.SIGCONT)  # it must run to write them; it is killed next
    deadline = time.monotonic() + wait
    text = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), open(files.stack_file, errors="replace") as f:
            text = f.read()
        if text.strip() and text.endswith("\n"):
            time.sleep(0.05)  # let it finish the other threads
            with contextlib.suppress(OSError), open(files.stack_file, errors="replace") as f:
                text = f.read()
            break
        time.sleep(0.02)
    note = "the process was stopped (SIGSTOP); " if stopped else ""
    return note + (text.strip() or "no Python stack could be collected")


def record_hang(files: AttemptFiles, *, since: float, timeout: float, stacks: str) -> str:
    """Write the hung worker's error file (its report); return its one-line message."""
    message = (
        f"Hang: no Python code ran in the main thread for {time.time() - since:.1f}s "
        f"(--hang-timeout {timeout:g})"
    )
    with contextlib.suppress(OSError):
        write_error_file(files.error_file, error_data(message, stacks, now=since))
    return message
