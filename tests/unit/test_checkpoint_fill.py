"""The snapshot writer's copy and CRC-32 on several threads (``checkpoint._fill``): the
same bytes and the same CRC as one thread and ``zlib.crc32``."""

from __future__ import annotations

import os
import random
import zlib

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
