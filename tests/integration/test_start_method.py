"""``--start-method`` acts: ``fork``/``forkserver`` fork replacement workers from the fork
server, ``spawn`` starts a fresh interpreter for each; ``--[no-]warm-standby``, its older
spelling, agrees with it or the command is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relaunch.cli import parse_args
from relaunch.errors import ConfigError

PY = sys.executable

FAILS_ONCE = """
import os, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(5)  # the fork server is ready while the first attempt runs
    sys.exit(1)
"""


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(FAILS_ONCE))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "method", "warm"),
    [
        ([], "forkserver", True),
        (["--start-method", "fork"], "fork", True),
        (["--start_method=forkserver"], "forkserver", True),
        (["--start-method", "spawn"], "spawn", False),
        (["--no-warm-standby"], "spawn", False),
        (["--warm-standby"], "forkserver", True),
        (["--start-method", "spawn", "--no-warm-standby"], "spawn", False),
        (["--start-method", "fork", "--warm-standby"], "fork", True),
    ],
)
def test_start_method_and_warm_standby_agree(
    script: str, argv: list[str], method: str, warm: bool
) -> None:
    config = parse_args([*argv, script])
    assert (config.start_method, config.warm_standby) == (method, warm)


def test_start_method_from_the_environment(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_START_METHOD", "spawn")
    assert parse_args([script]).warm_standby is False
    assert parse_args(["--start-method", "fork", script]).warm_standby is True


@pytest.mark.parametrize(
    "argv",
    [
        ["--start-method", "spawn", "--warm-standby"],
        ["--start-method", "fork", "--no-warm-standby"],
        ["--start-method", "forkserver", "--no_warm_standby"],
    ],
)
def test_a_contradicting_warm_standby_is_refused(script: str, argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"warm.standby: contradicts --start.method"):
        parse_args([*argv, script])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("method", "forked"), [("fork", [0, 1]), ("spawn", [])])
def test_replacements_are_forked_only_with_a_fork_start_method(
    tmp_path: Path, script: str, method: str, forked: list[int]
) -> None:
    logs = tmp_path / "logs"
    done = subprocess.run(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         f"--start-method={method}", "--log-dir", str(logs), script],
        capture_output=True, text=True, timeout=80, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = [
        json.loads(line) for line in next(logs.glob("*/events.jsonl")).read_text().splitlines()
    ]
    started = [e["metadata"] for e in events if e["name"] == "workers_started"]
    assert len(started) == 2, started
    assert started[0]["forked"] == []  # the first attempt is always fresh interpreters
    assert started[1]["forked"] == forked
