"""A ticket counter on etcd: tickets 1, 2, 3... each handed out once, one call each.

etcd has no atomic add: :meth:`~relaunch.store.etcd.EtcdStore.add` is a
compare-and-set loop, and N nodes taking tickets at once (a round's joins, a job's
leaves) retried each other's writes, O(N^2) calls in all. etcd counts the puts of a key
instead (its ``version``), so a put that returns the key as it was before
(``prev_kv``) hands out the previous version plus one, with no retry.

The key holds :data:`MARK`, never a number, and a put is made only while it does (a
transaction): ``add`` on it fails, and a counter that ``add`` wrote (an agent of a
version that counted so, or an older job's key under the same run id) is refused with
a clear error, never counted on (its version is not its count).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from relaunch.errors import StoreError
from relaunch.store._etcd_http import first_kv, kv_value

__all__ = ["MARK", "count", "take"]

MARK = b"relaunch-tickets-v1"
"""The value of a ticket counter's key."""

_MARK64 = base64.b64encode(MARK).decode("ascii")


def take(post: Callable[[str, dict[str, Any]], dict[str, Any]], key: str, raw_key: str) -> int:
    """The next ticket of the counter at ``key`` (``raw_key``: as etcd's JSON names it,
    base64), through ``post`` (one call of etcd's JSON API); the first is 1."""
    put = {"request_put": {"key": raw_key, "value": _MARK64, "prev_kv": True}}
    counter = {"key": raw_key, "result": "EQUAL", "target": "VALUE", "value": _MARK64}
    absent = {"key": raw_key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    look = {"request_range": {"key": raw_key}}
    while True:
        reply = post("/kv/txn", {"compare": [counter], "success": [put], "failure": [look]})
        answer = (reply.get("responses") or [{}])[0]
        if reply.get("succeeded"):
            prev = answer.get("response_put", {}).get("prev_kv") or {}
            return int(prev.get("version", 0)) + 1
        kv = first_kv(answer.get("response_range", {}))
        if kv is not None:
            count(key, kv)  # raises unless it is a counter (created meanwhile): again
            continue
        if post("/kv/txn", {"compare": [absent], "success": [put]}).get("succeeded"):
            return 1


def count(key: str, kv: dict[str, Any] | None) -> int:
    """How many tickets the counter at ``key`` handed out, from its key as etcd's JSON
    has it (None: no ticket yet); StoreError when it is not a ticket counter."""
    if kv is None:
        return 0
    raw = kv_value(kv)
    if raw != MARK:
        raise StoreError(
            f"key {key!r} holds {raw[:40]!r}, not a ticket counter: every agent of a job "
            "must run the same relaunch (an older one counted with add), and a job on an "
            "etcd that keeps an older job's keys needs a --rdzv-id of its own"
        )
    return int(kv.get("version", 0))
