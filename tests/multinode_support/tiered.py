"""Tiered-recovery jobs for tests: gloo DDP-like workers under ``relaunch.inprocess``
that log every step, and agents started (and killed) one by one on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from multinode_support.stopping import stop_sessions
from multinode_support.waiting import wait_for
from relaunch.procs._sys import descendants, process_state

__all__ = ["RANKS", "WORKER", "Step", "TieredJob", "check_recovered", "gone"]

WORKER = textwrap.dedent(
    r"""
    import datetime, hashlib, os, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    from relaunch import inprocess

    OUT = os.environ["OUT_DIR"]
    STEPS = int(os.environ["STEPS"])

    def last_step():
        # STEPS, or the step the test wrote in OUT/stop_at once it saw what it waited
        # for (every rank reads it before passing it, so every rank ends at that step)
        try:
            with open(f"{OUT}/stop_at") as f:
                return min(STEPS, int(f.read()))
        except (OSError, ValueError):
            return STEPS

    INCARNATION = int(os.environ.get("RELAUNCH_INPROCESS_INCARNATION", "0"))
    NAME = f"{os.environ['GROUP_RANK']}_{os.environ['LOCAL_RANK']}"
    # A replacement starts from other weights: only the broadcast can make them equal.
    torch.manual_seed(INCARNATION)
    MODEL = nn.Linear(8, 1)
    OPT = torch.optim.Adam(MODEL.parameters(), lr=0.01)
    STEP = [0]
    # Python stacks of a rank that made no step for 6 s (a stall, for diagnosis)
    import faulthandler
    STALL_LOG = open(f"{OUT}/stall_{NAME}_{os.getpid()}.txt", "w")

    def die_after_admission(state):
        if INCARNATION == 1 and os.environ.get("KILL_FIRST_REPLACEMENT") == NAME:
            os.kill(os.getpid(), 9)
        return state

    @inprocess.Wrapper(
        soft_timeout=datetime.timedelta(seconds=10),
        hard_timeout=datetime.timedelta(seconds=20),
        heartbeat_timeout=datetime.timedelta(seconds=30),
        barrier_timeout=datetime.timedelta(seconds=60),
        initialize=die_after_admission,
    )
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        state = {"model": MODEL.state_dict(), "opt": OPT.state_dict(), "step": STEP[0]}
        state = inprocess.broadcast_state(call_wrapper, state, to="all")
        MODEL.load_state_dict(state["model"])
        OPT.load_state_dict(state["opt"])
        STEP[0] = state["step"]
        new = sorted(call_wrapper.new_ranks)
        with open(f"{OUT}/steps_{NAME}.log", "a") as log:
            while STEP[0] < last_step():
                loss = MODEL(torch.ones(4, 8)).pow(2).mean()
                OPT.zero_grad()
                loss.backward()
                for p in MODEL.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
                with call_wrapper.atomic():
                    OPT.step()
                    STEP[0] += 1
                digest = hashlib.md5(MODEL.weight.detach().numpy().tobytes()).hexdigest()[:12]
                log.write(
                    f"{rank} {world} {STEP[0]} {os.getpid()} {call_wrapper.iteration} "
                    f"{digest} {INCARNATION} {','.join(map(str, new)) or '-'} {time.time():.3f}\n"
                )
                log.flush()
                call_wrapper.ping()
                faulthandler.dump_traceback_later(6, file=STALL_LOG)
                time.sleep(0.03)
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()

    train()
    """
)


@dataclass(frozen=True)
class Step:
    node: str
    rank: int
    world: int
    step: int
    pid: int
    iteration: int
    digest: str
    incarnation: int
    new: str


RANKS = ("0_0", "0_1", "1_0", "1_1")


@dataclass
class TieredJob:
    """Agents of one 2-nodes-of-2-workers job (c10d on 127.0.0.1); spares may be added."""

    tmp: Path
    port: int
    steps_total: int = 400
    backend: str = "c10d"
    endpoint: str | None = None
    """The rendezvous endpoint (default: c10d hosted on 127.0.0.1:``port``)."""
    env: dict[str, str] = field(default_factory=dict)
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        (self.tmp / "out").mkdir(exist_ok=True)
        (self.tmp / "train.py").write_text(WORKER)

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def start(self, name: str, *flags: str) -> subprocess.Popen[bytes]:
        """Start agent ``name`` (its log dir ``logs<name>``, output ``agent<name>.out``)."""
        cmd = [
            sys.executable, "-m", "relaunch", "--nnodes=2", "--nproc-per-node=2",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint or f'127.0.0.1:{self.port}'}", "--rdzv-id=tiered",
            "--max-restarts=3", "--monitor-interval=0.05", f"--log-dir={self.tmp / f'logs{name}'}",
            "--local-addr=127.0.0.1", *flags, str(self.tmp / "train.py"),
        ]  # fmt: skip
        env = {**os.environ, "OUT_DIR": str(self.out), "STEPS": str(self.steps_total),
               "OMP_NUM_THREADS": "1", **self.env}  # fmt: skip
        with open(self.tmp / f"agent{name}.out", "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        self.agents[name] = proc
        return proc

    def steps(self) -> list[Step]:
        rows = []
        for path in sorted(self.out.glob("steps_*.log")):
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) != 9:
                    continue  # being written
                rows.append(
                    Step(path.stem[6:], *map(int, parts[:5]), parts[5], int(parts[6]), parts[7])
                )
        return rows

    def newest_step(self) -> int:
        """The newest step any rank logged."""
        return max(s.step for s in self.steps())

    def pid_of(self, node: str) -> int:
        return next(s.pid for s in reversed(self.steps()) if s.node == node)

    def events(self, name: str) -> list[dict[str, object]]:
        docs = []
        for path in (self.tmp / f"logs{name}").glob("*/events.jsonl"):
            docs += [json.loads(line) for line in path.read_text().splitlines() if line]
        return docs

    def node_events(self, group_rank: int) -> list[dict[str, object]]:
        """The events of the agent of ``group_rank`` (the store's host is rank 0, and
        either agent may host it)."""
        name = next(n for n in self.agents if self.group_rank(n) == group_rank)
        return self.events(name)

    def group_rank(self, name: str) -> int | None:
        """The group rank agent ``name`` had in its latest round."""
        ranks = [e["group_rank"] for e in self.events(name) if e["name"] == "rendezvous_complete"]
        return ranks[-1] if ranks else None  # type: ignore[return-value]

    def output(self) -> str:
        return "\n".join(
            f"--- agent {n} ---\n"
            + (self.tmp / f"agent{n}.out").read_text(errors="replace")[-3000:]
            for n in self.agents
        )

    def agent_output(self, name: str) -> str:
        return (self.tmp / f"agent{name}.out").read_text(errors="replace")

    def wait_event(self, name: str, event: str, timeout: float = 60) -> None:
        wait_for(
            lambda: any(e["name"] == event for e in self.events(name)),
            timeout,
            what=f"agent {name}: {event}",
            detail=self.output,
        )

    def wait_for_steps(
        self, pred: Callable[[Step], bool], ranks: int, what: str, timeout: float = 120
    ) -> None:
        """Until ``ranks`` ranks logged a step that satisfies ``pred``."""
        wait_for(
            lambda: len({s.node for s in self.steps() if pred(s)}) >= ranks,
            timeout,
            what=what,
            detail=self.output,
        )

    def at_step(self, count: int, timeout: float = 120) -> None:
        wait_for(
            lambda: len({s.node for s in self.steps() if s.step >= count}) == 4,
            timeout,
            what=f"every rank at step {count}",
            detail=self.output,
        )

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL agent ``name`` and every process under it at once (its workers, their
        monitor processes, its fork server): the node is gone. Returns their pids."""
        proc = self.agents[name]
        pids = [proc.pid, *descendants(proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return pids

    def finish(self, names: tuple[str, ...] | None = None, *, after: int | None = None) -> None:
        """Every (named) agent exits 0 within 180 s. With ``after`` (the newest step
        before a fault): once every rank stepped at full size past it, the job is told to
        end 20 steps later instead of at ``steps_total``."""
        if after is not None:
            self.wait_for_steps(lambda s: s.world == 4 and s.step > after + 2, 4, "full size")
            stop_at = max(s.step for s in self.steps()) + 20
            (self.out / "stop_at.tmp").write_text(str(stop_at))
            (self.out / "stop_at.tmp").rename(self.out / "stop_at")
        for name in names or tuple(self.agents):
            try:
                assert self.agents[name].wait(timeout=180) == 0, self.output()
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not finish\n{self.output()}") from None

    def close(self) -> None:
        stop_sessions(self.agents.values(), grace=60)


def gone(pids: list[int]) -> bool:
    """Whether none of ``pids`` runs any more (a zombie is dead: an orphan waits for
    whichever init adopted it to reap it)."""
    return all(process_state(pid) in (None, "Z") for pid in pids)


def check_recovered(
    j: TieredJob,
    killed: dict[str, int],
    survivors: dict[str, int],
    agents: tuple[str, ...] = ("0", "1"),
) -> None:
    """Every rank stepped at full size in the final iteration (the killed ones in new
    processes), the survivors kept their pids, each of ``agents`` started its workers
    once, and every rank had the same weights at every step of the final iteration."""
    rows = j.steps()
    final_it = max(s.iteration for s in rows)
    # every rank stepped again at full size, the replaced ones in new processes
    last = {s.node: s for s in rows if s.iteration == final_it}
    assert set(last) == set(RANKS), last
    assert all(s.world == 4 for s in last.values()), last
    for node, pid in killed.items():
        assert last[node].pid != pid and last[node].incarnation >= 1, last[node]
    # no healthy process restarted: one pid per survivor for the whole run
    for node, pid in survivors.items():
        pids = {s.pid for s in rows if s.node == node}
        assert pids == {pid}, (node, pids, j.output())
    # one attempt per agent: the group was never restarted as processes
    for name in agents:
        names = [e["name"] for e in j.events(name)]
        assert names.count("workers_started") == 1, names
    # the same weights on every rank at every step of the final iteration, the
    # replacements' included (they started from other weights: the broadcast did it)
    by_step: dict[int, set[str]] = {}
    for s in rows:
        if s.iteration == final_it:
            by_step.setdefault(s.step, set()).add(s.digest)
    assert all(len(d) == 1 for d in by_step.values()), by_step
    # the job resumed where it was, not from step 0
    first = min(s.step for s in rows if s.iteration == final_it)
    assert first > 1, first
