"""Interruption records: why an iteration was interrupted, as versioned JSON lines
(NVIDIA's ``inprocess.attribution`` names; :mod:`relaunch.inprocess.attribution`
re-exports them)."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

from relaunch._json import loads as json_loads
from relaunch.inprocess._core._exceptions import InternalError

__all__ = ["Interruption", "InterruptionRecord", "decode_records"]

_VERSION = 1


class Interruption(enum.Enum):
    """Kinds of interruption."""

    EXCEPTION = "exception"
    """The wrapped function raised an exception."""
    BASE_EXCEPTION = "base_exception"
    """A ``BaseException`` (e.g. ``KeyboardInterrupt``) ended the rank's wrapper."""
    SOFT_TIMEOUT = "soft_timeout"
    """No progress for ``soft_timeout``: the rank aborts and restarts."""
    HARD_TIMEOUT = "hard_timeout"
    """No progress for ``hard_timeout``: the monitor process killed the rank."""
    MONITORING_PROCESS_EXCEPTION = "monitoring_process_exception"
    """The monitor process itself failed."""
    UNRESPONSIVE = "unresponsive"
    """No heartbeat for ``heartbeat_timeout``: the rank is declared missing."""
    TERMINATED = "terminated"
    """The rank's process ended (killed, crashed) or a health check failed."""
    JOINED = "joined"
    """A replacement process of a rank that died asks to join (relaunch's tiered
    recovery): not a fault, the ranks restart to take it in."""


@dataclass(frozen=True, kw_only=True)
class InterruptionRecord:
    """One interruption of one rank in one iteration: which process (the rank and its
    incarnation), what happened, when."""

    initial_rank: int
    """The rank's initial rank (stable for the whole job)."""
    incarnation: int = 0
    """Which process of the rank it is about: 0 for the first, ``k`` for its k-th
    replacement. A death record of an earlier incarnation does not make a replacement
    dead."""
    interruption: Interruption
    """What happened."""
    message: str = ""
    """A short human-readable explanation (exception text)."""
    timestamp: float = field(default_factory=time.time)
    """Wall-clock time of the record (seconds since the epoch)."""

    def encode(self) -> str:
        """One JSON line (with its trailing newline)."""
        doc = {
            "version": _VERSION,
            "initial_rank": self.initial_rank,
            "interruption": self.interruption.value,
            "message": self.message[:2000],
            "timestamp": self.timestamp,
            "incarnation": self.incarnation,
        }
        return json.dumps(doc, separators=(",", ":")) + "\n"

    @classmethod
    def decode(cls, line: str) -> InterruptionRecord:
        """Parse one JSON line; raise :class:`InternalError` when it is not a record."""
        try:
            doc = json_loads(line)
            if not isinstance(doc, dict) or doc.get("version") != _VERSION:
                raise ValueError(f"unknown record version in {line!r}")
            rank = doc["initial_rank"]
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError(f"initial_rank is not an int in {line!r}")
            incarnation = doc.get("incarnation", 0)
            if not isinstance(incarnation, int) or isinstance(incarnation, bool) or incarnation < 0:
                raise ValueError(f"incarnation is not an int >= 0 in {line!r}")
            return cls(
                initial_rank=rank,
                interruption=Interruption(doc["interruption"]),
                message=str(doc.get("message", "")),
                timestamp=float(doc["timestamp"]),
                incarnation=incarnation,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InternalError(f"corrupt interruption record {line!r}: {exc}") from exc

    def __str__(self) -> str:
        text = f"rank {self.initial_rank}: {self.interruption.name}"
        return f"{text} ({self.message})" if self.message else text


def decode_records(blob: bytes) -> list[InterruptionRecord]:
    """Decode a store value made of appended JSON lines (empty lines are skipped)."""
    text = blob.decode("utf-8", errors="replace")
    return [InterruptionRecord.decode(line) for line in text.split("\n") if line.strip()]
