"""Endpoints (``host[:port]``): the one parser, and the default ports of the backends.

Used by the command line (which normalizes what the user typed) and by the rendezvous
backends (which connect to it); a leaf module, importing nothing of relaunch but errors.
"""

from __future__ import annotations

import re
import socket

from relaunch.errors import ConfigError

__all__ = [
    "C10D_PORT",
    "ETCD_PORT",
    "join_endpoint",
    "own_address",
    "split_endpoint",
]

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
    else:
        host = stripped  # a name, an IPv4 address, or a bare IPv6 address
    if port_text is None:
        if default_port is None:
            raise error
        port = default_port
    elif port_text.isdigit() and min_port <= int(port_text) <= 65535:
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
