"""NVIDIA's ``inprocess.wrap`` module: :class:`Wrapper` (the decorator) and the
per-call :class:`~relaunch.inprocess.wrapper.CallWrapper`.

The Wrapper builds its ``restart_health_check`` from the check classes named here
(so code that patches ``wrap.ChainedGPUHealthCheck``, ``wrap.ChainedNVLHealthCheck`` or
``wrap.ChainedNicHealthCheck`` changes what it builds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from relaunch.inprocess.config import WrapperConfig
from relaunch.inprocess.health_check import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
    restart_health_check,
)
from relaunch.inprocess.wrapper import CallWrapper

__all__ = [
    "CallWrapper",
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "Wrapper",
]

F = TypeVar("F", bound=Callable[..., Any])


class Wrapper:
    """Decorator: restart the wrapped function in-process on every healthy rank on a fault.

    Takes the keyword parameters of :class:`~relaunch.inprocess.config.WrapperConfig`
    (NVIDIA's names); a bad one raises :class:`relaunch.errors.ConfigError` naming it.
    The decorated function returns the function's value once every active rank has
    completed; spare ranks return None. A rank that is terminated raises
    :class:`~relaunch.inprocess.RestartError` (a subclass says why).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.config = WrapperConfig(**kwargs)
        self.restart_health_check = restart_health_check(self.config.health_check)
        """What runs after an interruption, as NVIDIA's 0.7: the NIC, NVLink and GPU checks
        of device ``LOCAL_RANK`` first (in that order), then the user's ``health_check``
        (a Compose whose ``instances`` are the user's, GPU, NVLink, NIC: the last runs
        first). None without ``LOCAL_RANK`` and user checks."""

    def __getattr__(self, name: str) -> Any:
        # Not a shim: NVIDIA's 0.7 Wrapper keeps every parameter as an attribute of its
        # own (``wrapper.soft_timeout``, ``wrapper.abort``, ...; see its ``__init__``), and
        # code written for it reads them. Here they live in the frozen config.
        if name in ("config", "restart_health_check"):
            raise AttributeError(name)
        return getattr(self.config, name)

    def __call__(self, fn: F) -> F:
        if not self.config.enabled:
            return fn

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with CallWrapper(self) as call_wrapper:
                return call_wrapper(fn, args, kwargs)

        return wrapped  # type: ignore[return-value]
