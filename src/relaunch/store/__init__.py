"""Key-value stores behind one narrow protocol: memory, TCP (torch-compatible), etcd.

:class:`~relaunch.store.etcd.EtcdStore` imports its optional dependency
(``etcd3gw``, the ``relaunch[etcd]`` extra) only when one is created.
"""

from relaunch.store._protocol import (
    BatchStore,
    LeaseStore,
    PeekStore,
    ScanStore,
    Store,
    TicketStore,
    TurnStore,
    get_many,
    has_batches,
    has_leases,
    has_peek,
    has_scan,
    has_tickets,
    has_turns,
    peek,
    set_many,
    take_ticket,
    tickets_taken,
    together,
)
from relaunch.store.etcd import EtcdStore
from relaunch.store.memory import MemoryStore
from relaunch.store.prefix import LeasePrefixStore, PrefixStore
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

__all__ = [
    "BatchStore",
    "EtcdStore",
    "LeasePrefixStore",
    "LeaseStore",
    "MemoryStore",
    "PeekStore",
    "PrefixStore",
    "ScanStore",
    "Store",
    "TCPStoreClient",
    "TCPStoreServer",
    "TicketStore",
    "TurnStore",
    "get_many",
    "has_batches",
    "has_leases",
    "has_peek",
    "has_scan",
    "has_tickets",
    "has_turns",
    "peek",
    "set_many",
    "take_ticket",
    "tickets_taken",
    "together",
]
