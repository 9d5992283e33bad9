"""Functional composition of callables (NVIDIA's ``inprocess.Compose``, same semantics).

``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the *last* instance runs first. A tuple
returned by one instance is unpacked into the next call; any other value is passed
as the single argument (to an instance that takes parameters). An instance that
returns None while it was given arguments breaks the chain: a warning says so.

The composed object is an instance of the lowest common ancestor of the instances'
classes, so ``Compose(HealthCheckA(), HealthCheckB())`` is a ``HealthCheck`` and is
accepted wherever one is.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from relaunch.errors import ConfigError

__all__ = ["Compose"]


def _common_ancestor(instances: tuple[Any, ...]) -> type:
    shared = set(type(instances[0]).mro())
    for instance in instances[1:]:
        shared &= set(type(instance).mro())
    return next(cls for cls in type(instances[0]).mro() if cls in shared)


def _takes_arguments(fn: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):  # a builtin without a signature
        return True


class Compose:
    """Chain callables: ``Compose(f, g)(*args)`` is ``f(*g(*args))`` (see the module)."""

    instances: tuple[Callable[..., Any], ...]

    def __new__(cls, *instances: Callable[..., Any]) -> Compose:
        if not instances:
            raise ConfigError("instances: expected at least one callable, got none")
        for index, instance in enumerate(instances):
            if not callable(instance):
                raise ConfigError(f"instances[{index}]: expected a callable, got {instance!r}")
        ancestor = _common_ancestor(instances)
        bases: tuple[type, ...] = (cls,) if issubclass(cls, ancestor) else (cls, ancestor)
        try:
            dynamic = type(cls.__name__, bases, {"__module__": cls.__module__})
        except TypeError:  # plain functions: their type cannot be a base
            dynamic = cls
        composed: Compose = object.__new__(dynamic)
        composed.instances = tuple(instances)
        return composed

    def __init__(self, *instances: Callable[..., Any]) -> None:
        pass  # set up in __new__ (the ancestor's __init__ must not run)

    def __call__(self, *args: Any) -> Any:
        ret: Any = None
        for instance in reversed(self.instances):
            ret = instance(*(args or ()))
            if ret is None and args and args != (None,):
                warnings.warn(
                    f"{type(self).__name__} didn't chain arguments after calling "
                    f"{instance!r} with {args!r}",
                    UserWarning,
                    stacklevel=2,
                )
            if not isinstance(ret, tuple) and _takes_arguments(instance):
                args = (ret,)
            else:
                args = ret if isinstance(ret, tuple) else ()
        return ret

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(i) for i in self.instances)})"
