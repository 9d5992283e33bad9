"""One job, one program: a node that runs another entrypoint under the same job id is
refused (a stranger reusing ``--rdzv-id``), and the job's nodes say so.

``<prefix>program`` holds the first node's program and its fingerprint (versioned
JSON); a refused node adds a note at ``<prefix>refused/<n>`` (``n`` from the counter
``<prefix>refused/count``), which the job's nodes log once each.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable

from relaunch._json import loads as json_loads
from relaunch._text import printable
from relaunch.errors import RendezvousError
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.store import Store, peek
from relaunch.store.signed import is_signed

__all__ = ["RefusedLog", "claim_program", "log_refused"]

logger = logging.getLogger("relaunch.rendezvous.handler")


def claim_program(
    store: Store, prefix: str, node: str, program: str, settings: RendezvousSettings
) -> None:
    """Record ``program`` as the job's, or check it is the job's; RendezvousError (one
    line naming both programs) when it is another."""
    fingerprint = hashlib.sha256(program.encode()).hexdigest()[:16]
    mine = json.dumps({"version": 1, "fingerprint": fingerprint, "program": program})
    current, written = store.compare_set(prefix + "program", None, mine.encode())
    if written:
        return
    if is_signed(current):
        raise RendezvousError(
            f"job {settings.run_id!r} signs its records with a per-job secret and this node "
            "has none: give it the same --rdzv-conf secret_file as the other nodes"
        )
    try:
        theirs = json_loads(current)
        same = theirs.get("fingerprint") == fingerprint
        described = str(theirs.get("program"))[:300]
    except (ValueError, AttributeError, UnicodeDecodeError):
        same, described = False, f"a program this node cannot read ({current[:60]!r})"
    if same:
        return
    n = store.add(prefix + "refused/count", 1)
    note = json.dumps({"node": node, "program": program[:300]})
    store.set(f"{prefix}refused/{n}", note.encode())
    raise RendezvousError(
        f"this node runs {printable(program[:300])!r} but job {settings.run_id!r} runs "
        f"{printable(described)!r}: refused (another job with the same --rdzv-id?); "
        "heterogeneous roles: --rdzv-conf allow_mixed=1"
    )


def log_refused(store: Store, prefix: str, run_id: str, seen: int) -> int:
    """Log the refusals after the first ``seen``; return how many there are now."""
    raw = peek(store, prefix + "refused/count")  # a poll: the cheapest read the store has
    try:
        count = int(raw or b"0")
    except ValueError:
        return seen
    for n in range(seen + 1, count + 1):
        note = store.get(f"{prefix}refused/{n}")
        try:
            doc = json_loads(note or b"")
            who, what = str(doc["node"]), str(doc["program"])
        except (ValueError, KeyError, TypeError):
            who, what = "?", repr((note or b"")[:120])
        logger.warning(
            "rendezvous %s refused node %s: it runs %r, not this job's program",
            run_id, printable(who), printable(what),
        )  # fmt: skip
    return max(seen, count)


class RefusedLog:
    """Logs the job's refused nodes, looking once per ``every`` seconds (one small read)."""

    def __init__(self, store: Store, prefix: str, run_id: str, every: float,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self._store, self._prefix, self._run_id = store, prefix, run_id
        self._every, self._clock = every, clock
        self._seen, self._at = 0, -math.inf

    def __call__(self) -> None:
        now = self._clock()
        if now - self._at >= self._every:
            self._at = now
            self._seen = log_refused(self._store, self._prefix, self._run_id, self._seen)
