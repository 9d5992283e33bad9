"""The agent reaps the orphans reparented to it (it is a subreaper) after a group
stops, but never a child that one of its own Popens started: the etcd member's
keeper, the fork server or a standby that exited keeps its exit status for its owner."""

from __future__ import annotations

import subprocess
import time

import pytest

from relaunch._children import track, unreaped
from relaunch.procs._sys import process_state, reap_orphans

pytestmark = pytest.mark.timeout(30)


def _exited(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` has exited without reaping it (a zombie)."""
    deadline = time.monotonic() + 10
    while process_state(proc.pid) != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)


def test_a_tracked_child_keeps_its_exit_status_and_an_orphan_is_reaped() -> None:
    mine = track(subprocess.Popen(["sh", "-c", "exit 7"]))
    stray = subprocess.Popen(["sh", "-c", "exit 9"])  # stands for a reparented orphan
    _exited(mine)
    _exited(stray)
    assert mine.pid in unreaped()
    reap_orphans()
    assert process_state(stray.pid) is None  # reaped: its Popen can only guess now
    assert process_state(mine.pid) == "Z"
    assert mine.wait(timeout=5) == 7
    assert mine.pid not in unreaped()
    stray.wait(timeout=5)
