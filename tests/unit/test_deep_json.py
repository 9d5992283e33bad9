"""A record nested too deeply for the JSON decoder (a few kilobytes of ``[``: corrupt,
or written to harm) is refused as any malformed record is, with the error its reader
names for one; before, ``json.loads`` raised RecursionError past every ``except
ValueError`` and ended the thread that read it (an agent's snapshot fetch, a
connection of its snapshot server, a worker's ``load()``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from relaunch._contract import read_exit_file, read_marker
from relaunch._json import loads
from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _wire as wire
from relaunch.checkpoint._peer_record import PeerRecord
from relaunch.errors import StatusError
from relaunch.inprocess import RestartError
from relaunch.inprocess._core._exchange import decode_state
from relaunch.rendezvous._lifeline import decode_address
from relaunch.status._report import decode_report
from relaunch.timer._request import parse_request

DEEP = b"[" * 3000 + b"]" * 3000


def test_a_document_nested_too_deeply_is_malformed_json() -> None:
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        loads(DEEP)


@pytest.mark.parametrize(
    ("read", "refusal"),
    [
        (lambda: layout.parse_manifest(DEEP, "snap/manifest.json"), layout.CorruptSnapshot),
        (lambda: wire.decode_listing(DEEP), wire.WireError),
        (lambda: PeerRecord.from_bytes(DEEP, "snapshots/peer/0"), wire.WireError),
        (lambda: decode_report(DEEP, key="status/node"), StatusError),
        (lambda: parse_request(DEEP), ValueError),
        (lambda: decode_state(DEEP, "inprocess/state"), RestartError),
        (lambda: decode_address(DEEP), ValueError),
    ],
    ids=[
        "manifest",
        "peer-listing",
        "peer-record",
        "status-report",
        "timer",
        "inprocess",
        "lifeline",
    ],
)
def test_each_reader_refuses_it_with_its_own_error(
    read: Callable[[], object], refusal: type[Exception]
) -> None:
    with pytest.raises(refusal):
        read()


def test_the_worker_files_read_by_path_are_taken_for_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "exit.json"
    path.write_bytes(DEEP)
    assert read_exit_file(str(path)) is None
    assert read_marker(str(path)) == (None, None)


def test_a_rank_of_a_peer_s_listing_is_an_ascii_number() -> None:
    listing = '{"v": 1, "ok": true, "version": 1, "ranks": {"\\u00b2": []}}'
    with pytest.raises(wire.WireError, match="expected a rank number"):
        wire.decode_listing(listing.encode())


def test_an_integer_too_long_to_convert_is_malformed_json() -> None:
    with pytest.raises(json.JSONDecodeError, match="4300 digits"):
        loads(b"1" * 5000)
    with pytest.raises(ValueError, match="not JSON"):  # (the lifeline's own refusal)
        decode_address(b'{"v": 1, "host": "a", "port": ' + b"1" * 5000 + b"}")
