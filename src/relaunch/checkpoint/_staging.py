"""CUDA tensors of a save on their way to node memory: copied into one pinned host
buffer (their byte ranges of the data file) on a per-device copy stream that waits for
the work queued so far, an event recorded after the copies (the writer waits for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relaunch.checkpoint._tree import Leaf

__all__ = ["CudaStager", "Staged", "on_cuda"]


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

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        self._streams: dict[torch.device, Any] = {}

    def stage(self, leaves: list[Leaf]) -> Staged | None:
        """Queue the copies of the CUDA tensors ``leaves`` into the pinned buffer (at
        their offsets of the data file), each on its device's copy stream after the work
        queued so far on the current stream, and record an event after them."""
        if not leaves:
            return None
        end = max(leaf.offset + leaf.nbytes for leaf in leaves)
        if self._pinned is None or self._pinned.numel() < end:
            self._pinned = None  # the old buffer goes first
            self._pinned = torch.empty(end, dtype=torch.uint8, pin_memory=True)
        pinned = self._pinned
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


def on_cuda(leaf: Leaf) -> bool:
    return leaf.tensor is not None and leaf.tensor.device.type == "cuda"
