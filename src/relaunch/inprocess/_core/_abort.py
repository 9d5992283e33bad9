"""The abort of an iteration, from the engine's side: the user's ``abort`` callbacks
run once per iteration (:class:`Aborter`; again while the main thread stays in the
function), and the default process group is destroyed afterwards, in the main thread
(:func:`destroy_default_group`).

The callbacks run in the monitor thread, where the main thread may be blocked in a
collective; destroying the default group there would shut the group's worker threads
down under a collective the main thread queued and no worker started (``Work::wait``
forever), so the engine destroys it once the function has left.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from relaunch.inprocess._core._groups import GroupRefs
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._params import run_callbacks
from relaunch.inprocess._core._state import State

__all__ = ["Aborter", "destroy_default_group"]

log = get_logger(__name__)


class Aborter:
    """Runs the ``abort`` callbacks of one call with the rank's current (frozen) state:
    :meth:`once` per iteration, from whichever thread notices the interruption
    first; :meth:`again` whenever asked (the monitor thread's re-abort)."""

    def __init__(self, callbacks: Any, groups: GroupRefs, state: Callable[[], State]) -> None:
        self._callbacks = callbacks
        self._groups = groups
        self._state = state
        self._lock = threading.Lock()
        self._done = False

    def rearm(self) -> None:
        """A new iteration: the next :meth:`once` aborts again."""
        with self._lock:
            self._done = False

    def once(self) -> None:
        """Abort, unless this iteration was aborted already."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self.again()

    def again(self) -> None:
        """Run the abort callbacks (again: see MonitorThread's re-abort)."""
        self._groups.take()  # references first: the abort may drop torch's
        state = self._state()
        try:
            run_callbacks(self._callbacks, state.freeze())
        except Exception:
            log.exception("rank %s: abort failed", state.initial_rank)


def destroy_default_group() -> None:
    """Destroy the default process group if there is one (from the main thread), and
    what an interrupted ``init_process_group`` left behind."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group still has to go
            log.debug("destroy_process_group failed: %s", exc)
    else:
        _forget_interrupted_init()


_REGISTRIES = (
    "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
    "pg_coalesce_state",
)  # fmt: skip


def _forget_interrupted_init() -> None:
    """A restart that lands inside ``init_process_group`` (between its registration
    steps) leaves the new group in torch's registries with no default group:
    ``is_initialized()`` is False, so nothing destroys it, and it keeps its store alive
    (a program's own multi-tenant TCPStore then serves the next iteration the old
    iteration's keys: gloo connects to dead addresses). Forget it as
    ``destroy_process_group`` would; the wrapper's references drop it afterwards."""
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    registries: list[Any] = [getattr(world, name, None) for name in _REGISTRIES]
    if not any(registries):
        return
    log.debug("forgetting the process groups of an interrupted init_process_group")
    for registry in registries:
        if hasattr(registry, "clear"):
            registry.clear()
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if callable(unregister):
        unregister()
