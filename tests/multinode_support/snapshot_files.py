"""Snapshot folders written and read by hand, in the layout the agents serve
(``rank-N/step-N``: the data file and its manifest), for the peer-copy tests."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from relaunch.checkpoint import _layout as layout


def write_snapshot(root: Path, rank: int, step: int, data: bytes, *, job: str) -> None:
    """A complete snapshot of ``rank`` at ``step`` holding ``data`` (world size 2)."""
    folder = layout.step_dir(layout.rank_dir(str(root), rank), step)
    os.makedirs(folder)
    with open(os.path.join(folder, layout.DATA), "wb") as f:
        f.write(data)
    m = layout.Manifest(job, rank, 2, step, len(data), zlib.crc32(data), {"t": "leaf"})
    layout.write_manifest(folder, m)


def snapshot_bytes(root: Path, rank: int, step: int) -> bytes:
    """The data file of ``rank``'s snapshot at ``step``."""
    path = os.path.join(layout.step_dir(layout.rank_dir(str(root), rank), step), layout.DATA)
    with open(path, "rb") as f:
        return f.read()
