"""A node without workers yet gets ready to replace one (the fork server of a spare).

A spare waits in the rendezvous with no worker to learn imports from. As soon as it
waits beside a running round (the rendezvous calls back), its fork server starts
anyway, preloading what the other nodes' workers import (each agent shares its workers' list through the
rendezvous store, :func:`share_modules`) or else a guess from the script. When the
spare then takes a lost node's place, its workers are forked in milliseconds with
everything imported, and join the running job at once.
"""

from __future__ import annotations

import logging

from relaunch.agent._forking import decode_modules, encode_modules
from relaunch.agent._workers import NodeWorkers
from relaunch.errors import StoreError
from relaunch.rendezvous import RendezvousHandler, RendezvousInfo, SharedBoard

__all__ = ["learn_modules", "next_round", "share_modules"]

log = logging.getLogger(__name__)


def next_round(
    handler: RendezvousHandler, workers: NodeWorkers | None, *, prewarm: bool
) -> RendezvousInfo:
    """The handler's next round; with ``prewarm`` (no worker ran on this node yet, and
    a fork server is wanted), the fork server starts while the node waits beside a
    running round. From the caller's thread: the server dies with the thread that
    started it."""
    if not prewarm or workers is None:
        return handler.next_rendezvous()

    def while_waiting() -> None:
        workers.prewarm(_shared_modules(handler) or [])

    return handler.next_rendezvous(while_waiting)


def learn_modules(handler: RendezvousHandler, workers: NodeWorkers) -> None:
    """Before this node's workers take a lost node's place: what the other nodes'
    workers import, so they import it before joining (a node that came after the loss
    had no time to prewarm; its workers would otherwise import torch's lazy modules at
    their first step, while the others wait for them in a collective)."""
    shared = _shared_modules(handler)
    if shared is not None:
        workers.learn_modules(shared)


def share_modules(handler: RendezvousHandler, workers: NodeWorkers) -> None:
    """Publish what this node's workers import, when that list grew. Never raises."""
    modules = workers.modules_to_share()
    if modules and isinstance(handler, SharedBoard):
        try:
            handler.publish_worker_modules(encode_modules(modules))
        except StoreError as exc:
            log.warning("could not share the workers' imports with spares: %s", exc)


def _shared_modules(handler: RendezvousHandler) -> list[str] | None:
    """What the other nodes' workers import; None when it cannot be read (no shared
    store, or the store failed)."""
    if not isinstance(handler, SharedBoard):
        return None
    try:
        return decode_modules(handler.worker_modules())
    except StoreError:
        return None
