"""Endpoints (``host[:port]``): the one parser, the default ports of the backends, and
the choice of a port for a server this machine starts.

Used by the command line (which normalizes what the user typed) and by the rendezvous
backends (which connect to it); a leaf module, importing nothing of relaunch but errors.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import re
import socket
from pathlib import Path

from relaunch.errors import ConfigError

__all__ = [
    "C10D_PORT",
    "ETCD_PORT",
    "any_address",
    "is_ip",
    "join_endpoint",
    "own_address",
    "port_free",
    "quiet_port",
    "split_endpoint",
]

log = logging.getLogger(__name__)

C10D_PORT = 29400
"""The c10d rendezvous port when none is given (torchrun's)."""
ETCD_PORT = 2379
"""etcd's client port when none is given."""

_HOST_RE = re.compile(r"^[\w.:-]+$")


def split_endpoint(
    text: str, default_port: int | None, *, name: str = "--rdzv-endpoint", min_port: int = 0
) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 address (no port)
    -> ``(host, port)``, the host without brackets.

    ``default_port=None`` makes the port mandatory; ports below ``min_port`` are refused.
    Raises ConfigError naming ``name`` and what was expected.
    """
    expected = "HOST:PORT" if default_port is None else "HOST[:PORT]"
    expected += f" with a port in {min_port}..65535 (IPv6 in brackets: [::1]:PORT)"
    error = ConfigError(f"{name}: expected {expected}, got {text!r}")
    stripped = text.strip()
    port_text: str | None = None
    if stripped.startswith("["):
        host, sep, rest = stripped[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise error
        port_text = rest[1:] if rest else None
    elif stripped.count(":") == 1:
        host, _, port_text = stripped.partition(":")
    elif is_ip(stripped) or not is_ip(stripped.rpartition(":")[0]):
        host = stripped  # a name, an IPv4 address, or a bare IPv6 address
    else:  # an IPv6 address and a port, unbracketed (fe80::1:29500: no address itself)
        host, _, port_text = stripped.rpartition(":")
    if port_text is None:
        if default_port is None:
            raise error
        port = default_port
    elif port_text.isascii() and port_text.isdigit() and min_port <= int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise error
    if not host or not _HOST_RE.match(host):
        raise error
    return host, port


def join_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def family_of(address: str) -> socket.AddressFamily:
    """The socket family of an address literal: IPv6 when it holds a colon."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def own_address(toward: str, port: int) -> str:
    """This machine's address on the route to ``toward`` (no DNS, no packet sent)."""
    with socket.socket(family_of(toward), socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((toward, port))
        except OSError:
            return "127.0.0.1"
        return str(probe.getsockname()[0])


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_EPHEMERAL = (32768, 60999)  # Linux's default range
_QUIET_FLOOR = 10000  # below it, registered services crowd
_NODE_PORTS = 30000  # Kubernetes' NodePorts (30000-32767): traffic to them may be redirected
_ROOM = 1000  # the fewest ports a window below or above the range is used with
_TORCH_DEFAULTS = range(29400, 29600)  # torch's default ports, which scripts hard-code


def _ephemeral() -> tuple[int, int]:
    """This network namespace's ephemeral port range (Linux's default when unreadable)."""
    try:
        low, high = (int(word) for word in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL
    return (low, high) if 1 <= low <= high <= 65535 else _EPHEMERAL


def any_address(address: str) -> str:
    """The any-address of ``address``'s family (``::`` takes IPv4 too, as this project's
    servers bind it). A program's own server (a torch TCPStore) binds it as well, so a
    port is free for it only when free on every local address."""
    return "::" if ":" in address else "0.0.0.0"


def port_free(address: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``address`` now."""
    with socket.socket(family_of(address), socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def quiet_port(address: str, spare: int = 0, tries: int = 200) -> int:
    """A port free on every address of ``address``'s family now, with the ``spare`` ports
    after it free too, chosen outside the kernel's ephemeral range: below it (and below
    Kubernetes' NodePorts), else above it; the kernel's pick (``bind(0)``, said in the
    log) when neither has room or no such port is free.

    ``bind(0)`` hands out a port of the ephemeral range, the range every outgoing
    connection takes its source port from: between the choice and the server's bind, any
    connection on the machine (a worker's store client, a gloo pair) may take it, and so
    may it take ``MASTER_PORT + 1``, where programs written after NVIDIA's examples host
    their own store. Outside that range only another process's choice can collide.
    """
    low, high = _ephemeral()
    windows = [(_QUIET_FLOOR, min(low, _NODE_PORTS) - spare), (high + 1, 65536 - spare)]
    windows = [(a, b) for a, b in windows if b - a >= _ROOM]
    wildcard = any_address(address)
    for _ in range(tries if windows else 0):
        port = random.randrange(*windows[0])
        taken = (
            p in _TORCH_DEFAULTS or not port_free(wildcard, p)
            for p in range(port, port + spare + 1)
        )
        if not any(taken):
            return port
        windows = windows[1:] + windows[:1]  # the other window next, when there are two
    log.info(
        "no free port outside the ephemeral range %d-%d for a server on %s; the kernel's pick",
        low, high, address,
    )  # fmt: skip
    with socket.socket(family_of(address), socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def is_ip(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 address literal."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
