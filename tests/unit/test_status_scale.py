"""A big job's view: nodes by state, a grid of one character per node, the rows of the
nodes worth a look, one node's whole row on request; the page, the text and the JSON."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

from multinode_support.status_job import big_job
from relaunch.status import StatusServer, render_html, render_text
from relaunch.status._summary import DETAIL_NODES, TIMELINE_LIMIT, node_detail, summarize

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "docs" / "status.schema.json").read_text()
)


@pytest.fixture(scope="module")
def doc() -> dict[str, object]:
    return big_job(4096)


def test_every_node_is_counted_and_drawn(doc: dict[str, object]) -> None:
    jsonschema.validate(doc, SCHEMA)
    summary = doc["summary"]
    assert summary["nodes"] == summary["listed"] == 4096 + 16
    assert summary["nodes_by_state"] == {"failed": 3, "silent": 1, "running": 4092, "spare": 16}
    assert summary["workers_by_state"] == {
        "failed": 3, "lost": 1, "running": 4092 * 8 - 1, "stopped": 3 * 7
    }  # fmt: skip
    grid = summary["grid"]
    assert len(grid) == 4112 and grid[7] == grid[2048] == grid[4095] == "f"
    assert grid[11] == "n" and grid[0] == "r" and grid[-16:] == "s" * 16


def test_a_big_job_lists_the_nodes_worth_a_look_first(doc: dict[str, object]) -> None:
    small = summarize(doc)  # type: ignore[arg-type]
    jsonschema.validate(small, SCHEMA)
    ranks = [row["rank"] for row in small["nodes"]]
    # the failed first, then the silent one, then the node with a lost worker
    assert ranks == [7, 2048, 4095, 11, 5], ranks
    assert small["summary"]["listed"] == 5 and small["summary"]["grid"] == doc["summary"]["grid"]
    assert len(small["timeline"]) == TIMELINE_LIMIT
    assert len(json.dumps(small)) < len(json.dumps(doc)) / 100
    row = node_detail(doc, "host-1234")  # type: ignore[arg-type]
    assert row is not None and row["rank"] == 1234 and len(row["report"]["workers"]) == 8
    assert node_detail(doc, "no-such-node") is None  # type: ignore[arg-type]


def test_a_small_job_keeps_every_row() -> None:
    doc = big_job(DETAIL_NODES - 16, spares=16)
    assert summarize(doc) is doc  # type: ignore[arg-type]


def test_the_page_and_the_text_draw_the_grid_not_a_row_per_worker(doc: dict[str, object]) -> None:
    page = render_html(doc)
    assert page.count('<i class="') == 4112 + 4  # the squares and the key's four states
    assert page.count("<tr>") < 60  # the listed nodes and their workers, not 32,768 rows
    assert 'id="listed"' in page and "SIGKILL" in page and "4112 nodes:" in page
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render_text(doc))
    text = out.getvalue()
    assert "4112 nodes: failed 3 (f), silent 1 (n), running 4092 (r), spare 16 (s)" in text
    assert "last failure: rank 56 on host-7" in text.replace("\n", " ") or "last failure" in text
    assert text.count("\n") < 200, len(text.splitlines())


def test_the_status_server_summarizes_and_gives_one_node_s_row(doc: dict[str, object]) -> None:
    server = StatusServer("127.0.0.1", 0, lambda: doc)
    assert server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        with urllib.request.urlopen(f"{base}/status.json", timeout=30) as r:
            small = json.loads(r.read())
        assert small["summary"]["listed"] == 5 and len(small["nodes"]) == 5
        with urllib.request.urlopen(f"{base}/status.json?node=host-2048", timeout=30) as r:
            row = json.loads(r.read())
        assert row["rank"] == 2048 and row["report"]["state"] == "failed"
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/status.json?node=nope", timeout=30)
        assert missing.value.code == 404
        missing.value.close()
    finally:
        server.close()
