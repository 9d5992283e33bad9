"""What one call of a wrapped function owns on this rank, from its start to its close:
the monitor process, the shared progress record and its watchdog thread, the store
clients, the process-group references, the main thread's control, and the restart
state the loop (``_loop``) moves forward.

The monitor process is forked first, before the call opens any connection or starts
any thread (the child inherits none); :meth:`RankCall.close` releases everything,
whatever state the call is in. The public :class:`~relaunch.inprocess.CallWrapper`
is a :class:`RankCall` with the methods the wrapped function calls.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

from relaunch.inprocess._core import _rejoin, _sockets
from relaunch.inprocess._core._abort import Aborter
from relaunch.inprocess._core._config import CallConfig
from relaunch.inprocess._core._coord import CoordinationStore
from relaunch.inprocess._core._env import (
    StallClock,
    namespace,
    refuse_initialized_group,
    store_factory,
    warn_if_logging_is_off,
)
from relaunch.inprocess._core._groups import GroupRefs
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._main_thread import MainThreadControl
from relaunch.inprocess._core._monitor_process import MonitorProcess, MonitorSettings
from relaunch.inprocess._core._progress import MainThreadProgress, SharedProgress
from relaunch.inprocess._core._rendezvous import EnvRendezvousPatch
from relaunch.inprocess._core._state import State

__all__ = ["POLL", "RankCall"]

log = get_logger(__name__)

POLL = 0.005
"""Barrier polling period (seconds): a barrier completes within one period of the last arrival."""


class RankCall:
    """The processes, threads, store clients and restart state of one call on this rank.

    ``restart_health_check`` runs after an interruption (the Wrapper builds it);
    ``exchanged``: the rank assignment exchanges data through the store (``Tree``).
    """

    def __init__(
        self,
        config: CallConfig,
        restart_health_check: Callable[[Any], Any] | None,
        *,
        exchanged: bool,
    ) -> None:
        refuse_initialized_group()
        warn_if_logging_is_off()
        self.config = config
        self.wrapper_health_check = restart_health_check
        self.exchanged = exchanged
        self.state = State.from_env()
        """This rank's state in the current iteration (replaced, never mutated)."""
        self.incarnation = _rejoin.incarnation()
        self.fresh: set[int] = set()
        """Ranks of this iteration that are replacements without their training state."""
        self.unstated = self.incarnation > 0
        """This process is a replacement that has not got its training state yet."""
        self.stall = StallClock()
        self.shared = SharedProgress()
        self.groups = GroupRefs(bound=config.seconds("soft_timeout"))
        self.aborter = Aborter(config.abort, self.groups, lambda: self.state)
        self.factory, host_port = store_factory(config, self.state.initial_rank)
        self.namespace = namespace()
        settings = MonitorSettings.of(
            config,
            self.state,
            namespace=self.namespace,
            host_port=host_port,
            incarnation=self.incarnation,
        )
        self.monitor_process = MonitorProcess(settings, self.shared, self.factory)
        self.hosting = host_port is not None
        self.atomic_lock = threading.RLock()
        self.control = MainThreadControl(self.atomic_lock)
        self.watchdog = MainThreadProgress(
            self.shared, config.seconds("progress_watchdog_interval")
        )
        self._coord: CoordinationStore | None = None
        self.thread_coord: CoordinationStore | None = None
        """The monitor thread's store client (a client is not thread-safe)."""
        self.monitor_process.start()  # fork first: the child inherits no connection, no thread
        try:
            self._connect()
        except BaseException:
            self.close()
            raise
        self.rdzv = EnvRendezvousPatch(
            self.factory, lambda: self.coord.pg_prefix(self.state.iteration)
        )

    def _connect(self) -> None:
        """Open the store clients and start the watchdog (after the fork)."""
        self._coord = CoordinationStore(self.factory(), self.namespace)
        self.thread_coord = CoordinationStore(self.factory(), self.namespace)
        self.thread_coord.incarnations = self._coord.incarnations  # one map
        if self.incarnation > 0:
            self._coord.incarnations[self.state.initial_rank] = self.incarnation
        self.watchdog.start()
        _sockets.mark_baseline()  # the wrapper's own connections are never shut down

    @property
    def coord(self) -> CoordinationStore:
        """The main thread's store client (open until :meth:`close`)."""
        assert self._coord is not None
        return self._coord

    def close(self) -> None:
        """Stop the watchdog and the monitor process, drop the store clients and the
        process-group references, release the shared record."""
        _sockets.clear_baseline()
        log.debug("rank %s: closing", self.state.initial_rank)
        self.watchdog.shutdown()
        grace = self.config.seconds("termination_grace_time")
        self.monitor_process.shutdown(float("inf") if self.hosting else grace + 5.0)
        self._coord = None
        self.thread_coord = None
        self.groups.release()
        gc.collect()  # drops the store clients' connections
        self.shared.close()
