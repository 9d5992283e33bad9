"""The ranks agree on the step they restore: the newest one every rank has whole.

Each rank offers the steps of its snapshots in node memory and in the durable copies
(manifests checked); the newest step in every offer is read by every rank, from node
memory when it is there, else from the durable copy (data length and CRC-32 checked);
when any rank has no whole copy of it, every rank drops that step and tries the next
one. A replacement for a lost node, with no snapshot in its memory, restores the
survivors' step from the durable copies when the copier got there. Small all-gathers
over the default process group, of versioned JSON records (no pickle).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from relaunch._json import loads as json_loads
from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._layout import CorruptSnapshot
from relaunch.errors import SnapshotError

__all__ = [
    "decode_record",
    "encode_record",
    "gather",
    "group_device",
    "newest_common",
    "other_world",
]

log = logging.getLogger("relaunch.checkpoint")

_RECORD_VERSION = 1
"""Of each rank's record in :func:`gather`."""


def newest_common(
    saver: Any, roots: list[str | None]
) -> tuple[tuple[int, Any, str] | None, int | None]:
    """``(step, state, source)``: the newest step every rank holds whole in one of
    ``roots`` (None: node memory; tried in order), this rank's state of it and where it
    came from ("memory" or "durable"), or None when there is no such step; and the
    newest step any rank offered (what the job had done: the steps between are redone)."""
    where: dict[int, list[str | None]] = {}
    for root in roots:
        for step in saver.steps(root):
            where.setdefault(step, []).append(root)
    offers = gather(saver, sorted(where))
    common = set(offers[0]).intersection(*offers[1:]) if offers else set()
    newest = max((max(o) for o in offers if o), default=None)
    for step in sorted(common, reverse=True):
        found: tuple[int, Any, str] | None = None
        for root in where[step]:
            try:
                found = step, saver.read(step, root), "memory" if root is None else "durable"
                break
            except CorruptSnapshot as exc:
                log.warning(
                    "rank %s: snapshot not used: %s; trying an older one", saver.where.rank, exc
                )
        if all(gather(saver, found is not None)):
            return found, newest
    if newest is not None and saver.where.rank == 0:
        log.warning("checkpoint.load(): a fresh start: %s", _why_none(offers, newest))
    elif newest is None:  # (every rank sees it: their offers were gathered)
        # (the durable copies, on shared storage, looked at by rank 0 alone)
        mine = other_world(saver.where, roots if saver.where.rank == 0 else [None])
        other = [s for s in gather(saver, mine) if s is not None]
        if other and saver.where.rank == 0:
            step, world = max(other)
            log.warning(
                "checkpoint.load(): a fresh start: the snapshots held (newest step %s) "
                "were saved by a world of %s ranks, not this one of %s; each rank "
                "restores its own rank's state of the same world size, and a state that "
                "is the same on every rank (plain data parallel training) restores "
                "across sizes with checkpoint.load(replicated=True)",
                step, world, saver.where.world_size,
            )  # fmt: skip
    return None, newest


def other_world(where: layout.Where, roots: list[str | None]) -> tuple[int, int] | None:
    """``(step, world size)`` of the newest snapshot of this job under ``roots`` (None:
    node memory) that a world of another size saved, or None: what a rank with nothing
    of its own to restore tells, so that a change of size is not a silent fresh start."""
    newest: tuple[int, int] | None = None
    for root in roots:
        base = root or where.root
        for rank, steps in layout.held_ranks(base).items():
            try:
                m = layout.read_manifest(layout.step_dir(layout.rank_dir(base, rank), steps[0]))
            except CorruptSnapshot:
                continue
            if m.job == where.job and m.world_size != where.world_size:
                newest = max(newest or (m.step, m.world_size), (m.step, m.world_size))
    return newest


def _why_none(offers: list[list[int]], newest: int) -> str:
    """Why no step was restored though some rank held one (said once, by rank 0)."""
    none = [rank for rank, offer in enumerate(offers) if not offer]
    if none:
        held = [rank for rank, offer in enumerate(offers) if offer]
        return (
            f"{_span(none)} {'holds' if len(none) == 1 else 'hold'} no snapshot, "
            f"{_span(held)} {'does' if len(held) == 1 else 'do'} (newest step {newest}); "
            "each rank restores its own state, so every rank must call checkpoint.save(), "
            "not one of them"
        )
    return (
        f"no step is held whole by every rank (their newest steps: "
        f"{min(max(o) for o in offers)} to {newest})"
    )


def _span(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``ranks 0-2, 5`` (a job of thousands of ranks in a line)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def gather(saver: Any, mine: Any) -> list[Any]:
    """Every rank's ``mine`` (JSON data), in rank order: an all-gather over the default
    group of each rank's versioned JSON record (no pickle), padded to the longest."""
    world = saver.where.world_size
    if world == 1:
        return [mine]
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise SnapshotError(
            f"checkpoint.load() compares the {world} ranks' snapshots over the default "
            "process group: call it after torch.distributed.init_process_group"
        )
    if dist.get_world_size() != world:
        raise SnapshotError(
            f"the default process group has {dist.get_world_size()} ranks, WORLD_SIZE is {world}"
        )
    device = group_device()
    record = encode_record(mine)
    length = torch.tensor([len(record)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]  # (one copy from a GPU)
    mine_padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine_padded[: len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    records = [torch.empty_like(mine_padded) for _ in range(world)]
    dist.all_gather(records, mine_padded)
    rows = torch.stack(records).cpu().numpy()
    return [decode_record(rank, rows[rank, :size].tobytes()) for rank, size in enumerate(sizes)]


def group_device() -> Any:
    """Where the default group's tensors must be: the CPU, or with NCCL alone this
    process's GPU (the one ``init_process_group(device_id=...)`` bound, else the current
    device)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def encode_record(value: Any) -> bytes:
    """One rank's part of a :func:`gather`: ``{"v": 1, "value": ...}`` as JSON."""
    return json.dumps({"v": _RECORD_VERSION, "value": value}, separators=(",", ":")).encode()


def decode_record(rank: int, raw: bytes) -> Any:
    """The value of rank ``rank``'s record; SnapshotError naming the rank and the fault."""
    try:
        doc = json_loads(raw)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"rank {rank}'s snapshot offer is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != _RECORD_VERSION or "value" not in doc:
        raise SnapshotError(
            f"rank {rank}'s snapshot offer is not one this version reads (expected an "
            f"object with v={_RECORD_VERSION} and a value, got {raw[:80]!r}): every rank "
            "must run the same relaunch"
        )
    return doc["value"]
