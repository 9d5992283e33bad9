"""The wrapper, called as NVIDIA's documentation calls it (one rank, a real store and
monitor process, each case in a fresh interpreter): RetryController, callbacks with
NVIDIA's arguments and frozen state, which exceptions end the wrapper and how, the
monitor process's pid file and log file, the hard timeout across restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from multinode_support.ports import free_port

pytestmark = pytest.mark.timeout(120)

PRELUDE = textwrap.dedent(
    """
    import dataclasses, datetime, json, os, sys, time
    import torch
    from relaunch import inprocess
    T = datetime.timedelta
    KW = dict(
        store_kwargs={"port": int(os.environ["STORE_PORT"]), "timeout": T(seconds=10)},
        monitor_thread_interval=T(seconds=1e-3), monitor_process_interval=T(seconds=1e-3),
        progress_watchdog_interval=T(seconds=1e-3), last_call_wait=T(seconds=1e-3),
        termination_grace_time=T(seconds=1e-3),
    )
    def report(**fields):
        print("RESULT " + json.dumps(fields), flush=True)
    def outcome(fn, *args):
        try:
            return {"returned": fn(*args)}
        except BaseException as exc:
            return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    """
)


def start(tmp: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "case.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    environ = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "STORE_PORT": str(free_port()),
        **env,
    }
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=environ
    )


def run(tmp: Path, body: str, **env: str) -> dict[str, object]:
    done = start(tmp, body, **env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    result: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    return result


def test_retry_controller_ends_after_max_iterations(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """
        calls = []
        @inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=4), **KW)
        def fn(call_wrapper: inprocess.CallWrapper = None):
            calls.append(call_wrapper.iteration)
            raise RuntimeError("again")
        report(calls=calls, **outcome(fn))
        """,
    )
    assert result["calls"] == [0, 1, 2, 3]
    assert result["raised"] == "RestartAbort" and "iteration=4" in str(result["message"])


def test_a_retried_function_returns_its_value(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """
        n = []
        @inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=4), **KW)
        def fn(a, b=2):
            n.append(1)
            if len(n) < 3:
                raise RuntimeError
            return a + b
        report(**outcome(fn, 40))
        """,
    )
    assert result == {"returned": 42}


CALLBACK_CASES = {
    "finalize_raises": (
        "class F(inprocess.finalize.Finalize):\n    def __call__(self, state):\n"
        "        raise ZeroDivisionError\nextra = dict(finalize=F())",
        "ZeroDivisionError",
    ),
    "finalize_writes_frozen_state": (
        "class F(inprocess.finalize.Finalize):\n    def __call__(self, state):\n"
        "        state.rank = 0\n        return state\nextra = dict(finalize=F())",
        "FrozenInstanceError",
    ),
    "health_check_raises": (
        "class H(inprocess.health_check.HealthCheck):\n    def __call__(self, state):\n"
        "        raise ZeroDivisionError\nextra = dict(health_check=H())",
        "HealthCheckError",
    ),
    "initialize_writes_frozen_state": (
        "class I(inprocess.initialize.Initialize):\n    def __call__(self, state):\n"
        "        state.rank = 0\n        return state\n"
        "extra = dict(initialize=inprocess.Compose(I(), inprocess.initialize.RetryController(max_iterations=1)))",
        "RestartAbort",
    ),
    "abort_raises": (
        "class A(inprocess.abort.Abort):\n    def __call__(self, state):\n"
        "        raise ZeroDivisionError\nextra = dict(abort=A())",
        "RestartAbort",
    ),
}


@pytest.mark.parametrize("case", sorted(CALLBACK_CASES))
def test_callbacks_get_nvidias_arguments_and_their_failures_end_as_nvidias(
    tmp_path: Path, case: str
) -> None:
    setup, expected = CALLBACK_CASES[case]
    kwargs = "initialize=inprocess.initialize.RetryController(max_iterations=2), "
    if "initialize=" in setup:
        kwargs = ""
    result = run(
        tmp_path,
        setup
        + f"""
@inprocess.Wrapper({kwargs}**extra, **KW)
def fn():
    raise RuntimeError("fault")
report(**outcome(fn))
""",
    )
    assert result["raised"] == expected, result


def test_a_transiently_unhealthy_rank_goes_on(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """
        class H(inprocess.health_check.HealthCheck):
            failed = False
            def __call__(self, state):
                if not H.failed:
                    H.failed = True
                    raise ZeroDivisionError
                return state
        @inprocess.Wrapper(health_check=H(), **KW)
        def fn():
            return 5
        report(**outcome(fn))
        """,
    )
    assert result == {"returned": 5}


def test_rank_should_restart_and_base_exceptions(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """
        @inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=2), **KW)
        def restart():
            raise inprocess.monitor_thread.RankShouldRestart
        @inprocess.Wrapper(**KW)
        def leave():
            raise SystemExit(3)
        report(restart=outcome(restart), leave=outcome(leave))
        """,
    )
    assert result["restart"] == {"raised": "RestartAbort", "message": result["restart"]["message"]}  # type: ignore[index]
    assert result["leave"]["raised"] == "SystemExit"  # type: ignore[index]


def test_an_initialized_process_group_is_refused(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """
        torch.distributed.init_process_group("gloo")
        @inprocess.Wrapper(**KW)
        def fn():
            pass
        result = outcome(fn)
        torch.distributed.destroy_process_group()
        report(**result, is_value_error=isinstance(ValueError(), ValueError))
        """,
    )
    assert result["raised"] == "ConfigError"  # a ValueError, as NVIDIA's
    assert "not torch.distributed.is_initialized()" in str(result["message"])


def test_monitor_process_pid_file_and_log_file(tmp_path: Path) -> None:
    pidfile = tmp_path / "monitor_{rank}.pid"
    logfile = tmp_path / "monitor_{rank}.log"
    result = run(
        tmp_path,
        f"""
        @inprocess.Wrapper(monitor_process_pidfile={str(pidfile)!r},
                           monitor_process_logfile={str(logfile)!r}, **KW)
        def fn():
            return 1
        report(**outcome(fn))
        """,
    )
    assert result == {"returned": 1}
    pid = (tmp_path / "monitor_0.pid").read_text().strip()
    assert pid.isdigit() and int(pid) > 0
    log = (tmp_path / "monitor_0.log").read_text()
    assert "monitor_process" in log and "target_pid" in log


def test_a_rank_that_stalls_in_every_iteration_ends_at_the_hard_timeout(tmp_path: Path) -> None:
    """As NVIDIA's monitor process ends it: SIGTERM (default action: killed by it)."""
    done = start(
        tmp_path,
        """
        @inprocess.Wrapper(**{**KW, "soft_timeout": T(seconds=0.5), "hard_timeout": T(seconds=2),
                              "barrier_timeout": T(seconds=30), "heartbeat_timeout": T(seconds=20)})
        def fn(call_wrapper: inprocess.CallWrapper = None):
            print("ITERATION", call_wrapper.iteration, flush=True)
            time.sleep(3600)  # the GIL is released: no progress, every time
        report(**outcome(fn))
        """,
    )
    assert done.returncode == -signal.SIGTERM, done.stdout[-2000:] + done.stderr[-4000:]
    assert "RESULT" not in done.stdout
    assert 3 <= done.stdout.count("ITERATION") < 12, done.stdout
    assert "across restarts" in done.stderr and "terminating" in done.stderr


def test_a_stalled_rank_s_own_sigterm_handler_runs(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        """
        import signal
        def on_term(signum, frame):
            report(signal=signum)
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        @inprocess.Wrapper(**{**KW, "soft_timeout": T(seconds=0.5), "hard_timeout": T(seconds=2),
                              "termination_grace_time": T(seconds=5)})
        def fn():
            time.sleep(3600)
        report(**outcome(fn))
        """,
    )
    assert result == {"signal": 15}
