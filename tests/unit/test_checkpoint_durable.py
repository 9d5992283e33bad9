"""The durable copier: copies that line up across ranks and nodes, so a job that loses
every node still has a step every rank can restore."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from relaunch.checkpoint._durable import COMPLETE, DurableCopier, discard_newer
from relaunch.checkpoint._saver import Saver, Where


def _save(root: Path, rank: int, *steps: int, durable: Path | None = None) -> Saver:
    saver = Saver(
        Where(
            root=str(root),
            job="j",
            rank=rank,
            world_size=2,
            keep=2,
            limit=None,
            durable=None if durable is None else str(durable),
        )
    )
    for step in steps:
        saver.save(step, {"w": torch.full((4,), float(step + 10 * rank))})
    saver.wait()
    return saver


def _copies(durable: Path, rank: int) -> list[int]:
    return sorted(int(p.name[5:]) for p in (durable / f"rank-{rank:05d}").glob("step-*"))


def _marked(durable: Path) -> dict[int, list[int]]:
    return {
        int(step.name[5:]): sorted(int(r.name[5:]) for r in step.iterdir())
        for step in sorted((durable / COMPLETE).iterdir())
    }


def test_a_node_copies_one_step_for_all_its_ranks(tmp_path: Path) -> None:
    node, durable = tmp_path / "node", tmp_path / "durable"
    _save(node, 0, 3, 4, 5)
    _save(node, 1, 4, 5, 6)  # one step ahead
    copier = DurableCopier(str(node), str(durable), keep=2, interval=0.5)
    copier.copy_newest()
    assert _copies(durable, 0) == [5] and _copies(durable, 1) == [5]
    assert _marked(durable) == {5: [0, 1]}
    saver = _save(node, 1, durable=durable)
    assert saver.steps(str(durable)) == [5]
    assert torch.equal(saver.read(5, str(durable))["w"], torch.full((4,), 15.0))


def test_pruning_keeps_the_newest_step_every_rank_holds(tmp_path: Path) -> None:
    a, b, durable = tmp_path / "a", tmp_path / "b", tmp_path / "durable"
    copiers = []
    for rank, node in enumerate((a, b)):
        copier = DurableCopier(str(node), str(durable), keep=2, interval=0.5)
        copier.own([rank])  # a node with one rank each, copying independently
        copiers.append(copier)
        _save(node, rank, 3)
        copier.copy_newest()
    assert _marked(durable) == {3: [0, 1]}
    for step in (4, 5, 6, 7):  # rank 0's node copies on; rank 1's copier lags behind
        _save(a, 0, step)
        copiers[0].copy_newest()
    assert _copies(durable, 0) == [3, 6, 7]  # the newest two and the whole step
    _save(b, 1, 4, 5, 6)
    copiers[1].copy_newest()  # step 6 is whole now: step 3 may go, with its markers
    assert _copies(durable, 1) == [3, 6]
    _save(a, 0, 8)
    copiers[0].copy_newest()
    assert _copies(durable, 0) == [6, 7, 8]
    assert _marked(durable) == {6: [0, 1], 7: [0], 8: [0]}


def test_a_restore_drops_the_copies_of_the_timeline_left(tmp_path: Path) -> None:
    node, durable = tmp_path / "node", tmp_path / "durable"
    copier = DurableCopier(str(node), str(durable), keep=3, interval=0.5)
    copier.own([0])
    for step in (1, 2, 3):
        _save(node, 0, step)
        copier.copy_newest()
    assert discard_newer(str(durable), 0, 1) == [3, 2]
    assert _copies(durable, 0) == [1]
    assert _marked(durable) == {1: [0], 2: [], 3: []}
    # the new timeline's step 2 is copied although a step 2 was copied before
    saver = _save(node, 0)
    saver.discard_newer(1)
    _save(node, 0, 2)
    copier.copy_newest()
    assert _copies(durable, 0) == [1, 2]


def _during_the_next_copy(monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]) -> None:
    """Run ``action`` once, as the copier's next file copy begins."""
    copyfile = shutil.copyfile

    def meanwhile(src: str, dst: str) -> str:
        monkeypatch.setattr(shutil, "copyfile", copyfile)
        action()
        return copyfile(src, dst)

    monkeypatch.setattr(shutil, "copyfile", meanwhile)


def test_a_copy_under_way_when_its_step_is_dropped_never_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The copier pinned step 3 and copies it when the worker restores step 2 and drops
    # step 3 (a timeline the job left): the copy must not land after that drop.
    node, durable = tmp_path / "node", tmp_path / "durable"
    copier = DurableCopier(str(node), str(durable), keep=3, interval=0.5)
    copier.own([0])
    worker = _save(node, 0, 2, durable=durable)
    copier.copy_newest()
    _save(node, 0, 3)
    _during_the_next_copy(monkeypatch, lambda: worker.discard_newer(2))  # as load() does
    copier.copy_newest()
    assert _copies(durable, 0) == [2]
    assert _marked(durable) == {2: [0]}


def test_a_step_pruned_while_it_is_copied_still_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rotation (keep=2) prunes the step being copied: the pin keeps its bytes.
    node, durable = tmp_path / "node", tmp_path / "durable"
    copier = DurableCopier(str(node), str(durable), keep=3, interval=0.5)
    copier.own([0])
    _save(node, 0, 1, 2)
    _during_the_next_copy(monkeypatch, lambda: _save(node, 0, 3, 4))  # step 2 is pruned
    copier.copy_newest()
    assert _copies(durable, 0) == [2]
    assert not (node / "rank-00000" / "step-000000000002").exists()
