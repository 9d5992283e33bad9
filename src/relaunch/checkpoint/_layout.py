"""Where snapshots live and how one is recognised as complete (standard library only:
the agent uses it too, and never imports torch).

A node's snapshot directory holds one folder per global rank, and in it one folder per
snapshot::

    <root>/rank-00003/step-000000001200/{data,manifest.json}
    <root>/rank-00003/.partial-step-000000001201-<pid>/        (being written)

A snapshot is complete when its folder has its final name: it is written under a
``.partial-`` name and renamed once its data and manifest are on disk, so a process
killed during a save leaves a partial folder, never a snapshot that looks whole. The
manifest (versioned JSON) names the job, the rank, the world size, the step, the data's
length and CRC-32, and the tree of the state; :func:`read_manifest` checks every field
and names the one that is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any

from relaunch._contract import SNAPSHOT_DIR_ENV, snapshot_rank_dir
from relaunch._json import loads as json_loads
from relaunch.errors import SnapshotError

__all__ = [
    "DATA",
    "ENV_AGENT",
    "ENV_DIR",
    "ENV_DURABLE",
    "ENV_KEEP",
    "ENV_LIMIT",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "CorruptSnapshot",
    "Manifest",
    "Where",
    "alive",
    "complete_steps",
    "discard_newer",
    "held_ranks",
    "newer_steps",
    "parse_manifest",
    "partial_dir",
    "pin",
    "prune",
    "rank_dir",
    "read_manifest",
    "safe_job",
    "step_dir",
    "unpinned",
    "write_manifest",
]

ENV_DIR = SNAPSHOT_DIR_ENV
"""The node's snapshot directory (the agent sets it for its workers)."""
ENV_KEEP = "RELAUNCH_SNAPSHOT_KEEP"
"""How many snapshots each rank keeps (newest first)."""
ENV_LIMIT = "RELAUNCH_SNAPSHOT_LIMIT"
"""Bytes the node's snapshot directory may hold, all its ranks together."""
ENV_DURABLE = "RELAUNCH_CHECKPOINT_DIR"
ENV_AGENT = "RELAUNCH_SNAPSHOT_AGENT"
"""``127.0.0.1:PORT``: the node's agent, told of each snapshot; a snapshot counts as
complete once the agent's ring successor holds a copy (multi-node jobs only)."""
"""Shared storage that receives durable copies (``<dir>/<job>/rank-N/step-N``)."""

FORMAT = "relaunch.snapshot"
VERSION = 2
"""2: a tree may hold ``odict`` nodes (:mod:`~relaunch.checkpoint._tree`); a manifest
of version 1 (none) is read as well."""
READABLE = (1, 2)
MANIFEST = "manifest.json"
DATA = "data"

_RANK = re.compile(r"rank-(\d{5,})\Z")
_STEP = re.compile(r"step-(\d{12})\Z")
_PARTIAL = re.compile(r"\.partial-step-\d{12}-(\d+)(?:-\d+)?\Z")


class CorruptSnapshot(SnapshotError):
    """A snapshot that cannot be used: unreadable, truncated, of another job or layout."""


rank_dir = snapshot_rank_dir


def step_dir(rank_root: str, step: int) -> str:
    return os.path.join(rank_root, f"step-{step:012d}")


def partial_dir(rank_root: str, step: int) -> str:
    """Where ``step`` is written before it is complete: named by the process (a dead
    one's are removed) and the thread (an agent's puller and its fetch for a new round
    may copy the same step at once)."""
    return os.path.join(
        rank_root, f".partial-step-{step:012d}-{os.getpid()}-{threading.get_ident()}"
    )


def complete_steps(rank_root: str) -> list[int]:
    """Steps of the complete snapshots in ``rank_root``, newest first."""
    try:
        names = os.listdir(rank_root)
    except OSError:
        return []
    steps = []
    for name in names:
        match = _STEP.match(name)
        if match and os.path.isfile(os.path.join(rank_root, name, MANIFEST)):
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def held_ranks(root: str) -> dict[int, list[int]]:
    """Global rank -> the steps of its complete snapshots under ``root`` (a node's
    directory or the durable one), newest first; ranks with none are left out."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    held = {}
    for name in names:
        match = _RANK.match(name)
        steps = complete_steps(os.path.join(root, name)) if match else []
        if match and steps:
            held[int(match.group(1))] = steps
    return held


def prune(rank_root: str, keep: int, *, besides: int | None = None) -> list[int]:
    """Keep the ``keep`` newest complete snapshots (``besides``, the step being written
    again, neither counts nor goes); remove the partial folders of processes that are
    gone (a save that a kill interrupted). Returns the complete steps kept, newest
    first (a save's writer lists them once; one whose removal failed is not among them)."""
    steps = complete_steps(rank_root)
    gone = [s for s in steps if s != besides][keep:]
    for step in gone:
        shutil.rmtree(step_dir(rank_root, step), ignore_errors=True)
    with contextlib.suppress(OSError):
        for name in os.listdir(rank_root):
            match = _PARTIAL.match(name)
            if match and int(match.group(1)) != os.getpid() and not alive(int(match.group(1))):
                shutil.rmtree(os.path.join(rank_root, name), ignore_errors=True)
    return [s for s in steps if s not in gone]


def newer_steps(rank_root: str, step: int | None) -> list[int]:
    """The complete snapshots under ``rank_root`` newer than ``step`` (all when None)."""
    return [s for s in complete_steps(rank_root) if step is None or s > step]


def discard_newer(rank_root: str, step: int | None) -> list[int]:
    """Remove the snapshots newer than ``step`` (all when None): after a restore they
    belong to a timeline the job left. Returns their steps."""
    gone = newer_steps(rank_root, step)
    for s in gone:
        shutil.rmtree(step_dir(rank_root, s), ignore_errors=True)
    return gone


def pin(path: str, pins: str) -> str:
    """Link the file ``path`` under the folder ``pins`` (a new name) and return the link:
    while it exists, the saver never reuses the file for another snapshot (its bytes
    stay those of the snapshot being copied). Remove the link when done. OSError when
    ``path`` is gone."""
    os.makedirs(pins, exist_ok=True)
    link = os.path.join(pins, f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}")
    os.link(path, link)
    return link


def unpinned(path: str) -> bool:
    """Whether no one copies the file ``path`` (it has no other link; see :func:`pin`)."""
    try:
        return os.stat(path).st_nlink == 1
    except OSError:
        return False


def take_data(folder: str, path: str) -> None:
    """Move the data file of the snapshot ``folder`` to ``path`` (a new snapshot reuses
    its pages), its manifest removed first (never complete without its data); nothing
    moves while someone copies it (pinned), and a file pinned meanwhile is left to the
    copy. The caller removes ``folder``."""
    data = os.path.join(folder, DATA)
    if not unpinned(data):
        return
    with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, MANIFEST))
        os.rename(data, path)
    if os.path.exists(path) and not unpinned(path):
        os.unlink(path)  # pinned meanwhile: its bytes stay the copy's


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def safe_job(job: str) -> str:
    """The job id as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "none"


@dataclass(frozen=True)
class Where:
    """Who this process is and where its snapshots go."""

    root: str
    job: str
    rank: int
    world_size: int
    keep: int
    limit: int | None
    durable: str | None
    agent: tuple[str, int] | None = None
    """The node's agent (multi-node jobs): told of each snapshot; its successor copies it."""
    threads: int = 1
    """Threads that copy and checksum a save (``_fill.threads_for``)."""


@dataclass(frozen=True)
class Manifest:
    job: str
    rank: int
    world_size: int
    step: int
    nbytes: int
    crc32: int
    tree: Any

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "job": self.job,
                "rank": self.rank,
                "world_size": self.world_size,
                "step": self.step,
                "nbytes": self.nbytes,
                "crc32": self.crc32,
                "tree": self.tree,
            },
            separators=(",", ":"),
        )


def write_manifest(folder: str, manifest: Manifest) -> None:
    path = os.path.join(folder, MANIFEST)
    data = manifest.to_json().encode()
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less umask
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(path + ".tmp", path)


def read_manifest(folder: str) -> Manifest:
    """The manifest of the snapshot in ``folder``; CorruptSnapshot naming the field
    that is missing or wrong (or the file that cannot be read)."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise CorruptSnapshot(f"{path}: unreadable manifest ({exc})") from exc
    return parse_manifest(raw, path)


def parse_manifest(raw: bytes, path: str) -> Manifest:
    """The manifest in ``raw`` (read from, or sent for, ``path``); CorruptSnapshot naming
    the field that is missing or wrong."""
    try:
        doc = json_loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise CorruptSnapshot(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(doc, dict):
        raise CorruptSnapshot(f"{path}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise CorruptSnapshot(f"{path}: format: expected {FORMAT!r}, got {doc.get('format')!r}")
    if type(doc.get("version")) is not int or doc.get("version") not in READABLE:
        raise CorruptSnapshot(
            f"{path}: version: expected one of {READABLE}, got {doc.get('version')!r}"
        )

    def field(key: str, kind: type) -> Any:
        value = doc.get(key)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise CorruptSnapshot(f"{path}: {key}: expected {kind.__name__}, got {value!r}")
        if kind is int and isinstance(value, int) and value < 0:
            raise CorruptSnapshot(f"{path}: {key}: expected a non-negative int, got {value}")
        return value

    if "tree" not in doc:
        raise CorruptSnapshot(f"{path}: tree: missing")
    return Manifest(
        job=field("job", str),
        rank=field("rank", int),
        world_size=field("world_size", int),
        step=field("step", int),
        nbytes=field("nbytes", int),
        crc32=field("crc32", int),
        tree=doc["tree"],
    )
