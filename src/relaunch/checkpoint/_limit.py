"""The node's limit on its snapshots' bytes (``--snapshot-limit``; standard library
only, as :mod:`relaunch.checkpoint._layout`)."""

from __future__ import annotations

import contextlib
import functools
import os

from relaunch.checkpoint._layout import ENV_LIMIT, complete_steps, rank_dir, step_dir
from relaunch.errors import SnapshotError

__all__ = ["check_limit", "usage"]


def check_limit(root: str, rank: int, step: int, nbytes: int, keep: int, limit: int | None) -> None:
    """Refuse a snapshot of ``step`` (``nbytes``) that would bring the node's snapshot
    directory ``root`` over ``limit``, counting the other ranks' snapshots and the newest
    ``keep`` of ``rank`` besides it (those that stay while it is written)."""
    if limit is None or _fits_whole(root, nbytes, limit):
        return
    ours = rank_dir(root, rank)
    kept = [s for s in complete_steps(ours) if s != step][:keep]
    mine_after = sum(usage(step_dir(ours, s)) for s in kept)
    others = usage(root) - usage(ours)
    if others + mine_after + nbytes > limit:
        raise SnapshotError(
            f"snapshot of step {step} refused: its {_size(nbytes)} would bring the node's "
            f"snapshot directory {root} to {_size(others + mine_after + nbytes)}, over its "
            f"limit of {_size(limit)} (--snapshot-limit or {ENV_LIMIT}; by default half "
            "the size of the file system that holds the directory)"
        )


def _size(nbytes: int) -> str:
    """``nbytes`` as a reader takes it in: ``4194304 bytes (4.0 MiB)``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes} bytes ({nbytes / scale:.1f} {unit})"
    return f"{nbytes} bytes"


def _fits_whole(root: str, nbytes: int, limit: int) -> bool:
    """Whether ``nbytes`` more fit under ``limit`` even if everything on ``root``'s file
    system were snapshots, for a ``root`` in node memory (tmpfs): one ``statvfs``, where
    the walk of every rank's files costs the training thread 0.1-0.5 ms a save. tmpfs
    counts the pages written, the walk each file's size: they differ by what other
    ranks' saves in flight have still to write, as much as the walk misses of a save
    that starts beside this one. Elsewhere (a disk that compresses or shares blocks
    counts less than the files' sizes) the walk decides."""
    if not _in_memory(root):
        return False
    try:
        st = os.statvfs(root)
    except OSError:  # not made yet: the walk decides
        return False
    if st.f_blocks <= 0 or st.f_frsize <= 0:  # a file system that counts nothing
        return False
    return (st.f_blocks - st.f_bfree) * st.f_frsize + nbytes <= limit


@functools.lru_cache(maxsize=16)
def _in_memory(root: str) -> bool:
    """Whether ``root`` is on a tmpfs (the innermost mount that holds it, as
    ``/proc/self/mounts`` has it; False where that cannot be read)."""
    path = os.path.realpath(root)
    mount, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                at = fields[1].replace("\\040", " ")
                inside = path == at or path.startswith(at.rstrip("/") + "/")
                if inside and len(at) >= len(mount):
                    mount, kind = at, fields[2]
    except OSError:
        return False
    return kind == "tmpfs"


def usage(root: str) -> int:
    """Bytes under ``root`` (every rank's snapshots, partial ones included; a file
    linked twice counts once)."""
    total, seen = 0, set()
    for folder, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(folder, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total
