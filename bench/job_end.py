"""A job's end: from its last worker's exit to every agent gone, relaunch vs torchrun.

    python bench/job_end.py [--runs 4] [--nodes 3] [--store auto|tcp] [--fault-at-end]

``--nodes`` agents on 127.0.0.1 (c10d, one worker each) run a script that writes
when it ends and exits 0; per run, the seconds from the last worker's end until
every agent exited, and the lines an agent wrote about a leave it could not make
("could not ..."). relaunch runs with its default store (``auto``: the embedded etcd
members) or a TCP store on the endpoint's node (``tcp``: ``store_members=0``);
torchrun with its own.

``--fault-at-end``: the last rank fails (exit 3) a second after the others' workers
ended, once (``--max-restarts=1``): the seconds from that failure until every agent
exited (``--limit`` at most: then the agents are killed) and the agents' exit codes.
Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, free_port, in_loopback_netns

SCRIPT = "import os, time\nopen(os.environ['JOB_END_DIR'] + '/end.' + os.environ['RANK'], 'w').write(str(time.time()))\n"
FAULT_SCRIPT = """import os, sys, time
d, rank = os.environ["JOB_END_DIR"], os.environ["RANK"]
if rank == os.environ["FAIL_RANK"] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(1.0)  # the other ranks' workers have ended by then
    open(os.path.join(d, "fail"), "w").write(str(time.time()))
    sys.exit(3)
open(os.path.join(d, "end." + rank), "w").write(str(time.time()))
"""

LAUNCHERS = {
    "relaunch": [sys.executable, "-m", "relaunch"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def one_end(
    launcher: str, nodes: int, store: str, run: int, *, fault: bool = False, limit: float = 180
) -> tuple[float, int, list[int]]:
    """Seconds from the last worker's end (``fault``: the late failure) to the last
    agent's exit (``limit`` at most); 'could not' lines; the agents' exit codes."""
    with tempfile.TemporaryDirectory(prefix="relaunch-job-end-") as tmp:
        script = Path(tmp, "end.py")
        script.write_text(FAULT_SCRIPT if fault else SCRIPT)
        port = free_port()
        conf = ["--rdzv-conf=store_members=0"] if launcher == "relaunch" and store == "tcp" else []
        cmd = [*LAUNCHERS[launcher], f"--nnodes={nodes}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=end{run}", "--local-addr=127.0.0.1",
               f"--max-restarts={int(fault)}", *conf, str(script)]  # fmt: skip
        env = {**os.environ, "JOB_END_DIR": tmp, "FAIL_RANK": str(nodes - 1)}
        logs = [Path(tmp, f"agent{i}.log") for i in range(nodes)]
        procs = []
        for log in logs:
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.time() + limit
        try:
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.01, deadline - time.time()))
            out_at = time.time()
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait(timeout=30)
        codes = [p.returncode for p in procs]
        said = sum(log.read_text().count("could not") for log in logs)
        if fault:
            return out_at - float(Path(tmp, "fail").read_text()), said, codes
        if codes != [0] * nodes:
            raise RuntimeError(f"{launcher}: agents exited {codes}")
        ended = max(float(Path(tmp, f"end.{r}").read_text()) for r in range(nodes))
        return out_at - ended, said, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--store", choices=["auto", "tcp"], default="auto")
    parser.add_argument("--fault-at-end", action="store_true",
                        help="the last rank fails once after the others ended")  # fmt: skip
    parser.add_argument("--limit", type=float, default=180.0,
                        help="seconds the agents get (then they are killed)")  # fmt: skip
    parser.add_argument("--launchers", default="relaunch,torchrun")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    if not set(launchers) <= set(LAUNCHERS):
        parser.error(f"--launchers: expected some of {sorted(LAUNCHERS)}, got {args.launchers}")
    in_loopback_netns()
    seconds: dict[str, list[float]] = {name: [] for name in launchers}
    lines = dict.fromkeys(launchers, 0)
    since = "the late failure" if args.fault_at_end else "the last worker's end"
    for run in range(args.runs):  # the launchers in turns, same hour
        for name in launchers:
            s, said, codes = one_end(
                name, args.nodes, args.store, run, fault=args.fault_at_end, limit=args.limit
            )
            seconds[name].append(s)
            lines[name] += said
            print(f"  run {run} {name}: every agent out {s:.2f} s after {since}; exit codes "
                  f"{codes}; 'could not' lines {said}", flush=True)  # fmt: skip
    for name in launchers:
        print(f"{name:9s} {fmt(seconds[name])}  ('could not' lines: {lines[name]})")


if __name__ == "__main__":
    main()
