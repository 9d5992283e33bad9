"""The public surface of relaunch.errors and relaunch.timer is pinned; importing needs no torch."""

from __future__ import annotations

import subprocess
import sys

import relaunch.errors
import relaunch.timer

ERRORS = {
    "ERROR_FILE_ENV",
    "ChildFailedError",
    "ConfigError",
    "ErrorFileProblem",
    "ErrorRecord",
    "FailureFormatError",
    "InProcessError",
    "ProblemKind",
    "ProcessFailure",
    "RelaunchError",
    "RendezvousClosedError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "SnapshotError",
    "StatusError",
    "StoreClosedError",
    "StoreConnectionError",
    "StoreLostError",
    "StoreError",
    "StoreTimeoutError",
    "TimerError",
    "WorkerError",
    "build_error_data",
    "read_error_file",
    "record",
    "write_error_file",
}
TIMER = {
    "TIMER_FILE_ENV",
    "TimerClient",
    "TimerExpiry",
    "TimerRequest",
    "TimerServer",
    "expires",
    "parse_request",
}


def test_public_names() -> None:
    assert set(relaunch.errors.__all__) == ERRORS
    assert set(relaunch.timer.__all__) == TIMER
    for module in (relaunch.errors, relaunch.timer):
        for name in module.__all__:
            assert getattr(module, name) is not None


def test_import_does_not_import_torch() -> None:
    code = "import sys, relaunch.errors, relaunch.timer; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
