"""A rank's snapshots: written into the node's snapshot directory, read back whole.

``save`` encodes the state's tree (plain values are captured there) and queues the
CUDA tensors' copies, straight into the data file or through a pinned buffer
(``_staging``), on a copy stream that waits for the work queued so far (the copy
overlaps the next step). A writer thread takes the data file (the retiring snapshot's,
its pages reused, or a new one; ``save`` takes it for CUDA copies), copies the CPU
tensors into its mapping (on /dev/shm the one copy into node memory), checksums each
chunk once its CUDA bytes have landed, writes the manifest and renames the folder,
which makes the snapshot complete (copies and CRC on a few threads: ``_fill``; where the
files go, which one is reused and which steps are dropped: ``_rank_files``).

The copy is finished before any ``torch.optim`` optimizer steps again (a global
pre-step hook waits for the CPU tensors' copy, and makes the current CUDA stream wait
for the copy stream: the GPU orders the optimizer's writes after the copy, the
training thread does not wait), and before the next ``save`` or ``load``; with
``blocking=True`` the snapshot is complete before ``save`` returns. The tensors of the state that no optimizer
steps (a module's buffers, which its forward updates in place) are cloned in ``save``,
or the save blocks (``_fence``). One save is in flight at a time.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._ack import PeerAck
from relaunch.checkpoint._fence import Fence
from relaunch.checkpoint._fill import Filler, Part, Run, runs_of
from relaunch.checkpoint._layout import Where
from relaunch.checkpoint._limit import check_limit
from relaunch.checkpoint._mapped import MappedFiles
from relaunch.checkpoint._rank_files import RankFiles
from relaunch.checkpoint._readback import Prefetch, offered_steps, read_step
from relaunch.checkpoint._staging import CudaStager, Staged, page_lockable
from relaunch.checkpoint._tree import Leaf, encode, flat_bytes
from relaunch.checkpoint._writer import Writer
from relaunch.errors import SnapshotError

__all__ = ["Saver", "Where"]

log = logging.getLogger("relaunch.checkpoint")


@dataclass
class _Pending:
    folder: str
    step: int
    manifest_tree: Any
    nbytes: int
    host: list[Leaf]
    """The values the writer copies one by one: of :data:`SMALL` bytes or more, or on a
    device neither the host's nor CUDA."""
    runs: list[Run]
    """The other values the writer copies (CPU tensors, bytes), a run of neighbours at
    a time."""
    staged: Staged | None = None
    file: BinaryIO | None = None
    """The data file, when ``save`` took it."""
    lockable: bool = False
    """Whether the snapshot files can be page-locked (the writer then locks the next
    save's file)."""


class Saver:
    """Saves and reads one rank's snapshots (one per process; see ``checkpoint``)."""

    def __init__(self, where: Where) -> None:
        self.where = where
        self._writer = Writer()
        self._error: BaseException | None = None
        self._filler = Filler(where.threads)
        self._stager = CudaStager(self._filler)
        self._maps = MappedFiles(before_unmap=self._stager.unlock)
        self._lockable: bool | None = None
        """Whether the snapshot files' pages can be page-locked (tmpfs), once known."""
        self._staged: Staged | None = None
        """The CUDA copies of the save in flight (the optimizer's stream waits for them)."""
        self._copied = threading.Event()
        self._whole = threading.Event()
        """Set once the save in flight is complete in node memory, or failed."""
        self._whole.set()
        self._ack = PeerAck(where)
        self._fence = Fence()
        """The optimizers that stepped: their tensors' copies may run beside the next step."""
        self._prefetch: Prefetch | None = None
        """A read of the newest snapshot started before the script ran (``prefetch``)."""
        self.read_ahead = False
        """Whether the last ``read`` took the read started by ``prefetch``."""
        self._files = RankFiles(where, self._maps, lambda: self.window)
        atexit.register(self._at_exit)
        # a fence: no optimizer changes the tensors of a save still being copied
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _at_exit(self) -> None:
        self._ack.exiting()
        try:
            self.wait(120.0)
        finally:
            self.drop_prefetch()
            if not self._writer.busy():
                self._writer.close()
            self._filler.close()

    def close(self) -> None:
        """Wait for the save in flight (raising what it failed with), then stop the
        copy threads and the optimizer hook; the Saver saves no more."""
        atexit.unregister(self._at_exit)
        try:
            self.wait()
        finally:
            self.drop_prefetch()
            if not self._writer.busy():  # nothing copies into them
                self._writer.close()
                self._ack.close()
                self._maps.close()
                self._stager.close()
            self._filler.close()
            self._hook.remove()

    def drop_prefetch(self) -> None:
        """Forget the prefetched state (a script that saves before it loads, or ends)."""
        fetched, self._prefetch = self._prefetch, None
        if fetched is not None:
            fetched.join()

    @property
    def window(self) -> int:
        """Complete snapshots this rank keeps: ``keep``, and one more while a peer copy
        is made (so the step every rank's copy holds is still in every rank's memory)."""
        return self.where.keep + (1 if self._ack.peer else 0)

    def _before_optimizer_step(self, optimizer: object, *_: object) -> None:
        self._fence.saw(optimizer)
        self.wait_copied()

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, state: object, *, blocking: bool = False) -> None:
        self.wait()
        self.drop_prefetch()
        tree, leaves, nbytes = encode(state)
        # the tensors no optimizer's hook protects are cloned, or the save waits for
        # its copy
        copy_first = self._fence.secure(leaves, nbytes)
        runs, host = runs_of([leaf for leaf in leaves if leaf.nbytes and leaf.device != "cuda"])
        # what stays while this one is written: the other ranks' and our newest window-1
        w = self.where
        check_limit(w.root, w.rank, step, nbytes, max(self.window - 1, 1), w.limit)
        pending = _Pending(
            folder=self._files.begin(step),
            step=step,
            manifest_tree=tree,
            nbytes=nbytes,
            host=host,
            runs=runs,
        )
        self._stage([leaf for leaf in leaves if leaf.nbytes and leaf.device == "cuda"], pending)
        self._staged = pending.staged
        self._copied = threading.Event()
        self._whole = threading.Event()
        self._writer.submit(functools.partial(self._finish, pending))
        if blocking:
            self.wait_whole()
        elif copy_first:
            self.wait_copied()

    def _stage(self, leaves: list[Leaf], p: _Pending) -> None:
        """Queue the CUDA ``leaves``' copies: into the data file's mapping where it is a
        reused file (taken here) that can be page-locked, else into the pinned buffer."""
        if not leaves:
            return
        if self._lockable is None:
            self._lockable = page_lockable(self._files.root)
        p.lockable = self._lockable and not self._stager.refused
        try:
            mapping = None
            if p.lockable:
                p.file, fresh = self._files.data_file(p.folder, p.step, p.nbytes)
                if not fresh:  # a new file's pages would be faulted in here, then locked
                    mapping = self._maps.map(p.file, p.nbytes)
            p.staged = self._stager.stage(leaves, mapping)
        except BaseException:
            self._stager.settle()  # nothing lands in the file once it is gone
            if p.file is not None:
                p.file.close()
            self._files.drop(p.folder)
            raise

    def wait_copied(self) -> None:
        """Wait until the CPU tensors of the save in flight are copied, and make the
        current CUDA stream of each device wait for the copy of its tensors (the caller
        may then change them, on that stream); the rest of the save may still be
        running."""
        if self._writer.busy():
            staged = self._staged
            if staged is not None:
                for stream, _event in staged.copies:
                    torch.cuda.current_stream(stream.device).wait_stream(stream)
            self._copied.wait()

    def _copy(self, p: _Pending, mapping: mmap.mmap) -> int:
        """Copy every value into the mapped file (in the writer) and return its CRC-32:
        the CPU values first (then the caller may change them), then each chunk's CRC-32
        once its CUDA bytes have landed (in the file itself, or in the pinned buffer,
        whence they are copied first, in the same pass)."""
        target = torch.frombuffer(mapping, dtype=torch.uint8)
        staged, parts = p.staged, []
        try:
            self._filler.copy(
                target, [Part(leaf.offset, flat_bytes(leaf)) for leaf in p.host], p.runs
            )
            self._copied.set()
            if staged is not None and staged.buffer is not None:
                parts = [
                    Part(leaf.offset, staged.buffer[leaf.offset : leaf.offset + leaf.nbytes])
                    for leaf in staged.leaves
                ]
            before = staged.wait_for if staged is not None else None
            with memoryview(mapping) as view:
                return self._filler.crc32(view, target, parts, before=before)
        finally:
            del target, parts
            if staged is not None:
                staged.synchronize()  # the file may be dropped once nothing lands in it
            p.host, p.runs = [], []  # the caller's tensors are no longer needed
            p.staged = None

    def _lock_next(self, steps: list[int]) -> None:
        """Page-lock the data file the next save will reuse, here in the writer, not in
        the next ``save`` (a file written through the pinned buffer, a restarted
        worker's second file). Only a speed-up: a failure is left to that save."""
        path = self._files.next_data(steps)
        if path is None:
            return
        try:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if size:
                    self._stager.lock(self._maps.map(f, size))
        except Exception as exc:
            log.debug("rank %s: the next snapshot's file is not locked ahead: %s",
                      self.where.rank, exc)  # fmt: skip

    def _finish(self, p: _Pending) -> None:
        f = None
        try:
            try:
                f = (
                    p.file
                    if p.file is not None
                    else self._files.data_file(p.folder, p.step, p.nbytes)[0]
                )
                crc = 0
                if p.nbytes:
                    mapping = self._maps.map(f, p.nbytes)
                    crc = self._copy(p, mapping)
            finally:
                self._copied.set()
            f.flush()
            os.fsync(f.fileno())
            f.close()
            w = self.where
            manifest = layout.Manifest(
                job=w.job,
                rank=w.rank,
                world_size=w.world_size,
                step=p.step,
                nbytes=p.nbytes,
                crc32=crc,
                tree=p.manifest_tree,
            )
            kept = self._files.complete(p.folder, p.step, manifest)
            self._whole.set()
            self._ack.after_save(p.step, crc)
            if p.lockable:
                self._lock_next(kept)
        except BaseException as exc:
            self._error = exc
            if p.staged is not None:  # failed before the copy: nothing lands in the file
                with contextlib.suppress(Exception):
                    p.staged.synchronize()
            if f is not None:
                with contextlib.suppress(Exception):
                    f.close()
            with contextlib.suppress(Exception):
                self._files.drop(p.folder)  # the partial file's mapping goes with it
        finally:
            self._whole.set()

    def wait_whole(self) -> None:
        """Wait until the save in flight is complete in node memory (not for its peer
        copy: the agents make that, and a worker that dies meanwhile loses nothing);
        raise what it failed with."""
        self._whole.wait()
        if self._error is not None:
            self.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the save in flight is complete; raise what it failed with."""
        if not self._writer.join(timeout):
            log.warning("snapshot writer still busy after %s s; its step may be lost", timeout)
            return
        error, self._error = self._error, None
        if error is not None:
            raise SnapshotError(f"the last snapshot could not be written: {error!r}") from error

    def discard_newer(self, step: int | None) -> list[int]:
        """Forget this rank's snapshots of the steps a restore of ``step`` left
        (``_timeline.drop_left``). Returns the steps dropped from node memory."""
        return self._files.discard_newer(step)

    # -- reading -------------------------------------------------------------------------
    @property
    def filler(self) -> Filler:
        """The threads that copy and checksum this rank's snapshots (reads too)."""
        return self._filler

    def steps(self, root: str | None = None) -> list[int]:
        """This rank's snapshots that can be offered, newest first (``offered_steps``)."""
        return offered_steps(self.where, root)

    def prefetch(self) -> None:
        """Start reading this rank's newest snapshot in node memory on a thread, for
        ``read`` to take (a restarted worker, before its script runs)."""
        if self._prefetch is None:
            self._prefetch = Prefetch(self.where, self._filler)

    def read(self, step: int, root: str | None = None) -> object:
        """The state of snapshot ``step``; CorruptSnapshot when it is not whole. Each
        tensor is read straight into a storage of its own (no second copy of the state)."""
        fetched, self._prefetch = self._prefetch, None
        self.read_ahead = False
        if fetched is not None:
            # the read ahead is of node memory's newest step; anything else is read now
            took, state = False, None
            if root is None:
                took, state = fetched.take(step)
            else:
                fetched.join()
            del fetched  # a read of another step: freed before this one
            if took:
                self.read_ahead = True
                return state
        return read_step(self.where, step, root, self._filler)
