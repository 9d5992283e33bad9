"""Functional composition of the wrapper's callbacks."""

from __future__ import annotations

from typing import Any

from relaunch.errors import ConfigError

__all__ = ["Compose"]


class Compose:
    """Chain callbacks: ``Compose(f, g)(state, *rest)`` is ``f(g(state, *rest), *rest)``.

    As in function composition, the *last* instance runs first; the state each
    returns is passed to the next, the other arguments are passed to each unchanged.
    (A plain list given to :class:`~relaunch.inprocess.Wrapper` runs in list order.)
    """

    def __init__(self, *instances: Any) -> None:
        if not instances:
            raise ConfigError("instances: expected at least one callable, got none")
        for index, instance in enumerate(instances):
            if not callable(instance):
                raise ConfigError(f"instances[{index}]: expected a callable, got {instance!r}")
        self.instances = instances

    def __call__(self, state: Any, *rest: Any) -> Any:
        for instance in reversed(self.instances):
            state = instance(state, *rest)
        return state

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(i) for i in self.instances)})"
