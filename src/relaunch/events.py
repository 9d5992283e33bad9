"""Structured events: one JSON line per state change of the agent.

Each event goes to the ``relaunch.events`` logger and, when a sink file is
set, is appended to it (``<run log dir>/events.jsonl``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EVENT_VERSION", "Event", "EventSink"]

log = logging.getLogger("relaunch.events")

EVENT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Event:
    """One state change: what happened (``name``), where, when, and details."""

    name: str
    run_id: str
    role: str = ""
    host: str = field(default_factory=socket.gethostname)
    group_rank: int | None = None
    restart_count: int = 0
    timestamp: float = field(default_factory=time.time)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": EVENT_VERSION,
                "name": self.name,
                "run_id": self.run_id,
                "role": self.role,
                "host": self.host,
                "group_rank": self.group_rank,
                "restart_count": self.restart_count,
                "timestamp": self.timestamp,
                "metadata": dict(self.metadata),
            },
            default=str,
            sort_keys=True,
        )


class EventSink:
    """Writes events as JSON lines to a file (append, one write per event). Thread-safe."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._lock = threading.Lock()

    @property
    def path(self) -> str | None:
        return self._path

    def emit(self, event: Event) -> None:
        line = event.to_json()
        log.debug("%s", line)
        if self._path is None:
            return
        data = (line + "\n").encode()
        with self._lock:
            try:
                fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
            except OSError as exc:
                log.warning("cannot write event to %s: %s", self._path, exc)
