"""Running one of examples/, or a test's own script, under relaunch on this node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(
    example: str, out: Path, *args: str, nproc: int = 2
) -> tuple[int, str, list[dict[str, object]]]:
    """Run ``examples/<example>`` standalone with ``nproc`` workers and one restart,
    its per-step rows written under ``out``; return (exit code, what it said, rows)."""
    out.mkdir()
    cmd = [
        sys.executable, "-m", "relaunch", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=1", "--monitor-interval=0.1", str(EXAMPLES / example),
        "--log-to", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    rows = [
        json.loads(line) for p in out.glob("rank*.jsonl") for line in p.read_text().splitlines()
    ]
    return proc.returncode, proc.stdout + proc.stderr, rows


def run_script(tmp: Path, text: str, *, nproc: int = 2) -> tuple[int, str]:
    """Run ``text`` (a training script, written under ``tmp``) standalone with ``nproc``
    workers and one restart; return (exit code, what relaunch and the workers said)."""
    script = tmp / "train.py"
    script.write_text(text)
    cmd = [
        sys.executable, "-m", "relaunch", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=1", "--monitor-interval=0.1", str(script),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    return proc.returncode, proc.stdout + proc.stderr


def resumed(rows: list[dict[str, object]], attempt: int = 1) -> set[object]:
    """The steps the rows of ``attempt`` say they resumed from."""
    return {r["resumed_from"] for r in rows if r.get("attempt") == attempt and "step" in r}


def finals(rows: list[dict[str, object]]) -> set[object]:
    """The final weights' digests the ranks wrote."""
    return {r["final"] for r in rows if "final" in r}
