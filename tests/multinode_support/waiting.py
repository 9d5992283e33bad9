"""Waiting for a condition in tests: one helper, a deadline, a message that says what."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_for"]


def wait_for(
    predicate: Callable[[], bool],
    timeout: float = 60.0,
    *,
    what: str = "condition",
    interval: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll ``predicate`` every ``interval`` s until true; fail after ``timeout`` s naming
    ``what`` (and ``detail()``, e.g. the agents' output)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{extra}")
        time.sleep(interval)
