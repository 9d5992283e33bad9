"""Training state from a healthy peer, in memory: what a replacement rank starts from.

A replacement process (relaunch's tiered recovery, see ``_rejoin``) enters the
wrapped function with no model or optimizer state. At the start of an iteration,
after ``init_process_group``, every rank calls :func:`broadcast_state` with its
state; the ranks that are new in this iteration get the state of the lowest rank
that is not new, the others get their own back::

    @inprocess.Wrapper(...)
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        dist.init_process_group("gloo")
        state = inprocess.broadcast_state(call_wrapper, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        })
        model.load_state_dict(state["model"]); ...

With no new rank it returns at once, without a collective (every rank knows that the
same way: ``call_wrapper.new_ranks`` is read when no rank runs the function; a
replacement stays new until it got the state or trained). Tensors travel
pickled by ``torch.distributed.broadcast_object_list`` over the iteration's default
group: give CPU tensors (``state_dict()`` of a CPU copy), or pass ``device`` for NCCL.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

__all__ = ["broadcast_state"]

T = TypeVar("T")


def broadcast_state(
    call_wrapper: Any,
    state: T,
    *,
    to: Literal["new", "all"] = "new",
    device: Any = None,
    group: Any = None,
) -> T:
    """Give the new ranks of this iteration (``to="all"``: every rank) the state of the
    lowest rank that is not new; return the state this rank should use. A collective
    when a rank is new, nothing otherwise."""
    import torch.distributed as dist

    new = frozenset(call_wrapper.new_ranks) if call_wrapper is not None else frozenset()
    if not new:
        return state
    world = dist.get_world_size(group)
    sources = [r for r in range(world) if r not in new]
    if not sources:
        return state  # every rank is new: nobody has anything to give
    source = sources[0]
    rank = dist.get_rank(group)
    box: list[Any] = [state if rank == source else None]
    dist.broadcast_object_list(box, src=source, group=group, device=device)
    if rank in new:
        call_wrapper.has_state()
    return box[0] if rank in new or to == "all" else state
