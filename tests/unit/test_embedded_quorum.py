"""The embedded store's quorum verdict (:mod:`relaunch.rendezvous._quorum`), its clock
injected; the members' addresses are ports nobody listens on (a refused connection:
their processes are gone). The real members: tests/faults/test_embedded_store.py."""

from __future__ import annotations

from relaunch._endpoint import quiet_port
from relaunch.rendezvous._quorum import QuorumWatch, quorum_lost_line
from relaunch.rendezvous._seats import Member


def _gone_member(name: str) -> Member:
    port = quiet_port("127.0.0.1")  # (free: nothing listens there)
    return Member(id=name, name=f"{name}-host", peer_urls=(f"http://127.0.0.1:{port}",),
                  client_urls=(f"http://127.0.0.1:{port}",))  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_verdict_comes_at_the_second_look_and_names_the_members() -> None:
    members = [_gone_member(n) for n in "abc"]
    refused = {m.id: "refused" for m in members}
    clock = Clock()
    watch = QuorumWatch(silent_after=10.0, starting_after=30.0, clock=clock)
    assert watch.look(members, refused) is None  # one look
    clock.now += 0.5
    line = watch.look(members, refused)
    assert line is not None
    assert line.startswith("the embedded rendezvous store lost its quorum"), line
    assert all(f"{n}-host" in line for n in "abc"), line
    assert "0 of 3 voting members run, a quorum needs 2" in line, line
    assert "or this node can reach none of its members" in line, line  # (maybe cut off)


def test_a_healthy_look_between_starts_the_count_again() -> None:
    members = [_gone_member(n) for n in "abc"]
    refused = {m.id: "refused" for m in members}
    clock = Clock()
    watch = QuorumWatch(silent_after=10.0, starting_after=30.0, clock=clock)
    assert watch.look(members, refused) is None
    clock.now += 0.4
    assert watch.look(members, {**refused, "c": "healthy"}) is None
    clock.now += 0.4
    assert watch.look(members, refused) is None  # counted from here again
    watch.clear()  # a call served through the leader
    clock.now += 5.0
    assert watch.look(members, refused) is None


def test_the_line_counts_a_member_up_as_running() -> None:
    members = [_gone_member(n) for n in "abc"]
    line = quorum_lost_line(members, {"a": "refused", "b": "refused", "c": "healthy"})
    assert "members a-host, b-host unreachable; 1 of 3 voting members run" in line, line
    assert "reach none" not in line, line
