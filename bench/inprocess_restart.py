"""In-process restart vs process restart: fault -> every surviving rank trains again.

    python bench/inprocess_restart.py [--runs 3] [--faults exception,sigkill,hang]
                                      [--launcher-a relaunch] [--single-node]
                                      [--watchdog-runs 20] [--watchdog-pause 0.03]

The same 2x2 gloo DDP job (two agents of two workers each on this host, c10d
rendezvous) and the same fault, injected in rank 1 at step 20, recovered
(a) by ``relaunch.inprocess`` under the ``relaunch`` launcher (``--launcher-a
torchrun`` runs the wrapper under torchrun instead), and
(b) by torchrun's process restart (``--max-restarts 3``), in the same run.
Reported: seconds from the fault to the moment every surviving rank completed a
training step again (median of ``--runs``), and the ratio; then the wrapper's
overhead on a step loop without faults (one node of ``--overhead-workers``, the
2x2 job's step time varies too much between runs; ``--overhead-runs`` interleaved
pairs; the spread of the runs is the noise floor); then NVIDIA's standalone
``ProgressWatchdog`` (``--watchdog-runs``, in this process): after a pause of
``--watchdog-pause`` s, from ``resume()`` to the first fresh progress timestamp, and
the gap between the last timestamp before the pause and that one. Run by hand, not
in CI.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import JsonLines, fmt, in_loopback_netns, median

PY = sys.executable
LAUNCHERS = {
    "relaunch": [PY, "-m", "relaunch"],
    "torchrun": [PY, "-m", "torch.distributed.run"],
}

TRAIN = textwrap.dedent(
    """
    import datetime, json, os, signal, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    mode, fault, out, steps, pg_timeout, soft = sys.argv[1:7]
    steps, pg_timeout, soft = int(steps), float(pg_timeout), float(soft)
    rank0 = int(os.environ["RANK"]); attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    log = open(os.path.join(out, f"{rank0}.{os.getpid()}.log"), "a", buffering=1)
    def emit(kind, **kw):
        log.write(json.dumps({"kind": kind, "t": time.time(), "attempt": attempt, **kw}) + "\\n")
    def machinery_cpu(cw):
        # CPU seconds used by the wrapper's threads and monitor process so far
        import threading
        def cpu(path):
            fields = open(path).read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        total = sum(cpu(f"/proc/self/task/{t.native_id}/stat") for t in threading.enumerate()
                    if t.name.startswith("relaunch-inprocess"))
        if cw.monitor_process.pid:
            total += cpu(f"/proc/{cw.monitor_process.pid}/stat")
        return total
    def body(iteration, ping, cw=None):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        started = time.perf_counter()
        for step in range(steps):
            if fault != "none" and rank0 == 1 and attempt == 0 and iteration == 0 and step == 20:
                emit("fault")
                if fault == "exception":
                    raise RuntimeError("injected")
                if fault == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault == "hang":
                    time.sleep(3600)
            x = torch.randn(64, 256)
            loss = model(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if fault != "none":
                emit("step", step=step, iteration=iteration)
            ping()
        cpu = machinery_cpu(cw) if cw is not None else 0.0
        emit("loop", seconds=time.perf_counter() - started, steps=steps, machinery_cpu=cpu)
        del model, opt  # free DDP before its process group (a gloo teardown deadlock)
        dist.destroy_process_group()
    if mode == "inprocess":
        from relaunch import inprocess
        @inprocess.Wrapper(
            soft_timeout=datetime.timedelta(seconds=soft),
            hard_timeout=datetime.timedelta(seconds=2 * soft),
            heartbeat_timeout=datetime.timedelta(seconds=10),
            barrier_timeout=datetime.timedelta(seconds=max(60, 4 * soft)),
        )
        def train(call_wrapper: inprocess.CallWrapper | None = None):
            body(call_wrapper.iteration, call_wrapper.ping, call_wrapper)
        train()
    else:
        body(0, lambda: None)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(out: Path) -> JsonLines:
    """The ranks' records in ``<rank>.<pid>.log``, with the rank and pid of the file."""

    def annotate(path: Path, row: dict[str, Any]) -> dict[str, Any]:
        rank, pid = (int(x) for x in path.name.split(".")[:2])
        return {**row, "rank": rank, "pid": pid}

    return JsonLines(out, annotate)


def _trained_again(rows: list[dict[str, Any]], t0: float) -> dict[int, float]:
    """Per rank, the first step after the fault at ``t0`` by a recovered worker.

    Recovered: a later in-process iteration, or a process that started after the
    fault (under torchrun the node whose worker did not fail restarts its workers
    as a membership change: their restart count stays 0).
    """
    born: dict[int, float] = {}
    for r in rows:
        born[r["pid"]] = min(born.get(r["pid"], r["t"]), r["t"])
    firsts: dict[int, float] = {}
    for r in rows:
        t, rank = float(r["t"]), int(r["rank"])
        again = int(r.get("iteration", 0)) > 0 or born[r["pid"]] > t0
        if r["kind"] == "step" and t > t0 and again:
            firsts[rank] = min(firsts.get(rank, t), t)
    return firsts


def _start(
    launcher: str,
    args: argparse.Namespace,
    script: str,
    argv: list[str],
    out: Path,
    workers: int | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start the launcher(s); each one's stdout and stderr go to ``out/launcher<i>.txt``.

    ``workers``: one node of that many workers (else the topology of the options).
    """
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    if workers is not None:
        topo = [["--standalone", f"--nproc-per-node={workers}"]]
    elif args.single_node:
        topo = [["--standalone", "--nproc-per-node=4"]]
    else:
        port, rid = _free_port(), f"bench{time.monotonic_ns()}"
        common = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"]
        common += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rid}"]
        topo = [common, common]
    flags = ["--max-restarts=3", "--monitor-interval=0.1"]
    procs = []
    for i, t in enumerate(topo):
        with (out / f"launcher{i}.txt").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [*LAUNCHERS[launcher], *t, *flags, script, *argv],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def _tails(out: Path, lines: int = 15) -> str:
    """The last lines of each launcher's output (for a failed run)."""
    parts = []
    for path in sorted(out.glob("launcher*.txt")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def recovery(launcher: str, mode: str, fault: str, args: argparse.Namespace, script: str) -> float:
    """Seconds from the fault until every surviving rank completed a step after it."""
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        out = Path(tmp)
        argv = [mode, fault, str(out), "100000", str(args.pg_timeout), str(args.soft_timeout)]
        procs = _start(launcher, args, script, argv, out)
        try:
            deadline = time.monotonic() + args.pg_timeout * 3 + 180
            events = _events(out)
            survivors = 3 if fault == "sigkill" and mode == "inprocess" else 4
            while time.monotonic() < deadline:
                rows = events.poll()
                faults = [float(r["t"]) for r in rows if r["kind"] == "fault"]
                if faults:
                    firsts = _trained_again(rows, faults[0])
                    if len(firsts) >= survivors:
                        return max(sorted(firsts.values())[:survivors]) - faults[0]
                if all(p.poll() is not None for p in procs):
                    raise RuntimeError(
                        f"{launcher}/{mode}/{fault}: the job ended without recovering\n"
                        + _tails(out)
                    )
                time.sleep(0.05)
            raise RuntimeError(f"{launcher}/{mode}/{fault}: no recovery in time\n" + _tails(out))
        finally:
            _stop(procs)


def _loop_seconds_per_step(
    launcher: str, mode: str, args: argparse.Namespace, script: str
) -> tuple[float, float]:
    """One fault-free run: seconds per step of the training loop and the CPU share of
    the wrapper's machinery (CPU seconds per second of loop, per rank), medians over ranks."""
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        out = Path(tmp)
        argv = [mode, "none", str(out), str(args.overhead_steps), "60", "30"]
        procs = _start(launcher, args, script, argv, out, workers=args.overhead_workers)
        try:
            for proc in procs:
                proc.wait(600)
        finally:
            _stop(procs)
        loops = [r for r in _events(out).poll() if r["kind"] == "loop"]
        if not loops:
            raise RuntimeError(f"{launcher}/{mode}: no training loop finished\n" + _tails(out))
        per_step = median([float(r["seconds"]) / float(r["steps"]) for r in loops])
        share = median([float(r.get("machinery_cpu", 0.0)) / float(r["seconds"]) for r in loops])
        return per_step, share


def overhead(
    launcher: str, args: argparse.Namespace, script: str
) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per step without faults, plain and wrapped, over interleaved runs; and the
    wrapped runs' machinery CPU share."""
    result: dict[str, list[float]] = {"plain": [], "inprocess": []}
    shares: list[float] = []
    for _ in range(args.overhead_runs):
        for mode in result:
            per_step, share = _loop_seconds_per_step(launcher, mode, args, script)
            result[mode].append(per_step)
            if mode == "inprocess":
                shares.append(share)
    return result, shares


def watchdog_resume(runs: int, pause: float, interval: float) -> tuple[list[float], list[float]]:
    """NVIDIA's ProgressWatchdog paused for ``pause`` s, then resumed: seconds from
    ``resume()`` to the first fresh timestamp, and from the last timestamp before the
    pause to it (the pause, plus that delay), per run."""
    import datetime

    from relaunch.inprocess.progress_watchdog import ProgressWatchdog, Timestamp

    class Collect:
        def __init__(self) -> None:
            self.stamps: list[Timestamp] = []

        def send_timestamp(self, stamp: Timestamp) -> None:
            self.stamps.append(stamp)

    latency: list[float] = []
    gap: list[float] = []
    for _ in range(runs):
        collect = Collect()
        watchdog = ProgressWatchdog(0, collect, datetime.timedelta(seconds=interval))
        watchdog.start()
        try:
            while len(collect.stamps) < 5:
                time.sleep(interval)  # the main thread runs Python: the probes land
            watchdog.pause_and_synchronize()
            before = collect.stamps[-1]
            time.sleep(pause)
            resumed = time.monotonic()
            watchdog.resume()
            while not [s for s in collect.stamps if s.auto is not None and s.auto > resumed]:
                time.sleep(interval / 10)
        finally:
            watchdog.shutdown()
        fresh = next(s.auto for s in collect.stamps if s.auto is not None and s.auto > resumed)
        assert before.auto is not None
        latency.append(fresh - resumed)
        gap.append(fresh - before.auto)
    return latency, gap


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default="exception,sigkill,hang")
    parser.add_argument("--launcher-a", default="relaunch", choices=sorted(LAUNCHERS))
    parser.add_argument("--single-node", action="store_true", help="one agent of 4 workers")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="gloo timeout (s)")
    parser.add_argument("--soft-timeout", type=float, default=2.0, help="wrapper soft timeout (s)")
    parser.add_argument("--overhead-steps", type=int, default=5000, help="0: skip")
    parser.add_argument(
        "--overhead-workers", type=int, default=2, help="one node of N workers, for the overhead"
    )
    parser.add_argument("--overhead-runs", type=int, default=5, help="interleaved pairs")
    parser.add_argument("--cases", default="ab", help="which of (a) and (b) to run")
    parser.add_argument("--watchdog-runs", type=int, default=20, help="0: skip")
    parser.add_argument("--watchdog-pause", type=float, default=0.03, help="seconds")
    parser.add_argument("--watchdog-interval", type=float, default=0.001, help="seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        script = os.path.join(tmp, "train.py")
        Path(script).write_text(TRAIN)
        cases = {"a": (args.launcher_a, "inprocess"), "b": ("torchrun", "plain")}
        cases = {key: value for key, value in cases.items() if key in args.cases}
        print(f"fault -> every surviving rank trained a step again (median of {args.runs})")
        print(
            f"  (a) relaunch.inprocess under {args.launcher_a}, soft_timeout {args.soft_timeout} s"
        )
        print(f"  (b) torchrun process restart, gloo timeout {args.pg_timeout} s")
        for fault in [f for f in args.faults.split(",") if f]:
            times: dict[str, list[float]] = {key: [] for key in cases}
            for _ in range(args.runs):
                for key, (launcher, mode) in cases.items():  # interleaved
                    try:
                        times[key].append(recovery(launcher, mode, fault, args, script))
                    except RuntimeError as exc:
                        print(f"    {fault}: ({key}) failed: {exc}")
            for key in times:
                print(f"  {fault:9s} ({key}) {fmt(times[key])}")
            if times.get("a") and times.get("b"):
                print(f"  {'':9s} ratio b/a {median(times['b']) / median(times['a']):.1f}x")
        if args.watchdog_runs:
            latency, gap = watchdog_resume(
                args.watchdog_runs, args.watchdog_pause, args.watchdog_interval
            )
            print(
                f"ProgressWatchdog, interval {args.watchdog_interval * 1e3:g} ms, paused "
                f"{args.watchdog_pause * 1e3:g} ms, median of {args.watchdog_runs}:"
            )
            print(
                f"  resume -> first fresh timestamp {median(latency) * 1e3:.2f} ms "
                f"(max {max(latency) * 1e3:.2f}); last timestamp before the pause -> it "
                f"{median(gap) * 1e3:.2f} ms (min {min(gap) * 1e3:.2f})"
            )
        if not args.overhead_steps:
            return
        per_step, shares = overhead(args.launcher_a, args, script)
        plain, wrapped = median(per_step["plain"]), median(per_step["inprocess"])
        print(
            f"overhead, {args.overhead_workers} workers on one node, {args.overhead_steps} "
            f"steps, {args.overhead_runs} interleaved runs each:"
        )
        for mode, label in (("plain", "plain  "), ("inprocess", "wrapped")):
            runs = ", ".join(f"{x * 1e3:.2f}" for x in per_step[mode])
            print(f"  {label} median {median(per_step[mode]) * 1e3:.3f} ms/step  (runs: {runs})")
        print(f"  wrapped/plain {(wrapped / plain - 1) * 100:+.2f} %")
        runs = ", ".join(f"{x * 100:.2f}" for x in shares)
        print(
            f"  wrapper machinery (its threads + monitor process), CPU per rank: "
            f"median {median(shares) * 100:.2f} % of a core  (runs: {runs})"
        )


if __name__ == "__main__":
    main()
