"""The corruption watch the agent's reads and its keep-alive thread share: each distinct
corruption is logged once, however many reads see it, and the state being valid again
is logged once after it."""

from __future__ import annotations

import logging

import pytest

from relaunch.errors import RendezvousStateError
from relaunch.rendezvous._corrupt import CorruptWatch

NOTICED = "this node goes on with the last valid state"
VALID = "the state is valid again"


def lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_each_corruption_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="relaunch.rendezvous.handler")
    watch = CorruptWatch("job", grace=60)
    watch.ok()  # valid from the start: nothing to say
    assert caplog.records == []
    since = watch.seen(RendezvousStateError("state 'k' is corrupt: one"))
    assert watch.seen(RendezvousStateError("state 'k' is corrupt: one")) == since
    assert lines(caplog, NOTICED) == 1
    # another corruption is said too, and counts from the first one
    assert watch.seen(RendezvousStateError("state 'k' is corrupt: two")) == since
    assert lines(caplog, NOTICED) == 2 and lines(caplog, VALID) == 0
    assert not watch.expired() and watch.error() is None
    watch.ok()
    watch.ok()
    assert lines(caplog, VALID) == 1
