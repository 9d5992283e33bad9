"""TimerServer: the agent's end of the worker watchdog, serving a named pipe."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

from relaunch.errors import ConfigError, TimerError
from relaunch.procs._sys import start_token
from relaunch.timer._request import TimerRequest, parse_request
from relaunch.timer._table import Expired, TimerExpiry, TimerTable

__all__ = ["TimerServer"]

logger = logging.getLogger(__name__)

#: A line longer than this without a newline is discarded (requests fit in PIPE_BUF).
_MAX_LINE = 64 * 1024
_READ_CHUNK = 64 * 1024


class TimerServer:
    """Serve timer requests from workers on a named pipe and kill workers whose timers expire.

    Args:
        path: the named pipe to create (an existing pipe there is replaced). If None, the
            pipe is created in a private temporary directory removed by :meth:`close`.
        max_interval: the longest time, in seconds, between two expiry checks (> 0).
        on_expiry: called in the server thread with a :class:`TimerExpiry` for each expiry of
            a watched pid, after the signal was sent. Exceptions it raises are logged.

    Only pids registered with :meth:`watch_pids` are ever signalled: a request naming any
    other pid is dropped on expiry, with a log line. Lines that are not valid requests are
    ignored with a log line.

    Raises:
        ConfigError: ``max_interval`` is not a positive number.
    """

    def __init__(
        self,
        *,
        path: str | None = None,
        max_interval: float = 0.1,
        on_expiry: Callable[[TimerExpiry], None] | None = None,
    ) -> None:
        if (
            not isinstance(max_interval, int | float)
            or isinstance(max_interval, bool)
            or not math.isfinite(max_interval)
            or max_interval <= 0
        ):
            raise ConfigError(
                f"TimerServer: max_interval must be a positive number of seconds, "
                f"got {max_interval!r}"
            )
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError(f"TimerServer: path must be a non-empty string, got {path!r}")
        self._requested_path = path
        self._path: str | None = path
        self._max_interval = float(max_interval)
        self._on_expiry = on_expiry
        self._table = TimerTable()
        self._lock = threading.Lock()
        self._fd_lock = threading.Lock()
        self._tokens: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tmpdir: str | None = None
        self._fds: list[int] = []
        self._wake_w: int | None = None
        self._created_pipe = False
        self._started = False
        self._closed = False
        self._release_on_exit = False

    @property
    def path(self) -> str:
        """The named pipe's path (``TORCHELASTIC_TIMER_FILE`` for the workers).

        Raises:
            TimerError: no path was given and the server is not started.
        """
        if self._path is None:
            raise TimerError("TimerServer.path: the server is not started")
        return self._path

    def start(self) -> None:
        """Create the pipe and start serving in a thread.

        Raises:
            TimerError: started twice, closed, or the pipe cannot be created.
        """
        if self._closed:
            raise TimerError("TimerServer.start: the server is closed")
        if self._started:
            raise TimerError("TimerServer.start: the server is already started")
        self._started = True
        try:
            self._make_pipe()
            reader = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            self._fds.append(reader)
            # Our own writer keeps the pipe from ever reading EOF when clients come and go.
            self._fds.append(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            wake_r, wake_w = os.pipe()
            self._fds += [wake_r, wake_w]
            self._wake_w = wake_w
            os.set_blocking(wake_r, False)
            os.set_blocking(wake_w, False)
        except OSError as exc:
            self._release_resources()
            raise TimerError(f"TimerServer: cannot create the timer pipe: {exc}") from exc
        self._thread = threading.Thread(
            target=self._serve, args=(reader, wake_r), name="relaunch-timer-server", daemon=True
        )
        self._thread.start()
        logger.info("timer server listening on %s", self.path)

    def watch_pids(self, pids: Iterable[int]) -> None:
        """Allow these worker pids to be signalled when their timers expire.

        Each process's start time is noted (Linux ``/proc``), so that a pid reused by an
        unrelated process after the worker died is never signalled.
        """
        pids = list(pids)
        tokens = {pid: start_token(pid) for pid in pids}
        with self._lock:
            self._table.watch(pids)
            self._tokens.update(tokens)

    def clear_pid(self, pid: int) -> None:
        """Forget a worker that exited: drop its timers and never signal this pid again.

        Call it for every worker pid when it exits or its group is stopped.
        """
        with self._lock:
            self._table.clear_pid(pid)
            self._tokens.pop(pid, None)

    def close(self) -> None:
        """Stop the thread, remove the pipe and its temporary directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        if self._thread is threading.current_thread():
            # Called from on_expiry: the loop sees the stop flag and releases on its way out.
            self._release_on_exit = True
            return
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 10 * self._max_interval))
            if self._thread.is_alive():
                logger.error("timer server thread did not stop; leaving it (daemon)")
                return
        self._release_resources()

    def __enter__(self) -> TimerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _make_pipe(self) -> None:
        if self._requested_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="relaunch-timer-")
            self._path = os.path.join(self._tmpdir, "timer.pipe")
        path = self.path
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISFIFO(mode):
                raise OSError(errno.EEXIST, "exists and is not a named pipe", path)
            os.unlink(path)
        os.mkfifo(path, 0o600)
        self._created_pipe = True

    def _release_resources(self) -> None:
        with self._fd_lock:
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds = []
            self._wake_w = None
        if self._created_pipe and self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._created_pipe = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _wake(self) -> None:
        # Under the lock: a closed descriptor number may be reused by an unrelated file.
        with self._fd_lock:
            if self._wake_w is not None:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")

    def _serve(self, reader: int, wake_r: int) -> None:
        try:
            self._serve_loop(reader, wake_r)
        except Exception:
            logger.exception("timer server thread failed; worker timers are no longer enforced")
        finally:
            if self._release_on_exit:
                self._release_resources()

    def _serve_loop(self, reader: int, wake_r: int) -> None:
        poller = select.poll()
        poller.register(reader, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        pending = b""
        while not self._stop.is_set():
            with self._lock:
                deadline = self._table.next_deadline()
            timeout = self._max_interval
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.time()))
            try:
                events = poller.poll(math.ceil(timeout * 1000))
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                events = []
            for fd, _ in events:
                if fd == wake_r:
                    _drain(wake_r)
                else:
                    pending = self._consume(pending + _drain(reader))
            self._check_expiry()

    def _consume(self, data: bytes) -> bytes:
        *lines, rest = data.split(b"\n")
        for line in lines:
            self._handle_line(line)
        if len(rest) > _MAX_LINE:
            logger.warning("timer pipe: dropping %s bytes with no newline", len(rest))
            return b""
        return rest

    def _handle_line(self, line: bytes) -> None:
        if not line.strip():
            return
        request = _parse_line(line)
        if request is None:
            return
        with self._lock:
            self._table.apply(request)

    def _check_expiry(self) -> None:
        with self._lock:
            decisions = self._table.expire(time.time())
        for decision in decisions:
            if self._stop.is_set():
                return
            self._act(decision)

    def _act(self, decision: Expired) -> None:
        expiry = decision.expiry
        if not decision.watched:
            logger.warning(
                "timer of pid %s (scopes %s) expired, but the agent does not watch this pid: "
                "ignored",
                expiry.pid,
                list(decision.scopes),
            )
            return
        with self._lock:
            token = self._tokens.get(expiry.pid)
        if token is not None and start_token(expiry.pid) != token:
            logger.warning(
                "timer of pid %s expired, but that process is gone (pid reused?): ignored",
                expiry.pid,
            )
            return
        if expiry.signal > 0:
            logger.warning(
                "timer expired: killing worker pid %s with signal %s (scopes %s)",
                expiry.pid,
                expiry.signal,
                list(decision.scopes),
            )
            try:
                os.kill(expiry.pid, expiry.signal)
            except ProcessLookupError:
                logger.info("worker pid %s already exited", expiry.pid)
            except OSError as exc:
                logger.error("could not signal worker pid %s: %s", expiry.pid, exc)
        else:
            logger.warning(
                "timer expired for worker pid %s (scopes %s); no signal requested",
                expiry.pid,
                list(decision.scopes),
            )
        if self._on_expiry is not None:
            try:
                self._on_expiry(expiry)
            except Exception:
                logger.exception("timer server: on_expiry callback failed")


def _parse_line(line: bytes) -> TimerRequest | None:
    """Parse a request line; recover a whole request after garbage left by a dead writer."""
    try:
        return parse_request(line)
    except ValueError as exc:
        error = exc
    start = line.rfind(b"{")
    if start > 0:
        try:
            request = parse_request(line[start:])
        except ValueError:
            pass
        else:
            logger.warning("timer pipe: ignoring %r before a request", line[:start][:200])
            return request
    logger.warning("timer pipe: ignoring bad request %r: %s", line[:200], error)
    return None


def _drain(fd: int, limit: int = 16 * _READ_CHUNK) -> bytes:
    chunks = []
    total = 0
    while total < limit:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
