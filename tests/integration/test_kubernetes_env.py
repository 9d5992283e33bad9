"""Kubeflow's environments, exactly as its controllers set them, with ``relaunch
train.py`` and no flag at all (the container command ``torchrun train.py`` becomes).

Each pod is a network namespace with its own host name (the pod name) and an
``/etc/hosts`` standing in for the cluster DNS of the job's headless service. The
variables are those of kubeflow/trainer's torch plugin (TrainJob:
``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` from the job completion index,
``PET_MASTER_ADDR=<job>-node-0-0.<job>``, ``PET_MASTER_PORT=29500``), of
training-operator v1's PyTorchJob with a Master replica (the same, plus ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``PYTHONUNBUFFERED``), and of its elastic
PyTorchJob (``PET_RDZV_BACKEND=c10d``, ``PET_RDZV_ENDPOINT=<job>-worker-0:<port>``,
``PET_RDZV_ID``, ``PET_NNODES=MIN:MAX``, ``PET_MAX_RESTARTS``, ``PET_NPROC_PER_NODE``).
Needs root (network namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import Cluster
from multinode_support.hosts import Hosts, start_plain
from multinode_support.netns import Net, network

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def net() -> Iterator[Net]:
    with network(2, tag="kf", octet=215) as created:
        yield created


def _trainjob_env(i: int) -> dict[str, str]:
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": str(i),
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29500",
    }


def _pytorchjob_env(i: int) -> dict[str, str]:
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": "23456",
        "MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_MASTER_ADDR": "job-master-0",
        "WORLD_SIZE": "4",
        "RANK": str(i),
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": str(i),
        "PET_NNODES": "2",
    }


def _finish(cluster: Cluster, nodes: list[str]) -> None:
    for node in nodes:
        assert cluster.wait_exit(node, timeout=150) == 0, cluster.outputs()
    last = {(s.node, s.rank): s for s in cluster.steps()}
    assert sorted(rank for _, rank in last) == [0, 1, 2, 3], cluster.outputs()
    assert {s.world for s in last.values()} == {4}
    assert {s.total for s in last.values()} == {1 + 2 + 3 + 4}  # every rank in one group


@pytest.mark.parametrize(
    ("kind", "pods", "env"),
    [
        ("TrainJob", ["job-node-0-0", "job-node-0-1"], _trainjob_env),
        ("PyTorchJob", ["job-master-0", "job-worker-0"], _pytorchjob_env),
    ],
)
def test_static_environment_runs_unchanged(
    net: Net, tmp_path: Path, kind: str, pods: list[str], env: object
) -> None:
    assert callable(env)
    aliases = [[f"{pod}.job"] for pod in pods] if kind == "TrainJob" else None
    hosts = Hosts(net, pods, tmp_path, aliases)
    cluster = Cluster(tmp_path, backend="static", endpoint="")
    try:
        for i, pod in enumerate(pods):
            start_plain(cluster, pod, hosts.prefix(i), env(i), "--", "steps=3")
        _finish(cluster, pods)
        assert {s.rank for s in cluster.steps(pods[0])} == {0, 1}  # PET_NODE_RANK=0
    finally:
        cluster.close()


def test_elastic_pytorchjob_environment_runs_unchanged(net: Net, tmp_path: Path) -> None:
    pods = ["job-worker-0", "job-worker-1"]
    hosts = Hosts(net, pods, tmp_path)
    cluster = Cluster(tmp_path, backend="c10d", endpoint="")
    env = {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:2",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ID": "job",
    }
    try:
        for i, pod in enumerate(pods):
            start_plain(cluster, pod, hosts.prefix(i), env, "--", "steps=3")
        _finish(cluster, pods)
        # The pod named in the endpoint knew itself by its host name: it hosts the store,
        # and the store's host is node rank 0.
        assert {s.rank for s in cluster.steps(pods[0])} == {0, 1}, cluster.outputs()
    finally:
        cluster.close()
