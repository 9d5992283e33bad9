"""The ranks agree on the step they restore: the newest one every rank has whole.

Each rank offers its snapshots' steps (manifests checked); the newest step in every
offer is read by every rank (data length and CRC-32 checked); when any rank's copy is
not whole, every rank drops that step and tries the next one. Two all-gathers of small
lists per step tried, over the default process group.
"""

from __future__ import annotations

import logging
from typing import Any

from relaunch.checkpoint._layout import CorruptSnapshot
from relaunch.errors import SnapshotError

__all__ = ["newest_common"]

log = logging.getLogger("relaunch.checkpoint")


def newest_common(saver: Any, root: str | None) -> tuple[int, Any] | None:
    offers = _gather(saver, saver.steps(root))
    common = set(offers[0]).intersection(*offers[1:]) if offers else set()
    for step in sorted(common, reverse=True):
        state: Any = None
        try:
            state = saver.read(step, root)
            whole = True
        except CorruptSnapshot as exc:
            log.warning(
                "rank %s: snapshot not used: %s; trying an older one", saver.where.rank, exc
            )
            whole = False
        if all(_gather(saver, whole)):
            return step, state
    return None


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
