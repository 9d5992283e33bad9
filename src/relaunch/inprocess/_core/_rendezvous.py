"""A fresh ``env://`` rendezvous namespace for every restart iteration.

``init_process_group(backend)`` with ``env://`` under an agent store uses the prefix
``/worker/attempt_<restart count>``: the same in every in-process iteration, so the
keys of the previous iteration break the next rendezvous. While the wrapper runs,
``env://`` is served by this handler instead: the process group meets in the
coordination store under the iteration's own prefix, over a connection opened for
it (opened inside the iteration, so abort shuts it down if the rendezvous hangs).
``RANK`` and ``WORLD_SIZE`` (set per iteration) or the URL's query give the ranks.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

__all__ = ["EnvRendezvousPatch"]


def _handlers() -> dict[str, Any]:
    module = importlib.import_module("torch.distributed.rendezvous")
    handlers: dict[str, Any] = module._rendezvous_handlers
    return handlers


class EnvRendezvousPatch:
    """Replace torch's ``env://`` handler while installed; restore it after."""

    def __init__(self, store_factory: Callable[[], Any], prefix: Callable[[], str]) -> None:
        self.store_factory = store_factory
        self.prefix = prefix
        self._saved: Any = None
        self._installed = False

    def _handler(self, url: str, timeout: timedelta | None = None, **kwargs: Any) -> Iterator[Any]:
        from torch._C._distributed_c10d import PrefixStore

        query = dict(parse_qsl(urlparse(url).query))
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
        if rank < 0 or world_size < 1:
            raise ValueError("env:// rendezvous: RANK and WORLD_SIZE must be set")
        client = self.store_factory()
        if timeout is not None:
            client.set_timeout(timeout)
        yield (PrefixStore(self.prefix(), client), rank, world_size)
        raise RuntimeError("env:// rendezvous under relaunch.inprocess cannot re-rendezvous")

    def install(self) -> None:
        handlers = _handlers()
        self._saved = handlers.get("env")
        handlers["env"] = self._handler
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        handlers = _handlers()
        if self._saved is not None:
            handlers["env"] = self._saved
        else:
            handlers.pop("env", None)
        self._installed = False
