"""Who runs the embedded store's etcd members: the pure decisions (no etcd here; the
real members are in tests/faults/test_embedded_store.py)."""

from __future__ import annotations

import logging

import pytest

from relaunch.rendezvous._seats import (
    JoinSteps,
    Member,
    asked_health,
    join_steps,
    parse_members,
    plan,
    quorum_gone,
)


def _m(name: str, *, learner: bool = False, started: bool = True) -> Member:
    return Member(
        id=str(abs(hash(name)) % 10**9),
        name=name if started else "",
        peer_urls=(f"http://{name}:2380",),
        client_urls=(f"http://{name}:2379",) if started else (),
        learner=learner,
    )


A, B, C = _m("a"), _m("b"), _m("c")


def test_a_node_joins_while_seats_are_free_and_no_one_is_joining() -> None:
    assert plan([A], None, 3, {}, 0.0, 3.0, 40.0).join
    assert plan([A, B], None, 3, {}, 0.0, 3.0, 40.0).join
    assert not plan([A, B, C], None, 3, {}, 0.0, 3.0, 40.0).join  # full
    assert not plan([A, B], "a", 3, {}, 0.0, 3.0, 40.0).join  # already a member
    starting = _m("d", learner=True, started=False)
    assert not plan([A, B, starting], None, 5, {starting.id: 0.0}, 0.0, 3.0, 40.0).join
    # a learner that runs, waiting for a pair, is what the next node joins beside
    assert plan([A, _m("d", learner=True)], None, 3, {}, 0.0, 3.0, 40.0).join


def test_the_voting_members_grow_in_pairs() -> None:
    waiting = _m("d", learner=True)
    # one voting member: the first node to join waits as a learner
    assert join_steps([A], 3) == JoinSteps(promote_first=None, voting=False)
    # the next one promotes it, joins, and is promoted: 1 -> 3, never a lasting 2
    assert join_steps([A, waiting], 3) == JoinSteps(promote_first=waiting.id, voting=True)
    # two voting members (one was lost): a new one is promoted at once
    assert join_steps([A, B], 3) == JoinSteps(promote_first=None, voting=True)
    assert join_steps([A, B, C], 5) == JoinSteps(promote_first=None, voting=False)
    assert join_steps([A, B, C, waiting], 5) == JoinSteps(waiting.id, voting=True)
    assert join_steps([A, B, C], 3) is None  # full
    assert join_steps([A, _m("e", learner=True, started=False)], 3) is None  # one starting


def test_the_steward_promotes_a_learner_only_to_an_odd_count() -> None:
    waiting = _m("d", learner=True)
    assert plan([A, waiting], "a", 3, {}, 0.0, 3.0, 40.0).promote is None  # 1 stays odd
    assert plan([A, B, waiting], "a", 5, {}, 0.0, 3.0, 40.0).promote == waiting.id
    assert plan([A, B, waiting], "b", 5, {}, 0.0, 3.0, 40.0).promote is None  # steward acts
    assert plan([A, B, waiting], "a", 5, {waiting.id: 0.0}, 0.0, 3.0, 40.0).promote is None
    # a voting member removed now leaves an even count: the learner takes its vote
    down = {C.id: 0.0}
    decided = plan([A, B, C, waiting], "a", 5, down, 5.0, 3.0, 40.0)
    assert decided.remove == (C.id,) and decided.promote == waiting.id


def test_a_learner_that_ran_and_went_down_is_removed_after_the_grace() -> None:
    waiting = _m("d", learner=True)
    down = {waiting.id: 0.0}
    assert plan([A, waiting], "a", 3, down, 3.0, 3.0, 40.0).remove == (waiting.id,)


def test_only_the_steward_removes_and_only_after_the_grace() -> None:
    down = {C.id: 10.0}
    assert plan([A, B, C], "a", 3, down, 12.0, 3.0, 40.0).remove == ()  # 2 s down
    assert plan([A, B, C], "a", 3, down, 13.0, 3.0, 40.0).remove == (C.id,)
    assert plan([A, B, C], "b", 3, down, 13.0, 3.0, 40.0).remove == ()  # not the steward
    # the removal frees a seat: a node that is not a member may take it at once
    assert plan([A, B, C], None, 3, down, 13.0, 3.0, 40.0).join is False  # not removed yet
    assert plan([A, B], None, 3, {}, 13.0, 3.0, 40.0).join


def test_a_member_whose_port_refuses_is_removed_without_the_grace() -> None:
    # nothing listens on its port: its process is gone, waiting only holds its seat
    down = {C.id: 10.0}
    assert plan([A, B, C], "a", 3, down, 10.0, 3.0, 40.0, {C.id}).remove == (C.id,)
    assert plan([A, B, C], "b", 3, down, 10.0, 3.0, 40.0, {C.id}).remove == ()  # steward acts
    # one added that never started keeps the join grace (its port refuses until it runs)
    starting = _m("d", started=False)
    down = {starting.id: 10.0}
    assert plan([A, B, starting], "a", 3, down, 10.0, 3.0, 40.0, {starting.id}).remove == ()


def test_a_steward_that_is_down_hands_over_to_the_next_name() -> None:
    down = {A.id: 0.0}
    assert plan([A, B, C], "b", 3, down, 5.0, 3.0, 40.0).remove == (A.id,)


def test_a_member_stuck_joining_is_removed_after_the_join_grace_only() -> None:
    stuck = _m("d", started=False)
    down = {stuck.id: 0.0}
    assert plan([A, B, stuck], "a", 3, down, 10.0, 3.0, 40.0).remove == ()
    assert plan([A, B, stuck], "a", 3, down, 41.0, 3.0, 40.0).remove == (stuck.id,)


def test_the_last_voting_member_is_never_removed() -> None:
    down = {A.id: 0.0, B.id: 0.0}
    # nobody healthy: no steward, nothing removed, nobody joins a cluster without quorum
    decided = plan([A, B], None, 3, down, 100.0, 3.0, 40.0)
    assert decided.remove == () and not decided.join


def test_a_member_list_reply_is_never_trusted(caplog: pytest.LogCaptureFixture) -> None:
    reply = {
        "members": [
            {
                "ID": "12",
                "name": "a",
                "peerURLs": ["http://a:2380"],
                "clientURLs": ["http://a:2379"],
            },
            {"ID": "13", "peerURLs": ["http://d:2380"], "isLearner": True},
            {"ID": "not a number"},
            "not a record",
            {"name": "no id"},
        ]
    }
    with caplog.at_level(logging.WARNING):
        members = parse_members(reply)
    assert [(m.id, m.name, m.started, m.joining) for m in members] == [
        ("12", "a", True, False),
        ("13", "", False, True),
    ]
    assert caplog.text.count("not a member") == 3
    assert parse_members({"members": "x"}) == [] and parse_members({}) == []


def test_the_clients_spread_over_the_voting_members() -> None:
    from relaunch.rendezvous._member_calls import client_endpoints

    learner, starting = _m("d", learner=True), _m("e", started=False)
    members = [A, B, C, learner, starting]
    hosts = lambda eps: [h for h, _ in eps]  # noqa: E731
    first = lambda name, ms=members, down=(): hosts(client_endpoints(ms, name, down))[0]  # noqa: E731
    assert hosts(client_endpoints(members)) == ["a", "b", "c", "d"]
    assert hosts(client_endpoints(members, spread="b")) == ["b", "a", "c", "d"]  # its own
    names = [f"node-{i}" for i in range(60)]
    assert {first(n) for n in names} == {"a", "b", "c"}  # each serves some, a learner none
    assert first("d") in {"a", "b", "c"}  # a node whose member is still a learner
    for name in names:  # a node's choice is its own; each list holds every member
        assert client_endpoints(members, name) == client_endpoints(members, name)
        assert sorted(hosts(client_endpoints(members, name))) == ["a", "b", "c", "d"]
        mine = next(m for m in (A, B, C) if m.name == first(name))
        assert first(name, down={mine.id}) != mine.name  # never a member seen down
    # a member removed moves its own clients only
    moved = [n for n in names if first(n) != "c" and first(n, [A, B]) != first(n)]
    assert moved == []


def test_a_client_moves_to_the_member_it_prefers_and_keeps_a_failover() -> None:
    pytest.importorskip("etcd3gw")
    from relaunch.store._etcd_http import EtcdEndpoints

    calls = EtcdEndpoints(
        [("a", 1), ("b", 2), ("c", 3)], protocol="http", ca_cert=None, cert=None, key=None,
        user=None, password=None, timeout=1.0,
    )  # fmt: skip
    try:
        assert calls.current()[1] == "a:1"
        calls.current()[2]()  # a failed over to b
        calls.use([("a", 1), ("b", 2), ("c", 3)])
        assert calls.current()[1] == "b:2"  # a refresh keeps the failover
        calls.use([("a", 1), ("b", 2), ("c", 3)], move=True)
        assert calls.current()[1] == "a:1"  # moved back to the first, the same list
        calls.current()[2]()
        calls.use([("c", 3), ("a", 1), ("b", 2)])
        assert calls.current()[1] == "b:2"  # the one in use stays while listed
        calls.use([("c", 3), ("a", 1), ("b", 2)], move=True)
        assert calls.current()[1] == "c:3"  # moved: the first one given
        stale_skip = calls.current()[2]
        calls.use([("a", 1), ("b", 2)], move=True)
        stale_skip()  # a failover on the endpoints before the move does not undo it
        assert calls.current()[1] == "a:1"
    finally:
        calls.close()


# -- the quorum lost for good ------------------------------------------------------------


def _gone(members: list[Member], seen: dict[Member, str], leaderless_for: float) -> bool:
    return quorum_gone(members, {m.id: h for m, h in seen.items()}, leaderless_for,
                       refused_after=1.0, silent_after=10.0, starting_after=30.0)  # fmt: skip


def test_the_quorum_is_gone_a_second_after_a_majority_s_ports_refuse() -> None:
    seen = {A: "refused", B: "refused", C: "unhealthy"}
    assert not _gone([A, B, C], seen, 0.5)  # one look: a second one confirms
    assert _gone([A, B, C], seen, 1.0)


def test_an_election_after_one_member_s_loss_is_no_lost_quorum() -> None:
    # one of three refuses, the two left elect a leader: neither healthy meanwhile
    seen = {A: "refused", B: "unhealthy", C: "unhealthy"}
    assert not _gone([A, B, C], seen, 5.0)
    assert _gone([A, B, C], seen, 10.0)  # no leader for that long: two that cannot meet


def test_silent_members_are_taken_for_lost_only_after_the_longer_delay() -> None:
    seen = {A: "unhealthy", B: "unhealthy", C: "unhealthy"}  # a cable pulled: no refusal
    assert not _gone([A, B, C], seen, 9.9)
    assert _gone([A, B, C], seen, 10.0)


def test_one_healthy_member_means_the_quorum_holds() -> None:
    seen = {A: "refused", B: "refused", C: "healthy"}  # (C's view may be stale: it holds)
    assert not _gone([A, B, C], seen, 60.0)


def test_learners_have_no_vote_in_the_count() -> None:
    d, e = _m("d", learner=True), _m("e", learner=True)
    seen = {A: "refused", B: "unhealthy", C: "unhealthy", d: "refused", e: "refused"}
    assert not _gone([A, B, C, d, e], seen, 5.0)  # one voter of three refuses
    assert not _gone([d, e], {d: "refused", e: "refused"}, 60.0)  # no voter: nothing to judge


def test_five_voters_keep_their_quorum_with_two_lost() -> None:
    D, E = _m("d"), _m("e")
    two = {A: "refused", B: "refused", C: "unhealthy", D: "unhealthy", E: "unhealthy"}
    assert not _gone([A, B, C, D, E], two, 5.0)
    three = {**two, C: "refused"}
    assert _gone([A, B, C, D, E], three, 1.0)


def test_a_voting_member_that_starts_may_bring_the_quorum_back() -> None:
    # two running, the third added and starting (a voter at once): one of the two lost
    starting = _m("d", started=False)
    seen = {A: "refused", B: "unhealthy", starting: "unhealthy"}
    assert not _gone([A, B, starting], seen, 29.0)  # it may run in time
    assert _gone([A, B, starting], seen, 30.0)
    # both running ones gone: the third alone is no majority, whenever it runs
    assert _gone([A, B, starting], {**seen, B: "refused"}, 1.0)


def test_at_idle_the_steward_checks_the_others_and_they_the_steward() -> None:
    settled = [C, A, B]
    assert asked_health(settled, "a", {}, 3, True) == {B.id, C.id}  # a: the steward
    assert asked_health(settled, "b", {}, 3, True) == {A.id}
    assert asked_health(settled, "c", {}, 3, True) == {A.id}
    assert asked_health(settled, None, {}, 3, True) == set()  # no member: no checks
    everyone = {A.id, B.id, C.id}
    # something amiss: every member checks every member (the quorum's judgement, the
    # steward's replacements, a new steward's first look)
    assert asked_health(settled, "b", {}, 3, False) == everyone  # the calls fail
    assert asked_health(settled, "b", {C.id: 0.0}, 3, True) == everyone  # one is down
    assert asked_health([A, B], "b", {}, 3, True) == {A.id, B.id}  # a seat is free
    learner = _m("d", learner=True)
    assert asked_health([A, B, C, learner], "c", {}, 3, True) == {A.id}
    assert asked_health([A, B, C, learner], "a", {}, 3, True) == {B.id, C.id, learner.id}
    assert asked_health([_m("x", started=False)], "b", {}, 1, True) == {_m("x", started=False).id}
