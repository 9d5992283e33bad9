"""Rendezvous at scale: relaunch vs torch's DynamicRendezvousHandler, same TCP store.

N simulated nodes (threads, one store connection each) join one round with
``min_nodes = max_nodes = N`` through the same TCP store server: relaunch's
pure-Python server (the one agents host), in a process of its own, so it costs
both sides the same (``--server torch`` uses torch's C++ server instead). Prints, per N, the
seconds from "go" until every node has its rank, the store operations made,
and the ratio. Run by hand (not in CI)::

    python bench/rendezvous_scale.py                 # N = 8 64 256 1024
    python bench/rendezvous_scale.py 8 64 --torch-cap 120
    python bench/rendezvous_scale.py --lost-node     # time to notice a lost node

``--lost-node``: three node processes (c10d, default settings, ``--nnodes 2:3``)
complete a round; one is SIGKILLed; prints when the survivors noticed (their
``num_nodes_waiting()`` polled every 0.1 s, as an agent's monitor does) and
when both completed the next round.

torch runs are capped (``--torch-cap`` seconds, its join timeout): a capped run
prints "> cap". Both sides use a 5 s keep-alive interval (torch's fixed value),
so heartbeats cost both the same during the round.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.store.tcp import TCPStoreClient


class CountingStore:
    """A Store proxy counting the calls made through it."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner = inner
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counter[0] += 1
            return attr(*args, **kwargs)

        return call


def run_threads(n: int, work: Callable[[int], None], cap: float) -> tuple[float, int]:
    """Start ``n`` threads on a barrier; return (seconds until all finished, failures)."""
    go = threading.Barrier(n + 1)
    failures = [0]
    lock = threading.Lock()

    def body(i: int) -> None:
        go.wait()
        try:
            work(i)
        except Exception as exc:  # a capped torch run times out
            with lock:
                failures[0] += 1
            if failures[0] == 1:
                print(f"    node {i}: {type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=body, args=(i,), name=f"bench-node-{i}") for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(timeout=cap + 60)
    return time.perf_counter() - start, failures[0]


def bench_relaunch(n: int, port: int, run_id: str) -> tuple[float, int, int]:
    settings = RendezvousSettings(
        run_id=run_id,
        min_nodes=n,
        max_nodes=n,
        keep_alive_interval=5.0,
        keep_alive_max_attempt=3,
    )
    counter = [0]
    clients = [TCPStoreClient("127.0.0.1", port, timeout=120) for _ in range(n)]
    handlers = [
        DynamicRendezvousHandler(
            backend="c10d",
            store=CountingStore(client, counter),  # type: ignore[arg-type]
            settings=settings,
        )
        for client in clients
    ]
    ranks: list[int] = [-1] * n

    def work(i: int) -> None:
        ranks[i] = handlers[i].next_rendezvous().rank

    seconds, failures = run_threads(n, work, 600)
    ops = counter[0]
    assert failures or sorted(ranks) == list(range(n)), "ranks are not 0..N-1"
    closers = [
        threading.Thread(target=h.shutdown, name=f"bench-shutdown-{i}")
        for i, h in enumerate(handlers)
    ]
    for t in closers:
        t.start()
    for t in closers:
        t.join(timeout=120)
    return seconds, ops, failures


def bench_torch(n: int, port: int, run_id: str, cap: float) -> tuple[float, int, int]:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler as TorchHandler,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    counter = [0]
    lock = threading.Lock()

    class CountingBackend(C10dRendezvousBackend):
        def _call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
            with lock:
                counter[0] += 1
            return super()._call_store(store_op, *args, **kwargs)

    stores = [
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cap + 60))
        for _ in range(n)
    ]
    timeout = RendezvousTimeout(join=timedelta(seconds=cap))
    handlers = [
        TorchHandler.from_backend(
            run_id, store, CountingBackend(store, run_id), n, n, "127.0.0.1", timeout
        )
        for store in stores
    ]
    counter[0] = 0

    def work(i: int) -> None:
        handlers[i].next_rendezvous()

    seconds, failures = run_threads(n, work, cap)
    ops = counter[0]
    for h in handlers:
        h._stop_heartbeats()
    return seconds, ops, failures


LOST_NODE = """
import json, sys, time
from relaunch.rendezvous import RendezvousParameters, create_handler
params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id="lost",
                              min_nodes=2, max_nodes=3, conf={"is_host": sys.argv[2]})
handler = create_handler(params)
while True:
    info = handler.next_rendezvous()
    print(json.dumps({"t": time.time(), "round": info.round, "world": info.world_size}),
          flush=True)
    while handler.num_nodes_waiting() == 0:
        time.sleep(0.1)
    print(json.dumps({"t": time.time(), "noticed": True}), flush=True)
"""


def bench_lost_node() -> None:
    import json
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for i in range(3):  # the first one hosts the store; the victim is the last one
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", LOST_NODE, f"127.0.0.1:{port}", str(int(i == 0))],
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
        )
    try:
        for p in procs:
            assert p.stdout is not None
            json.loads(p.stdout.readline())
        victim = procs.pop()
        killed = time.time()
        victim.kill()
        victim.wait(timeout=10)
        noticed, again = [], []
        for p in procs:
            assert p.stdout is not None
            noticed.append(json.loads(p.stdout.readline())["t"] - killed)
            doc = json.loads(p.stdout.readline())
            again.append(doc["t"] - killed)
            assert doc["world"] == 2
        print(
            f"lost node noticed after {max(noticed):.2f} s (each: {noticed[0]:.2f}, "
            f"{noticed[1]:.2f}); survivors' round of 2 complete after {max(again):.2f} s"
        )
    finally:
        for p in reversed(procs):  # the store host last: survivors must not see it vanish
            p.kill()
            p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()


def _one(kind: str, n: int, port: int, cap: float) -> tuple[float, int, int] | None:
    """Run one measurement in a process of its own; None when it did not finish in time."""
    cmd = [sys.executable, __file__, "--one", kind, str(n), str(port), "--torch-cap", str(cap)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=cap + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        return None
    if proc.returncode != 0:
        return None
    seconds, ops, failures = out.split()[-3:]
    return float(seconds), int(ops), int(failures)


SERVER = """
import sys
from relaunch.store.tcp import TCPStoreServer
server = TCPStoreServer(host="127.0.0.1", port=0).start()
print(server.port, flush=True)
sys.stdin.read()
server.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[8, 64, 256, 1024])
    parser.add_argument("--torch-cap", type=float, default=120.0, help="seconds")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--server", choices=["relaunch", "torch"], default="relaunch")
    parser.add_argument("--lost-node", action="store_true")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "N", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(512 * 1024)
    if args.lost_node:
        bench_lost_node()
        return
    if args.one:
        kind, n, port = args.one[0], int(args.one[1]), int(args.one[2])
        if kind == "relaunch":
            result = bench_relaunch(n, port, f"relaunch-{n}")
        else:
            result = bench_torch(n, port, f"torch-{n}", args.torch_cap)
        print(*result, flush=True)
        os._exit(0)  # torch's capped handler threads may still be running
    server: Any = None
    proc: subprocess.Popen[bytes] | None = None
    if args.server == "torch":
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = server.port
    else:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
    print(f"TCP store ({args.server} server) on 127.0.0.1:{port}; each run in its own process")
    print(f"{'N':>6} {'relaunch s':>11} {'ops':>8} {'torch s':>10} {'ops':>8} {'ratio':>8}")
    try:
        for n in args.sizes:
            _row(n, port, args)
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()  # the server exits at the end of its input
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _row(n: int, port: int, args: argparse.Namespace) -> None:
    ours = _one("relaunch", n, port, 600.0)
    if ours is None:
        print(f"{n:>6} relaunch did not finish", flush=True)
        return
    line = f"{n:>6} {ours[0]:>11.3f} {ours[1]:>8}"
    if not args.no_torch:
        theirs = _one("torch", n, port, args.torch_cap)
        if theirs is None or theirs[2]:
            cap = args.torch_cap
            line += f" {'> ' + format(cap, '.0f'):>10} {'?':>8} {'> ' + format(cap / ours[0], '.0f'):>7}x"
        else:
            line += f" {theirs[0]:>10.3f} {theirs[1]:>8} {theirs[0] / ours[0]:>7.1f}x"
    print(line, flush=True)


if __name__ == "__main__":
    main()
