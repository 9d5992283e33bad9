"""The examples do what the README and their docstrings say, run the way they say.

The README's demo is run exactly as its "Try it" block writes it (the ``relaunch ...``
part; the installs before it are not re-run), from a directory laid out like the
repository's root; ``examples/three_tiers.py`` is run as its docstring writes it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict[str, str]:
    """This environment without launcher variables; the examples' temp files in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("PYTHON_EXEC", None)
    env["TMPDIR"] = str(tmp_path)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv``; past ``timeout``, SIGINT first (three_tiers.py then stops its agents)."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{argv} did not finish within {timeout:g} s\n{out}\n{err}")
    return proc.returncode, out, err


def readme_demo_command() -> list[str]:
    """The README's "Try it" command, after its last ``&&`` (the installs)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Try it\n", 1)[1]
    block = re.search(r"^```[^\n]*\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert block is not None, "no code block in the README's Try it section"
    command = block.group(1).strip().split("&&")[-1]
    return shlex.split(command)


@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("relaunch") is None, reason="console script not installed")
def test_the_readme_demo_fails_at_step_15_restarts_and_finishes_40_steps(tmp_path: Path) -> None:
    argv = readme_demo_command()
    assert argv[0] == "relaunch" and "examples/train_ddp.py" in argv, argv
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    code, out, err = _run(argv, tmp_path, _env(tmp_path), timeout=200)
    assert code == 0, f"{out}\n{err}"
    # The failure happened: rank 1 raised at step 15 of attempt 0 and the agent restarted.
    assert "RuntimeError: injected failure at step 15 on rank 1" in err, err
    assert "restarting this node's workers (restart 1 of 1" in err, err
    lines = out.splitlines()
    first = [line for line in lines if line.startswith("[attempt 0]")]
    assert "[attempt 0] step  10" in out and not any("done" in line for line in first), out
    # The restart resumed from a checkpoint (every 5 steps, the last one at 10 or 15)
    # and finished all 40 steps.
    resumed = re.search(r"^\[attempt 1\] resumed from step (\d+)$", out, re.MULTILINE)
    assert resumed is not None and int(resumed.group(1)) in (10, 15), out
    assert "[attempt 1] step  35" in out, out
    assert re.search(r"^\[attempt 1\] done: 40 steps, final loss ", out, re.MULTILINE), out
    assert "summary: the workers succeeded; restarts used 1 of 1" in err, err


@pytest.mark.timeout(480)
def test_three_tiers_handles_each_fault_in_its_tier_and_keeps_healthy_processes(
    tmp_path: Path,
) -> None:
    # As the docstring writes it (its files kept, for the failure's message).
    job = tmp_path / "job"
    code, out, err = _run([sys.executable, "examples/three_tiers.py", "--keep", str(job)],
                          ROOT, _env(tmp_path), timeout=420)  # fmt: skip
    logs = "".join(
        f"\n--- {log.name} (its end) ---\n" + "".join(log.read_text().splitlines(True)[-80:])
        for log in sorted(job.glob("*.log"))
    )
    assert code == 0, f"{out}\n{err}{logs}"
    summary = out.split("\nsummary:\n", 1)[1] + logs
    tiers = {
        "exception in rank 1": "in-process restart",
        "SIGKILL of rank 3": "process",
        "SIGKILL of node 1": "node",
    }
    for fault, tier in tiers.items():
        line = re.search(
            rf"^  {fault} +-> tier: (.+?) +\d+\.\d+ s, \d+ steps redone$", summary, re.M
        )
        assert line is not None and line.group(1) == tier, summary
    assert "(ranks [2, 3] came back on the spare; the others kept running)" in out, out
    assert "ranks 0 and 1 kept their processes for the whole run: True" in summary, summary
    assert "agents' exit codes: {'node0': 0, 'spare': 0}" in summary, summary
