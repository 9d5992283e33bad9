"""The public surface of the launcher's packages, pinned (a change here is an API change)."""

from __future__ import annotations

import subprocess
import sys

import relaunch
import relaunch.agent
import relaunch.events
import relaunch.launcher
import relaunch.procs
import relaunch.rendezvous.static


def test_top_level() -> None:
    assert relaunch.__all__ == ["RelaunchError", "__version__"]


def test_agent() -> None:
    assert sorted(relaunch.agent.__all__) == [
        "LocalAgent",
        "RoundHook",
        "RoundStart",
        "RunResult",
        "SnapshotFacts",
        "SnapshotSource",
        "Worker",
        "WorkerGroup",
        "WorkerSpec",
        "WorkerState",
        "worker_env",
    ]


def test_launcher() -> None:
    assert sorted(relaunch.launcher.__all__) == [
        "build_spec",
        "create_rendezvous_handler",
        "launch",
    ]


def test_procs() -> None:
    assert sorted(relaunch.procs.__all__) == [
        "Entrypoint",
        "ForkServer",
        "ProcessSpec",
        "RunLogDir",
        "Standby",
        "Std",
        "TeeTarget",
        "WorkerProcesses",
        "is_stopped",
        "process_state",
        "raise_open_files_limit",
        "set_child_subreaper",
        "terminate",
    ]


def test_events_and_static_rendezvous() -> None:
    # one frozen dataclass per event (the detail), the envelope, the sink
    details = {name for name, value in vars(relaunch.events).items() if hasattr(value, "metadata")}
    assert sorted(relaunch.events.__all__) == sorted(
        {"EVENT_VERSION", "Cause", "Detail", "Emit", "Event", "EventSink"}
        | (details - {"_Detail", "Event"})
    )
    assert len(details) == 26, details  # 25 events and their base
    assert sorted(relaunch.rendezvous.static.__all__) == [
        "STATIC_CONF_KEYS",
        "StandaloneRendezvousHandler",
        "StaticRendezvousHandler",
        "create_static_handler",
    ]


def test_the_agent_side_never_imports_torch() -> None:
    code = (
        "import sys, relaunch, relaunch.agent, relaunch.cli, relaunch.procs, relaunch.store.tcp, "
        "relaunch.rendezvous.registry, relaunch.timer, relaunch.errors; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
