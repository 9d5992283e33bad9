"""The ``relaunch`` command end to end: parse, launch through the agent, exit code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

_SCRIPT = """\
import os, sys
# One write per line: the workers share the agent's stdout, print() writes twice.
sys.stdout.write("rank=%s world=%s local=%s args=%s\\n" % (
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], sys.argv[1:]))
sys.stdout.flush()
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("PYTHON_EXEC", None)
    env.update(extra)
    return env


def _relaunch(
    argv: list[str], cwd: Path, *, command: list[str] | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(command or [sys.executable, "-m", "relaunch"]), *argv],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(_SCRIPT)
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(_SCRIPT)
    return tmp_path


def test_standalone_script_runs_every_local_rank(workdir: Path) -> None:
    argv = ["--standalone", "--nproc_per_node", "2", "--no-warm-standby", "train.py", "x"]
    result = _relaunch([*argv, "${local_rank}"], workdir)
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank="))
    assert lines == [
        "rank=0 world=2 local=0 args=['x', '0']",
        "rank=1 world=2 local=1 args=['x', '1']",
    ]


@pytest.mark.parametrize(
    "rendezvous",
    [[], ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]],
    ids=["no-rendezvous-flags", "c10d-port-0"],
)
def test_torchruns_plain_single_node_command_runs(workdir: Path, rendezvous: list[str]) -> None:
    """``torchrun --nproc-per-node 2 train.py``: one node, no rendezvous flags."""
    result = _relaunch([*rendezvous, "--nproc-per-node", "2", "train.py"], workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("world=2") == 2


def test_env_defaults_reach_the_launch(workdir: Path) -> None:
    result = _relaunch(
        ["train.py"], workdir, PET_NPROC_PER_NODE="2", PET_STANDALONE="1", PET_WARM_STANDBY="0"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("world=2") == 2


def test_failing_worker_gives_non_zero_exit(workdir: Path) -> None:
    argv = ["--standalone", "--no-warm-standby", "train.py"]
    result = _relaunch(argv, workdir, EXIT_CODE="3")
    assert result.returncode == 1, result.stderr  # README: 1, the workers failed for good
    assert "relaunch: error:" not in result.stderr  # a job failure, not a usage error


@pytest.mark.skipif(shutil.which("relaunch") is None, reason="console script not installed")
def test_console_script_runs_a_module_from_the_working_directory(workdir: Path) -> None:
    command = [shutil.which("relaunch") or "relaunch"]
    argv = ["--standalone", "--no-warm-standby", "-m", "trainpkg.main", "y"]
    result = _relaunch(argv, workdir, command=command)
    assert result.returncode == 0, result.stderr
    assert "rank=0 world=1 local=0 args=['y']" in result.stdout


def test_no_python_runs_a_binary(workdir: Path) -> None:
    argv = ["--standalone", "--nproc-per-node=2", "--no-python", "sh", "-c", "echo lr=$LOCAL_RANK"]
    result = _relaunch(argv, workdir)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["lr=0", "lr=1"]


_LIMITS = """\
import os, resource, sys
def soft(pid):
    with open(f"/proc/{pid}/limits") as f:
        return next(int(line.split()[3]) for line in f if line.startswith("Max open files"))
def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
agent = os.getppid()  # (or the fork server's process, or a standby's: the agent's child)
while b"-m\\0relaunch\\0" not in open(f"/proc/{agent}/cmdline", "rb").read():
    agent = parent(agent)
sys.stdout.write("worker=%d agent=%d\\n" % (resource.getrlimit(resource.RLIMIT_NOFILE)[0], soft(agent)))
"""


@pytest.mark.parametrize("start", [[], ["--no-warm-standby"]], ids=["standby", "popen"])
def test_the_agent_may_open_every_file_allowed_and_its_workers_what_they_were_given(
    tmp_path: Path, start: list[str]
) -> None:
    # the agent serves a connection per node and some per worker: at the common soft
    # limit of 1,024 files a job of 128 nodes of 8 ranks ran out. It raises its own to
    # the hard limit (as Go programs do, etcd among them); its workers get the limit
    # relaunch was given, as under torchrun
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 256:
        pytest.skip(f"the hard limit on open files is {hard}: nothing to raise")
    (tmp_path / "limits.py").write_text(_LIMITS)
    result = subprocess.run(
        [sys.executable, "-m", "relaunch", "--standalone", *start, "limits.py"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60, check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"worker=256 agent={hard}" in result.stdout, result.stdout + result.stderr
