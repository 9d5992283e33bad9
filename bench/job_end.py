"""A job's end: from its last worker's exit to every agent gone, relaunch vs torchrun.

    python bench/job_end.py [--runs 4] [--nodes 3] [--store auto|tcp]

``--nodes`` agents on 127.0.0.1 (c10d, one worker each) run a script that writes
when it ends and exits 0; per run, the seconds from the last worker's end until
every agent exited, and the lines an agent wrote about a leave it could not make
("could not ..."). relaunch runs with its default store (``auto``: the embedded etcd
members) or a TCP store on the endpoint's node (``tcp``: ``store_members=0``);
torchrun with its own. Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, free_port, in_loopback_netns

SCRIPT = "import os, time\nopen(os.environ['JOB_END_DIR'] + '/end.' + os.environ['RANK'], 'w').write(str(time.time()))\n"

LAUNCHERS = {
    "relaunch": [sys.executable, "-m", "relaunch"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def one_end(launcher: str, nodes: int, store: str, run: int) -> tuple[float, int]:
    """Seconds from the last worker's end to the last agent's exit; 'could not' lines."""
    with tempfile.TemporaryDirectory(prefix="relaunch-job-end-") as tmp:
        script = Path(tmp, "end.py")
        script.write_text(SCRIPT)
        port = free_port()
        conf = ["--rdzv-conf=store_members=0"] if launcher == "relaunch" and store == "tcp" else []
        cmd = [*LAUNCHERS[launcher], f"--nnodes={nodes}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=end{run}", "--local-addr=127.0.0.1", "--max-restarts=0", *conf,
               str(script)]  # fmt: skip
        env = {**os.environ, "JOB_END_DIR": tmp}
        logs = [Path(tmp, f"agent{i}.log") for i in range(nodes)]
        procs = []
        for log in logs:
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        try:
            for p in procs:
                p.wait(timeout=180)
            out_at = time.time()
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait(timeout=30)
        codes = [p.returncode for p in procs]
        if codes != [0] * nodes:
            raise RuntimeError(f"{launcher}: agents exited {codes}")
        ended = max(float(Path(tmp, f"end.{r}").read_text()) for r in range(nodes))
        said = sum(log.read_text().count("could not") for log in logs)
        return out_at - ended, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--store", choices=["auto", "tcp"], default="auto")
    args = parser.parse_args()
    in_loopback_netns()
    seconds: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    lines = dict.fromkeys(LAUNCHERS, 0)
    for run in range(args.runs):  # the launchers in turns, same hour
        for name in LAUNCHERS:
            s, said = one_end(name, args.nodes, args.store, run)
            seconds[name].append(s)
            lines[name] += said
            print(f"  run {run} {name}: every agent out {s:.2f} s after the last worker's "
                  f"end; 'could not' lines {said}", flush=True)  # fmt: skip
    for name in LAUNCHERS:
        print(f"{name:9s} {fmt(seconds[name])}  ('could not' lines: {lines[name]})")


if __name__ == "__main__":
    main()
