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

from relaunch.inprocess._core import _exceptions
from relaunch.inprocess._core._exceptions import *  # noqa: F403  (the names of its __all__)

__all__ = list(_exceptions.__all__)
