"""A big job's status document, simulated: the views' tests and
``bench/status_page_scale.py`` draw it."""

from __future__ import annotations

from relaunch.rendezvous._state import RendezvousState
from relaunch.status import FailureLine, NodeReport, TimelineEntry, WorkerRow, job_document


def big_job(nodes: int, per_node: int = 8, spares: int = 16) -> dict[str, object]:
    """The document of a job of ``nodes`` nodes (and spares) with 3 failed nodes, one
    node that has not reported, one worker lost in-process; every node with events."""
    ids = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}_{100 + i}_0" for i in range(nodes + spares)]
    state = RendezvousState(
        run_id="big",
        round=3,
        complete=True,
        participants={n: i for i, n in enumerate(ids[:nodes])},
        redundancy_list=set(ids[nodes:]),
        last_heartbeats={n: 999.0 for n in ids},
        restarts=2,
    )
    failed = {7, 2048, nodes - 1}
    reports = {}
    for i, node in enumerate(ids[:nodes]):
        if i == 11:
            continue  # silent: no report yet
        state_name = "failed" if i in failed else "running"
        workers = tuple(
            WorkerRow(local_rank=lr, rank=i * per_node + lr, pid=1000 + lr,
                      state=_worker_state(i in failed, i, lr), snapshot=41)
            for lr in range(per_node)
        )  # fmt: skip
        last = (
            FailureLine(rank=i * per_node, host=f"host-{i}", exitcode=-9,
                        message="Signal 9 (SIGKILL)", time=900.0 + i, round=3)
            if i in failed else None
        )  # fmt: skip
        reports[node] = NodeReport(
            node=node, host=f"host-{i}", role="default", group_rank=i, round=3, attempt=2,
            state=state_name, updated=999.0, max_restarts=5, restarts=2, workers=workers,
            last_failure=last,
            timeline=(TimelineEntry(time=800.0 + i / nodes, name="restart", text="restarted"),),
        )  # fmt: skip
    return dict(job_document(state, reports, backend="c10d", now=1000.0))


def _worker_state(failed: bool, node: int, local_rank: int) -> str:
    """A failed node's first worker failed and the others were stopped; node 5 lost its
    local rank 3 in-process; every other worker runs."""
    if failed:
        return "failed" if local_rank == 0 else "stopped"
    return "lost" if (node, local_rank) == (5, 3) else "running"
