"""Timer requests (torch's wire format) and the pure timer table, with explicit times."""

from __future__ import annotations

import json
import signal

import pytest

from relaunch.errors import ConfigError, TimerError
from relaunch.timer import TimerRequest, TimerServer, expires, parse_request
from relaunch.timer._request import PIPE_BUF
from relaunch.timer._table import TimerTable


def _req(pid: int, scope: str, when: float, sig: int = 9) -> TimerRequest:
    return TimerRequest(pid=pid, scope_id=scope, expiration_time=when, signal=sig)


def test_encode_matches_torch_layout_and_parses_back() -> None:
    request = _req(12, "train.py#3", 100.5)
    line = request.encode()
    assert line.endswith(b"\n")
    assert json.loads(line) == {
        "version": 1,
        "pid": 12,
        "scope_id": "train.py#3",
        "expiration_time": 100.5,
        "signal": 9,
    }
    assert parse_request(line) == request
    assert parse_request(
        b'{"version":1,"pid":3,"scope_id":"s","expiration_time":-1,"signal":0}'
    ) == (_req(3, "s", -1.0, 0))


def test_encode_refuses_lines_past_pipe_buf() -> None:
    with pytest.raises(ValueError, match="PIPE_BUF"):
        _req(1, "x" * PIPE_BUF, 1.0).encode()


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"garbage",
        b"[1]",
        b'{"version": 2, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 9}',
        b'{"version": 1, "pid": 0, "scope_id": "s", "expiration_time": 1, "signal": 9}',
        b'{"version": 1, "pid": -1, "scope_id": "s", "expiration_time": 1, "signal": 9}',
        b'{"version": 1, "pid": true, "scope_id": "s", "expiration_time": 1, "signal": 9}',
        b'{"version": 1, "pid": 1, "scope_id": 5, "expiration_time": 1, "signal": 9}',
        b'{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": "1", "signal": 9}',
        b'{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": NaN, "signal": 9}',
        b'{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 999}',
        b'{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 1}',
    ],
)
def test_parse_rejects_bad_lines(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_request(line)


def test_negative_signal_means_no_kill() -> None:
    line = b'{"version": 1, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": -3}'
    assert parse_request(line).signal == 0


def test_table_acquire_release_and_expiry() -> None:
    table = TimerTable()
    table.watch({10, 11})
    table.apply(_req(10, "a", 5.0))
    table.apply(_req(10, "b", 3.0, sig=0))
    table.apply(_req(10, "c", 50.0))
    table.apply(_req(11, "a", 4.0))
    table.apply(_req(11, "a", -1, sig=0))  # released
    table.apply(_req(99, "x", 1.0))  # not watched
    assert table.next_deadline() == 1.0
    assert table.expire(0.5) == []
    decisions = table.expire(6.0)
    assert [(d.expiry.pid, d.watched) for d in decisions] == [(10, True), (99, False)]
    first = decisions[0]
    # The first expired scope with a signal is reported; all of pid 10's timers are dropped.
    assert (first.expiry.scope_id, first.expiry.signal, first.expiry.expired_at) == ("a", 9, 5.0)
    assert first.scopes == ("b", "a")
    assert len(table) == 0 and table.next_deadline() is None


def test_table_expiry_without_signal_and_rearm() -> None:
    table = TimerTable()
    table.watch([5])
    table.apply(_req(5, "s", 10.0))
    table.apply(_req(5, "s", 20.0))  # re-armed: the later deadline wins
    assert table.expire(15.0) == []
    table.apply(_req(5, "s", 1.0, sig=0))
    (decision,) = table.expire(2.0)
    assert decision.expiry.signal == 0


def test_table_clear_pid() -> None:
    table = TimerTable()
    table.watch([1, 2])
    table.apply(_req(1, "a", 1.0))
    table.apply(_req(2, "a", 1.0))
    table.clear_pid(1)
    assert not table.is_watched(1) and table.is_watched(2)
    assert [d.expiry.pid for d in table.expire(5.0)] == [2]


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "1", True])
def test_server_validates_max_interval(value: object) -> None:
    with pytest.raises(ConfigError, match="max_interval"):
        TimerServer(max_interval=value)  # type: ignore[arg-type]


def test_server_path_before_start() -> None:
    with pytest.raises(TimerError):
        _ = TimerServer().path
    assert TimerServer(path="/tmp/x.pipe").path == "/tmp/x.pipe"


def test_expires_validates_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", "/nonexistent/pipe")
    with pytest.raises(ConfigError, match="after"):
        expires(after=-1)
    with pytest.raises(ConfigError, match="signal"):
        expires(after=1, signal=signal.NSIG)
