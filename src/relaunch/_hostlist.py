"""Slurm host lists: ``node[01-03,07],gpu5`` -> ``node01 node02 node03 node07 gpu5``.

The syntax of ``SLURM_JOB_NODELIST`` / ``SLURM_STEP_NODELIST`` (what ``scontrol show
hostnames`` expands): items separated by commas outside brackets; in an item, each
bracket holds comma-separated numbers and ranges ``LO-HI``, zero-padded to the width of
``LO`` (``[08-10]`` -> 08 09 10); several brackets in one item multiply, the last one
varying fastest (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). A pure module: no I/O, no
environment.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from relaunch.errors import ConfigError

__all__ = ["count_hosts", "expand_hostlist", "first_host"]

_PART_RE = re.compile(r"\[([^\[\]]*)\]|([^\[\],]+)")
_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")


@dataclass(frozen=True)
class _Numbers:
    """The numbers of one bracket: ``(low, high, width)`` ranges, in order."""

    ranges: tuple[tuple[int, int, int], ...]

    def __iter__(self) -> Iterator[str]:
        for low, high, width in self.ranges:
            for number in range(low, high + 1):
                yield f"{number:0{width}d}"

    def __len__(self) -> int:
        return sum(high - low + 1 for low, high, _ in self.ranges)


_Part = tuple[str] | _Numbers
"""A literal piece of a host name (a 1-tuple) or a bracket."""


def _bad(text: str, name: str, why: str) -> ConfigError:
    return ConfigError(
        f"{name}: expected a Slurm host list like node[01-03,07],gpu5 ({why}), got {text!r}"
    )


def _split_items(text: str, name: str) -> list[str]:
    """The top-level comma-separated items (commas inside brackets belong to them)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise _bad(text, name, "unbalanced or nested brackets")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise _bad(text, name, "unbalanced brackets")
    items.append(text[start:])
    return items


def _bracket(body: str, text: str, name: str) -> _Numbers:
    ranges = []
    for piece in body.split(","):
        match = _RANGE_RE.fullmatch(piece)
        if match is None:
            raise _bad(text, name, f"[{body}] is not a list of numbers and LO-HI ranges")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise _bad(text, name, f"the range {piece} goes down")
        ranges.append((low, high, len(match[1])))
    return _Numbers(tuple(ranges))


def _parse(text: str, name: str) -> list[list[_Part]]:
    if not text.strip():
        raise _bad(text, name, "empty")
    if any(char.isspace() for char in text.strip()):
        raise _bad(text, name, "a space in it")
    items: list[list[_Part]] = []
    for item in _split_items(text.strip(), name):
        matches = list(_PART_RE.finditer(item))
        if not item or "".join(m[0] for m in matches) != item:
            raise _bad(text, name, f"the item {item!r}")
        items.append([(m[2],) if m[2] is not None else _bracket(m[1], text, name) for m in matches])
    return items


def _names(parts: list[_Part]) -> Iterator[str]:
    """The names of one item, the last bracket varying fastest; lazily (unlike
    ``itertools.product``, which holds every bracket's numbers)."""
    if not parts:
        yield ""
        return
    for head in parts[0]:
        for tail in _names(parts[1:]):
            yield head + tail


def expand_hostlist(text: str, name: str = "host list") -> Iterator[str]:
    """The host names of a Slurm host list, in order, generated lazily. Raises ConfigError
    naming ``name`` for a malformed list (before the first name is returned)."""
    items = _parse(text, name)
    return itertools.chain.from_iterable(_names(item) for item in items)


def first_host(text: str, name: str = "host list") -> str:
    """The first host of a Slurm host list (node 0 of a job step). Raises ConfigError."""
    return next(expand_hostlist(text, name))


def count_hosts(text: str, name: str = "host list") -> int:
    """How many hosts a Slurm host list names, without expanding it. Raises ConfigError."""
    return sum(math.prod(len(part) for part in item) for item in _parse(text, name))
