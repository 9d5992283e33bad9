"""relaunch.cli.parse_args: torchrun flags, spellings, PET_ defaults and their precedence."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from relaunch.cli import parse_args
from relaunch.config import Std
from relaunch.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PET_") or name in (
            "PYTHON_EXEC",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        ):
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_defaults_single_node_falls_back_to_c10d_like_torchrun(script: str) -> None:
    config = parse_args([script, "--lr", "0.1"])
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 1)
    assert config.rdzv_backend == "c10d"
    assert config.rdzv_endpoint == "127.0.0.1:0"
    assert config.rdzv_id != "none"
    assert config.standalone is False
    assert config.entrypoint == script
    assert config.args == ("--lr", "0.1")
    assert config.max_restarts == 0
    assert config.monitor_interval == 0.1
    assert config.start_method == "forkserver"
    assert config.role == "default"
    assert (config.module, config.no_python, config.run_path) == (False, False, False)
    assert config.log_dir is None
    assert dict(config.redirects) == {0: Std.NONE}
    assert dict(config.tee) == {0: Std.NONE}
    assert config.local_ranks_filter is None
    assert (config.master_addr, config.master_port, config.local_addr) == (None, None, None)
    assert config.exit_barrier_timeout == 300.0
    assert config.warm_standby is True
    assert config.log_line_prefix_template is None
    assert config.signals_to_handle == (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )


def test_script_arguments_are_not_parsed_as_flags(script: str) -> None:
    config = parse_args(["--nnodes", "1", script, "--nnodes", "3:2", "-m", "x"])
    assert config.args == ("--nnodes", "3:2", "-m", "x")
    assert config.max_nodes == 1


@pytest.mark.parametrize(
    ("dash", "underscore", "value", "field", "expected"),
    [
        ("--nproc-per-node", "--nproc_per_node", "3", "nproc_per_node", 3),
        ("--max-restarts", "--max_restarts", "4", "max_restarts", 4),
        ("--monitor-interval", "--monitor_interval", "0.5", "monitor_interval", 0.5),
        ("--start-method", "--start_method", "fork", "start_method", "fork"),
        ("--rdzv-id", "--rdzv_id", "job7", "rdzv_id", "job7"),
        ("--rdzv-conf", "--rdzv_conf", "join_timeout=5, a = b", "rdzv_conf", {"join_timeout": "5", "a": "b"}),
        ("--log-dir", "--log_dir", "/tmp/relaunch-logs", "log_dir", "/tmp/relaunch-logs"),
        ("--local-ranks-filter", "--local_ranks_filter", "0,2", "local_ranks_filter", {0, 2}),
        ("--local-addr", "--local_addr", "10.1.2.3", "local_addr", "10.1.2.3"),
        ("--exit-barrier-timeout", "--exit_barrier_timeout", "0", "exit_barrier_timeout", 0.0),
        ("--signals-to-handle", "--signals_to_handle", "SIGUSR1,SIGTERM", "signals_to_handle",
         (signal.SIGUSR1, signal.SIGTERM)),
        ("--log-line-prefix-template", "--log_line_prefix_template", "[${rank}]:",
         "log_line_prefix_template", "[${rank}]:"),
    ],
)  # fmt: skip
def test_dash_and_underscore_spellings(
    script: str, dash: str, underscore: str, value: str, field: str, expected: object
) -> None:
    for flag in (dash, underscore):
        config = parse_args(["--nproc-per-node", "3", flag, value, script])
        got = getattr(config, field)
        assert (dict(got) if field == "rdzv_conf" else got) == expected, flag


def test_static_multi_node_uses_master_addr_and_port(script: str) -> None:
    argv = ["--nnodes=2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master-port=1234"]
    config = parse_args([*argv, script])
    assert config.rdzv_backend == "static"
    assert config.rdzv_endpoint == "10.0.0.1:1234"
    assert (config.node_rank, config.master_addr, config.master_port) == (1, "10.0.0.1", 1234)
    params = config.rendezvous_parameters()
    assert (params.backend, params.endpoint, params.node_rank) == ("static", "10.0.0.1:1234", 1)
    assert (params.min_nodes, params.max_nodes, params.run_id) == (2, 2, "none")


def test_static_with_an_ipv6_master_addr_brackets_it(script: str) -> None:
    """(before: ``::1:1234``, refused as an endpoint without a port)"""
    argv = ["--nnodes=2", "--node-rank=1", "--master-addr=::1", "--master-port=1234"]
    config = parse_args([*argv, script])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "[::1]:1234")


def test_static_defaults_and_single_node_with_a_port(script: str) -> None:
    config = parse_args(["--nnodes", "2", script])
    assert config.rdzv_endpoint == "127.0.0.1:29500"
    config = parse_args(["--master-port", "0", script])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "127.0.0.1:0")


def test_c10d_and_etcd_endpoints_get_default_ports(script: str) -> None:
    config = parse_args(["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-id", "j", script])
    assert (config.min_nodes, config.max_nodes) == (1, 4)
    assert config.rdzv_endpoint == "127.0.0.1:29400"
    assert config.rendezvous_parameters().node_rank is None
    config = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]", script])
    assert config.rdzv_endpoint == "[::1]:29400"
    # a bracketed --master-addr, as the refusal of a bare one asks (it came out as
    # '[[::1]]:29500' and was refused, naming --rdzv-endpoint)
    config = parse_args(["--nnodes", "2", "--master-addr", "[::1]", "--node-rank", "0", script])
    assert (config.rdzv_endpoint, config.master_addr) == ("[::1]:29500", "::1")
    argv = ["--rdzv_backend", "etcd", "--rdzv_endpoint", "10.0.0.1,10.0.0.2:2380"]
    config = parse_args([*argv, script])
    assert config.rdzv_endpoint == "10.0.0.1:2379,10.0.0.2:2380"


def test_standalone_overrides_rendezvous_flags(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["--standalone", "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-id", "x", script]
    config = parse_args(argv)
    assert config.standalone is True
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
    assert config.rdzv_id not in ("x", "none")
    assert (config.min_nodes, config.max_nodes) == (1, 1)
    assert "--nnodes" in caplog.text and "--rdzv-backend" in caplog.text
    assert parse_args(["--standalone", script]).rdzv_id != config.rdzv_id


def test_a_durable_dir_under_a_run_id_drawn_at_random_is_said_to_restore_nothing_later(
    script: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    durable = ["--checkpoint-dir", str(tmp_path)]
    parse_args(["--standalone", "--rdzv-id", "x", *durable, script])
    said = [r.getMessage() for r in caplog.records if "--checkpoint-dir" in r.getMessage()]
    assert len(said) == 1 and "--standalone draws a new one" in said[0], said
    assert "the same --rdzv-id each time instead of --standalone" in said[0]
    caplog.clear()
    parse_args(["--nproc-per-node", "2", *durable, script])  # torchrun's single-node default
    assert "none was given (--rdzv-id)" in caplog.text
    caplog.clear()
    for argv in (["--rdzv-id", "x", *durable], ["--standalone"], ["--nnodes", "2", *durable]):
        parse_args([*argv, script])  # a run id kept from launch to launch, or no copies
    assert "--checkpoint-dir" not in caplog.text


def test_env_defaults_and_precedence(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_NNODES", "1:3")
    monkeypatch.setenv("PET_STANDALONE", "0")
    monkeypatch.setenv("PET_MODULE", "0")
    monkeypatch.setenv("PET_WARM_STANDBY", "0")
    monkeypatch.setenv("PET_TEE", "3")
    config = parse_args([script])
    assert (config.nproc_per_node, config.max_restarts, config.rdzv_backend) == (4, 2, "c10d")
    assert (config.max_nodes, config.standalone, config.module) == (3, False, False)
    assert config.warm_standby is False
    assert dict(config.tee) == dict.fromkeys(range(4), Std.ALL)
    config = parse_args(["--nproc_per_node", "2", "--max-restarts=0", "--warm-standby", script])
    assert (config.nproc_per_node, config.max_restarts, config.warm_standby) == (2, 0, True)
    monkeypatch.setenv("PET_STANDALONE", "1")
    assert parse_args([script]).standalone is True


def test_hang_timeout_from_flag_or_environment(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_args([script]).hang_timeout == 0.0
    assert parse_args(["--hang-timeout", "2.5", script]).hang_timeout == 2.5
    monkeypatch.setenv("PET_HANG_TIMEOUT", "7")
    assert parse_args([script]).hang_timeout == 7.0
    assert parse_args(["--hang_timeout=3", script]).hang_timeout == 3.0


def test_warm_standby_flags(script: str) -> None:
    assert parse_args(["--no-warm-standby", script]).warm_standby is False
    assert parse_args(["--no_warm_standby", script]).warm_standby is False
    assert parse_args(["--no-warm-standby", "--warm_standby", script]).warm_standby is True


def test_redirects_tee_maps_per_local_rank(script: str) -> None:
    config = parse_args(["--nproc-per-node", "3", "-r", "0:1,2:2", "--tee", "1", script])
    assert dict(config.redirects) == {0: Std.OUT, 1: Std.NONE, 2: Std.ERR}
    assert dict(config.tee) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}


def test_module_no_python_and_run_path(script: str) -> None:
    config = parse_args(["-m", "json.tool", "--indent", "2"])
    assert (config.module, config.entrypoint, config.args) == (True, "json.tool", ("--indent", "2"))
    config = parse_args(["--no-python", "true", "x"])
    assert (config.no_python, config.entrypoint) == (True, "true")
    config = parse_args(["--run-path", "--no-python", script])
    assert (config.run_path, config.no_python) == (True, False)


def test_nproc_cpu_counts_usable_cpus(script: str) -> None:
    config = parse_args(["--nproc-per-node", "cpu", script])
    assert config.nproc_per_node == len(os.sched_getaffinity(0))


def test_log_line_prefix_template_from_torchelastic_env(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${role_name}${local_rank}|")
    assert parse_args([script]).log_line_prefix_template == "${role_name}${local_rank}|"
    config = parse_args(["--log-line-prefix-template", "<${rank}>", script])
    assert config.log_line_prefix_template == "<${rank}>"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nnodes", "3:2"], "--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
        (["--nnodes", "0"], "--nnodes: expected"),
        (["--nproc_per_node", "0"], "--nproc_per_node: expected a number >= 1"),
        (["--max_restarts", "-1"], "--max_restarts: expected an integer >= 0, got '-1'"),
        (["--rdzv-backend", "zk"], "--rdzv-backend: expected one of static, c10d, etcd, got 'zk'"),
        (["--monitor-interval", "nan"], "--monitor-interval: expected a finite number > 0"),
        (["--hang-timeout", "-1"], "--hang-timeout: expected a finite number >= 0"),
        (["--snapshot-keep", "1"], "--snapshot-keep: expected an integer >= 2, got '1'"),
        (["--hang_timeout", "soon"], "--hang_timeout: expected a finite number >= 0"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank: expected a rank below"),
        (["--nnodes", "1:2"], "--nnodes: expected N (the static backend"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:99999"], "--rdzv-endpoint: expected"),
        (["--nnodes", "2", "--rdzv-endpoint", "h"], "--rdzv-endpoint: expected HOST:PORT"),
        (["--master-addr", "a b"], "--master-addr: expected a host name"),
        (["--rdzv-id", "../x"], "--rdzv-id: expected a job id of letters, digits and _.:-"),
        (["--rdzv_id", ".."], "--rdzv_id: expected a job id"),
        (["--signals-to-handle", "SIGKILL"], "--signals-to-handle: expected"),
        (["--log-line-prefix-template", "${x}"], "--log-line-prefix-template: expected"),
        (["--start-method", "thread"], "--start-method: expected one of spawn, fork, forkserver"),
        (["--event-log-handler", "console"], "--event-log-handler: expected 'null'"),
        (["--logs-specs", "mine"], "--logs-specs: expected nothing"),
        (["--numa-binding", "node"], "--numa-binding: expected nothing"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout: expected a finite number >= 0"),
        (["--virtual-local-rank"], "--virtual-local-rank: expected nothing"),
        (["--duplicate-stdout-filters", "a"], "--duplicate-stdout-filters: expected nothing"),
        (["--run-path", "-m"], "--run-path: expected no --module"),
    ],
)
def test_invalid_values_name_the_flag(script: str, argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args([*argv, script])
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_env_errors_name_the_variable(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "3:2")
    with pytest.raises(ConfigError, match=r"^--nnodes \(from PET_NNODES\): expected"):
        parse_args([script])
    monkeypatch.delenv("PET_NNODES")
    monkeypatch.setenv("PET_STANDALONE", "yes")
    with pytest.raises(ConfigError, match=r"^PET_STANDALONE: expected 0 or 1, got 'yes'"):
        parse_args([script])


def test_python_exec_other_than_this_interpreter_is_refused(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHON_EXEC", sys.executable)
    assert parse_args([script]).entrypoint == script
    monkeypatch.setenv("PYTHON_EXEC", "/nonexistent/python")
    with pytest.raises(ConfigError, match=r"^PYTHON_EXEC: expected unset"):
        parse_args([script])


def test_log_dir_that_is_a_file_is_refused(script: str) -> None:
    with pytest.raises(ConfigError, match=r"^--log-dir: expected a directory"):
        parse_args(["--log-dir", script, script])


def test_argparse_errors_are_one_line_naming_the_flag(script: str) -> None:
    with pytest.raises(ConfigError, match=r"^--nproc_per_node: expected one argument$"):
        parse_args(["--nproc_per_node"])
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: --bogus$"):
        parse_args(["--bogus", script])
    with pytest.raises(ConfigError, match=r"^training_script: expected a script"):
        parse_args(["--nnodes", "1"])


def test_public_names() -> None:
    import relaunch.cli
    import relaunch.config

    assert relaunch.cli.__all__ == ["main", "parse_args"]
    assert sorted(relaunch.config.__all__) == sorted(
        [
            "BACKENDS",
            "DEFAULT_SIGNALS",
            "START_METHODS",
            "LaunchConfig",
            "Std",
            "check_run_id",
            "check_template",
            "parse_endpoint",
            "parse_nnodes",
            "parse_rdzv_conf",
            "parse_signals",
            "parse_std",
        ]
    )


def test_nproc_auto_and_gpu_count_devices_with_torch(script: str) -> None:
    torch = pytest.importorskip("torch")
    expected = (
        torch.accelerator.device_count()
        if torch.accelerator.is_available()
        else len(os.sched_getaffinity(0))
    )
    assert parse_args(["--nproc-per-node", "auto", script]).nproc_per_node == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^--nproc-per-node: expected a device type"):
            parse_args(["--nproc-per-node", "gpu", script])


def test_flag_values_are_checked_before_the_entrypoint(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match=r"^--nnodes: expected"):
        parse_args(["--nnodes", "3:2", missing])
    with pytest.raises(ConfigError, match=r"^--max-restarts: expected"):
        parse_args(["--max-restarts", "-1", "-m", "no_such_module_relaunch_test"])
    with pytest.raises(ConfigError, match=r"^training_script: expected an existing"):
        parse_args([missing])


def test_empty_env_value_counts_as_unset(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "")
    monkeypatch.setenv("PET_STANDALONE", "")
    config = parse_args([script])
    assert (config.max_nodes, config.standalone) == (1, False)


def test_shutdown_timeout_from_flag_env_and_default(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert parse_args([script]).shutdown_timeout == 30.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert parse_args([script]).shutdown_timeout == 7.0
    assert parse_args(["--shutdown_timeout", "2.5", script]).shutdown_timeout == 2.5
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT: expected"):
        parse_args([script])
