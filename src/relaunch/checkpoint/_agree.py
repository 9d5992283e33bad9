"""The ranks agree on the step they restore: the newest one every rank has whole.

Each rank offers the steps of its snapshots in node memory and in the durable copies
(manifests checked); the newest step in every offer is read by every rank, from node
memory when it is there, else from the durable copy (data length and CRC-32 checked);
when any rank has no whole copy of it, every rank drops that step and tries the next
one. A replacement for a lost node, with no snapshot in its memory, restores the
survivors' step from the durable copies when the copier got there. Small all-gathers
over the default process group.
"""

from __future__ import annotations

import logging
from typing import Any

from relaunch.checkpoint._layout import CorruptSnapshot
from relaunch.errors import SnapshotError

__all__ = ["newest_common"]

log = logging.getLogger("relaunch.checkpoint")


def newest_common(
    saver: Any, roots: list[str | None]
) -> tuple[tuple[int, Any, str | None] | None, int | None]:
    """``(step, state, root)``: the newest step every rank holds whole in one of
    ``roots`` (None: node memory; tried in order), this rank's state of it and where it
    came from, or None when there is no such step; and the newest step any rank
    offered (what the job had done: the steps between are redone)."""
    where: dict[int, list[str | None]] = {}
    for root in roots:
        for step in saver.steps(root):
            where.setdefault(step, []).append(root)
    offers = _gather(saver, sorted(where))
    common = set(offers[0]).intersection(*offers[1:]) if offers else set()
    newest = max((max(o) for o in offers if o), default=None)
    for step in sorted(common, reverse=True):
        found: tuple[int, Any, str | None] | None = None
        for root in where[step]:
            try:
                found = step, saver.read(step, root), root
                break
            except CorruptSnapshot as exc:
                log.warning(
                    "rank %s: snapshot not used: %s; trying an older one", saver.where.rank, exc
                )
        if all(_gather(saver, found is not None)):
            return found, newest
    return None, newest


def _gather(saver: Any, mine: Any) -> list[Any]:
    world = saver.where.world_size
    if world == 1:
        return [mine]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise SnapshotError(
            f"checkpoint.load() compares the {world} ranks' snapshots over the default "
            "process group: call it after torch.distributed.init_process_group"
        )
    if dist.get_world_size() != world:
        raise SnapshotError(
            f"the default process group has {dist.get_world_size()} ranks, WORLD_SIZE is {world}"
        )
    out: list[Any] = [None] * world
    dist.all_gather_object(out, mine)
    return out
