"""The record a node of a round publishes in the round's store: where it serves its
snapshots and which global ranks it runs (versioned JSON, every field checked)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from relaunch._json import loads as json_loads
from relaunch.checkpoint import _wire as wire

__all__ = ["PeerRecord"]


@dataclass(frozen=True)
class PeerRecord:
    """Where a node of the round serves its snapshots, and the global ranks it runs."""

    addr: str
    port: int
    ranks: tuple[int, ...]

    def to_bytes(self) -> bytes:
        doc = {"v": 1, "addr": self.addr, "port": self.port, "ranks": list(self.ranks)}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, key: str) -> PeerRecord:
        """WireError naming ``key`` and the field when the record is not one."""
        try:
            doc = json_loads(raw)
        except ValueError as exc:
            raise wire.WireError(f"{key}: not JSON ({exc})") from exc
        ok = isinstance(doc, dict) and doc.get("v") == 1
        if not ok:
            raise wire.WireError(f"{key}: expected a version 1 peer record, got {raw[:120]!r}")
        addr, port, ranks = doc.get("addr"), doc.get("port"), doc.get("ranks")
        if not isinstance(addr, str) or not addr:
            raise wire.WireError(f"{key}: addr: expected a host, got {addr!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise wire.WireError(f"{key}: port: expected 1-65535, got {port!r}")
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        ):
            raise wire.WireError(f"{key}: ranks: expected a list of ranks, got {ranks!r}")
        return cls(addr, port, tuple(ranks))
