"""Keep the process groups of an iteration alive until the iteration's objects are gone.

A DDP ``Reducer`` holds its process group in C++, and is freed with the GIL held
(when the function returns or its frames are cleared for a restart). If it held the
*last* reference, ``~ProcessGroupGloo`` joins gloo's worker threads under the GIL
while one of them needs the GIL to free a finished work: a deadlock (seen with
py-spy in ~1 restart in 100, and in plain DDP scripts that destroy the group before
the model). Torch destroys a ``ProcessGroup`` whose last reference is a Python one
*without* the GIL, so the wrapper takes Python references to every group it sees
during the iteration and drops them once the function's objects are released.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

__all__ = ["GroupRefs", "live_groups", "release_frames", "reset_group_names"]


def live_groups() -> list[Any]:
    """The process groups torch.distributed knows now (its ``pg_map``)."""
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return []
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if not pg_map:
        return []
    try:
        return list(pg_map)
    except RuntimeError:  # changed size while read from another thread: next time
        return []


class GroupRefs:
    """Python references to process groups, taken from any thread, dropped by one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Any] = {}

    def take(self) -> None:
        """Add every live process group (cheap: called by the monitor thread each poll)."""
        groups = live_groups()
        if not groups:
            return
        with self._lock:
            for group in groups:
                self._held.setdefault(id(group), group)

    def release(self) -> None:
        """Drop the references (groups no one else holds are destroyed here, GIL released).

        Call it once the iteration's objects (its frames, a DDP model) are freed.
        """
        with self._lock:
            held, self._held = self._held, {}
        held.update(_take_runner_kept())
        held.clear()


def _take_runner_kept() -> dict[int, Any]:
    """The destroyed groups relaunch's worker runner keeps to the end of the process
    (``procs/_worker_hooks``), handed over to be dropped with the iteration's."""
    dist = sys.modules.get("torch.distributed")
    take = getattr(getattr(dist, "destroy_process_group", None), "__relaunch_take_kept__", None)
    kept: dict[int, Any] = take() if callable(take) else {}
    return kept


def release_frames(exc: BaseException | None, *, chain: bool = True) -> None:
    """Free the locals of the failed iteration's frames (its model, process group, ...).

    The traceback keeps them alive; clearing the frames lets their destructors run
    here, in the restart procedure, instead of at a random point of the next
    iteration (a full ``gc.collect()`` would do it too, at ~0.1-0.3 s).
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # (frames still running are skipped)
        exc = (exc.__cause__ or exc.__context__) if chain else None


NAMES_PER_ITERATION = 1_000_000
"""Group names reserved per iteration: iteration ``k`` names its groups from
``k * NAMES_PER_ITERATION`` on."""


def reset_group_names(iteration: int) -> None:
    """Name the iteration's process groups from ``iteration * NAMES_PER_ITERATION`` on
    (when no default group exists).

    torch names an unnamed group by a per-process counter, and the group's keys live
    under that name in the store it is given. Two reasons to set the counter before
    every iteration: (1) an ``init_process_group`` interrupted by a restart leaves the
    counter incremented with no group, so a survivor would name its next default group
    ``"1"`` while a replacement process names it ``"0"`` and they would wait on
    different keys forever: all ranks agree on the iteration; (2) a store of the
    program's own that outlived the failed iteration (a failed DDP backward can keep
    its group, and so the store, alive in C++) still holds the old group's keys: a new
    name per iteration never reads them.
    """
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # pragma: no cover - torch without distributed
        return
    world: Any = getattr(c10d, "_world", None)
    if dist.is_available() and not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = iteration * NAMES_PER_ITERATION
