"""Timer requests: one JSON line per acquire or release, torch's ``FileTimerRequest`` layout.

::

    {"version": 1, "pid": 1234, "scope_id": "train.py#42", "expiration_time": 1700000000.5,
     "signal": 9}

A negative ``expiration_time`` releases the scope. ``signal`` 0 means "do not kill".
"""

from __future__ import annotations

import json
import math
import select
import signal as _signal
from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = [
    "PIPE_BUF",
    "TIMER_FILE_ENV",
    "TIMER_REQUEST_VERSION",
    "TimerRequest",
    "parse_request",
]

#: The environment variable naming the timer server's named pipe.
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: The only request version understood (torch's ``FileTimerRequest.version``).
TIMER_REQUEST_VERSION = 1
#: Writes up to this many bytes to a pipe are atomic.
PIPE_BUF: int = getattr(select, "PIPE_BUF", 512)


@dataclass(frozen=True, kw_only=True)
class TimerRequest:
    """One acquire (``expiration_time >= 0``) or release (``< 0``) of a scope by a process.

    Attributes:
        pid: the process to signal on expiry (the requester).
        scope_id: names the timed block; the key is ``(pid, scope_id)``.
        expiration_time: the deadline, ``time.time()`` seconds; negative to release.
        signal: the signal to send on expiry; 0 does not kill.
    """

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def is_release(self) -> bool:
        """True if this request releases its scope."""
        return self.expiration_time < 0

    def encode(self) -> bytes:
        """The request as one newline-terminated JSON line (raises ValueError past PIPE_BUF)."""
        line = (
            json.dumps(
                {
                    "version": TIMER_REQUEST_VERSION,
                    "pid": self.pid,
                    "scope_id": self.scope_id,
                    "expiration_time": self.expiration_time,
                    "signal": self.signal,
                }
            )
            + "\n"
        ).encode()
        if len(line) > PIPE_BUF:
            raise ValueError(
                f"timer request is {len(line)} bytes, more than PIPE_BUF ({PIPE_BUF}); "
                f"use a shorter scope (got {len(self.scope_id)} characters)"
            )
        return line


def parse_request(line: bytes | str) -> TimerRequest:
    """Parse one request line strictly.

    Raises:
        ValueError: the line is not a version-1 request with valid fields.
    """
    try:
        data: Any = json.loads(line)
    except RecursionError:
        raise ValueError("a JSON document nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("version") != TIMER_REQUEST_VERSION:
        raise ValueError(f"unsupported version {data.get('version')!r}")
    pid = data.get("pid")
    if not _is_int(pid) or pid <= 0:
        raise ValueError(f"pid must be a positive integer, got {pid!r}")
    scope_id = data.get("scope_id")
    if not isinstance(scope_id, str):
        raise ValueError(f"scope_id must be a string, got {scope_id!r}")
    expiration = data.get("expiration_time")
    if _is_int(expiration):
        try:
            expiration = float(expiration)
        except OverflowError:
            expiration = math.inf if expiration > 0 else -1.0
    if not isinstance(expiration, float) or math.isnan(expiration):
        raise ValueError(f"expiration_time must be a number, got {expiration!r}")
    signum = data.get("signal")
    if not _is_int(signum) or signum >= _signal.NSIG:
        raise ValueError(f"signal must be an integer below {_signal.NSIG}, got {signum!r}")
    # torch: "a negative or zero signal will not kill the process".
    signum = max(signum, 0)
    return TimerRequest(pid=pid, scope_id=scope_id, expiration_time=expiration, signal=signum)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
