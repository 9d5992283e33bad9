"""The durable copier: each rank's snapshots copied from node memory to shared storage
in the background (``--checkpoint-dir``), training never waiting for it.

A job that lost every node restores the newest step that *every* rank has a durable
copy of, so the copies must line up across nodes, which copy independently:

- a node copies one step for all of its ranks (the newest step every one of them holds),
  pinned with hard links first, so a worker pruning it meanwhile does not cut the copy
  short;
- the copiers wake on a wall-clock grid (multiples of the interval), so nodes whose
  ranks are in step pick the same step;
- after copying rank r's step s, the copier leaves an empty marker
  ``<dir>/<job>/.complete/step-s/rank-r``; a step whose markers number its world size
  is *whole*. Pruning keeps the newest ``keep`` copies of a rank **and the newest whole
  step**, so a job that was once whole on shared storage stays restorable, whichever
  steps the nodes' copiers happen to take next.

Copies are written under a partial name and renamed when whole (data fsynced first).
A worker that drops the steps its job left (after a restore, before a save of an
earlier step) does it under the rank's timeline lock (:func:`timeline_lock`), which
counts such drops; the copier pins and renames under the same lock, and lands a copy
only if no drop came between: the copy of a dropped step never lands after the drop,
where its marker would count a step of mixed timelines whole. (A step merely pruned by
the rotation meanwhile is still copied: the pin keeps its bytes.)
Standard library only: the agent never imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Collection, Iterator

from relaunch.checkpoint import _layout as layout

__all__ = ["DurableCopier", "discard", "discard_newer", "timeline_lock"]

log = logging.getLogger(__name__)

PIN = ".durable-pin"
"""Under the node's snapshot directory: the hard links of the snapshots being copied."""
COMPLETE = ".complete"
"""Under the job's durable directory: ``step-N/rank-R`` markers of finished copies."""
LOCKS = ".timeline-locks"
"""Under the node's snapshot directory: one lock file per rank (:func:`timeline_lock`)."""

_RANK = re.compile(r"rank-(\d{5,})\Z")
_MARKED = re.compile(r"step-(\d{12})\Z")


class DurableCopier:
    """Copies the snapshots in ``root`` (node memory) to ``durable`` (the job's folder
    on shared storage), every ``interval`` seconds in a thread of its own."""

    def __init__(self, root: str, durable: str, *, keep: int, interval: float) -> None:
        self.root = root
        self.durable = durable
        self.keep = keep
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._copied: dict[int, tuple[int, int]] = {}
        self._ranks: frozenset[int] | None = None

    def start(self) -> None:
        os.makedirs(self.durable, exist_ok=True)
        self._thread = threading.Thread(
            target=self._loop, name="relaunch-durable-copier", daemon=True
        )
        self._thread.start()

    def own(self, ranks: Collection[int]) -> None:
        """The ranks this node's workers run from now on: only theirs are copied (the
        copies a node keeps of a peer's snapshots are its owner's to copy)."""
        self._ranks = frozenset(ranks)

    def close(self) -> None:
        """Stop the thread, then copy the newest snapshots once more (the last ones)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(60.0)
            if thread.is_alive():
                log.warning("the durable copier did not finish within 60 s; left running")
            else:
                self.copy_newest()
        shutil.rmtree(os.path.join(self.root, PIN), ignore_errors=True)
        shutil.rmtree(os.path.join(self.root, LOCKS), ignore_errors=True)  # (workers gone)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval - time.time() % self._interval):
            try:
                self.copy_newest()
            except Exception:  # a full or gone shared file system must not end the job
                log.exception("durable copy failed; retrying")

    def copy_newest(self) -> None:
        """Copy each rank's chosen step (see the module's docstring) unless done."""
        held = {
            rank: steps
            for rank, steps in layout.held_ranks(self.root).items()
            if self._ranks is None or rank in self._ranks
        }
        if not held:
            return
        common = min(steps[0] for steps in held.values())
        for rank, steps in sorted(held.items()):
            step = common if common in steps else steps[0]
            rank_root = layout.rank_dir(self.root, rank)
            try:  # the step and its CRC: a step written again after a restore is copied
                done = (step, layout.read_manifest(layout.step_dir(rank_root, step)).crc32)
            except layout.CorruptSnapshot:
                continue
            if self._copied.get(rank) != done and self._copy_one(rank_root, rank, step):
                self._copied[rank] = done

    def _copy_one(self, rank_root: str, rank: int, step: int) -> bool:
        source = layout.step_dir(rank_root, step)
        pin = os.path.join(self.root, PIN, f"{rank}-{step}")
        shutil.rmtree(pin, ignore_errors=True)
        try:
            os.makedirs(pin)
            with timeline_lock(self.root, rank) as timeline:
                for name in (layout.DATA, layout.MANIFEST):
                    os.link(os.path.join(source, name), os.path.join(pin, name))
            world = layout.read_manifest(pin).world_size
        except (OSError, layout.CorruptSnapshot):  # pruned under us: a newer one is there
            shutil.rmtree(pin, ignore_errors=True)
            return False
        try:
            return self._land(pin, rank, step, world, timeline)
        finally:
            shutil.rmtree(pin, ignore_errors=True)

    def _land(self, pin: str, rank: int, step: int, world: int, timeline: int) -> bool:
        """Copy the pinned snapshot ``pin`` to shared storage; False when the worker
        dropped steps its job left meanwhile (``timeline``: their count at the pin)."""
        target_root = layout.rank_dir(self.durable, rank)
        partial = layout.partial_dir(target_root, step)
        marker = os.path.join(self.durable, COMPLETE, f"step-{step:012d}", f"rank-{rank:05d}")
        try:
            os.makedirs(partial, exist_ok=True)
            shutil.copyfile(os.path.join(pin, layout.DATA), os.path.join(partial, layout.DATA))
            with open(os.path.join(partial, layout.DATA), "rb+") as f:
                os.fsync(f.fileno())
            shutil.copyfile(
                os.path.join(pin, layout.MANIFEST), os.path.join(partial, layout.MANIFEST)
            )
            final = layout.step_dir(target_root, step)
            with timeline_lock(self.root, rank) as now:
                if now != timeline:
                    return False
                if os.path.exists(final):  # another timeline's copy of the step: not whole
                    with contextlib.suppress(OSError):
                        os.remove(marker)
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(partial, final)
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                open(marker, "wb").close()
            self._prune(target_root, world)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return True

    def _prune(self, rank_root: str, world: int) -> None:
        """Keep the newest ``keep`` copies of the rank and the newest whole step; drop
        the markers of steps older than that one."""
        steps = layout.complete_steps(rank_root)
        whole = next((s for s in steps if self._whole(s, world)), None)
        for step in steps[self.keep :]:
            if step != whole:
                shutil.rmtree(layout.step_dir(rank_root, step), ignore_errors=True)
        layout.prune(rank_root, len(steps))  # the partial folders of copiers that are gone
        if whole is None:
            return
        marks = os.path.join(self.durable, COMPLETE)
        for name in _listdir(marks):
            match = _MARKED.match(name)
            if match and int(match.group(1)) < whole:
                shutil.rmtree(os.path.join(marks, name), ignore_errors=True)

    def _whole(self, step: int, world: int) -> bool:
        names = _listdir(os.path.join(self.durable, COMPLETE, f"step-{step:012d}"))
        return sum(1 for n in names if _RANK.match(n)) >= world


@contextlib.contextmanager
def timeline_lock(root: str, rank: int, *, leave: bool = False) -> Iterator[int]:
    """Hold rank ``rank``'s timeline lock in the node's snapshot directory ``root``, and
    yield how many times its worker dropped steps the job left. ``leave``: the holder
    drops such steps (the count goes up, whatever happens)."""
    path = os.path.join(root, LOCKS, f"rank-{rank:05d}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (released with the file's close)
        raw = os.pread(fd, 32, 0).strip()
        drops = int(raw) if raw.isdigit() else 0  # (a garbled count: a change all the same)
        try:
            yield drops
        finally:
            if leave:
                os.ftruncate(fd, 0)
                os.pwrite(fd, b"%d\n" % (drops + 1), 0)
    finally:
        os.close(fd)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def discard_newer(durable: str, rank: int, step: int | None) -> list[int]:
    """Remove rank ``rank``'s durable copies newer than the restored ``step`` (all when
    None) and their markers: they belong to a timeline the job left, and a marker of one
    would count the step whole once another rank copies the new timeline's."""
    gone = layout.newer_steps(layout.rank_dir(durable, rank), step)
    discard(durable, rank, gone)
    return gone


def discard(durable: str, rank: int, steps: list[int]) -> None:
    """Remove rank ``rank``'s durable copies of ``steps`` and their markers."""
    for s in steps:
        shutil.rmtree(layout.step_dir(layout.rank_dir(durable, rank), s), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(durable, COMPLETE, f"step-{s:012d}", f"rank-{rank:05d}"))
