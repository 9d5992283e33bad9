"""The per-job secret's store view (pure logic over a memory store) and the workers'
store admitting the round's addresses only (a real server, a second loopback address)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from relaunch.errors import ConfigError, RendezvousStateError
from relaunch.rendezvous._state import RendezvousState, decode_state, encode_state
from relaunch.store.memory import MemoryStore
from relaunch.store.signed import SignedStore, read_secret
from relaunch.store.tcp import TCPStoreServer

SECRET = b"0123456789abcdef-secret"


def test_values_round_trip_signed_and_tampering_is_refused() -> None:
    raw = MemoryStore()
    store = SignedStore(raw, SECRET)
    store.set("k", b"value")
    assert store.get("k") == b"value" and raw.get("k") != b"value"
    assert store.compare_set("k", b"value", b"new") == (b"new", True)
    assert store.compare_set("k", b"stale", b"x") == (b"new", False)
    assert store.multi_get(["k", "missing"]) == [b"new", None]
    raw.set("k", b"forged")
    with pytest.raises(RendezvousStateError, match="not signed"):
        store.get("k")
    other = SignedStore(raw, b"another secret of 16+ bytes")
    store.set("k", b"v")
    with pytest.raises(RendezvousStateError, match="does not verify"):
        other.get("k")
    assert store.add("n", 2) == 2  # counters pass through
    raw.close()


def test_a_node_without_the_secret_is_told_why() -> None:
    raw = MemoryStore()
    SignedStore(raw, SECRET).set("state", encode_state(RendezvousState(run_id="job")))
    blob = raw.get("state")
    assert blob is not None
    with pytest.raises(RendezvousStateError, match="per-job secret"):
        decode_state(blob, key="state", run_id="job")
    raw.close()


def test_secret_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="16 bytes"):
        (tmp_path / "s").write_text("short")
        read_secret(str(tmp_path / "s"))
    with pytest.raises(ConfigError, match="readable file"):
        read_secret(str(tmp_path / "missing"))


def test_the_workers_store_admits_the_rounds_addresses_only() -> None:
    other = "10.77.0.2"
    if subprocess.run(
        ["ip", "addr", "add", f"{other}/32", "dev", "lo"], capture_output=True
    ).returncode:
        pytest.skip("cannot add an address to lo (needs the test network namespace)")
    try:
        with TCPStoreServer(host="0.0.0.0", port=0, allowed=frozenset({"10.1.1.1"})) as server:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as ok:
                ok.settimeout(0.5)
                with pytest.raises(TimeoutError):
                    ok.recv(1)  # still open: loopback is admitted
            refused = socket.socket()
            refused.bind((other, 0))
            refused.settimeout(5)
            refused.connect((other, server.port))
            assert refused.recv(1) == b""  # closed at once
            refused.close()
    finally:
        subprocess.run(["ip", "addr", "del", f"{other}/32", "dev", "lo"], capture_output=True)
