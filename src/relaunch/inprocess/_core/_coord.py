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
    ns/joins           appended ``rank:incarnation,``: replacement processes asking to join
    ns/it<i>/joined    the frozen ranks (and incarnations) admitted after iteration i
    ns/it<i>/roster    every rank's state for iteration i (versioned JSON), set once
    ns/current         the latest iteration a roster was published for
    ns/stated          appended ``rank:incarnation,``: replacements that have their state
    job/lost           appended JSON lines: ranks of nodes the relaunch agents saw lost
                       (``job`` is ``ns`` without its call: one key for every call)

Values are appended lines, so a reader needs one round trip (``multi_get``) to see
every record, and arrivals are de-duplicated by initial rank: whoever arrives twice,
or arrives after being declared dead, is counted once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from relaunch._contract import lost_key_of
from relaunch._json import loads as json_loads
from relaunch.inprocess._core._exceptions import BarrierTimeoutError, InternalError
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._records import Interruption, InterruptionRecord, decode_records

__all__ = ["CoordinationStore", "TorchStore"]

log = get_logger(__name__)

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
        # where the relaunch agent records the ranks lost with their node
        self.lost_key = lost_key_of(self.namespace) or self.key("lost")
        self._dead_keys = [self.key("dead"), self.lost_key]
        self._ensured: set[str] = set()
        self.incarnations: dict[int, int] = {}
        """Admitted incarnation per initial rank (absent: 0). Death records of an
        earlier incarnation do not count; shared by the wrapper's stores."""

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
        record = InterruptionRecord(
            initial_rank=initial_rank,
            interruption=kind,
            message=message,
            incarnation=self.incarnations.get(initial_rank, 0),
        )
        self.store.append(self.key("dead"), record.encode())
        self.record_interrupted(iteration, record)

    def record_exited(self, initial_rank: int) -> None:
        self.store.append(self.key("exited"), f"{initial_rank},")

    def _dead(self, dead: bytes, lost: bytes = b"") -> set[int]:
        """The ranks whose admitted incarnation has a death record (the wrapper's own,
        or an agent's for a lost node: that one kills every incarnation up to its own)."""
        blob = dead + b"\n" + lost
        return {
            r.initial_rank
            for r in decode_records(blob)
            if r.incarnation >= self.incarnations.get(r.initial_rank, 0)
        }

    def unreplaced_lost(self) -> set[int]:
        """Ranks of a lost node that no node took over yet (the relaunch agents record
        them UNRESPONSIVE; the node that takes over records them TERMINATED before its
        workers ask to join): no restart waits for their replacements."""
        (blob,) = self._read([self.lost_key])
        kinds: dict[int, set[Interruption]] = {}
        for r in decode_records(blob):
            if r.incarnation >= self.incarnations.get(r.initial_rank, 0):
                kinds.setdefault(r.initial_rank, set()).add(r.interruption)
        return {r for r, k in kinds.items() if k == {Interruption.UNRESPONSIVE}}

    def dead_ranks(self) -> set[int]:
        return self._dead(*self._read(self._dead_keys))

    def exited_ranks(self) -> set[int]:
        (blob,) = self._read([self.key("exited")])
        return _ints(blob)

    def poll(self, iteration: int) -> tuple[list[InterruptionRecord], set[int]]:
        """Interruption records of ``iteration`` and the dead ranks, in one round trip."""
        ints, dead, lost = self._read([self.it_key(iteration, "int"), *self._dead_keys])
        return decode_records(ints), self._dead(dead, lost)

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
        keys = [self.key(barrier), *self._dead_keys]
        if iteration is not None:
            keys.append(self.it_key(iteration, "int"))
        while True:
            blobs = self._read(keys)
            arrived = _ints(blobs[0])
            dead = self._dead(blobs[1], blobs[2])
            records = decode_records(blobs[3]) if iteration is not None else []
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
        waiting: Callable[[set[int]], None] | None = None,
    ) -> set[int]:
        """Every member arrives or is dead; return the frozen set of terminated members.
        ``waiting`` is called at every poll with the members arrived or dead so far."""
        barrier = f"it{iteration}/termination"
        self.arrive(barrier, initial_rank)

        def check(arrived: set[int], dead: set[int], _: list[InterruptionRecord]) -> str | None:
            if waiting is not None:
                waiting(arrived | dead)
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
            value = json_loads(blob)
            return {int(r) for r in value["ranks"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise InternalError(f"corrupt frozen rank set {blob!r}") from exc

    # replacements (tiered recovery) -------------------------------------------------
    def request_join(self, initial_rank: int, incarnation: int) -> None:
        """A replacement process of ``initial_rank`` asks to be taken in."""
        self.store.append(self.key("joins"), f"{initial_rank}:{incarnation},")

    def mark_stated(self, initial_rank: int, incarnation: int) -> None:
        """A replacement process has its training state (it got it, or it trained)."""
        self.store.append(self.key("stated"), f"{initial_rank}:{incarnation},")

    def stated(self) -> dict[int, int]:
        """The latest incarnation per initial rank that has its state."""
        return self._rank_incarnations("stated")

    def join_requests(self) -> dict[int, int]:
        """The latest incarnation that asked to join, per initial rank."""
        return self._rank_incarnations("joins")

    def _rank_incarnations(self, name: str) -> dict[int, int]:
        (blob,) = self._read([self.key(name)])
        out: dict[int, int] = {}
        for item in blob.decode("ascii", errors="replace").split(","):
            if not item.strip():
                continue
            try:
                rank_text, inc_text = item.split(":")
                rank, inc = int(rank_text), int(inc_text)
            except ValueError as exc:
                raise InternalError(f"corrupt {name} record {item!r}") from exc
            out[rank] = max(inc, out.get(rank, 0))
        return out

    def freeze_joins(self, iteration: int, admitted: dict[int, int]) -> dict[int, int]:
        """Admit ``admitted`` (rank -> incarnation) after ``iteration`` unless already
        decided; return what every rank uses."""
        doc = json.dumps({"version": 1, "ranks": {str(r): i for r, i in sorted(admitted.items())}})
        blob = self._decide(self.it_key(iteration, "joined"), doc)
        try:
            value = json_loads(blob)
            if value.get("version") != 1:
                raise ValueError("unknown version")
            return {int(r): int(i) for r, i in value["ranks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InternalError(f"corrupt admitted set {blob!r}") from exc

    def publish_roster(self, iteration: int, doc: str) -> None:
        """Publish the states of ``iteration`` (once) for replacements to read."""
        self._decide(self.it_key(iteration, "roster"), doc)
        self.store.set(self.key("current"), str(iteration))

    def _text(self, key: str) -> str | None:
        """The value of ``key`` now (None when unset or empty). Never waits."""
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode("utf-8", errors="replace") or None

    def roster(self, iteration: int) -> str | None:
        return self._text(self.it_key(iteration, "roster"))

    def current_iteration(self) -> int | None:
        text = self._text(self.key("current"))
        try:
            return None if text is None else int(text)
        except ValueError as exc:
            raise InternalError(f"corrupt current iteration {text!r}") from exc

    def outcome(self, iteration: int) -> str | None:
        return self._text(self.it_key(iteration, "outcome"))
