"""The endpoints of an etcd cluster and the calls to them (its JSON gateway, through
``etcd3gw``'s sessions): failover in order, authentication, TLS; the endpoints can be
changed while calls run in other threads (a cluster whose members changed)."""

from __future__ import annotations

import base64
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from relaunch._json import loads as json_loads
from relaunch.errors import (
    ConfigError,
    StoreClosedError,
    StoreConnectionError,
    StoreError,
    StoreLostError,
)

__all__ = ["EtcdEndpoints", "first_kv", "kv_value"]

logger = logging.getLogger("relaunch.store.etcd")


class EtcdEndpoints:
    """Calls to the first endpoint that answers; see :class:`~relaunch.store.etcd.EtcdStore`."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        protocol: str,
        ca_cert: str | None,
        cert: str | None,
        key: str | None,
        user: str | None,
        password: str | None,
        timeout: float,
    ) -> None:
        try:
            import etcd3gw
            import requests
        except ImportError as exc:
            raise ConfigError(
                "the etcd rendezvous backend needs the etcd3gw package: "
                "pip install 'relaunch[etcd]'"
            ) from exc
        if not endpoints:
            raise ConfigError("endpoints: expected at least one (host, port)")
        if protocol not in ("http", "https"):
            raise ConfigError(f"protocol: expected 'http' or 'https', got {protocol!r}")
        if (cert is None) != (key is None):
            raise ConfigError("cert and key: give both (a client certificate and its key) or none")
        if (user is None) != (password is None):
            raise ConfigError("user and password: give both or none")
        if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
            raise ConfigError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.requests = requests
        # Given per request: requests lets REQUESTS_CA_BUNDLE override a session's CA
        # file, so --rdzv-conf cacert would be ignored where that variable is set.
        self.verify: str | bool = ca_cert if ca_cert is not None else True
        self.timeout = float(timeout)
        self.closed = False
        self._etcd3gw = etcd3gw
        # etcd3gw's names: cert_key, cert_cert
        self._client_options: dict[str, Any] = {
            "protocol": protocol, "ca_cert": ca_cert, "cert_key": key, "cert_cert": cert,
            "timeout": self.timeout, "api_path": "/v3/",
        }  # fmt: skip
        self._user = user
        self._password = password
        self._lock = threading.Lock()
        self._view: tuple[list[Any], list[str]] = ([], [])
        self._current = 0
        self._authed: set[int] = set()
        self._retired: list[Any] = []
        self._answered = True
        self._hurried = False
        self.lost: str | None = None
        """Why the store is gone for good (:meth:`give_up`); None while it may answer."""
        self.on_trouble: Callable[[], None] | None = None
        """Called (in the calling thread) when a sweep first finds no endpoint that can
        serve a call."""
        self.troubled_since: float | None = None
        """Since when (monotonic) the sweeps of the endpoints found none that could serve
        a call, with no call served through the leader since; None while they are."""
        self._set(endpoints)

    def _set(self, endpoints: Sequence[tuple[str, int]]) -> None:
        clients = [
            self._etcd3gw.client(host=host, port=port, **self._client_options)
            for host, port in endpoints
        ]
        # one tuple, swapped whole: a call in another thread reads a list and its names
        self._view = (clients, [f"{host}:{port}" for host, port in endpoints])

    @property
    def _clients(self) -> list[Any]:
        return self._view[0]

    def _settle(self, clients: list[Any], index: int) -> bool:
        """Make ``index`` of ``clients`` the endpoint in use, unless the endpoints were
        swapped meanwhile (:meth:`use`: its choice stands); whether it was."""
        with self._lock:
            if clients is not self._clients:
                return False
            self._current = index
            return True

    def use(self, endpoints: Sequence[tuple[str, int]], *, move: bool = False) -> None:
        """Try these endpoints from now on; the one in use stays first when still there,
        unless ``move``: then the first one given is."""
        if not endpoints:
            raise ConfigError("endpoints: expected at least one (host, port)")
        with self._lock:
            wanted = [f"{host}:{port}" for host, port in endpoints]
            names = self._view[1]
            if wanted == names:
                if move:
                    self._current = 0
                return
            current = names[self._current] if names and not move else None
            # closed at close(): a call in another thread may be using one now
            self._retired.extend(self._clients)
            self._set(endpoints)
            self._current = wanted.index(current) if current in wanted else 0
            self._authed = set()

    def hurry(self) -> None:
        """Every call from now on waits at most ``_AFTER_LOSS`` for an endpoint."""
        self._hurried = True

    def give_up(self, reason: str) -> None:
        """The store is gone for good: every call from now on raises StoreLostError
        with ``reason`` at once (a call in flight ends within its own timeout)."""
        self.lost = reason

    def current(self) -> tuple[Any, str, Callable[[], None]]:
        """The client in use, its name, and a call that moves on to the next one."""
        clients, names = self._view
        index = self._current % len(clients)

        def skip() -> None:
            self._settle(clients, (index + 1) % len(clients))

        return clients[index], names[index], skip

    def _authenticate(self, index: int, client: Any) -> None:
        if self._user is None or index in self._authed:
            return
        resp = client.session.post(
            client.get_url("/auth/authenticate"),
            json={"name": self._user, "password": self._password},
            timeout=self.timeout,
            verify=self.verify,
        )
        if resp.status_code != 200:
            raise StoreError(f"etcd authentication as {self._user!r} failed: {resp.text.strip()}")
        client.session.headers["Authorization"] = resp.json()["token"]
        self._authed.add(index)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers; sweep again (backing off) while the
        cluster has no leader or no endpoint answers, for up to ``timeout`` seconds."""
        return self.post_sent(path, body)[0]

    def post_sent(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """:meth:`post`, and whether the call was sent more than once: an endpoint that
        did not answer (in time) may still have applied it."""
        failed = 0
        # once a call found no endpoint for its whole timeout, the store is taken for
        # lost until one answers: the calls after it (an agent saying why it stops, and
        # leaving) each wait a moment, not the whole timeout again
        quick = self._hurried or not self._answered
        patience_left = min(self.timeout, _AFTER_LOSS) if quick else self.timeout
        deadline = time.monotonic() + patience_left
        delay, patience = 0.05, _ATTEMPT
        while True:
            result, errors = self._sweep(path, body, deadline, patience)
            failed += len(errors)
            if result is not None:
                self._answered = True
                if _through_leader(path, body):  # (a member without a leader serves the rest)
                    self.troubled_since = None
                return result, failed > 0
            if self.troubled_since is None:
                self.troubled_since = time.monotonic()
                if self.on_trouble is not None:
                    self.on_trouble()
            if time.monotonic() + delay > deadline:
                self._answered = False
                raise StoreConnectionError("no etcd endpoint answered: " + "; ".join(errors))
            time.sleep(delay)
            delay, patience = min(delay * 2, 1.0), patience * 2

    def _sweep(
        self, path: str, body: dict[str, Any], deadline: float, patience: float
    ) -> tuple[dict[str, Any] | None, list[str]]:
        if self.closed:
            raise StoreClosedError("the etcd store is closed")
        if self.lost is not None:
            raise StoreLostError(self.lost)
        errors = []
        clients, names = self._view  # use() may swap it
        start = self._current % len(clients)
        for step in range(len(clients)):
            index = (start + step) % len(clients)
            client = clients[index]
            try:
                self._authenticate(index, client)
                # one endpoint waits ``patience`` at most (doubled each sweep: a big
                # reply on a loaded machine still comes): a write sent while the
                # cluster elects a leader is dropped by etcd, which answers only after
                # its own request timeout; another endpoint a moment later takes it
                cap = patience if len(clients) > 1 else self.timeout  # else: nowhere to go
                wait = max(0.05, min(self.timeout, cap, deadline - time.monotonic()))
                resp = client.session.post(
                    client.get_url(path), json=body, timeout=wait, verify=self.verify
                )
            except self.requests.RequestException as exc:
                errors.append(f"{names[index]}: {exc}")
                self._authed.discard(index)
                continue
            if resp.status_code == 401 and self._user is not None:
                self._authed.discard(index)
                errors.append(f"{names[index]}: authentication expired")
                continue
            if resp.status_code >= 500 and _unavailable(resp.status_code, resp.text):
                errors.append(f"{names[index]}: {resp.text.strip()}")
                continue
            if resp.status_code != 200:
                if resp.status_code >= 500 and self.troubled_since is None:  # (etcd's own
                    self.troubled_since = time.monotonic()  # deadline passed: no leader?)
                raise StoreError(f"etcd {path} failed ({resp.status_code}): {resp.text.strip()}")
            if index != self._current and self._settle(clients, index):
                logger.info("etcd store: failed over to %s", names[index])
            result: dict[str, Any] = resp.json()
            return result, errors
        return None, errors

    def close(self) -> None:
        """Close every session (those of endpoints no longer used too)."""
        self.closed = True
        for client in (*self._clients, *self._retired):
            client.session.close()


def first_kv(range_reply: dict[str, Any]) -> dict[str, Any] | None:
    """The first key of a range's answer (a range call's, or a transaction's
    ``response_range``), as etcd's JSON has it; None when there is none."""
    kvs = range_reply.get("kvs") or []
    return kvs[0] if kvs else None


def kv_value(kv: dict[str, Any]) -> bytes:
    """The value of a key as etcd's JSON has it (base64; absent when empty)."""
    return base64.b64decode(kv.get("value", ""))


_ATTEMPT = 1.0
"""Seconds one endpoint may take to answer, in a call's first sweep, before the call
moves on to the next endpoint."""


_AFTER_LOSS = 2.0
"""Seconds a call may take while the store is taken for lost (the call before it
found no endpoint that answered within the whole timeout)."""


def _through_leader(path: str, body: dict[str, Any]) -> bool:
    """Whether a call is served only through the cluster's leader (a write, a read that
    is not ``serializable``, a lease's keep-alive): its answer proves a quorum. A
    member list or a serializable read is answered by a member alone."""
    return not (body.get("serializable") or path.startswith(("/cluster/", "/maintenance/")))


def _unavailable(status: int, text: str) -> bool:
    """Whether an error reply means "this endpoint cannot serve now, try another": no
    leader, a member stopping or removed (its gateway's own connection closed: gRPC
    UNAVAILABLE, code 14), its raft stopped or dropping proposals (a leader changing, or
    a member leaving as a job ends: the call was not applied), or its gateway's
    connection to its own gRPC server cut mid-call (INTERNAL, code 13, "unexpected EOF":
    seen with 1,024 simulated nodes on one 3-member cluster; the call may have been
    applied, as after a timeout)."""
    try:
        reply = json_loads(text)
        code = reply.get("code") if isinstance(reply, dict) else None
    except ValueError:
        code = None
    cut = code == 13 and ("EOF" in text or "transport is closing" in text)
    raft = "raft: stopped" in text or "proposal dropped" in text
    return status == 503 or "leader" in text or code == 14 or raft or cut
