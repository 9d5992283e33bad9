"""record() in real worker processes, and compatibility with torch's error files both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relaunch.errors import ChildFailedError, ErrorRecord, ProcessFailure, read_error_file

TIMEOUT = 100  # a worker importing torch on a loaded 2-core machine can be slow


def _run(tmp_path: Path, body: str, error_file: str | None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    return subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


RAISES = """
    import faulthandler
    from relaunch.errors import record

    @record
    def main(x):
        print("faulthandler", faulthandler.is_enabled(), flush=True)
        raise ValueError(f"bad value {x}")

    main(42)
"""


def test_record_writes_error_file_torch_can_read(tmp_path: Path) -> None:
    error_file = str(tmp_path / "error.json")
    proc = _run(tmp_path, RAISES, error_file)
    assert proc.returncode == 1
    assert "faulthandler True" in proc.stdout
    assert "ValueError: bad value 42" in proc.stderr  # re-raised
    data = json.loads(Path(error_file).read_text())
    assert data["message"]["message"] == "ValueError: bad value 42"
    assert "raise ValueError" in data["message"]["extraInfo"]["py_callstack"]
    assert data["message"]["extraInfo"]["timestamp"].isdigit()

    ours = ProcessFailure(0, 1234, proc.returncode, error_file)
    assert ours.message == "ValueError: bad value 42"
    assert ours.timestamp == int(data["message"]["extraInfo"]["timestamp"])

    from torch.distributed.elastic.multiprocessing.errors import (
        ProcessFailure as TorchProcessFailure,
    )

    theirs = TorchProcessFailure(0, 1234, proc.returncode, error_file)
    assert theirs.timestamp == ours.timestamp
    assert theirs.message["message"] == ours.message  # type: ignore[index]
    assert theirs.message["extraInfo"]["py_callstack"] == ours.traceback  # type: ignore[index]


def test_torch_record_file_is_read_and_torch_child_failed_error_is_copied(tmp_path: Path) -> None:
    torch_file = str(tmp_path / "torch_error.json")
    copied_file = str(tmp_path / "copied.json")
    body = f"""
        import os
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError, ProcessFailure, record as torch_record)
        from relaunch.errors import record

        @torch_record
        def torch_main():
            raise KeyError("from torch record")

        try:
            torch_main()
        except KeyError:
            pass

        @record
        def nanny():
            failure = ProcessFailure(3, 99, 1, {torch_file!r})
            raise ChildFailedError("trainer", {{7: failure}})

        os.environ["TORCHELASTIC_ERROR_FILE"] = {copied_file!r}
        try:
            nanny()
        except ChildFailedError:
            print("re-raised")
    """
    proc = _run(tmp_path, body, torch_file)
    assert proc.returncode == 0, proc.stderr
    assert "re-raised" in proc.stdout
    result = read_error_file(torch_file)
    assert isinstance(result, ErrorRecord)
    assert result.message == "KeyError: 'from torch record'"
    assert result.traceback is not None and "from torch record" in result.traceback
    failure = ProcessFailure(0, 4321, 1, torch_file)
    assert failure.timestamp == result.timestamp and failure.problem is None
    assert Path(copied_file).read_bytes() == Path(torch_file).read_bytes()


def test_child_failed_error_copies_root_cause_file_unchanged(tmp_path: Path) -> None:
    children = tmp_path / "children"
    children.mkdir()
    own = str(tmp_path / "own.json")
    body = f"""
        import os
        from relaunch.errors import ChildFailedError, ProcessFailure, record
        from relaunch.errors import build_error_data, write_error_file

        def child_file(name, when):
            path = os.path.join({str(children)!r}, name)
            try:
                raise RuntimeError(name)
            except RuntimeError as exc:
                write_error_file(path, build_error_data(exc, now=when))
            return path

        late = ProcessFailure(0, 10, 1, child_file("late", 2000.0))
        early = ProcessFailure(1, 11, 1, child_file("early", 1000.0))
        killed = ProcessFailure(2, 12, -9, "<N/A>")

        @record
        def nanny():
            raise ChildFailedError("trainer", {{0: late, 1: early, 2: killed}})

        nanny()
    """
    proc = _run(tmp_path, body, own)
    assert proc.returncode == 1
    assert "Root Cause (first observed failure)" in proc.stderr
    assert Path(own).read_bytes() == (children / "early").read_bytes()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("raise SystemExit(0)", 0),
        ("raise SystemExit(None)", 0),
        ("raise SystemExit(3)", 3),
        ("raise KeyboardInterrupt", -2),  # Python re-kills itself with SIGINT
        ("return 5", 0),
    ],
)
def test_exits_that_write_nothing(tmp_path: Path, body: str, code: int) -> None:
    error_file = tmp_path / "error.json"
    script = f"""
        from relaunch.errors import record

        @record
        def main():
            {body}

        print("returned", main())
    """
    proc = _run(tmp_path, script, str(error_file))
    assert proc.returncode == code, proc.stderr
    assert not error_file.exists()
    if code == 0 and "SystemExit(0)" in body:
        assert "returned None" in proc.stdout  # SystemExit(0) is success, like torch


def test_no_error_file_env_logs_only(tmp_path: Path) -> None:
    proc = _run(tmp_path, RAISES, None)
    assert proc.returncode == 1
    assert "TORCHELASTIC_ERROR_FILE is not set" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["worker.py"]


def test_unwritable_error_file_does_not_hide_the_exception(tmp_path: Path) -> None:
    proc = _run(tmp_path, RAISES, str(tmp_path / "missing-dir" / "error.json"))
    assert proc.returncode == 1
    assert "could not write error file" in proc.stderr
    assert "ValueError: bad value 42" in proc.stderr


def test_agent_report_from_real_failed_workers(tmp_path: Path) -> None:
    """Several real workers fail; the report names the earliest as the root cause."""
    files = [str(tmp_path / f"err{i}.json") for i in range(2)]
    first = _run(tmp_path, RAISES, files[0])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    assert killed.wait(timeout=TIMEOUT) == -9
    failures = {
        0: ProcessFailure(0, 1000, first.returncode, files[0]),
        1: ProcessFailure(1, killed.pid, killed.returncode, files[1]),
    }
    report = ChildFailedError("worker.py", failures)
    rank, root = report.get_first_failure()
    assert root.timestamp <= failures[1].timestamp
    if rank == 0:
        assert "ValueError: bad value 42" in str(report).split("Other Failures")[0]
    assert f"Signal 9 (SIGKILL) received by PID {killed.pid}" in str(report)
