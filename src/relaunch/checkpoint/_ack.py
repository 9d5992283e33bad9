"""The worker's side of the peer copy: tell the node's agent that a snapshot is
complete, then wait until the ring successor holds a copy of it (``_peers`` is the
agents' side; ``_wire`` the messages).

The next save waits for this one, so the copies' pace is the snapshots' pace, and the
step every rank's copy holds is still in every rank's memory while the next is copied.
Standard library only.
"""

from __future__ import annotations

import logging
import threading

from relaunch.checkpoint import _wire as wire
from relaunch.checkpoint._channel import Channel
from relaunch.checkpoint._layout import Where

__all__ = ["PeerAck"]

log = logging.getLogger("relaunch.checkpoint")

_ASK_TIMEOUT = 10.0
"""Seconds one question to the agent may take (it answers a wait within a second)."""


class PeerAck:
    """One rank's snapshots told to its agent, and their peer copies waited for."""

    def __init__(self, where: Where) -> None:
        self._where = where
        self._agent = None if where.agent is None else Channel(*where.agent)
        """The connection to the agent's snapshot server (the writer thread's)."""
        self.peer = False
        """Whether the last snapshot had a peer copy made (the node keeps one more)."""
        self._exiting = threading.Event()
        self._warned = False

    def exiting(self) -> None:
        """The process exits: no snapshot waits for a copy from now on (the peers may
        be gone)."""
        self._exiting.set()

    def after_save(self, step: int, crc: int) -> None:
        """Tell the agent of snapshot ``step`` (CRC ``crc``) and wait until its ring
        successor holds a copy. No agent, no successor, an agent that cannot be
        reached, or the process exiting: no wait (one warning the first time the
        agent cannot be reached)."""
        agent = self._agent
        if agent is None:
            return
        base = {"job": self._where.job, "rank": self._where.rank, "step": step}
        try:
            self.peer = wire.flag(agent.ask({**base, "op": "saved"}, _ASK_TIMEOUT), "peer")
            while self.peer and not self._exiting.is_set():
                raw = agent.ask({**base, "op": "wait_ack", "crc": crc}, _ASK_TIMEOUT)
                if wire.flag(raw, "acked"):
                    return
                self.peer = wire.flag(raw, "peer")
        except (OSError, wire.WireError) as exc:
            if not self._warned:
                log.warning("rank %s: no peer copy of the snapshots: %s", self._where.rank, exc)
                self._warned = True

    def close(self) -> None:
        """Close the connection to the agent (the process exits; no save is in flight)."""
        if self._agent is not None:
            self._agent.close()
