"""Which tensors of a save could change before their copy is taken, and what ``save``
does about them.

The copy of a save runs beside the next step, and only the optimizers' writes wait
for it (the Saver's global pre-step hook). Any other tensor of the state that the next
step changes in place would reach the snapshot with a later value than the step saved:
a module's buffer that its forward updates (BatchNorm's running statistics and
counter, the usual case), an exponential moving average of the weights, a counter
kept by hand. So at ``save``:

- the tensors of an optimizer that has stepped (its parameters and its state, by
  storage: views of them too) are *fenced*: copied beside the next step, as before;
- the others are cloned there and then (a CUDA clone on the current stream, so
  before the next step's kernels; the copy is taken of the clone), while they are at
  most :data:`CLONE_SHARE` of the state's bytes;
- beyond that (no optimizer has stepped yet, a large average of the weights), or
  when a CUDA clone finds no memory, the save is made blocking instead (it returns
  once the CPU tensors are copied, and the current CUDA stream waits for the CUDA
  copies): slower, never more memory.

A DTensor (or another wrapper subclass) is compared by the tensors it wraps, so a
sharded optimizer's local shards, which a ``torch.distributed.checkpoint`` save hands
over, are fenced. A tensor an optimizer holds but that is changed outside its
``step`` (parameters perturbed by hand, as SAM does; weights clamped; an average
swapped in for evaluation) is still the caller's: wait for ``wait_copied`` first.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch

from relaunch.checkpoint._tree import Leaf

__all__ = ["CLONE_SHARE", "Fence"]

CLONE_SHARE = 1 / 8
"""The most of a state's bytes that ``save`` clones (the tensors no optimizer fences)."""


class Fence:
    """The optimizers seen stepping in this process, and what they fence."""

    def __init__(self) -> None:
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def saw(self, optimizer: object) -> None:
        """``optimizer`` is about to step (the Saver's pre-step hook)."""
        if isinstance(optimizer, torch.optim.Optimizer):
            self._optimizers.add(optimizer)

    def secure(self, leaves: list[Leaf], nbytes: int) -> bool:
        """Clone the tensors of ``leaves`` that no optimizer fences (each leaf then
        holds its clone); True when they are too many bytes to clone, or a CUDA clone
        finds no memory, and the save must block instead (then no leaf keeps a clone)."""
        fenced = {at for at in _storages(list(self._optimizers)) if at is not None}
        loose = [
            leaf
            for leaf in leaves
            if leaf.tensor is not None
            and leaf.nbytes
            and not (set(_tensor_storages(leaf.tensor)) <= fenced)
        ]
        if sum(leaf.nbytes for leaf in loose) > nbytes * CLONE_SHARE:
            return True
        clones: list[tuple[Leaf, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for leaf in loose:
                    assert leaf.tensor is not None
                    clone = leaf.tensor.detach().clone(memory_format=torch.contiguous_format)
                    clones.append((leaf, clone))
        except torch.cuda.OutOfMemoryError:
            return True  # the clones made so far go with this frame
        for leaf, clone in clones:
            leaf.tensor = clone
        return False


def _storages(optimizers: list[torch.optim.Optimizer]) -> Iterator[int | None]:
    """The storages of every tensor the optimizers hold: their parameters and their
    state (nested in dicts and lists too)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            yield from _within(group.get("params", ()))
        yield from _within(list(optimizer.state.values()))


def _within(value: object) -> Iterator[int | None]:
    if isinstance(value, torch.Tensor):
        yield from _tensor_storages(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _within(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _within(item)


def _tensor_storages(tensor: torch.Tensor) -> Iterator[int | None]:
    """Where ``tensor``'s bytes are (views share their base's storage): a plain
    tensor's storage, or those of the tensors a wrapper subclass holds (a DTensor's
    local shard, which is what a ``torch.distributed.checkpoint`` save hands over);
    None where there is none to compare."""
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = flatten()
            for name in names:
                inner = getattr(tensor, name, None)
                if isinstance(inner, torch.Tensor):
                    yield from _tensor_storages(inner)
            return
    try:
        yield int(tensor.untyped_storage().data_ptr()) or None
    except (RuntimeError, NotImplementedError):  # a subclass without one
        yield None
