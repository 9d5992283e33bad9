"""Exceptions of in-process restart (NVIDIA's ``inprocess.exception``, same names and bases).

Two derive from :class:`BaseException` on purpose, as in NVIDIA's: a user's
``except Exception`` must not swallow them. :class:`RankShouldRestart` is raised
asynchronously into the main thread to stop the wrapped function;
:class:`RestartAbort` ends the wrapper at once, bypassing any further restart
(``RetryController`` raises it when its limits are reached). Everything else
derives from :class:`relaunch.errors.InProcessError`::

    InProcessError
    └── RestartError              the restart procedure cannot go on (this rank stops)
        ├── HealthCheckError      a health check failed: this rank is terminated
        ├── InternalError         a bug or an unexpected state in the wrapper
        └── TimeoutError          a wrapper timeout (also the builtin TimeoutError)
            └── BarrierTimeoutError  not every expected rank reached a barrier in time
"""

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
