"""Error files: strict reading of every kind of bad file, torch's two layouts, atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relaunch.errors import (
    ErrorFileProblem,
    ErrorRecord,
    ProblemKind,
    build_error_data,
    read_error_file,
    write_error_file,
)

TORCH_LAYOUT = {
    "message": {
        "message": "ValueError: boom",
        "extraInfo": {"py_callstack": "Traceback (most recent call last):\n...", "timestamp": "17"},
    }
}


def _write(tmp_path: Path, content: str | bytes) -> str:
    path = tmp_path / "error.json"
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    return str(path)


def _problem(path: str) -> ErrorFileProblem:
    result = read_error_file(path)
    assert isinstance(result, ErrorFileProblem), result
    return result


def test_reads_torch_layout(tmp_path: Path) -> None:
    result = read_error_file(_write(tmp_path, json.dumps(TORCH_LAYOUT)))
    assert isinstance(result, ErrorRecord)
    assert result.message == "ValueError: boom"
    assert result.traceback is not None and result.traceback.startswith("Traceback")
    assert result.timestamp == 17
    assert result.time is None
    assert result.error_code is None
    assert result.data == TORCH_LAYOUT


def test_reads_string_message_layout_and_error_code(tmp_path: Path) -> None:
    result = read_error_file(_write(tmp_path, '{"message": "oops", "timestamp": 5}'))
    assert isinstance(result, ErrorRecord)
    assert (result.message, result.timestamp, result.traceback) == ("oops", 5, None)
    data = json.loads(json.dumps(TORCH_LAYOUT))
    data["message"]["errorCode"] = -9
    result = read_error_file(_write(tmp_path, json.dumps(data)))
    assert isinstance(result, ErrorRecord) and result.error_code == -9


def test_missing_file(tmp_path: Path) -> None:
    assert _problem(str(tmp_path / "nope.json")).kind is ProblemKind.MISSING


def test_unreadable_path(tmp_path: Path) -> None:
    assert _problem(str(tmp_path)).kind is ProblemKind.UNREADABLE


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        ("", ProblemKind.EMPTY),
        ("  \n", ProblemKind.EMPTY),
        ('{"message": {"message": "ValueError: bo', ProblemKind.TRUNCATED),
        ('{"message": 1,', ProblemKind.TRUNCATED),
        ("Segmentation fault", ProblemKind.NOT_JSON),
        ('{"message": "x"} trailing', ProblemKind.NOT_JSON),
        (b"\xff\xfe\x00garbage", ProblemKind.NOT_JSON),
        ("[1, 2]", ProblemKind.WRONG_SHAPE),
        ('{"msg": "x"}', ProblemKind.WRONG_SHAPE),
        ('{"message": 3}', ProblemKind.WRONG_SHAPE),
        ('{"message": {"extraInfo": {}}}', ProblemKind.WRONG_SHAPE),
        ('{"message": {"message": "x", "extraInfo": []}}', ProblemKind.WRONG_SHAPE),
        (
            '{"message": {"message": "x", "extraInfo": {"timestamp": "soon"}}}',
            ProblemKind.WRONG_SHAPE,
        ),
        (
            '{"message": {"message": "x", "extraInfo": {"py_callstack": 7}}}',
            ProblemKind.WRONG_SHAPE,
        ),
        ('{"message": {"message": "x", "errorCode": "9"}}', ProblemKind.WRONG_SHAPE),
        ('{"message": "x", "timestamp": NaN}', ProblemKind.WRONG_SHAPE),
    ],
)
def test_bad_files_are_described_not_raised(
    tmp_path: Path, content: str | bytes, kind: ProblemKind
) -> None:
    path = _write(tmp_path, content)
    problem = _problem(path)
    assert problem.kind is kind
    assert problem.path == path
    assert path in problem.describe() and kind.value in problem.describe()


def test_deeply_nested_json_is_a_problem(tmp_path: Path) -> None:
    path = _write(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert _problem(path).kind in (ProblemKind.NOT_JSON, ProblemKind.WRONG_SHAPE)


def test_build_and_write_round_trip(tmp_path: Path) -> None:
    try:
        raise KeyError("missing")
    except KeyError as exc:
        data = build_error_data(exc, now=1234.5)
    path = str(tmp_path / "error.json")
    write_error_file(path, data)
    result = read_error_file(path)
    assert isinstance(result, ErrorRecord)
    assert result.message == "KeyError: 'missing'"
    assert result.timestamp == 1234 and result.time == 1234.5
    assert result.traceback is not None and "raise KeyError" in result.traceback
    # torch's layout: timestamp is a string of digits.
    assert data["message"]["extraInfo"]["timestamp"] == "1234"
    assert os.listdir(tmp_path) == ["error.json"]


def test_write_bytes_replaces_unchanged(tmp_path: Path) -> None:
    path = _write(tmp_path, "old")
    write_error_file(path, b'{"message": "copied"}')
    assert Path(path).read_bytes() == b'{"message": "copied"}'
    assert os.listdir(tmp_path) == ["error.json"]


def test_write_into_missing_directory_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        write_error_file(str(tmp_path / "no" / "error.json"), {"message": "x"})


def test_named_pipe_or_device_is_unreadable_not_a_hang(tmp_path: Path) -> None:
    pipe = tmp_path / "error.json"
    os.mkfifo(pipe)
    assert _problem(str(pipe)).kind is ProblemKind.UNREADABLE
    assert _problem("/dev/zero").kind is ProblemKind.UNREADABLE


def test_times_out_of_range_are_left_out_and_huge_numbers_are_refused(tmp_path: Path) -> None:
    """A timestamp in milliseconds (its date out of range failed the failure's report,
    in place of the summary), a huge ``relaunch_time`` (an OverflowError), an int of
    5,000 digits (json's ValueError, past the handler): the record is read without the
    time, or refused as malformed; read_error_file never raises."""
    data = json.loads(json.dumps(TORCH_LAYOUT))
    data["message"]["extraInfo"]["timestamp"] = "1700000000000"
    data["message"]["extraInfo"]["relaunch_time"] = 10**400
    result = read_error_file(_write(tmp_path, json.dumps(data)))
    assert isinstance(result, ErrorRecord)
    assert (result.timestamp, result.time, result.message) == (None, None, "ValueError: boom")
    result = read_error_file(_write(tmp_path, '{"message": "x", "timestamp": ' + "9" * 5000 + "}"))
    assert isinstance(result, ErrorFileProblem)
