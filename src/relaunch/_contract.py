"""The worker contract beyond torchrun's variables (read by the agent, by
``relaunch.inprocess`` and -- by these literal names, as it runs by path -- by the
runner): the files an attempt's worker and the
agent share, named in the worker's environment and written by the runner (``_warm.py``).

- ``TORCHELASTIC_ERROR_FILE``: torch's error file (``@record``, or the runner when the
  script raised without it).
- ``RELAUNCH_EXIT_FILE``: ``{"version": 2, "exitcode": N, "time": T}``, written by the
  runner when the script ended, before the interpreter tears down. N != 0 (it raised
  or exited non-zero): the agent treats the worker as exited with N from then on.
  N == 0 (it returned, or exited 0): the worker is done and succeeded, whatever its
  interpreter does afterwards (atexit handlers, C++ destructors that abort, a hang or
  a signal death in teardown); T tells the agent when its teardown began. (Version 1
  announced failures only.)
- ``RELAUNCH_INPROCESS_MARKER``: exists while the worker runs under
  ``relaunch.inprocess`` (its peers go on without a lost rank).
- ``RELAUNCH_INPROCESS_INCARNATION``: set for a replacement process of an in-process
  rank that died (1 for its first replacement): it joins its running peers instead
  of starting the job (``relaunch.inprocess._core._rejoin``).
- ``RELAUNCH_INPROCESS_JOIN_WAIT``: set when the agent replaces dead in-process ranks
  (``--max-restarts`` > 0): how long a restart waits for a replacement's join request.
- ``RELAUNCH_INPROCESS_PRELOAD``: a file listing (one per line) the modules this
  node's workers import; a replacement process imports those it lacks before it asks
  to join, so its peers never wait for its imports (they train on meanwhile).
- ``RELAUNCH_SNAPSHOT_DIR``: the node's snapshot directory (``relaunch.checkpoint``),
  one folder per global rank (:func:`snapshot_rank_dir`). A worker whose rank has a
  snapshot there when it starts (a restart; a node that took a lost node's ranks) has
  the runner start reading the newest one back before the script runs
  (:func:`snapshot_to_prefetch`); ``checkpoint.load()`` takes what it read.
- ``RELAUNCH_PROGRESS_FILE`` (with ``--hang-timeout``): its mtime is the last time the
  worker's main thread ran Python code; ``RELAUNCH_STACK_FILE`` receives its Python
  stacks when the agent sends ``RELAUNCH_STACK_SIGNAL`` (faulthandler).

And in the workers' store: ``/relaunch/inprocess/<run id>/<restart count>/`` holds
the keys of ``relaunch.inprocess`` (one ``call<n>/`` prefix per wrapped call) and
``lost``, where the agent records the ranks lost with their node.

Standard library only: the runner (``procs/_warm.py``) loads this file by path, so
both sides of the contract read one definition.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ERROR_FILE_ENV",
    "EXIT_FILE_ENV",
    "EXIT_FILE_VERSION",
    "INCARNATION_ENV",
    "JOIN_WAIT",
    "JOIN_WAIT_ENV",
    "MARKER_ENV",
    "PRELOAD_ENV",
    "SNAPSHOT_DIR_ENV",
    "STACK_SIGNAL",
    "AttemptFiles",
    "ExitRecord",
    "call_namespace",
    "error_record",
    "exit_record",
    "lost_key",
    "lost_key_of",
    "read_exit_file",
    "read_marker",
    "read_module_list",
    "snapshot_rank_dir",
    "snapshot_to_prefetch",
]

EXIT_FILE_VERSION = 2
INCARNATION_ENV = "RELAUNCH_INPROCESS_INCARNATION"
MARKER_ENV = "RELAUNCH_INPROCESS_MARKER"
JOIN_WAIT_ENV = "RELAUNCH_INPROCESS_JOIN_WAIT"
PRELOAD_ENV = "RELAUNCH_INPROCESS_PRELOAD"
JOIN_WAIT = 2.0
"""Seconds in-process peers wait, in a restart after a death, for the replacement the
agent starts (it joins in that restart instead of causing another)."""
EXIT_FILE_ENV = "RELAUNCH_EXIT_FILE"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
INPROCESS_ROOT = "/relaunch/inprocess"
STACK_SIGNAL = signal.SIGRTMIN + 5
"""The signal that makes a runner write its Python stacks (relaunch.inprocess uses +4)."""
SNAPSHOT_DIR_ENV = "RELAUNCH_SNAPSHOT_DIR"
"""The node's snapshot directory (the agent sets it for its workers)."""


def snapshot_rank_dir(root: str, rank: int) -> str:
    """The folder of global rank ``rank``'s snapshots in the node's directory ``root``."""
    return os.path.join(root, f"rank-{rank:05d}")


def snapshot_to_prefetch(env: Mapping[str, str]) -> bool:
    """Whether a worker with environment ``env`` should have its rank's newest snapshot
    read back before its script runs: its rank has one in node memory and it is not an
    in-process replacement (which takes its state from its running peers)."""
    root, rank = env.get(SNAPSHOT_DIR_ENV), env.get("RANK", "")
    if not root or not rank.isdigit() or env.get(INCARNATION_ENV):
        return False
    try:
        names = os.listdir(snapshot_rank_dir(root, int(rank)))
    except OSError:
        return False
    return any(name.startswith("step-") for name in names)


@dataclass(frozen=True)
class AttemptFiles:
    """The files of one worker of one attempt, in its attempt directory."""

    error_file: str
    result_file: str
    marker: str
    exit_file: str
    progress_file: str
    stack_file: str

    @classmethod
    def in_dir(cls, attempt_dir: str) -> AttemptFiles:
        join = os.path.join
        return cls(
            error_file=join(attempt_dir, "error.json"),
            result_file=join(attempt_dir, "result.json"),
            marker=join(attempt_dir, "inprocess"),
            exit_file=join(attempt_dir, "exit.json"),
            progress_file=join(attempt_dir, "progress"),
            stack_file=join(attempt_dir, "stack.txt"),
        )

    def env(self, hang_timeout: float | None) -> dict[str, str]:
        """The variables that name these files (error file excepted: torchrun's own)."""
        env = {MARKER_ENV: self.marker, EXIT_FILE_ENV: self.exit_file}
        if hang_timeout:
            env.update(
                RELAUNCH_PROGRESS_FILE=self.progress_file,
                RELAUNCH_HANG_TIMEOUT=str(hang_timeout),
                RELAUNCH_STACK_FILE=self.stack_file,
                RELAUNCH_STACK_SIGNAL=str(int(STACK_SIGNAL)),
            )
        return env


def exit_record(code: int, now: float) -> dict[str, object]:
    """The exit file's JSON object: the script ended with ``code`` at ``now``."""
    return {"version": EXIT_FILE_VERSION, "exitcode": code, "time": now}


def error_record(message: str, callstack: str, now: float) -> dict[str, object]:
    """The error file's JSON object, in torch's layout (``@record`` writes the same)."""
    return {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(now)),
                "relaunch_time": now,
            },
        }
    }


def _attempt_prefix(run_id: str, restart_count: int | str) -> str:
    return f"{INPROCESS_ROOT}/{run_id}/{restart_count}"


def call_namespace(run_id: str, restart_count: int | str, call: int) -> str:
    """The workers' store prefix of one wrapped call of ``relaunch.inprocess``."""
    return f"{_attempt_prefix(run_id, restart_count)}/call{call}/"


def lost_key(run_id: str, restart_count: int | str) -> str:
    """The workers' store key of the ranks lost with their node (every call's)."""
    return f"{_attempt_prefix(run_id, restart_count)}/lost"


def lost_key_of(namespace: str) -> str | None:
    """:func:`lost_key` of the attempt a :func:`call_namespace` belongs to; None for
    a prefix that is not one."""
    head, sep, call = namespace.rstrip("/").rpartition("/call")
    return f"{head}/lost" if sep and call.isdigit() else None


@dataclass(frozen=True)
class ExitRecord:
    """How a runner announced that its script ended (``RELAUNCH_EXIT_FILE``)."""

    exitcode: int
    """The status the script ended with: 0 when it returned (or exited 0)."""
    time: float
    """Wall-clock time of the announcement: when the interpreter's teardown began."""

    @property
    def returned(self) -> bool:
        """The script returned (or exited 0): the worker succeeded, whatever follows."""
        return self.exitcode == 0


def read_exit_file(path: str) -> ExitRecord | None:
    """What a runner announced, or None (no file, or not a valid one: the process's
    real exit is awaited then)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # (nested too deep: RecursionError)
        return None
    if not isinstance(data, dict) or data.get("version") != EXIT_FILE_VERSION:
        return None
    code, when = data.get("exitcode"), data.get("time")
    if isinstance(code, bool) or not isinstance(code, int):
        return None
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        return None
    return ExitRecord(exitcode=code, time=float(when))


def read_marker(path: str) -> tuple[int | None, bool | None]:
    """(iteration, active) an in-process worker wrote in its marker, or (None, None) when
    it wrote none yet (or the file is not a valid marker)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None, None
    if not isinstance(data, dict) or data.get("version") != 1:
        return None, None
    iteration, active = data.get("iteration"), data.get("active")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        return None, None
    return iteration, active if isinstance(active, bool) else None


def read_module_list(path: str) -> list[str]:
    """The module names in a ``PRELOAD_ENV`` file (one per line; also the fork server's
    preload list), or [] when it cannot be read."""
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []
