"""``assert_never``: typing's own from Python 3.11 on; relaunch runs on 3.10 too."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["assert_never"]


def assert_never(value: NoReturn) -> NoReturn:
    """Mark a case that cannot happen: mypy fails where ``value`` may still be something
    (a match or an if-chain that misses a case); at run time, an AssertionError."""
    raise AssertionError(f"unhandled case: {value!r}")
