"""What one node's part of the embedded store is given, and what its etcd member is
started with: the first member of a new cluster, or one added to a running cluster.

The member's client port is the endpoint's port where it is free on this node (on a
cluster every member then listens at ``<its node>:<the endpoint's port>``, so any live
node's address works as the endpoint of a node that joins later), else a free one.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaunch._endpoint import any_address, port_free, quiet_port
from relaunch.rendezvous._seats import Member
from relaunch.store._etcd_member import MemberSpec, bracket

__all__ = ["EmbeddedSettings", "bind_address", "first_member", "joining_member"]


@dataclass(frozen=True, kw_only=True)
class EmbeddedSettings:
    """What one node's part of the embedded store is given."""

    binary: str
    """The etcd binary."""
    run_id: str
    endpoint: tuple[str, int]
    """Where a node first asks (the c10d endpoint)."""
    address: str
    """This node's address, where its member listens."""
    target: int
    """How many voting members the store grows to."""
    hosts: bool
    """Whether this node hosts the endpoint (starts the first member)."""
    grace: float
    """Seconds a member may be down before it is replaced."""
    lease_ttl: float
    read_timeout: float
    log_dir: str | None = None
    """Where the members' logs go (None: nowhere)."""
    interval: float = 2.0
    """Seconds between the member checks."""
    cpus: int | None = None
    """Each member's Go scheduler threads (None: one per core)."""


def bind_address(cfg: EmbeddedSettings) -> str:
    """Where this node's member binds its ports."""
    return cfg.address if cfg.address.startswith("127.") else any_address(cfg.address)


def first_member(cfg: EmbeddedSettings, name: str, client_port: int) -> MemberSpec:
    """The member that starts a new cluster, serving on ``client_port``."""
    peer = quiet_port(cfg.address)
    return MemberSpec(
        name=name,
        address=cfg.address,
        client_port=client_port,
        peer_port=peer,
        initial_cluster=f"{name}=http://{bracket(cfg.address)}:{peer}",
        new_cluster=True,
        token=f"relaunch-{cfg.run_id}",
        cpus=cfg.cpus,
    )


def joining_member(
    cfg: EmbeddedSettings, name: str, peer: int, added: str, members: list[Member]
) -> MemberSpec:
    """How this node's member starts once added as ``added`` (its peer port ``peer``)
    to ``members``, as the cluster listed them in its reply."""
    cluster = [
        f"{m.name if m.id != added else name}={m.peer_urls[0]}" for m in members if m.peer_urls
    ]
    wanted = cfg.endpoint[1]
    port = wanted if port_free(bind_address(cfg), wanted) else quiet_port(cfg.address)
    return MemberSpec(
        name=name,
        address=cfg.address,
        client_port=port,
        peer_port=peer,
        initial_cluster=",".join(cluster),
        new_cluster=False,
        token=f"relaunch-{cfg.run_id}",
        cpus=cfg.cpus,
    )
