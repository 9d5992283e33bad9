"""One rank's folder in node memory, as its saves use it: a save's partial folder, the
data file it writes (the retiring snapshot's, its pages reused, or a new one), the
rename that makes it complete, the mappings kept only while their files are there, and
the timeline (a save of an earlier step, or a restore, drops the later steps).

What is in a snapshot, and how it is copied, is the :class:`~relaunch.checkpoint.
_saver.Saver`'s; this module only places files.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import BinaryIO

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._layout import Where
from relaunch.checkpoint._mapped import MappedFiles
from relaunch.checkpoint._timeline import drop_later, drop_left, newest_step

__all__ = ["RankFiles"]

log = logging.getLogger("relaunch.checkpoint")


class RankFiles:
    """The files of ``where``'s rank (``window``: how many complete snapshots it keeps,
    asked at each save; ``maps``: the data files' mappings). Used by one thread at a
    time (``save`` and its writer take turns)."""

    def __init__(self, where: Where, maps: MappedFiles, window: Callable[[], int]) -> None:
        self.where = where
        self.root = layout.rank_dir(where.root, where.rank)
        self.maps = maps
        self._window = window
        self._newest: int | None = None
        """The newest step this rank holds, as last known (None: listed at the next save)."""

    def begin(self, step: int) -> str:
        """A new partial folder for a save of ``step`` (the later steps dropped first:
        :meth:`go_back_to`); its path."""
        self.go_back_to(step)
        os.makedirs(self.root, exist_ok=True)
        folder = layout.partial_dir(self.root, step)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        return folder

    def data_file(self, folder: str, step: int, nbytes: int) -> tuple[BinaryIO, bool]:
        """The data file of the partial snapshot of ``step`` in ``folder``, ``nbytes``
        long, and whether it is new: the oldest snapshot's beyond the newest keep-1 (at
        least one) when there is one to retire, its pages reused (a new file costs
        zeroed pages, freeing one costs as much), else a new file. A data file that an
        agent is copying (pinned: linked twice) is never reused."""
        path = os.path.join(folder, layout.DATA)
        for old_step in self._retiring(step):
            old = layout.step_dir(self.root, old_step)
            if not os.path.exists(path):
                layout.take_data(old, path)
            shutil.rmtree(old, ignore_errors=True)
        fresh = not os.path.exists(path)
        f = open(path, "w+b" if fresh else "r+b")  # noqa: SIM115
        f.truncate(nbytes)
        return f, fresh

    def next_data(self, steps: list[int]) -> str | None:
        """The data file the next save will reuse (``steps``: the complete ones, just
        listed); None when it will take a new one."""
        retire = self._retiring(None, steps)
        if not retire:
            return None
        return os.path.join(layout.step_dir(self.root, retire[0]), layout.DATA)

    def _retiring(self, step: int | None, steps: list[int] | None = None) -> list[int]:
        """The complete snapshots (``steps``, when just listed) a save of ``step``
        retires: beyond the newest keep-1."""
        listed = layout.complete_steps(self.root) if steps is None else steps
        return [s for s in listed if s != step][max(self._window() - 1, 1) :]

    def complete(self, folder: str, step: int, manifest: layout.Manifest) -> list[int]:
        """Write ``manifest`` into the partial ``folder`` of ``step`` and rename it: the
        snapshot is complete. The ones beyond the window go. Returns the complete steps
        now, newest first."""
        layout.write_manifest(folder, manifest)
        final = layout.step_dir(self.root, step)
        if os.path.exists(final):  # the same step again (after a restart)
            shutil.rmtree(final, ignore_errors=True)
        os.rename(folder, final)
        kept = layout.prune(self.root, self._window())
        self.keep_live_maps(kept)
        return kept

    def drop(self, folder: str) -> None:
        """A save into ``folder`` failed: the partial folder goes, and its mapping."""
        shutil.rmtree(folder, ignore_errors=True)
        self.keep_live_maps()

    def keep_live_maps(self, steps: list[int] | None = None) -> None:
        """Unmap the data files that are gone (a mapping would keep their memory);
        ``steps``: the complete ones, when just listed."""
        root = self.root
        steps = layout.complete_steps(root) if steps is None else steps
        self.maps.keep_only(os.path.join(layout.step_dir(root, s), layout.DATA) for s in steps)

    def go_back_to(self, step: int) -> None:
        """Before a save of ``step``: drop this rank's snapshots of later steps, which
        would outrank it at the next restore (a script whose step count went back, or
        that did not ``load`` its past life's): the newest save is the rank's state."""
        if self._newest is None:
            self._newest = newest_step(self.where)
        newest = self._newest
        if step < newest:
            gone = drop_later(self.where, step)
            self.keep_live_maps()
            if gone:
                log.warning(
                    "rank %s: saving step %s after step %s: dropped the snapshots of steps %s",
                    self.where.rank, step, newest, gone,
                )  # fmt: skip
        self._newest = step

    def discard_newer(self, step: int | None) -> list[int]:
        """Forget this rank's snapshots of the steps a restore of ``step`` left
        (``_timeline.drop_left``). Returns the steps dropped from node memory."""
        gone = drop_left(self.where, step)
        self._newest = None
        self.keep_live_maps()
        return gone
