"""The record of each rank's restores (``restores.jsonl`` in the node's snapshot
directory): what ``load()`` restored, the newest step any rank offered, and from
where. The agent reads it for its summary and its status (the steps redone per
fault); a worker appends a line per ``load()``, in one write. Standard library only
(the agent reads it too); a line that is not a valid record is counted, never
trusted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from relaunch._json import loads as json_loads

__all__ = ["RESTORES", "SOURCES", "Restore", "append_restore", "read_restores"]

RESTORES = "restores.jsonl"
"""At the root: one JSON line per ``load()`` of each rank (what the agent summarises)."""

SOURCES = (None, "memory", "durable", "another rank")
"""Where a restored state came from: nowhere (a fresh start), this node's memory, the
durable copies, or (``load(replicated=True)``) another rank over the process group."""


@dataclass(frozen=True)
class Restore:
    """One rank's ``load()``: the step it restored (None: a fresh start), the newest step
    any rank offered, where the state came from (one of :data:`SOURCES`)."""

    rank: int
    step: int | None
    newest: int | None
    source: str | None

    @property
    def redone(self) -> int:
        """Steps done before the fault that the job does again."""
        if self.newest is None:
            return 0
        return self.newest - (-1 if self.step is None else self.step)


def append_restore(root: str, restore: Restore) -> None:
    line = json.dumps(
        {
            "v": 1,
            "rank": restore.rank,
            "step": restore.step,
            "newest": restore.newest,
            "source": restore.source,
        },
        separators=(",", ":"),
    )
    fd = os.open(os.path.join(root, RESTORES), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line + "\n").encode())  # one write: lines of ranks never mix
    finally:
        os.close(fd)


def read_restores(root: str) -> tuple[list[Restore], int]:
    """The restores recorded under ``root`` and how many lines were not valid records."""
    try:
        with open(os.path.join(root, RESTORES), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return [], 0
    found, bad = [], 0
    for line in lines:
        try:
            doc = json_loads(line)
            ok = isinstance(doc, dict) and doc.get("v") == 1
            ints = [doc.get(k) for k in ("step", "newest")] if ok else []
            ok = ok and _is_count(doc.get("rank")) and all(v is None or _is_count(v) for v in ints)
            ok = ok and doc.get("source") in SOURCES
        except ValueError:
            ok = False
        if not ok:
            bad += 1
            continue
        found.append(Restore(doc["rank"], doc["step"], doc["newest"], doc["source"]))
    return found, bad


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
