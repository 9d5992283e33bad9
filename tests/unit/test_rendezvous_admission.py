"""With a job secret, a node's snapshot server admits a node of the job that joined
after this node's round: :class:`JobAddresses` reads the state again (at most once a
second: a call within the second waits for it) for an address the round did not name.
Pure logic: a backend that returns the states given, an injected clock and sleep."""

from __future__ import annotations

import pytest

from relaunch.errors import RendezvousStateError
from relaunch.rendezvous._admission import REREAD_AFTER, JobAddresses
from relaunch.rendezvous._state import RendezvousState


class Backend:
    def __init__(self) -> None:
        self.state = RendezvousState(run_id="job")
        self.loads = 0
        self.broken = False

    def load(self) -> tuple[RendezvousState, bytes | None]:
        self.loads += 1
        if self.broken:
            raise RendezvousStateError("the record at key 'state' is not signed: refused")
        return self.state, b"{}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_round_s_nodes_are_admitted_without_a_read() -> None:
    backend, clock = Backend(), Clock()
    admits = JobAddresses(backend, frozenset({"10.0.0.1"}), clock, clock.sleep)  # type: ignore[arg-type]
    clock.now += 5
    assert admits("10.0.0.1")
    assert backend.loads == 0


def test_a_node_that_joined_after_the_round_is_admitted_once_the_state_names_it() -> None:
    backend, clock = Backend(), Clock()
    admits = JobAddresses(backend, frozenset({"10.0.0.1"}), clock, clock.sleep)  # type: ignore[arg-type]
    clock.now += REREAD_AFTER
    assert not admits("10.0.0.7")  # not in the state yet
    assert backend.loads == 1 and clock.slept == []  # read at once
    backend.state.participants = {"10.0.0.7_40_0": 0, "node-b.example_41_0": 1}
    backend.state.redundancy_list = {"10.0.0.9_42_0"}
    clock.now += 0.25  # it joined just after that read, and connects
    assert admits("10.0.0.7")  # read again once the second has passed: not refused
    assert clock.slept == [REREAD_AFTER - 0.25]
    assert admits("10.0.0.9")  # a spare: known from the same read
    assert backend.loads == 2
    assert not admits("10.0.0.66")  # a stranger as that read began: its answer stands
    assert backend.loads == 2
    clock.now += 0.01
    assert not admits("10.0.0.67")  # a stranger after it: a read, a second after that one
    assert backend.loads == 3
    assert clock.slept == [REREAD_AFTER - 0.25, pytest.approx(REREAD_AFTER - 0.01)]


def test_a_state_that_cannot_be_read_admits_no_one_new() -> None:
    backend, clock = Backend(), Clock()
    backend.state.participants = {"10.0.0.7_40_0": 0}
    backend.broken = True
    admits = JobAddresses(backend, frozenset({"10.0.0.1"}), clock, clock.sleep)  # type: ignore[arg-type]
    clock.now += REREAD_AFTER
    assert not admits("10.0.0.7")
    assert admits("10.0.0.1")
