"""Rendezvous: the agents of a job agree on who takes part in each round.

``create_handler(params)`` builds the handler of ``--rdzv-backend`` (``c10d``,
``etcd`` or ``static``); :class:`DynamicRendezvousHandler` is the elastic one
(state machine in :mod:`relaunch.rendezvous._ops`, a round's moves in
:mod:`relaunch.rendezvous._rounds`, state codec in
:mod:`relaunch.rendezvous._state`, store I/O in :mod:`relaunch.rendezvous._backend`).
"""

from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    ReplicatedStore,
    SharedBoard,
    TieredMembership,
)
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.rendezvous.registry import create_handler

__all__ = [
    "DynamicRendezvousHandler",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "ReplicatedStore",
    "SharedBoard",
    "TieredMembership",
    "create_handler",
]
