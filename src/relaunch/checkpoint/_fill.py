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
import torch._utils

from relaunch.checkpoint._crc import crc32
from relaunch.checkpoint._tree import ALIGN, Leaf, flat_bytes

__all__ = ["CHUNK", "SMALL", "Filler", "Part", "Run", "crc32_combine", "runs_of", "threads_for"]

CHUNK = 8 << 20
"""Bytes of the data file per task: large enough that a task's overhead is noise, small
enough that a few threads' chunks stay in the cache between copy and checksum."""

SMALL = 1 << 20
"""Bytes below which a CPU value is copied with its neighbours (:func:`runs_of`)."""


def _flatten_each(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([piece.reshape(-1) for piece in pieces])


_flatten: Callable[[list[torch.Tensor]], torch.Tensor] = getattr(
    torch._utils, "_flatten_dense_tensors", _flatten_each
)
"""Tensors flattened and joined in one call (torch's own, private: DDP's buckets);
where a torch release drops it, a ``reshape`` per piece (3 us a value)."""

_CAT_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool,
})  # fmt: skip
"""The dtypes a small value is joined in (others, as bytes: joining every dtype is
not a given)."""

_POLY = 0xEDB88320  # CRC-32's polynomial, reflected (zlib's)
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Part:
    """A value's bytes (``source``, flat uint8) that go at ``offset`` of the file (or
    come from there, when a snapshot is read back)."""

    offset: int
    source: torch.Tensor


@dataclass(frozen=True)
class Run:
    """Small values side by side in the data file, of one dtype (the caller's tensors,
    any shapes), with zeros of that dtype where the file aligns the next one: copied
    by one call into ``[offset, offset + nbytes)``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    pieces: list[torch.Tensor]


def runs_of(leaves: Sequence[Leaf]) -> tuple[list[Run], list[Leaf]]:
    """The runs of the CPU values under :data:`SMALL` bytes of ``leaves`` (in the order
    of their offsets), each up to :data:`CHUNK` bytes, and the other leaves (copied
    one by one: large ones in chunks; a value on another device, XPU or MPS, with the
    copy that brings it to the host).

    Made in ``save``, without a torch call per value. A model's thousands of biases and
    norms (a ResNet's convolutions too) were each a copy of its own on the writer's
    threads, whose torch calls released and took back the GIL from the training
    thread, a few times per value (3,200 values of 16 KB: a 75 ms step took 400 ms
    with a snapshot every step); the writer now makes two calls per run."""
    runs: list[Run] = []
    others: list[Leaf] = []
    pieces: list[torch.Tensor] = []
    start = end = 0
    kind = torch.uint8
    for leaf in leaves:
        if leaf.nbytes >= SMALL or leaf.device != "cpu":
            others.append(leaf)
            continue
        flat = _flat(leaf)
        gap = leaf.offset - end
        joins = pieces and flat.dtype == kind and 0 <= gap < ALIGN
        if not joins or leaf.offset + leaf.nbytes - start > CHUNK:
            if pieces:
                runs.append(Run(start, end - start, kind, pieces))
            pieces, start, gap, kind = [], leaf.offset, 0, flat.dtype
        if gap:
            pieces.append(_pad(kind, gap))
        pieces.append(flat)
        end = leaf.offset + leaf.nbytes
    if pieces:
        runs.append(Run(start, end - start, kind, pieces))
    return runs, others


def _join(pieces: list[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``pieces`` (one dtype, any shapes) one after another into ``out`` (flat):
    flattened and joined by one call in C++ (torch's own, which DDP uses for its
    buckets), then copied; a call per piece from Python (a ``reshape``) cost the
    training thread 3 us a value."""
    with torch.no_grad():
        out.copy_(_flatten(pieces))


@functools.lru_cache(maxsize=256)
def _pad(dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeros as ``dtype``."""
    return torch.zeros(nbytes, dtype=torch.uint8).view(dtype)


def _flat(leaf: Leaf) -> torch.Tensor:
    """A small value as it is joined: the tensor itself (a bytes value, or a tensor of
    a dtype not in :data:`_CAT_DTYPES`, as flat uint8)."""
    tensor = leaf.tensor
    if tensor is None or tensor.dtype not in _CAT_DTYPES:
        return flat_bytes(leaf)
    return tensor.detach() if tensor.requires_grad else tensor


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

    def copy(self, target: torch.Tensor, parts: Sequence[Part], runs: Sequence[Run] = ()) -> None:
        """Copy every part into ``target`` (flat uint8) at its offset, a chunk a task,
        and every run, a task each."""
        tasks: list[Callable[[], object]] = []
        for part in parts:
            n = part.source.numel()
            for lo in range(0, n, CHUNK):
                hi = min(n, lo + CHUNK)
                dst = target[part.offset + lo : part.offset + hi]
                tasks.append(functools.partial(dst.copy_, part.source[lo:hi]))
        for run in runs:
            out = target[run.offset : run.offset + run.nbytes].view(run.dtype)
            tasks.append(functools.partial(_join, run.pieces, out))
        self._map(lambda task: task(), tasks)

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
        tasks = []
        try:
            for item in items:
                tasks.append(self._pool.submit(fn, item))
        except RuntimeError:
            # the interpreter is shutting down (a script that ends with a save in
            # flight): its pools take no more tasks before the atexit hook that waits
            # for this save runs; the rest is done here, or the last step is lost
            done = [task.result() for task in tasks]
            return done + [fn(item) for item in items[len(tasks) :]]
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
