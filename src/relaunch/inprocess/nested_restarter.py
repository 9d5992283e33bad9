"""Lines for a nested restarter (NVIDIA's ``inprocess.nested_restarter``).

A launcher that restarts whole processes (NVIDIA's ft_launcher) follows an in-process
restart from log lines of the form
``active_rank=R [NestedRestarter] name=[InProcess] state=S [stage=T]``. Add
``NestedRestarterHandlingCompleted()`` to ``initialize`` and
``NestedRestarterHandlingStarting()`` to ``abort`` to emit them, on one rank
(``special_rank``, default 0).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from typing import Any

from relaunch.inprocess.abort import Abort
from relaunch.inprocess.initialize import Initialize

__all__ = [
    "NestedRestarterCallback",
    "NestedRestarterHandlingCompleted",
    "NestedRestarterHandlingStarting",
    "NestedRestarterLogger",
]


class NestedRestarterLogger:
    """The restarter's log: the ``InprocessRestarter`` logger, to stderr, not propagated."""

    def __init__(self) -> None:
        self.name = "InprocessRestarter"
        self.hostname = socket.gethostname()
        self.connected_rank: int | None = None
        self.restarter_logger = logging.getLogger(self.name)
        if not self.restarter_logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(
                logging.Formatter(
                    f"[%(asctime)s] [%(levelname)s] [{self.name}@{self.hostname}] %(message)s"
                )
            )
            self.restarter_logger.addHandler(handler)
            self.restarter_logger.setLevel(logging.INFO)
            self.restarter_logger.propagate = False

    def set_connected_rank(self, rank: int | None) -> None:
        self.connected_rank = rank

    def log_for_restarter(self, message: str) -> None:
        self.restarter_logger.info(message)


_shared_logger = NestedRestarterLogger()


@dataclasses.dataclass
class NestedRestarterCallback:
    """Logs ``state=<restarter_state> [stage=<restarter_stage>]`` on ``special_rank``."""

    restarter_state: str
    restarter_stage: str | None = None
    logger: NestedRestarterLogger = dataclasses.field(default=_shared_logger)
    special_rank: int = 0

    def __call__(self, state: Any) -> Any:
        if state.initial_rank == self.special_rank:
            self.logger.set_connected_rank(state.initial_rank)
            message = (
                f"active_rank={state.active_rank} [NestedRestarter] name=[InProcess] "
                f"state={self.restarter_state}"
            )
            if self.restarter_stage is not None:
                message += f" stage={self.restarter_stage}"
            self.logger.log_for_restarter(message)
        return state


class NestedRestarterHandlingCompleted(Initialize, NestedRestarterCallback):
    """An ``initialize``: says ``state=initialize`` at the first iteration, then
    ``state=handling stage=completed`` at each restart."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(
            self, restarter_state="initialize", logger=_shared_logger, special_rank=special_rank
        )
        self._called_once = False

    def __call__(self, state: Any) -> Any:
        state = NestedRestarterCallback.__call__(self, state)
        if not self._called_once:
            self._called_once = True
            self.restarter_state, self.restarter_stage = "handling", "completed"
        return state


class NestedRestarterHandlingStarting(Abort, NestedRestarterCallback):
    """An ``abort``: says ``state=handling stage=starting`` when a restart begins."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(
            self,
            restarter_state="handling",
            restarter_stage="starting",
            logger=_shared_logger,
            special_rank=special_rank,
        )

    def __call__(self, state: Any) -> Any:
        return NestedRestarterCallback.__call__(self, state)
