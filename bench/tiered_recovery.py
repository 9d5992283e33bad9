"""Tiered recovery: SIGKILLed ranks replaced in-process vs torchrun's process restart.

    python bench/tiered_recovery.py --faults 5 --gap 1:5 [--load 2] [--seed 1]

The same 2x2 gloo job (two agents of two workers on this host, c10d on 127.0.0.1),
side by side in one run:

(a) ``relaunch --max-restarts 3`` with the training function wrapped by
    ``relaunch.inprocess.Wrapper``: a SIGKILLed rank's agent forks a replacement that
    joins its peers' next iteration; the peers restart in their own processes and the
    replacement takes the model, optimizer state and step from a survivor
    (``inprocess.broadcast_state``);
(b) ``torchrun --max-restarts N``: every worker restarts; the state kept in memory
    is lost (no checkpoint in this job: steps lost = the step the job was at).

From a seed, ``--faults`` SIGKILLs of a random rank, each ``--gap`` seconds after the
job recovered from the previous one, with ``--load`` busy processes beside the job.
Per fault: seconds from the SIGKILL to every rank having completed a step at full
size (world 4) in its new iteration or process; steps redone; healthy processes
restarted (pids of ranks that were not killed). Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import JsonLines, fmt, free_port, in_loopback_netns, median

PY = sys.executable
TRAIN = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    mode, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    MODEL = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    OPT = torch.optim.SGD(MODEL.parameters(), lr=0.001, momentum=0.9)
    HOLD = {"step": 0}
    SNAPSHOTS = os.environ.get("BENCH_SNAPSHOTS") == "1"
    if SNAPSHOTS:
        from relaunch import checkpoint
    log = open(os.path.join(out, f"{os.getpid()}.log"), "a", buffering=1)

    def body(cw):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        if cw is not None:
            state = {"model": MODEL.state_dict(), "opt": OPT.state_dict(), "step": HOLD["step"]}
            state = inprocess.broadcast_state(cw, state, version=HOLD["step"])
            MODEL.load_state_dict(state["model"]); OPT.load_state_dict(state["opt"])
            HOLD["step"] = state["step"]
        finish = os.path.join(out, "finish")
        while not os.path.exists(finish):
            loss = MODEL(torch.randn(64, 256)).pow(2).mean()
            OPT.zero_grad(); loss.backward()
            for p in MODEL.parameters():
                dist.all_reduce(p.grad); p.grad /= world
            if cw is not None:
                with cw.atomic():
                    OPT.step(); HOLD["step"] += 1
            else:
                OPT.step(); HOLD["step"] += 1
            if SNAPSHOTS:  # (bench/node_recovery.py --snapshots)
                checkpoint.save(HOLD["step"], {"model": MODEL.state_dict(), "opt": OPT.state_dict()})
            log.write(json.dumps({"t": time.time(), "rank": rank, "world": world,
                "step": HOLD["step"], "pid": os.getpid(),
                "it": cw.iteration if cw is not None else 0}) + "\\n")
            if cw is not None:
                cw.ping()
            time.sleep(0.01)
        dist.destroy_process_group()

    if mode == "inprocess":
        from relaunch import inprocess
        @inprocess.Wrapper(
            soft_timeout=datetime.timedelta(seconds=5),
            hard_timeout=datetime.timedelta(seconds=10),
            heartbeat_timeout=datetime.timedelta(seconds=30),
            barrier_timeout=datetime.timedelta(seconds=60),
        )
        def train(call_wrapper: inprocess.CallWrapper | None = None):
            body(call_wrapper)
        train()
    else:
        body(None)
    """
)


@dataclass
class Fault:
    rank: int
    full_size: float
    steps_lost: int
    healthy_restarted: int


def start(
    kind: str, out: Path, script: str, restarts: int, log_dir: str | None = None
) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    launcher = [PY, "-m", "relaunch"] if kind == "a" else [PY, "-m", "torch.distributed.run"]
    mode = "inprocess" if kind == "a" else "plain"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = []
    for node in (0, 1):
        cmd = [
            *launcher, "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=tiered{port}",
            f"--max-restarts={restarts}", "--monitor-interval=0.1",
        ]  # fmt: skip
        if log_dir is not None and kind == "a":
            cmd.append(f"--log-dir={os.path.join(log_dir, f'node{node}')}")
        cmd += [script, mode, str(out)]
        with (out / f"launcher{node}.txt").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    return procs


def stop(procs: list[subprocess.Popen[bytes]], out: Path) -> bool:
    """Ask the job to finish; return whether both launchers exited 0."""
    (out / "finish").write_text("")
    ok = True
    for proc in procs:
        try:
            ok = proc.wait(60) == 0 and ok
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            ok = False
    return ok


def wait_until(predicate: Any, timeout: float, what: str, out: Path) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            tails = "\n".join(
                p.read_text(errors="replace")[-2000:] for p in sorted(out.glob("launcher*.txt"))
            )
            raise RuntimeError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.02)


def again(
    rows: JsonLines, t0: float, before: dict[int, tuple[int, int]]
) -> dict[int, dict[str, Any]] | None:
    """Each rank's first step at full size after ``t0`` in a new process or iteration."""
    first: dict[int, dict[str, Any]] = {}
    for r in rows.poll():
        if r["t"] > t0 and r["world"] == 4 and (r["pid"], r["it"]) != before.get(r["rank"]):
            first.setdefault(r["rank"], r)
    return first if len(first) == 4 else None


def run(kind: str, args: argparse.Namespace, script: str) -> tuple[list[Fault], bool]:
    rng = random.Random(args.seed)
    lo, hi = (float(x) for x in args.gap.split(":"))
    faults: list[Fault] = []
    with tempfile.TemporaryDirectory(prefix="relaunch_tiered_") as tmp:
        out = Path(tmp)
        procs = start(kind, out, script, args.faults + 1, args.log_dir)
        rows = JsonLines(out)
        try:
            wait_until(
                lambda: {r["rank"] for r in rows.poll() if r["step"] >= 20} == {0, 1, 2, 3},
                180,
                "the job to train",
                out,
            )
            for _ in range(args.faults):
                time.sleep(rng.uniform(lo, hi))
                latest = {r["rank"]: r for r in rows.poll() if r["world"] == 4}
                victim = rng.randrange(4)
                before = {r: (x["pid"], x["it"]) for r, x in latest.items()}
                last_step = max(x["step"] for x in latest.values())
                pids_before = {x["pid"] for x in latest.values()}
                t0 = time.time()
                os.kill(latest[victim]["pid"], signal.SIGKILL)

                end = time.monotonic() + 180
                while (first := again(rows, t0, before)) is None:
                    if time.monotonic() > end:
                        raise RuntimeError(f"({kind}) not at full size again after 180 s")
                    time.sleep(0.02)
                full = max(r["t"] for r in first.values()) - t0
                lost = max(0, last_step + 1 - min(r["step"] for r in first.values()))
                survivors = pids_before - {latest[victim]["pid"]}
                restarted = len(survivors - {r["pid"] for r in first.values()})
                faults.append(Fault(victim, full, lost, restarted))
                print(
                    f"    ({kind}) SIGKILL rank {victim}: full size in {full:.2f} s, "
                    f"{lost} steps redone, {restarted} healthy processes restarted",
                    flush=True,
                )
        finally:
            ok = stop(procs, out)
    return faults, ok


def print_results(results: dict[str, tuple[list[Fault], bool]]) -> None:
    """Each case's figures, and the ratio of the medians (b/a) when both ran."""
    for kind, (faults, ok) in results.items():
        print(
            f"  ({kind}) full size again: {fmt([f.full_size for f in faults])}; steps "
            f"redone median {median([float(f.steps_lost) for f in faults]):.0f}, max "
            f"{max((f.steps_lost for f in faults), default=0)}; healthy processes "
            f"restarted {sum(f.healthy_restarted for f in faults)}; finished ok: {ok}"
        )
    if "a" in results and "b" in results and results["a"][0] and results["b"][0]:
        a = median([f.full_size for f in results["a"][0]])
        b = median([f.full_size for f in results["b"][0]])
        print(f"  ratio b/a (median full size again): {b / a:.1f}x")


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--gap", default="1:5", help="seconds between faults, MIN:MAX")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the job")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", default="ab")
    parser.add_argument("--log-dir", help="keep relaunch's logs (events, fork server) here")
    args = parser.parse_args()
    load = [
        subprocess.Popen([PY, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.load)
    ]
    try:
        with tempfile.TemporaryDirectory(prefix="relaunch_tiered_") as tmp:
            script = os.path.join(tmp, "train.py")
            Path(script).write_text(TRAIN)
            print(
                f"SIGKILL of a random rank, {args.faults} faults, gap {args.gap} s, "
                f"load {args.load}, seed {args.seed}"
            )
            print("  (a) relaunch, tiered (replacement joins in-process)")
            print("  (b) torchrun, process restart")
            results = {kind: run(kind, args, script) for kind in args.cases}
        print_results(results)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
