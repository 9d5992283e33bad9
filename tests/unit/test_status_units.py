"""The status board, the node report's codec, the job document and its views, as pure logic."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relaunch.errors import StatusError
from relaunch.events import (
    Cause,
    Detail,
    Event,
    RendezvousComplete,
    Restart,
    WorkerHung,
    WorkerLost,
    WorkerRespawned,
    WorkersFailed,
    WorkersStarted,
)
from relaunch.rendezvous._state import RendezvousState
from relaunch.status import (
    MAX_REPORT_BYTES,
    StatusBoard,
    WorkerRow,
    decode_report,
    encode_report,
    escape,
    job_document,
    render_html,
    render_metrics,
    render_text,
)

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "status.schema.json").read_text())


def event(detail: Detail, t: float) -> Event:
    return Event(detail=detail, run_id="job", host="host-a", group_rank=0, timestamp=t)


def started(attempt: int, pids: dict[int, int]) -> WorkersStarted:
    return WorkersStarted(
        attempt=attempt, pids=pids, forked=(), seconds=0.1, master_addr="h", master_port=1
    )


def board_after_a_failure() -> tuple[StatusBoard, list[str]]:
    said: list[str] = []
    board = StatusBoard(
        node="a_1_0", host="host-a", role="default", max_restarts=3, say=said.append
    )
    board.observe(event(RendezvousComplete(round=0, world_size=2, seconds=0.1), 100.0))
    board.observe(event(started(0, {0: 11, 1: 12}), 100.5))
    cause = Cause(local_rank=1, pid=12, exitcode=1, time=110.0,
                  message="ValueError: bad \x1b[2J batch\nsecond line")  # fmt: skip
    board.observe(event(WorkersFailed(attempt=0, failures={1: 1}, causes={1: cause}), 110.2))
    board.observe(event(Restart(restarts=1, max_restarts=3), 110.3))
    board.observe(event(RendezvousComplete(round=1, world_size=2, seconds=0.1), 111.0))
    board.observe(event(started(1, {0: 21, 1: 22}), 111.4))
    return board, said


def test_the_board_says_the_failure_the_restart_and_counts_the_recovery() -> None:
    board, said = board_after_a_failure()
    assert said[0] == "round 0: 2 node(s); this node is rank 0"
    assert said[1] == (
        "rank 1 (local rank 1, pid 12, host host-a) failed: exit code 1: "
        "ValueError: bad \\x1b[2J batch"  # the escape sequence is shown, not obeyed
    )
    assert "restart 1 of 3" in said[2]
    assert said[3] == "workers running again (attempt 1)"
    report = board.report()
    assert report.faults == {"exit": 1} and report.tiers == {"group": 1}
    assert report.recovery.count == 1 and report.recovery.total == pytest.approx(1.2)
    assert report.last_failure is not None and report.last_failure.rank == 1
    assert report.restarts == 1 and report.round == 1 and report.state == "running"
    assert board.summary().startswith("summary: the run ended (running); restarts used 1 of 3")
    assert "in-process" not in board.summary()  # (no in-process restart: not a word of it)
    assert "recoveries: 1 group; in-process restarts: 2; 1.2 s" in board.summary(2)


def test_a_hang_is_counted_once_and_a_lost_process_is_the_process_tier() -> None:
    said: list[str] = []
    board = StatusBoard(node="n", host="h", role="r", max_restarts=1, say=said.append)
    board.observe(
        event(WorkerHung(local_rank=0, pid=7, reason="no progress for 3 s", stacks=""), 5.0)
    )
    cause = Cause(local_rank=0, pid=7, exitcode=-9, message="x", time=5.0)
    board.observe(event(WorkersFailed(attempt=0, failures={0: -9}, causes={0: cause}), 5.1))
    assert board.report().faults == {"hang": 1}
    lost = WorkerLost(rank=3, local_rank=1, exitcode=-signal.SIGKILL, reason="")
    board.observe(event(lost, 9.0))
    board.observe(
        event(
            WorkerRespawned(attempt=0, local_rank=1, pid=8, incarnation=1, replacement=1,
                            forked=True, seconds=0.01),
            9.2,
        )
    )  # fmt: skip
    report = board.report()
    assert report.faults == {"hang": 1, "lost": 1} and report.tiers["process"] == 1
    assert any("replaced in place" in line for line in said)


def test_a_report_round_trips_and_stays_bounded() -> None:
    board, _ = board_after_a_failure()
    rows = [WorkerRow(local_rank=0, rank=0, pid=21, state="running", iteration=3, active=True)]
    report = board.report(rows)
    assert decode_report(encode_report(report), key="k") == report
    for i in range(5000):
        board.observe(event(Restart(restarts=i, max_restarts=3), 200.0 + i))
    assert len(encode_report(board.report(rows))) <= MAX_REPORT_BYTES


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"version": 2}, "version"),
        ({"attempt": "one"}, "attempt"),
        ({"workers": [{"local_rank": -1}]}, "workers[0].local_rank"),
        ({"faults": {"meteor": 1}}, "faults"),
        ({"updated": None}, "updated"),
        # numbers the page and /metrics cannot draw: a date past the year 9999, an int
        # no float holds (the page got no answer; /metrics failed)
        ({"updated": 1e17}, "updated"),
        ({"restarts": 10**309}, "restarts"),
    ],
)
def test_a_corrupt_report_is_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    board, _ = board_after_a_failure()
    doc = json.loads(encode_report(board.report()))
    doc.update(change)
    with pytest.raises(StatusError, match="status/x: field " + re.escape(field)):
        decode_report(json.dumps(doc).encode(), key="status/x")
    with pytest.raises(StatusError, match="not JSON"):
        decode_report(b"\x80garbage", key="status/x")


def test_the_document_has_its_documented_shape_and_its_views_render() -> None:
    board, _ = board_after_a_failure()
    rows = [WorkerRow(local_rank=0, rank=0, pid=21, state="running", iteration=2, active=False)]
    state = RendezvousState(
        run_id="job",
        round=1,
        complete=True,
        participants={"a_1_0": 0, "b_2_0": 1},
        redundancy_list={"c_3_0"},
        last_heartbeats={"a_1_0": 99.0},
        restarts=1,
    )
    doc = job_document(state, {"a_1_0": board.report(rows)}, backend="c10d", now=100.0)
    jsonschema.validate(doc, SCHEMA)
    assert doc["world"] == {"nodes": 2, "workers": 1, "nodes_waiting": 0, "spares": 1}
    assert doc["restarts"] == {"used": 1, "max": 3, "left": 2}
    assert doc["inprocess"] == {"iteration": 2, "active": [], "inactive": [0]}
    assert [n["role"] for n in doc["nodes"]] == ["participant", "participant", "spare"]
    page = render_html(doc)
    assert "\x1b" not in page and "\\x1b[2J" in page and "<svg" in page
    assert "rendezvous store" not in page  # no embedded store: no members table
    doc["store_members"] = [
        {"name": "10.0.0.1-7-job", "client_url": "http://10.0.0.1:29400", "learner": False,
         "healthy": True},
        {"name": "10.0.0.2-8-job", "client_url": "http://10.0.0.2:29400", "learner": False,
         "healthy": False},
    ]  # fmt: skip
    jsonschema.validate(doc, SCHEMA)
    page = render_html(doc)
    assert "<td>10.0.0.1-7-job</td><td>http://10.0.0.1:29400</td><td>healthy</td>" in page
    assert "<td>10.0.0.2-8-job</td><td>http://10.0.0.2:29400</td><td>DOWN</td>" in page
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(doc).decode())}
    assert families["relaunch_restarts"].samples[0].value == 1
    hist = families["relaunch_recovery_seconds"]
    assert [s.value for s in hist.samples if s.name.endswith("_count")] == [1]


def test_a_node_whose_seat_is_held_shows_as_joining_with_its_report() -> None:
    # a round started again: a is back, b (its seat held) not yet, c a spare
    board, _ = board_after_a_failure()
    rows = [WorkerRow(local_rank=0, rank=2, pid=21, state="stopped", iteration=0, active=False)]
    state = RendezvousState(
        run_id="job",
        round=2,
        participants={"a_1_0": 0},
        redundancy_list={"c_3_0"},
        expected={"a_1_0", "b_2_0", "c_3_0"},
        held_until=130.0,
        restarts=1,
    )
    doc = job_document(state, {"b_2_0": board.report(rows)}, backend="c10d", now=100.0)
    jsonschema.validate(doc, SCHEMA)
    roles = {n["node"]: n["role"] for n in doc["nodes"]}
    assert roles == {"a_1_0": "joining", "b_2_0": "joining", "c_3_0": "spare"}
    assert doc["restarts"]["used"] == 1 and doc["world"]["workers"] == 1


def test_escape_shows_control_characters() -> None:
    assert escape("a\x1b]0;title\x07b\r\n") == "a\\x1b]0;title\\x07b\\x0d\\n"
    assert escape("naïve ünïcode\t") == "naïve ünïcode\t"


def test_the_snapshots_show_in_the_document_the_views_and_the_metrics() -> None:
    import dataclasses

    from rich.console import Console

    from relaunch.status import render_text

    board, _ = board_after_a_failure()
    state = RendezvousState(
        run_id="job", round=1, complete=True, participants={"a_1_0": 0, "b_2_0": 1}
    )
    reports = {}
    for node, ranks, newest in (("a_1_0", (0, 1), (41, 42)), ("b_2_0", (2, 3), (42, 42))):
        rows = [
            WorkerRow(local_rank=i, rank=r, pid=None, state="running", snapshot=s)
            for i, (r, s) in enumerate(zip(ranks, newest, strict=True))
        ]
        # each node records the restore its ranks took part in: step 29 of 30, one redone
        report = dataclasses.replace(board.report(rows), node=node, restores=1, steps_redone=1)
        assert decode_report(encode_report(report), key="k") == report
        reports[node] = report
    doc = job_document(state, reports, backend="c10d", now=100.0)
    jsonschema.validate(doc, SCHEMA)
    assert doc["snapshots"] == {
        "restorable": 41, "newest": 42, "restores": 1, "steps_redone": 1,
        "redone_per_restore": 1.0,
    }  # fmt: skip
    line = "snapshots: every rank can restore step 41; 1 restores, 1 steps redone (1 per restore)"
    assert line in render_html(doc)
    console = Console(width=200, record=True)
    console.print(render_text(doc))
    text = console.export_text()
    assert line in text and "step 41" in text
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(doc).decode())}
    steps = {s.labels["rank"]: s.value for s in families["relaunch_snapshot_step"].samples}
    assert steps == {"0": 41, "1": 42, "2": 42, "3": 42}
    assert families["relaunch_steps_redone"].samples[0].value == 1
    # a report of an agent older than the snapshots reads as no snapshot
    old = json.loads(encode_report(reports["a_1_0"]))
    del old["restores"], old["steps_redone"]
    for w in old["workers"]:
        del w["snapshot"]
    back = decode_report(json.dumps(old).encode(), key="k")
    assert back.restores == 0 and all(w.snapshot is None for w in back.workers)
    assert job_document(state, {"a_1_0": back}, backend="c10d", now=1.0)["snapshots"] is None


def test_a_report_s_text_is_shown_not_read_as_markup() -> None:
    """``relaunch status`` draws the nodes' reports with rich: a host named ``[/]`` made
    it fail (MarkupError), and ``[link=...]`` printed a terminal escape sequence."""
    import io

    from rich.console import Console

    board, _ = board_after_a_failure()
    rows = [WorkerRow(local_rank=0, rank=0, pid=21, state="running", iteration=2, active=True)]
    state = RendezvousState(
        run_id="job", round=1, complete=True, participants={"a_1_0": 0, "b_2_0": 1}
    )
    doc = job_document(state, {"a_1_0": board.report(rows)}, backend="c10d", now=100.0)
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    nodes[0]["host"], nodes[1]["host"] = "[/]", "[link=http://x]a[/link]"
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=True).print(render_text(doc))
    said = out.getvalue()
    assert "[/]" in said and "[link=http://x]a[/link]" in said
    assert "\x1b]8" not in said  # no hyperlink escape
