"""Error files: the JSON a failed worker leaves for its agent.

The layout is torch's (``torch.distributed.elastic.multiprocessing.errors``), so that
files written by torch's ``@record`` are read here and files written here are read by
torch::

    {"message": {"message": "ValueError: bad input",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

torch also accepts a newer layout where ``message`` is a plain string and ``timestamp`` sits
at the top level; :func:`read_error_file` accepts both. relaunch adds one key torch ignores,
``extraInfo.relaunch_time`` (float seconds), to order failures within the same second.

:func:`read_error_file` never raises: it returns an :class:`ErrorRecord` or an
:class:`ErrorFileProblem` describing what is wrong with the file.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import stat
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

from relaunch._contract import ERROR_FILE_ENV, error_record

__all__ = [
    "ERROR_FILE_ENV",
    "LATEST",
    "NOT_AVAILABLE",
    "ErrorFileProblem",
    "ErrorRecord",
    "ProblemKind",
    "build_error_data",
    "read_error_file",
    "write_error_file",
]

logger = logging.getLogger(__name__)

#: Placeholder torch uses for a missing value (e.g. no error file).
NOT_AVAILABLE = "<N/A>"
#: Error files larger than this are not read (a sane bound on agent memory).
MAX_ERROR_FILE_BYTES = 32 * 1024 * 1024


class ProblemKind(enum.Enum):
    """What is wrong with an error file."""

    MISSING = "missing"
    UNREADABLE = "unreadable"
    EMPTY = "empty"
    TOO_LARGE = "too large"
    TRUNCATED = "truncated"
    NOT_JSON = "not JSON"
    WRONG_SHAPE = "not in the error file layout"


@dataclass(frozen=True, kw_only=True)
class ErrorFileProblem:
    """An error file that could not be used.

    Attributes:
        path: the file.
        kind: what is wrong.
        detail: a short human-readable explanation (decoder message, missing key...).
    """

    path: str
    kind: ProblemKind
    detail: str

    def describe(self) -> str:
        """One line: ``error file <path> is <kind>: <detail>``."""
        return f"error file {self.path} is {self.kind.value}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class ErrorRecord:
    """A parsed error file.

    Attributes:
        data: the whole JSON object as read (copied unchanged when propagating).
        message: the error message, e.g. ``"ValueError: bad input"``.
        traceback: the Python traceback (``py_callstack``), if present.
        timestamp: seconds since the epoch when the error was recorded, if present.
        time: the precise time (float seconds) if a relaunch writer recorded it.
        error_code: ``errorCode`` if a parent process overrode it (torch does so).
    """

    data: dict[str, Any]
    message: str
    traceback: str | None
    timestamp: int | None
    time: float | None
    error_code: int | None


def build_error_data(exc: BaseException, *, now: float | None = None) -> dict[str, Any]:
    """Return the error-file JSON object (torch layout) for ``exc`` and its traceback."""
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return error_data(f"{type(exc).__name__}: {exc}", callstack, now=now)


def error_data(message: str, callstack: str, *, now: float | None = None) -> dict[str, Any]:
    """The error-file JSON object (torch layout) for a message and a call stack."""
    return error_record(message, callstack, time.time() if now is None else now)


def write_error_file(path: str, content: dict[str, Any] | bytes) -> None:
    """Write ``content`` (a JSON object, or raw bytes copied unchanged) to ``path`` atomically.

    The file is written beside ``path`` and renamed over it, so a reader sees either the
    old file or the whole new one. Raises ``OSError`` if the file cannot be written.
    """
    payload = content if isinstance(content, bytes) else json.dumps(content).encode()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".error-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fp:
            fp.write(payload)
            fp.flush()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_error_file(path: str) -> ErrorRecord | ErrorFileProblem:
    """Read and validate the error file at ``path``. Never raises."""
    try:
        # O_NONBLOCK: a named pipe at the path must not hang the agent.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fp:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("not a regular file")
            raw = fp.read(MAX_ERROR_FILE_BYTES + 1)
    except FileNotFoundError:
        return ErrorFileProblem(path=path, kind=ProblemKind.MISSING, detail="no such file")
    except (OSError, ValueError) as exc:
        return ErrorFileProblem(path=path, kind=ProblemKind.UNREADABLE, detail=str(exc))
    if len(raw) > MAX_ERROR_FILE_BYTES:
        detail = f"larger than {MAX_ERROR_FILE_BYTES} bytes"
        return ErrorFileProblem(path=path, kind=ProblemKind.TOO_LARGE, detail=detail)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ErrorFileProblem(path=path, kind=ProblemKind.NOT_JSON, detail=f"not UTF-8: {exc}")
    stripped = text.strip()
    if not stripped:
        return ErrorFileProblem(path=path, kind=ProblemKind.EMPTY, detail=f"{len(raw)} bytes")
    try:
        data = json.loads(stripped)
    except (ValueError, RecursionError) as exc:  # (ValueError: an int of 4,300+ digits)
        kind = ProblemKind.NOT_JSON
        extra = isinstance(exc, json.JSONDecodeError) and exc.msg == "Extra data"
        if stripped.startswith("{") and not stripped.endswith("}") and not extra:
            kind = ProblemKind.TRUNCATED
        return ErrorFileProblem(path=path, kind=kind, detail=f"{exc} ({len(raw)} bytes)")
    try:
        return _parse(data)
    except ValueError as exc:
        return ErrorFileProblem(path=path, kind=ProblemKind.WRONG_SHAPE, detail=str(exc))


def _parse(data: Any) -> ErrorRecord:
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if "message" not in data:
        raise ValueError('no "message" key')
    message = data["message"]
    error_code: int | None = None
    if isinstance(message, str):
        return ErrorRecord(
            data=data,
            message=message,
            traceback=None,
            timestamp=_timestamp(data.get("timestamp")),
            time=None,
            error_code=None,
        )
    if not isinstance(message, dict):
        raise ValueError(f'"message" must be a string or an object, got {type(message).__name__}')
    text = message.get("message")
    if not isinstance(text, str):
        raise ValueError('"message.message" must be a string')
    extra = message.get("extraInfo", {})
    if not isinstance(extra, dict):
        raise ValueError('"message.extraInfo" must be an object')
    callstack = extra.get("py_callstack")
    if callstack is not None and not isinstance(callstack, str):
        raise ValueError('"message.extraInfo.py_callstack" must be a string')
    precise: Any = extra.get("relaunch_time")
    if not (_is_number(precise) and 0 <= precise <= LATEST):
        precise = None
    if "errorCode" in message:
        code = message["errorCode"]
        if not isinstance(code, int) or isinstance(code, bool):
            raise ValueError('"message.errorCode" must be an integer')
        error_code = code
    return ErrorRecord(
        data=data,
        message=text,
        traceback=callstack,
        timestamp=_timestamp(extra.get("timestamp")),
        time=float(precise) if precise is not None else None,
        error_code=error_code,
    )


LATEST = 1e11
"""The latest time an error file's times may say, in seconds (the year 5138): a time
past it (milliseconds, a huge number) is left out of the record."""


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _timestamp(value: Any) -> int | None:
    """Seconds since 1970, or None where the value is none or past :data:`LATEST` (a
    time in milliseconds: its date, out of range, failed the failure's report)."""
    if value is None:
        return None
    seconds: float | None = None
    if _is_number(value):
        seconds = value
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            seconds = int(value.strip())
    if seconds is None:
        raise ValueError(f"timestamp must be an integer or a string of digits, got {value!r}")
    return int(seconds) if 0 <= seconds <= LATEST else None
