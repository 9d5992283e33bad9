"""What ``load()`` says when it restores nothing though the node holds snapshots of the
job: a world that changed size is never a silent fresh start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from relaunch.checkpoint._agree import decode_record, encode_record, newest_common, other_world
from relaunch.checkpoint._saver import Saver, Where
from relaunch.errors import SnapshotError


def _where(root: Path, rank: int, world: int, job: str = "j") -> Where:
    return Where(str(root), job, rank, world, 2, None, None, threads=1)


def _save(where: Where, steps: range) -> None:
    saver = Saver(where)
    try:
        for step in steps:
            saver.save(step, {"w": torch.full((4,), float(step)), "step": step})
    finally:
        saver.close()


def test_a_rank_with_nothing_of_its_own_tells_of_the_other_world_s_snapshots(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a job of 3 ranks lost a node: this node held rank 1; it is now rank 0 of 1
    _save(_where(tmp_path, 1, 3), range(5))
    saver = Saver(_where(tmp_path, 0, 1))
    try:
        with caplog.at_level(logging.WARNING, logger="relaunch.checkpoint"):
            assert newest_common(saver, [None]) == (None, None)
    finally:
        saver.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "newest step 4" in said[0] and "a world of 3 ranks, not this one of 1" in said[0]
    assert "checkpoint.load(replicated=True)" in said[0]


def test_a_fresh_job_and_another_job_s_snapshots_say_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(_where(tmp_path, 1, 3, job="other"), range(2))
    where = _where(tmp_path, 0, 1)
    assert other_world(where, [None]) is None
    assert other_world(_where(tmp_path / "empty", 0, 1), [None, None]) is None
    saver = Saver(where)
    try:
        with caplog.at_level(logging.WARNING, logger="relaunch.checkpoint"):
            assert newest_common(saver, [None]) == (None, None)
    finally:
        saver.close()
    assert caplog.records == []


def test_the_durable_copies_count_too_and_the_newest_is_named(tmp_path: Path) -> None:
    _save(_where(tmp_path / "mem", 2, 4), range(3))
    _save(_where(tmp_path / "durable", 0, 2), range(7))
    where = _where(tmp_path / "mem", 0, 1)
    assert other_world(where, [None, str(tmp_path / "durable")]) == (6, 2)
    assert other_world(where, [None]) == (2, 4)


def test_the_ranks_offers_cross_as_versioned_json_and_a_bad_one_names_its_rank() -> None:
    for value in ([3, 7, 12], True, None, 4_294_967_295, [12, 4]):
        assert decode_record(2, encode_record(value)) == value
    assert decode_record(0, encode_record((12, 4))) == [12, 4]  # a tuple arrives a list
    with pytest.raises(SnapshotError, match=r"rank 3's snapshot offer is not JSON"):
        decode_record(3, b"\x80\x04\x95")  # a pickle, say
    with pytest.raises(SnapshotError, match=r"rank 1's snapshot offer .* v=1 .* same relaunch"):
        decode_record(1, b'{"v": 2, "value": [1]}')
    with pytest.raises(SnapshotError, match=r"rank 1's snapshot offer"):
        decode_record(1, b"[1, 2]")
