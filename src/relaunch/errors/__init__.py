"""Errors of relaunch and error propagation from workers to the agent.

The exception tree is documented in :mod:`relaunch.errors._exceptions`.
"""

from relaunch.errors._exceptions import (
    ConfigError,
    InProcessError,
    RelaunchError,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreClosedError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    TimerError,
    WorkerError,
)

__all__ = [
    "ConfigError",
    "InProcessError",
    "RelaunchError",
    "RendezvousClosedError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreClosedError",
    "StoreConnectionError",
    "StoreError",
    "StoreTimeoutError",
    "TimerError",
    "WorkerError",
]
