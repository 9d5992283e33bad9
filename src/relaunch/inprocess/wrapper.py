"""``CallWrapper``: one call of a function wrapped by :class:`~relaunch.inprocess.wrap.Wrapper`."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from relaunch.inprocess import _params, _rejoin, _sockets
from relaunch.inprocess._coord import CoordinationStore
from relaunch.inprocess._env import (
    StallClock,
    announce_to_agent,
    namespace,
    refuse_initialized_group,
    store_factory,
    terminate_self,
    warn_if_logging_is_off,
)
from relaunch.inprocess._groups import GroupRefs, release_frames, reset_group_names
from relaunch.inprocess._logs import get_logger
from relaunch.inprocess._rendezvous import EnvRendezvousPatch
from relaunch.inprocess._roster import assign, assign_exchanged, initial_state, readmit
from relaunch.inprocess.abort import destroy_default_group
from relaunch.inprocess.attribution import Interruption, InterruptionRecord
from relaunch.inprocess.exception import RankShouldRestart, RestartAbort, TimeoutError
from relaunch.inprocess.monitor_process import MonitorProcess, MonitorSettings
from relaunch.inprocess.monitor_thread import MainThreadControl, MonitorThread
from relaunch.inprocess.progress_watchdog import MainThreadProgress, SharedProgress
from relaunch.inprocess.rank_assignment import uses_store
from relaunch.inprocess.state import Mode, State

if TYPE_CHECKING:
    from relaunch.inprocess.wrap import Wrapper

__all__ = ["CallWrapper"]

log = get_logger(__name__)

_POLL = 0.005
"""Barrier polling period (seconds): a barrier completes within one period of the last arrival."""


class CallWrapper:
    """The restart state and machinery of one call of a wrapped function.

    Passed to the function's parameter annotated ``CallWrapper`` (or
    ``CallWrapper | None``): read :attr:`iteration`, call :meth:`ping`, use :meth:`atomic`.
    """

    def __init__(self, wrapper: Wrapper) -> None:
        refuse_initialized_group()
        warn_if_logging_is_off()
        cfg = wrapper.config
        self.config = cfg
        self.wrapper_health_check = wrapper.restart_health_check
        self.state = State.from_env()
        self.incarnation = _rejoin.incarnation()
        self._new: set[int] = set()
        self._unstated = self.incarnation > 0
        self._stall = StallClock()
        self.shared = SharedProgress()
        self._abort_lock = threading.Lock()
        self._aborted = False
        self.groups = GroupRefs()
        self._factory, host_port = store_factory(cfg, self.state.initial_rank)
        self.namespace = namespace()
        settings = MonitorSettings.of(
            cfg,
            self.state,
            namespace=self.namespace,
            host_port=host_port,
            incarnation=self.incarnation,
        )
        self.monitor_process = MonitorProcess(settings, self.shared, self._factory)
        self._hosting = host_port is not None
        self.atomic_lock = threading.RLock()
        self.control = MainThreadControl(self.atomic_lock)
        self.watchdog = MainThreadProgress(self.shared, cfg.seconds("progress_watchdog_interval"))
        self._coord: CoordinationStore | None = None
        self._thread_coord: CoordinationStore | None = None
        self.monitor_process.start()  # fork first: the child inherits no connection, no thread
        try:
            self._coord = CoordinationStore(self._factory(), self.namespace)
            self._thread_coord = CoordinationStore(self._factory(), self.namespace)
            self._thread_coord.incarnations = self._coord.incarnations  # one map
            if self.incarnation > 0:
                self._coord.incarnations[self.state.initial_rank] = self.incarnation
            self.watchdog.start()
            _sockets.mark_baseline()  # the wrapper's own connections are never shut down
        except BaseException:
            self._close()
            raise
        self._rdzv = EnvRendezvousPatch(
            self._factory, lambda: self.coord.pg_prefix(self.state.iteration)
        )

    @property
    def coord(self) -> CoordinationStore:
        assert self._coord is not None
        return self._coord

    # public API of the wrapped function ---------------------------------------------
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
        return frozenset(self._new)

    def ping(self) -> None:
        """Report progress; after the first ping, a rank that stops pinging times out."""
        self.watchdog.ping()
        if self._unstated:
            self.has_state()

    def has_state(self) -> None:
        """This replacement process has its training state (``broadcast_state`` and the
        first ``ping`` say so): it is no longer among the :attr:`new_ranks`."""
        if self._unstated:
            self._unstated = False
            self.coord.mark_stated(self.state.initial_rank, self.incarnation)

    def disable_hang_protection(self) -> contextlib.AbstractContextManager[None]:
        """No soft or hard timeout inside the block (a long, legitimately silent call:
        a checkpoint save); progress counts again from its end. Faults of other ranks
        still interrupt it."""
        return self.shared.unarmed()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the restart never interrupts midway (and does not enter once begun)."""
        with self.atomic_lock:
            yield

    # context manager -------------------------------------------------------------------
    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        _sockets.clear_baseline()
        log.debug("rank %s: closing", self.state.initial_rank)
        self.watchdog.shutdown()
        grace = self.config.seconds("termination_grace_time")
        self.monitor_process.shutdown(float("inf") if self._hosting else grace + 5.0)
        self._coord = None
        self._thread_coord = None
        self.groups.release()
        gc.collect()  # drops the store connections
        self.shared.close()

    # the restart loop ---------------------------------------------------------------
    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        name = _params.call_wrapper_parameter(fn, CallWrapper)
        if name is not None and name not in kwargs:
            kwargs = {**kwargs, name: self}
        me = self.state.initial_rank
        world = set(range(self.state.initial_world_size))
        self.control.install()
        self._rdzv.install()
        announce_to_agent()
        ret: Any = None
        try:
            roster = self._first_roster(world)
            if roster is None:
                return None  # a replacement that came when the job had completed
            while True:
                state = roster.get(me)
                if state is None or state.mode is Mode.TERMINATED:
                    raise RestartAbort(f"rank {me} was terminated")
                self.state = state
                state.set_distributed_vars()
                self.shared.iteration = state.iteration
                self.coord.publish_roster(
                    state.iteration, _rejoin.encode_roster(roster, self.coord.incarnations)
                )
                done, value = self._iteration(fn, args, kwargs, roster)
                if done:
                    ret = value
                    break
                it = state.iteration
                terminated = self._restart(value, set(roster))
                exchanged = uses_store(self.config.rank_assignment)
                # A stateful, store-exchanging assignment (Tree) cannot be replayed to
                # readmit replacements: they are not admitted (they end cleanly).
                admitted = (
                    {} if exchanged else _rejoin.admit(self.coord, it, set(roster), terminated)
                )
                if admitted:
                    log.info("rank %s: ranks %s rejoin", me, sorted(admitted))
                    roster = readmit(self.config, roster, terminated, set(admitted), it)
                else:
                    roster = self._assign(roster, terminated, advance=True, tag=str(it))
                self._new = _rejoin.fresh_ranks(self.coord, roster)
        except BaseException as exc:
            kind = (
                Interruption.TERMINATED
                if isinstance(exc, Exception)
                else Interruption.BASE_EXCEPTION
            )
            log.error("rank %s leaves the job: %r", me, exc)
            with contextlib.suppress(Exception):
                self.coord.record_dead(self.state.iteration, me, kind, repr(exc))
            raise
        finally:
            self.shared.armed = 0
            self._rdzv.uninstall()
            self.control.uninstall()
            with contextlib.suppress(Exception):
                self.coord.record_exited(me)
        return ret

    def _first_roster(self, world: set[int]) -> dict[int, State] | None:
        """The roster of the first iteration this process runs: the initial one after
        the initial barrier, or, for a replacement, the one it is admitted into."""
        me, timeout = self.state.initial_rank, self.config.seconds("barrier_timeout")
        size = self.state.initial_world_size
        if self.incarnation > 0:
            _rejoin.preload()  # ready before it asks: its peers must not wait for imports
            roster = _rejoin.wait_for_admission(self.coord, me, self.incarnation, timeout, _POLL)
            if roster is not None:
                self._new = _rejoin.fresh_ranks(self.coord, roster)
                log.info("rank %s: replacement admitted at iteration %s", me, roster[me].iteration)
            return roster
        dead = self.coord.initial_barrier(me, world, timeout, _POLL)
        layout = {r: initial_state(r, size) for r in world}
        return self._assign(layout, dead, advance=False, tag="init")

    def _assign(
        self, roster: dict[int, State], terminated: set[int], *, advance: bool, tag: str
    ) -> dict[int, State]:
        if not uses_store(self.config.rank_assignment):
            return assign(self.config, roster, terminated, advance=advance)
        return assign_exchanged(
            self.config,
            roster,
            terminated,
            advance=advance,
            me=self.state.initial_rank,
            coord=self.coord,
            tag=tag,
            timeout=self.config.seconds("barrier_timeout"),
        )

    def _iteration(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        roster: dict[int, State],
    ) -> tuple[bool, Any]:
        """Run one iteration; return (True, value) when the job completed, else (False, cause)."""
        cfg, state, coord = self.config, self.state, self.coord
        me, it = state.initial_rank, state.iteration
        members = set(roster)
        active = {r for r, s in roster.items() if s.mode is Mode.ACTIVE}
        with self._abort_lock:
            self._aborted = False
        if not coord.iteration_barrier(it, me, members, cfg.seconds("barrier_timeout"), _POLL):
            return False, None
        log.debug("rank %s: iteration %s barrier passed", me, it)
        announce_to_agent(iteration=it, active=state.mode is Mode.ACTIVE)
        if state.mode is not Mode.ACTIVE:
            log.debug("rank %s is a spare at iteration %s", me, it)
            return coord.completion(it, None, active, None, _POLL), None
        _sockets.mark_baseline()
        self.shared.arm()
        assert self._thread_coord is not None
        monitor = MonitorThread(
            coord=self._thread_coord,
            iteration=it,
            initial_rank=me,
            members=members,
            interval=cfg.seconds("monitor_thread_interval"),
            soft_timeout=cfg.seconds("soft_timeout"),
            shared=self.shared,
            control=self.control,
            abort=self._abort_once,
            reabort=self._abort_again,
            groups=self.groups,
        )
        monitor.start()
        try:
            kind, value = self._call(fn, args, kwargs)
        finally:
            self.shared.armed = 0
            monitor.shutdown(cfg.seconds("barrier_timeout"))
        self._check_stall(monitor.stalled_at)
        if kind in ("exception", "restart"):
            if kind == "exception":
                log.warning("rank %s: iteration %s raised %r", me, it, value)
            # (a restart the monitor did not trigger: the function asked for it itself)
            if not monitor.triggered.is_set():
                why = repr(value) if kind == "exception" else "RankShouldRestart"
                record = InterruptionRecord(
                    initial_rank=me, interruption=Interruption.EXCEPTION, message=why
                )
                coord.record_interrupted(it, record)
            return False, value
        self.groups.release()  # the function's frame is gone: so are its DDP reducers
        completion = cfg.seconds("completion_timeout")
        return coord.completion(it, me, active, completion, _POLL), value

    def _check_stall(self, stalled_at: float | None) -> None:
        """The hard timeout across restarts (see :class:`StallClock`)."""
        me, hard = self.state.initial_rank, self.config.seconds("hard_timeout")
        message = self._stall.overdue(stalled_at, hard, me)
        if message is not None:  # killed as NVIDIA's monitor process kills at hard_timeout
            self.coord.record_dead(self.state.iteration, me, Interruption.HARD_TIMEOUT, message)
            terminate_self(message, self.config.seconds("termination_grace_time"))
            raise TimeoutError(message)  # a SIGTERM handler of the program raised

    def _call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, Any]:
        outcome: tuple[str, Any] | None = None
        try:
            try:
                reset_group_names(self.state.iteration)
                self.control.enter()
                cfg, state = self.config, self.state
                _params.initialize_then_check(
                    cfg.initialize, cfg.health_check, state, state.initial_rank
                )
                outcome = ("ok", fn(*args, **kwargs))
            except Exception as exc:
                outcome = ("exception", exc)
            finally:
                self.control.leave()
        except RankShouldRestart as restart:
            self.control.leave()
            release_frames(restart, chain=False)  # landed in fn: free its frames' objects
            cause = outcome[1] if outcome is not None else restart.__context__
            return "restart", cause
        assert outcome is not None
        return outcome

    def _abort_again(self) -> None:
        """Run the abort callbacks (again: see MonitorThread's re-abort)."""
        self.groups.take()  # references first: the abort may drop torch's
        try:
            _params.run_callbacks(self.config.abort, self.state.freeze())
        except Exception:
            log.exception("rank %s: abort failed", self.state.initial_rank)

    def _abort_once(self) -> None:
        with self._abort_lock:
            if self._aborted:
                return
            self._aborted = True
        self._abort_again()

    def _restart(self, cause: Any, members: set[int]) -> set[int]:
        """The restart procedure; returns the frozen set of terminated initial ranks."""
        cfg, me, it = self.config, self.state.initial_rank, self.state.iteration
        train_ex = cause if isinstance(cause, BaseException) else None
        # The hard timeout covers the restart procedure too (its waits poll in Python):
        # a rank stuck in C here is killed and the others go on without it.
        self.shared.arm()
        self._abort_once()
        destroy_default_group()  # here, not in the monitor thread (see abort.py)
        exc_ = train_ex if isinstance(train_ex, Exception) else None
        self.state = dataclasses.replace(self.state, fn_exception=exc_)
        _params.finalize_then_check(
            cfg.finalize,
            self.wrapper_health_check,
            self.state,
            me,
            lambda why: self.coord.record_dead(it, me, Interruption.TERMINATED, why),
        )
        release_frames(train_ex)
        gc.collect(1)
        self.groups.release()  # the last references: groups are destroyed without the GIL
        self.shared.iteration = it + 1  # a death from now on interrupts the next iteration
        terminated = self.coord.termination_barrier(
            it,
            me,
            members,
            cfg.seconds("barrier_timeout"),
            _POLL,
            cfg.seconds("last_call_wait"),
        )
        log.info("rank %s: iteration %s ends; terminated ranks %s", me, it, sorted(terminated))
        if me in terminated:
            raise RestartAbort(f"rank {me} was declared terminated")
        return terminated
