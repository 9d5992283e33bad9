"""ProcessFailure and ChildFailedError: messages, root cause, report, JSON round trip."""

from __future__ import annotations

import json
import pickle
import socket
from pathlib import Path

import pytest

from relaunch.errors import (
    ChildFailedError,
    ConfigError,
    FailureFormatError,
    ProcessFailure,
    WorkerError,
    build_error_data,
    write_error_file,
)


def _error_file(tmp_path: Path, name: str, exc: Exception, when: float) -> str:
    path = str(tmp_path / f"{name}.json")
    try:
        raise exc
    except Exception as caught:
        write_error_file(path, build_error_data(caught, now=when))
    return path


def test_failure_from_error_file(tmp_path: Path) -> None:
    path = _error_file(tmp_path, "r0", ValueError("bad input"), 1000.25)
    failure = ProcessFailure(0, 4321, 1, path)
    assert failure.message == "ValueError: bad input"
    assert failure.timestamp == 1000 and failure.time == 1000.25
    assert failure.traceback is not None and "ValueError: bad input" in failure.traceback
    assert failure.error_file == path
    assert failure.error_file_data["message"]["message"] == "ValueError: bad input"
    assert failure.problem is None
    assert failure.hostname == socket.gethostname()
    assert failure.signal_name() == "<N/A>"


def test_failure_by_signal_without_file(tmp_path: Path) -> None:
    failure = ProcessFailure(2, 1234, -9, str(tmp_path / "absent.json"))
    assert failure.message == "Signal 9 (SIGKILL) received by PID 1234"
    assert failure.signal_name() == "SIGKILL"
    assert failure.error_file == "<N/A>"
    assert failure.error_file_data == {"message": "<NONE>"}
    assert failure.traceback is None


def test_failure_by_unknown_signal_and_exit_code(tmp_path: Path) -> None:
    assert ProcessFailure(0, 7, -200, "<N/A>").signal_name() == "<N/A>"
    failure = ProcessFailure(0, 7, 3, "<N/A>")
    assert "exit code 3" in failure.message and "@record" in failure.message


@pytest.mark.parametrize(
    ("content", "word"), [("", "empty"), ('{"message": {"mes', "truncated"), ("zz", "not JSON")]
)
def test_corrupt_file_is_reported_with_exit_code(tmp_path: Path, content: str, word: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    failure = ProcessFailure(1, 55, 17, str(path))
    assert failure.problem is not None and word in failure.problem
    assert word in failure.message and "exit code 17" in failure.message
    assert failure.error_file == str(path)
    signalled = ProcessFailure(1, 55, -11, str(path))
    assert "Signal 11 (SIGSEGV) received by PID 55" in signalled.message


def test_json_round_trip(tmp_path: Path) -> None:
    path = _error_file(tmp_path, "r0", RuntimeError("x"), 50.5)
    for failure in (ProcessFailure(0, 10, 1, path), ProcessFailure(1, 11, -15, "<N/A>")):
        wire = json.dumps(failure.to_json())
        back = ProcessFailure.from_json(json.loads(wire))
        assert back == failure
        assert back.to_json() == failure.to_json()
        assert back.time == failure.time and back.error_file_data == failure.error_file_data


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(version=2),
        lambda d: d.pop("pid"),
        lambda d: d.update(pid="12"),
        lambda d: d.update(exitcode=True),
        lambda d: d.update(traceback=3),
        lambda d: d.update(error_file_data=[]),
        lambda d: d.update(timestamp=1700000000000),  # milliseconds: no date to show
        lambda d: d.update(time=10**400),  # a float cannot hold it
        lambda d: d.update(time=float("nan")),
    ],
)
def test_from_json_is_strict(mutate: object) -> None:
    data = ProcessFailure(0, 10, -9, "<N/A>").to_json()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(FailureFormatError):
        ProcessFailure.from_json(data)
    with pytest.raises(FailureFormatError):
        ProcessFailure.from_json([1])


def test_root_cause_is_earliest_among_ranks(tmp_path: Path) -> None:
    failures = {
        0: ProcessFailure(0, 100, 1, _error_file(tmp_path, "a", ValueError("late"), 3000.9)),
        1: ProcessFailure(1, 101, 1, _error_file(tmp_path, "b", ValueError("first"), 2000.7)),
        2: ProcessFailure(2, 102, 1, _error_file(tmp_path, "c", ValueError("same s"), 2000.2)),
        3: ProcessFailure(3, 103, -9, "<N/A>"),
    }
    error = ChildFailedError("train.py", failures)
    assert error.get_first_failure() == (2, failures[2])
    assert isinstance(error, WorkerError)
    text = str(error)
    assert text == error.format_msg()
    head, others = text.split("Other Failures:")
    assert "train.py FAILED" in head
    assert "Root Cause (first observed failure):" in head
    assert "ValueError: same s" in head and "rank      : 2 (local_rank: 2)" in head
    assert f"host      : {socket.gethostname()}" in head
    assert "late" in others and "first" in others and "Signal 9 (SIGKILL)" in others
    assert "exitcode  : -9 (SIGKILL, pid: 103)" in others


def test_report_single_failure_and_pickle(tmp_path: Path) -> None:
    error = ChildFailedError("job", {5: ProcessFailure(1, 9, -15, "<N/A>")})
    assert "<NO_OTHER_FAILURES>" in str(error)
    clone = pickle.loads(pickle.dumps(error))
    assert str(clone) == str(error) and clone.failures == error.failures


def test_report_needs_failures() -> None:
    with pytest.raises(ConfigError):
        ChildFailedError("job", {})


def test_report_json_round_trip(tmp_path: Path) -> None:
    path = _error_file(tmp_path, "r0", ValueError("v"), 10.0)
    error = ChildFailedError(
        "job", {0: ProcessFailure(0, 1, 1, path), 8: ProcessFailure(0, 2, -6, "<N/A>")}
    )
    back = ChildFailedError.from_json(json.loads(json.dumps(error.to_json())))
    assert back.failures == error.failures and back.name == "job"
    assert str(back) == str(error)
    for bad in (
        {},
        {"version": 1, "name": "x", "failures": {}},
        {"version": 1, "name": "x", "failures": {"zero": error.failures[0].to_json()}},
    ):
        with pytest.raises(FailureFormatError):
            ChildFailedError.from_json(bad)
