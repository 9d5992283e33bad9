"""The worker watchdog with real worker processes, a real named pipe and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch.errors import TimerError
from relaunch.timer import TimerExpiry, TimerRequest, TimerServer, expires

TIMEOUT = 30
TORCH_TIMEOUT = 100  # importing torch on a loaded 2-core machine can take long


@pytest.fixture(autouse=True)
def no_timer_leftovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Private temp dirs go under this test's tmp_path (other engineers' tests run at the
    same time), and none is left behind; neither is any thread."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    threads = set(threading.enumerate())
    yield
    assert list(private.iterdir()) == []
    assert set(threading.enumerate()) <= threads


class Expiries:
    """Collects on_expiry calls and lets a test wait for them."""

    def __init__(self) -> None:
        self.items: list[TimerExpiry] = []
        self._cond = threading.Condition()

    def __call__(self, expiry: TimerExpiry) -> None:
        with self._cond:
            self.items.append(expiry)
            self._cond.notify_all()

    def wait_for(self, count: int) -> list[TimerExpiry]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.items) >= count, timeout=TIMEOUT)
            return list(self.items)


def _worker(path: str, body: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TORCHELASTIC_TIMER_FILE": path}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _stop(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=TIMEOUT)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _send(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _request(pid: int, scope: str, after: float, sig: int = signal.SIGKILL) -> bytes:
    import time

    when = time.time() + after
    return TimerRequest(pid=pid, scope_id=scope, expiration_time=when, signal=sig).encode()


HANGS = """
    import time
    from relaunch.timer import expires
    with expires(after=0.5, scope="hang"):
        print("holding", flush=True)
        time.sleep(60)
"""


def test_expired_worker_is_killed_and_reported() -> None:
    expiries = Expiries()
    with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
        proc = _worker(server.path, HANGS)
        try:
            server.watch_pids({proc.pid})
            assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
            (expiry,) = expiries.wait_for(1)
            assert (expiry.pid, expiry.scope_id, expiry.signal) == (proc.pid, "hang", 9)
            assert proc.stdout is not None and proc.stdout.read() == "holding\n"
        finally:
            _stop(proc)


def test_requested_signal_is_used() -> None:
    body = """
        import signal, time
        from relaunch.timer import expires
        with expires(after=0.2, scope="term", signal=signal.SIGTERM):
            time.sleep(60)
    """
    expiries = Expiries()
    with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
        proc = _worker(server.path, body)
        try:
            server.watch_pids({proc.pid})
            assert proc.wait(timeout=TIMEOUT) == -signal.SIGTERM
            assert expiries.wait_for(1)[0].signal == signal.SIGTERM
        finally:
            _stop(proc)


def test_released_scopes_do_not_fire() -> None:
    body = """
        import time
        from relaunch.timer import TimerClient, expires
        for i in range(3):
            with expires(after=1.0, scope="step"):
                pass
        with expires(after=1.0):
            pass
        # A sentinel that expires later, with signal 0 (report only): had a released scope
        # fired, it would have been reported (and this process killed) first.
        client = TimerClient(__import__("os").environ["TORCHELASTIC_TIMER_FILE"], signal=0)
        client.acquire("sentinel", time.time() + 1.5)
        time.sleep(3.0)
        print("survived", flush=True)
    """
    expiries = Expiries()
    with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
        proc = _worker(server.path, body)
        try:
            server.watch_pids({proc.pid})
            (expiry,) = expiries.wait_for(1)
            assert (expiry.pid, expiry.scope_id, expiry.signal) == (proc.pid, "sentinel", 0)
            assert proc.wait(timeout=TIMEOUT) == 0, proc.stderr
            assert len(expiries.items) == 1
        finally:
            _stop(proc)


def test_garbage_is_ignored_and_unwatched_pids_are_never_signalled() -> None:
    expiries = Expiries()
    stranger, victim = _sleeper(), _sleeper()
    try:
        with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
            server.watch_pids({victim.pid})
            _send(server.path, b"not json at all\n")
            _send(server.path, b'{"version": 1, "pid": 1}\n')
            _send(server.path, b'{"version": 1, "pid": -1, "scope_id": "s", "expiration')
            _send(server.path, b'_time": 0, "signal": 9}\n')
            _send(server.path, b"\x00\xff\n\n")
            _send(server.path, _request(stranger.pid, "stranger", 0.0))
            # A writer that died mid-line: the next whole request is still recovered.
            _send(server.path, b"partial garbage without newline ")
            _send(server.path, _request(victim.pid, "victim", 0.3))
            (expiry,) = expiries.wait_for(1)
            assert (expiry.pid, expiry.scope_id) == (victim.pid, "victim")
            assert victim.wait(timeout=TIMEOUT) == -signal.SIGKILL
        # The stranger's timer expired before the victim's and was dropped, not enforced.
        assert stranger.poll() is None
    finally:
        _stop(stranger)
        _stop(victim)


def test_clear_pid_forgets_timers() -> None:
    expiries = Expiries()
    cleared, victim = _sleeper(), _sleeper()
    try:
        with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
            server.watch_pids({cleared.pid, victim.pid})
            _send(server.path, _request(cleared.pid, "a", 1.0))
            server.clear_pid(cleared.pid)
            _send(server.path, _request(cleared.pid, "b", 1.0))  # no longer watched
            _send(server.path, _request(victim.pid, "c", 1.2))
            assert [e.pid for e in expiries.wait_for(1)] == [victim.pid]
        assert cleared.poll() is None
    finally:
        _stop(cleared)
        _stop(victim)


def test_torch_file_timer_client_against_our_server() -> None:
    body = """
        import time
        from torch.distributed.elastic.timer import FileTimerClient, configure, expires
        configure(FileTimerClient(__import__("os").environ["TORCHELASTIC_TIMER_FILE"]))
        with expires(after=0.3, scope="torch-scope"):
            time.sleep(60)
    """
    expiries = Expiries()
    with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
        proc = _worker(server.path, body)
        try:
            server.watch_pids({proc.pid})
            assert proc.wait(timeout=TORCH_TIMEOUT) == -signal.SIGKILL
            assert expiries.wait_for(1)[0].scope_id == "torch-scope"
        finally:
            _stop(proc)


def test_our_expires_against_torch_file_timer_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.timer import FileTimerRequest, FileTimerServer

    seen: list[tuple[str, FileTimerRequest | None]] = []
    done = threading.Event()

    def log_event(name: str, request: FileTimerRequest | None) -> None:
        seen.append((name, request))
        if name == "timer expired":
            done.set()

    path = str(tmp_path / "torch.pipe")
    server = FileTimerServer(path, run_id="t", max_interval=0.05, log_event=log_event)
    server.start()
    try:
        monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", path)
        with expires(after=0.0, scope="ours", signal=0):  # signal 0: report, do not kill
            assert done.wait(TIMEOUT)
    finally:
        server.stop()  # joins its thread for max_interval only: finish the join here
        for thread in threading.enumerate():
            if "_watchdog_loop" in thread.name:
                thread.join(TIMEOUT)
    request = next(r for name, r in seen if name == "timer expired")
    assert request is not None
    assert (request.worker_pid, request.scope_id, request.signal) == (os.getpid(), "ours", 0)


def test_close_removes_pipe_and_dir_and_is_idempotent(tmp_path: Path) -> None:
    server = TimerServer()
    server.start()
    path = server.path
    assert Path(path).is_fifo()
    server.close()
    server.close()
    assert not Path(path).exists() and not Path(path).parent.exists()
    with pytest.raises(TimerError):
        server.start()

    given = tmp_path / "given.pipe"
    os.mkfifo(given)  # a stale pipe from an earlier run is replaced
    with TimerServer(path=str(given)) as second:
        assert second.path == str(given) and given.is_fifo()
    assert not given.exists() and tmp_path.exists()


def test_close_with_a_client_holding_the_pipe_open() -> None:
    server = TimerServer()
    server.start()
    path = Path(server.path)
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, b'{"version": 1')  # a writer stuck mid-line
        server.close()  # returns: it waits neither for the line's end nor for the writer
        assert "relaunch-timer-server" not in {t.name for t in threading.enumerate()}
        assert not path.exists() and not path.parent.exists()
        with pytest.raises(BrokenPipeError):  # nobody reads the pipe any more
            os.write(fd, b"}\n")
    finally:
        os.close(fd)
    server.close()  # idempotent


def test_start_refuses_a_path_that_is_not_a_pipe(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("keep me")
    server = TimerServer(path=str(regular))
    with pytest.raises(TimerError, match="not a named pipe"):
        server.start()
    server.close()
    assert regular.read_text() == "keep me"
    with pytest.raises(TimerError):
        TimerServer(path=str(tmp_path / "no-dir" / "p")).start()


def test_expires_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    with pytest.raises(TimerError, match="TORCHELASTIC_TIMER_FILE is not set"):
        expires(after=1)
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(tmp_path / "absent"))
    with pytest.raises(TimerError, match="no timer pipe"), expires(after=1):
        pass
    lonely = tmp_path / "lonely.pipe"
    os.mkfifo(lonely)
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(lonely))
    with pytest.raises(TimerError, match="no timer server"), expires(after=1):
        pass
    regular = tmp_path / "regular"
    regular.write_text("")
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(regular))
    with pytest.raises(TimerError, match="not a named pipe"), expires(after=1):
        pass


def test_failed_release_does_not_hide_the_block_error(monkeypatch: pytest.MonkeyPatch) -> None:
    server = TimerServer()
    server.start()
    try:
        monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", server.path)
        with pytest.raises(KeyError), expires(after=30, signal=0):
            server.close()  # the server goes away inside the block
            raise KeyError("block")
        server2 = TimerServer()
        server2.start()
        monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", server2.path)
        with pytest.raises(TimerError), expires(after=30, signal=0):
            server2.close()
    finally:
        server.close()


def test_close_from_on_expiry_callback() -> None:
    victim = _sleeper()
    closed = threading.Event()
    holder: list[TimerServer] = []

    def on_expiry(expiry: TimerExpiry) -> None:
        holder[0].close()
        closed.set()

    server = TimerServer(max_interval=0.05, on_expiry=on_expiry)
    holder.append(server)
    server.start()
    path = server.path
    try:
        server.watch_pids({victim.pid})
        _send(path, _request(victim.pid, "v", 0.0))
        assert closed.wait(TIMEOUT)
        assert victim.wait(timeout=TIMEOUT) == -signal.SIGKILL
        for thread in threading.enumerate():
            if thread.name == "relaunch-timer-server":
                thread.join(TIMEOUT)
        assert not Path(path).exists()
    finally:
        server.close()
        _stop(victim)


def test_reused_pid_is_not_signalled() -> None:
    expiries = Expiries()
    reused, victim = _sleeper(), _sleeper()
    try:
        with TimerServer(max_interval=0.05, on_expiry=expiries) as server:
            server.watch_pids({reused.pid, victim.pid})
            # Simulate the worker dying and its pid going to another process: the process
            # start time noted by watch_pids no longer matches.
            server._tokens[reused.pid] = "another process"
            _send(server.path, _request(reused.pid, "old", 0.0))
            _send(server.path, _request(victim.pid, "new", 0.3))
            assert [e.pid for e in expiries.wait_for(1)] == [victim.pid]
        assert reused.poll() is None
    finally:
        _stop(reused)
        _stop(victim)
