"""Keep the process groups of an iteration alive until the iteration's objects are gone,
and bound their gloo collectives' timeout.

A DDP ``Reducer`` holds its process group in C++, and is freed with the GIL held
(when the function returns or its frames are cleared for a restart). If it held the
*last* reference, ``~ProcessGroupGloo`` joins gloo's worker threads under the GIL
while one of them needs the GIL to free a finished work: a deadlock (seen with
py-spy in ~1 restart in 100, and in plain DDP scripts that destroy the group before
the model). Torch destroys a ``ProcessGroup`` whose last reference is a Python one
*without* the GIL, so the wrapper takes Python references to every group it sees
during the iteration and drops them once the function's objects are released.

gloo can leave a send queued, unfailed, on a connection that its dead peer's kernel
closed at that moment (``UnboundBuffer::waitSend``): the collective waits for its
timeout with the GIL released, where no abort reaches it. With gloo's default of 30
minutes, the hard timeout killed such a rank and the agent replaced it: a survivor of
a lost node replaced too, 20 s after the loss (seen in the node-tier tests). So each
group's gloo collectives get the soft timeout as their timeout at most: the stuck
one fails first, and the rank restarts in its process. A collective that takes longer
ends the iteration anyway (the rank makes no progress meanwhile), except inside
``disable_hang_protection()``, where a checkpoint save's collectives may wait for a
slow rank: the groups' own timeouts hold there (:meth:`GroupRefs.unbounded`).
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

from relaunch.inprocess._core._logs import get_logger

__all__ = [
    "GroupRefs",
    "gloo_backends",
    "live_groups",
    "release_frames",
    "reset_group_names",
    "set_gloo_timeout",
]

log = get_logger(__name__)


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


def gloo_backends(group: Any) -> dict[str, Any]:
    """The gloo backends of ``group`` by device type (a backend's Python object is a
    new one at each lookup: key it by its group and device, not by its ``id``)."""
    found = {}
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except Exception:  # a group torn down meanwhile
            continue
        if type(backend).__name__ == "ProcessGroupGloo":
            found[str(device)] = backend
    return found


class GroupRefs:
    """Python references to process groups, taken from any thread, dropped by one;
    with ``bound`` (seconds), their gloo collectives' timeout is that at most."""

    def __init__(self, bound: float | None = None) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Any] = {}
        self._bound = None if bound is None else datetime.timedelta(seconds=bound)
        self._own: dict[tuple[int, str], datetime.timedelta] = {}  # bounded -> own timeout
        self._lifted = 0

    def take(self) -> None:
        """Add every live process group (cheap: called by the monitor thread each poll),
        and bound the new ones' gloo timeout (not inside :meth:`unbounded`)."""
        groups = live_groups()
        if not groups:
            return
        with self._lock:
            for group in groups:
                if id(group) not in self._held:
                    self._held[id(group)] = group
                    if not self._lifted:
                        self._bound_group(group)

    @contextlib.contextmanager
    def unbounded(self) -> Iterator[None]:
        """The groups' own gloo timeouts inside the block (no group created inside is
        bounded); bounded again from its end."""
        with self._lock:
            self._lifted += 1
            if self._lifted == 1:
                for group in self._held.values():
                    for device, backend in gloo_backends(group).items():
                        own = self._own.pop((id(group), device), None)
                        if own is not None:
                            set_gloo_timeout(backend, own)
        try:
            yield
        finally:
            with self._lock:
                self._lifted -= 1
                if not self._lifted:
                    for group in self._held.values():
                        self._bound_group(group)

    def _bound_group(self, group: Any) -> None:
        if self._bound is None:
            return
        for device, backend in gloo_backends(group).items():
            try:
                own = backend.options._timeout
            except Exception:  # best effort: the hard timeout still applies
                continue
            if own > self._bound:  # (a bounded or expired one is not)
                self._own[id(group), device] = own
                set_gloo_timeout(backend, self._bound)

    def release(self) -> None:
        """Drop the references (groups no one else holds are destroyed here, GIL released).

        Call it once the iteration's objects (its frames, a DDP model) are freed.
        """
        with self._lock:
            held, self._held = self._held, {}
            self._own.clear()
        held.update(_take_runner_kept())
        held.clear()


def set_gloo_timeout(backend: Any, timeout: datetime.timedelta) -> None:
    """Give the gloo ``backend``'s collectives started from now on ``timeout`` (best
    effort: a failure is logged at debug level)."""
    try:
        backend._set_default_timeout(timeout)
    except Exception as exc:
        log.debug("cannot set the gloo timeout of %r: %s", backend, exc)


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
