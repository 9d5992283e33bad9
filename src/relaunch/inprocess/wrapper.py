"""``CallWrapper``: one call of a function wrapped by :class:`~relaunch.inprocess.wrap.Wrapper`.

What the wrapped function sees of the call (its iteration, ``ping``, ``atomic``, ...);
the machinery is the core's :class:`~relaunch.inprocess._core._call.RankCall`, and
the restart loop is ``_core/_loop.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from relaunch.inprocess._core import _params
from relaunch.inprocess._core._call import RankCall
from relaunch.inprocess._core._loop import run
from relaunch.inprocess.rank_assignment import uses_store

if TYPE_CHECKING:
    from relaunch.inprocess.wrap import Wrapper

__all__ = ["CallWrapper"]


class CallWrapper(RankCall):
    """The restart state and machinery of one call of a wrapped function.

    Passed to the function's parameter annotated ``CallWrapper`` (or
    ``CallWrapper | None``): read :attr:`iteration`, call :meth:`ping`, use :meth:`atomic`.
    """

    def __init__(self, wrapper: Wrapper) -> None:
        cfg = wrapper.config
        super().__init__(
            cfg, wrapper.restart_health_check, exchanged=uses_store(cfg.rank_assignment)
        )

    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (0 for the first call)."""
        return self.state.iteration

    @property
    def new_ranks(self) -> frozenset[int]:
        """Ranks (``RANK`` values) of this iteration that are replacement processes
        without their training state (admitted, and not yet through an iteration in
        which they got it or trained); see :func:`relaunch.inprocess.broadcast_state`.
        The same on every rank; empty when no rank is new."""
        return frozenset(self.fresh)

    def ping(self) -> None:
        """Report progress; after the first ping, a rank that stops pinging times out."""
        self.watchdog.ping()
        if self.unstated:
            self.has_state()

    def has_state(self) -> None:
        """This replacement process has its training state (``broadcast_state`` and the
        first ``ping`` say so): it is no longer among the :attr:`new_ranks`."""
        if self.unstated:
            self.unstated = False
            self.coord.mark_stated(self.state.initial_rank, self.incarnation)

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """No soft or hard timeout inside the block (a long, legitimately silent call:
        a checkpoint save), and gloo collectives wait for their group's own timeout, not
        the soft timeout; progress counts again from its end. Faults of other ranks
        still interrupt it."""
        with self.groups.unbounded(), self.shared.unarmed():
            yield

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the restart never interrupts midway (and does not enter once begun)."""
        with self.atomic_lock:
            yield

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``fn`` with restarts (passing this object to the parameter that asks
        for it); return its value once every active rank has returned."""
        name = _params.call_wrapper_parameter(fn, CallWrapper)
        if name is not None and name not in kwargs:
            kwargs = {**kwargs, name: self}
        return run(self, fn, args, kwargs)
