"""Reading a snapshot's data file back: each value's bytes straight into its target,
the CRC-32 of the whole file taken on the way."""

from __future__ import annotations

import zlib
from typing import Any

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._tree import Region

__all__ = ["read_regions"]


def read_regions(f: Any, regions: list[Region], size: int, path: str) -> int:
    """Read the data file into the regions' targets (the bytes between them into a
    scratch buffer); return the CRC-32 of all ``size`` bytes."""
    scratch = memoryview(bytearray(1 << 20))
    crc, pos = 0, 0

    def fill(view: memoryview) -> None:
        nonlocal crc, pos
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise layout.CorruptSnapshot(f"{path}: ended at byte {pos + got} of {size}")
            got += n
        crc = zlib.crc32(view, crc)
        pos += len(view)

    for offset, nbytes, target in [*regions, (size, 0, memoryview(b""))]:
        while pos < offset:  # padding between values: checked, not kept
            fill(scratch[: min(len(scratch), offset - pos)])
        if nbytes:
            fill(target)
    return crc
