"""Soak: many consecutive in-process restarts of a DDP job, under the relaunch launcher.

    python bench/inprocess_soak.py [--ranks 3] [--restarts 40] [--runs 3] [--load 1]

One node, ``--ranks`` gloo DDP workers wrapped by ``relaunch.inprocess``; rank 1
raises at step 5 of each of the first ``--restarts`` iterations. ``--load N`` runs
N busy loops beside the job (contention makes races show). Soft timeout 20 s, hard
timeout 40 s: a restart that takes seconds is a stall, one that kills a rank (the
world shrinks) is a hang that only the hard timeout ended.

Prints, per run: the restart latencies (fault -> every rank completed a step of
the next iteration) as median / max, how many took over 1 s, ranks lost, and the
launcher's exit code. With ``--dump-dir``, a stall (no rank stepped for 5 s) has
every worker's stacks written there (``py-spy dump --native`` and gdb's
``thread apply all bt``, when installed): the way to see what a hang is. Run by hand,
not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import in_loopback_netns, median

TRAIN = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from relaunch import inprocess
    out, restarts = sys.argv[1], int(sys.argv[2])
    rank0 = int(os.environ["RANK"])
    log = open(os.path.join(out, f"{rank0}.log"), "a", buffering=1)
    def emit(**kw):
        log.write(json.dumps({"t": time.time(), "pid": os.getpid(), **kw}) + "\\n")
    @inprocess.Wrapper(
        soft_timeout=datetime.timedelta(seconds=20),
        hard_timeout=datetime.timedelta(seconds=40),
        barrier_timeout=datetime.timedelta(seconds=120),
    )
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        it = call_wrapper.iteration
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(10):
            if rank0 == 1 and it < restarts and step == 5:
                emit(ev="fault", it=it)
                raise RuntimeError("injected")
            loss = model(torch.randn(64, 256)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            emit(ev="step", it=it, world=world)
            call_wrapper.ping()
        del model, opt  # free DDP before its process group (a gloo teardown deadlock)
        dist.destroy_process_group()
    train()
    """
)


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in out.glob("*.log"):
        rank = int(path.stem)
        for line in path.read_text().splitlines():
            rows.append({**json.loads(line), "rank": rank})
    return rows


def _latencies(rows: list[dict[str, Any]], ranks: int) -> tuple[list[float], int]:
    """Per fault: seconds until every rank of the next iteration stepped; ranks lost."""
    faults = {int(r["it"]): r["t"] for r in rows if r["ev"] == "fault"}
    first: dict[tuple[int, int], float] = {}
    worlds: dict[int, int] = {}
    for r in rows:
        if r["ev"] == "step":
            key = (int(r["it"]), int(r["rank"]))
            first[key] = min(first.get(key, r["t"]), r["t"])
            worlds[int(r["it"])] = int(r["world"])
    out = []
    for it, t0 in sorted(faults.items()):
        nxt = [t for (i, _), t in first.items() if i == it + 1]
        if nxt and len(nxt) == worlds.get(it + 1, 0):
            out.append(max(nxt) - t0)
    lost = ranks - min(worlds.values(), default=ranks)
    return out, lost


def _dump_stacks(pids: set[int], dump_dir: Path) -> None:
    """Every worker's Python and native stacks (gloo's threads need gdb) into files."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    for pid in sorted(pids):
        tools = {
            "py-spy": ["py-spy", "dump", "--native", "--pid", str(pid)],
            "gdb": ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
        }
        for name, cmd in tools.items():
            if shutil.which(cmd[0]) is None:
                continue
            with (dump_dir / f"{stamp}_{pid}.{name}.txt").open("w") as f:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=120, check=False)
    print(f"    stall: stacks of {sorted(pids)} in {dump_dir}")


def run(args: argparse.Namespace, script: str) -> None:
    with tempfile.TemporaryDirectory(prefix="relaunch_soak_") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "relaunch", "--standalone"]
        cmd += [f"--nproc-per-node={args.ranks}", "--max-restarts=0", "--monitor-interval=0.1"]
        cmd += [script, str(out), str(args.restarts)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        deadline = started + args.restarts * 5 + 240
        code: int | str = "timeout"
        tail: list[str] = []
        dumped = False
        with (out / "launcher.txt").open("w+") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.5)
                    logs = list(out.glob("*.log"))
                    if args.dump_dir is None or dumped or not logs:
                        continue
                    if time.time() - max(p.stat().st_mtime for p in logs) > 5:
                        dumped = True
                        pids = {int(r["pid"]) for r in _rows(out)}
                        _dump_stacks(
                            {p for p in pids if os.path.exists(f"/proc/{p}")}, args.dump_dir
                        )
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(60)
                else:
                    code = proc.returncode
            log.seek(0)
            tail = log.read().splitlines()[-5:] if code != 0 else []
        lat, lost = _latencies(_rows(out), args.ranks)
        slow = sum(x > 1.0 for x in lat)
        print(
            f"  {len(lat)}/{args.restarts} restarts in {time.monotonic() - started:.0f} s: "
            f"median {median(lat) * 1e3:.0f} ms, max {max(lat, default=0) * 1e3:.0f} ms, "
            f">1 s: {slow}, ranks lost: {lost}, exit {code}"
        )
        for line in tail:
            print(f"    {line}")


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", type=int, default=0, help="busy loops beside the job")
    parser.add_argument("--dump-dir", type=Path, help="write the workers' stacks here on a stall")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory(prefix="relaunch_soak_") as tmp:
            script = os.path.join(tmp, "train.py")
            Path(script).write_text(TRAIN)
            print(f"{args.ranks} DDP ranks, {args.restarts} exception restarts per run")
            for _ in range(args.runs):
                run(args, script)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
