"""The store that coordinates ranks: records, barriers and heartbeats under one namespace.

Keys (``ns`` is unique per job, torchrun/relaunch attempt and wrapped call)::

    ns/dead            appended JSON lines: ranks gone for good (killed, missing, unhealthy)
    ns/exited          appended lines: initial ranks that left the wrapper
    ns/hb/<r>          heartbeat counter of rank r's monitor process
    ns/init/...        initial barrier
    ns/it<i>/int       appended JSON lines: interruption records of iteration i
    ns/it<i>/<name>    appended lines: arrivals at barrier <name> of iteration i
    ns/it<i>/outcome   "complete" or "restart", set once (compare-and-set)
    ns/it<i>/terminated  the frozen set of terminated ranks, set once
    ns/it<i>/pg/       prefix of the process group's own rendezvous

Values are appended lines, so a reader needs one round trip (``multi_get``) to see
every record, and arrivals are de-duplicated by initial rank: whoever arrives twice,
or arrives after being declared dead, is counted once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from relaunch.inprocess.attribution import Interruption, InterruptionRecord, decode_records
from relaunch.inprocess.exception import BarrierTimeoutError, InternalError

__all__ = ["CoordinationStore", "TorchStore"]

log = logging.getLogger(__name__)

COMPLETE = "complete"
RESTART = "restart"


class TorchStore(Protocol):
    """The part of a torch ``Store`` client the wrapper uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def append(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


def _ints(blob: bytes) -> set[int]:
    out: set[int] = set()
    for item in blob.decode("ascii", errors="replace").split(","):
        item = item.strip()
        if item:
            try:
                out.add(int(item))
            except ValueError as exc:
                raise InternalError(f"corrupt rank list {blob!r}") from exc
    return out


class CoordinationStore:
    """Helpers over one torch ``Store`` client. Not thread-safe: one per thread."""

    def __init__(self, store: TorchStore, namespace: str) -> None:
        self.store = store
        self.namespace = namespace.rstrip("/") + "/"
        self._ensured: set[str] = set()

    # keys -------------------------------------------------------------------------
    def key(self, *parts: object) -> str:
        return self.namespace + "/".join(str(p) for p in parts)

    def it_key(self, iteration: int, *parts: object) -> str:
        return self.key(f"it{iteration}", *parts)

    def pg_prefix(self, iteration: int) -> str:
        """Prefix under which the process group of ``iteration`` rendezvous."""
        return self.it_key(iteration, "pg") + "/"

    def _read(self, keys: list[str]) -> list[bytes]:
        for key in keys:
            if key not in self._ensured:
                self.store.append(key, "")
                self._ensured.add(key)
        return list(self.store.multi_get(keys))

    # records ------------------------------------------------------------------------
    def record_interrupted(self, iteration: int, record: InterruptionRecord) -> None:
        self.store.append(self.it_key(iteration, "int"), record.encode())

    def record_dead(
        self, iteration: int, initial_rank: int, kind: Interruption, message: str = ""
    ) -> None:
        """Rank ``initial_rank`` is gone for good: mark it dead and interrupt ``iteration``."""
        record = InterruptionRecord(initial_rank=initial_rank, interruption=kind, message=message)
        self.store.append(self.key("dead"), record.encode())
        self.record_interrupted(iteration, record)

    def record_exited(self, initial_rank: int) -> None:
        self.store.append(self.key("exited"), f"{initial_rank},")

    def dead_ranks(self) -> set[int]:
        (blob,) = self._read([self.key("dead")])
        return {r.initial_rank for r in decode_records(blob)}

    def exited_ranks(self) -> set[int]:
        (blob,) = self._read([self.key("exited")])
        return _ints(blob)

    def poll(self, iteration: int) -> tuple[list[InterruptionRecord], set[int]]:
        """Interruption records of ``iteration`` and the dead ranks, in one round trip."""
        ints, dead = self._read([self.it_key(iteration, "int"), self.key("dead")])
        return decode_records(ints), {r.initial_rank for r in decode_records(dead)}

    # heartbeats ---------------------------------------------------------------------
    def heartbeat(self, initial_rank: int) -> None:
        self.store.add(self.key("hb", initial_rank), 1)

    def heartbeats(self, ranks: Iterable[int]) -> dict[int, int]:
        ranks = sorted(ranks)
        keys = [self.key("hb", r) for r in ranks]
        for key in keys:
            if key not in self._ensured:
                self.store.add(key, 0)
                self._ensured.add(key)
        return {r: int(v or b"0") for r, v in zip(ranks, self.store.multi_get(keys), strict=True)}

    # barriers -----------------------------------------------------------------------
    def arrive(self, barrier: str, initial_rank: int) -> None:
        self.store.append(self.key(barrier), f"{initial_rank},")

    def _wait(
        self,
        barrier: str,
        members: set[int],
        timeout: float,
        poll: float,
        check: Callable[[set[int], set[int], list[InterruptionRecord]], str | None],
        iteration: int | None,
    ) -> str:
        deadline = time.monotonic() + timeout
        keys = [self.key(barrier), self.key("dead")]
        if iteration is not None:
            keys.append(self.it_key(iteration, "int"))
        while True:
            blobs = self._read(keys)
            arrived = _ints(blobs[0])
            dead = {r.initial_rank for r in decode_records(blobs[1])}
            records = decode_records(blobs[2]) if iteration is not None else []
            verdict = check(arrived, dead, records)
            if verdict is not None:
                return verdict
            if time.monotonic() >= deadline:
                missing = sorted(members - arrived - dead)
                raise BarrierTimeoutError(
                    f"barrier {barrier!r}: ranks {missing} did not arrive within {timeout:.3g} s"
                )
            time.sleep(poll)

    def initial_barrier(
        self, initial_rank: int, members: set[int], timeout: float, poll: float
    ) -> set[int]:
        """All ranks arrive (the dead count as arrived); return the dead members."""
        self.arrive("init/arrived", initial_rank)

        def check(arrived: set[int], dead: set[int], _: list[InterruptionRecord]) -> str | None:
            return COMPLETE if members <= arrived | dead else None

        self._wait("init/arrived", members, timeout, poll, check, None)
        return self.freeze("init/terminated", self.dead_ranks() & members)

    def iteration_barrier(
        self, iteration: int, initial_rank: int, members: set[int], timeout: float, poll: float
    ) -> bool:
        """All members arrive: True. A member died or the iteration was interrupted: False."""
        barrier = f"it{iteration}/iteration"
        self.arrive(barrier, initial_rank)

        def check(
            arrived: set[int], dead: set[int], records: list[InterruptionRecord]
        ) -> str | None:
            if members <= arrived:
                return COMPLETE
            if records or (members - arrived) & dead:
                return RESTART
            return None

        return self._wait(barrier, members, timeout, poll, check, iteration) == COMPLETE

    def completion(
        self,
        iteration: int,
        initial_rank: int | None,
        active: set[int],
        timeout: float | None,
        poll: float,
    ) -> bool:
        """Wait until every active rank completed (True) or the iteration restarts (False).

        Active ranks arrive (``initial_rank``); spares pass None and wait without a
        timeout. The outcome is decided once, by compare-and-set, so that no rank
        returns while another restarts.
        """
        barrier = f"it{iteration}/completed"
        if initial_rank is not None:
            self.arrive(barrier, initial_rank)
        outcome_key = self.it_key(iteration, "outcome")

        def check(
            arrived: set[int], dead: set[int], records: list[InterruptionRecord]
        ) -> str | None:
            if active <= arrived:
                return self._decide(outcome_key, COMPLETE)
            if records or (active - arrived) & dead:
                return self._decide(outcome_key, RESTART)
            if self.store.check([outcome_key]):
                return str(self.store.get(outcome_key).decode())
            return None

        limit = timeout if timeout is not None else float("inf")
        return self._wait(barrier, active, limit, poll, check, iteration) == COMPLETE

    def _decide(self, key: str, outcome: str) -> str:
        return str(self.store.compare_set(key, "", outcome).decode())

    def termination_barrier(
        self,
        iteration: int,
        initial_rank: int,
        members: set[int],
        timeout: float,
        poll: float,
        last_call_wait: float,
    ) -> set[int]:
        """Every member arrives or is dead; return the frozen set of terminated members."""
        barrier = f"it{iteration}/termination"
        self.arrive(barrier, initial_rank)

        def check(arrived: set[int], dead: set[int], _: list[InterruptionRecord]) -> str | None:
            return COMPLETE if members <= arrived | dead else None

        self._wait(barrier, members, timeout, poll, check, None)
        dead = self.dead_ranks() & members
        if dead and last_call_wait > 0:
            end = time.monotonic() + last_call_wait
            while (left := end - time.monotonic()) > 0:  # short sleeps: progress is seen
                time.sleep(min(left, poll))
            dead = self.dead_ranks() & members
        return self.freeze(f"it{iteration}/terminated", dead)

    def freeze(self, name: str, ranks: set[int]) -> set[int]:
        """Set ``name`` to ``ranks`` unless already set; return the value every rank uses."""
        doc = json.dumps({"version": 1, "ranks": sorted(ranks)})
        blob = self._decide(self.key(name), doc)
        try:
            value = json.loads(blob)
            return {int(r) for r in value["ranks"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise InternalError(f"corrupt frozen rank set {blob!r}") from exc
