"""Replacement ranks (tiered recovery): a new process takes the place of a rank that died.

When a rank's process dies, its relaunch agent forks a replacement that runs the same
script with ``RELAUNCH_INPROCESS_INCARNATION=k`` (its k-th replacement). The
replacement's wrapper does not pass the initial barrier (its peers are long past it):

1. it appends ``rank:k`` to the join requests (:meth:`CoordinationStore.request_join`);
2. the peers restart for the death anyway; after each termination barrier every
   peer freezes, by compare-and-set, the requests it sees (:func:`admit`): the
   admitted ranks are back in the roster of the next iteration, with the rank
   assignment recomputed from the initial layout, so the world is back at N;
3. the peers publish each iteration's roster (every rank's state, versioned JSON);
   the replacement reads the rosters from the current iteration on
   (:func:`wait_for_admission`) and, once one holds it, takes its state and goes to
   that iteration's barrier like everyone else. A roster published without it (the
   peers froze before its request landed) makes it record a ``JOINED`` interruption
   of that iteration: the peers restart once more and take it in.

Deaths are per incarnation: a death record of incarnation ``j`` counts only while
``j`` is at least the rank's admitted incarnation, so the old process's death does not
make its replacement dead, and the replacement's own death does.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping

from relaunch._contract import INCARNATION_ENV, JOIN_WAIT_ENV, PRELOAD_ENV, read_module_list
from relaunch._json import loads as json_loads
from relaunch.inprocess._core._coord import COMPLETE, CoordinationStore
from relaunch.inprocess._core._exceptions import BarrierTimeoutError, InternalError
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._records import Interruption, InterruptionRecord
from relaunch.inprocess._core._state import Mode, State

__all__ = [
    "admit",
    "decode_roster",
    "encode_roster",
    "fresh_ranks",
    "incarnation",
    "wait_for_admission",
]


log = get_logger(__name__)

_VERSION = 1
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def incarnation(env: Mapping[str, str] | None = None) -> int:
    """This process's incarnation: 0 for a rank's first process."""
    env = os.environ if env is None else env
    text = env.get(INCARNATION_ENV, "0") or "0"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise InternalError(f"{INCARNATION_ENV}: expected an int >= 0, got {text!r}")
    return value


def preload(env: Mapping[str, str] | None = None) -> int:
    """Import the modules the agent's ``RELAUNCH_INPROCESS_PRELOAD`` file lists that
    this process lacks (what the node's workers import: a replacement forked early, or
    started fresh, would otherwise import them while its peers wait for it in a
    collective). Returns how many were imported; never raises."""
    import importlib
    import sys

    env = os.environ if env is None else env
    path = env.get(PRELOAD_ENV)
    if not path:
        return 0
    count, t0 = 0, time.monotonic()
    for name in read_module_list(path):
        if name in sys.modules or not _MODULE.fullmatch(name):
            continue
        try:
            importlib.import_module(name)
            count += 1
        except (Exception, SystemExit):  # one that cannot be imported here is skipped
            continue
    log.debug("%d modules imported in %.2f s before joining", count, time.monotonic() - t0)
    return count


def join_wait(env: Mapping[str, str] | None = None) -> float:
    """Seconds a restart waits for the replacements of the ranks it lost: the relaunch
    agent sets ``RELAUNCH_INPROCESS_JOIN_WAIT`` when it replaces dead ranks; 0 else."""
    env = os.environ if env is None else env
    try:
        return max(0.0, float(env.get(JOIN_WAIT_ENV, "0") or "0"))
    except ValueError:
        return 0.0


def encode_roster(roster: Mapping[int, State], incarnations: Mapping[int, int]) -> str:
    """One iteration's states (by initial rank) and the admitted incarnations."""
    states = {
        str(r): {
            "rank": s.rank,
            "world_size": s.world_size,
            "initial_world_size": s.initial_world_size,
            "active_rank": s.active_rank,
            "active_world_size": s.active_world_size,
            "iteration": s.iteration,
            "mode": s.mode.name,
        }
        for r, s in sorted(roster.items())
    }
    inc = {str(r): i for r, i in sorted(incarnations.items())}
    return json.dumps({"version": _VERSION, "states": states, "incarnations": inc})


def decode_roster(text: str) -> tuple[dict[int, State], dict[int, int]]:
    """Parse :func:`encode_roster`'s document; InternalError naming what is wrong."""
    try:
        doc = json_loads(text)
        if not isinstance(doc, dict) or doc.get("version") != _VERSION:
            raise ValueError("unknown roster version")
        roster: dict[int, State] = {}
        for key, s in doc["states"].items():
            active = s["active_rank"]
            roster[int(key)] = State(
                rank=int(s["rank"]),
                world_size=int(s["world_size"]),
                initial_rank=int(key),
                initial_world_size=int(s["initial_world_size"]),
                active_rank=None if active is None else int(active),
                active_world_size=None
                if s["active_world_size"] is None
                else int(s["active_world_size"]),
                iteration=int(s["iteration"]),
                mode=Mode[s["mode"]],
            )
        incarnations = {int(r): int(i) for r, i in doc["incarnations"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InternalError(f"corrupt roster {text[:200]!r}: {exc}") from exc
    return roster, incarnations


def admit(
    coord: CoordinationStore, iteration: int, members: set[int], terminated: set[int]
) -> dict[int, int]:
    """Freeze (once, for every rank) the replacements taken in after ``iteration``:
    requests of a newer incarnation than admitted, for ranks not running on."""
    running = members - terminated
    # The agent replaces a dead rank within a few hundred ms: wait for it here, so that
    # it joins in this restart instead of causing one more; not for the ranks of a lost
    # node that no node took over yet (they may never come).
    awaited = terminated - coord.unreplaced_lost() if terminated else set()
    deadline = time.monotonic() + (join_wait() if awaited else 0.0)
    while True:
        pending = {
            r: inc
            for r, inc in coord.join_requests().items()
            if inc > coord.incarnations.get(r, 0) and r not in running
        }
        if awaited <= set(pending) or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    admitted = coord.freeze_joins(iteration, pending)
    coord.incarnations.update(admitted)
    return admitted


def fresh_ranks(coord: CoordinationStore, roster: Mapping[int, State]) -> set[int]:
    """The ranks (``RANK`` values) of ``roster`` that are replacement processes without
    their training state yet: admitted, and not yet through an iteration in which they
    got it (``broadcast_state``) or trained (``ping``). The same on every rank: read
    when no rank runs the function (after the termination barrier, or the admission).
    A replacement whose first iteration was interrupted before the state reached it
    stays fresh in the next one."""
    stated = coord.stated()
    return {
        s.rank
        for r, s in roster.items()
        if s.rank is not None
        and coord.incarnations.get(r, 0) > 0
        and stated.get(r, -1) < coord.incarnations[r]
    }


def wait_for_admission(
    coord: CoordinationStore,
    initial_rank: int,
    inc: int,
    timeout: float,
    poll: float,
) -> dict[int, State] | None:
    """Ask to join and wait for a roster that holds this incarnation; return it (the
    states of its iteration), or None when the job completed meanwhile."""
    coord.request_join(initial_rank, inc)
    deadline = time.monotonic() + timeout
    it = coord.current_iteration()
    asked: set[int] = set()
    while True:
        if it is None:
            it = coord.current_iteration()
        elif (text := coord.roster(it)) is not None:
            roster, incarnations = decode_roster(text)
            if initial_rank in roster and incarnations.get(initial_rank, 0) == inc:
                coord.incarnations.update(incarnations)
                return roster
            if coord.outcome(it) == COMPLETE:
                return None
            if it not in asked:  # the peers run without us: make them restart
                asked.add(it)
                coord.record_interrupted(
                    it,
                    InterruptionRecord(
                        initial_rank=initial_rank,
                        interruption=Interruption.JOINED,
                        message=f"replacement process {os.getpid()} (incarnation {inc}) joins",
                        incarnation=inc,
                    ),
                )
            if coord.roster(it + 1) is not None:
                it += 1
                continue
        if time.monotonic() >= deadline:
            raise BarrierTimeoutError(
                f"rank {initial_rank}: not admitted back into the job within {timeout:.3g} s"
            )
        time.sleep(poll)
