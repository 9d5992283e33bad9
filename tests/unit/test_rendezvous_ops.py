"""The pure rendezvous state machine, driven with an injected clock (no sleeps)."""

from __future__ import annotations

import math

import pytest

from relaunch.errors import ConfigError, RendezvousStateError
from relaunch.rendezvous._ops import (
    Action,
    apply,
    decide_close,
    decide_depart,
    decide_exit,
    decide_join,
    decide_leave,
    needs_wake,
    nodes_waiting,
    perform_requests,
    place,
    record_failure,
    remove_dead,
    went_on,
)
from relaunch.rendezvous._settings import (
    BEATS_PER_SECOND,
    RendezvousSettings,
    check_conf_keys,
    settings_from_conf,
)
from relaunch.rendezvous._state import (
    RendezvousState,
    decode_state,
    encode_state,
    new_node_id,
    node_sort_key,
)

T0 = 1_000_000.0
FAR = math.inf


def _beat(state: RendezvousState, node: str, when: float) -> RendezvousState:
    """A copy of ``state`` whose heartbeat time of ``node`` is ``when``."""
    new = state.copy()
    new.last_heartbeats[node] = when
    return new


def settings(lo: int = 2, hi: int = 3, **kw: float) -> RendezvousSettings:
    return RendezvousSettings(run_id="job", min_nodes=lo, max_nodes=hi, **kw)  # type: ignore[arg-type]


def joined(nodes: list[str], s: RendezvousSettings, now: float = T0) -> RendezvousState:
    state = RendezvousState(run_id="job")
    for node in nodes:
        state = place(state, node, now, s)
    return state


def test_first_node_joins_participants() -> None:
    s = settings()
    state = RendezvousState(run_id="job")
    assert decide_join(state, "a_1_0", T0, s, FAR) is Action.ADD_TO_PARTICIPANTS
    state = apply(Action.ADD_TO_PARTICIPANTS, state, "a_1_0", T0, s)
    assert state.participants == {"a_1_0": 0}
    assert state.deadline is None
    assert decide_join(state, "a_1_0", T0, s, FAR) is Action.SYNC


def test_last_call_starts_at_min_and_completes_when_it_expires() -> None:
    s = settings(last_call_timeout=30.0)
    state = joined(["a_1_0", "b_1_0"], s)
    assert state.deadline == T0 + 30.0
    assert not state.complete
    assert decide_join(state, "a_1_0", T0 + 29.0, s, FAR) is Action.SYNC
    assert decide_join(state, "a_1_0", T0 + 30.0, s, FAR) is Action.MARK_COMPLETE
    state = apply(Action.MARK_COMPLETE, state, "a_1_0", T0 + 30.0, s)
    assert state.complete and state.deadline is None
    assert state.participants == {"a_1_0": 0, "b_1_0": 1}
    assert decide_join(state, "b_1_0", T0 + 30.0, s, FAR) is Action.FINISH


def test_max_nodes_completes_at_once_with_sorted_ranks() -> None:
    s = settings(2, 3)
    state = joined(["c_1_0", "a_9_0", "a_10_0"], s)
    assert state.complete
    # pid compared as a number: a_9 before a_10.
    assert state.participants == {"a_9_0": 0, "a_10_0": 1, "c_1_0": 2}


def test_late_node_goes_to_wait_list_then_spare_when_full() -> None:
    s = settings(1, 2)
    state = joined(["a_1_0"], s)
    state = apply(Action.MARK_COMPLETE, state, "a_1_0", T0, s)
    assert decide_join(state, "b_1_0", T0, s, FAR) is Action.ADD_TO_WAIT_LIST
    state = place(state, "b_1_0", T0, s)
    assert state.wait_list == {"b_1_0"}
    assert nodes_waiting(state, my_round=0) == 1
    full = joined(["a_1_0", "b_1_0"], s)
    assert full.complete
    assert decide_join(full, "c_1_0", T0, s, FAR) is Action.ADD_TO_REDUNDANCY_LIST
    full = place(full, "c_1_0", T0, s)
    assert full.redundancy_list == {"c_1_0"}
    assert nodes_waiting(full, my_round=0) == 0
    assert decide_join(full, "c_1_0", T0, s, FAR) is Action.SYNC


def test_restart_reopens_round_and_completes_without_last_call() -> None:
    s = settings(1, 4, last_call_timeout=30.0)
    state = joined(["a_1_0", "b_1_0"], s)
    state = apply(Action.MARK_COMPLETE, state, "a_1_0", T0, s)
    assert decide_exit(state, "a_1_0", T0, FAR) is Action.REMOVE_FROM_PARTICIPANTS
    state = apply(Action.REMOVE_FROM_PARTICIPANTS, state, "a_1_0", T0, s)
    assert state.round == 1 and not state.complete
    assert state.expected == {"a_1_0", "b_1_0"}
    assert nodes_waiting(state, my_round=0) >= 1  # b must restart too
    state = place(state, "a_1_0", T0 + 1, s)
    assert not state.complete  # waiting for b, not for a 30 s last call
    state = place(state, "b_1_0", T0 + 1, s)
    assert state.complete and state.round == 1


def test_dead_participant_reopens_round_for_survivors_and_spare() -> None:
    s = settings(2, 2, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    assert state.complete and state.redundancy_list == {"c_1_0"}
    state = _beat(state, "a_1_0", T0 + 2.5)
    state = _beat(state, "c_1_0", T0 + 2.5)
    same, dead = remove_dead(state, T0 + 2.0, s)
    assert dead == [] and same is state
    state, dead = remove_dead(state, T0 + 2.6, s)
    assert dead == ["b_1_0"]
    assert state.round == 1 and not state.complete
    assert state.expected == {"a_1_0", "c_1_0"}
    # the spare steps in: it leaves the redundancy list and joins
    assert decide_join(state, "c_1_0", T0 + 2.6, s, FAR) is Action.REMOVE_FROM_REDUNDANCY_LIST
    state = place(state, "c_1_0", T0 + 2.6, s)
    state = place(state, "a_1_0", T0 + 2.6, s)
    assert state.complete and set(state.participants) == {"a_1_0", "c_1_0"}


def test_a_round_opened_again_holds_its_nodes_seats_before_spares_and_new_nodes() -> None:
    # a's worker failed: the round is opened again; a spare and a node arriving now
    # must not take the seat of b, which comes back 80 ms later with its snapshots
    s = settings(2, 2, last_call_timeout=30.0)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    assert state.complete and state.redundancy_list == {"c_1_0"}
    state = apply(Action.REMOVE_FROM_PARTICIPANTS, state, "a_1_0", T0, s)
    assert state.held_until == T0 + 30.0
    assert decide_join(state, "c_1_0", T0, s, FAR) is Action.SYNC
    assert decide_join(state, "d_1_0", T0, s, FAR) is Action.ADD_TO_REDUNDANCY_LIST
    for node in ("c_1_0", "d_1_0", "a_1_0", "b_1_0"):
        state = place(state, node, T0 + 0.08, s)
    assert state.complete and set(state.participants) == {"a_1_0", "b_1_0"}
    assert state.redundancy_list == {"c_1_0", "d_1_0"} and state.held_until is None


def test_held_seats_go_to_spares_when_their_node_is_dead_or_late() -> None:
    s = settings(2, 2, last_call_timeout=30.0, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    base = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    base = apply(Action.REMOVE_FROM_PARTICIPANTS, base, "a_1_0", T0, s)
    base = place(base, "a_1_0", T0, s)
    # late: the seat is free for the spare once the hold ended
    assert decide_join(base, "c_1_0", T0 + 29.9, s, FAR) is Action.SYNC
    late = place(base, "c_1_0", T0 + 30.0, s)
    assert late.complete and set(late.participants) == {"a_1_0", "c_1_0"}
    # dead: found so, b leaves what the round expects, and its seat with it
    base = _beat(_beat(base, "a_1_0", T0 + 2.5), "c_1_0", T0 + 2.5)
    dead, gone = remove_dead(base, T0 + 2.6, s)
    assert gone == ["b_1_0"]
    assert decide_join(dead, "c_1_0", T0 + 2.6, s, FAR) is Action.REMOVE_FROM_REDUNDANCY_LIST


def test_a_node_at_its_exit_barrier_keeps_its_seat_when_another_node_is_lost() -> None:
    # a's workers are done and a waits at its exit barrier (it holds the only copy of
    # its ranks' newest snapshots); b is lost; the spare c and b's replacement d arrive
    # before a sees the round end: c takes b's seat, d waits as a spare, a is back
    s = settings(2, 2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    state, lost = remove_dead(state, T0 + 100, s, alive={"a_1_0", "c_1_0"})
    assert lost == ["b_1_0"]
    state = place(state, "c_1_0", T0 + 100, s)
    state = place(state, "d_1_0", T0 + 100.1, s)
    assert not state.complete and state.redundancy_list == {"d_1_0"}
    state = place(state, "a_1_0", T0 + 100.5, s)
    assert state.complete and set(state.participants) == {"a_1_0", "c_1_0"}


def test_survivors_below_min_wait_and_dead_expected_node_is_dropped() -> None:
    s = settings(1, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    state = apply(Action.REMOVE_FROM_PARTICIPANTS, state, "a_1_0", T0, s)
    state = place(state, "a_1_0", T0 + 1.0, s)
    state = place(state, "b_1_0", T0 + 1.0, s)
    assert not state.complete  # c is expected
    state = _beat(state, "a_1_0", T0 + 3.0)
    state = _beat(state, "b_1_0", T0 + 3.0)
    state, dead = remove_dead(state, T0 + 3.0, s)
    assert dead == ["c_1_0"]
    assert state.complete and len(state.participants) == 2


def test_closed_rendezvous_refuses_and_spare_exits_gracefully() -> None:
    s = settings(1, 1)
    state = joined(["a_1_0", "b_1_0"], s)
    assert decide_close(state, T0, FAR) is Action.MARK_CLOSED
    state = apply(Action.MARK_CLOSED, state, "a_1_0", T0, s)
    assert decide_close(state, T0, FAR) is Action.FINISH
    assert decide_join(state, "x_1_0", T0, s, FAR) is Action.ERROR_CLOSED
    assert decide_join(state, "b_1_0", T0, s, FAR) is Action.EXIT_GRACEFULLY
    assert nodes_waiting(state, my_round=0) == 0


def test_join_timeout_rolls_back_then_errors() -> None:
    s = settings(2, 3)
    state = joined(["a_1_0"], s)
    assert decide_join(state, "a_1_0", T0 + 11, s, T0 + 10) is Action.LEAVE
    left = apply(Action.LEAVE, state, "a_1_0", T0 + 11, s)
    assert not left.knows("a_1_0")
    assert decide_join(left, "a_1_0", T0 + 11, s, T0 + 10) is Action.ERROR_TIMEOUT
    assert decide_join(state, "a_1_0", T0 + 16, s, T0 + 10) is Action.ERROR_TIMEOUT


def test_leave_keeps_complete_round_for_the_others() -> None:
    s = settings(1, 2)
    state = joined(["a_1_0", "b_1_0"], s)
    assert decide_leave(state, "a_1_0", T0, FAR) is Action.LEAVE
    state2 = apply(Action.LEAVE, state, "a_1_0", T0, s)
    assert state2.complete and state2.round == 0 and state2.participants == {"b_1_0": 1}
    assert needs_wake(state, state2)  # a removal wakes waiters
    assert nodes_waiting(state2, my_round=0) == 0  # b keeps training
    state3 = apply(Action.LEAVE, state2, "b_1_0", T0, s)
    assert state3.round == 1 and not state3.complete
    assert decide_leave(state3, "b_1_0", T0, FAR) is Action.FINISH
    assert decide_exit(state3, "b_1_0", T0, FAR) is Action.FINISH


def test_a_batch_of_requests_is_performed_in_ticket_order() -> None:
    # one batch (the queue's head folds every pending request into one copy): a node
    # that asked to join then to leave is gone, leaves of participants keep the round
    # complete for the one left, and a node joining after them waits for the next round
    s = settings(1, 3)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    new = state.copy()
    batch = [
        ("a_1_0", True, False),
        ("d_1_0", False, False),
        ("d_1_0", True, False),
        ("b_1_0", True, False),
    ]
    perform_requests(new, batch, T0, s)
    assert new.complete and new.participants == {"c_1_0": 2}
    assert not new.knows("a_1_0") and not new.knows("b_1_0") and not new.knows("d_1_0")
    assert state.participants == {"a_1_0": 0, "b_1_0": 1, "c_1_0": 2}  # the copy only
    perform_requests(
        new, [("e_1_0", False, False), ("e_1_0", True, False), ("e_1_0", False, False)], T0, s
    )
    assert new.wait_list == {"e_1_0"} and nodes_waiting(new, my_round=0) == 1
    perform_requests(new, [("c_1_0", True, False), ("f_1_0", True, False)], T0, s)  # f: never there
    assert not new.knows("c_1_0") and not new.complete and new.round == 1
    # departures (nodes told to stop while their workers run) reopen the round once
    new = state.copy()
    perform_requests(new, [("a_1_0", True, True), ("b_1_0", True, True)], T0, s)
    assert new.round == 1 and new.participants == {} and new.expected == {"c_1_0"}
    assert not new.knows("a_1_0") and not new.knows("b_1_0")


def test_failure_restarts_are_counted_once_per_round() -> None:
    state = RendezvousState(run_id="job")
    state = record_failure(state, 3)
    assert state.restarts == 1
    assert record_failure(state, 3) is state
    assert record_failure(state, 2) is state
    assert record_failure(state, 4).restarts == 2


def test_wake_only_on_changes_that_matter() -> None:
    s = settings(2, 4)
    one = joined(["a_1_0"], s)
    two = place(one, "b_1_0", T0, s)
    three = place(two, "c_1_0", T0, s)
    assert needs_wake(one, two)  # the last call started
    assert not needs_wake(two, three)  # one more participant: nobody needs to wake
    beat = _beat(three, "a_1_0", T0 + 1)
    assert not needs_wake(three, beat)


def test_codec_round_trip_and_strict_decoding() -> None:
    s = settings(1, 2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    state.deadline = T0
    data = encode_state(state)
    back = decode_state(data, key="k", run_id="job")
    assert encode_state(back) == data
    for bad in (
        b"\x80\x04pickle",
        b"[]",
        b'{"version": 99}',
        data.replace(b'"complete":true', b'"complete":"yes"'),
        data.replace(b'"round":0', b'"round":0.5'),
        data.replace(b'"round":0', b'"held_until":"soon","round":0'),
        data.replace(b'"round":0', b'"held_until":1e999,"round":0'),
        data.replace(b'"round":0', b'"held_until":5,"round":0'),  # a complete round
    ):
        with pytest.raises(RendezvousStateError, match="'relaunch/x/state'"):
            decode_state(bad, key="relaunch/x/state", run_id="job")
    with pytest.raises(RendezvousStateError, match=r"belongs to run 'job'"):
        decode_state(data, key="k", run_id="other")
    reopened = apply(Action.REMOVE_FROM_PARTICIPANTS, state, "a_1_0", T0, s)
    data = encode_state(reopened)
    assert b'"held_until"' in data
    assert encode_state(decode_state(data, key="k", run_id="job")) == data


def test_node_ids_sort_and_are_unique() -> None:
    a, b = new_node_id("10.0.0.1"), new_node_id("10.0.0.1")
    assert a != b and a.startswith("10.0.0.1_")
    assert node_sort_key("h_x_y") == ("h_x_y", 0, 0)
    assert sorted(["n_2_0", "n_10_0", "m_99_1"], key=node_sort_key) == [
        "m_99_1",
        "n_2_0",
        "n_10_0",
    ]


def test_settings_validation_names_the_parameter() -> None:
    with pytest.raises(ConfigError, match="max_nodes"):
        settings(3, 2)
    with pytest.raises(ConfigError, match="last_call_timeout"):
        settings(last_call_timeout=0.0)
    with pytest.raises(ConfigError, match="join_timeout"):
        settings_from_conf(run_id="j", min_nodes=1, max_nodes=1, conf={"join_timeout": "-1"})
    with pytest.raises(ConfigError, match="keep_alive_max_attempt"):
        settings_from_conf(
            run_id="j", min_nodes=1, max_nodes=1, conf={"keep_alive_max_attempt": "x"}
        )
    with pytest.raises(ConfigError, match=r"'bogus'.*join_timeout"):
        check_conf_keys({"bogus": "1"}, ["join_timeout"])
    got = settings_from_conf(
        run_id="j", min_nodes=1, max_nodes=2, conf={"last_call_timeout": "1.5"}
    )
    assert got.last_call_timeout == 1.5 and got.dead_after == 2.0


def test_a_big_job_beats_less_often_unless_told() -> None:
    # the store takes at most BEATS_PER_SECOND heartbeats a second by default; a job's
    # own keep_alive_interval is kept whatever its size
    def interval(max_nodes: int, **conf: str) -> float:
        got = settings_from_conf(run_id="j", min_nodes=1, max_nodes=max_nodes, conf=conf)
        return got.keep_alive_interval

    assert interval(1) == interval(2048) == 0.5
    assert interval(4096) == 1.0 and interval(16384) == 4.0
    assert 16384 / interval(16384) == BEATS_PER_SECOND
    assert interval(16384, keep_alive_interval="0.5") == 0.5


def test_store_liveness_replaces_heartbeat_times() -> None:
    s = settings(1, 2)
    state = joined(["a_1_0", "b_1_0"], s)
    # fresh heartbeats, but the store (etcd leases) says b is gone: b is dead
    new, dead = remove_dead(state, T0, s, alive={"a_1_0"})
    assert dead == ["b_1_0"] and state.round == 0
    assert new.round == 1 and new.expected == {"a_1_0"}
    # stale heartbeats, but both leases alive: nobody is dead (no clock involved)
    same, dead = remove_dead(state, T0 + 1000, s, alive={"a_1_0", "b_1_0"})
    assert dead == [] and same is state


def _inprocess(state: RendezvousState, s: RendezvousSettings, now: float) -> RendezvousState:
    for node in list(state.participants):
        state = apply(Action.MARK_INPROCESS, state, node, now, s)
    return state


def test_a_lost_inprocess_node_leaves_a_vacancy_that_a_spare_fills() -> None:
    s = settings(2, 2, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = _inprocess(joined(["a_1_0", "b_1_0", "c_1_0"], s), s, T0)
    assert state.inprocess == {"a_1_0", "b_1_0"} and state.redundancy_list == {"c_1_0"}
    for node in ("a_1_0", "c_1_0"):
        state = _beat(state, node, T0 + 2.5)
    old = state
    state, dead = remove_dead(state, T0 + 2.6, s)
    assert dead == ["b_1_0"]
    # the round goes on: same round, complete, b's rank left vacant, nobody restarts
    assert state.round == 0 and state.complete and state.participants == {"a_1_0": 0}
    assert list(state.vacancies) == [1] and state.vacancies[1] > 0
    assert needs_wake(old, state)  # the spare waits on a change
    assert nodes_waiting(state, 0) == 0
    base = state.vacancies[1]
    assert decide_join(state, "c_1_0", T0 + 2.6, s, FAR) is Action.FILL_VACANCY
    state = place(state, "c_1_0", T0 + 2.6, s)
    assert state.participants == {"a_1_0": 0, "c_1_0": 1} and not state.vacancies
    assert state.incarnations == {1: base} and state.round == 0
    assert decide_join(state, "c_1_0", T0 + 2.6, s, FAR) is Action.FINISH
    # the codec keeps it all
    again = decode_state(encode_state(state), key="k", run_id="job")
    assert again.incarnations == {1: base} and again.inprocess == {"a_1_0"}


def test_without_a_spare_the_round_goes_on_smaller_and_a_new_node_fills_it() -> None:
    s = settings(2, 2, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = _inprocess(joined(["a_1_0", "b_1_0"], s), s, T0)
    state = _beat(state, "a_1_0", T0 + 2.5)
    state, dead = remove_dead(state, T0 + 2.6, s)
    assert dead == ["b_1_0"] and state.complete and list(state.vacancies) == [1]
    later = place(state, "d_9_0", T0 + 60, s)  # a node that arrives a minute later
    assert later.participants == {"a_1_0": 0, "d_9_0": 1} and later.round == 0
    # a second loss of the same rank starts above the first replacement's incarnation
    later = apply(Action.MARK_INPROCESS, later, "d_9_0", T0 + 61, s)
    later = _beat(later, "a_1_0", T0 + 70)
    later, dead = remove_dead(later, T0 + 70.5, s)
    assert dead == ["d_9_0"] and later.vacancies[1] > later.incarnations[1]


def test_a_lost_node_reopens_the_round_unless_every_node_restarts_in_process() -> None:
    s = settings(2, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    state = apply(Action.MARK_INPROCESS, state, "b_1_0", T0, s)
    state = apply(Action.MARK_INPROCESS, state, "c_1_0", T0, s)
    for node in ("b_1_0", "c_1_0"):
        state = _beat(state, node, T0 + 2.5)
    reopened, _ = remove_dead(state, T0 + 2.6, s)  # a's workers do not: a new round
    assert reopened.round == 1 and not reopened.vacancies and not reopened.inprocess
    # the rank-0 node hosts the workers' store: losing it reopens the round too
    state = _inprocess(joined(["a_1_0", "b_1_0", "c_1_0"], s), s, T0)
    for node in ("b_1_0", "c_1_0"):
        state = _beat(state, node, T0 + 2.5)
    reopened, _ = remove_dead(state, T0 + 2.6, s)
    assert reopened.round == 1 and not reopened.vacancies


def test_a_failure_reported_after_the_job_went_on_from_its_round_is_not_counted() -> None:
    s = settings(2, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    assert not went_on(state, 0, "b_1_0")  # its own round, still running: counted
    for node in ("a_1_0", "b_1_0"):
        state = _beat(state, node, T0 + 2.5)
    later, dead = remove_dead(state, T0 + 2.6, s)  # c was silent: a new round without it
    assert dead == ["c_1_0"] and later.round == 1
    assert went_on(later, 0, "b_1_0")  # b's workers failed as the round ended
    assert went_on(later, 0, "c_1_0")  # c's, once it ran again, their peers gone
    assert not went_on(later, 1, "b_1_0")  # a failure in the new round is counted
    # in-process nodes: c's rank is left vacant in the same round; c is dropped
    state = _inprocess(joined(["a_1_0", "b_1_0", "c_1_0"], s), s, T0)
    for node in ("a_1_0", "b_1_0"):
        state = _beat(state, node, T0 + 2.5)
    later, _ = remove_dead(state, T0 + 2.6, s)
    assert later.round == 0 and later.vacancies
    assert went_on(later, 0, "c_1_0") and not went_on(later, 0, "b_1_0")


def test_a_node_that_departs_its_running_round_is_gone_as_a_lost_one() -> None:
    # the agent got a signal while its workers ran (a scale-down): it leaves before its
    # workers stop, so the others' failures on its closed connections are not counted
    s = settings(2, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = joined(["a_1_0", "b_1_0", "c_1_0"], s)
    assert decide_depart(state, "c_1_0", T0, T0 + 5) is Action.DEPART
    assert decide_depart(state, "c_1_0", T0 + 6, T0 + 5) is Action.ERROR_TIMEOUT
    later = apply(Action.DEPART, state, "c_1_0", T0, s)
    assert later.round == 1 and not later.knows("c_1_0")  # reopened for a and b
    assert went_on(later, 0, "a_1_0") and not went_on(later, 1, "a_1_0")
    assert decide_depart(later, "c_1_0", T0, T0 + 5) is Action.FINISH
    closed = apply(Action.MARK_CLOSED, state, "a_1_0", T0, s)  # the job is over
    assert decide_depart(closed, "c_1_0", T0, T0 + 5) is Action.FINISH
    # in-process nodes keep their round: c's rank is left vacant for a spare
    state = _inprocess(joined(["a_1_0", "b_1_0", "c_1_0"], s), s, T0)
    kept = apply(Action.DEPART, state, "c_1_0", T0, s)
    assert kept.round == 0 and kept.vacancies and not kept.knows("c_1_0")
    # a leave after the workers ended (the job's end) keeps the round for the others
    ended = apply(Action.LEAVE, joined(["a_1_0", "b_1_0", "c_1_0"], s), "c_1_0", T0, s)
    assert ended.round == 0 and ended.complete


def test_vacancy_fields_are_checked_for_sense() -> None:
    s = settings(2, 2)
    state = joined(["a_1_0", "b_1_0"], s)
    doc = encode_state(state).decode()
    for bad in ('"vacancies":{"0":5}', '"vacancies":{"x":5}', '"incarnations":{"1":-2}'):
        raw = doc[:-1] + "," + bad + "}"
        with pytest.raises(RendezvousStateError, match=r"vacancies|incarnations"):
            decode_state(raw.encode(), key="k", run_id="job")


def test_the_node_hosting_the_store_is_rank_0_of_every_round() -> None:
    s = settings(2, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = RendezvousState(run_id="job")
    state = apply(Action.CLAIM_STORE_HOST, state, "z_9_0", T0, s)  # sorts last by name
    for node in ("a_1_0", "b_1_0", "z_9_0"):
        state = place(state, node, T0, s)
    assert state.complete and state.participants["z_9_0"] == 0
    assert sorted(state.participants.values()) == [0, 1, 2]
    again = decode_state(encode_state(state), key="k", run_id="job")
    assert again.store_host == "z_9_0"
    # losing the host forgets it (its store is gone: the job is lost anyway)
    for node in ("a_1_0", "b_1_0"):
        state = _beat(state, node, T0 + 2.5)
    state, dead = remove_dead(state, T0 + 2.6, s)
    assert dead == ["z_9_0"] and state.store_host is None
