"""NVIDIA's testing and supervision helpers, called as NVIDIA's documentation calls
them: ``tools.inject_fault`` (seeded choice of ranks and fault, real signals and
exceptions), ``auto_restart.monitor_and_restart`` (a real fork and restart), health
checks called the older way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from relaunch import inprocess
from relaunch.errors import ConfigError
from relaunch.inprocess.state import State
from relaunch.inprocess.tools import inject_fault as fi

pytestmark = pytest.mark.timeout(60)


def chosen_ranks(monkeypatch: pytest.MonkeyPatch, world: int, **kwargs: Any) -> list[int]:
    """Which ranks inject (every rank runs the same call with its own RANK)."""
    hits = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        fired: list[float] = []
        key = fi.register_fault("RECORD", lambda delay, callback, fired=fired: fired.append(delay))
        fi.inject_fault(faults=[key], **kwargs)
        if fired:
            hits.append(rank)
    return hits


def test_ranks_agree_on_the_chosen_ranks_and_spare_the_kept_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for seed in range(20):
        hits = chosen_ranks(
            monkeypatch, 8, num_faults=(1, 3), keep_alive=2, delay=(0.1, 0.2), seed=seed
        )
        assert 1 <= len(hits) <= 3 and min(hits) >= 2
        again = chosen_ranks(
            monkeypatch, 8, num_faults=(1, 3), keep_alive=2, delay=(0.1, 0.2), seed=seed
        )
        assert again == hits
    assert chosen_ranks(monkeypatch, 2, num_faults=5, keep_alive=2, delay=0.1, seed=1) == []


def test_fault_names_of_every_release_and_bad_arguments() -> None:
    assert fi.Fault.KILL is fi.Fault.SIGKILL and fi.Fault["TERM"] is fi.Fault.SIGTERM
    assert fi.Fault.GPU is fi.Fault.GPU_ERROR and fi.Fault.GIL is fi.Fault.LOCK_GIL
    with pytest.raises(ValueError, match="faults"):
        fi.inject_fault(faults=[], num_faults=1, keep_alive=0, delay=0.1, seed=0)
    with pytest.raises(ValueError, match="num_faults"):
        fi.inject_fault(faults=[fi.Fault.KILL], num_faults=(3, 1), keep_alive=0, delay=0.1, seed=0)
    with pytest.raises(RuntimeError, match="Unknown fault"):
        fi.dispatch_fault_injection(fi.CustomFault("never registered"), 0.0, None)


def test_workload_and_async_exceptions_reach_the_training_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fired = threading.Event()
    fi.inject_fault([fi.Fault.WORKLOAD_EXC], 1, 1, 0.01, seed=3, callback=fired.set)
    assert fired.wait(5)
    with pytest.raises(fi.InjectedException):
        for _ in range(500):
            fi.maybe_raise_workload_exception()
            time.sleep(0.01)
    fi.maybe_raise_workload_exception()  # raised once only
    with pytest.raises(fi.InjectedException):
        fi.inject_fault([fi.Fault.ASYNC_EXC], 1, 1, 0.01, seed=3)
        for _ in range(500):
            time.sleep(0.01)


@pytest.mark.parametrize(
    ("fault", "returncode"),
    [("SIGTERM", -signal.SIGTERM), ("KILL", -signal.SIGKILL), ("SIGNAL_EXC", 3)],
)
def test_signals_hit_the_chosen_rank(tmp_path: Path, fault: str, returncode: int) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from relaunch.inprocess.tools import inject_fault as fi
            fi.inject_fault([fi.Fault[{fault!r}]], 1, 0, 0.05, seed=0)
            try:
                time.sleep(30)
            except fi.InjectedException:
                sys.exit(3)
            """
        )
    )
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, timeout=40, capture_output=True)
    assert done.returncode == returncode, done.stderr[-2000:]


def test_monitor_and_restart_forks_until_the_child_succeeds(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, pathlib, sys
            from relaunch.inprocess.auto_restart import monitor_and_restart
            monitor_and_restart(restart_delay=0.05)
            runs = pathlib.Path({str(counter)!r})
            n = len(runs.read_text()) if runs.exists() else 0
            runs.write_text("x" * (n + 1))
            if n == 0:
                sys.exit(7)
            if n == 1:
                os.kill(os.getpid(), 9)
            print("trained", flush=True)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], timeout=40, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("trained") == 1 and counter.read_text() == "xxx"
    lines = done.stderr.splitlines()
    assert lines[0] == "Starting self-monitoring mode"
    assert any(line.endswith("exited with status 7") for line in lines)
    assert any(line.endswith("exited with signal 9") for line in lines)
    with pytest.raises(ConfigError, match="restart_delay"):
        inprocess.auto_restart.monitor_and_restart(restart_delay=-1)


def test_health_checks_take_nvidias_older_call_too() -> None:
    state = State(0, 1).freeze()
    assert inprocess.health_check.CudaHealthCheck()(state, None) is state
    assert inprocess.health_check.ChainedGPUHealthCheck(device_index=0)(state, None) is state
    counter = inprocess.health_check.FaultCounter(max_rank_faults=1)
    counter(state, RuntimeError("first"))
    with pytest.raises(inprocess.health_check.FaultCounterExceeded):
        counter(state, RuntimeError("second"))
