"""CUDA tensors of a save on their way to node memory: copied into one pinned host
buffer (their byte ranges of the data file) on a per-device copy stream that waits for
the work queued so far, an event recorded after the copies (the writer waits for it).

The buffer is exactly as large as the save's CUDA bytes: plain host memory, its pages
faulted in on the filler's threads, then page-locked (``cudaHostRegister``). torch's
pinned allocator would round it up to a power of two (a 1.2 GB state pins 2 GB) and
page-lock it on one thread; a restarted worker pays that at its first save, and the
driver unlocks every pinned byte when the process dies, before its agent can start the
next one."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from relaunch.checkpoint._fill import Filler
from relaunch.checkpoint._tree import Leaf

__all__ = ["CudaStager", "PinnedBuffer", "Staged", "on_cuda"]

log = logging.getLogger("relaunch.checkpoint")

_PORTABLE = 1
"""``cudaHostRegisterPortable``: page-locked for every CUDA context of the process."""


@dataclass
class Staged:
    """The CUDA tensors of a save, on their way into the pinned buffer."""

    leaves: list[Leaf]
    """Their byte ranges of the data file, which the pinned buffer mirrors."""
    pinned: torch.Tensor
    copies: list[tuple[Any, Any]]
    """``(copy stream, event recorded after its copies)`` per device."""


class CudaStager:
    """One rank's pinned buffer (grown as needed) and copy streams, one per device."""

    def __init__(self, filler: Filler) -> None:
        self._filler = filler
        self._pinned: PinnedBuffer | None = None
        self._streams: dict[torch.device, Any] = {}

    def close(self) -> None:
        """Unlock and free the pinned buffer (no copy may be in flight)."""
        pinned, self._pinned = self._pinned, None
        if pinned is not None:
            pinned.close()

    def stage(self, leaves: list[Leaf]) -> Staged | None:
        """Queue the copies of the CUDA tensors ``leaves`` into the pinned buffer (at
        their offsets of the data file), each on its device's copy stream after the work
        queued so far on the current stream, and record an event after them."""
        if not leaves:
            return None
        end = max(leaf.offset + leaf.nbytes for leaf in leaves)
        if self._pinned is None or self._pinned.tensor.numel() < end:
            self.close()  # the old buffer goes first
            self._pinned = PinnedBuffer(end, self._filler)
        pinned = self._pinned.tensor
        streams: dict[torch.device, Any] = {}
        for leaf in leaves:
            src = leaf.tensor
            assert src is not None
            stream = streams.get(src.device)
            if stream is None:
                stream = self._copy_stream(src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
                streams[src.device] = stream
            with torch.cuda.stream(stream):
                flat = src.detach().contiguous().reshape(-1).view(torch.uint8)
                pinned[leaf.offset : leaf.offset + leaf.nbytes].copy_(flat, non_blocking=True)
            flat.record_stream(stream)  # its memory is not reused before the copy is done
            leaf.tensor = None
        copies = []
        for stream in streams.values():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            copies.append((stream, event))
        return Staged(leaves=leaves, pinned=pinned, copies=copies)

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


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


def on_cuda(leaf: Leaf) -> bool:
    return leaf.tensor is not None and leaf.tensor.device.type == "cuda"
