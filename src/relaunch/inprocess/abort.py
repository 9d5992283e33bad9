"""Abort: release whatever the wrapped function is blocked in, asynchronously.

Abort runs in the monitor thread while the main thread may be blocked in a
collective; it must make that call return. The engine destroys the default group
afterwards, in the main thread (:func:`destroy_default_group`, defined in the core).
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import os

from relaunch.inprocess._core import _sockets
from relaunch.inprocess._core._abort import destroy_default_group
from relaunch.inprocess._core._groups import gloo_backends, live_groups, set_gloo_timeout
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._state import State

__all__ = ["Abort", "AbortTorchDistributed", "AbortTransformerEngine", "destroy_default_group"]

log = get_logger(__name__)


class Abort(abc.ABC):
    """Base class of abort callbacks."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Make the main thread's blocking calls return; called from the monitor thread."""


class AbortTorchDistributed(Abort):
    """Abort every torch.distributed process group (the wrapper then destroys the
    default one in the main thread: :func:`destroy_default_group`).

    NCCL communicators are aborted. For Gloo (and for a rendezvous still waiting on
    the store), the read side of the TCP connections opened by this iteration is shut
    down, which makes a pending collective fail at once (measured: ~2 ms); the
    connections close for the peers once they have aborted too (the restart's
    termination barrier, or 0.2 s; see ``_core/_sockets.py`` for why not at once). Gloo backends get a 1 ms timeout
    first, so a collective started after the abort fails too. Connections opened
    before the iteration (the wrapper's own store clients) are kept; other sockets the
    function opened in this iteration are shut down too.
    """

    def __init__(
        self, torch_fr_trace_path: str | None = None, *, shutdown_sockets: bool = True
    ) -> None:
        self.torch_fr_trace_path = torch_fr_trace_path or os.environ.get("NVRX_FR_TRACE_PATH")
        """Where NCCL flight-recorder traces go (``<path>/iter_<n>/rank_<r>``) when
        ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 (NVIDIA's parameter); None: not collected."""
        self.shutdown_sockets = shutdown_sockets

    def __call__(self, state: State) -> State:
        import torch.distributed as dist

        if not dist.is_available():
            return state
        if dist.is_initialized():
            if self.torch_fr_trace_path:
                _dump_flight_recorder(self.torch_fr_trace_path, state)
            _abort_nccl(dist)
            _expire_gloo()
        if self.shutdown_sockets:
            count = _sockets.shutdown_new_connections()
            log.debug("rank %s: shut down %s connections", state.initial_rank, count)
        # The default group is destroyed by the wrapper in the main thread, once the
        # function has left (destroy_default_group): the abort runs in the monitor
        # thread, and destroying there shuts the group's worker threads down under a
        # collective the main thread queued and no worker started: Work::wait forever.
        return state

    def __repr__(self) -> str:
        return f"AbortTorchDistributed(shutdown_sockets={self.shutdown_sockets})"


_EXPIRED = datetime.timedelta(milliseconds=1)


def _expire_gloo() -> None:
    """Give every gloo backend a 1 ms timeout, so collectives started *after* the abort
    fail at once.

    The socket shutdown releases the collectives already waiting. But the main thread
    may still be inside C++ (a DDP backward) and enqueue another bucket's allreduce on
    the broken pairs; gloo then waits for it up to the group's timeout (30 min by
    default), and the restart exception, which needs bytecode to run, never lands
    (seen ~1 in 500 DDP restarts under load: a rank stuck in ``finalize_backward``
    until its hard timeout). With the timeout expired, that allreduce fails in ms.
    """
    for group in live_groups():  # (best effort: the socket shutdown still applies)
        for backend in gloo_backends(group).values():
            set_gloo_timeout(backend, _EXPIRED)


def _abort_nccl(dist: object) -> None:
    from torch.distributed import distributed_c10d as c10d

    for group in live_groups():
        try:
            backend = str(c10d.get_backend(group))
        except Exception:
            continue
        if "nccl" not in backend:
            continue
        abort_fn = getattr(c10d, "_abort_process_group", None)
        try:
            if abort_fn is not None:
                abort_fn(group)
            else:
                group.abort()
        except Exception as exc:
            log.debug("NCCL abort failed: %s", exc)


class AbortTransformerEngine(Abort):
    """Release TransformerEngine's userbuffers and FP8 global state (NVIDIA's); does
    nothing where TransformerEngine is not installed."""

    def __call__(self, state: State) -> State:
        try:
            import transformer_engine.pytorch as te  # type: ignore[import-not-found]
        except Exception:
            return state
        with contextlib.suppress(Exception):
            te.module.base.destroy_ub()
        with contextlib.suppress(Exception):
            te.fp8.FP8GlobalStateManager.reset()
        return state


def _dump_flight_recorder(path: str, state: State) -> None:
    """Write this rank's NCCL flight-recorder trace (torch's own format)."""
    try:
        if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")) <= 0:
            return
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]

        folder = os.path.join(path, f"iter_{state.iteration}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{state.initial_rank}"), "wb") as f:
            f.write(_dump_nccl_trace())
    except Exception as exc:  # a trace is a nicety: the abort must go on
        log.warning("cannot write the NCCL flight-recorder trace to %s: %s", path, exc)
