"""Lifelines (relaunch.rendezvous._lifeline): a watched node whose process dies is
reported at once; a wrong address, or a node that lives, never is. Real sockets and
a real process killed with SIGKILL. And the epoch watch that replaces polling."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from relaunch.rendezvous._epochs import EpochWatch
from relaunch.rendezvous._lifeline import Lifeline, Target, decode_address, encode_address
from relaunch.rendezvous._ops import remove_lost
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState
from relaunch.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(60)

_TARGET = textwrap.dedent(
    """
    import sys, time
    from relaunch.rendezvous._lifeline import Lifeline
    line = Lifeline("target", "127.0.0.1", lambda node: None)
    line.start()
    print(line.address[1], flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def watcher() -> Iterator[tuple[Lifeline, queue.Queue[str]]]:
    lost: queue.Queue[str] = queue.Queue()
    line = Lifeline("watcher", "127.0.0.1", lost.put)
    line.start()
    yield line, lost
    line.close()


def test_a_watched_process_killed_is_reported_lost(
    watcher: tuple[Lifeline, queue.Queue[str]],
) -> None:
    line, lost = watcher
    proc = subprocess.Popen([sys.executable, "-c", _TARGET], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        line.watch(Target("target", "127.0.0.1", port))
        with pytest.raises(queue.Empty):
            lost.get(timeout=0.5)  # it lives: nothing to report
        proc.kill()
        assert lost.get(timeout=10) == "target"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_live_target_and_a_wrong_address_are_never_reported(
    watcher: tuple[Lifeline, queue.Queue[str]],
) -> None:
    line, lost = watcher
    live = Lifeline("live", "127.0.0.1", lambda node: None)
    live.start()
    try:
        # a port where nothing listens refuses the first try: not proof of a loss
        line.watch(Target("nobody", "127.0.0.1", _closed_port()))
        with pytest.raises(queue.Empty):
            lost.get(timeout=0.5)
        # nor a name the resolver refuses (a label over 63 characters: UnicodeError,
        # which ended the lifeline's thread: no loss was reported from then on)
        line.watch(Target("odd", "a" * 70 + ".example", 1))
        with pytest.raises(queue.Empty):
            lost.get(timeout=0.5)
        line.watch(Target("live", *live.address))
        with pytest.raises(queue.Empty):
            lost.get(timeout=0.5)
    finally:
        live.close()
    # its lifeline closed (its leave written first, in the handler): reported, and
    # removing a node that already left the state is a no-op
    assert lost.get(timeout=10) == "live"


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_published_address_is_checked() -> None:
    assert decode_address(encode_address("10.0.0.1", 4242)) == ("10.0.0.1", 4242)
    for raw, what in [
        (b"\xff", "not JSON"),
        (b'{"v": 2, "host": "a", "port": 1}', "v=1"),
        (b'{"v": 1, "host": "", "port": 1}', "host"),
        (b'{"v": 1, "host": "a", "port": 70000}', "port"),
        (b'{"v": 1, "host": "a", "port": true}', "port"),
    ]:
        with pytest.raises(ValueError, match=what):
            decode_address(raw)


def test_a_lost_node_is_dropped_like_a_dead_one_and_only_if_still_there() -> None:
    settings = RendezvousSettings(run_id="r", min_nodes=2, max_nodes=3)
    state = RendezvousState(run_id="r")
    state.participants = {"a_1_0": 0, "b_1_0": 1, "c_1_0": 2}
    state.last_heartbeats = {n: 100.0 for n in state.participants}
    state.complete = True
    new, gone = remove_lost(state, {"b_1_0", "z_1_0"}, 100.5, settings)
    assert gone == ["b_1_0"]
    assert not new.complete and new.expected == {"a_1_0", "c_1_0"}  # reopened at once
    same, none = remove_lost(new, {"b_1_0"}, 100.6, settings)
    assert same is new and none == []


def test_the_epoch_watch_answers_without_reading_and_only_when_it_knows() -> None:
    store = MemoryStore()
    watch = EpochWatch(store, lambda n: f"epoch/{n}", "n", wait=0.3)
    try:
        # the first call starts the thread: None (the caller reads) unless the thread
        # read the store before this call looked (a loaded machine's scheduling)
        assert watch.changed_since(4) in (None, False)
        wait_until(lambda: watch.changed_since(4) is False)
        store.set("epoch/5", b"1")
        wait_until(lambda: watch.changed_since(4) is True)
        assert watch.changed_since(3) is True
        assert watch.changed_since(7) is None  # behind the caller's state: it reads
    finally:
        watch.close()


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
