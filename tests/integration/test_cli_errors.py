"""``python -m relaunch`` refuses bad command lines: exit code 2 and exactly one stderr line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.pop("PYTHON_EXEC", None)
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("raise SystemExit('must never run')\n")
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nnodes", "3:2", "train.py"], "--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
        (["--nnodes", "0", "train.py"], "--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '0'"),
        (["--nproc-per-node", "0", "train.py"], "--nproc-per-node: expected a number >= 1, auto, cpu, gpu or xpu, got '0'"),
        (["--nproc_per_node", "-1", "train.py"], "--nproc_per_node: expected a number >= 1, auto, cpu, gpu or xpu, got '-1'"),
        (["--nproc-per-node=abc", "train.py"], "--nproc-per-node: expected a number >= 1, auto, cpu, gpu or xpu, got 'abc'"),
        (["--max-restarts", "-1", "train.py"], "--max-restarts: expected an integer >= 0, got '-1'"),
        (["--rdzv-backend", "zookeeper", "train.py"], "--rdzv-backend: expected one of static, c10d, etcd, got 'zookeeper'"),
        (["missing.py"], "training_script: expected an existing Python script, got 'missing.py'"),
        (["-m", "no_such_module_relaunch_test"], "-m/--module: expected an importable module, got 'no_such_module_relaunch_test'"),
        (["--no-python", "no-such-binary-relaunch-test"], "--no-python: expected an executable file or a program on PATH, got 'no-such-binary-relaunch-test'"),
        (["--rdzv-conf", "a=1,b", "train.py"], "--rdzv-conf: expected KEY=VALUE,... with a non-empty key and value in each item, got 'a=1,b'"),
        (["--monitor-interval", "0", "train.py"], "--monitor-interval: expected a finite number > 0, got '0'"),
        (["-r", "5", "train.py"], "-r: expected 0-3 or LOCAL_RANK:0-3,... (e.g. 0:1,1:2), got '5'"),
        (["--tee", "0:x", "train.py"], "--tee: expected 0-3 or LOCAL_RANK:0-3,... (e.g. 0:1,1:2), got '0:x'"),
        (["--local-ranks-filter", "0,a", "train.py"], "--local-ranks-filter: expected a comma-separated list of local ranks, e.g. 0,1,2, got '0,a'"),
        (["-m", "--no-python", "json"], "--no-python: expected no --module with --no-python, got '--module'"),
        (["--nnodes", "2", "--master-port", "70000", "train.py"], "--master-port: expected an integer >= 0 and <= 65535, got '70000'"),
        (["--master_port", "x", "train.py"], "--master_port: expected an integer >= 0 and <= 65535, got 'x'"),
        (["--node-rank", "-1", "train.py"], "--node-rank: expected an integer >= 0, got '-1'"),
        (["--nnodes", "2", "--node-rank", "2", "train.py"], "--node-rank: expected a rank below the number of nodes (2), got '2'"),
        (["--signals-to-handle", "SIGTERM,SIGNOPE", "train.py"], "--signals-to-handle: expected a comma-separated list of signal names that can be handled (e.g. SIGTERM,SIGINT,SIGUSR1), got 'SIGTERM,SIGNOPE'"),
        ([], "training_script: expected a script, module (-m) or program to run"),
        (["--bogus", "train.py"], "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_bad_command_line_is_one_line_and_exit_2(
    workdir: Path, argv: list[str], expected: str
) -> None:
    result = _run(argv, workdir)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"relaunch: error: {expected}\n"
    assert result.stdout == ""


def test_env_default_error_names_the_variable(workdir: Path) -> None:
    result = _run(["train.py"], workdir, PET_MAX_RESTARTS="-3")
    assert result.returncode == 2
    assert result.stderr == (
        "relaunch: error: --max-restarts (from PET_MAX_RESTARTS): expected an integer >= 0, "
        "got '-3'\n"
    )
    result = _run(["train.py"], workdir, LOGLEVEL="LOUD")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "relaunch: error: LOGLEVEL: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got 'LOUD'"
    ]


def test_help_exits_0(workdir: Path) -> None:
    result = _run(["--help"], workdir)
    assert result.returncode == 0
    for flag in ("--nproc-per-node", "--rdzv_conf", "--warm-standby", "--no-warm-standby"):
        assert flag in result.stdout


def test_parse_args_does_not_import_torch(workdir: Path) -> None:
    code = (
        "import sys\n"
        "from relaunch.cli import parse_args\n"
        "c = parse_args(['--nproc-per-node', '2', '--nnodes', '1:2', '--rdzv-backend', 'c10d',"
        " 'train.py'])\n"
        "assert c.nproc_per_node == 2\n"
        "c = parse_args(['--nproc-per-node', 'cpu', '--standalone', 'train.py'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"
