"""Hosts for multi-node tests: network namespaces joined by veth pairs to a bridge.

Created and removed by the test (root, ``ip``); a test that cannot create them skips.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest

__all__ = ["Net", "network"]


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Net:
    """A bridge and ``n`` namespaces (``tag``: a short name prefix; ``octet``: the
    third octet of the 10.X.Y.0/24 subnet), each with a veth pair into the bridge."""

    def __init__(self, n: int, *, tag: str, octet: int) -> None:
        suffix = f"{os.getpid() % 100000}"
        self.subnet = f"10.{octet}.{os.getpid() % 250}"
        self.bridge = f"{tag}br{suffix}"
        self.spaces = [f"{tag}ns{suffix}_{i}" for i in range(n)]
        self.links = [f"{tag}v{suffix}{i}" for i in range(n)]
        self.created: list[tuple[str, str]] = []
        try:
            self._build()
        except BaseException:
            self.remove()
            raise

    def _build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        sh("ip", "link", "set", self.bridge, "up")
        for i, (ns, link) in enumerate(zip(self.spaces, self.links, strict=True)):
            sh("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            sh("ip", "link", "add", link, "type", "veth", "peer", "name", self.inner(i))
            self.created.append(("link", link))
            sh("ip", "link", "set", self.inner(i), "netns", ns)
            sh("ip", "link", "set", link, "master", self.bridge)
            sh("ip", "link", "set", link, "up")
            run = ("ip", "netns", "exec", ns)
            sh(*run, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", self.inner(i))
            sh(*run, "ip", "link", "set", self.inner(i), "up")
            sh(*run, "ip", "link", "set", "lo", "up")

    def inner(self, i: int) -> str:
        return f"{self.links[i]}p"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def cut(self, i: int) -> None:
        """Take node ``i`` off the network (its veth goes down)."""
        sh("ip", "link", "set", self.links[i], "down")

    def remove(self) -> None:
        for kind, name in reversed(self.created):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True, timeout=30)
        self.created.clear()


@contextlib.contextmanager
def network(n: int, *, tag: str, octet: int) -> Iterator[Net]:
    """``n`` namespaces for one test, removed after it; skips where they cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    probe = f"{tag}probe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {result.stderr.decode().strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    net = Net(n, tag=tag, octet=octet)
    try:
        yield net
    finally:
        net.remove()
