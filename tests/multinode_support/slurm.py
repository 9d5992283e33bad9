"""A real Slurm cluster for one test: Debian's ``munged``, ``slurmctld`` and ``slurmd``.

Host 0 (``ctl``) runs the controller and is where ``srun`` and ``scancel`` are typed;
hosts 1.. (``node01``, ``node02``, ...) each run a ``slurmd``, in a network namespace
and under a host name of their own (:class:`multinode_support.hosts.Hosts`). The munge
key, ``slurm.conf``, state, spool and logs live in the test's temporary directory;
``close()`` stops the daemons and kills whatever is still running in the namespaces
(``slurmstepd`` daemonizes, so it is no child of the test). The cluster is configured
like a strict site: ``KillOnBadExit=1``, so a task that fails ends the whole step
unless ``srun --kill-on-bad-exit=0`` says otherwise, and ``WaitTime=10``, so the other
tasks are killed 10 s after the first one ended unless ``srun --wait=0`` says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from multinode_support.hosts import Hosts
from multinode_support.waiting import wait_for

__all__ = ["Slurm", "require_slurm"]

_PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "srun", "sinfo", "squeue", "scancel")

_CONF = """\
ClusterName=relaunchtest
SlurmctldHost=ctl({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=10
KillWait=30
KillOnBadExit=1
WaitTime=10
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def require_slurm() -> None:
    """Skip the test, saying why, when Slurm or munge is not installed."""
    missing = [p for p in _PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing; scripts/test.sh installs "
            "Debian's slurmctld slurmd munge slurm-client with apt-get where it can)"
        )


class Slurm:
    """munged + slurmctld on ``hosts`` 0, a slurmd on each other host."""

    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts = hosts
        self.root = tmp / "slurm"
        self.nodes = hosts.names[1:]
        for sub in ("state", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, mode=0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = self.root / "munge" / "socket"
        self.conf = self.root / "slurm.conf"
        lines = [
            f"NodeName={name} NodeAddr={hosts.net.addr(i + 1)} CPUs={os.cpu_count() or 1} "
            "State=UNKNOWN"
            for i, name in enumerate(self.nodes)
        ]
        self.conf.write_text(
            _CONF.format(
                ctl_addr=hosts.net.addr(0),
                munge_socket=self.munge_socket,
                root=self.root,
                nodes="\n".join(lines),
            )
        )
        self.env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")},
            "SLURM_CONF": str(self.conf),
        }
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.jobs: list[subprocess.Popen[bytes]] = []

    # -- daemons ----------------------------------------------------------------------

    def _daemon(self, name: str, cmd: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self.daemons.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
            )

    def start(self) -> Slurm:
        munge = self.root / "munge"
        self._daemon("munged", [
            "munged", "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
            f"--socket={self.munge_socket}", f"--pid-file={munge / 'pid'}",
            f"--seed-file={munge / 'seed'}", f"--log-file={munge / 'log'}",
        ])  # fmt: skip
        wait_for(self.munge_socket.exists, 30, what="munged's socket", detail=self.logs)
        conf = str(self.conf)
        self._daemon("slurmctld", [*self.hosts.prefix(0), "slurmctld", "-D", "-i", "-f", conf])
        for i, name in enumerate(self.nodes, start=1):
            self._daemon(name, [*self.hosts.prefix(i), "slurmd", "-D", "-N", name, "-f", conf])
        wait_for(
            lambda: self.node_states() == ["idle"] * len(self.nodes),
            60, what="every slurmd registered and idle", interval=0.5, detail=self.logs,
        )  # fmt: skip
        return self

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").iterdir()):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # -- commands on the controller's host --------------------------------------------

    def command(self, *cmd: str, check: bool = True) -> str:
        result = subprocess.run(
            [*self.hosts.prefix(0), *cmd], capture_output=True, text=True, timeout=30,
            env=self.env,
        )  # fmt: skip
        if check:
            assert result.returncode == 0, f"{cmd}: {result.stdout}{result.stderr}"
        return result.stdout

    def node_states(self) -> list[str]:
        out = self.command("sinfo", "-h", "-N", "-o", "%T", check=False)
        return [line.strip().rstrip("*") for line in out.splitlines() if line.strip()]

    def job_ids(self) -> list[str]:
        return self.command("squeue", "-h", "-o", "%i").split()

    def srun(self, *args: str, out: Path, cwd: Path) -> subprocess.Popen[bytes]:
        """``srun ARGS`` typed on the controller's host (the environment is exported to
        the tasks, as ``srun`` does by default)."""
        with open(out, "wb") as sink:
            proc = subprocess.Popen(
                [*self.hosts.prefix(0), "srun", *args], stdout=sink, stderr=subprocess.STDOUT,
                env=self.env, cwd=cwd, start_new_session=True,
            )  # fmt: skip
        self.jobs.append(proc)
        return proc

    # -- faults and cleanup -----------------------------------------------------------

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.hosts.net.spaces[i]],
            capture_output=True, text=True, timeout=30,
        ).stdout  # fmt: skip
        return [int(pid) for pid in out.split()]

    def kill_host(self, i: int) -> None:
        """SIGKILL everything running on host ``i``: its slurmd, the step's slurmstepd,
        relaunch and its workers (a node lost, as far as the others can tell)."""
        for pid in self.pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.jobs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in [*self.jobs, *self.daemons]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        for i in range(len(self.hosts.names)):
            self.kill_host(i)  # slurmstepd and its tasks, which are no children of ours
        for proc in [*self.jobs, *self.daemons]:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)
        wait_for(
            lambda: not any(self.pids(i) for i in range(len(self.hosts.names))), 15,
            what="every process of the Slurm hosts gone",
        )  # fmt: skip
