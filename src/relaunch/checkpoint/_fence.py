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
- beyond that (no optimizer has stepped yet, a large average of the weights) the
  save is made blocking instead (it returns once the CPU tensors are copied, and the
  current CUDA stream waits for the CUDA copies): slower, never more memory.
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
        holds its clone); True when they are too many bytes to clone and the save
        must block instead (nothing is cloned then)."""
        fenced = {at for at in _storages(self._optimizers) if at is not None}
        loose = [
            leaf
            for leaf in leaves
            if leaf.tensor is not None and leaf.nbytes and _storage(leaf.tensor) not in fenced
        ]
        if sum(leaf.nbytes for leaf in loose) > nbytes * CLONE_SHARE:
            return True
        with torch.no_grad():
            for leaf in loose:
                assert leaf.tensor is not None
                leaf.tensor = leaf.tensor.detach().clone(memory_format=torch.contiguous_format)
        return False


def _storages(optimizers: weakref.WeakSet[torch.optim.Optimizer]) -> Iterator[int | None]:
    for optimizer in list(optimizers):
        for group in optimizer.param_groups:
            for param in group.get("params", ()):
                if isinstance(param, torch.Tensor):
                    yield _storage(param)
        for per_param in optimizer.state.values():
            values = per_param.values() if isinstance(per_param, dict) else (per_param,)
            for value in values:
                if isinstance(value, torch.Tensor):
                    yield _storage(value)


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage is (its views share it); None where it has none."""
    try:
        return int(tensor.untyped_storage().data_ptr()) or None
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one
        return None
