"""Ports a test may give to a server it starts later.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same
range every outgoing connection takes its source port from: between the test picking it
and the server binding it, any client on the machine (a worker's store connection, a
gloo pair) may take it as its source port, and the server's bind then fails. Picking
below the ephemeral range leaves only the (rare) chance that another test picked the same
port; CI saw the first kind fail a test (both agents of a job found the endpoint's port
taken by a connection, and neither could host the store).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_ports", "ipv6_loopback"]

_FALLBACK_LOW = 32768  # Linux's default start of the ephemeral range
_FLOOR = 10000


def _ephemeral_low() -> int:
    try:
        low, _high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low)
    except (OSError, ValueError):
        return _FALLBACK_LOW


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, below the ephemeral range."""
    high = _ephemeral_low()
    if high - _FLOOR < 1000:
        raise RuntimeError(f"the ephemeral port range starts at {high}: no room below it")
    found: list[int] = []
    for _ in range(200 * n):
        port = random.randrange(_FLOOR, high)
        if port in found:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"no {n} free ports on {host} between {_FLOOR} and {high}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the ephemeral range."""
    return free_ports(1, host)[0]


def ipv6_loopback() -> bool:
    """Whether this machine (this network namespace) has an IPv6 loopback to bind."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True
