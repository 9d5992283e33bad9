"""Named hosts over :class:`multinode_support.netns.Net`: each namespace gets a host name
of its own (a UTS namespace) and an ``/etc/hosts`` naming every host (bind-mounted in a
private mount namespace), as a cluster's DNS would. What a Kubernetes pod or a Slurm
node sees: ``socket.gethostname()`` is its name, and the names of the others resolve.

Commands enter the network namespace with ``nsenter`` rather than ``ip netns exec``,
which remounts ``/sys`` (``slurmd`` needs the host's ``/sys/fs/cgroup``). Nothing is
written outside the test's temporary directory; the UTS and mount namespaces end with
their last process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from multinode_support.cluster import Cluster
from multinode_support.netns import Net

__all__ = ["Hosts", "start_plain"]

_ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


class Hosts:
    """Host ``names[i]`` (with ``aliases[i]``, e.g. a Kubernetes FQDN) on ``net.addr(i)``."""

    def __init__(
        self, net: Net, names: list[str], tmp: Path, aliases: list[list[str]] | None = None
    ) -> None:
        self.net = net
        self.names = names
        self.hosts_file = tmp / "etc_hosts"
        lines = ["127.0.0.1 localhost"]
        for i, name in enumerate(names):
            extra = aliases[i] if aliases else []
            lines.append(" ".join([net.addr(i), *extra, name]))
        self.hosts_file.write_text("\n".join(lines) + "\n")

    def prefix(self, i: int) -> tuple[str, ...]:
        """The command prefix that runs a program as host ``i``."""
        return (
            "nsenter", f"--net=/run/netns/{self.net.spaces[i]}",
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", _ENTER, self.names[i], str(self.hosts_file),
        )  # fmt: skip


def start_plain(
    cluster: Cluster,
    node: str,
    prefix: tuple[str, ...],
    env: dict[str, str],
    *flags_and_worker_args: str,
    script: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``relaunch [flags] SCRIPT OUT train [args]`` with ``env`` (over a minimal
    environment) and no flag the test did not give: the command a cluster's job runs.
    ``flags_and_worker_args``: flags first, then ``--`` and the worker's arguments;
    ``script``: the worker (default: the cluster's)."""
    split = list(flags_and_worker_args)
    cut = split.index("--") if "--" in split else len(split)
    flags, worker_args = split[:cut], split[cut + 1 :]
    cmd = [
        *prefix, sys.executable, "-m", "relaunch", *flags,
        str(script or cluster.script), str(cluster.out), "train", *worker_args,
    ]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    full_env = {**base, "MN_NODE": node, "OMP_NUM_THREADS": "1", **env}
    with open(cluster.tmp / f"agent_{node}.out", "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    cluster.procs[node] = proc
    return proc
