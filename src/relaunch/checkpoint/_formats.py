"""What the framework integrations (``hf``, ``lightning``, ``dcp``) put around a
snapshot's state: a format name and a version, checked when it is restored."""

from __future__ import annotations

from typing import Any

from relaunch.errors import SnapshotError

__all__ = ["check_every", "restored_as", "tagged"]


def tagged(fmt: str, version: int, **fields: Any) -> dict[str, Any]:
    """The state to save: ``fields`` under the integration's format and version."""
    return {"format": fmt, "version": version, **fields}


def restored_as(
    restored: tuple[int, Any] | None, fmt: str, version: int, writer: str
) -> tuple[int, dict[str, Any]] | None:
    """``checkpoint.load()``'s answer, checked to be ``writer``'s (None stays None);
    SnapshotError naming the step, the format expected and the writer otherwise."""
    if restored is None:
        return None
    step, snap = restored
    if not isinstance(snap, dict) or snap.get("format") != fmt or snap.get("version") != version:
        raise SnapshotError(
            f"the snapshot of step {step} was not written by {writer} (format {fmt!r} "
            f"version {version}): another script's?"
        )
    return step, snap


def check_every(every: object, who: str) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise SnapshotError(f"{who}: every must be an int >= 1, got {every!r}")
    return every
