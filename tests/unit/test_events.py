"""Events: one typed detail each, written as version-1 JSON lines (format unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

from relaunch.events import (
    Cause,
    Detail,
    Event,
    EventSink,
    ForkServerStarted,
    NodeLost,
    RendezvousComplete,
    WorkersFailed,
)


def line(detail: Detail) -> dict[str, object]:
    event = Event(detail=detail, run_id="job", host="h", group_rank=1, timestamp=5.0)
    doc: dict[str, object] = json.loads(event.to_json())
    return doc


def test_a_line_has_the_envelope_and_the_details_fields() -> None:
    doc = line(RendezvousComplete(round=2, world_size=3, seconds=0.5))
    assert doc == {
        "version": 1, "name": "rendezvous_complete", "run_id": "job", "role": "", "host": "h",
        "group_rank": 1, "restart_count": 0, "timestamp": 5.0,
        "metadata": {"round": 2, "world_size": 3, "seconds": 0.5},
    }  # fmt: skip


def test_optional_fields_appear_only_when_set() -> None:
    md = line(RendezvousComplete(round=2, world_size=3, seconds=0.5, replaces=1, incarnation=7))
    assert md["metadata"] == {
        "round": 2, "world_size": 3, "seconds": 0.5, "replaces": 1, "incarnation": 7
    }  # fmt: skip
    assert line(ForkServerStarted(pid=4))["metadata"] == {"pid": 4}
    assert line(ForkServerStarted(pid=4, prewarm=True))["metadata"] == {"pid": 4, "prewarm": True}
    assert line(ForkServerStarted(pid=None))["metadata"] == {"pid": None}  # required: kept


def test_nested_details_become_plain_json() -> None:
    cause = Cause(local_rank=0, pid=9, exitcode=-9, message="killed", time=4.0)
    md = line(WorkersFailed(attempt=1, failures={3: -9}, causes={3: cause}))["metadata"]
    assert md == {
        "attempt": 1,
        "failures": {"3": -9},
        "causes": {"3": {"local_rank": 0, "pid": 9, "exitcode": -9, "message": "killed",
                         "time": 4.0}},
    }  # fmt: skip
    assert line(NodeLost(group_rank=1, ranks=(2, 3)))["metadata"] == {
        "group_rank": 1,
        "ranks": [2, 3],
    }


def test_the_sink_appends_one_line_per_event(tmp_path: Path) -> None:
    sink = EventSink(str(tmp_path / "events.jsonl"))
    for n in range(3):
        sink.emit(Event(detail=NodeLost(group_rank=n, ranks=(0, 1)), run_id="job"))
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    names = [json.loads(x)["metadata"]["group_rank"] for x in lines]
    assert names == [0, 1, 2]
