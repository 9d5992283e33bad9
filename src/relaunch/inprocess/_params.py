"""Pass the active CallWrapper to the wrapped function's parameter that asks for it."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["call_wrapper_parameter", "run_callbacks"]


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
