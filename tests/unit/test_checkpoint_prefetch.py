"""A restarted worker's snapshot read ahead (``Saver.prefetch``): ``read`` gives what
it would have read itself, for the prefetched step and any other, a corrupt snapshot is
refused the same way, and a save first drops it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from relaunch import _contract
from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._fill import CHUNK
from relaunch.checkpoint._saver import Saver, Where


def _where(root: Path) -> Where:
    return Where(str(root), "j", 0, 1, 2, None, None, threads=2)


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    # more than two chunks of the data file, with a small value between the big ones
    return {
        "big": torch.randn(CHUNK // 2, generator=gen),
        "step": step,
        "small": torch.arange(3, dtype=torch.int16) + step,
        "opt": [torch.randn(CHUNK // 8, generator=gen), b"\x00\x01"],
    }


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _saved(root: Path, steps: range) -> None:
    first = Saver(_where(root))
    for step in steps:
        first.save(step, _state(step))
    first.close()


def _prefetching() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "relaunch-snapshot-prefetch"]


def test_the_prefetched_step_and_any_other_read_as_without_it(tmp_path: Path) -> None:
    _saved(tmp_path, range(2))
    for wanted in (1, 0):  # the prefetched (newest) step, then another one
        again = Saver(_where(tmp_path))  # the restarted worker
        again.prefetch()
        try:
            assert _equal(again.read(wanted), _state(wanted))
            assert again.read_ahead == (wanted == 1) and _prefetching() == []
        finally:
            again.close()


def test_a_step_of_the_durable_copies_is_read_from_there(tmp_path: Path) -> None:
    _saved(tmp_path / "durable", range(3))  # steps 1 and 2 kept there
    _saved(tmp_path / "memory", range(2))
    again = Saver(_where(tmp_path / "memory"))
    again.prefetch()  # of step 1, in memory
    try:
        assert _equal(again.read(2, str(tmp_path / "durable")), _state(2))
        assert not again.read_ahead and _prefetching() == []
    finally:
        again.close()


def test_a_corrupt_snapshot_read_ahead_is_refused_as_when_read(tmp_path: Path) -> None:
    _saved(tmp_path, range(2))
    data = tmp_path / "rank-00000" / "step-000000000001" / layout.DATA
    raw = bytearray(data.read_bytes())
    raw[CHUNK + 5] ^= 0x01  # one bit, in the second chunk
    data.write_bytes(bytes(raw))
    again = Saver(_where(tmp_path))
    again.prefetch()
    try:
        with pytest.raises(layout.CorruptSnapshot, match="CRC-32"):
            again.read(1)
        assert _equal(again.read(0), _state(0))  # the older one, read then
    finally:
        again.close()


def test_a_save_before_any_load_drops_the_read(tmp_path: Path) -> None:
    _saved(tmp_path, range(1))
    again = Saver(_where(tmp_path))
    again.prefetch()
    try:
        again.save(5, _state(5), blocking=True)
        assert _prefetching() == []
        again.wait()
        assert again.steps() == [5, 0]
        assert _equal(again.read(5), _state(5))
    finally:
        again.close()


def test_which_workers_read_ahead(tmp_path: Path) -> None:
    env = {_contract.SNAPSHOT_DIR_ENV: str(tmp_path), "RANK": "3"}
    assert not _contract.snapshot_to_prefetch(env)  # no snapshot of rank 3 yet
    (tmp_path / "rank-00003" / ".partial-step-000000000001-99").mkdir(parents=True)
    assert not _contract.snapshot_to_prefetch(env)  # a partial one is not a snapshot
    (tmp_path / "rank-00003" / "step-000000000001").mkdir()
    assert _contract.snapshot_to_prefetch(env)
    assert not _contract.snapshot_to_prefetch({**env, "RANK": "2"})
    assert not _contract.snapshot_to_prefetch({**env, "RANK": "x"})
    assert not _contract.snapshot_to_prefetch({**env, _contract.INCARNATION_ENV: "1"})
    assert not _contract.snapshot_to_prefetch({"RANK": "3"})
