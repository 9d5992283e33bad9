"""What the launcher reads from workers and the file system is not trusted: control
characters in an error file are shown, not obeyed; an unusable --log-dir is one line
and exit 2 before anything starts; a failed run keeps its error files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ESC = "\x1b"

FAIL_WITH_ESCAPES = """
import json, os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump({"message": {"message": "ValueError: bad \\x1b[2J\\x1b]0;owned\\x07 batch",
               "extraInfo": {"py_callstack": "Traceback:\\n  \\x1b[31mred\\x1b[0m", "timestamp": "1"}}}, f)
sys.exit(1)
"""


def relaunch(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", "--standalone", "--nproc-per-node=1", *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp,
        env={**os.environ, "TMPDIR": str(tmp), **env},
    )


def test_escape_sequences_of_an_error_file_are_shown_not_obeyed(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(FAIL_WITH_ESCAPES)
    done = relaunch(tmp_path, "fail.py")
    assert done.returncode == 1
    assert ESC not in done.stderr, done.stderr
    assert "\\x1b[2J" in done.stderr and "\\x07" in done.stderr


def test_a_failed_run_keeps_its_error_files_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text("raise ValueError('bad batch')\n")
    done = relaunch(tmp_path, "fail.py")
    assert done.returncode == 1
    kept = [line for line in done.stderr.splitlines() if "are kept in" in line]
    assert len(kept) == 1, done.stderr
    run_dir = Path(kept[0].rsplit(" ", 1)[1])
    error_files = list(run_dir.glob("attempt_*/*/error.json"))
    assert error_files and "bad batch" in error_files[0].read_text()
    assert str(error_files[0]) in done.stderr  # the report's error_file can be opened
    assert json.loads(error_files[0].read_text())["message"]


def test_a_successful_run_leaves_no_temporary_dir(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('fine')\n")
    done = relaunch(tmp_path, "ok.py")
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.glob("relaunch_*"))


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_log_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("raise SystemExit('must never run')\n")
    (tmp_path / "file").write_text("")
    done = relaunch(tmp_path, "--log-dir=file", "ok.py")
    assert done.returncode == 2 and "--log-dir" in one_line(done)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
@pytest.mark.parametrize("options", ["ro", "size=8k"], ids=["read-only", "no-space"])
def test_an_unusable_log_dir_is_one_line_and_exit_2(tmp_path: Path, options: str) -> None:
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a mount namespace")
    (tmp_path / "ok.py").write_text("raise SystemExit('must never run')\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fill = "" if options == "ro" else f"&& head -c 16384 /dev/zero > {mnt}/full 2>/dev/null; "
    script = (
        f"mount -t tmpfs -o {options} none {mnt} {fill or '&& '}"
        f"exec {sys.executable} -m relaunch --standalone --log-dir={mnt}/logs ok.py"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert "--log-dir" in line and "writable directory" in line
