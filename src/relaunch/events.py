"""Structured events: one frozen dataclass per state change of the agent.

The agent builds one :class:`Event` (where and when) around one detail (what
happened: :data:`Detail`, a closed union, so a reader's ``match`` can be checked for
exhaustiveness and a misspelled event does not type-check). Events become JSON only
where they are written: the ``relaunch.events`` logger and, when a sink file is set,
``<run log dir>/events.jsonl`` (one line per event, format version 1: ``name`` and
``metadata`` are the detail's name and fields).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from relaunch import _event_details
from relaunch._event_details import *  # noqa: F403  (the details are this module's too)
from relaunch._event_details import Detail
from relaunch._event_details import _Detail as _Detail  # the details' base class

__all__ = ["EVENT_VERSION", "Event", "EventSink"]
__all__ += _event_details.__all__

log = logging.getLogger("relaunch.events")

EVENT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Event:
    """One state change: what happened (``detail``), where and when."""

    detail: Detail
    run_id: str
    role: str = ""
    host: str = field(default_factory=socket.gethostname)
    group_rank: int | None = None
    restart_count: int = 0
    timestamp: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        return self.detail.name

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
                "metadata": self.detail.metadata(),
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
