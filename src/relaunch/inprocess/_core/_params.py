"""Pass the active CallWrapper to the wrapped function's parameter that asks for it;
call the user's callbacks."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from relaunch.inprocess._core._exceptions import HealthCheckError
from relaunch.inprocess._core._logs import get_logger

__all__ = [
    "call_wrapper_parameter",
    "finalize_then_check",
    "initialize_then_check",
    "run_callbacks",
]

log = get_logger(__name__)


def _mentions(annotation: object, cls: type) -> bool:
    if annotation is cls:
        return True
    if isinstance(annotation, str):
        return cls.__name__ in annotation
    return any(_mentions(arg, cls) for arg in typing.get_args(annotation))


def call_wrapper_parameter(fn: Callable[..., Any], cls: type) -> str | None:
    """Name of the parameter annotated ``cls`` or ``cls | None`` (or named ``call_wrapper``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for name, param in signature.parameters.items():
        annotation = hints.get(name, param.annotation)
        if annotation is not inspect.Parameter.empty and _mentions(annotation, cls):
            return name
    if "call_wrapper" in signature.parameters:
        return "call_wrapper"
    return None


def run_callbacks(callbacks: Any, state: Any) -> None:
    """Call one callback, or each of a list in order, with the read-only ``state``
    (NVIDIA's convention: what they return is not used)."""
    if callbacks is None:
        return
    items = callbacks if isinstance(callbacks, list | tuple) else [callbacks]
    for callback in items:
        callback(state)


def initialize_then_check(initialize: Any, health_check: Any, state: Any, rank: int) -> None:
    """Before the function, in NVIDIA's order: ``initialize`` (a failure is a fault of
    the iteration), then the health check (a failure is a HealthCheckError)."""
    run_callbacks(initialize, state.freeze())
    try:
        run_callbacks(health_check, state.freeze())
    except Exception as exc:
        raise HealthCheckError(f"rank {rank}: {exc!r}") from exc


def finalize_then_check(
    finalize: Any, health_check: Any, state: Any, rank: int, record: Callable[[str], None]
) -> None:
    """After the abort, in NVIDIA's order: ``finalize`` (a failure ends the wrapper as
    is), then the health check (a failure is a HealthCheckError: only this rank
    leaves). ``record(message)`` marks this rank dead before either raises."""
    try:
        run_callbacks(finalize, state.freeze())
    except Exception as exc:
        log.error("rank %s: finalize failed: %r", rank, exc)
        record(f"finalize: {exc!r}")
        raise
    try:
        if health_check is not None:
            health_check(state.freeze())
    except Exception as exc:
        log.error("rank %s: health check failed: %r", rank, exc)
        record(f"unhealthy: {exc!r}")
        raise HealthCheckError(f"rank {rank}: {exc!r}") from exc
