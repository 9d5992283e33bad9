"""A state that is the same on every rank (``load(replicated=True)``): any rank's
snapshot is every rank's, whatever the world's size was when it was saved.

Plain data parallel training (DDP, an optimizer every rank steps alike) keeps one
state on every rank. A node lost with no spare to take its ranks, or a node that joins,
changes the world's size, and a rank's own snapshots, saved in the old world, no longer
name its place (``load()`` refuses them: a sharded state cannot be restored so). Here
each rank offers the steps of every snapshot of this job it can read: in node memory,
every rank's folder (its own, the other workers' of the node, the copies it keeps of
its peer's, those of ranks of a past world); in the durable copies, its own rank's and
rank 0's (a job of thousands of ranks reads two folders of shared storage, not all).
The newest step any rank offers is read by the ranks that hold it, and the ranks agree
on one copy by its CRC-32: the one most of them read (a folder no live rank tended, as
that of a node that sat out a restore, can hold a step of the same number from a
timeline the job left). Each rank without a whole copy of that one receives the
snapshot's files from a rank that read it (point-to-point over the default process
group, in chunks, the holders taking the others in turn) and reads them as a file of
node memory is read, length and CRC-32 checked. When no rank read it whole, or a
transfer failed, every rank tries the next newest.

Snapshots of a timeline the job left (steps past the one restored) are dropped from
every folder of the node's memory before any rank saves again: a later restore must
never take a step of another timeline from a folder no live rank tends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._agree import gather, group_device
from relaunch.checkpoint._readback import check, read_folder, read_sent

__all__ = ["newest_replica"]

log = logging.getLogger("relaunch.checkpoint")

Source = tuple[str | None, int]
"""Where a rank holds a step: the root (None: node memory) and the rank's folder."""

_CHUNK = 64 << 20
"""Bytes sent at once: a state of gigabytes crosses an NCCL group through one buffer of
this size on the GPU, not a copy of all of it."""
_NO_SEND = -1
"""The length a source sends when it cannot read the files it read a moment ago."""


def newest_replica(
    saver: Any, roots: list[str | None]
) -> tuple[tuple[int, Any, str] | None, int | None]:
    """``(step, state, source)``: the newest step any rank holds whole, this rank's copy
    of it and where that came from ("memory", "durable" or "another rank"), or None
    when no rank holds one whole; and the newest step any rank offered."""
    where: layout.Where = saver.where
    held = _held(where, roots)
    offers = gather(saver, sorted(held))
    steps = sorted({s for offer in offers for s in offer}, reverse=True)
    for step in steps:
        state, source, crc = _read_first(saver, step, held.get(step, []))
        crcs = gather(saver, crc)
        chosen = _chosen(crcs)
        if chosen is None:
            continue
        came = None if source is None else "memory" if source[0] is None else "durable"
        if crc != chosen:
            state, came = None, None  # not read, or a copy of a timeline the job left
        if any(c != chosen for c in crcs):
            state, came = _share(saver, step, [c == chosen for c in crcs], state, source)
        saver.drop_prefetch()  # a read ahead of another step: not held beside the state
        _drop_other_timelines(where, step)  # before any rank of the node saves again
        if all(gather(saver, came is not None)):
            assert came is not None
            return (step, state, came), steps[0]
    return None, steps[0] if steps else None


def _chosen(crcs: list[int | None]) -> int | None:
    """The copy every rank restores, by its CRC-32: the one most ranks read (a folder no
    live rank tended, as a node's that sat out a restore, can hold a step of the same
    number from a timeline the job left); of equals, the lowest rank's. None: no rank
    read one whole."""
    count: dict[int, int] = {}
    for crc in crcs:
        if crc is not None:
            count[crc] = count.get(crc, 0) + 1
    if not count:
        return None
    most = max(count.values())
    return next(c for c in crcs if c is not None and count[c] == most)


def _held(where: layout.Where, roots: list[str | None]) -> dict[int, list[Source]]:
    """Step -> where this rank can read it: its own folder first (a restarted worker's
    read-ahead is of it), then the node's other folders, then the durable copies."""
    held: dict[int, list[Source]] = {}
    for root in roots:
        base = root or where.root
        if root is None:
            ranks = sorted(layout.held_ranks(base), key=lambda r: (r != where.rank, r))
        else:
            ranks = sorted({where.rank, 0})
        for rank in ranks:
            for step in layout.complete_steps(layout.rank_dir(base, rank)):
                held.setdefault(step, []).append((root, rank))
    return held


def _folder(where: layout.Where, step: int, source: Source) -> str:
    root, rank = source
    return layout.step_dir(layout.rank_dir(root or where.root, rank), step)


def _read_first(
    saver: Any, step: int, sources: list[Source]
) -> tuple[Any, Source | None, int | None]:
    """This rank's read of ``step`` from the first of ``sources`` that holds it whole,
    where from and its CRC-32 (the manifest's)."""
    where: layout.Where = saver.where
    for source in sources:
        root, rank = source
        folder = _folder(where, step, source)
        try:
            manifest = layout.read_manifest(folder)
            # any world size: a past world's snapshot of this job is every rank's
            check(replace(where, rank=rank, world_size=manifest.world_size), manifest, folder, step)
            if rank == where.rank and manifest.world_size == where.world_size:
                state = saver.read(step, root)  # the read ahead, when it is of it
            else:
                state = read_folder(folder, manifest, saver.filler)
            return state, source, manifest.crc32
        except layout.CorruptSnapshot as exc:
            log.warning("rank %s: snapshot not used: %s", where.rank, exc)
    return None, None, None


def _share(
    saver: Any, step: int, read: list[bool], state: Any, source: Source | None
) -> tuple[Any, str | None]:
    """Send the snapshot of ``step`` from the ranks that read the chosen copy (``read``:
    whether each rank did) to those that did not, each holder to every len(holders)-th
    of them. Returns this rank's state and where it came from (None: the transfer
    failed)."""
    where: layout.Where = saver.where
    holders = [rank for rank, ok in enumerate(read) if ok]
    lacking = [rank for rank, ok in enumerate(read) if not ok]
    giver = {rank: holders[i % len(holders)] for i, rank in enumerate(lacking)}
    device = group_device()
    if where.rank in giver:
        got = _receive(saver, step, giver[where.rank], device)
        return got, (None if got is None else "another rank")
    assert source is not None
    folder = _folder(where, step, source)
    for rank in lacking:
        if giver[rank] == where.rank:
            _send(folder, rank, device)
    return state, "memory" if source[0] is None else "durable"


def _send(folder: str, to: int, device: torch.device) -> None:
    """The manifest's and the data file's bytes of the snapshot in ``folder`` to rank
    ``to``: their lengths first (``_NO_SEND`` when they cannot be read), then the
    manifest, then the data in chunks of at most ``_CHUNK`` bytes."""
    import torch.distributed as dist

    data_path = os.path.join(folder, layout.DATA)
    try:
        with open(os.path.join(folder, layout.MANIFEST), "rb") as f:
            manifest = f.read()
        size = os.path.getsize(data_path)
        data = torch.from_file(data_path, shared=False, size=size, dtype=torch.uint8)
        if not manifest:
            raise OSError("the manifest is empty")
    except (OSError, RuntimeError) as exc:  # gone since it was read: the receiver says so
        log.warning("cannot send %s to rank %s: %s", folder, to, exc)
        dist.send(torch.tensor([_NO_SEND, _NO_SEND], dtype=torch.int64, device=device), to)
        return
    dist.send(torch.tensor([len(manifest), size], dtype=torch.int64, device=device), to)
    dist.send(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(device), to)
    for part, through in _chunks(data, device):
        dist.send(part if through is None else through.copy_(part), to)


def _chunks(
    data: torch.Tensor, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``data`` (flat uint8, on the CPU) in chunks of at most ``_CHUNK`` bytes, each with
    the part of one buffer on ``device`` it crosses through (None on the CPU: the chunk
    itself is sent, or received into)."""
    size = data.numel()
    buffer = None
    if device.type != "cpu" and size:
        buffer = torch.empty(min(size, _CHUNK), dtype=torch.uint8, device=device)
    for lo in range(0, size, _CHUNK):
        part = data[lo : lo + _CHUNK]
        yield part, None if buffer is None else buffer[: part.numel()]


def _receive(saver: Any, step: int, giver: int, device: torch.device) -> Any:
    """The state of ``step`` as rank ``giver`` sends it; None when it could not send it
    or what came is not whole (said in one line)."""
    import torch.distributed as dist

    where: layout.Where = saver.where
    lengths = torch.zeros(2, dtype=torch.int64, device=device)
    dist.recv(lengths, giver)
    n_manifest, size = (int(n) for n in lengths.tolist())
    what = f"step {step} from rank {giver}"
    if n_manifest == _NO_SEND:
        log.warning("rank %s: %s: it could not read it again", where.rank, what)
        return None
    manifest = torch.empty(n_manifest, dtype=torch.uint8, device=device)
    dist.recv(manifest, giver)
    data = torch.empty(size, dtype=torch.uint8)
    for part, through in _chunks(data, device):
        dist.recv(part if through is None else through, giver)
        if through is not None:
            part.copy_(through)
    try:
        m = layout.parse_manifest(manifest.cpu().numpy().tobytes(), what)
        if (m.job, m.step) != (where.job, step):
            raise layout.CorruptSnapshot(f"{what}: job {m.job!r}, step {m.step} (not this job's)")
        return read_sent(m, data, what, saver.filler)
    except layout.CorruptSnapshot as exc:
        log.warning("rank %s: snapshot not used: %s", where.rank, exc)
        return None


def _drop_other_timelines(where: layout.Where, step: int) -> None:
    """Drop the steps after ``step`` from the node's folders of other ranks (this rank's
    own: ``load()``, with its durable copies)."""
    for rank in layout.held_ranks(where.root):
        if rank != where.rank:
            layout.discard_newer(layout.rank_dir(where.root, rank), step)
