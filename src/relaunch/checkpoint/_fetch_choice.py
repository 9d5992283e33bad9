"""What a node fetches before its workers start: pure decisions over the steps and
CRC-32s that this node and the other nodes hold
(:class:`~relaunch.checkpoint._fetch.Fetch` does the I/O)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["fetch_targets", "short_of", "two_timelines"]


def two_timelines(
    mine: dict[int, dict[int, int]], listed: dict[tuple[int, int], set[int]], ran: Iterable[int]
) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The (rank, step) pairs of two timelines, from this node's snapshots (``mine``:
    rank -> step -> CRC-32) and the CRCs the round's other nodes list (``listed``):

    - *stale*: this node's, of a rank it did not run in the round before (not in
      ``ran``), that another node holds with other bytes. It wrote them before it sat out
      a restore to an older step, and the job then wrote that step again: kept, load()
      restored that step from two timelines (the job's on every other rank, the old one
      on this node's), once the step matched the newest the round shares;
    - *ambiguous*: steps the other nodes hold with different bytes (the mirror of a node
      that sat out, beside the job's copy): fetched from none."""
    ran = set(ran)
    ambiguous = {key for key, crcs in listed.items() if len(crcs) > 1}
    stale = {
        (rank, step)
        for (rank, step), crcs in listed.items()
        if rank not in ran and step in mine.get(rank, {}) and crcs != {mine[rank][step]}
    }
    return stale, ambiguous


def fetch_targets(
    ranks: Iterable[int],
    held: dict[int, set[int]],
    offered: dict[int, set[int]],
    others: dict[int, set[int]] | None = None,
) -> dict[int, int]:
    """The step to fetch for each of ``ranks`` (those already here are left out): the
    newest step that every one of them has, here or on another node, and that the
    round's ``others`` ranks hold too, so that every rank restores it (a lost node's
    ranks had their copies made one by one, and the other ranks may be a step behind
    the newest copy: each rank's newest alone made a step no two ranks had in common, a
    fresh start); without one the others hold, the newest these ranks share; else each
    rank's newest offered one that is newer than any here."""
    ranks = list(ranks)
    have = [held.get(rank, set()) | offered.get(rank, set()) for rank in ranks]
    common = set.intersection(*have) if have else set()
    everyone = common.intersection(*(others or {}).values())
    if everyone:
        common = everyone
    if common:
        step = max(common)
        return {rank: step for rank in ranks if step not in held.get(rank, set())}
    out = {}
    for rank in ranks:
        newest = max(offered.get(rank, set()), default=-1)
        if newest > max(held.get(rank, set()), default=-1):
            out[rank] = newest
    return out


def short_of(
    ranks: Iterable[int],
    held: dict[int, set[int]],
    offered: dict[int, set[int]],
    others: dict[int, set[int]],
) -> bool:
    """Whether what the round's nodes hold leaves the round short: a rank of ``ranks``
    (here or ``offered``) or of the round's ``others`` with nothing to restore, or no
    step that every one of them can restore (the nodes outside the round are asked then)."""
    have = [held.get(rank, set()) | offered.get(rank, set()) for rank in ranks]
    have += others.values()
    if not have:
        return False
    return any(not steps for steps in have) or not set.intersection(*have)
