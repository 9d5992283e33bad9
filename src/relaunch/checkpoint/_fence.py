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
        tensors = [
            (leaf, leaf.tensor) for leaf in leaves if leaf.tensor is not None and leaf.nbytes
        ]
        if not tensors:
            return False
        held = _Held(list(self._optimizers))
        loose = [(leaf, tensor) for leaf, tensor in tensors if not held.fences(tensor)]
        if sum(leaf.nbytes for leaf, _ in loose) > nbytes * CLONE_SHARE:
            return True
        clones: list[tuple[Leaf, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for leaf, tensor in loose:
                    clone = tensor.detach().clone(memory_format=torch.contiguous_format)
                    clones.append((leaf, clone))
        except torch.cuda.OutOfMemoryError:
            return True  # the clones made so far go with this frame
        for leaf, clone in clones:
            leaf.tensor = clone
        return False


class _Held:
    """The tensors the optimizers hold: their parameters and their state (nested in
    dicts and lists too). Plain loops, and the state's storages read only when a
    tensor is neither held itself nor over a parameter's storage: a save asks about
    thousands of tensors on the training thread."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        params: list[torch.Tensor] = []
        self._state: list[torch.Tensor] = []
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                _gather(group.get("params", ()), params)
            for state in optimizer.state.values():
                _gather(state, self._state)
        self._ids = {id(t) for t in params} | {id(t) for t in self._state}
        self._storages = _storages_of(params)
        self._all = False

    def fences(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is held, or its bytes are all in held tensors' storages."""
        if id(tensor) in self._ids:  # the optimizer's state, as its state_dict gives it
            return True
        storages = _tensor_storages(tensor)
        if all(at in self._storages for at in storages):
            return True
        if not self._all:
            self._all = True
            self._storages |= _storages_of(self._state)
            return all(at in self._storages for at in storages)
        return False


def _gather(value: object, into: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _gather(item, into)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _gather(item, into)


def _storages_of(tensors: list[torch.Tensor]) -> set[int]:
    storages = {at for tensor in tensors for at in _tensor_storages(tensor)}
    storages.discard(0)  # none to compare: never fences
    return storages


def _tensor_storages(tensor: torch.Tensor) -> list[int]:
    """Where ``tensor``'s bytes are (views share their base's storage): a plain
    tensor's storage, or those of the tensors a wrapper subclass holds (a DTensor's
    local shard, which is what a ``torch.distributed.checkpoint`` save hands over);
    0 where there is none to compare."""
    cls = type(tensor)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = flatten()
            inner = (getattr(tensor, name, None) for name in names)
            return [at for t in inner if isinstance(t, torch.Tensor) for at in _tensor_storages(t)]
    try:
        return [int(tensor.untyped_storage().data_ptr())]
    except (RuntimeError, NotImplementedError):  # a subclass without one
        return [0]
