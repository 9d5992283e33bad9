"""Parsers of the launch settings given as text (flags, ``--rdzv-conf``, endpoints), shared
by the command line and :class:`relaunch.config.LaunchConfig`. Each takes the ``name`` to
put in its error (a flag such as ``--nnodes`` or a field name) and raises ConfigError
naming what was wrong and what was expected."""

from __future__ import annotations

import re
import signal
from string import Template

from relaunch.errors import ConfigError

__all__ = [
    "bad",
    "check_run_id",
    "check_template",
    "parse_endpoint",
    "parse_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
    "signal_number",
]

_UNHANDLEABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})
_HOST_RE = re.compile(r"^[\w.:-]+$")
_RUN_ID_RE = re.compile(r"[\w.:-]+")
_PREFIX_KEYS = {"role_name": "role", "rank": 0, "local_rank": 0}


def bad(name: str, expected: str, got: object) -> ConfigError:
    return ConfigError(f"{name}: expected {expected}, got {got!r}")


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
    """Validate ``host[:port]`` and return ``host:port`` (IPv6 hosts stay in brackets).

    ``default_port=None`` makes the port mandatory.
    """
    expected = "HOST:PORT" if default_port is None else "HOST[:PORT]"
    expected += " with a port in 0..65535 (IPv6 in brackets: [::1]:PORT)"
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[: close + 1], text[close + 1 :]
        if close < 0 or (rest and not rest.startswith(":")):
            raise bad(name, expected, text)
        port_text = rest[1:] if rest else None
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    else:
        host, port_text = text, None
    if port_text is None and default_port is not None:
        port = default_port
    elif port_text and port_text.isdigit() and int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise bad(name, expected, text)
    if not _HOST_RE.match(host.removeprefix("[").removesuffix("]")):
        raise bad(name, expected, text)
    return f"{host}:{port}"


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
