"""Slurm's environment as defaults of the command line (``srun relaunch train.py``), and
the Slurm host-list expander. Expected expansions were checked against ``scontrol show
hostnames`` of Slurm 22.05."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relaunch._cli_slurm import read_step
from relaunch._hostlist import count_hosts, expand_hostlist, first_host
from relaunch.cli import parse_args
from relaunch.errors import ConfigError

# What srun sets on the second node of `srun --nodes=2 --ntasks-per-node=1` (job 1234,
# step 0), as seen in a real step (the variables relaunch reads, and the job's).
STEP = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOBID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_NODELIST": "node[01-02]",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURMD_NODENAME": "node02",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("PET_", "SLURM")) or name == "RELAUNCH_RDZV_SECRET_FILE":
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _in_step(monkeypatch: pytest.MonkeyPatch, **changes: str | None) -> None:
    for name, value in {**STEP, **changes}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


# -- host lists ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[09-11]", ["n09", "n10", "n11"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
        ("n[1,1]", ["n1", "n1"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu-[1-2]-ib,cpu[7]", ["gpu-1-ib", "gpu-2-ib", "cpu7"]),
        ("x-1.cluster,[3-4]", ["x-1.cluster", "3", "4"]),
    ],
)
def test_hostlist_expands_like_scontrol(text: str, hosts: list[str]) -> None:
    assert list(expand_hostlist(text)) == hosts
    assert count_hosts(text) == len(hosts)
    assert first_host(text) == hosts[0]


def test_hostlist_is_lazy_for_huge_lists() -> None:
    assert first_host("n[0-999999999999]") == "n0"
    assert count_hosts("n[0-999999999999],m") == 10**12 + 1


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("n[1-2", "unbalanced"),
        ("n]1", "unbalanced"),
        ("n[[1]]", "nested"),
        ("n[a]", "[a] is not a list"),
        ("n[]", "[] is not a list"),
        ("n[1-]", "[1-] is not a list"),
        ("n[3-1]", "goes down"),
        ("a,,b", "the item ''"),
        ("a b", "a space"),
    ],
)
def test_hostlist_malformed_is_one_clear_error(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST: expected a Slurm host list") as e:
        list(expand_hostlist(text, "SLURM_STEP_NODELIST"))
    assert why in str(e.value)


# -- reading the step ------------------------------------------------------------------


def test_read_step_prefers_the_steps_own_variables() -> None:
    # A 1-node step inside a 2-node allocation: SLURM_NODELIST is the job's.
    env = {
        **STEP,
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "node01",
        "SLURM_NODEID": "0",
    }
    assert read_step(env) is None
    env = {**STEP, "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_NUM_NODES": "4"}
    step = read_step(env)
    assert step is not None
    assert (step.num_nodes, step.node_id, step.first_host) == (2, 1, "node07")
    assert (step.run_id, step.tasks_per_node) == ("1234.0", 1)


def test_read_step_none_outside_a_step() -> None:
    assert read_step({}) is None
    # A batch script: the job's variables and SLURM_PROCID=0, but no step id.
    batch = {k: v for k, v in STEP.items() if "STEP" not in k}
    assert read_step(batch) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_STEP_NUM_NODES": "two"}, "SLURM_STEP_NUM_NODES: expected an integer >= 1"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID: expected a node index below 2"),
        ({"SLURM_NODEID": ""}, "SLURM_NODEID: expected an integer >= 0"),
        ({"SLURM_STEP_NODELIST": "node[01-"}, "SLURM_STEP_NODELIST: expected a Slurm host"),
        ({"SLURM_STEP_TASKS_PER_NODE": "1(y2)"}, "SLURM_STEP_TASKS_PER_NODE: expected counts"),
    ],
)
def test_read_step_malformed_variable_is_named(change: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        read_step({**STEP, **change})


def test_tasks_per_node_from_the_counts() -> None:
    step = read_step({**STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"})
    assert step is not None and step.tasks_per_node == 2
    env = {k: v for k, v in STEP.items() if "TASKS_PER_NODE" not in k}
    step = read_step({**env, "SLURM_STEP_NUM_TASKS": "3"})
    assert step is not None and step.tasks_per_node == 2


# -- the command line inside a step ----------------------------------------------------


def test_srun_with_no_rendezvous_flags_takes_c10d_at_the_first_host(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _in_step(monkeypatch)
    config = parse_args(["--nproc-per-node=2", script])
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "node01:29400")
    assert config.rdzv_id == "1234.0"
    assert config.rdzv_conf == {"is_host": "0"}
    assert capsys.readouterr().err.splitlines() == [
        "relaunch: from Slurm: nnodes=2, node 1 of the step, "
        "rdzv endpoint node01:29400 (c10d), rdzv id 1234.0"
    ]
    _in_step(monkeypatch, SLURM_NODEID="0", SLURM_PROCID="0")
    config = parse_args(["--nproc-per-node=2", script])
    assert config.rdzv_conf == {"is_host": "1"}
    assert "(c10d, hosted on this node)" in capsys.readouterr().err


def test_flags_and_pet_variables_win_over_slurm(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_step(monkeypatch)
    config = parse_args(["--nnodes=1:2", "--rdzv-id=mine", "--rdzv-conf=is_host=1", script])
    assert (config.min_nodes, config.max_nodes, config.rdzv_id) == (1, 2, "mine")
    assert (config.rdzv_endpoint, config.rdzv_conf) == ("node01:29400", {"is_host": "1"})
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "head:1234")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    config = parse_args([script])
    assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_conf) == (
        "c10d",
        "head:1234",
        {},  # not Slurm's endpoint: hosting is inferred from the address, as without Slurm
    )
    assert (config.max_nodes, config.rdzv_id) == (2, "1234.0")


def test_etcd_takes_only_the_node_count_and_the_id(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_step(monkeypatch)
    config = parse_args(["--rdzv-backend=etcd", "--rdzv-endpoint=etcd1:2379", script])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("etcd", "etcd1:2379")
    assert (config.max_nodes, config.rdzv_id, config.rdzv_conf) == (2, "1234.0", {})


def test_static_takes_master_addr_and_node_rank(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_step(monkeypatch)
    config = parse_args(["--rdzv-backend=static", script])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "node01:29500")
    assert (config.node_rank, config.master_addr, config.max_nodes) == (1, "node01", 2)
    config = parse_args(["--master-addr=10.0.0.1", "--master-port=1234", script])
    assert (config.rdzv_backend, config.rdzv_endpoint, config.node_rank) == (
        "static",
        "10.0.0.1:1234",
        1,
    )
    config = parse_args(["--rdzv-backend=static", "--node-rank=0", script])
    assert config.node_rank == 0


@pytest.mark.parametrize(
    "argv",
    [["--standalone"], ["--nnodes=1"], ["--nnodes=1:1"]],
)
def test_single_node_requests_ignore_slurm(
    script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_step(monkeypatch)
    config = parse_args([*argv, script])
    assert (config.max_nodes, config.rdzv_endpoint) == (1, "127.0.0.1:0")
    assert config.rdzv_id != "1234.0"


def test_outside_a_multi_node_step_nothing_changes(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_step(monkeypatch, SLURM_STEP_ID=None, SLURM_STEPID=None)  # a batch script
    config = parse_args([script])
    assert (config.max_nodes, config.rdzv_endpoint) == (1, "127.0.0.1:0")
    _in_step(monkeypatch, SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1", SLURM_NODEID="0")
    config = parse_args([script])
    assert (config.max_nodes, config.rdzv_endpoint) == (1, "127.0.0.1:0")


def test_several_tasks_per_node_is_refused(
    script: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _in_step(monkeypatch, SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_STEP_NUM_TASKS="4")
    with pytest.raises(ConfigError, match=r"SLURM_STEP_TASKS_PER_NODE=2\(x2\): expected one"):
        parse_args([script])
    # Everything given by hand: Slurm is not consulted, one warning says it.
    argv = ["--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--rdzv-id=x", script]
    with caplog.at_level("WARNING"):
        assert parse_args(argv).max_nodes == 4
    assert "several relaunch agents per node" in caplog.text


def test_a_bad_value_from_slurm_names_its_variable(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_step(monkeypatch, SLURM_JOB_ID="12/34")
    with pytest.raises(ConfigError, match="--rdzv-id"):
        parse_args([script])
    _in_step(monkeypatch, SLURM_JOB_ID="1234", SLURM_NODEID="x")
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        parse_args([script])
