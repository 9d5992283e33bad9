"""The agent's side of the snapshots (standard library only: the agent never imports
torch): the node's snapshot directory for one run, the workers' environment that
points at it, and the durable copier.

The default directory is a new folder under /dev/shm (node memory that outlives the
workers), named ``relaunch-<job>-<agent pid>-<random>``, made by the first save and
removed when the agent ends; one that an agent killed outright left behind is removed
by the next agent on the machine that finds its owner gone. A directory given with ``--snapshot-dir`` is
kept.

The durable copier (``--checkpoint-dir``, :mod:`._durable`) copies this node's ranks'
snapshots to ``<checkpoint-dir>/<job>/rank-N/step-N`` every half second; training never
waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import string
import tempfile

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._durable import DurableCopier
from relaunch.checkpoint._peers import PeerCopies, PeerRound
from relaunch.checkpoint._restores import Restore, read_restores

__all__ = ["SnapshotArea"]

log = logging.getLogger(__name__)

_SHM = "/dev/shm"
_OWNED = re.compile(r"relaunch-.*-(\d+)-[a-z0-9_]{8}\Z")


class SnapshotArea:
    """The snapshot directory of this agent's run (a context manager)."""

    def __init__(
        self,
        *,
        job: str,
        directory: str | None,
        keep: int,
        limit: int | None,
        durable: str | None,
        peers: str | None = None,
        guarded: bool = False,
        interval: float = 0.5,
    ) -> None:
        """``peers``: the address the snapshot server binds (other nodes fetch this
        node's snapshots there); None for a job of one node (no peer copies).
        ``guarded`` (a job secret): that server refuses every other host until the
        first round names the job's."""
        self.job = job
        self.keep = keep
        self._given = directory
        self._limit = limit
        self._durable_base = durable
        self._interval = interval
        self.root = ""
        self._copier: DurableCopier | None = None
        self._peers_bind = peers
        self._guarded = guarded
        self._peers: PeerCopies | None = None
        self._bad_restores = 0

    @property
    def durable(self) -> str | None:
        if self._durable_base is None:
            return None
        return os.path.join(self._durable_base, layout.safe_job(self.job))

    def __enter__(self) -> SnapshotArea:
        return self.open()

    def open(self) -> SnapshotArea:
        """Create (or adopt) the directory and start the durable copier."""
        if self._given is not None:
            os.makedirs(self._given, exist_ok=True)
            self.root = self._given
        else:
            base = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None
            base = base or tempfile.gettempdir()
            _remove_orphans(base)
            # named now, made by the first save: a job that takes no snapshot leaves
            # nothing in node memory, even when its agent is killed
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=8))
            name = f"relaunch-{layout.safe_job(self.job)[:40]}-{os.getpid()}-{suffix}"
            self.root = os.path.join(base, name)
        if self._peers_bind is not None:
            self._peers = PeerCopies(
                self.root, self.job, bind=self._peers_bind, guarded=self._guarded
            )
        if self.durable is not None:
            self._copier = DurableCopier(
                self.root, self.durable, keep=self.keep, interval=self._interval
            )
            self._copier.start()
        return self

    def env(self) -> dict[str, str]:
        """What the workers need to find the directory (``relaunch.checkpoint`` reads it)."""
        out = {
            layout.ENV_DIR: self.root,
            layout.ENV_KEEP: str(self.keep),
            layout.ENV_LIMIT: str(self.limit()),
        }
        if self._durable_base is not None:
            out[layout.ENV_DURABLE] = self._durable_base
        if self._peers is not None:
            out[layout.ENV_AGENT] = f"127.0.0.1:{self._peers.port}"
        return out

    def limit(self) -> int:
        """The node's limit in bytes: the one given, else half the file system's size."""
        if self._limit is not None:
            return self._limit
        st = os.statvfs(self.root if os.path.isdir(self.root) else os.path.dirname(self.root))
        return max(st.f_blocks * st.f_frsize // 2, 1)

    def newest_steps(self) -> dict[int, int]:
        """Global rank -> step of its newest complete snapshot in this node's directory
        (its own workers' ranks and the copies it keeps of a peer's)."""
        return {rank: steps[0] for rank, steps in layout.held_ranks(self.root).items()}

    def restores(self) -> dict[tuple[int | None, int | None, str | None], list[int]]:
        """This node's ranks' restores, ``(step, newest, source)`` -> ranks (the job's
        first start, with nothing to restore, is none)."""
        records, bad = read_restores(self.root)
        if bad and bad != self._bad_restores:
            log.warning("%s: %s lines that are not restore records; skipped", self.root, bad)
        self._bad_restores = bad
        done: dict[tuple[int | None, int | None, str | None], list[int]] = {}
        for r in records:
            if r.step is not None or r.newest is not None:
                done.setdefault((r.step, r.newest, r.source), []).append(r.rank)
        return done

    def summary(self) -> str | None:
        """One line on this node's snapshots: each rank's newest step, and each restore
        (the step, where from, the steps redone); None when there were none."""
        newest, done = self.newest_steps(), self.restores()
        if not newest and not done:
            return None
        parts = []
        if newest:
            by_step: dict[int, list[int]] = {}
            for rank, last in sorted(newest.items()):
                by_step.setdefault(last, []).append(rank)
            parts.append(
                "newest "
                + ", ".join(f"step {s} (ranks {_ranks(r)})" for s, r in sorted(by_step.items()))
            )
        for (restored, top, source), ranks in done.items():
            redone = Restore(0, restored, top, source).redone
            what = "a fresh start" if restored is None else f"step {restored} from {source}"
            unit = "step" if redone == 1 else "steps"
            parts.append(f"restored {what}, {redone} {unit} redone (ranks {_ranks(ranks)})")
        return "snapshots: " + "; ".join(parts)

    def round_started(self, seat: PeerRound) -> None:
        """A rendezvous round starts on this node (before its workers): the peer copies
        (``_peers``) publish, fetch what this node's ranks lack and pull the ring
        predecessor's snapshots. Never raises."""
        if self._peers is not None:
            self._peers.round_started(seat)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        peers, self._peers = self._peers, None
        if peers is not None:
            peers.close()
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.close()
        if self._given is None and self.root:
            shutil.rmtree(self.root, ignore_errors=True)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(set(ranks)))


def _remove_orphans(base: str) -> None:
    """Remove default snapshot folders whose agent is gone (killed before its cleanup)."""
    for name in _listdir(base):
        match = _OWNED.match(name)
        if match is None or layout.alive(int(match.group(1))):
            continue
        path = os.path.join(base, name)
        with contextlib.suppress(OSError):
            mine = os.stat(path).st_uid == os.getuid()
            if mine and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed %s, the snapshots of an agent that is gone", path)
