"""Parsers of the launch settings given as text (flags, ``--rdzv-conf``, endpoints), shared
by the command line and :class:`relaunch.config.LaunchConfig`. Each takes the ``name`` to
put in its error (a flag such as ``--nnodes`` or a field name) and raises ConfigError
naming what was wrong and what was expected."""

from __future__ import annotations

import re
import signal
from string import Template

from relaunch._endpoint import join_endpoint, split_endpoint
from relaunch.errors import ConfigError
from relaunch.procs import Std

__all__ = [
    "bad",
    "check_run_id",
    "check_template",
    "parse_bytes",
    "parse_endpoint",
    "parse_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
    "parse_std",
    "signal_number",
]

_UNHANDLEABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})
_RUN_ID_RE = re.compile(r"[\w.:-]+")
_PREFIX_KEYS = {"role_name": "role", "rank": 0, "local_rank": 0}


def bad(name: str, expected: str, got: object) -> ConfigError:
    return ConfigError(f"{name}: expected {expected}, got {got!r}")


_BYTES_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str, name: str = "--snapshot-limit") -> int:
    """A size such as ``8G``, ``512MiB`` or ``1000000`` (binary units), > 0."""
    match = _BYTES_RE.fullmatch(text.strip())
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()]) if match else 0
    if size <= 0:
        raise bad(name, "a size in bytes, e.g. 8G, 512M or 1000000", text)
    return size


def parse_nnodes(text: str, name: str = "--nnodes") -> tuple[int, int]:
    """``"N"`` -> ``(N, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)``, with ``1 <= MIN <= MAX``."""
    expected = "N or MIN:MAX with 1 <= MIN <= MAX"
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if match is None:
        raise bad(name, expected, text)
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if not 1 <= low <= high:
        raise bad(name, expected, text)
    return low, high


def parse_rdzv_conf(text: str, name: str = "--rdzv-conf") -> dict[str, str]:
    """``"k1=v1,k2=v2"`` -> ``{"k1": "v1", "k2": "v2"}``; empty text -> ``{}``.

    Every key needs a non-empty value (as in torch); keys and values are stripped.
    """
    result: dict[str, str] = {}
    if not text.strip():
        return result
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not key.strip() or not sep or not value.strip():
            raise bad(name, "KEY=VALUE,... with a non-empty key and value in each item", text)
        result[key.strip()] = value.strip()
    return result


def signal_number(item: str) -> int | None:
    item = item.strip().upper()
    if item.isdigit():
        number = int(item)
    elif item.startswith("SIG") and item in signal.Signals.__members__:
        number = int(signal.Signals[item])
    else:
        return None
    if number not in signal.valid_signals() or number in _UNHANDLEABLE:
        return None
    return number


def parse_signals(text: str, name: str = "--signals-to-handle") -> tuple[int, ...]:
    """``"SIGTERM,SIGINT"`` (names or numbers) -> signal numbers, duplicates dropped.

    SIGKILL and SIGSTOP cannot be handled and are refused.
    """
    result: list[int] = []
    for item in text.split(","):
        number = signal_number(item)
        if number is None:
            raise bad(
                name,
                "a comma-separated list of signal names that can be handled "
                "(e.g. SIGTERM,SIGINT,SIGUSR1)",
                text,
            )
        if number not in result:
            result.append(number)
    return tuple(result)


def parse_endpoint(text: str, default_port: int | None, name: str = "--rdzv-endpoint") -> str:
    """Validate ``host[:port]`` and return ``host:port`` (IPv6 hosts in brackets).

    ``default_port=None`` makes the port mandatory.
    """
    return join_endpoint(*split_endpoint(text, default_port, name=name))


def check_run_id(run_id: str, name: str = "--rdzv-id") -> str:
    """A job id: letters, digits and ``_.:-`` (it names store keys and log directories)."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id) or set(run_id) == {"."}:
        raise bad(name, "a job id of letters, digits and _.:- (no path separators)", run_id)
    return run_id


def check_template(template: str, name: str = "--log-line-prefix-template") -> str:
    """Check a console prefix template: only ``${role_name}``, ``${rank}``, ``${local_rank}``."""
    expected = "a template using only ${role_name}, ${rank}, ${local_rank}"
    try:
        Template(template).substitute(_PREFIX_KEYS)
    except (KeyError, ValueError, TypeError, AttributeError):
        raise bad(name, expected, template) from None
    return template


def parse_std(text: str, name: str = "std") -> Std | dict[int, Std]:
    """``"3"`` (every local rank) or ``"0:1,1:2"`` (local rank -> value), like torch.

    Raises ConfigError naming ``name`` when ``text`` is neither.
    """
    expected = "0-3 or LOCAL_RANK:0-3,... (e.g. 0:1,1:2)"
    text = text.strip()
    if re.fullmatch(r"[0-3]", text):
        return Std(int(text))
    if not re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
        raise bad(name, expected, text)
    result: dict[int, Std] = {}
    for item in text.split(","):
        rank, value = item.split(":")
        if int(rank) in result:
            raise bad(name, f"{expected} with each local rank once", text)
        result[int(rank)] = Std(int(value))
    return result
