"""The timer table: pure bookkeeping of acquired scopes, expiry decided from a given time."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from relaunch.timer._request import TimerRequest

__all__ = ["Expired", "TimerExpiry", "TimerTable"]

logger = logging.getLogger(__name__)

#: Acquires beyond this many live timers are dropped (a bound on a flood of stray requests).
MAX_TIMERS = 100_000


@dataclass(frozen=True, kw_only=True)
class TimerExpiry:
    """A worker's timer expired.

    Attributes:
        pid: the worker process.
        scope_id: the expired scope (the first expired one with a signal, if several).
        signal: the signal sent to the worker; 0 means the worker was not killed.
        expired_at: the scope's deadline (``time.time()`` seconds).
    """

    pid: int
    scope_id: str
    signal: int
    expired_at: float


@dataclass(frozen=True, kw_only=True)
class Expired:
    """An expiry decision: what to do, and whether the pid is one the agent watches."""

    expiry: TimerExpiry
    watched: bool
    scopes: tuple[str, ...]


class TimerTable:
    """Acquired timers keyed by ``(pid, scope_id)``, and the set of pids that may be killed.

    Not thread-safe: the owner serializes calls.
    """

    def __init__(self) -> None:
        self._timers: dict[tuple[int, str], TimerRequest] = {}
        self._watched: set[int] = set()

    def __len__(self) -> int:
        return len(self._timers)

    def apply(self, request: TimerRequest) -> None:
        """Acquire (or re-arm) or release the request's scope."""
        key = (request.pid, request.scope_id)
        if request.is_release:
            self._timers.pop(key, None)
        elif key in self._timers or len(self._timers) < MAX_TIMERS:
            self._timers[key] = request
        else:
            logger.warning("timer table full (%s timers): dropping %s", MAX_TIMERS, request)

    def watch(self, pids: Iterable[int]) -> None:
        """Allow the listed pids to be signalled on expiry."""
        self._watched.update(pids)

    def clear_pid(self, pid: int) -> None:
        """Forget a pid: its timers and its permission to be signalled (it exited)."""
        self._watched.discard(pid)
        for key in [k for k in self._timers if k[0] == pid]:
            del self._timers[key]

    def is_watched(self, pid: int) -> bool:
        """True if ``pid`` may be signalled."""
        return pid in self._watched

    def next_deadline(self) -> float | None:
        """The earliest deadline of any live timer, or None."""
        if not self._timers:
            return None
        return min(r.expiration_time for r in self._timers.values())

    def expire(self, now: float) -> list[Expired]:
        """Remove every timer of each pid that has an expired timer; return one decision per pid.

        Like torch, the scope reported is the earliest-expired one with a signal > 0 (else the
        earliest), and all of that pid's timers are dropped.
        """
        by_pid: dict[int, list[TimerRequest]] = {}
        for request in self._timers.values():
            if request.expiration_time <= now:
                by_pid.setdefault(request.pid, []).append(request)
        decisions = []
        for pid, expired in sorted(by_pid.items()):
            expired.sort(key=lambda r: r.expiration_time)
            chosen = next((r for r in expired if r.signal > 0), expired[0])
            for key in [k for k in self._timers if k[0] == pid]:
                del self._timers[key]
            expiry = TimerExpiry(
                pid=pid,
                scope_id=chosen.scope_id,
                signal=chosen.signal,
                expired_at=chosen.expiration_time,
            )
            decisions.append(
                Expired(
                    expiry=expiry,
                    watched=pid in self._watched,
                    scopes=tuple(r.scope_id for r in expired),
                )
            )
        return decisions
