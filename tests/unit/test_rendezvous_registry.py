"""create_handler's validation (before any network) and endpoint parsing."""

from __future__ import annotations

import pytest

from relaunch._endpoint import split_endpoint
from relaunch.errors import ConfigError
from relaunch.rendezvous import RendezvousParameters, create_handler
from relaunch.rendezvous._embedded_setup import ONE_CPU_UP_TO, member_cpus
from relaunch.rendezvous.registry import _is_local_address


def params(
    backend: str = "c10d", endpoint: str = "127.0.0.1:1", **conf: str
) -> RendezvousParameters:
    return RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=2, conf=conf
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node0:29400", ("node0", 29400)),
        ("node0", ("node0", 29400)),
        ("10.0.0.1:5", ("10.0.0.1", 5)),
        ("[::1]:7", ("::1", 7)),
        ("[::1]", ("::1", 29400)),
        ("fe80::1", ("fe80::1", 29400)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert split_endpoint(text, 29400, min_port=1) == expected


@pytest.mark.parametrize("text", ["", "h:0", "h:70000", "h:x", "[::1"])
def test_bad_endpoint(text: str) -> None:
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        split_endpoint(text, 29400, min_port=1)


def test_unknown_backend_and_conf_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="--rdzv-backend"):
        create_handler(params(backend="zookeeper"))
    with pytest.raises(ConfigError, match=r"'timeout'.*is_host.*join_timeout"):
        create_handler(params(timeout="5"))
    with pytest.raises(ConfigError, match="is_host"):
        create_handler(params(is_host="maybe"))
    with pytest.raises(ConfigError, match="read_timeout"):
        create_handler(params(read_timeout="0"))
    with pytest.raises(ConfigError, match="last_call_timeout"):
        create_handler(params(last_call_timeout="-3"))
    with pytest.raises(ConfigError, match="protocol"):
        create_handler(params(backend="etcd", protocol="gopher"))


def test_local_address_needs_no_dns() -> None:
    assert _is_local_address("127.0.0.1", None)
    assert _is_local_address("node7", "node7")
    assert not _is_local_address("192.0.2.1", None)  # TEST-NET-1: never ours
    assert not _is_local_address("some-other-host.invalid", None)


@pytest.mark.parametrize("value", ["x", "-1", "10", "2.5", ""])
def test_a_bad_number_of_store_members_is_refused_before_any_network(value: str) -> None:
    with pytest.raises(ConfigError, match=r"store_members: expected auto or a number.*0\.\.9"):
        create_handler(params(store_members=value))


@pytest.mark.parametrize("value", ["x", "0", "-2", "1.5", "", "1025"])
def test_a_bad_number_of_store_cpus_is_refused_before_any_network(value: str) -> None:
    with pytest.raises(ConfigError, match=r"store_cpus: expected auto, all .* 1\.\.1024"):
        create_handler(params(store_cpus=value))


@pytest.mark.parametrize(
    ("value", "max_nodes", "expected"),
    [("auto", 4, 1), ("auto", ONE_CPU_UP_TO, 1), ("auto", ONE_CPU_UP_TO + 1, None),
     ("all", 4, None), ("ALL", 4, None), (" 3 ", 4096, 3)],
)  # fmt: skip
def test_store_cpus_sets_the_members_scheduler_threads(
    value: str, max_nodes: int, expected: int | None
) -> None:
    assert member_cpus({"store_cpus": value}, max_nodes) == expected
    assert member_cpus({}, 4) == 1


def test_store_members_with_an_etcd_that_is_not_there_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAUNCH_ETCD", "/nonexistent/etcd")
    with pytest.raises(
        ConfigError, match="RELAUNCH_ETCD='/nonexistent/etcd': expected an executable"
    ):
        create_handler(params(store_members="3"))
