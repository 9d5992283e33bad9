"""The child processes this process started (``subprocess.Popen``) and has not reaped
yet: whoever reaps the orphans reparented to a subreaper leaves these alone, so each
Popen sees its own child's exit status (a reaped child's Popen would read 0).

Standard library only; any thread may start a child.
"""

from __future__ import annotations

import subprocess
import threading
import weakref
from typing import Any, TypeVar

__all__ = ["track", "unreaped"]

P = TypeVar("P", bound="subprocess.Popen[Any]")

_started: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()
_lock = threading.Lock()


def track(proc: P) -> P:
    """Remember ``proc`` until it is reaped (or dropped); returns it."""
    with _lock:
        _started.add(proc)
    return proc


def unreaped() -> set[int]:
    """The pids of the tracked children whose Popen has not reaped them."""
    with _lock:
        procs = list(_started)
    return {proc.pid for proc in procs if proc.returncode is None}
