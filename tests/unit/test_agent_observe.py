"""The agent's reading of the worker contract: announced exits, progress, the hung rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relaunch._contract import AttemptFiles, ExitRecord, read_exit_file
from relaunch.agent._core import oldest_hung
from relaunch.agent._worker_files import announced_exit, last_progress, returned_at


@pytest.fixture
def files(tmp_path: Path) -> AttemptFiles:
    return AttemptFiles.in_dir(str(tmp_path))


def test_no_file_no_announced_exit(files: AttemptFiles) -> None:
    assert announced_exit(files) is None


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "[]",
        '{"version": 3, "exitcode": 1, "time": 1.0}',
        '{"version": 1, "exitcode": 1, "time": 1.0}',
        '{"version": 2}',
        '{"version": 2, "exitcode": 1}',
        '{"version": 2, "exitcode": "1", "time": 1.0}',
        '{"version": 2, "exitcode": true, "time": 1.0}',
        '{"version": 2, "exitcode": 0, "time": "1.0"}',
        '{"version": 2, "exitcode": 0, "time": NaN}',
    ],
)
def test_a_corrupt_exit_file_is_ignored(files: AttemptFiles, content: str) -> None:
    Path(files.exit_file).write_text(content)
    assert read_exit_file(files.exit_file) is None
    assert announced_exit(files) is None
    assert returned_at(files) is None


def test_an_exit_file_announces_its_code(files: AttemptFiles) -> None:
    Path(files.exit_file).write_text(json.dumps({"version": 2, "exitcode": 3, "time": 1.0}))
    assert read_exit_file(files.exit_file) == ExitRecord(exitcode=3, time=1.0)
    assert announced_exit(files) == 3
    assert returned_at(files) is None


def test_an_exit_file_with_status_0_says_the_script_returned(files: AttemptFiles) -> None:
    Path(files.exit_file).write_text(json.dumps({"version": 2, "exitcode": 0, "time": 5.5}))
    assert read_exit_file(files.exit_file) == ExitRecord(exitcode=0, time=5.5)
    assert announced_exit(files) is None  # not a failure
    assert returned_at(files) == 5.5
    Path(files.error_file).write_text('{"message": "ValueError: x"}')
    assert announced_exit(files) is None  # it returned: an error file changes nothing
    Path(files.marker).write_text("")
    assert returned_at(files) == 5.5  # in-process workers that returned too


def test_a_complete_error_file_is_a_failure_a_partial_one_is_not_yet(
    files: AttemptFiles,
) -> None:
    Path(files.error_file).write_text('{"message": {"message": "ValueError: x", "extra')
    assert announced_exit(files) is None  # @record may still be writing it
    Path(files.error_file).write_text('{"message": "ValueError: x"}')
    assert announced_exit(files) == 1


def test_in_process_workers_announce_nothing(files: AttemptFiles) -> None:
    Path(files.marker).write_text("")
    Path(files.exit_file).write_text(json.dumps({"version": 2, "exitcode": 3, "time": 1.0}))
    assert announced_exit(files) is None


def test_progress_is_the_later_of_start_and_the_file(files: AttemptFiles) -> None:
    assert last_progress(files, started=100.0) is None  # not started by the runner (yet)
    Path(files.progress_file).write_text("")
    os.utime(files.progress_file, (50.0, 50.0))
    assert last_progress(files, started=100.0) == 100.0
    os.utime(files.progress_file, (150.0, 150.0))
    assert last_progress(files, started=100.0) == 150.0


def test_the_rank_that_stopped_first_is_the_hung_one() -> None:
    assert oldest_hung({0: 100.0, 1: 101.0}, now=103.0, timeout=5.0) is None
    assert oldest_hung({0: 100.3, 1: 100.1, 2: 104.0}, now=105.5, timeout=5.0) == 1
    assert oldest_hung({0: 100.0, 1: 100.0}, now=106.0, timeout=5.0) == 0


def test_the_contract_names_its_files_in_the_environment(files: AttemptFiles) -> None:
    assert set(files.env(None)) == {"RELAUNCH_INPROCESS_MARKER", "RELAUNCH_EXIT_FILE"}
    env = files.env(2.5)
    assert env["RELAUNCH_HANG_TIMEOUT"] == "2.5"
    assert env["RELAUNCH_PROGRESS_FILE"] == files.progress_file
    assert int(env["RELAUNCH_STACK_SIGNAL"]) > 0
