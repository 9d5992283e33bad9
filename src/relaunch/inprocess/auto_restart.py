"""Self-monitoring restart of a whole process (NVIDIA's ``inprocess.auto_restart``).

:func:`monitor_and_restart` forks: the child returns to the caller and runs the
program; the parent waits for it. A child that exits with status 0 ends the parent
with status 0; a child that fails (non-zero status, a signal) is forked again from
the parent's state after ``restart_delay`` seconds. Call it early, before threads or
CUDA exist (``fork`` copies only the calling thread). The messages on stderr are
NVIDIA's, so tools that parse them keep working.
"""

from __future__ import annotations

import errno
import os
import sys
import time

from relaunch.errors import ConfigError

__all__ = ["monitor_and_restart"]


def monitor_and_restart(restart_delay: float = 5.0) -> None:
    """Return in a child process; the parent restarts the child until it succeeds."""
    if (
        isinstance(restart_delay, bool)
        or not isinstance(restart_delay, int | float)
        or not restart_delay >= 0
    ):
        raise ConfigError(f"restart_delay: expected seconds >= 0, got {restart_delay!r}")
    sys.stderr.write("Starting self-monitoring mode\n")
    while True:
        try:
            child = os.fork()
        except OSError as exc:
            sys.stderr.write(f"fork: {exc}\n")
            os._exit(1)
        if child == 0:
            return
        sys.stderr.write(f"Launched child {child}\n")
        status = _wait(child)
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
            sys.stderr.write(f"Child {child} exited with status {code}\n")
            if code == 0:
                os._exit(0)
        elif os.WIFSIGNALED(status):
            sys.stderr.write(f"Child {child} exited with signal {os.WTERMSIG(status)}\n")
        else:
            sys.stderr.write(f"Child {child} exited abnormally ({status:x})\n")
        time.sleep(restart_delay)


def _wait(child: int) -> int:
    while True:
        try:
            return os.waitpid(child, 0)[1]
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            sys.stderr.write(f"waitpid: {exc}\n")
            os._exit(1)
