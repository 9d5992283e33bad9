"""Who is alive, judged by each node's own clock: hosts whose clocks differ.

A heartbeat's value is its writer's wall-clock time; a reader judges it by when the
value last changed, on its own clock, so that no skew makes a live node dead, nor a
lost node alive for longer. The clocks are injected; the store is the in-memory one
(pure logic: the real-process version is in ``test_rendezvous_c10d.py``).
"""

from __future__ import annotations

import pytest

from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._liveness import Liveness
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.store.memory import MemoryStore

# every 0.5 s; dead after 2 s
SETTINGS = RendezvousSettings(
    run_id="job", min_nodes=1, max_nodes=2, keep_alive_interval=0.5, keep_alive_max_attempt=4
)


class Hosts:
    """Two hosts, ``a`` and ``b``, whose clocks are ``skew`` seconds apart (b - a)."""

    def __init__(self, skew: float) -> None:
        self.store = MemoryStore()
        self.now = 1_000_000.0
        self.a = Liveness(self.store, "p/", SETTINGS, lambda: self.now)
        self.b = Liveness(self.store, "p/", SETTINGS, lambda: self.now + skew)

    def step(self, seconds: float = 0.5) -> None:
        self.now += seconds


@pytest.fixture(params=[-3600.0, -10.0, 10.0, 3600.0], ids=lambda s: f"b{s:+g}s")
def hosts(request: pytest.FixtureRequest) -> Hosts:
    return Hosts(request.param)


def test_a_node_that_beats_is_alive_whatever_its_clock(hosts: Hosts) -> None:
    # (b behind: dead at its every beat before; ahead: fine before too)
    for _ in range(20):
        hosts.b.beat("b")
        assert hosts.a.alive(["b"]) == {"b"}
        hosts.step()


def test_a_node_that_stops_is_dead_after_the_delay_whatever_its_clock(hosts: Hosts) -> None:
    # (b an hour ahead: alive for an hour after its last beat before)
    for _ in range(4):
        hosts.b.beat("b")
        assert hosts.a.alive(["b"]) == {"b"}
        hosts.step()
    # (a's looks are 0.5 s apart: b's last beat came after a's look before it)
    hosts.step(0.9)  # 1.4 s after its last beat, a looks: alive
    assert hosts.a.alive(["b"]) == {"b"}
    hosts.step(1.2)  # 2.6 s after it
    assert hosts.a.alive(["b"]) == set()


def test_a_first_look_at_a_node_long_gone_finds_it_dead_within_the_delay() -> None:
    # a node that takes over the steward's role has read no heartbeat yet: a node
    # that stopped long ago is dead at its second look, one delay less two beats later
    # (a live node, whatever its clock, beats again before then)
    hosts = Hosts(0.0)
    hosts.b.beat("b")
    hosts.step(60)
    assert hosts.a.alive(["b"]) == {"b"}
    hosts.step(0.9)
    assert hosts.a.alive(["b"]) == {"b"}
    hosts.step(0.2)
    assert hosts.a.alive(["b"]) == set()


def test_a_leaving_node_is_alive_until_its_deadline_whatever_its_clock(hosts: Hosts) -> None:
    # b leaves: it stops beating and says it is alive for 30 s more (its leave's close
    # timeout), a span, not a time on its clock (a time 10 s behind was dead at once)
    hosts.b.beat("b")
    assert hosts.a.alive(["b"]) == {"b"}
    left = hosts.now
    hosts.b.leaving("b", until=hosts.b._clock() + 30)
    while hosts.a.alive(["b"]) == {"b"}:  # a looks every 0.5 s
        hosts.step()
    assert 30 <= hosts.now - left <= 30.5


def test_the_steward_keeps_its_role_while_it_says_so_whatever_its_clock(hosts: Hosts) -> None:
    # b holds the role (its key holds its clock's time): a never takes it from a b that
    # says so again (b 10 s behind: a took it at its first look before), and takes it
    # once b stopped for the delay (b an hour ahead: not for an hour before)
    watch_a, watch_b = CorruptWatch("job", 2.0), CorruptWatch("job", 2.0)
    assert hosts.b.steward("b", watch_b)
    for _ in range(12):
        hosts.step()
        assert not hosts.a.steward("a", watch_a)
        assert hosts.b.steward("b", watch_b)
    stopped = hosts.now
    while not hosts.a.steward("a", watch_a):
        hosts.step()
        assert hosts.now - stopped <= 3.0
    assert hosts.now - stopped >= 2.0
    assert not hosts.b.steward("b", watch_b)


def test_a_value_that_is_not_a_heartbeat_is_dead() -> None:
    hosts = Hosts(0.0)
    for junk in (b"", b"12x", b"+5", b"5+", b"5+x", b"1" * 17, "٣".encode()):
        hosts.store.set("p/hb/b", junk)
        assert hosts.a.alive(["b"]) == set()


def test_a_state_written_by_a_host_an_hour_ahead_is_not_corrupt() -> None:
    # a join applied by a node whose clock is an hour ahead dates its heartbeat in the
    # state by that clock: the other nodes decode the state (they called it corrupt,
    # and the job ended, from 5 minutes ahead); a time no clock reads is still refused
    from relaunch.errors import RendezvousStateError
    from relaunch.rendezvous._backend import StateBackend
    from relaunch.rendezvous._state import RendezvousState, encode_state

    store, now = MemoryStore(), 1_700_000_000.0
    backend = StateBackend(store, SETTINGS, clock=lambda: now)
    ahead = RendezvousState(run_id="job", participants={"a": -1}, last_heartbeats={"a": now + 3600})
    store.set(backend.state_key, encode_state(ahead))
    assert backend.load()[0].last_heartbeats == {"a": now + 3600}
    never = RendezvousState(run_id="job", participants={"a": -1}, last_heartbeats={"a": 2e11})
    store.set(backend.state_key, encode_state(never))
    with pytest.raises(RendezvousStateError, match="last_heartbeats_ms"):
        backend.load()


class SteppingReader:
    """Host ``a`` reads, and its wall clock steps by ``step`` seconds mid-run (a
    correction); its ticks (monotonic) do not. Host ``b`` beats on a steady clock."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.now, self.wall_step = 1_000_000.0, 0.0
        self.a = Liveness(
            self.store, "p/", SETTINGS, lambda: self.now + self.wall_step, lambda: self.now
        )
        self.b = Liveness(self.store, "p/", SETTINGS, lambda: self.now)


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_step_of_the_reader_s_wall_clock_changes_no_one_s_liveness(step: float) -> None:
    # the reader's clock steps just after a node's last beat (by the wall clock: back
    # an hour, the lost node stayed alive the hour; ahead an hour, dead at once)
    hosts = SteppingReader()
    for _ in range(4):
        hosts.b.beat("b")
        assert hosts.a.alive(["b"]) == {"b"}
        hosts.now += 0.5
    stopped = hosts.now - 0.5
    hosts.wall_step = step
    while hosts.a.alive(["b"]) == {"b"}:
        hosts.now += 0.5
        assert hosts.now - stopped <= 3.0
    assert hosts.now - stopped >= 2.0


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_step_of_the_steward_s_wall_clock_keeps_its_role(step: float) -> None:
    hosts = SteppingReader()
    watch_a, watch_b = CorruptWatch("job", 2.0), CorruptWatch("job", 2.0)
    assert hosts.a.steward("a", watch_a)
    for i in range(12):  # (back an hour by the wall clock: b took the role)
        if i == 4:
            hosts.wall_step = step
        hosts.now += 0.5
        assert hosts.a.steward("a", watch_a)
        assert not hosts.b.steward("b", watch_b)


def test_a_leaving_node_s_span_counts_for_a_close_timeout_at_most() -> None:
    # a span no leave takes (a corrupt or hostile value) does not keep a node alive
    hosts = Hosts(0.0)
    hosts.b.beat("b")
    assert hosts.a.alive(["b"]) == {"b"}
    left = hosts.now
    hosts.b.leaving("b", until=hosts.now + 10 * SETTINGS.close_timeout)
    while hosts.a.alive(["b"]) == {"b"}:
        hosts.step(5.0)
    assert hosts.now - left <= SETTINGS.close_timeout + 5.0
