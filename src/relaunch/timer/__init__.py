"""The worker watchdog: "kill me if this block is not done by time T".

The agent runs a :class:`TimerServer` on a named pipe whose path it gives the workers in
``TORCHELASTIC_TIMER_FILE``; a worker wraps a block that may hang in :func:`expires`::

    from relaunch.timer import expires

    with expires(after=60):
        train_step()

The lines on the pipe are torch's ``FileTimerRequest`` JSON, so torch's ``FileTimerClient``
works against :class:`TimerServer` and :func:`expires` works against torch's
``FileTimerServer``.
"""

from relaunch.timer._client import TimerClient, expires
from relaunch.timer._request import TIMER_FILE_ENV, TimerRequest, parse_request
from relaunch.timer._server import TimerServer
from relaunch.timer._table import TimerExpiry

__all__ = [
    "TIMER_FILE_ENV",
    "TimerClient",
    "TimerExpiry",
    "TimerRequest",
    "TimerServer",
    "expires",
    "parse_request",
]
