"""Pure logic of in-process restart: config, state, rank assignment, filters, records."""

from __future__ import annotations

import ast
import dataclasses
import datetime
from pathlib import Path
from typing import Any

import pytest

from relaunch import inprocess
from relaunch.errors import ConfigError, InProcessError
from relaunch.inprocess import (
    ActiveWorldSizeDivisibleBy,
    Compose,
    FillGaps,
    Interruption,
    InterruptionRecord,
    MaxActiveWorldSize,
    Mode,
    ShiftRanks,
    State,
)
from relaunch.inprocess.attribution import decode_records

S = datetime.timedelta(seconds=1)


def test_public_names_are_pinned() -> None:
    assert sorted(inprocess.__all__) == sorted(
        [
            *("Abort", "AbortTorchDistributed", "ActivateAllRanks", "ActiveWorldSizeDivisibleBy"),
            *("BarrierTimeoutError", "CallWrapper", "Compose", "CudaHealthCheck", "FaultCounter"),
            *("FillGaps", "Finalize", "FrozenState", "HealthCheck", "HealthCheckError"),
            *("Initialize", "InternalError", "Interruption", "InterruptionRecord"),
            *("MaxActiveWorldSize", "Mode", "RankAssignment", "RankAssignmentCtx"),
            *("RankDiscarded", "RankFilter", "RankShouldRestart", "RestartAbort", "RestartError"),
            *("RetryController", "ShiftRanks", "State", "Status", "ThreadedFinalize", "Wrapper"),
            *("WrapperConfig", "abort", "auto_restart", "broadcast_state", "compose"),
            *("exception", "finalize", "health_check", "initialize", "monitor_thread"),
            *("nested_restarter", "progress_watchdog", "rank_assignment", "rank_filter", "state"),
            *("tools", "wrap"),
        ]
    )
    for name in inprocess.__all__:
        assert hasattr(inprocess, name)


def test_the_core_imports_no_public_module() -> None:
    """The engine (``inprocess/_core``) imports nothing public of the package: the public
    modules re-export it and build on it, never the other way round."""
    core = Path(inprocess.__file__).parent / "_core"
    imported: dict[str, set[str]] = {}
    for path in sorted(core.glob("*.py")):
        names = imported.setdefault(path.name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: a relative import"
                module = node.module or ""
                names.update(f"{module}.{alias.name}" for alias in node.names)
    assert len(imported) > 20
    public = {
        (file, name)
        for file, names in imported.items()
        for name in names
        if name.startswith("relaunch.inprocess.")
        and not name.startswith("relaunch.inprocess._core.")
    }
    assert public == set()


def test_exception_tree() -> None:
    assert issubclass(inprocess.RestartError, InProcessError)
    for cls in (
        inprocess.HealthCheckError,
        inprocess.InternalError,
        inprocess.BarrierTimeoutError,
        inprocess.exception.TimeoutError,
    ):
        assert issubclass(cls, inprocess.RestartError)
    assert issubclass(inprocess.BarrierTimeoutError, inprocess.exception.TimeoutError)
    assert issubclass(inprocess.exception.TimeoutError, TimeoutError)
    # NVIDIA's: neither is an Exception, so ``except Exception`` cannot swallow them
    assert not issubclass(inprocess.RankShouldRestart, Exception)
    assert not issubclass(inprocess.RestartAbort, Exception)


BAD_PARAMETERS = [
    ("store_factory", 3),
    ("store_kwargs", [1]),
    ("initialize", 3),
    ("abort", "x"),
    ("finalize", [print, 3]),
    ("health_check", 1.5),
    ("rank_assignment", None),
    ("rank_filter", object()),
    ("monitor_thread_interval", "1s"),
    ("monitor_process_interval", -S),
    ("progress_watchdog_interval", datetime.timedelta(0)),
    ("soft_timeout", 200 * S),  # not below hard_timeout
    ("hard_timeout", 10 * S),  # not above soft_timeout (60 s)
    ("heartbeat_timeout", 500 * S),  # not below barrier_timeout
    ("barrier_timeout", 80 * S),  # not above hard_timeout
    ("completion_timeout", "x"),
    ("last_call_wait", -S),
    ("termination_grace_time", datetime.timedelta(0)),
    ("monitor_process_logfile", "relative/path-{rank}.log"),
    ("monitor_process_pidfile", "pid-{rank}"),
    ("heartbeat_interval", 40 * S),  # not below heartbeat_timeout
    ("enabled", "yes"),
]


@pytest.mark.parametrize(("name", "value"), BAD_PARAMETERS, ids=[b[0] for b in BAD_PARAMETERS])
def test_every_invalid_parameter_is_refused_with_its_name(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        inprocess.Wrapper(**{name: value})


def test_every_parameter_is_covered_by_the_invalid_cases() -> None:
    fields = {f.name for f in dataclasses.fields(inprocess.WrapperConfig)}
    assert fields == {name for name, _ in BAD_PARAMETERS}


def test_unknown_parameter_is_refused() -> None:
    with pytest.raises(TypeError):
        inprocess.Wrapper(soft_timeot=S)  # type: ignore[call-arg]


def test_intervals_must_be_below_their_timeouts() -> None:
    with pytest.raises(ConfigError, match="monitor_thread_interval"):
        inprocess.Wrapper(monitor_thread_interval=61 * S)
    with pytest.raises(ConfigError, match="monitor_process_interval"):
        inprocess.Wrapper(monitor_process_interval=31 * S)


def test_numbers_are_taken_as_seconds_and_names_are_readable() -> None:
    wrapper = inprocess.Wrapper(soft_timeout=2, hard_timeout=4.5)
    assert wrapper.soft_timeout == 2 * S
    assert wrapper.hard_timeout == datetime.timedelta(seconds=4.5)
    assert isinstance(wrapper.abort, inprocess.AbortTorchDistributed)


def test_disabled_wrapper_returns_the_function_unchanged() -> None:
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> int:
        return 7

    assert inprocess.Wrapper(enabled=False)(train) is train


def _state(rank: int, world: int = 4) -> State:
    return State(rank=rank, world_size=world, initial_rank=rank, initial_world_size=world)


def _assign(assignment: Any, rank: int, world: int, dead: set[int]) -> State | None:
    ctx = inprocess.RankAssignmentCtx(_state(rank, world), None, set(dead))
    try:
        return assignment(ctx).state  # type: ignore[no-any-return]
    except inprocess.RankDiscarded:
        return None


def test_shift_ranks_closes_gaps_in_order() -> None:
    result = {r: _assign(ShiftRanks(), r, 4, {1}) for r in range(4)}
    assert result[1] is None
    assert [(s.rank, s.world_size) for r in (0, 2, 3) if (s := result[r])] == [
        (0, 3),
        (1, 3),
        (2, 3),
    ]


def test_fill_gaps_moves_only_the_highest_ranks() -> None:
    result = {r: _assign(FillGaps(), r, 5, {0, 2}) for r in (1, 3, 4)}
    assert result[1] is not None and result[1].rank == 1
    assert {s.rank for r in (3, 4) if (s := result[r])} == {0, 2}
    assert all(s is not None and s.world_size == 3 for s in result.values())


def test_filters_choose_active_ranks_and_spares() -> None:
    states = [_assign(MaxActiveWorldSize(3), r, 5, set()) for r in range(5)]
    assert [s.mode for s in states if s] == [Mode.ACTIVE] * 3 + [Mode.INACTIVE] * 2
    assert states[4] is not None and states[4].active_rank is None
    assert states[0] is not None and states[0].active_world_size == 3
    div = Compose(ActiveWorldSizeDivisibleBy(2), MaxActiveWorldSize(3))
    states = [_assign(div, r, 5, set()) for r in range(5)]
    assert [s.mode for s in states if s] == [Mode.ACTIVE] * 2 + [Mode.INACTIVE] * 3


def test_filter_parameters_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_active_world_size"):
        inprocess.rank_filter.MaxActiveWorldSize(0)
    with pytest.raises(ConfigError, match="divisor"):
        inprocess.rank_filter.ActiveWorldSizeDivisibleBy(-1)
    with pytest.raises(ConfigError, match="instances"):
        Compose()


def test_state_from_env_and_distributed_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    state = State.from_env({"RANK": "2", "WORLD_SIZE": "3"})
    assert (state.rank, state.initial_rank, state.world_size) == (2, 2, 3)
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("WORLD_SIZE", "9")
    dataclasses.replace(state, active_rank=1, active_world_size=2).set_distributed_vars()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")
    with pytest.raises(ConfigError, match="RANK"):
        State.from_env({"RANK": "3", "WORLD_SIZE": "3"})


def test_interruption_records_round_trip_and_reject_garbage() -> None:
    record = InterruptionRecord(
        initial_rank=3, interruption=Interruption.SOFT_TIMEOUT, message="a\nb"
    )
    blob = (record.encode() + record.encode()).encode()
    assert decode_records(blob) == [record, record]
    with pytest.raises(inprocess.InternalError):
        decode_records(b'{"version": 99}\n')
    with pytest.raises(inprocess.InternalError):
        decode_records(b"not json\n")


def test_fault_counter_terminates_after_too_many_faults() -> None:
    counter = inprocess.FaultCounter(max_rank_faults=1)
    failed = dataclasses.replace(_state(0), fn_exception=RuntimeError()).freeze()
    counter(_state(0).freeze())  # an iteration without a fault does not count
    counter(failed)
    with pytest.raises(inprocess.health_check.FaultCounterExceeded):
        counter(failed)


def test_cuda_health_check_takes_nvidias_timeout() -> None:
    check = inprocess.CudaHealthCheck(timeout=datetime.timedelta(seconds=3))
    assert check.timeout == datetime.timedelta(seconds=3)
    state = State(rank=0, world_size=1, initial_rank=0, initial_world_size=1)
    assert check(state) is state  # CUDA not initialized here: nothing to check
    with pytest.raises(ConfigError, match="timeout"):
        inprocess.CudaHealthCheck(timeout=5)  # type: ignore[arg-type]


def test_rosters_round_trip_and_corrupt_ones_are_named() -> None:
    from relaunch.inprocess._core._rejoin import decode_roster, encode_roster

    roster = {
        r: State(rank=r, world_size=3, initial_rank=r, initial_world_size=4, iteration=5)
        for r in (0, 2, 3)
    }
    states, incarnations = decode_roster(encode_roster(roster, {2: 1}))
    assert states == roster and incarnations == {2: 1}
    with pytest.raises(InProcessError, match="corrupt roster"):
        decode_roster('{"version": 1, "states": {"0": {"rank": "x"}}, "incarnations": {}}')
    with pytest.raises(InProcessError, match="corrupt roster"):
        decode_roster('{"version": 2}')


def test_death_records_count_for_their_incarnation_only() -> None:
    from relaunch.inprocess._core._coord import CoordinationStore

    class Fake:
        def __init__(self) -> None:
            self.kv: dict[str, str] = {}

        def append(self, key: str, value: str) -> None:
            self.kv[key] = self.kv.get(key, "") + value

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.kv.get(k, "").encode() for k in keys]

    coord = CoordinationStore(Fake(), "ns")  # type: ignore[arg-type]
    coord.record_dead(0, 1, Interruption.TERMINATED, "first process died")
    assert coord.dead_ranks() == {1}
    coord.incarnations[1] = 1  # its replacement was admitted
    assert coord.dead_ranks() == set()
    coord.record_dead(3, 1, Interruption.TERMINATED, "the replacement died")
    assert coord.dead_ranks() == {1}
    coord.request_join(1, 2)
    coord.request_join(2, 1)
    assert coord.join_requests() == {1: 2, 2: 1}


def test_store_kwargs_take_nvidias_timeout() -> None:
    from relaunch.inprocess._core._env import resolve_store

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    kw = {"timeout": datetime.timedelta(seconds=7)}
    assert resolve_store(kw, 60.0, env).timeout == 7.0
    assert resolve_store({"timeout": 3}, 60.0, env).timeout == 3.0
    assert resolve_store({}, 60.0, env).timeout == 60.0
    with pytest.raises(ConfigError, match=r"store_kwargs\['timeout'\]"):
        resolve_store({"timeout": -1}, 60.0, env)
    with pytest.raises(ConfigError, match="expected host, port, timeout"):
        resolve_store({"bogus": 1}, 60.0, env)


def test_a_port_of_the_programs_own_is_hosted_by_rank_0_even_under_an_agent() -> None:
    from relaunch.inprocess._core._env import resolve_store

    agent = {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    assert resolve_store({}, 60.0, agent).hosted_by_rank0 is False  # the agent's store
    assert resolve_store({"port": 29500}, 60.0, agent).hosted_by_rank0 is False
    own = resolve_store({"port": 29502}, 60.0, agent)  # NVIDIA's examples: MASTER_PORT + 2
    assert (own.host, own.port, own.hosted_by_rank0) == ("10.0.0.1", 29502, True)
    alone = resolve_store({}, 60.0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (alone.port, alone.hosted_by_rank0) == (29501, True)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 64, 1000, 16384])
def test_each_rank_s_heartbeat_is_read_by_about_log2_of_the_world(world: int) -> None:
    from relaunch.inprocess._core._monitor_process import watched

    readers: dict[int, int] = dict.fromkeys(range(world), 0)
    for rank in range(world):
        mine = watched(rank, world)
        assert rank not in mine and len(set(mine)) == len(mine)
        assert len(mine) == (world - 1).bit_length()  # ceil(log2(world))
        for r in mine:
            readers[r] += 1
    assert set(readers.values()) == {(world - 1).bit_length()}


def test_a_lost_node_s_ranks_are_each_read_by_a_live_rank() -> None:
    from relaunch.inprocess._core._monitor_process import watched

    world, per_node = 64, 8
    for node in range(world // per_node):
        dead = set(range(node * per_node, (node + 1) * per_node))
        read = {r for rank in set(range(world)) - dead for r in watched(rank, world)}
        assert dead <= read, node
