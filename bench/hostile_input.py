"""What hostile input to the store costs in time: the figures the tests check only as
behaviour (tests/unit/test_state_fuzz.py, tests/integration/test_store_bounds.py,
tests/faults/test_corrupt_state.py).

    python bench/hostile_input.py [--runs 3] [--no-agents]

(a) The rendezvous state codec: 4,000 random, mutated and valid states decoded;
    seconds in all and microseconds per state.
(b) The rendezvous handler's reads of 300 such states (``num_nodes_waiting()`` and
    ``is_closed()``, each a fresh read through the cache and the corruption watch):
    median and slowest read.
(c) A torch client sends a 44 MB value to relaunch's TCP store server (refused: the
    client is dropped): the slowest call of another client meanwhile (one every
    10 ms), and how long the server then takes to close.
(d) Two real agents (c10d, one gloo worker each) after a 44 MB write over their
    rendezvous state: seconds from SIGTERM to both agents' exit, and their exit codes
    (a store stuck on such a value once took them 99-115 s).

Medians of ``--runs``. Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, in_loopback_netns, median

from relaunch.errors import RendezvousStateError
from relaunch.rendezvous import DynamicRendezvousHandler, RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, decode_state, encode_state
from relaunch.store.memory import MemoryStore
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

PY = sys.executable
NOW = 1.7e9
KEY = "relaunch/rdzv/job/state"
BIG = 44 * 1024 * 1024
WEIRD: list[Any] = [None, -1, 10**18, 1e308, "x", "", [], {}, True, {"a": "b"}, "é" * 50]

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    log = open(os.path.join(sys.argv[1], f"steps{os.environ['RANK']}"), "a", buffering=1)
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        log.write("step\\n")
        time.sleep(0.05)
    """
)


def states(seed: int, count: int) -> list[bytes]:
    """Valid states, mutated JSON, flipped bytes and random bytes, a quarter each."""
    rng = random.Random(seed)
    out: list[bytes] = []
    for i in range(count):
        nodes = [f"10.0.0.{n}_{1000 + n}_0" for n in range(rng.randint(0, 6))]
        state = RendezvousState(
            run_id="job",
            round=rng.randint(0, 5),
            complete=rng.random() < 0.5,
            participants={n: r for r, n in enumerate(nodes[:4])},
            redundancy_list=set(nodes[4:]),
            last_heartbeats={n: NOW - rng.random() for n in nodes},
        )
        raw = encode_state(state)
        kind = i % 4
        if kind == 0:
            doc = json.loads(raw)
            doc[rng.choice(sorted(doc))] = rng.choice(WEIRD)
            raw = json.dumps(doc).encode()
        elif kind == 1:
            flipped = bytearray(raw)
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            raw = bytes(flipped)
        elif kind == 2:
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        out.append(raw)
    return out


def codec(run: int) -> tuple[float, float]:
    """(seconds to decode 4,000 states, microseconds per state)."""
    blobs = states(run, 4000)
    t0 = time.perf_counter()
    for raw in blobs:
        with contextlib.suppress(RendezvousStateError):
            decode_state(raw, key=KEY, run_id="job", now=NOW, max_nodes=4)
    seconds = time.perf_counter() - t0
    return seconds, seconds / len(blobs) * 1e6


def handler_reads(run: int) -> tuple[float, float]:
    """(median, slowest) seconds of one handler read of a random state."""
    store = MemoryStore()
    settings = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=1)
    handler = DynamicRendezvousHandler(
        backend="c10d", store=store, settings=settings, clock=lambda: NOW
    )
    took: list[float] = []
    try:
        handler.next_rendezvous()
        for raw in states(run, 300):
            store.set(KEY, raw)
            store.set(f"relaunch/rdzv/job/epoch/{10**6}", b"1")  # every read a fresh one
            t0 = time.perf_counter()
            try:
                handler.num_nodes_waiting()
                handler.is_closed()
            except RendezvousStateError:
                pass
            took.append(time.perf_counter() - t0)
    finally:
        handler.shutdown()
    return median(took), max(took)


def big_value() -> tuple[float, float]:
    """(slowest call of a good client while a 44 MB value is refused, server close s)."""
    import torch.distributed as dist

    server = TCPStoreServer(host="127.0.0.1", port=0).start()
    closed = False
    try:
        good = TCPStoreClient("127.0.0.1", server.port, timeout=10)
        hostile = dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        stop = threading.Event()
        took: list[float] = []

        def poll() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                good.set("beat", b"1")
                took.append(time.perf_counter() - t0)
                time.sleep(0.01)

        poller = threading.Thread(target=poll, name="bench-good-client")
        poller.start()
        try:
            with contextlib.suppress(Exception):  # torch's error type varies
                hostile.set(KEY, b"x" * BIG)
                hostile.get(KEY)
            time.sleep(0.2)
        finally:
            stop.set()
            poller.join(30)
            good.close()
            del hostile
        t0 = time.perf_counter()
        server.close()
        closed = True
        return max(took), time.perf_counter() - t0
    finally:
        if not closed:
            server.close()


def agents_stop(tmp: Path) -> tuple[float, tuple[int, ...]]:
    """(seconds from SIGTERM to both agents' exit, their exit codes)."""
    import torch.distributed as dist

    out = Path(tempfile.mkdtemp(dir=tmp))
    script = out / "train.py"
    script.write_text(TRAIN)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(out)}
    procs = []
    for node in ("a", "b"):
        cmd = [PY, "-m", "relaunch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job", "--local-addr=127.0.0.1",
               "--monitor-interval=0.1", str(script), str(out)]  # fmt: skip
        with open(out / f"agent_{node}.out", "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    steps = [out / "steps0", out / "steps1"]

    def trained() -> int:
        return sum(len(p.read_text().splitlines()) for p in steps if p.exists())

    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in steps):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the job did not start; see {out}")
            time.sleep(0.1)
        hostile = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        with contextlib.suppress(Exception):  # the server drops that client
            hostile.set(KEY, b"[" + b"0," * (BIG // 2) + b"0]")
            hostile.get(KEY)
        del hostile
        before = trained()
        while trained() < before + 5:
            if time.monotonic() > deadline:
                raise RuntimeError(f"training did not go on after the 44 MB write; see {out}")
            time.sleep(0.05)
        t0 = time.perf_counter()
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        codes = tuple(proc.wait(300) for proc in procs)
        return time.perf_counter() - t0, codes
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-agents", action="store_true", help="skip (d)")
    args = parser.parse_args()
    in_loopback_netns()
    logging.getLogger("relaunch").setLevel(logging.ERROR)  # (b) warns per corrupt state
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the dropped client's stack
    decode = [codec(run) for run in range(args.runs)]
    reads = [handler_reads(run) for run in range(args.runs)]
    big = [big_value() for _ in range(args.runs)]
    print(f"medians of {args.runs} runs:")
    print(f"(a) decode 4,000 states: {median([d[0] for d in decode]):.3f} s, "
          f"{median([d[1] for d in decode]):.1f} us per state")  # fmt: skip
    print(f"(b) handler read of a random state: median {median([r[0] for r in reads]) * 1e3:.3f}"
          f" ms, slowest {median([r[1] for r in reads]) * 1e3:.3f} ms")  # fmt: skip
    print(f"(c) 44 MB value refused: another client's slowest call "
          f"{median([b[0] for b in big]) * 1e3:.1f} ms; server close "
          f"{median([b[1] for b in big]) * 1e3:.1f} ms")  # fmt: skip
    if args.no_agents:
        return
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        stops = [agents_stop(Path(tmp)) for _ in range(args.runs)]
    codes = sorted({c for _, cs in stops for c in cs})
    print(f"(d) 44 MB state write, then SIGTERM: both agents out in "
          f"{median([s[0] for s in stops]):.2f} s (runs: "
          f"{', '.join(f'{s[0]:.2f}' for s in stops)}); exit codes {codes}")  # fmt: skip


if __name__ == "__main__":
    main()
