"""The exceptions of in-process restart, defined in the core because the engine raises
them; :mod:`relaunch.inprocess.exception` (NVIDIA's module) re-exports them and draws
their tree."""

from __future__ import annotations

import builtins

from relaunch.errors import InProcessError

__all__ = [
    "BarrierTimeoutError",
    "HealthCheckError",
    "InternalError",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "TimeoutError",
]


class RestartError(InProcessError):
    """The restart procedure cannot go on; this rank leaves the job."""


class RestartAbort(BaseException):
    """The wrapper ends now, without any further restart (this rank leaves the job)."""


class HealthCheckError(RestartError):
    """A health check of this rank failed; the rank is terminated, the others continue."""


class InternalError(RestartError):
    """An unexpected state inside the wrapper (a bug); the message holds the state."""


class TimeoutError(RestartError, builtins.TimeoutError):
    """A wrapper timeout (a finalize or health check thread, a barrier)."""


class BarrierTimeoutError(TimeoutError):
    """Not every expected rank arrived at a barrier before its timeout."""


class RankShouldRestart(BaseException):
    """Raised asynchronously in the main thread: stop the function, restart it.

    Never catch it in user code; the wrapper catches it. The wrapped function may
    also raise it itself to ask for a restart.
    """
