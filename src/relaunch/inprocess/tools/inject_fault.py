"""Fault injection for testing a job's fault tolerance (NVIDIA's
``inprocess.tools.inject_fault``, same names, arguments and random draws).

Every rank calls :func:`inject_fault` with the same ``seed`` (typically a base seed
plus the wrapper's iteration); the ranks agree, without talking, on how many ranks
fail, which (never one of the first ``keep_alive`` ranks, e.g. rank 0 hosting the
store) and with which fault. On a chosen rank the fault happens ``delay`` seconds
later, from a daemon thread of this process (NVIDIA's forks a process to send a
signal: a thread cannot outlive the rank and signal a recycled pid).

``callback`` runs just before the fault. :data:`Fault` also answers to the names of
NVIDIA's earlier releases (``KILL`` is ``SIGKILL``, ``GPU`` is ``GPU_ERROR``, ...).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess.monitor_thread import async_raise

__all__ = [
    "CustomFault",
    "Fault",
    "InjectedException",
    "clear_workload_exception",
    "dispatch_fault_injection",
    "inject_fault",
    "maybe_raise_workload_exception",
    "register_fault",
]

log = get_logger(__name__)


class Fault(enum.Enum):
    GPU_ERROR = 1
    GPU_SLEEP = 2
    WORKLOAD_EXC = 3
    ASYNC_EXC = 4
    SIGNAL_EXC = 5
    OS_ABORT = 6
    LOCK_GIL = 7
    SEGFAULT = 8
    SIGINT = 9
    SIGKILL = 10
    SIGTERM = 11
    SIGSTOP = 12
    # the names of NVIDIA's earlier releases (aliases of the members above)
    GPU = 1
    ABORT = 6
    GIL = 7
    INT = 9
    KILL = 10
    TERM = 11
    STOP = 12


@dataclasses.dataclass(frozen=True)
class CustomFault:
    """A fault registered by name with :func:`register_fault`."""

    name: str


class InjectedException(Exception):
    """Raised in the training code by ``ASYNC_EXC``, ``SIGNAL_EXC`` and
    ``WORKLOAD_EXC``."""


Handler = Callable[[float, Callable[[], Any] | None], Any]
_handlers: dict[Fault | CustomFault, Handler] = {}
_workload_raise = threading.Event()


def register_fault(fault: Fault | str, handler: Handler) -> Fault | CustomFault:
    """Register (or replace) what injecting ``fault`` does: ``handler(delay, callback)``
    must return at once (start a thread for anything delayed). A new name gives a
    :class:`CustomFault` to pass to :func:`inject_fault`."""
    if isinstance(fault, str):
        key: Fault | CustomFault = (
            Fault[fault] if fault in Fault.__members__ else CustomFault(fault)
        )
    elif isinstance(fault, Fault):
        key = fault
    else:
        raise TypeError(f"fault: expected a Fault or a name, got {fault!r}")
    _handlers[key] = handler
    return key


def dispatch_fault_injection(
    fault: Fault | CustomFault, delay: float, callback: Callable[[], Any] | None
) -> None:
    handler = _handlers.get(fault)
    if handler is None:
        raise RuntimeError(f"Unknown fault type: {fault}")
    handler(delay, callback)


def maybe_raise_workload_exception() -> None:
    """Called by the training code: raises :class:`InjectedException` once after a
    ``WORKLOAD_EXC`` fault fired."""
    if _workload_raise.is_set():
        _workload_raise.clear()
        raise InjectedException


def clear_workload_exception() -> None:
    """Forget a ``WORKLOAD_EXC`` fault that fired and was not raised yet."""
    _workload_raise.clear()


def _later(what: str, action: Callable[[], Any]) -> Handler:
    """A handler running ``action`` in a daemon thread after the delay."""

    def run(delay: float, callback: Callable[[], Any] | None) -> None:
        time.sleep(delay)
        log.critical("injecting fault: %s", what)
        if callback is not None:
            callback()
        action()

    def handler(delay: float, callback: Callable[[], Any] | None) -> None:
        name = f"relaunch-inject-{what.replace(' ', '-')}"
        threading.Thread(target=run, args=(delay, callback), name=name, daemon=True).start()

    return handler


def _gpu_error() -> None:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    index = torch.ones(1, dtype=torch.int64, device=device)
    torch.ones(1, dtype=torch.int64, device=device)[index] = 0  # device-side assert


def _gpu_sleep() -> None:
    import torch

    torch.cuda._sleep(1 << 62)  # type: ignore[no-untyped-call]


def _lock_gil() -> None:
    re.match(r"(a?){40}a{40}", "a" * 40)  # exponential backtracking, GIL held


def _raise_injected(signum: int, frame: FrameType | None) -> None:
    raise InjectedException


def _signal_exc(delay: float, callback: Callable[[], Any] | None) -> None:
    signal.signal(signal.SIGUSR1, _raise_injected)
    _later("SIGUSR1", lambda: os.kill(os.getpid(), signal.SIGUSR1))(delay, callback)


def _async_exc(delay: float, callback: Callable[[], Any] | None) -> None:
    main = threading.main_thread().ident
    assert main is not None
    _later("async exception", lambda: async_raise(main, InjectedException))(delay, callback)


def _send(sig: signal.Signals) -> Handler:
    return _later(sig.name, lambda: os.kill(os.getpid(), sig))


for _fault, _handler in {
    Fault.GPU_ERROR: _later("GPU error", _gpu_error),
    Fault.GPU_SLEEP: _later("GPU sleep", _gpu_sleep),
    Fault.WORKLOAD_EXC: _later("workload exception", _workload_raise.set),
    Fault.ASYNC_EXC: _async_exc,
    Fault.SIGNAL_EXC: _signal_exc,
    Fault.OS_ABORT: _later("abort", os.abort),
    Fault.LOCK_GIL: _later("GIL lock", _lock_gil),
    Fault.SEGFAULT: _later("segfault", lambda: ctypes.string_at(1)),
    Fault.SIGINT: _send(signal.SIGINT),
    Fault.SIGKILL: _send(signal.SIGKILL),
    Fault.SIGTERM: _send(signal.SIGTERM),
    Fault.SIGSTOP: _send(signal.SIGSTOP),
}.items():
    register_fault(_fault, _handler)


def inject_fault(
    faults: Sequence[Fault | CustomFault],
    num_faults: int | tuple[int, int],
    keep_alive: int,
    delay: float | tuple[float, float],
    seed: int,
    callback: Callable[[], Any] | None = None,
) -> None:
    """Inject one of ``faults`` into ``num_faults`` ranks (a number or a ``(min,
    max)`` range) chosen among ranks ``keep_alive`` and above (``RANK``,
    ``WORLD_SIZE`` from the environment), ``delay`` seconds (or uniform in a range)
    from now. All ranks must pass the same arguments."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    faults = list(faults)
    if not faults:
        raise ValueError("faults: expected at least one fault, got none")
    low, high = (num_faults, num_faults) if isinstance(num_faults, int) else num_faults
    if not 0 <= low <= high:
        raise ValueError(f"num_faults: expected 0 <= min <= max, got {num_faults!r}")
    draw = random.Random(seed)
    if not isinstance(delay, float | int):
        delay = draw.uniform(delay[0], delay[1])
    count = min(draw.randint(low, high), max(0, world_size - keep_alive))
    chosen = draw.sample(range(keep_alive, world_size), count)
    fault = draw.sample(faults, 1)[0]
    if rank in chosen:
        log.info(
            "seed=%s ranks=%s fault=%s delay=%.3f s", seed, sorted(chosen), fault, float(delay)
        )
        dispatch_fault_injection(fault, float(delay), callback)
