"""The writer's mappings of its data files, kept from one save to the next.

A snapshot's data file is usually the retiring snapshot's, renamed (its pages reused).
Mapping it afresh for each save costs a page fault per 4 KiB page during the copy
(300,000 for 1.2 GB: the copy ran at 2.8 GB/s instead of 10 on this machine, and the
optimizer waited for it). A mapping kept open for the file's inode survives the rename,
so the next copy into that file touches no fault at all; a file mapped for the first
time is mapped with its pages populated in one call.

A mapping held for a deleted file would keep its memory: :meth:`keep_only` drops the
mappings of every file that is no longer one of the rank's data files, after each
prune. A held mapping keeps its inode alive, so an inode number in the table never
names another file. A mapping that CUDA copies land in directly is page-locked by its
user, which unlocks it in ``before_unmap`` (a locked range must not be unmapped).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterable
from typing import BinaryIO

__all__ = ["MappedFiles"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class MappedFiles:
    """Shared mappings of data files by inode, each of the file's size when mapped."""

    def __init__(self, before_unmap: Callable[[mmap.mmap], None] | None = None) -> None:
        self._held: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}
        self._before_unmap = before_unmap

    def map(self, f: BinaryIO, nbytes: int, *, populate: bool = True) -> mmap.mmap:
        """A mapping of the first ``nbytes`` of ``f`` (whose size is ``nbytes``); a new
        one with its pages faulted in unless ``populate`` is false (the caller faults
        them in itself, on several threads)."""
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino)
        held = self._held.get(key)
        if held is not None and held[0] == nbytes:
            return held[1]
        self._drop(key)
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        mapping = mmap.mmap(f.fileno(), nbytes, flags=flags)
        self._held[key] = (nbytes, mapping)
        return mapping

    def forget(self, f: BinaryIO) -> None:
        """Drop the mapping of ``f`` (a file about to be removed)."""
        with contextlib.suppress(OSError):
            st = os.fstat(f.fileno())
            self._drop((st.st_dev, st.st_ino))

    def keep_only(self, paths: Iterable[str]) -> None:
        """Drop every mapping but those of the files at ``paths`` (the live data files)."""
        live = set()
        for path in paths:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                live.add((st.st_dev, st.st_ino))
        for key in [k for k in self._held if k not in live]:
            self._drop(key)

    def close(self) -> None:
        for key in list(self._held):
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            try:
                if self._before_unmap is not None:
                    self._before_unmap(held[1])
            finally:
                with contextlib.suppress(BufferError, ValueError):
                    held[1].close()
