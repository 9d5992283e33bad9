"""The public names of relaunch.rendezvous and relaunch.store, pinned; no torch on import."""

from __future__ import annotations

import subprocess
import sys

import relaunch.rendezvous
import relaunch.store


def test_rendezvous_exports() -> None:
    assert sorted(relaunch.rendezvous.__all__) == [
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
    for name in relaunch.rendezvous.__all__:
        assert getattr(relaunch.rendezvous, name) is not None


def _methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_a_small_handler_and_optional_capabilities() -> None:
    from relaunch.rendezvous import (
        DynamicRendezvousHandler,
        RendezvousHandler,
        SharedBoard,
        TieredMembership,
    )
    from relaunch.rendezvous.static import StandaloneRendezvousHandler, StaticRendezvousHandler

    assert len(_methods(RendezvousHandler)) == 11, _methods(RendezvousHandler)
    for capability in (TieredMembership, SharedBoard):
        for name in _methods(capability):  # the dynamic backends have every capability
            assert callable(getattr(DynamicRendezvousHandler, name)), name
        for static in (StaticRendezvousHandler, StandaloneRendezvousHandler):
            # no no-op stand-ins: a fixed set of nodes simply lacks the capability
            assert not _methods(capability) & _methods(static), (static, capability)


def test_store_exports() -> None:
    assert sorted(relaunch.store.__all__) == [
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


def test_import_does_not_pull_torch_or_etcd() -> None:
    code = (
        "import sys, relaunch.rendezvous, relaunch.store, relaunch.rendezvous.registry;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'etcd3gw', 'requests')];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_memory_store_is_a_store() -> None:
    from relaunch.store import MemoryStore, PrefixStore, Store

    store = MemoryStore()
    assert isinstance(store, Store)
    assert isinstance(PrefixStore(store, "p/"), Store)
    store.close()
