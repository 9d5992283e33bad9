"""Stores with NVIDIA's ``inprocess.store`` API: ``StoreMixin``, ``TCPStore``,
``FileStore``, ``PrefixStore``.

:class:`StoreMixin` adds to a torch ``Store`` what rank assignments and user code
written for NVIDIA's wrapper call: exchanging states and grouping keys between ranks
(``send_state``/``get_states``, ``send_key``/``get_keys``) and named barriers; it is
defined in the core (``_core/_exchange.py``), which exchanges states through it.
Unlike NVIDIA's, states and keys travel as versioned JSON, never pickle.

The wrapper's own coordination protocol lives in ``_core/_coord.py`` (the wrapper
accepts any of these classes, or any torch Store factory, as ``store_factory``).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from relaunch.inprocess._core._exchange import (
    BarrierError,
    BarrierOverflow,
    BarrierTimeout,
    StoreMixin,
    as_timedelta,
)

__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FileStore",
    "PrefixStore",
    "StoreMixin",
    "TCPStore",
]


class TCPStore(StoreMixin, dist.TCPStore):  # type: ignore[misc,name-defined]
    """torch's TCPStore with :class:`StoreMixin`; rank ``tcp_store_host_rank`` (0) hosts
    it, the others connect. Host, port and world size default to ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``WORLD_SIZE``."""

    TCP_STORE_HOST_RANK = 0

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        use_libuv: bool = True,
        tcp_store_host_rank: int | None = None,
    ) -> None:
        host_name = host_name if host_name is not None else os.environ["MASTER_ADDR"]
        port = port if port is not None else int(os.environ["MASTER_PORT"])
        world_size = world_size if world_size is not None else int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        self.tcp_store_host_rank = tcp_store_host_rank or self.TCP_STORE_HOST_RANK
        kwargs: dict[str, Any] = {
            "host_name": host_name,
            "port": port,
            "world_size": world_size,
            "timeout": as_timedelta(timeout),
            "wait_for_workers": wait_for_workers,
            "multi_tenant": multi_tenant,
            "use_libuv": use_libuv,
        }
        if rank == self.tcp_store_host_rank:
            try:
                super().__init__(is_master=True, **kwargs)
                return
            except Exception:  # another process hosts it: connect
                pass
        super().__init__(is_master=False, **kwargs)

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return () if self.tcp_store_host_rank == -1 else (self.tcp_store_host_rank,)


class PrefixStore(StoreMixin, dist.PrefixStore):  # type: ignore[misc,name-defined]
    """The keys of one restart iteration (``_inprocess_<iteration>/``) of ``store``."""

    def __init__(self, iteration: int, store: Any) -> None:
        self.base_store = store
        super().__init__(self.STORE_PREFIX.format(iteration=iteration), store)


class FileStore(StoreMixin, dist.FileStore):  # type: ignore[misc,name-defined]
    """torch's FileStore with :class:`StoreMixin`."""
