"""``create_handler(params)``: the rendezvous handler for ``--rdzv-backend``.

``c10d``
    The state lives in a TCP store (torch's wire protocol). The node whose
    ``--local-addr`` or host name is the endpoint's host, or that sets
    ``is_host=1`` in ``--rdzv-conf``, hosts the store on the endpoint's port; the
    others connect (retrying for ``read_timeout`` seconds, as nodes start in any
    order). When hosting was inferred and a store already listens on the port
    (several agents on one machine), the node connects to it instead; a port held
    by a connection, not a server, is tried again until ``read_timeout``. Extra conf keys: ``is_host``,
    ``read_timeout``.
``etcd``
    The state lives in etcd v3 (comma-separated endpoints, failed over in
    order). Extra conf keys: ``protocol`` (http or https), ``cacert``, ``cert``,
    ``key``, ``user``, ``password``, ``read_timeout``.
``static``
    Delegated to :func:`relaunch.rendezvous.static.create_static_handler`.

Every dynamic backend also takes the keys of
:data:`relaunch.rendezvous._settings.COMMON_CONF_KEYS`; an unknown key is a
ConfigError naming it and the valid ones.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from relaunch._endpoint import C10D_PORT, ETCD_PORT, own_address, split_endpoint
from relaunch.errors import ConfigError, RendezvousError, StoreConnectionError
from relaunch.rendezvous._embedded_setup import (
    embedded_client,
    member_cpus,
    members_wanted,
    start_embedded,
)
from relaunch.rendezvous._settings import (
    COMMON_CONF_KEYS,
    RendezvousSettings,
    check_conf_keys,
    conf_seconds,
    settings_from_conf,
)
from relaunch.rendezvous.api import RendezvousHandler, RendezvousParameters
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.store import Store

if TYPE_CHECKING:
    from relaunch.rendezvous._replicated import EmbeddedStore
    from relaunch.store.tcp import TCPStoreServer

__all__ = ["C10D_CONF_KEYS", "DEFAULT_PORT", "ETCD_CONF_KEYS", "connect_store", "create_handler"]

logger = logging.getLogger(__name__)

DEFAULT_PORT = C10D_PORT
"""The c10d endpoint port when none is given (torchrun's)."""

C10D_CONF_KEYS = (*COMMON_CONF_KEYS, "is_host", "read_timeout", "store_members", "store_cpus")
ETCD_CONF_KEYS = (
    *COMMON_CONF_KEYS,
    "protocol",
    "cacert",
    "cert",
    "key",
    "user",
    "password",
    "read_timeout",
)


def _flag(conf: Mapping[str, str], key: str) -> bool | None:
    raw = conf.get(key)
    if raw is None:
        return None
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}: expected 1/0 or true/false, got {raw!r}")


def _is_local_address(host: str, local_addr: str | None) -> bool:
    """Whether ``host`` names this machine, without any DNS lookup."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    if local_addr is not None and host == local_addr:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))  # only succeeds for an address of ours
        except OSError:
            return False
    return True


def _signed(store: Store, params: RendezvousParameters) -> Store:
    """``store`` signed with the job's secret when ``secret_file`` is given."""
    from relaunch.store.signed import SignedStore, read_secret

    path = params.conf.get("secret_file")
    if path is None:
        logger.info(
            "rendezvous %s is unauthenticated (no --rdzv-conf secret_file): any process "
            "that reaches its store can read and change it",
            params.run_id,
        )
        return store
    return SignedStore.over(store, read_secret(path))


def _host_or_find(host: str, bind: str, port: int, timeout: float) -> TCPStoreServer | None:
    """The store server of ``port`` when this node can host it; None when another agent
    on this machine already does (several agents of the job on one machine).

    A port that cannot be bound but has no listener is held by a connection (an
    outgoing connection's source port, a socket closing): that lasts a moment, so this
    tries again until ``timeout`` seconds have passed, and then returns None (the
    client's connection then fails with the endpoint named).
    """
    from relaunch.store.tcp import TCPStoreServer

    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            return TCPStoreServer(host=bind, port=port).start()
        except StoreConnectionError as exc:
            if _listening(host, port):
                logger.info("port %d taken; connecting as a client of the store there", port)
                return None
            if time.monotonic() >= deadline:
                logger.warning("port %d stayed taken for %g s (%s)", port, timeout, exc)
                return None
            if not said:
                said = True
                logger.info(
                    "port %d is taken but nothing listens on it (%s): trying again", port, exc
                )
        time.sleep(0.1)


def _listening(host: str, port: int) -> bool:
    """Whether a server accepts connections on ``host:port`` now."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError:
        return False
    return True


def _create_c10d(params: RendezvousParameters) -> DynamicRendezvousHandler:
    from relaunch.store.tcp import TCPStoreClient

    conf = params.conf
    check_conf_keys(conf, C10D_CONF_KEYS)
    settings = settings_from_conf(
        run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes, conf=conf
    )
    host, port = split_endpoint(params.endpoint, DEFAULT_PORT, min_port=1)
    read_timeout = conf_seconds(conf, "read_timeout", 60.0)
    explicit = _flag(conf, "is_host")
    is_host = _is_local_address(host, params.local_addr) if explicit is None else explicit
    cpus = member_cpus(conf, params.max_nodes)  # (checked where no member runs too)
    target, binary = members_wanted(conf, params.max_nodes)
    if "store_cpus" in conf and not (target and binary is not None):
        logger.warning("--rdzv-conf store_cpus has no effect: this job's rendezvous store is "
                       "a TCP store, not etcd members (store_members)")  # fmt: skip
    if target and binary is not None:
        embedded, replicated = start_embedded(
            params, settings, (host, port), is_host, (target, binary), read_timeout, cpus
        )
        return _c10d_handler(params, settings, replicated, (host, port), embedded=embedded)
    server = _tcp_server(host, port, explicit, read_timeout) if is_host else None
    is_host = server is not None
    try:
        # Once connected, a store that stays unreachable for a heartbeat timeout is lost.
        store = TCPStoreClient(
            "127.0.0.1" if is_host else host,
            port,
            timeout=read_timeout,
            reconnect_timeout=min(read_timeout, settings.heartbeat_timeout),
            # silent longer than the others keep this node (16 s at 16,384 nodes) too
            silent_timeout=min(read_timeout, max(settings.heartbeat_timeout, settings.dead_after)),
        )
    except StoreConnectionError as exc:
        if server is not None:
            server.close()
        raise StoreConnectionError(
            f"cannot reach the c10d rendezvous store at {host}:{port} within "
            f"read_timeout={read_timeout} s: is the node hosting it up? ({exc})"
        ) from exc
    return _c10d_handler(params, settings, store, (host, port), server=server)


def _c10d_handler(
    params: RendezvousParameters,
    settings: RendezvousSettings,
    store: Store,
    endpoint: tuple[str, int],
    *,
    server: TCPStoreServer | None = None,
    embedded: EmbeddedStore | None = None,
) -> DynamicRendezvousHandler:
    """The c10d handler over ``store`` (owned by ``embedded`` when there is one, else by
    the handler); a bad job secret closes what was started for it."""
    try:
        signed = _signed(store, params)
    except ConfigError:
        (embedded or store).close()
        if server is not None:
            server.close()
        raise
    return DynamicRendezvousHandler(
        backend="c10d",
        store=signed,
        settings=settings,
        local_addr=params.local_addr,
        server=server,
        owns_store=embedded is None,
        embedded=embedded,
        lifeline_host=params.local_addr or own_address(*endpoint),
    )


def _tcp_server(
    host: str, port: int, explicit: bool | None, read_timeout: float
) -> TCPStoreServer | None:
    """The TCP store server this node hosts for endpoint ``host:port``; None when
    another agent here hosts it already (``is_host`` not given: found, not started)."""
    from relaunch.store.tcp import TCPStoreServer

    bind = "::" if ":" in host else "0.0.0.0"
    if explicit is None:
        server = _host_or_find(host, bind, port, read_timeout)
    else:
        try:
            server = TCPStoreServer(host=bind, port=port).start()
        except StoreConnectionError as exc:
            raise RendezvousError(
                f"this node hosts the c10d rendezvous store of endpoint {host}:{port} "
                f"(is_host=1) but cannot listen on port {port} ({exc}); "
                "is another job using it?"
            ) from exc
    if server is not None:
        logger.info("hosting the c10d rendezvous store on port %d", server.port)
    return server


def _etcd_store(params: RendezvousParameters, timeout: float | None = None) -> Store:
    from relaunch.store.etcd import EtcdStore

    conf = params.conf
    endpoints = [
        split_endpoint(e, ETCD_PORT, min_port=1) for e in params.endpoint.split(",") if e.strip()
    ]
    if not endpoints:
        raise ConfigError("--rdzv-endpoint: expected host:port[,host:port...] for etcd")
    protocol = conf.get("protocol", "http")
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol: expected http or https, got {protocol!r}")
    return EtcdStore(
        endpoints,
        protocol=protocol,
        ca_cert=conf.get("cacert"),
        cert=conf.get("cert"),
        key=conf.get("key"),
        user=conf.get("user"),
        password=conf.get("password"),
        timeout=timeout or conf_seconds(conf, "read_timeout", 10.0),
    )


def _create_etcd(params: RendezvousParameters) -> DynamicRendezvousHandler:
    check_conf_keys(params.conf, ETCD_CONF_KEYS)
    settings = settings_from_conf(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        conf=params.conf,
    )
    store = _etcd_store(params)
    try:
        signed = _signed(store, params)
    except ConfigError:
        store.close()
        raise
    first = split_endpoint(params.endpoint.split(",")[0], ETCD_PORT, min_port=1)
    return DynamicRendezvousHandler(
        backend="etcd",
        store=signed,
        settings=settings,
        local_addr=params.local_addr,
        lifeline_host=params.local_addr or own_address(*first),
    )


def connect_store(
    params: RendezvousParameters,
    *,
    timeout: float,
    members: Sequence[tuple[str, int]] = (),
) -> Store:
    """A client of the rendezvous store of ``params`` (c10d or etcd), to read a job's
    status: it never hosts a store. ``members``: the embedded store's members as an
    agent knows them (c10d), tried instead of the endpoint, whose node may be gone.
    Raises ConfigError for another backend or a bad endpoint or conf,
    StoreConnectionError when the store cannot be reached."""
    if params.backend == "etcd":
        check_conf_keys(params.conf, ETCD_CONF_KEYS)
        return _signed(_etcd_store(params, timeout), params)
    if params.backend != "c10d":
        raise ConfigError(
            f"--rdzv-backend: expected c10d or etcd (a job's status lives in its rendezvous "
            f"store), got {params.backend!r}"
        )
    from relaunch.store.tcp import TCPStoreClient

    check_conf_keys(params.conf, C10D_CONF_KEYS)
    if members:
        from relaunch.store.etcd import EtcdStore

        return _signed(EtcdStore(list(members), timeout=timeout), params)
    host, port = split_endpoint(params.endpoint, DEFAULT_PORT, min_port=1)
    embedded = embedded_client(host, port, timeout)
    if embedded is not None:
        return _signed(embedded, params)
    try:
        return _signed(
            TCPStoreClient(host, port, timeout=timeout, reconnect_timeout=timeout), params
        )
    except StoreConnectionError as exc:
        raise StoreConnectionError(
            f"cannot reach the c10d rendezvous store at {host}:{port} within {timeout:g} s ({exc})"
        ) from exc


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler of ``params.backend``: ``c10d``, ``etcd`` or ``static``.

    Raises ConfigError for an unknown backend, a bad endpoint or a bad conf key or
    value; RendezvousError when this node should host the c10d store and cannot
    bind its port; StoreConnectionError when the store cannot be reached.
    """
    if params.backend == "c10d":
        return _create_c10d(params)
    if params.backend == "etcd":
        return _create_etcd(params)
    if params.backend == "static":
        from relaunch.rendezvous.static import create_static_handler

        return create_static_handler(params)
    raise ConfigError(f"--rdzv-backend: expected one of c10d, etcd, static, got {params.backend!r}")
