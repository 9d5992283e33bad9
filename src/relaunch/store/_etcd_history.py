"""Whether a compare-and-set that was sent more than once was applied by an earlier send.

The etcd client sends a call to the next member when one does not answer in time
(:class:`~relaunch.store._etcd_http.EtcdEndpoints`); the first send may still have been
applied. A compare-and-set sent again then answers "not written", and when yet
another write landed in between, the value it answers is not the caller's either: the
caller would take its applied write for a lost one (the rendezvous then skipped what
follows a write: the round's places, the epoch key that wakes the waiting nodes).
The key's history tells: etcd keeps every value of a key since its last compaction
(five minutes, as the agents start it), and the value that followed ``expected`` in it
is the caller's when its compare-and-set was applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relaunch.errors import StoreClosedError, StoreConnectionError, StoreError
from relaunch.store._etcd_http import first_kv, kv_value

__all__ = ["applied_earlier"]

_STEPS = 8
"""Values of the key's history read at most (each a call): a resent write is seconds
old, and few writes of one key land in seconds."""

Post = Callable[[str, dict[str, Any]], dict[str, Any]]


def applied_earlier(
    post: Post, raw_key: str, expected: bytes | None, desired: bytes, kv: dict[str, Any]
) -> bool:
    """Whether ``expected -> desired`` was applied to the key (``raw_key``: base64, as
    etcd's JSON names it) before its value became ``kv`` (the key now, as etcd's JSON
    has it): the value after ``expected`` in its history is ``desired`` (with
    ``expected`` None: the key's first value since it was created). That another
    writer put the same bytes there is taken as impossible, as the callers already
    take it (a rendezvous state's bytes carry its sequence number, a steward's its
    time). False when the history does not say (compacted; more than :data:`_STEPS`
    values back; a value that came back, A B A: taken for not applied, as before this
    check)."""
    try:
        if expected is None:
            first = _at(post, raw_key, int(kv["create_revision"]))
            return first is not None and kv_value(first) == desired
        later = kv
        for _ in range(_STEPS):
            earlier = _at(post, raw_key, int(later["mod_revision"]) - 1)
            if earlier is None:
                return False
            if kv_value(earlier) == expected:
                return kv_value(later) == desired
            later = earlier
    except (StoreClosedError, StoreConnectionError):
        raise  # the store is gone: not a question of history
    except (StoreError, KeyError, ValueError):  # compacted, or an answer not as expected
        return False
    return False


def _at(post: Post, raw_key: str, revision: int) -> dict[str, Any] | None:
    """The key as it was at ``revision`` (None: absent then)."""
    if revision <= 0:
        return None
    return first_kv(post("/kv/range", {"key": raw_key, "revision": str(revision)}))
