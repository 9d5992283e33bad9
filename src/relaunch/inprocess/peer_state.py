"""Training state from a healthy peer, in memory: what a replacement rank starts from,
and what makes the survivors of a fault agree again.

A replacement process (relaunch's tiered recovery, see ``_rejoin``) enters the
wrapped function with no model or optimizer state. At the start of an iteration,
after ``init_process_group``, every rank calls :func:`broadcast_state` with its
state; the ranks that are new in this iteration get the state of a survivor, the
others get their own back::

    @inprocess.Wrapper(...)
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        dist.init_process_group("gloo")
        state = inprocess.broadcast_state(call_wrapper, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        }, version=step)
        model.load_state_dict(state["model"]); ...

Survivors can disagree too: a fault can end an iteration after the last collective of
a step completed on some ranks and failed on others (seen at the end of a job: three
ranks made their last step and returned, the fourth one's all-reduce met their closed
connections), so some ranks made one more step than the others; left so, the job
would restart forever, the late rank waiting for peers that have finished. So, in an
iteration after a restart, the ranks first compare what they hold, one small
all-gather: ``version`` (an int that grows with the state, the step) when given, else
a digest of the state (tensors' bytes included); ranks that hold another version, or
another digest, than the source get the source's state. The source is the survivor
with the highest version (the lowest such rank), or, without versions, the lowest
survivor. Nothing else is sent when the survivors agree.

In the first iteration of the job with no new rank it returns at once, without a
collective (every rank knows that the same way: ``call_wrapper.new_ranks`` and
``call_wrapper.iteration`` are read when no rank runs the function; a replacement
stays new until it got the state or trained). Tensors travel pickled by
``torch.distributed.broadcast_object_list`` over the iteration's default group: give
CPU tensors (``state_dict()`` of a CPU copy), or pass ``device`` for NCCL.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Literal, TypeVar

__all__ = ["broadcast_state"]

T = TypeVar("T")


def broadcast_state(
    call_wrapper: Any,
    state: T,
    *,
    to: Literal["new", "all"] = "new",
    version: int | None = None,
    device: Any = None,
    group: Any = None,
) -> T:
    """Give the new ranks of this iteration, and the survivors that hold another
    state than the source (``to="all"``: every rank, once anything is sent), the state
    of the source survivor; return the state this rank should use.

    ``version``: an int that grows as the state advances (the step); the survivor with
    the highest one is the source. Without it, the lowest survivor is, and a digest
    of the state tells who differs. A collective when a rank is new or the iteration
    follows a restart; nothing otherwise."""
    import torch.distributed as dist

    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise TypeError(f"broadcast_state: version must be an int (the step), got {version!r}")
    new = frozenset(call_wrapper.new_ranks) if call_wrapper is not None else frozenset()
    restarted = call_wrapper is not None and call_wrapper.iteration > 0
    if not new and not restarted:
        return state
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    survivors = [r for r in range(world) if r not in new]
    if not survivors:
        return state  # every rank is new: nobody has anything to give
    mine = None if rank in new else (version if version is not None else _digest(state))
    marks: list[Any] = [None] * world
    dist.all_gather_object(marks, mine, group=group)
    source = _source(marks, survivors, by_version=version is not None)
    receivers = {r for r in range(world) if r in new or marks[r] != marks[source]}
    if not receivers:
        return state  # the survivors agree and nobody is new: nothing to send
    box: list[Any] = [state if rank == source else None]
    dist.broadcast_object_list(box, src=source, group=group, device=device)
    if rank in new:
        call_wrapper.has_state()
    take = rank in receivers or to == "all"
    return box[0] if take and rank != source else state


def _source(marks: list[Any], survivors: list[int], *, by_version: bool) -> int:
    if not by_version:
        return survivors[0]
    versions = [m for m in (marks[r] for r in survivors) if isinstance(m, int)]
    if len(versions) != len(survivors):  # a rank passed no version: compare by rank
        return survivors[0]
    best = max(versions)
    return next(r for r in survivors if marks[r] == best)


def _digest(state: object) -> str:
    """A digest of a state: structure, plain values and tensors' bytes (CUDA ones are
    copied to the host). Two ranks holding equal states get equal digests; a value
    that pickles differently per process (a set of str) only costs a broadcast."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, state)
    return h.hexdigest()


def _feed(h: Any, obj: object) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            try:
                data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            except (RuntimeError, TypeError):  # a layout without plain bytes (sparse...)
                h.update(pickle.dumps(t.to("cpu")))
            else:
                h.update(data.data)
    elif isinstance(obj, dict):
        h.update(b"D%d" % len(obj))
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(b"L%d" % len(obj))
        for value in obj:
            _feed(h, value)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:
        try:
            h.update(pickle.dumps(obj))
        except Exception:
            h.update(f"{type(obj).__qualname__}:{id(obj)}".encode())  # unknown: differs
