"""A rank's timeline: the steps the job left are dropped, so that they never outrank
what it saves now (after a restore, its later steps; before a save of an earlier step
than the rank holds, the later ones)."""

from __future__ import annotations

from collections.abc import Callable

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._durable import discard, discard_newer, timeline_lock
from relaunch.checkpoint._readback import offered_steps

__all__ = ["drop_later", "drop_left", "newest_step"]


def newest_step(where: layout.Where) -> int:
    """The newest step of this job and layout the rank holds, in node memory or durable
    (-1: none; those of another layout are kept for a world size that comes back)."""
    roots = [None, *([where.durable] if where.durable else [])]
    return max((s for root in roots for s in offered_steps(where, root, quiet=True)), default=-1)


def drop_later(where: layout.Where, step: int) -> list[int]:
    """Before a save of ``step``: drop the rank's later snapshots in node memory and its
    later durable copies of this layout. Returns the steps dropped."""

    def copies(durable: str) -> list[int]:
        later = [s for s in offered_steps(where, durable, quiet=True) if s > step]
        discard(durable, where.rank, later)
        return later

    gone, later = _drop(where, step, copies)
    return sorted({*gone, *later}, reverse=True)


def drop_left(where: layout.Where, step: int | None) -> list[int]:
    """After a restore of ``step``: drop the rank's snapshots in node memory newer than
    it (all of them for None: a fresh start) and its durable copies newer than it (a
    fresh start keeps them: they may be a world size's that comes back). Returns the
    steps dropped from node memory."""
    gone, _ = _drop(
        where, step, lambda d: [] if step is None else discard_newer(d, where.rank, step)
    )
    return gone


def _drop(
    where: layout.Where, step: int | None, copies: Callable[[str], list[int]]
) -> tuple[list[int], list[int]]:
    """Drop the rank's snapshots in node memory newer than ``step``, and with durable
    copies, ``copies(durable)`` of them, under the timeline lock (no copy of a dropped
    step lands later). Returns the steps dropped from memory and from durable."""
    memory = layout.rank_dir(where.root, where.rank)
    if where.durable is None:
        return layout.discard_newer(memory, step), []
    with timeline_lock(where.root, where.rank, leave=True):
        return layout.discard_newer(memory, step), copies(where.durable)
