"""relaunch.config: LaunchConfig validation, Std and the value parsers."""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

import pytest

from relaunch.config import (
    LaunchConfig,
    Std,
    check_template,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from relaunch.errors import ConfigError


def _config(**overrides: Any) -> LaunchConfig:
    fields: dict[str, Any] = {
        "min_nodes": 1,
        "max_nodes": 2,
        "nproc_per_node": 2,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "127.0.0.1:0",
        "rdzv_id": "job",
        "rdzv_conf": {"join_timeout": "5"},
        "standalone": False,
        "max_restarts": 1,
        "monitor_interval": 0.1,
        "start_method": "spawn",
        "role": "trainer",
        "entrypoint": "train.py",
        "args": ("--x", "1"),
        "module": False,
        "no_python": False,
        "run_path": False,
        "log_dir": None,
        "redirects": {0: Std.OUT, 1: Std.ERR},
        "tee": {},
        "local_ranks_filter": None,
        "master_addr": None,
        "master_port": None,
        "local_addr": None,
        "exit_barrier_timeout": 300,
        "log_line_prefix_template": None,
        "signals_to_handle": (signal.SIGTERM,),
    }
    fields.update(overrides)
    return LaunchConfig(**fields)


def test_valid_config_is_normalized_and_frozen() -> None:
    config = _config(args=["a"], local_ranks_filter={1}, exit_barrier_timeout=5)
    assert config.args == ("a",)
    assert config.local_ranks_filter == frozenset({1})
    assert config.exit_barrier_timeout == 5.0
    assert dict(config.redirects) == {0: Std.OUT, 1: Std.ERR}
    assert dict(config.tee) == {0: Std.NONE, 1: Std.NONE}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_restarts = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.rdzv_conf["x"] = "y"  # type: ignore[index]
    with pytest.raises(TypeError):
        LaunchConfig(1, 1)  # type: ignore[misc]


def test_rendezvous_parameters() -> None:
    params = _config(local_addr="10.0.0.5").rendezvous_parameters()
    assert (params.backend, params.endpoint, params.run_id) == ("c10d", "127.0.0.1:0", "job")
    assert (params.min_nodes, params.max_nodes, params.local_addr) == (1, 2, "10.0.0.5")
    assert params.node_rank is None
    assert dict(params.conf) == {"join_timeout": "5"}
    static = _config(rdzv_backend="static", min_nodes=2, node_rank=1).rendezvous_parameters()
    assert static.node_rank == 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"min_nodes": 0}, "min_nodes"),
        ({"max_nodes": 0}, "max_nodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"nproc_per_node": True}, "nproc_per_node"),
        ({"node_rank": -1}, "node_rank"),
        ({"rdzv_backend": "static", "min_nodes": 2, "node_rank": 2}, "node_rank"),
        ({"rdzv_backend": "static"}, "max_nodes"),
        ({"rdzv_backend": "zk"}, "rdzv_backend"),
        ({"rdzv_endpoint": "host"}, "rdzv_endpoint"),
        ({"rdzv_id": ""}, "rdzv_id"),
        ({"rdzv_id": "a/b"}, "rdzv_id"),
        ({"rdzv_conf": {"a": ""}}, "rdzv_conf"),
        ({"standalone": 1}, "standalone"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"monitor_interval": 0}, "monitor_interval"),
        ({"monitor_interval": float("inf")}, "monitor_interval"),
        ({"start_method": "thread"}, "start_method"),
        ({"role": " "}, "role"),
        ({"entrypoint": ""}, "entrypoint"),
        ({"args": "abc"}, "args"),
        ({"module": True, "no_python": True}, "no_python"),
        ({"run_path": True, "module": True}, "run_path"),
        ({"log_dir": ""}, "log_dir"),
        ({"redirects": {2: Std.OUT}}, "redirects"),
        ({"tee": {0: 4}}, "tee"),
        ({"local_ranks_filter": frozenset()}, "local_ranks_filter"),
        ({"local_ranks_filter": frozenset({-1})}, "local_ranks_filter"),
        ({"master_port": 65536}, "master_port"),
        ({"exit_barrier_timeout": -1}, "exit_barrier_timeout"),
        ({"log_line_prefix_template": "${nope}"}, "log_line_prefix_template"),
        ({"signals_to_handle": (signal.SIGKILL,)}, "signals_to_handle"),
        ({"signals_to_handle": (15, 15)}, "signals_to_handle"),
    ],
)
def test_invalid_field_is_named(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: expected "):
        _config(**overrides)


def test_std_parse() -> None:
    assert parse_std("3") is Std.ALL
    assert parse_std("0:1,1:2,12:3") == {0: Std.OUT, 1: Std.ERR, 12: Std.ALL}
    assert Std.to_map(Std.OUT, 2) == {0: Std.OUT, 1: Std.OUT}
    assert Std.to_map({1: Std.ERR, 5: Std.ALL}, 2) == {0: Std.NONE, 1: Std.ERR}
    for bad in ("4", "a", "0:1,", "0:4", "0:1,0:2", "", "-1"):
        with pytest.raises(ConfigError, match=r"^-r: expected 0-3 or LOCAL_RANK:0-3"):
            parse_std(bad, "-r")


def test_parse_nnodes() -> None:
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes(" 1:4 ") == (1, 4)
    for bad in ("0", "3:2", "0:2", "a", "1:2:3", "-1", ""):
        with pytest.raises(ConfigError, match=r"^--nnodes: expected N or MIN:MAX"):
            parse_nnodes(bad)


def test_parse_rdzv_conf() -> None:
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf("a=1, b = x=y") == {"a": "1", "b": "x=y"}
    for bad in ("a=1,b", "=1", "a=", "a=1,,b=2"):
        with pytest.raises(ConfigError, match=r"^--rdzv-conf: expected KEY=VALUE"):
            parse_rdzv_conf(bad)


def test_parse_signals() -> None:
    assert parse_signals("SIGTERM, sigusr1,15") == (signal.SIGTERM, signal.SIGUSR1)
    for bad in ("SIGKILL", "SIGSTOP", "TERM", "SIGNOPE", "", "0", "9999"):
        with pytest.raises(ConfigError, match=r"^--signals-to-handle: expected"):
            parse_signals(bad)


def test_parse_endpoint() -> None:
    assert parse_endpoint("h", 29400) == "h:29400"
    assert parse_endpoint("10.0.0.1:0", None) == "10.0.0.1:0"
    assert parse_endpoint("[::1]", 5) == "[::1]:5"
    assert parse_endpoint("[fe80::1]:7", None) == "[fe80::1]:7"
    # an IPv6 address and a port, unbracketed: the port after the last colon when the
    # whole is no address (torchrun reads it so); an address that is one stays whole
    assert parse_endpoint("fe80::1:29500", 5) == "[fe80::1]:29500"
    assert parse_endpoint("fe80::1:2950", 5) == "[fe80::1:2950]:5"
    for bad in ("h", "h:", "h:70000", "h:x", "[::1", "[::1]x", "a b:1", ":1", "[::1]", "h:²"):
        with pytest.raises(ConfigError, match=r"^--rdzv-endpoint: expected HOST:PORT"):
            parse_endpoint(bad, None)


def test_check_template() -> None:
    assert check_template("[${role_name}${rank}/${local_rank}]") is not None
    for bad in ("${x}", "$", "${rank"):
        with pytest.raises(ConfigError, match=r"^--log-line-prefix-template: expected"):
            check_template(bad)
