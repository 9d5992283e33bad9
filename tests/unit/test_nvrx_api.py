"""NVIDIA's resiliency-extension API, called as NVIDIA's documentation calls it:
``Compose``, ``State``/``FrozenState``/``Mode``, the rank assignments (``Tree``
included, over a real store shared by threads), the stores' ``StoreMixin`` methods,
the callbacks, the monitor-thread helpers, the progress watchdog, the nested
restarter's lines. Written from NVIDIA's API reference; no torch process group."""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from relaunch import inprocess
from relaunch.inprocess import rank_assignment as ra
from relaunch.inprocess.state import FrozenState, Mode, State

# -- Compose -------------------------------------------------------------------------


def test_compose_chains_right_to_left_and_unpacks_tuples() -> None:
    assert inprocess.Compose(lambda x: x + 1, lambda x: x * 10)(2) == 21
    assert inprocess.Compose(lambda a, b: (a + 1, b + 1), lambda a, b: (a * 2, b * 2))(1, 2) == (
        3,
        5,
    )
    calls: list[str] = []
    inprocess.Compose(lambda: calls.append("a"), lambda: calls.append("b"))()
    assert calls == ["b", "a"]


def test_compose_warns_when_a_link_returns_none() -> None:
    with pytest.warns(UserWarning, match="didn't chain"):
        assert inprocess.Compose(lambda x: x, lambda x: None)(1) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert inprocess.Compose(lambda x: x)(None) is None  # None in, None out: no warning


def test_compose_is_an_instance_of_the_common_base() -> None:
    class Base:
        pass

    class Foo(Base):
        def __call__(self) -> None:
            pass

    class Bar(Foo):
        def __call__(self) -> None:
            pass

    both = inprocess.Compose(Foo(), Bar())
    assert isinstance(both, Foo) and isinstance(both, Base) and not isinstance(both, Bar)
    checks = inprocess.Compose(inprocess.FaultCounter(), inprocess.CudaHealthCheck())
    assert isinstance(checks, inprocess.health_check.HealthCheck)


# -- State -----------------------------------------------------------------------------


def test_state_fields_freeze_and_copy() -> None:
    state = State(3, 8)  # NVIDIA's positional rank, world_size
    assert (state.initial_rank, state.initial_world_size, state.mode) == (3, 8, Mode.INITIALIZED)
    frozen = state.freeze()
    assert isinstance(frozen, FrozenState) and frozen.rank == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.rank = 0  # type: ignore[misc]
    state.fn_exception = ValueError("x")
    state.advance()
    assert state.iteration == 1 and state.fn_exception is None
    other = State(0, 2)
    other.copy_from(state, fields=["iteration"])
    assert other.iteration == 1 and other.rank == 0


# -- rank assignment -----------------------------------------------------------------


def assign(assignment: Any, world: int, dead: set[int], store: Any = None) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for rank in range(world):
        ctx = ra.RankAssignmentCtx(State(rank, world), store, set(dead))
        try:
            out[rank] = assignment(ctx).state
        except ra.RankDiscarded:
            out[rank] = None
    return out


def test_shift_ranks_and_fill_gaps_as_documented() -> None:
    shifted = assign(ra.ShiftRanks(), 8, {1, 4, 5})
    assert {r: s and s.rank for r, s in shifted.items()} == {
        0: 0, 1: None, 2: 1, 3: 2, 4: None, 5: None, 6: 3, 7: 4,
    }  # fmt: skip
    filled = assign(ra.FillGaps(), 8, {1, 4, 5})
    assert {r: s and s.rank for r, s in filled.items()} == {
        0: 0, 1: None, 2: 2, 3: 3, 4: None, 5: None, 6: 1, 7: 4,
    }  # fmt: skip
    assert all(s is None or s.world_size == 5 for s in filled.values())


def test_default_assignment_activates_every_survivor() -> None:
    default = inprocess.Compose(ra.ActivateAllRanks(), ra.ShiftRanks())
    states = assign(default, 4, {2})
    assert [(s.active_rank, s.active_world_size, s.mode) for s in states.values() if s] == [
        (0, 3, Mode.ACTIVE), (1, 3, Mode.ACTIVE), (2, 3, Mode.ACTIVE),
    ]  # fmt: skip


def test_filters_keep_a_divisible_active_world() -> None:
    states = assign(inprocess.Compose(ra.ActiveWorldSizeDivisibleBy(4), ra.ShiftRanks()), 8, {0})
    modes = [s.mode for s in states.values() if s]
    assert modes == [Mode.ACTIVE] * 4 + [Mode.INACTIVE] * 3


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


def per_rank(world: int, fn: Callable[[int], Any]) -> dict[int, Any]:
    """Run ``fn(rank)`` in one thread per rank (the store exchange needs them all)."""
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def mixin(base: Any, rank: int) -> Any:
    client = inprocess.store.PrefixStore(0, dist.TCPStore("127.0.0.1", base.port, is_master=False))
    return client


def test_filter_count_grouped_by_key_terminates_short_groups(store: Any) -> None:
    def run(rank: int) -> set[int]:
        filt = ra.FilterCountGroupedByKey(lambda s: s.rank // 2, lambda count: count == 2)
        filt.name = "pairs"  # the same barrier names on every rank
        ctx = ra.RankAssignmentCtx(State(rank, 8), mixin(store, rank), {1, 4, 5, 6})
        return filt(ctx).terminated_ranks

    results = per_rank(8, lambda r: set() if r in {1, 4, 5, 6} else run(r))
    assert all(results[r] == {0, 1, 4, 5, 6, 7} for r in (0, 2, 3, 7)), results


def test_tree_replaces_a_lost_active_rank_with_a_reserve_of_its_host(store: Any) -> None:
    hosts = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    layers = [
        ra.Layer(min_ranks=1, max_ranks=4, key_or_fn="root", flag=ra.LayerFlag.RESERVE),
        ra.Layer(min_ranks=1, max_ranks=2, key_or_fn=lambda s: hosts[s.initial_rank],
                 flag=ra.LayerFlag.RESERVE),
    ]  # fmt: skip
    trees = {r: ra.Tree(layers) for r in range(6)}
    first = per_rank(
        6, lambda r: trees[r](ra.RankAssignmentCtx(State(r, 6), mixin(store, r), set())).state
    )
    assert [first[r].mode for r in range(6)] == [Mode.ACTIVE, Mode.ACTIVE, Mode.INACTIVE] * 2
    assert [first[r].active_rank for r in range(6)] == [0, 1, None, 2, 3, None]
    # rank 1 (active, host a) is lost: host a's reserve (rank 2) takes its active rank
    second: dict[int, Any] = {}
    for r in (0, 2, 3, 4, 5):
        second[r] = trees[r](ra.RankAssignmentCtx(first[r], None, {1})).state
    assert second[2].mode is Mode.ACTIVE and second[2].active_rank == 1
    assert second[0].world_size == 5 and second[5].mode is Mode.INACTIVE


def test_store_mixin_exchanges_json_never_pickle(store: Any) -> None:
    client = mixin(store, 0)
    state = State(1, 4, fn_exception=RuntimeError("boom"))
    client.send_state(state, 1)
    client.send_key(("host", 3), 1)
    (back,) = client.get_states([1])
    assert (back.rank, back.world_size, back.mode) == (1, 4, Mode.INITIALIZED)
    assert "boom" in repr(back.fn_exception)
    assert client.get_keys([1]) == [("host", 3)]
    assert b"pickle" not in client.get("state_1") and client.get("state_1").startswith(b"{")
    client.barrier([0], "solo", 1, datetime.timedelta(seconds=5))
    with pytest.raises(inprocess.store.BarrierTimeout):
        client.barrier([0], "pair", 2, datetime.timedelta(seconds=0.2))


# -- callbacks --------------------------------------------------------------------------


def test_retry_controller_ends_the_wrapper_at_its_limit() -> None:
    controller = inprocess.initialize.RetryController(max_iterations=2)
    ok = State(0, 1, active_world_size=1, iteration=1).freeze()
    assert controller(ok) is ok
    with pytest.raises(inprocess.exception.RestartAbort, match="iteration=2"):
        controller(State(0, 1, active_world_size=1, iteration=2).freeze())


def test_threaded_finalize_times_out_and_reports_failures() -> None:
    state = State(0, 1).freeze()
    done: list[int] = []
    inprocess.finalize.ThreadedFinalize(datetime.timedelta(seconds=5), done.append, (1,))(state)
    assert done == [1]
    release = threading.Event()
    slow = inprocess.finalize.ThreadedFinalize(datetime.timedelta(seconds=0.1), release.wait)
    with pytest.raises(inprocess.exception.TimeoutError):
        slow(state)
    release.set()


def test_chained_hardware_checks_are_buildable_and_pass_without_hardware() -> None:
    state = State(0, 1).freeze()
    for check in (
        inprocess.health_check.ChainedGPUHealthCheck(device_index=0),
        inprocess.health_check.ChainedNVLHealthCheck(device_index=0),
        inprocess.health_check.ChainedNicHealthCheck(),
    ):
        assert check(state) is state


def test_restart_health_check_runs_the_hardware_checks_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As NVIDIA's 0.7 builds it: Compose(user's, GPU, NVLink, NIC) of device LOCAL_RANK.
    A Compose runs its last instance first: NIC, NVLink, GPU, then the user's checks."""
    order: list[str] = []

    class User(inprocess.health_check.HealthCheck):
        def __init__(self, name: str = "user") -> None:
            self.name = name

        def __call__(self, state: Any) -> Any:
            order.append(self.name)
            return state

    def recording(name: str) -> type[inprocess.health_check.HealthCheck]:
        class Check(inprocess.health_check.HealthCheck):
            def __init__(self, device_index: int | None = None) -> None:
                self.device_index = device_index

            def __call__(self, state: Any) -> Any:
                order.append(f"{name}{self.device_index}")
                return state

        return Check

    monkeypatch.setenv("LOCAL_RANK", "0")
    checks = inprocess.Wrapper(health_check=User()).restart_health_check.instances
    assert [type(c).__name__ for c in checks] == [
        "User",
        "ChainedGPUHealthCheck",
        "ChainedNVLHealthCheck",
        "ChainedNicHealthCheck",
    ]
    assert [c.device_index for c in checks[1:]] == [0, 0, 0]

    for name in ("GPU", "NVL", "Nic"):  # the wrapper builds the classes named in wrap
        monkeypatch.setattr(inprocess.wrap, f"Chained{name}HealthCheck", recording(name.lower()))
    monkeypatch.setenv("LOCAL_RANK", "1")
    state = State(0, 1).freeze()
    for user, expected in (
        (User(), ["user"]),
        ([User("a"), User("b")], ["a", "b"]),  # a list runs in its order
        (inprocess.Compose(User("a"), User("b")), ["b", "a"]),  # a Compose as composed
    ):
        order.clear()
        assert inprocess.Wrapper(health_check=user).restart_health_check(state) is state
        assert order == ["nic1", "nvl1", "gpu1", *expected]
    order.clear()
    assert inprocess.Wrapper().restart_health_check(state) is state
    assert order == ["nic1", "nvl1", "gpu1"]
    monkeypatch.delenv("LOCAL_RANK")
    assert inprocess.Wrapper().restart_health_check is None


# -- monitor thread helpers, progress watchdog, nested restarter -------------------------


def test_async_raise_interrupts_a_thread() -> None:
    caught: list[BaseException] = []
    started = threading.Event()

    def victim() -> None:
        started.set()
        try:
            for _ in range(1000):
                time.sleep(0.01)
        except inprocess.RankShouldRestart as exc:
            caught.append(exc)

    thread = threading.Thread(target=victim, name="victim")
    thread.start()
    started.wait()
    assert thread.ident is not None
    inprocess.monitor_thread.async_raise(thread.ident, inprocess.RankShouldRestart)
    thread.join(5)
    assert caught and not thread.is_alive()
    with pytest.raises(RuntimeError):
        inprocess.monitor_thread.async_raise(2**40, inprocess.RankShouldRestart)


class Collect:
    """A progress watchdog's connection: keeps the timestamps sent."""

    def __init__(self) -> None:
        self.stamps: list[Any] = []

    def send_timestamp(self, stamp: Any) -> None:
        self.stamps.append(stamp)


def test_progress_watchdog_sends_timestamps_and_pauses() -> None:
    collect = Collect()
    watchdog = inprocess.progress_watchdog.ProgressWatchdog(
        0, collect, datetime.timedelta(milliseconds=5)
    )
    watchdog.start()
    for _ in range(40):
        time.sleep(0.005)
    watchdog.pause_and_synchronize()
    paused = len(collect.stamps)
    time.sleep(0.05)
    assert len(collect.stamps) == paused > 3
    assert all(isinstance(s, inprocess.progress_watchdog.Timestamp) for s in collect.stamps)
    watchdog.ping()
    assert collect.stamps[-1].manual is not None
    watchdog.resume()
    watchdog.shutdown()
    watchdog.shutdown()
    with pytest.raises(RuntimeError):
        watchdog.resume()


def test_progress_watchdog_resumes_with_the_last_progress_and_stops_cleanly() -> None:
    collect = Collect()
    interval = datetime.timedelta(milliseconds=1)
    watchdog = inprocess.progress_watchdog.ProgressWatchdog(0, collect, interval)
    watchdog.start()
    while len(collect.stamps) < 5:
        time.sleep(0.001)
    watchdog.pause_and_synchronize()
    before = collect.stamps[-1]
    time.sleep(0.03)
    watchdog.resume()
    while len(collect.stamps) < 2 + collect.stamps.index(before) + 1:
        time.sleep(0.001)
    after = collect.stamps[collect.stamps.index(before) + 1 :]
    assert after[0] == before  # the progress known before the pause, then fresh ones
    assert after[1].auto > before.auto  # how long after: bench/inprocess_restart.py
    watchdog.shutdown()
    assert not watchdog.is_alive()
    last = len(collect.stamps)
    time.sleep(0.02)  # nothing is sent once shutdown() returned
    assert len(collect.stamps) == last and collect.stamps[-1].auto > after[-1].auto


def test_nested_restarter_lines() -> None:
    from relaunch.inprocess import nested_restarter as nr

    stream = io.StringIO()
    logger = nr.NestedRestarterLogger()
    logger.restarter_logger.handlers = [logging.StreamHandler(stream)]
    state = State(0, 2, active_rank=0, active_world_size=2).freeze()
    completed = nr.NestedRestarterHandlingCompleted()
    completed.logger = logger
    completed(state)
    completed(state)
    starting = nr.NestedRestarterHandlingStarting()
    starting.logger = logger
    starting(state)
    lines = stream.getvalue().splitlines()
    pattern = re.compile(r"NestedRestarter.*state=(\w+)(?:\s+stage=(\w+))?")
    found = [m.groups() for line in lines if (m := pattern.search(line))]
    assert found == [("initialize", None), ("handling", "completed"), ("handling", "starting")]


def test_records_reach_nvidias_logger() -> None:
    """Code that captures NVIDIA's ``nvrx`` logger (a handler, a level) sees ours."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    nvrx = logging.getLogger("nvrx")
    handler, level = Keep(level=logging.INFO), nvrx.level
    nvrx.addHandler(handler)
    nvrx.setLevel(logging.INFO)
    try:
        inprocess.health_check.ChainedGPUHealthCheck(device_index=0)(State(0, 1).freeze())
    finally:
        nvrx.removeHandler(handler)
        nvrx.setLevel(level)
    said = [r.getMessage() for r in records if r.name.startswith("nvrx.")]
    assert any("not available" in m for m in said), said
