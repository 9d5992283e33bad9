"""What the engine reads of the wrapper's parameters: :class:`CallConfig`, a protocol
that :class:`relaunch.inprocess.config.WrapperConfig` satisfies (the config, with its
defaults and checks, is public and built from public callbacks; the engine only reads
it)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["CallConfig"]


class CallConfig(Protocol):
    """The validated parameters of one wrapper, read-only (see ``WrapperConfig`` for
    what each one means)."""

    @property
    def store_factory(self) -> Callable[..., Any] | None: ...
    @property
    def store_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def initialize(self) -> Any: ...
    @property
    def abort(self) -> Any: ...
    @property
    def finalize(self) -> Any: ...
    @property
    def health_check(self) -> Any: ...
    @property
    def rank_assignment(self) -> Callable[..., Any]: ...
    @property
    def rank_filter(self) -> Any: ...
    @property
    def heartbeat_interval(self) -> datetime.timedelta | None: ...
    @property
    def monitor_process_logfile(self) -> str | None: ...
    @property
    def monitor_process_pidfile(self) -> str | None: ...

    def seconds(self, name: str) -> float:
        """A duration parameter (``soft_timeout``, ``barrier_timeout``, ...) in seconds."""
        ...
