"""The snapshot writer's copy and CRC-32 on several threads (``checkpoint._fill``): the
same bytes and the same CRC as one thread and ``zlib.crc32``."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from relaunch.checkpoint._fill import CHUNK, Filler, Part, crc32_combine, threads_for


def test_crc32_combine_is_the_crc_of_the_joined_bytes() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a = rng.randbytes(rng.randrange(0, 200))
        b = rng.randbytes(rng.randrange(0, 200))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 12345])
def test_the_crc_of_chunks_is_zlibs(threads: int, size: int) -> None:
    data = os.urandom(size)
    filler = Filler(threads)
    try:
        assert filler.crc32(memoryview(data)) == zlib.crc32(data)
    finally:
        filler.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_parts_land_at_their_offsets(threads: int) -> None:
    big = torch.randint(0, 256, (2 * CHUNK + 77,), dtype=torch.uint8)
    small = torch.arange(100, dtype=torch.uint8)
    target = torch.zeros(64 + len(big) + 200, dtype=torch.uint8)
    filler = Filler(threads)
    try:
        filler.copy(target, [Part(0, small), Part(128, big)])
    finally:
        filler.close()
    assert torch.equal(target[:100], small)
    assert int(target[100:128].count_nonzero()) == 0
    assert torch.equal(target[128 : 128 + len(big)], big)
    assert int(target[128 + len(big) :].count_nonzero()) == 0


def test_threads_share_the_cpus_among_the_node_s_ranks() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert threads_for({}) == max(1, min(8, cpus))
    assert threads_for({"LOCAL_WORLD_SIZE": str(cpus * 2)}) == 1
    assert threads_for({"LOCAL_WORLD_SIZE": "x"}) == max(1, min(8, cpus))


@pytest.mark.parametrize("threads", [1, 3])
def test_parts_copied_chunk_by_chunk_are_checksummed_with_the_rest(threads: int) -> None:
    first = torch.randint(0, 256, (CHUNK + 5,), dtype=torch.uint8)
    second = torch.randint(0, 256, (CHUNK // 2,), dtype=torch.uint8)
    target = torch.full((3 * CHUNK,), 7, dtype=torch.uint8)
    filler = Filler(threads)
    try:
        crc = filler.crc32(
            memoryview(target.numpy()), target, [Part(2 * CHUNK, second), Part(64, first)]
        )
    finally:
        filler.close()
    assert torch.equal(target[64 : 64 + len(first)], first)
    assert torch.equal(target[2 * CHUNK : 2 * CHUNK + len(second)], second)
    assert crc == zlib.crc32(target.numpy().tobytes())


class _Event:
    """A stand-in for a CUDA event: it records that it was waited for."""

    def __init__(self, waited: list[str], name: str) -> None:
        self.waited, self.name = waited, name

    def synchronize(self) -> None:
        self.waited.append(self.name)


def test_a_chunk_waits_for_the_events_of_the_cuda_bytes_it_holds_only() -> None:
    from relaunch.checkpoint._staging import Staged

    waited: list[str] = []
    a, b = _Event(waited, "a"), _Event(waited, "b")
    staged = Staged(leaves=[], buffer=None, copies=[])
    staged.ready = [(30, 40, b), (0, 10, a), (10, 20, a)]  # 20..30: CPU bytes
    staged.sort()
    staged.wait_for(20, 30)
    assert waited == []
    staged.wait_for(5, 15)
    assert waited == ["a"]  # once, though two of its ranges are in the chunk
    staged.wait_for(15, 35)
    assert waited == ["a", "a", "b"]


@pytest.mark.parametrize("threads", [1, 3])
def test_each_chunk_is_announced_before_it_is_touched(threads: int) -> None:
    data = bytearray(os.urandom(2 * CHUNK + 7))
    target = torch.frombuffer(data, dtype=torch.uint8)
    source = torch.arange(CHUNK + 3, dtype=torch.int64).remainder(251).to(torch.uint8)
    seen: list[tuple[int, int]] = []
    filler = Filler(threads)
    try:
        crc = filler.crc32(memoryview(data), target, [Part(CHUNK - 1, source)], before=lambda lo, hi: seen.append((lo, hi)))  # fmt: skip
    finally:
        filler.close()
    assert sorted(seen) == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 2 * CHUNK + 7)]
    assert bytes(data[CHUNK - 1 : 2 * CHUNK + 2]) == bytes(source.numpy())
    assert crc == zlib.crc32(data)


def test_only_tmpfs_is_offered_for_page_locking(tmp_path: Path) -> None:
    from relaunch.checkpoint._staging import page_lockable

    assert not page_lockable("/no/such/folder")
    if os.path.isdir("/dev/shm") and "tmpfs" in _fs_type("/dev/shm"):
        assert page_lockable("/dev/shm")
    assert page_lockable(str(tmp_path)) == ("tmpfs" in _fs_type(str(tmp_path)))


def _fs_type(path: str) -> str:
    """The file system type of ``path`` as /proc/self/mounts names it."""
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            mount, fstype = line.split()[1:3]
            inside = (
                os.path.realpath(path).startswith(mount.rstrip("/") + "/")
                or os.path.realpath(path) == mount
            )
            if inside and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def test_a_mapping_is_handed_to_its_hook_before_it_is_unmapped(tmp_path: Path) -> None:
    import mmap

    from relaunch.checkpoint._mapped import MappedFiles

    seen: list[bool] = []
    maps = MappedFiles(before_unmap=lambda m: seen.append(m.closed))
    path = os.path.join(str(tmp_path), "data")
    with open(path, "w+b") as f:
        f.truncate(mmap.PAGESIZE)
        first = maps.map(f, mmap.PAGESIZE, populate=False)
        assert maps.map(f, mmap.PAGESIZE) is first  # kept, by inode
        maps.forget(f)
    assert seen == [False] and first.closed
    maps.close()


def test_a_failed_task_returns_only_once_every_running_task_has_ended() -> None:
    # the tasks write into memory that the caller frees once the call raises
    import threading

    started: list[int] = []
    ended: list[int] = []
    release = threading.Event()

    def task(i: int) -> None:
        started.append(i)
        if i == 0:
            raise ValueError("the first chunk failed")
        release.wait(0.3)  # still running when the failure is seen
        ended.append(i)

    filler = Filler(3)
    try:
        with pytest.raises(ValueError, match="first chunk"):
            filler._map(task, range(6))
        # every task that started has ended (those not started never will)
        assert sorted(ended) == sorted(set(started) - {0}) and ended
    finally:
        release.set()
        filler.close()
