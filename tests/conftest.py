"""Shared test fixtures: every test must leave no process, no thread and no snapshot
folder in /dev/shm behind."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from relaunch.procs._sys import descendants


def _live(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X"):
            alive.add(pid)
    return alive


@pytest.fixture(autouse=True, scope="session")
def _private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Launchers started by the tests make their temporary dirs here: a failed run keeps
    its run dir (the error files of the report), and it must not pile up in /tmp."""
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmpdir"))
    yield
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def _no_scheduler_environment() -> Iterator[None]:
    """The suite run inside a Slurm step or a Kubeflow pod (PET_*) must not see the
    scheduler's variables: the launchers the tests start would take them as settings.
    Tests that need them set them themselves."""
    saved = {
        key: value
        for key, value in os.environ.items()
        if key.startswith(("SLURM_", "PET_")) or key == "RELAUNCH_RDZV_SECRET_FILE"
    }
    for key in saved:
        del os.environ[key]
    yield
    os.environ.update(saved)


def _snapshot_dirs() -> set[str]:
    """The agents' default snapshot folders in node memory (relaunch.checkpoint)."""
    return set(glob.glob("/dev/shm/relaunch-*"))


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a child process or a new thread running."""
    me = os.getpid()
    before_procs = set(descendants(me))
    before_threads = set(threading.enumerate())
    before_shm = _snapshot_dirs()
    yield
    deadline = time.monotonic() + 10.0
    left: set[int] = set()
    while time.monotonic() < deadline:
        left = _live(set(descendants(me)) - before_procs)
        if not left:
            break
        time.sleep(0.1)
    for pid in left:  # do not let one leak poison the next tests
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    threads: list[threading.Thread] = []
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        threads = [t for t in threading.enumerate() if t not in before_threads and t.is_alive()]
        if not threads:
            break
        time.sleep(0.05)
    shm: set[str] = set()
    deadline = time.monotonic() + 10.0  # an etcd keeper cleans up after its agent is gone
    while time.monotonic() < deadline:
        shm = _snapshot_dirs() - before_shm
        if not shm:
            break
        time.sleep(0.1)
    for path in shm:  # do not let one leak poison the next tests
        shutil.rmtree(path, ignore_errors=True)
    assert not left, f"test left processes behind: {sorted(left)}"
    assert not threads, f"test left threads behind: {[t.name for t in threads]}"
    assert not shm, f"test left snapshot folders in /dev/shm: {sorted(shm)}"
