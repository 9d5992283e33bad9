"""Finalize: runs after an interruption, before the health check (NVIDIA's
``inprocess.finalize``). It gets the read-only state (``state.fn_exception`` is what
interrupted the iteration); an exception it raises ends the wrapper on this rank.
"""

from __future__ import annotations

import abc
import datetime
import os
import threading
from collections.abc import Callable
from typing import Any

from relaunch.inprocess.exception import TimeoutError

__all__ = ["Finalize", "ThreadedFinalize"]


class Finalize(abc.ABC):
    """Base class of ``finalize`` callbacks."""

    @abc.abstractmethod
    def __call__(self, state: Any) -> Any:
        """Release what the interrupted iteration held; return the state."""


class ThreadedFinalize(Finalize):
    """Run ``fn(*args, **kwargs)`` in a thread; raise ``TimeoutError`` when it does not
    finish within ``timeout`` (the thread is a daemon: it cannot block the exit).

    When CUDA is in use, the thread runs on this rank's device (``LOCAL_RANK``). Unlike
    NVIDIA's, it also runs where CUDA is absent (CPU jobs have things to finalize too).
    """

    def __init__(
        self,
        timeout: datetime.timedelta,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | None = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.timeout = timeout
        self.fn = fn
        self.args = tuple(args or ())
        self.kwargs = dict(kwargs or {})

    def __call__(self, state: Any) -> Any:
        device = _cuda_device()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                if device is not None:
                    import torch

                    torch.cuda.set_device(device)
                self.fn(*self.args, **self.kwargs)
            except BaseException as exc:  # reported in the calling thread
                failure.append(exc)

        thread = threading.Thread(
            target=run, name=f"{type(self).__name__}-{state.rank}", daemon=True
        )
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise TimeoutError(f"finalize {self.fn!r} did not finish within {self.timeout}")
        if failure:
            raise failure[0]
        return state


def _cuda_device() -> int | None:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return None
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) if local_rank is not None else int(torch.cuda.current_device())
