"""Filling a snapshot's data file and taking its CRC-32, on several threads.

The writer's work per save is one copy of the state into the data file (from the
caller's CPU tensors, or from the pinned buffer CUDA tensors were copied into) and one
CRC-32 of the file (zlib's function, computed by zlib-ng where installed:
:mod:`relaunch.checkpoint._crc`). torch's ``copy_`` and the CRC-32 release the GIL,
so the file is cut into chunks of :data:`CHUNK` bytes that a few threads copy and
checksum side by side, and the file's CRC-32 is combined from the chunks' (zlib's ``crc32_combine``,
in Python: a chunk's CRC is shifted past the next chunk by a 32x32 matrix over GF(2),
built once per chunk length). Where the copy does not have to be done first (the CUDA
tensors, whose pinned buffer nobody waits for), a chunk is checksummed right after it
is copied, while its bytes are still in the cache: one pass over memory, not two. A
snapshot is read back the same way, each chunk copied out of the mapped file into the
values and checksummed while in the cache (``_readback``).

How many threads: the CPUs this process may run on, shared by the node's ranks
(``LOCAL_WORLD_SIZE``), at most 8; one means no thread at all (the writer does it).
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import torch

from relaunch.checkpoint._crc import crc32

__all__ = ["CHUNK", "Filler", "Part", "crc32_combine", "threads_for"]

CHUNK = 8 << 20
"""Bytes of the data file per task: large enough that a task's overhead is noise, small
enough that a few threads' chunks stay in the cache between copy and checksum."""

_POLY = 0xEDB88320  # CRC-32's polynomial, reflected (zlib's)
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Part:
    """A value's bytes (``source``, flat uint8) that go at ``offset`` of the file (or
    come from there, when a snapshot is read back)."""

    offset: int
    source: torch.Tensor


def threads_for(env: Mapping[str, str]) -> int:
    """Threads for one rank's writer: its share of the CPUs it may run on, 1 to 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(env.get("LOCAL_WORLD_SIZE") or "1"))
    except ValueError:
        local = 1
    return max(1, min(8, cpus // local))


class Filler:
    """Copies parts into a buffer and checksums it, over ``threads`` threads (made at
    the first task of more than one chunk; :meth:`close` joins them)."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None  # made at the first save that needs it

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def copy(self, target: torch.Tensor, parts: Sequence[Part]) -> None:
        """Copy every part into ``target`` (flat uint8) at its offset."""
        tasks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for part in parts:
            n = part.source.numel()
            for lo in range(0, n, CHUNK):
                hi = min(n, lo + CHUNK)
                dst = target[part.offset + lo : part.offset + hi]
                tasks.append((dst, part.source[lo:hi]))
        self._map(lambda t: t[0].copy_(t[1]), tasks)

    def zero(self, target: torch.Tensor) -> None:
        """Zero ``target`` (flat uint8), chunk by chunk: fresh memory's pages are faulted
        in on several threads."""
        n = target.numel()
        self._map(lambda lo: target[lo : lo + CHUNK].zero_(), range(0, n, CHUNK))

    def crc32(self, data: memoryview, target: torch.Tensor | None = None,
              parts: Sequence[Part] = (), *, reading: bool = False,
              before: Callable[[int, int], None] | None = None) -> int:  # fmt: skip
        """The CRC-32 of ``data`` (bytes), as ``zlib.crc32`` gives it; ``parts`` are first
        copied into ``target`` (flat uint8, over the same bytes), chunk by chunk, or with
        ``reading`` from ``target`` into each part's ``source`` (a snapshot read back).
        ``before(lo, hi)`` is called before the chunk ``[lo, hi)`` is touched (it waits
        until that chunk's bytes have landed)."""
        n = len(data)
        spans = [(lo, min(n, lo + CHUNK)) for lo in range(0, n, CHUNK)]
        ordered = sorted(parts, key=lambda p: p.offset)
        starts = [p.offset for p in ordered]

        def chunk(span: tuple[int, int]) -> int:
            lo, hi = span
            if before is not None:
                before(lo, hi)
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            while target is not None and i < len(ordered) and ordered[i].offset < hi:
                part = ordered[i]
                a, b = max(lo, part.offset), min(hi, part.offset + part.source.numel())
                if a < b and reading:
                    part.source[a - part.offset : b - part.offset].copy_(target[a:b])
                elif a < b:
                    target[a:b].copy_(part.source[a - part.offset : b - part.offset])
                i += 1
            return crc32(data[lo:hi])

        crc = 0
        for (lo, hi), part_crc in zip(spans, self._map(chunk, spans), strict=True):
            crc = part_crc if lo == 0 else crc32_combine(crc, part_crc, hi - lo)
        return crc

    def _map(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``fn`` of each item, on the threads; every task has ended when this returns
        or raises (the memory they write may go then)."""
        items = list(items)
        if self._threads <= 1 or len(items) <= 1:
            return [fn(item) for item in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self._threads, thread_name_prefix="relaunch-snapshot-fill"
            )
        tasks = [self._pool.submit(fn, item) for item in items]
        try:
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            wait(tasks)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length."""
    if len2 <= 0:
        return crc1
    return _times(_zeros(len2), crc1) ^ crc2


def _times(matrix: Sequence[int], vector: int) -> int:
    """``matrix`` (32 columns as ints) times ``vector`` over GF(2)."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """The operator that applies ``b`` then ``a``."""
    return tuple(_times(a, column) for column in b)


@functools.lru_cache(maxsize=64)
def _zeros(nbytes: int) -> tuple[int, ...]:
    """The operator that moves a CRC-32 past ``nbytes`` zero bytes."""
    op = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    for _ in range(3):
        op = _compose(op, op)  # 2, 4, 8 bits: one byte
    result: tuple[int, ...] | None = None
    while nbytes:
        if nbytes & 1:
            result = op if result is None else _compose(op, result)
        nbytes >>= 1
        if nbytes:
            op = _compose(op, op)
    assert result is not None
    return result
