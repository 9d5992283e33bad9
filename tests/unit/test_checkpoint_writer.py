"""The snapshot writer's thread: one for many saves, gone when idle, not a forked
child's to wait for."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest

from multinode_support.waiting import wait_for
from relaunch.checkpoint import _writer
from relaunch.checkpoint._layout import Where
from relaunch.checkpoint._saver import Saver
from relaunch.checkpoint._writer import Writer


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "relaunch-snapshot-writer"]


def test_saves_in_a_row_are_written_by_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread started per save cost the training thread its start at every save
    (1.9 ms with every core busy): saves in a row share one."""
    import torch

    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    where = Where(root=str(tmp_path), job="j", rank=0, world_size=1, keep=2, limit=None,
                  durable=None)  # fmt: skip
    saver = Saver(where)
    try:
        for step in range(20):
            saver.save(step, {"w": torch.full((4,), float(step))})
        saver.wait()
        assert started.count("relaunch-snapshot-writer") == 1
        assert saver.read(19)["w"].tolist() == [19.0] * 4  # type: ignore[index]
    finally:
        saver.close()
    assert not _writers()


def test_jobs_run_one_at_a_time_and_the_idle_thread_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_writer, "IDLE", 0.2)
    writer = Writer()
    order: list[int] = []
    release = threading.Event()
    writer.submit(lambda: (release.wait(30), order.append(1)))
    assert writer.busy() and not writer.join(0.05)
    release.set()
    assert writer.join(30) and not writer.busy()
    writer.submit(lambda: order.append(2))
    assert writer.join(30)
    assert order == [1, 2]
    wait_for(lambda: not _writers(), 30)  # idle: gone, nothing to close
    writer.submit(lambda: order.append(3))  # a job after that starts another
    assert writer.join(30) and order == [1, 2, 3]
    writer.close()
    assert not _writers()


def test_a_forked_child_does_not_wait_for_its_parent_s_job() -> None:
    writer = Writer()
    release = threading.Event()
    writer.submit(lambda: release.wait(30))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
        if pid == 0:  # the child: the parent's job is not its own
            code = 1
            try:
                done = threading.Event()
                if not writer.busy() and writer.join(0):
                    writer.submit(done.set)
                    code = 0 if writer.join(10) and done.is_set() else 1
                writer.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert writer.busy()
    finally:
        release.set()
        writer.join(30)
        writer.close()


def test_a_job_that_raises_does_not_stop_the_next() -> None:
    writer = Writer()
    ran: list[int] = []

    def fails() -> None:
        raise RuntimeError("a job's own failure")

    writer.submit(fails)
    assert writer.join(30)
    writer.submit(lambda: ran.append(1))
    assert writer.join(30) and ran == [1]
    writer.close()
