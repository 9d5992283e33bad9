"""The worker's end of the watchdog: ``with expires(after=60): ...``."""

from __future__ import annotations

import errno
import math
import os
import signal as _signal
import stat
import sys
import time
from types import TracebackType

from relaunch.errors import ConfigError, TimerError
from relaunch.timer._request import TIMER_FILE_ENV, TimerRequest

__all__ = ["TimerClient", "expires"]

_SEND_ATTEMPTS = 50
_OPEN_ATTEMPTS = 10
_SEND_RETRY_SLEEP = 0.02


class TimerClient:
    """Sends acquire and release requests for this process to the timer server's pipe.

    Args:
        path: the server's named pipe (``TORCHELASTIC_TIMER_FILE``).
        signal: the default signal to be killed with on expiry (0: do not kill).

    Compatible with torch's ``FileTimerServer`` and ``FileTimerClient``: same lines.
    """

    def __init__(self, path: str, *, signal: int = _signal.SIGKILL) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"TimerClient: path must be a non-empty string, got {path!r}")
        self.path = path
        self.signal = _check_signal(signal)

    def acquire(self, scope_id: str, expiration_time: float, signal: int | None = None) -> None:
        """Ask to be killed if ``scope_id`` is not released by ``expiration_time``.

        Raises:
            TimerError: the pipe is missing, no server reads it, or it stays full.
        """
        signum = self.signal if signal is None else _check_signal(signal)
        self._send(
            TimerRequest(
                pid=os.getpid(), scope_id=scope_id, expiration_time=expiration_time, signal=signum
            )
        )

    def release(self, scope_id: str) -> None:
        """Release ``scope_id``. Raises TimerError like :meth:`acquire`."""
        self._send(TimerRequest(pid=os.getpid(), scope_id=scope_id, expiration_time=-1, signal=0))

    def _open(self) -> int:
        # A server that is just starting may not have opened its end yet (ENXIO): retry
        # briefly, as torch's client does.
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.ENXIO or attempt == _OPEN_ATTEMPTS - 1:
                    raise
                time.sleep(_SEND_RETRY_SLEEP)
        raise AssertionError("unreachable")  # pragma: no cover

    def _send(self, request: TimerRequest) -> None:
        try:
            line = request.encode()
        except ValueError as exc:
            raise TimerError(str(exc)) from exc
        try:
            fd = self._open()
        except FileNotFoundError as exc:
            raise TimerError(
                f"no timer pipe at {self.path}: the agent's watchdog is not running "
                f"(enable it with TORCHELASTIC_ENABLE_FILE_TIMER=1)"
            ) from exc
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise TimerError(f"no timer server is reading the pipe {self.path}") from exc
            raise TimerError(f"cannot open the timer pipe {self.path}: {exc}") from exc
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise TimerError(f"{self.path} is not a named pipe")
            for _ in range(_SEND_ATTEMPTS):
                try:
                    os.write(fd, line)  # <= PIPE_BUF: all or nothing
                    return
                except BlockingIOError:
                    time.sleep(_SEND_RETRY_SLEEP)
                except BrokenPipeError as exc:
                    raise TimerError(f"the timer server closed the pipe {self.path}") from exc
            raise TimerError(f"the timer pipe {self.path} stays full: is the server stuck?")
        finally:
            os.close(fd)


class _Expires:
    def __init__(self, client: TimerClient, scope: str, after: float, signum: int) -> None:
        self._client = client
        self._scope = scope
        self._after = after
        self._signal = signum

    def __enter__(self) -> None:
        self._client.acquire(self._scope, time.time() + self._after, self._signal)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._client.release(self._scope)
        except TimerError:
            if exc is None:
                raise
            # Do not hide the block's own exception behind a failed release.


def expires(after: float, scope: str | None = None, signal: int = _signal.SIGKILL) -> _Expires:
    """Context manager: ask the agent to kill this process if the block runs past ``after`` s.

    The timer server is found through ``TORCHELASTIC_TIMER_FILE``. ``scope`` names the
    block (default: the caller's ``file#line``, as torch does); ``signal`` is sent on expiry
    (0: report only, do not kill). The timer is released when the block exits.

    Raises:
        ConfigError: ``after`` is negative or not a number, or ``signal`` is not a signal.
        TimerError: ``TORCHELASTIC_TIMER_FILE`` is unset, the pipe is missing or no server
            reads it (on entry, or on exit if the block itself succeeded).
    """
    if (
        not isinstance(after, int | float)
        or isinstance(after, bool)
        or not math.isfinite(after)
        or after < 0
    ):
        raise ConfigError(f"expires: after must be a non-negative number of seconds, got {after!r}")
    signum = _check_signal(signal)
    path = os.environ.get(TIMER_FILE_ENV)
    if not path:
        raise TimerError(
            f"expires: {TIMER_FILE_ENV} is not set; run under an agent with "
            f"TORCHELASTIC_ENABLE_FILE_TIMER=1"
        )
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    return _Expires(TimerClient(path, signal=signum), scope, float(after), signum)


def _check_signal(signum: int) -> int:
    if isinstance(signum, bool) or not isinstance(signum, int) or not 0 <= signum < _signal.NSIG:
        raise ConfigError(
            f"signal must be 0 or a signal number below {_signal.NSIG}, got {signum!r}"
        )
    return int(signum)
