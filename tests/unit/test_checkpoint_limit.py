"""The node's limit on its snapshots: one statvfs where node memory holds them and
everything fits, the walk of every rank's files otherwise."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _limit
from relaunch.errors import SnapshotError


@pytest.fixture
def shm_root() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="relaunch-limit-test-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _snapshot(root: Path, rank: int, step: int, nbytes: int) -> None:
    folder = Path(layout.step_dir(layout.rank_dir(str(root), rank), step))
    folder.mkdir(parents=True)
    (folder / layout.DATA).write_bytes(b"\1" * nbytes)
    (folder / layout.MANIFEST).write_text("{}")


def test_in_node_memory_a_save_that_fits_the_whole_file_system_is_not_walked(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _snapshot(shm_root, 1, 5, 4096)
    st = os.statvfs(shm_root)
    roomy = (st.f_blocks - st.f_bfree) * st.f_frsize + (1 << 30)

    def walked(root: str) -> int:
        raise AssertionError(f"walked {root}")

    with monkeypatch.context() as patched:
        patched.setattr(_limit, "usage", walked)
        _limit.check_limit(str(shm_root), 0, 1, 1 << 20, 2, roomy)
    # what does not fit the whole file system is walked, and refused by the walk alone
    with pytest.raises(SnapshotError, match="over its limit of 6000"):
        _limit.check_limit(str(shm_root), 0, 1, 2048, 2, 6000)
    _limit.check_limit(str(shm_root), 0, 1, 1024, 2, 6000)  # 4096 + 1024: fits


def test_off_node_memory_the_walk_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_limit, "_in_memory", lambda root: False)  # a disk, compressing maybe
    _snapshot(tmp_path, 1, 5, 4096)
    calls: list[str] = []
    usage = _limit.usage

    def counted(root: str) -> int:
        calls.append(root)
        return usage(root)

    monkeypatch.setattr(_limit, "usage", counted)
    _limit.check_limit(str(tmp_path), 0, 1, 1024, 2, 1 << 50)
    assert calls  # walked, however roomy
    with pytest.raises(SnapshotError, match="would bring the node's snapshot directory"):
        _limit.check_limit(str(tmp_path), 0, 1, 4096, 2, 6000)
