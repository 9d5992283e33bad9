"""The choice of a server's port outside the ephemeral range (``quiet_port``), for
ranges this machine does not have: read from a file standing in for the kernel's."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from relaunch import _endpoint
from relaunch._endpoint import quiet_port


def _range(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> None:
    fake = tmp_path / "ip_local_port_range"
    fake.write_text(text)
    monkeypatch.setattr(_endpoint, "_EPHEMERAL_RANGE", fake)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "low", "high"),
    [("32768\t60999\n", 32768, 60999), ("40000 65535", 40000, 65535), ("1024 60999", 1024, 60999)],
)
def test_a_port_and_its_spares_lie_outside_the_range_clear_of_node_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, low: int, high: int
) -> None:
    _range(monkeypatch, tmp_path, text)
    for _ in range(50):
        port = quiet_port("127.0.0.1", spare=2)
        for p in range(port, port + 3):
            assert not low <= p <= high, (p, text)
            assert not 30000 <= p <= 32767 and not 29400 <= p < 29600, p


@pytest.mark.timeout(30)
def test_the_spares_must_be_free_on_every_address(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A port whose next one another socket holds is passed over."""
    _range(monkeypatch, tmp_path, "32768 60999")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    held = holder.getsockname()[1]
    try:
        picks = iter([held - 1, held - 1, 20000])
        monkeypatch.setattr(_endpoint.random, "randrange", lambda a, b: next(picks))
        assert quiet_port("127.0.0.1", spare=1) == 20000
    finally:
        holder.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["1024 65535", "not a range", "60999 32768"])
def test_no_room_or_a_bad_file_falls_back_to_the_kernel_s_pick_or_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str
) -> None:
    _range(monkeypatch, tmp_path, text)
    port = quiet_port("127.0.0.1", spare=2)
    assert 0 < port <= 65535
    if text != "1024 65535":  # unreadable: Linux's default range is assumed
        assert not 32768 <= port <= 60999
