"""Reading the command line: the argparse layer, and each setting with its source (flag,
``PET_<FLAG>`` environment variable, default) and the flag to name in an error."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from relaunch._cli_options import OPTS
from relaunch.errors import ConfigError

__all__ = ["Parser", "Values", "build_parser"]

_T = TypeVar("_T")


class _Store(argparse.Action):
    """Store the value and remember which spelling was used (for error messages)."""

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: Any = None) -> None:
        setattr(ns, self.dest, self.const if self.nargs == 0 else values)
        ns.spelling[self.dest] = option_string


class Parser(argparse.ArgumentParser):
    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        """One line naming the flag as the user spelled it, instead of usage + error + exit."""
        match = re.match(r"argument ([^: ]+): (.*)", message)
        if match is None:
            raise ConfigError(message)
        flags = match[1].split("/")
        used = [f for f in flags if any(a == f or a.startswith(f + "=") for a in self.argv)]
        raise ConfigError(f"{(used or flags)[0]}: {match[2]}")


def build_parser() -> Parser:
    parser = Parser(prog="relaunch", description="Fault-tolerant drop-in for torchrun.")
    for dest, opt in OPTS.items():
        nargs = 0 if opt.switch else None
        const = True if opt.switch else None
        hint = f" [PET_{dest.upper()}]" if opt.env else ""
        parser.add_argument(
            *opt.flags(dest), dest=dest, action=_Store, nargs=nargs, const=const,
            help=opt.help + hint,
        )  # fmt: skip
    parser.add_argument("--no-warm-standby", "--no_warm_standby", dest="warm_standby",
                        action=_Store, nargs=0, const=False, help="Same as --start-method spawn.")  # fmt: skip
    parser.add_argument("training_script", nargs="?", help="Script, module or binary to run.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(**dict.fromkeys(OPTS))
    return parser


class Values:
    """Each setting with its source: flag > PET_<DEST> environment variable > fallback
    (e.g. Slurm's, :mod:`relaunch._cli_slurm`) > default."""

    def __init__(
        self,
        ns: argparse.Namespace,
        env: Mapping[str, str],
        fallback: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        """``fallback``: dest -> (value, source), used after the flag and the PET_
        variable, before the default (e.g. what Slurm's environment says)."""
        self._ns = ns
        self._env = env
        self._fallback = fallback or {}

    def with_fallback(self, fallback: Mapping[str, tuple[str, str]]) -> Values:
        """The same settings, with ``fallback`` between the environment and the default."""
        return Values(self._ns, self._env, {**self._fallback, **fallback})

    def label(self, dest: str) -> str:
        """The flag as the user spelled it, or its canonical spelling and the PET_ variable."""
        spelling: str | None = self._ns.spelling.get(dest)
        if spelling is not None:
            return spelling
        canonical = next(f for f in OPTS[dest].flags(dest) if f.startswith("--"))
        if self._env_value(dest) is not None:
            return f"{canonical} (from PET_{dest.upper()})"
        if dest in self._fallback:
            return f"{canonical} (from {self._fallback[dest][1]})"
        return canonical

    def _env_value(self, dest: str) -> str | None:
        if not OPTS[dest].env:
            return None
        return self._env.get(f"PET_{dest.upper()}") or None

    def given(self, dest: str) -> bool:
        return self.explicit(dest) or dest in self._fallback

    def explicit(self, dest: str) -> bool:
        """Given by a flag or a PET_ variable (not a fallback)."""
        return getattr(self._ns, dest) is not None or self._env_value(dest) is not None

    def stripped(self, dest: str) -> str:
        """The value, stripped; "" when there is none."""
        return (self.text(dest) or "").strip()

    def text(self, dest: str) -> str | None:
        value = getattr(self._ns, dest)
        if value is None:
            value = self._env_value(dest)
        if value is None and dest in self._fallback:
            value = self._fallback[dest][0]
        return OPTS[dest].default if value is None else str(value)

    def switch(self, dest: str, default: bool = False) -> bool:
        value = getattr(self._ns, dest)
        if value is not None:
            return bool(value)
        text = self._env_value(dest)
        if text is None:
            return default
        if not re.fullmatch(r"\s*\d+\s*", text):
            raise ConfigError(f"PET_{dest.upper()}: expected 0 or 1, got {text!r}")
        return int(text) != 0

    def fail(self, dest: str, expected: str, got: object = None) -> NoReturn:
        got = self.text(dest) if got is None else got
        raise ConfigError(f"{self.label(dest)}: expected {expected}, got {got!r}")

    def integer(self, dest: str, low: int, high: int | None = None) -> int:
        text = self.stripped(dest)
        ok = re.fullmatch(r"[+-]?\d+", text) is not None
        if not ok or int(text) < low or (high is not None and int(text) > high):
            self.fail(
                dest, f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
            )
        return int(text)

    def number(self, dest: str, *, positive: bool) -> float:
        text = self.stripped(dest)
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > 0 if positive else value >= 0) or value == float("inf"):
            self.fail(dest, "a finite number " + ("> 0" if positive else ">= 0"))
        return value

    def parsed(self, dest: str, parse: Callable[..., _T], *args: Any) -> _T:
        """Run a config parser, renaming the field in its error to the flag used."""
        return parse(self.text(dest) or "", *args, self.label(dest))
