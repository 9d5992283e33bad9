"""A torch-compatible TCP key-value store, in pure Python (no torch import).

:class:`TCPStoreServer` speaks torch's TCPStore wire protocol (torch 2.13), so
workers' ``torch.distributed.TCPStore(..., is_master=False)`` clients (and
``init_process_group(init_method="env://")`` with
``TORCHELASTIC_USE_AGENT_STORE=True``) can use the store the agent hosts.
:class:`TCPStoreClient` is the agent-side client; it implements
:class:`relaunch.store.Store` and works against either server.

Example::

    with TCPStoreServer(host="0.0.0.0", port=29500) as server:
        store = TCPStoreClient("127.0.0.1", server.port, prefix="rdzv")
        store.set("k", b"v")
"""

from __future__ import annotations

from relaunch.store._tcp_client import TCPStoreClient
from relaunch.store._tcp_server import TCPStoreServer

__all__ = ["TCPStoreClient", "TCPStoreServer"]
