"""ProcessFailure: what the agent knows about one failed worker process."""

from __future__ import annotations

import logging
import signal
import socket
import time
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, cast

from relaunch.errors._exceptions import WorkerError
from relaunch.errors._file import (
    LATEST,
    NOT_AVAILABLE,
    ErrorFileProblem,
    ProblemKind,
    read_error_file,
)

__all__ = ["FailureFormatError", "ProcessFailure"]

logger = logging.getLogger(__name__)

#: Version of the JSON produced by :meth:`ProcessFailure.to_json`.
FAILURE_JSON_VERSION = 1
_EMPTY_ERROR_DATA: dict[str, Any] = {"message": "<NONE>"}


class FailureFormatError(WorkerError, ValueError):
    """A failure record received from another process is malformed or of an unknown version."""


def signal_name(signum: int) -> str:
    """Return ``"SIGKILL"`` for 9, or ``"<N/A>"`` for a number that is not a signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return NOT_AVAILABLE


@dataclass(frozen=True)
class ProcessFailure:
    """A failed worker process, described from its exit code and its error file.

    Construct it with ``ProcessFailure(local_rank, pid, exitcode, error_file)`` after the
    process has exited: the error file is read then (and never again). A negative
    ``exitcode`` means the process was killed by signal ``-exitcode``.

    Attributes:
        local_rank, pid, exitcode: as given.
        error_file: the error file path, or ``"<N/A>"`` if the process wrote none.
        error_file_data: the error file's JSON object (``{"message": "<NONE>"}`` if none).
        message: a one-line description: the exception (``"ValueError: bad"``), the signal
            (``"Signal 9 (SIGKILL) received by PID 1234"``), or what is wrong with a corrupt
            error file, always with the exit code in that case.
        traceback: the worker's traceback, if its error file had one.
        timestamp: int seconds since the epoch: from the error file, else when observed.
        time: the same, as precisely as known (float seconds), to order failures.
        hostname: the host the process ran on (``socket.gethostname()``, no DNS).
        problem: what is wrong with the error file, if it exists but cannot be used.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = field(init=False, compare=False)
    message: str = field(init=False)
    traceback: str | None = field(init=False)
    timestamp: int = field(init=False)
    time: float = field(init=False, compare=False)
    hostname: str = field(init=False)
    problem: str | None = field(init=False)

    def __post_init__(self) -> None:
        now = time.time()
        result = read_error_file(self.error_file) if self.error_file != NOT_AVAILABLE else None
        values: dict[str, Any] = {
            "error_file_data": dict(_EMPTY_ERROR_DATA),
            "traceback": None,
            "timestamp": int(now),
            "time": now,
            "hostname": socket.gethostname(),
            "problem": None,
        }
        if result is None or (
            isinstance(result, ErrorFileProblem) and result.kind is ProblemKind.MISSING
        ):
            values["error_file"] = NOT_AVAILABLE
            values["message"] = self._exit_message(with_hint=True)
        elif isinstance(result, ErrorFileProblem):
            logger.warning(
                "local_rank %s (pid %s): %s", self.local_rank, self.pid, result.describe()
            )
            values["problem"] = result.describe()
            values["message"] = f"{result.describe()}; {self._exit_message(with_hint=False)}"
        else:
            values["error_file_data"] = result.data
            values["message"] = result.message or self._exit_message(with_hint=False)
            values["traceback"] = result.traceback
            if result.timestamp is not None:
                values["timestamp"] = result.timestamp
                values["time"] = (
                    result.time
                    if result.time is not None and int(result.time) == result.timestamp
                    else float(result.timestamp)
                )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _exit_message(self, *, with_hint: bool) -> str:
        if self.exitcode < 0:
            return f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
        text = f"Process {self.pid} exited with exit code {self.exitcode}"
        if with_hint:
            text += " and wrote no error file (decorate its entrypoint with @record)"
        return text

    def signal_name(self) -> str:
        """The name of the signal that killed the process (``"SIGKILL"``), else ``"<N/A>"``."""
        return signal_name(-self.exitcode) if self.exitcode < 0 else NOT_AVAILABLE

    @property
    def timecode(self) -> str:
        """The timestamp as local time, ``YYYY-MM-DD_HH:MM:SS`` (torch's display format)."""
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    def timestamp_isoformat(self) -> str:
        """Alias of :attr:`timecode`, torch's name."""
        return self.timecode

    def to_json(self) -> dict[str, Any]:
        """A versioned, JSON-serializable dict, for :meth:`from_json` in another process."""
        out: dict[str, Any] = {"version": FAILURE_JSON_VERSION}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_json(cls, data: Any) -> ProcessFailure:
        """Rebuild a failure from :meth:`to_json` output without touching any file.

        Raises:
            FailureFormatError: ``data`` is not a failure record of a known version.
        """
        if not isinstance(data, dict):
            raise FailureFormatError(f"failure record must be an object, got {type(data).__name__}")
        if data.get("version") != FAILURE_JSON_VERSION:
            raise FailureFormatError(
                f"failure record version must be {FAILURE_JSON_VERSION}, "
                f"got {data.get('version')!r}"
            )
        checks: dict[str, tuple[type, ...]] = {
            "local_rank": (int,),
            "pid": (int,),
            "exitcode": (int,),
            "error_file": (str,),
            "error_file_data": (dict,),
            "message": (str,),
            "traceback": (str, type(None)),
            "timestamp": (int,),
            "time": (int, float),
            "hostname": (str,),
            "problem": (str, type(None)),
        }
        obj = cls.__new__(cls)
        for name, types in checks.items():
            if name not in data:
                raise FailureFormatError(f"failure record has no {name!r}")
            value: Any = data[name]
            if isinstance(value, bool) or not isinstance(value, types):
                expected = " or ".join(t.__name__ for t in types)
                raise FailureFormatError(
                    f"failure record field {name!r} must be {expected}, got {value!r:.80}"
                )
            if name in ("timestamp", "time") and not 0 <= cast(float, value) <= LATEST:
                raise FailureFormatError(
                    f"failure record field {name!r} must be seconds since 1970 (at most "
                    f"{LATEST:.0e}), got {value!r:.80}"
                )
            if name == "time":
                value = float(cast(float, value))
            object.__setattr__(obj, name, value)
        return obj
