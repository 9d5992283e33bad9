"""Exchanging states, keys and barrier arrivals between ranks through a torch Store:
NVIDIA's ``StoreMixin`` and its barrier errors (re-exported by
:mod:`relaunch.inprocess.store`, with the concrete stores).

Rank assignments that exchange data (``Tree``, ``FilterCountGroupedByKey``) get a
:func:`mixin_view` of the coordination store; the engine publishes each rank's new
state through it. Unlike NVIDIA's, states and keys travel as versioned JSON, never
pickle: a peer (or anyone who reaches the store) cannot make this process run code.
A state's ``fn_exception`` travels as its ``repr``. Imports torch.distributed: the
engine imports this module only when an assignment exchanges data.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from relaunch._json import loads as json_loads
from relaunch.inprocess._core._exceptions import RestartError
from relaunch.inprocess._core._state import Mode, State

__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "StoreMixin",
    "as_timedelta",
    "decode_state",
    "encode_state",
    "mixin_view",
]

_VERSION = 1


class BarrierError(RestartError):
    """A barrier between ranks failed."""


class BarrierTimeout(BarrierError):
    """Not every rank arrived at a barrier in time."""


class BarrierOverflow(BarrierError):
    """More ranks arrived at a barrier than it was for."""


def as_timedelta(timeout: datetime.timedelta | float) -> datetime.timedelta:
    """A timeout given as a timedelta (NVIDIA's type) or seconds, as a timedelta."""
    return (
        timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    )


def _tuples(value: Any) -> Any:
    """JSON lists back to tuples (grouping keys must stay hashable)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def encode_state(state: Any) -> bytes:
    fields = {
        name: getattr(state, name)
        for name in ("rank", "world_size", "active_rank", "active_world_size",
                     "initial_rank", "initial_world_size", "iteration")
    }  # fmt: skip
    fields["mode"] = state.mode.name
    exc = state.fn_exception
    fields["fn_exception"] = None if exc is None else repr(exc)
    return json.dumps({"version": _VERSION, "state": fields}).encode()


def decode_state(raw: bytes, key: str) -> State:
    try:
        doc = json_loads(raw)
        fields = dict(doc["state"])
        if doc.get("version") != _VERSION:
            raise ValueError(f"version {doc.get('version')!r}")
        fields["mode"] = Mode[fields["mode"]]
        exc = fields.pop("fn_exception")
        state = State(**fields)
        state.fn_exception = None if exc is None else RuntimeError(exc)
        return state
    except (ValueError, KeyError, TypeError) as exc:
        raise RestartError(f"{key}: not a state record ({exc}): {raw[:120]!r}") from exc


class StoreMixin:
    """What NVIDIA's wrapper adds to a torch Store (mixed into one)."""

    STATE = "state_{rank}"
    KEY = "key_{rank}"
    BARRIER_PREFIX = "inprocess_barrier_prefix"
    STORE_PREFIX = "_inprocess_{iteration}"
    INITIAL_BARRIER = "initial_barrier"
    COMPLETION_BARRIER = "completion_barrier"
    ITERATION_BARRIER = "iteration_barrier"
    TERMINATION_BARRIER = "termination_barrier"

    # The torch Store methods this mixin relies on (provided by the store it is mixed into).
    set: Any
    get: Any
    add: Any
    append: Any
    check: Any
    wait: Any
    multi_get: Any

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        """Ranks whose loss loses the store (none, unless a rank hosts it)."""
        return ()

    def send_state(self, state: Any, rank: int) -> None:
        self.set(self.STATE.format(rank=rank), encode_state(state))

    def get_states(self, ranks: Iterable[int]) -> list[State]:
        keys = [self.STATE.format(rank=r) for r in ranks]
        return [decode_state(raw, key) for key, raw in zip(keys, self.multi_get(keys), strict=True)]

    def send_key(self, key: Any, rank: int) -> None:
        self.set(self.KEY.format(rank=rank), json.dumps({"version": _VERSION, "key": key}))

    def get_keys(self, ranks: Iterable[int]) -> list[Any]:
        names = [self.KEY.format(rank=r) for r in ranks]
        out = []
        for name, raw in zip(names, self.multi_get(names), strict=True):
            try:
                out.append(_tuples(json_loads(raw)["key"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise RestartError(f"{name}: not a key record: {raw[:120]!r}") from exc
        return out

    def get_packed(self, key: str, sep: str) -> list[str]:
        return str(self.get(key).decode()).rstrip(sep).split(sep)

    def barrier(
        self,
        ranks: Iterable[int],
        group_name: str,
        rendezvous_count: int,
        timeout: datetime.timedelta,
        timeout_chunk: datetime.timedelta | None = None,
    ) -> None:
        """Wait until ``rendezvous_count`` ranks arrived at barrier ``group_name``."""
        ranks = list(ranks)
        base = f"{self.BARRIER_PREFIX}:barrier:{group_name}"
        arrived = int(self.add(base, len(set(ranks))))
        self.append(f"{base}:arrived", ",".join(str(r) for r in ranks) + ",")
        if arrived > rendezvous_count:
            raise BarrierOverflow(
                f"{group_name}: {arrived} ranks arrived, expected {rendezvous_count}"
            )
        if arrived == rendezvous_count:
            self.set(f"{base}:last_worker_arrived", "1")
        timeout = as_timedelta(timeout)
        chunk = min(as_timedelta(timeout_chunk), timeout) if timeout_chunk is not None else timeout
        if timeout == datetime.timedelta.max and timeout_chunk is None:
            chunk = datetime.timedelta(seconds=60)
        deadline = time.monotonic() + min(timeout.total_seconds(), 1e9)
        while True:
            try:
                self.wait([f"{base}:last_worker_arrived"], chunk)
                return
            except dist.DistStoreError as exc:
                if time.monotonic() >= deadline:
                    raise BarrierTimeout(
                        f"{group_name}: ranks {ranks}: {rendezvous_count} expected, "
                        f"not all arrived within {timeout}"
                    ) from exc

    def completion_barrier(self, ranks: Iterable[int], rendezvous_count: int,
                           timeout: datetime.timedelta, timeout_chunk: datetime.timedelta | None = None) -> None:  # fmt: skip
        self.barrier(ranks, self.COMPLETION_BARRIER, rendezvous_count, timeout, timeout_chunk)

    def initial_barrier(self, ranks: Iterable[int], rendezvous_count: int,
                        timeout: datetime.timedelta, timeout_chunk: datetime.timedelta | None = None) -> None:  # fmt: skip
        self.barrier(ranks, self.INITIAL_BARRIER, rendezvous_count, timeout, timeout_chunk)


class _View(StoreMixin, dist.PrefixStore):  # type: ignore[misc,name-defined]
    pass


def mixin_view(prefix: str, store: Any) -> StoreMixin:
    """``store``'s keys under ``prefix``, with :class:`StoreMixin`'s methods."""
    view: StoreMixin = _View(prefix, store)
    return view
