"""Reading a rank's snapshots back: which ones it may offer, and one read whole (each
value's bytes straight into its storage, the CRC-32 of the file taken on the way).

A restarting worker waits for this before it trains again: at 100M parameters with
Adam (1.2 GB) a read() into the values and a CRC-32 after it, on one thread, took
1.5 s of the restart on this machine. The file is mapped (private, and only read) and
each chunk is copied out and checksummed while in the cache, on the threads the writer
copies with (``_fill``): 0.9 s. And a restarted worker need not wait for even that:
the runner starts a :class:`Prefetch` of the rank's newest snapshot in node memory
before the script runs (``checkpoint.prefetch``), so the read overlaps the script's
imports, its model's construction and its process group's rendezvous, and ``load()``
finds the state read when the ranks agree on that step.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import BinaryIO

import torch

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._fill import Filler, Part
from relaunch.checkpoint._tree_read import Region, decode, finish

__all__ = [
    "Prefetch",
    "check",
    "offered_steps",
    "read_folder",
    "read_regions",
    "read_sent",
    "read_step",
]

log = logging.getLogger("relaunch.checkpoint")


def offered_steps(
    where: layout.Where, root: str | None = None, *, quiet: bool = False
) -> list[int]:
    """The rank's snapshots under ``root`` (None: node memory) that can be offered (a
    manifest of this job, rank and world size), newest first; those mismatched are
    refused with one warning (none when ``quiet``)."""
    base = layout.rank_dir(root or where.root, where.rank)
    found, refused = [], []
    for step in layout.complete_steps(base):
        folder = layout.step_dir(base, step)
        try:
            check(where, layout.read_manifest(folder), folder, step)
        except layout.CorruptSnapshot as exc:
            refused.append((step, exc))
            continue
        found.append(step)
    if refused and not quiet:  # the newest one's reason; the others' steps
        (_, why), older = refused[0], [step for step, _ in refused[1:]]
        also = f" (also refused: the older steps {older})" if older else ""
        log.warning("snapshot refused: %s%s", why, also)
    return found


def check(where: layout.Where, m: layout.Manifest, folder: str, step: int) -> None:
    """CorruptSnapshot naming the field of ``m`` that is not ``where``'s (job, rank,
    world size) or ``step``."""
    for name, got, want in (
        ("job", m.job, where.job),
        ("rank", m.rank, where.rank),
        ("world_size", m.world_size, where.world_size),
        ("step", m.step, step),
    ):
        if got != want:
            why = "a snapshot of another job or layout"
            if name == "world_size":
                why += (
                    "; a state that is the same on every rank, as plain data parallel "
                    "training's, restores across world sizes: checkpoint.load(replicated=True)"
                )
            raise layout.CorruptSnapshot(
                f"{folder}: {name} {got!r} where this job expects {want!r} ({why})"
            )


def read_step(where: layout.Where, step: int, root: str | None, filler: Filler) -> object:
    """The state of snapshot ``step`` under ``root`` (None: node memory); CorruptSnapshot
    when it is not whole. Each tensor is read straight into a storage of its own."""
    folder = layout.step_dir(layout.rank_dir(root or where.root, where.rank), step)
    manifest = layout.read_manifest(folder)
    check(where, manifest, folder, step)
    return read_folder(folder, manifest, filler)


def read_folder(folder: str, manifest: layout.Manifest, filler: Filler) -> object:
    """The state of the snapshot in ``folder``, whose ``manifest`` was read and checked."""
    path = os.path.join(folder, layout.DATA)
    state, regions = decode(manifest.tree, manifest.nbytes, folder)
    try:
        with open(path, "rb", buffering=0) as f:
            crc = read_regions(f, regions, manifest.nbytes, path, filler)
    except OSError as exc:
        raise layout.CorruptSnapshot(f"{path}: unreadable ({exc})") from exc
    _check_crc(path, crc, manifest)
    return finish(state)


def read_sent(manifest: layout.Manifest, data: torch.Tensor, what: str, filler: Filler) -> object:
    """The state of a snapshot whose data file was sent as ``data`` (flat uint8, on the
    CPU), length and CRC-32 checked against ``manifest``; ``what`` names it in errors."""
    if data.numel() != manifest.nbytes:
        raise layout.CorruptSnapshot(
            f"{what}: {data.numel()} bytes, the manifest says {manifest.nbytes} (cut short?)"
        )
    state, regions = decode(manifest.tree, manifest.nbytes, what)
    crc = 0
    if manifest.nbytes:
        with data.numpy().data as view:
            parts = [Part(offset, target) for offset, _nbytes, target in regions]
            crc = filler.crc32(view, data, parts, reading=True)
    _check_crc(what, crc, manifest)
    return finish(state)


def _check_crc(what: str, crc: int, manifest: layout.Manifest) -> None:
    if crc != manifest.crc32:
        raise layout.CorruptSnapshot(
            f"{what}: CRC-32 {crc:#010x}, the manifest says {manifest.crc32:#010x}"
        )


def read_regions(f: BinaryIO, regions: list[Region], size: int, path: str, filler: Filler) -> int:
    """Copy the data file ``f`` (``size`` bytes, as its manifest says) into the regions'
    targets; return the CRC-32 of all its bytes (the padding between values included)."""
    got = os.fstat(f.fileno()).st_size
    if got != size:  # checked on the open file: the mapping must not pass its end
        raise layout.CorruptSnapshot(f"{path}: {got} bytes, the manifest says {size} (truncated?)")
    if size == 0:
        return 0
    mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE)
    try:
        data = torch.frombuffer(mapping, dtype=torch.uint8)
        try:
            with memoryview(mapping) as view:
                parts = [Part(offset, target) for offset, _nbytes, target in regions]
                return filler.crc32(view, data, parts, reading=True)
        finally:
            del data
    finally:
        mapping.close()


class Prefetch:
    """A read of the rank's newest snapshot in node memory, on a thread of its own,
    that ``load()`` takes when the ranks agree on that step."""

    JOIN = 600.0
    """Seconds :meth:`take` waits for the read (it reads node memory: at 1.2 GB/s,
    far longer than any state that fits there takes)."""

    def __init__(self, where: layout.Where, filler: Filler) -> None:
        steps = layout.complete_steps(layout.rank_dir(where.root, where.rank))
        self.step = steps[0] if steps else None
        self._read_ok = False
        self._result: object = None
        self._error: layout.CorruptSnapshot | None = None
        self._thread: threading.Thread | None = None
        if self.step is not None:
            self._thread = threading.Thread(
                target=self._read, args=(where, self.step, filler),
                name="relaunch-snapshot-prefetch", daemon=True,
            )  # fmt: skip
            self._thread.start()

    def _read(self, where: layout.Where, step: int, filler: Filler) -> None:
        try:
            self._result = read_step(where, step, None, filler)
            self._read_ok = True
        except layout.CorruptSnapshot as exc:
            self._error = exc  # load() says it, as if it had read it itself
        except Exception as exc:  # load() reads it again, and says why if it fails
            log.debug("prefetch of step %s failed: %r", step, exc)

    def take(self, step: int) -> tuple[bool, object]:
        """``(True, state)`` when this read was of ``step`` and is done (CorruptSnapshot
        when that snapshot is not whole); ``(False, None)`` otherwise: read it then."""
        done = self.join()
        if not done or step != self.step:
            return False, None
        if self._error is not None:
            raise self._error
        result, self._result = self._result, None
        return self._read_ok, result

    def join(self) -> bool:
        """Wait for the read; False when it is still running after :attr:`JOIN` s."""
        if self._thread is not None:
            self._thread.join(self.JOIN)
            if self._thread.is_alive():
                log.warning("prefetch of step %s still running after %s s", self.step, self.JOIN)
                return False
        return True
