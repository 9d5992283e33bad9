"""Mechanics of in-process restart in one process: store barriers, wake-up, watchdog, sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from relaunch.inprocess._core import _sockets
from relaunch.inprocess._core._coord import CoordinationStore
from relaunch.inprocess.attribution import Interruption, InterruptionRecord
from relaunch.inprocess.exception import BarrierTimeoutError, RankShouldRestart
from relaunch.inprocess.monitor_thread import MainThreadControl
from relaunch.inprocess.progress_watchdog import MainThreadProgress, SharedProgress, idle_since


@pytest.fixture
def server() -> Iterator[Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store
    del store


def _client(server: Any, ns: str = "/t/") -> CoordinationStore:
    import torch.distributed as dist

    return CoordinationStore(dist.TCPStore("127.0.0.1", server.port, is_master=False), ns)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name="test-rank")
    thread.start()
    return thread, out


@pytest.mark.timeout(30)
def test_iteration_barrier_completes_or_restarts_on_a_dead_member(server: Any) -> None:
    a, b = _client(server), _client(server)
    thread, out = _in_thread(lambda: b.iteration_barrier(0, 1, {0, 1}, 10, 0.005))
    assert a.iteration_barrier(0, 0, {0, 1}, 10, 0.005) is True
    thread.join(10)
    assert out == [True]
    a.record_dead(1, 1, Interruption.TERMINATED)
    assert a.iteration_barrier(1, 0, {0, 1}, 10, 0.005) is False
    with pytest.raises(BarrierTimeoutError, match=r"\[2\]"):
        a.iteration_barrier(2, 0, {0, 2}, 0.05, 0.005)


@pytest.mark.timeout(30)
def test_termination_barrier_counts_the_dead_and_freezes_the_set(server: Any) -> None:
    a, b = _client(server), _client(server)
    a.record_dead(0, 2, Interruption.HARD_TIMEOUT)
    thread, out = _in_thread(lambda: b.termination_barrier(0, 1, {0, 1, 2}, 10, 0.005, 0))
    first = a.termination_barrier(0, 0, {0, 1, 2}, 10, 0.005, 0)
    thread.join(10)
    a.record_dead(0, 1, Interruption.UNRESPONSIVE)  # too late for iteration 0
    assert first == out[0] == {2}
    assert a.freeze("it0/terminated", {1, 2}) == {2}


@pytest.mark.timeout(30)
def test_completion_is_decided_once(server: Any) -> None:
    a, b = _client(server), _client(server)
    record = InterruptionRecord(initial_rank=1, interruption=Interruption.EXCEPTION)
    a.record_interrupted(0, record)
    assert a.completion(0, 0, {0, 1}, 10, 0.005) is False
    # rank 1 completes afterwards: the outcome is already "restart"
    assert b.completion(0, 1, {0, 1}, 10, 0.005) is False
    thread, out = _in_thread(lambda: b.completion(1, None, {0}, None, 0.005))  # a spare
    assert a.completion(1, 0, {0}, 10, 0.005) is True
    thread.join(10)
    assert out == [True]


@pytest.mark.timeout(30)
def test_restart_exception_wakes_a_sleeping_main_thread() -> None:
    control = MainThreadControl(threading.RLock())
    control.install()
    try:
        control.enter()

        def fire() -> None:
            time.sleep(0.2)
            with control.lock:
                control.interrupt()

        thread = threading.Thread(target=fire, name="test-interrupter")
        thread.start()
        with pytest.raises(RankShouldRestart):
            time.sleep(60)
        control.leave()
        thread.join(10)
        assert control.interrupt() is False  # outside the function: nothing is raised
        time.sleep(0.01)
    finally:
        control.uninstall()


class CountedProgress(SharedProgress):
    """SharedProgress that counts the automatic timestamps written into it."""

    writes = 0

    @SharedProgress.auto_ts.setter
    def auto_ts(self, value: float) -> None:
        self.writes += 1
        SharedProgress.auto_ts.fset(self, value)


@pytest.mark.timeout(30)
def test_watchdog_timestamps_only_while_python_runs() -> None:
    # (how fresh the timestamp is, and how stale it gets: bench/progress_watchdog.py)
    shared = CountedProgress()
    watchdog = MainThreadProgress(shared, 0.02)
    watchdog.start()
    try:
        first = shared.writes
        while shared.writes < first + 3:  # Python runs: the timestamps land, again and again
            pass
        before = shared.writes
        time.sleep(1.0)  # 50 intervals with the GIL released and no bytecode run
        # None lands while no bytecode runs: at most the one whose probe ran just before
        # the sleep, one more that ran between reading ``before`` and the sleep, and the
        # one queued during the sleep, which runs as soon as the main thread wakes.
        assert shared.writes - before <= 3
        woke = shared.writes
        while shared.writes < woke + 2:  # and they land again once Python runs
            pass
        assert shared.ping_ts == 0.0
        watchdog.ping()
        assert shared.progress() <= shared.ping_ts
    finally:
        watchdog.shutdown()
        shared.close()


@pytest.mark.timeout(30)
def test_shutdown_new_connections_releases_a_blocked_reader() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    old = socket.create_connection(listener.getsockname())
    old_peer, _ = listener.accept()
    _sockets.mark_baseline()
    new = socket.create_connection(listener.getsockname())
    new_peer, _ = listener.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(new.recv(10)), name="test-reader")
    reader.start()
    try:
        # the listener and the connections opened before the baseline are spared
        assert _sockets.shutdown_new_connections() == 2  # new and new_peer
        reader.join(10)
        assert got == [b""]
        old.sendall(b"x")
        assert old_peer.recv(1) == b"x"
        # only the read side at first (a gloo send posted meanwhile must not fail:
        # see _sockets); a connection still open at the next call loses both sides
        new.sendall(b"y")
        assert _sockets.shutdown_new_connections() == 2
        with pytest.raises(OSError):
            new.sendall(b"z")
    finally:
        _sockets.clear_baseline()
        for s in (listener, old, old_peer, new, new_peer):
            s.close()


@pytest.mark.timeout(30)
def test_a_shut_down_connection_stays_open_until_released() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    _sockets.mark_baseline()
    ours = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    try:
        assert _sockets.shutdown_new_connections() == 2
        ours.close()  # as gloo does at the end-of-file
        # held open: the peer's sends still land (closed, the second would meet the
        # reset; gloo fails a send refused so only after the group's timeout: _sockets)
        for _ in range(3):
            peer.sendall(b"x")
            time.sleep(0.01)
        _sockets.release_held()
        with pytest.raises(OSError):
            for _ in range(100):
                peer.sendall(b"y")
                time.sleep(0.01)
    finally:
        _sockets.clear_baseline()
        for s in (listener, ours, peer):
            s.close()


@pytest.mark.timeout(30)
def test_a_lost_nodes_ranks_are_dead_until_their_replacements_are_admitted(server: Any) -> None:
    from relaunch._contract import lost_key
    from relaunch.inprocess._core._rejoin import fresh_ranks
    from relaunch.inprocess.state import State

    coord = _client(server, "/relaunch/inprocess/job/0/call0/")
    assert coord.lost_key == lost_key("job", 0)  # where the agents write
    survivor_view = _client(server, "/relaunch/inprocess/job/0/call0/")
    # the agents of the surviving nodes: ranks 2 and 3 are dead, nobody took them over
    lost = (
        InterruptionRecord(
            initial_rank=2, interruption=Interruption.UNRESPONSIVE, incarnation=999
        ).encode()
        + InterruptionRecord(
            initial_rank=3, interruption=Interruption.UNRESPONSIVE, incarnation=999
        ).encode()
    )
    coord.store.append(coord.lost_key, lost)
    assert survivor_view.dead_ranks() == {2, 3}
    assert survivor_view.unreplaced_lost() == {2, 3}  # no restart waits for them
    # the node that takes them over says so before its workers ask to join
    coord.store.append(
        coord.lost_key,
        InterruptionRecord(
            initial_rank=2, interruption=Interruption.TERMINATED, incarnation=999
        ).encode(),
    )
    assert survivor_view.unreplaced_lost() == {3}
    # admitted at incarnation 1000: alive again, and new until it has its state
    survivor_view.incarnations[2] = 1000
    assert survivor_view.dead_ranks() == {3}
    roster = {
        r: State(rank=r, world_size=4, initial_rank=r, initial_world_size=4) for r in (0, 1, 2)
    }
    assert fresh_ranks(survivor_view, roster) == {2}
    coord.mark_stated(2, 1000)
    assert fresh_ranks(survivor_view, roster) == set()


def test_the_idle_time_comes_from_the_older_timestamp_and_refuses_impossible_ones() -> None:
    assert idle_since(105.0, 0.0, created=100.0, now=110.0) == 5.0  # no ping yet
    assert idle_since(105.0, 108.0, created=100.0, now=110.0) == 5.0  # the older one counts
    assert idle_since(109.0, 102.0, created=100.0, now=110.0) == 8.0
    # a time the record cannot hold is a bad read, not a hang of 110 s
    assert idle_since(0.0, 0.0, created=100.0, now=110.0) is None
    assert idle_since(105.0, 1e-310, created=100.0, now=110.0) is None
    assert idle_since(200.0, 0.0, created=100.0, now=110.0) is None
    shared = SharedProgress()
    try:
        idle = shared.idle(time.monotonic())
        assert idle is not None and idle >= 0.0
        shared.auto_ts = 0.0
        assert shared.idle(time.monotonic()) is None
    finally:
        shared.close()
