"""``checkpoint.load(replicated=True)`` across a change of the world's size.

Real processes on gloo (a FileStore: no network): a one-rank job saves steps into one
node's snapshot directory; then two ranks load, rank 0 on that node and rank 1 on a
node whose directory is empty (a node that joined). Rank 1 receives the snapshot from
rank 0 over the process group; a corrupt newest step is passed over for the one
before; without ``replicated`` the other world size's snapshots are refused, with a
line that says what to use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = textwrap.dedent(
    r"""
    import json, os, sys
    import torch, torch.distributed as dist
    from relaunch import checkpoint

    mode, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        store = dist.FileStore(os.environ["STORE"], world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if mode == "save":
        offset = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # another timeline's
        for step in range(int(sys.argv[3])):
            w = torch.full((50_000,), step + offset)
            checkpoint.save(step, {"w": w, "step": step})
        checkpoint.wait()
    else:
        got = checkpoint.load(replicated=mode == "replicated")
        w = None if got is None else got[1]["w"]
        res = None if got is None else [got[0], got[1]["step"], w.numel(), float(w.sum())]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        if world > 1:
            dist.destroy_process_group()
    """
)


def _run(tmp: Path, mode: str, roots: list[Path], *args: str) -> list[str]:
    """Run the worker as ``len(roots)`` ranks, rank r on the node directory roots[r];
    return each rank's stderr."""
    store = tmp / f"store-{mode}-{len(list(tmp.glob('store-*')))}"
    procs = []
    for rank, root in enumerate(roots):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(roots)), "STORE": str(store),
            "RELAUNCH_SNAPSHOT_DIR": str(root), "TORCHELASTIC_RUN_ID": "job",
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        cmd = [sys.executable, "-c", WORKER, mode, str(tmp), *args]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errs = []
    for proc in procs:
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        errs.append(err)
    return errs


def _loaded(tmp: Path, world: int) -> list[Any]:
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _restores(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "restores.jsonl").read_text().splitlines()]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A node directory holding a one-rank world's snapshots of steps 3 and 4."""
    node = tmp_path / "node-a"
    _run(tmp_path, "save", [node], "5")
    return node


def test_a_rank_with_no_snapshot_receives_the_newest_from_one_that_holds_it(
    tmp_path: Path, saved: Path
) -> None:
    joined = tmp_path / "node-b"
    _run(tmp_path, "replicated", [saved, joined])
    expected = [4, 4, 50_000, 4.0 * 50_000]
    assert _loaded(tmp_path, 2) == [expected, expected]
    assert [r["source"] for r in _restores(saved)] == ["memory"]
    assert [r["source"] for r in _restores(joined)] == ["another rank"]


def test_a_corrupt_newest_step_is_passed_over_for_the_one_before(
    tmp_path: Path, saved: Path
) -> None:
    data = saved / "rank-00000" / "step-000000000004" / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    errs = _run(tmp_path, "replicated", [saved, tmp_path / "node-b"])
    expected = [3, 3, 50_000, 3.0 * 50_000]
    assert _loaded(tmp_path, 2) == [expected, expected]
    assert "CRC-32" in errs[0], errs
    # the step past the one restored is of a timeline the job left: it is dropped
    assert [p.name for p in (saved / "rank-00000").glob("step-*")] == ["step-000000000003"]


def test_a_newer_step_on_any_rank_is_restored_on_every_rank(tmp_path: Path, saved: Path) -> None:
    """Rank 1's node holds a newer step than rank 0's (another world's rank 0 made it):
    that one is every rank's, rank 0 receiving it."""
    other = tmp_path / "node-b"
    _run(tmp_path, "save", [other], "8")
    _run(tmp_path, "replicated", [saved, other])
    expected = [7, 7, 50_000, 7.0 * 50_000]
    assert _loaded(tmp_path, 2) == [expected, expected]
    assert [r["source"] for r in _restores(saved)] == ["another rank"]


def test_without_replicated_another_world_size_starts_afresh_and_says_why(
    tmp_path: Path, saved: Path
) -> None:
    errs = _run(tmp_path, "own", [saved, tmp_path / "node-b"])
    assert _loaded(tmp_path, 2) == [None, None]
    assert "world_size 1 where this job expects 2" in errs[0], errs
    assert "load(replicated=True)" in errs[0], errs


def test_copies_of_one_step_from_two_timelines_are_made_one(tmp_path: Path, saved: Path) -> None:
    """Rank 1's node holds a step 4 of its own, from a timeline the job left (a node
    that sat out a restore): the ranks restore one copy of it, not each its own."""
    other = tmp_path / "node-b"
    _run(tmp_path, "save", [other], "5", "100")
    _run(tmp_path, "replicated", [saved, other])
    expected = [4, 4, 50_000, 4.0 * 50_000]  # rank 0's: of equals, the lowest rank's
    assert _loaded(tmp_path, 2) == [expected, expected]
    assert [r["source"] for r in _restores(other)] == ["another rank"]
