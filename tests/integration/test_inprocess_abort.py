"""AbortTorchDistributed on a real gloo group of two processes.

A collective started *after* the abort (as a DDP backward still running in C++ does
when it enqueues its next bucket) must fail at once, not wait for the group's
timeout (120 s here). The abort expires the gloo backend's timeout for that: in the
race seen under load (~1 in 500 DDP restarts, `bench/inprocess_soak.py`) such an
allreduce otherwise waited in ``UnboundBuffer::waitSend``; the first test checks the
expired timeout directly.

A collective created before the abort whose send gloo posts after it must fail too:
with the sockets' write side shut down, such a send failed with EPIPE and gloo left
it queued, unfailed, for the group's timeout (1 abort in 6 of an allreduce loop hung
so). The second test aborts an allreduce loop at 16 moments.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from multinode_support.ports import free_port as _free_port

RANK = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from relaunch.inprocess import AbortTorchDistributed, State
from relaunch.inprocess._core import _sockets

rank = int(os.environ["RANK"])
_sockets.mark_baseline()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
group = dist.group.WORLD
dist.all_reduce(torch.ones(1))  # the pairs are connected and work
if rank == 1:
    sys.stdin.read()  # stays in the job, never joins another collective
    sys.exit(0)
AbortTorchDistributed()(State(rank=0, world_size=2, initial_rank=0, initial_world_size=2))
started = time.monotonic()
try:
    group.allreduce([torch.ones(1)]).wait()
    outcome = "returned"
except RuntimeError as exc:
    outcome = "failed"
timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
print(json.dumps({"outcome": outcome, "gloo_timeout": timeout}), flush=True)
# The aborted group is still referenced here; torch can abort the interpreter when it
# is torn down at exit (the wrapper releases it before: see inprocess/_core/_groups.py).
os._exit(0)
"""


@contextlib.contextmanager
def two_ranks(script: str, **env: str) -> Iterator[list[subprocess.Popen[str]]]:
    """Ranks 0 and 1 of a gloo job running ``script`` (``env`` added to theirs); killed
    if still running on the way out."""
    port = _free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in (0, 1):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", script],
                    env=dict(
                        os.environ,
                        RANK=str(rank),
                        WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1",
                        **env,
                    ),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.timeout(60)
def test_collective_started_after_abort_fails_at_once() -> None:
    with two_ranks(RANK) as procs:
        out, err = procs[0].communicate(timeout=45)
        assert procs[0].returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["outcome"] == "failed", result
        assert result["gloo_timeout"] <= 0.01, result  # was 120 s before the abort


LOOP = r"""
import datetime, os, threading
import torch, torch.distributed as dist
from relaunch.inprocess import AbortTorchDistributed, State
from relaunch.inprocess._core import _sockets

rank = int(os.environ["RANK"])
store = dist.TCPStore(
    "127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0,
    timeout=datetime.timedelta(seconds=60),
)
# The peer's collectives give up after 5 s: when the aborted rank's connection closes,
# a send the peer posts at that moment can wait in gloo for the whole timeout (_sockets).
timeout = datetime.timedelta(seconds=120 if rank == 0 else 5)
state = State(rank=0, world_size=2, initial_rank=0, initial_world_size=2)
for trial, ms in enumerate(os.environ["ABORT_AT_MS"].split(",")):
    _sockets.mark_baseline()  # the store's connection is older: spared
    prefixed = dist.PrefixStore(f"trial{trial}/", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=2, timeout=timeout)
    tensor = torch.ones(8)
    dist.all_reduce(tensor)
    aborter = threading.Timer(int(ms) / 1000, AbortTorchDistributed(), args=(state,))
    if rank == 0:
        aborter.start()
    try:
        while True:
            dist.all_reduce(tensor)
    except RuntimeError:
        print(ms, "failed", flush=True)
    aborter.cancel()
    if rank == 0:
        aborter.join()
        _sockets.release_held()  # as the wrapper's restart does
    dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.timeout(180)
def test_an_allreduce_loop_aborted_at_any_moment_fails() -> None:
    moments = random.Random(7).sample(range(20, 200), 16)  # ms after the first allreduce
    with two_ranks(LOOP, ABORT_AT_MS=",".join(map(str, moments))) as procs:
        expected = [w for ms in moments for w in (str(ms), "failed")]
        for rank, proc in enumerate(procs):  # the peer's loop fails too, by its timeout at worst
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise AssertionError(f"rank {rank}: an allreduce hung after: {out}") from None
            assert out.split() == expected, (rank, err[-3000:])
