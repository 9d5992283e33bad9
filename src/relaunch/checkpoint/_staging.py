"""CUDA tensors of a save on their way to node memory: copied straight into the
snapshot's data file where its mapping is page-locked, else into one pinned host
buffer that the writer copies into the file, on a per-device copy stream that waits for
the work queued so far. The copies go in slices of at most :data:`GROUP` bytes, an
event after every :data:`GROUP` bytes of a stream's copies, so the writer checksums (or
copies) the file's first bytes while the later ones are still on their way.

Straight into the file (``cudaHostRegister`` of its shared mapping, /dev/shm's pages):
no second copy in host memory, and the writer only checksums. A data file is locked
where it is reused: the writer keeps its mappings from one save to the next
(``_mapped``), and after each save it locks the file that the next save will reuse (the
oldest snapshot kept), off the training thread; a reused file not locked yet (a
restarted worker's first save, into a snapshot of its last life) is locked by ``save``.
A new file (the first saves of a job, a retiring file an agent is copying) gets the pinned buffer: locking it would mean faulting in all its pages on the
training thread first. Only tmpfs (/dev/shm) is tried: the kernel refuses long-term
pins of a disk file system's pages (and the failed call leaves an error for the next
kernel launch); a directory on disk, or a refusal, gets the pinned buffer from then on.

The pinned buffer, made at the first save that needs it and kept, is as large as the
data file up to its last CUDA byte: plain host memory, its pages faulted in on the
filler's threads, then page-locked. torch's pinned allocator
would round it up to a power of two (a 1.2 GB state pins 2 GB) and page-lock it on one
thread; a restarted worker pays that at its first save, and the driver unlocks every
pinned byte when the process dies, before its agent can start the next one."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from relaunch.checkpoint._fill import Filler
from relaunch.checkpoint._tree import Leaf

__all__ = ["GROUP", "CudaStager", "PinnedBuffer", "Staged", "page_lockable"]

log = logging.getLogger("relaunch.checkpoint")

GROUP = 64 << 20
"""Bytes of a stream's copies per event: the writer starts on them once they are in."""

_PORTABLE = 1
"""``cudaHostRegisterPortable``: page-locked for every CUDA context of the process."""
_TMPFS_MAGIC = 0x01021994


@dataclass
class Staged:
    """The CUDA tensors of a save, on their way into the data file or the pinned buffer."""

    leaves: list[Leaf]
    """Their byte ranges of the data file."""
    buffer: torch.Tensor | None
    """The pinned buffer that mirrors the data file (the writer copies the leaves' ranges
    from it); None when the copies land in the file itself."""
    copies: list[tuple[Any, Any]]
    """``(copy stream, event recorded after its last copy)`` per device."""
    ready: list[tuple[int, int, Any]] = field(default_factory=list)
    """``(start, end, event)``: the file's bytes ``[start, end)`` are in once ``event``
    is done; sorted by start, none overlapping."""
    _starts: list[int] = field(default_factory=list)

    def sort(self) -> None:
        self.ready.sort(key=lambda r: r[0])
        self._starts = [r[0] for r in self.ready]

    def wait_for(self, lo: int, hi: int) -> None:
        """Wait until every CUDA byte of the file's ``[lo, hi)`` has landed."""
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        seen: set[int] = set()
        while i < len(self.ready) and self.ready[i][0] < hi:
            _start, end, event = self.ready[i]
            if end > lo and id(event) not in seen:
                seen.add(id(event))
                event.synchronize()
            i += 1

    def synchronize(self) -> None:
        """Wait for every copy (the memory they land in may then go)."""
        for _stream, event in self.copies:
            event.synchronize()


class CudaStager:
    """One rank's copy streams (one per device), its page-locked data file mappings, and
    the pinned buffer (made only where a mapping cannot be locked; grown as needed)."""

    def __init__(self, filler: Filler) -> None:
        self._filler = filler
        self._pinned: PinnedBuffer | None = None
        self._streams: dict[torch.device, Any] = {}
        self._locked: dict[int, int] = {}
        """Page-locked mappings: their address -> length."""
        self._refused = False
        """The snapshot directory's pages cannot be locked: the pinned buffer is used."""
        self.device: torch.device | None = None
        """The device of the last save's first CUDA tensor (locks are made for it)."""

    def settle(self) -> None:
        """Wait for every copy queued on the copy streams."""
        for stream in self._streams.values():
            stream.synchronize()

    def close(self) -> None:
        """Unlock and free the pinned buffer (no copy may be in flight)."""
        pinned, self._pinned = self._pinned, None
        if pinned is not None:
            pinned.close()

    @property
    def refused(self) -> bool:
        """The snapshot directory's pages cannot be locked (the pinned buffer is used)."""
        return self._refused

    def stage(self, leaves: list[Leaf], into: mmap.mmap | None = None) -> Staged | None:
        """Queue the copies of the CUDA tensors ``leaves`` into the data file's mapping
        ``into`` (a reused file's: locked here if it is not yet), or into the pinned
        buffer (no ``into``, or it cannot be locked), at their offsets of the file; each
        on its device's copy stream after the work queued so far on the current stream,
        with an event after every :data:`GROUP` bytes."""
        if not leaves:
            return None
        end = max(leaf.offset + leaf.nbytes for leaf in leaves)
        self.device = leaves[0].tensor.device if leaves[0].tensor is not None else None
        target = None
        if into is not None and self.lock(into):
            target = torch.frombuffer(into, dtype=torch.uint8)
        buffer = None
        if target is None:
            if self._pinned is None or self._pinned.tensor.numel() < end:
                self.close()  # the old buffer goes first
                self._pinned = PinnedBuffer(end, self._filler)
            buffer = target = self._pinned.tensor
        staged = Staged(leaves=leaves, buffer=buffer, copies=[])
        by_device: dict[torch.device, list[Leaf]] = {}
        for leaf in leaves:
            assert leaf.tensor is not None
            by_device.setdefault(leaf.tensor.device, []).append(leaf)
        for device, on_device in by_device.items():
            group = _Group(self._copy_stream(device))
            group.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(group.stream):  # once per device: entering costs 30 us
                for leaf in on_device:
                    self._queue(leaf, target, group, staged.ready)
            staged.copies.append((group.stream, group.close(staged.ready)))
        staged.sort()
        return staged

    @staticmethod
    def _queue(
        leaf: Leaf, target: torch.Tensor, group: _Group, ready: list[tuple[int, int, Any]]
    ) -> None:
        """Queue ``leaf``'s copy into ``target`` at its offset, in slices (the writer
        starts on the first ones sooner), on ``group``'s stream (the current one)."""
        src = leaf.tensor
        assert src is not None
        flat = src.detach().contiguous().reshape(-1).view(torch.uint8)
        for lo in range(0, leaf.nbytes, GROUP):
            hi = min(leaf.nbytes, lo + GROUP)
            target[leaf.offset + lo : leaf.offset + hi].copy_(flat[lo:hi], non_blocking=True)
            group.add(leaf.offset + lo, leaf.offset + hi, ready)
        # neither its memory nor the source's (a clone ``save`` made, and dropped once
        # queued: ``_fence``) is reused before the copy is done
        flat.record_stream(group.stream)
        src.record_stream(group.stream)
        leaf.tensor = None

    def unlock(self, mapping: mmap.mmap) -> None:
        """Unlock ``mapping`` if it was locked here (before it is unmapped; no copy into
        it may be in flight)."""
        address = _address(mapping)
        if self._locked.pop(address, None) is not None:
            try:
                with torch.cuda.device(self.device):
                    torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
            except Exception as exc:  # the mapping goes all the same
                log.warning("unlocking a snapshot file's mapping failed: %s", exc)

    def lock(self, mapping: mmap.mmap) -> bool:
        """Page-lock ``mapping`` (once; its pages are there: a file written before), for
        :attr:`device`; False where its pages cannot be locked."""
        if self._refused or not len(mapping) or self.device is None:
            return False
        address = _address(mapping)
        if self._locked.get(address) == len(mapping):
            return True
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        with torch.cuda.device(self.device):  # not device 0's context, on a new thread
            error = cudart.cudaHostRegister(address, len(mapping), _PORTABLE)
            if error != cudart.cudaError.success:
                _forget_error(self.device)
        if error != cudart.cudaError.success:
            log.warning(
                "the snapshot directory's pages cannot be page-locked (%s): CUDA tensors are "
                "copied through a pinned buffer", error,
            )  # fmt: skip
            self._refused = True
            return False
        if not self._locked:
            log.info("CUDA tensors are copied straight into the snapshot files (page-locked)")
        self._locked[address] = len(mapping)
        return True

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


class _Group:
    """A stream's copies since its last event: their ranges of the data file."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.ranges: list[tuple[int, int]] = []
        self.nbytes = 0

    def add(self, lo: int, hi: int, ready: list[tuple[int, int, Any]]) -> None:
        self.ranges.append((lo, hi))
        self.nbytes += hi - lo
        if self.nbytes >= GROUP:
            self.close(ready)

    def close(self, ready: list[tuple[int, int, Any]]) -> _Landed:
        """Record an event after the copies so far and note their ranges; the event."""
        event = _Landed(self.stream)
        ready.extend((lo, hi, event) for lo, hi in self.ranges)
        self.ranges, self.nbytes = [], 0
        return event


class _Landed:
    """An event recorded on a copy stream, waited for with its device current (the
    writer's threads make no context on another device: a rank on GPU 5 has none on GPU
    0); its waiters sleep, not spin (several threads wait for the same one)."""

    def __init__(self, stream: Any) -> None:
        self.device = stream.device
        self._event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        self._event.record(stream)

    def synchronize(self) -> None:
        with torch.cuda.device(self.device):
            self._event.synchronize()


class PinnedBuffer:
    """``nbytes`` of page-locked host memory (:attr:`tensor`, flat uint8), unlocked when
    this object goes (or at :meth:`close`); torch's pinned allocator where the driver
    refuses to lock plain memory."""

    def __init__(self, nbytes: int, filler: Filler) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        filler.zero(self.tensor)  # the pages faulted in on several threads: locking is quick
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        address = self.tensor.data_ptr()
        error = cudart.cudaHostRegister(address, nbytes, _PORTABLE)
        if error != cudart.cudaError.success:
            _forget_error(torch.device("cuda", torch.cuda.current_device()))
            log.warning(
                "page-locking a %d-byte snapshot buffer failed (%s): torch's pinned allocator is used",
                nbytes, error,
            )  # fmt: skip
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._unlock = None
            return
        # runs before this object's tensor is released: the memory is unlocked, then freed
        self._unlock = weakref.finalize(self, cudart.cudaHostUnregister, address)
        self._unlock.atexit = False  # at exit the driver unlocks it with the process

    def close(self) -> None:
        if self._unlock is not None:
            self._unlock()


def page_lockable(path: str) -> bool:
    """Whether shared mappings of files under ``path`` can be page-locked: tmpfs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs, its f_type first
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
        return ctypes.c_long.from_buffer(buf).value == _TMPFS_MAGIC
    except (OSError, AttributeError):
        return False


def _forget_error(device: torch.device) -> None:
    """Take the error a failed CUDA runtime call leaves to this thread's next kernel
    launch (which would fail the caller's next, unrelated, operation)."""
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device=device).fill_(1.0)  # a kernel launch: it checks for the error


def _address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts in this process's memory."""
    if not len(mapping):
        return 0
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # the mapping may be closed again
