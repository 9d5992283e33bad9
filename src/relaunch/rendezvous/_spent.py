"""Keys a node wrote for a round and no longer needs, deleted off the round's path.

A node's join writes ``req/<t>`` and ``ack/<t>`` (the request queue's), and a complete
round ``assign/<r>/<node>`` for each participant: three keys a node a round (about 250
bytes with real node ids) that nothing reads once the request is in the state and the
node has its place in a later round. Kept, they grew the store by ~4 MB a round at
16,384 nodes, round after round: in the TCP store's host's memory, and on etcd against
its 2 GB quota (compaction drops old revisions, not live keys). Each node forgets its
own: its keep-alive thread deletes them after its next beat, a few deletes a round and
none on the way from a fault back to training.

What stays: a dead node's last keys, and a leaving node's leave request's (it deletes
the others as its keep-alive thread stops, before it asks), a few per fault or leave; the
keys of a request its node gave up waiting for (interrupted, or a corrupt state); a key
written again after its node deleted it (an ack or a place written late by a slow
applier, an etcd put resent); and the ``epoch/<n>`` keys, one per write that woke the
waiting nodes, job-wide (a node behind by many epochs must still find the next one;
see :meth:`StateBackend.changed_since`). An applier working from a state older than
its compare-and-set's may find requests already deleted: it waits for them up to a
keep-alive interval (and may say they were never written) before its write fails, as
it would anyway.
"""

from __future__ import annotations

import collections
import logging

from relaunch.errors import StoreError
from relaunch.store import Store

__all__ = ["SpentKeys"]

logger = logging.getLogger(__name__)


class SpentKeys:
    """The keys this node is done with, deleted by :meth:`forget` (the keep-alive
    thread's, after a beat); :meth:`add` is called from the rendezvous caller's thread."""

    def __init__(self) -> None:
        self._keys: collections.deque[str] = collections.deque()  # append and pop: atomic

    def add(self, *keys: str) -> None:
        self._keys.extend(keys)

    def forget(self, store: Store) -> None:
        """Delete the keys added so far. A delete the store refuses (StoreError: the
        store is lost for now) puts its key back for the next try and ends this one,
        said at debug level only: the caller's next call to the store says it louder."""
        while True:
            try:
                key = self._keys.popleft()
            except IndexError:
                return
            try:
                store.delete(key)
            except StoreError as exc:
                self._keys.appendleft(key)
                logger.debug("spent rendezvous keys not deleted yet: %s", exc)
                return
            except BaseException:
                self._keys.appendleft(key)
                raise
