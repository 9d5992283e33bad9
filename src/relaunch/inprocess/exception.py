"""Exceptions of in-process restart.

``RankShouldRestart`` derives from :class:`BaseException` on purpose: it is raised
asynchronously into the main thread to stop the wrapped function, and a user's
``except Exception`` must not swallow it. Everything else derives from
:class:`relaunch.errors.InProcessError`::

    InProcessError
    └── RestartError            the restart procedure cannot go on (this rank stops)
        ├── RestartAbort        the job is over for this rank (terminated, or no rank left)
        ├── HealthCheckError    a health check failed: this rank is terminated
        ├── BarrierTimeoutError a barrier between ranks timed out (also TimeoutError)
        └── InternalError       a bug or an unexpected state in the wrapper
"""

from __future__ import annotations

from relaunch.errors import InProcessError

__all__ = [
    "BarrierTimeoutError",
    "HealthCheckError",
    "InternalError",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
]


class RestartError(InProcessError):
    """The restart procedure cannot go on; this rank leaves the job."""


class RestartAbort(RestartError):
    """This rank was excluded from the job (terminated, or the job cannot continue)."""


class HealthCheckError(RestartError):
    """A health check of this rank failed; the rank is terminated, the others continue."""


class BarrierTimeoutError(RestartError, TimeoutError):
    """Not every expected rank arrived at a barrier before its timeout."""


class InternalError(RestartError):
    """An unexpected state inside the wrapper (a bug); the message holds the state."""


class RankShouldRestart(BaseException):
    """Raised asynchronously in the main thread: stop the function, restart it.

    Never catch it in user code; the wrapper catches it.
    """
