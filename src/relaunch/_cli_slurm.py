"""Slurm's job step as defaults of the command line: ``srun relaunch train.py`` needs no
rendezvous flags.

Inside a job step of several nodes (``srun --nodes=N --ntasks-per-node=1 relaunch
--nproc-per-node=G train.py``), what torchrun users pass by hand comes from Slurm's
environment, unless a flag or a ``PET_`` variable gives it:

- ``--nnodes``: ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES``);
- ``--rdzv-id``: ``SLURM_JOB_ID.SLURM_STEP_ID`` (Slurm's own name of the step, e.g.
  ``1234.0``: two steps of one job never share a rendezvous);
- without ``--rdzv-backend``, ``--rdzv-endpoint``, ``--master-addr`` and
  ``--master-port``: ``--rdzv-backend c10d`` at the step's first host (of
  ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``), port 29400, hosted by node 0
  (``SLURM_NODEID``; ``is_host`` in ``--rdzv-conf`` unless given there);
- with ``--rdzv-backend c10d`` and no endpoint: the same endpoint;
- with the static backend (``--rdzv-backend static``, or an endpoint without a backend):
  ``--master-addr`` the first host (when no endpoint is given) and ``--node-rank``
  ``SLURM_NODEID``.

"Inside a step" means ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` are set: a batch script has
``SLURM_PROCID=0`` but no step id, and runs once, on the first node only. A step of one
node, ``--standalone`` or ``--nnodes 1`` change nothing. Several tasks on a node (several
agents on one node's devices) are refused when anything is taken from Slurm.

Reads only the mapping it is given (the command line passes ``os.environ``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from relaunch._cli_values import Values
from relaunch._endpoint import C10D_PORT, join_endpoint
from relaunch._hostlist import first_host
from relaunch._parse import parse_nnodes
from relaunch.errors import ConfigError

__all__ = ["SlurmDefaults", "SlurmStep", "read_step", "slurm_defaults"]

logger = logging.getLogger(__name__)

_RENDEZVOUS = ("rdzv_backend", "rdzv_endpoint", "master_addr", "master_port")
_TASKS_RE = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True, kw_only=True)
class SlurmStep:
    """What Slurm's environment says about the job step this process is a task of."""

    job_id: str
    """``SLURM_JOB_ID``."""
    step_id: str
    """``SLURM_STEP_ID``."""
    num_nodes: int
    """Nodes of the step."""
    nodes_var: str
    """The variable ``num_nodes`` was read from."""
    node_id: int
    """This node's index in the step (``SLURM_NODEID``), 0 for the first host."""
    first_host: str
    """The step's first host (node 0), as Slurm names it."""
    hosts_var: str
    """The variable ``first_host`` was read from."""
    tasks_per_node: int
    """The most tasks Slurm starts on one node of the step."""
    tasks_text: str
    """Where ``tasks_per_node`` comes from, as ``VARIABLE=value``, for messages."""

    def __post_init__(self) -> None:
        if not 0 <= self.node_id < self.num_nodes:
            raise ConfigError(
                f"SLURM_NODEID: expected a node index below {self.num_nodes} "
                f"({self.nodes_var}), got {self.node_id}"
            )

    @property
    def run_id(self) -> str:
        return f"{self.job_id}.{self.step_id}"


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` set to a non-blank value."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _count(name: str, text: str, low: int) -> int:
    if not re.fullmatch(r"\d+", text) or int(text) < low:
        raise ConfigError(f"{name}: expected an integer >= {low}, got {text!r}")
    return int(text)


def _tasks_per_node(env: Mapping[str, str], num_nodes: int) -> tuple[int, str]:
    """(the most tasks on one node, ``VARIABLE=value``) of the step."""
    found = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is not None:
        name, text = found
        counts = [_TASKS_RE.fullmatch(item.strip()) for item in text.split(",")]
        if all(counts):
            return max(int(m[1]) for m in counts if m), f"{name}={text}"
        raise ConfigError(f"{name}: expected counts like 2(x3),1, got {text!r}")
    found = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if found is not None:
        name, text = found
        return math.ceil(_count(name, text, 1) / num_nodes), f"{name}={text}"
    return 1, "one task per node"


def read_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The Slurm job step of several nodes this process is a task of, or None (not in a
    step, or a step of one node). Raises ConfigError naming a malformed variable."""
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    step = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
    nodes = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if job is None or step is None or nodes is None:
        return None
    num_nodes = _count(*nodes, low=1)
    if num_nodes == 1:
        return None
    hosts = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if hosts is None:
        raise ConfigError(
            f"SLURM_STEP_NODELIST: expected the step's hosts ({nodes[0]}={num_nodes}), got none"
        )
    node_id = _first(env, "SLURM_NODEID")
    tasks, tasks_text = _tasks_per_node(env, num_nodes)
    return SlurmStep(
        job_id=job[1],
        step_id=step[1],
        num_nodes=num_nodes,
        nodes_var=nodes[0],
        node_id=_count("SLURM_NODEID", node_id[1] if node_id else "", low=0),
        first_host=first_host(hosts[1], hosts[0]),
        hosts_var=hosts[0],
        tasks_per_node=tasks,
        tasks_text=tasks_text,
    )


@dataclass(frozen=True)
class SlurmDefaults:
    """The settings taken from Slurm: each ``dest -> (value, source)``, used after the
    flags and ``PET_`` variables, before the defaults (:meth:`Values.with_fallback`)."""

    fallback: dict[str, tuple[str, str]] = field(default_factory=dict)
    is_host: bool | None = None
    """Whether this node hosts the c10d store, when the endpoint is Slurm's first host."""
    summary: str | None = None
    """One line saying what was taken, or None when nothing was."""

    def conf(self, conf: dict[str, str]) -> dict[str, str]:
        """``--rdzv-conf`` with ``is_host`` for Slurm's endpoint, unless it names one."""
        if self.is_host is None or "is_host" in conf:
            return conf
        return {**conf, "is_host": str(int(self.is_host))}


def _single_node(values: Values) -> bool:
    """Whether the flags or PET_ variables ask for one node (``--nnodes 1``)."""
    if not values.explicit("nnodes"):
        return False
    try:
        return parse_nnodes(values.stripped("nnodes"))[1] == 1
    except ConfigError:
        return False  # the command line reports it, naming the flag


def slurm_defaults(values: Values, env: Mapping[str, str]) -> SlurmDefaults:
    """What to take from Slurm's environment ``env``, given what ``values`` (flags and
    PET_ variables) already say. Raises ConfigError for a malformed SLURM_ variable, or
    for several tasks per node when anything would be taken from Slurm."""
    step = read_step(env)
    if step is None or values.switch("standalone") or _single_node(values):
        return SlurmDefaults()
    fallback: dict[str, tuple[str, str]] = {}
    if not values.explicit("nnodes"):
        fallback["nnodes"] = (str(step.num_nodes), step.nodes_var)
    if not values.explicit("rdzv_id"):
        fallback["rdzv_id"] = (step.run_id, "SLURM_JOB_ID.SLURM_STEP_ID")
    if values.explicit("rdzv_backend"):
        backend = values.stripped("rdzv_backend")
    else:
        backend = "static" if any(values.explicit(d) for d in _RENDEZVOUS) else "c10d"
        if backend == "c10d":
            fallback["rdzv_backend"] = ("c10d", f"Slurm, a step of {step.num_nodes} nodes")
    is_host = None
    if backend == "c10d" and not values.explicit("rdzv_endpoint"):
        endpoint = join_endpoint(step.first_host, C10D_PORT)
        fallback["rdzv_endpoint"] = (endpoint, f"{step.hosts_var}'s first host")
        is_host = step.node_id == 0
    if backend == "static":
        if not values.explicit("rdzv_endpoint") and not values.explicit("master_addr"):
            fallback["master_addr"] = (step.first_host, f"{step.hosts_var}'s first host")
        if not values.explicit("node_rank"):
            fallback["node_rank"] = (str(step.node_id), "SLURM_NODEID")
    several = step.tasks_per_node > 1
    if several and fallback:
        raise ConfigError(
            f"{step.tasks_text}: expected one relaunch per node (srun --ntasks-per-node=1), "
            "which starts --nproc-per-node workers itself"
        )
    if several:
        logger.warning("%s: several relaunch agents per node", step.tasks_text)
    return SlurmDefaults(fallback, is_host, _summary(step, fallback, backend) if fallback else None)


def _summary(step: SlurmStep, fallback: Mapping[str, tuple[str, str]], backend: str) -> str:
    parts = [f"{key}={fallback[key][0]}" for key in ("nnodes", "node_rank") if key in fallback]
    if "node_rank" not in fallback:  # c10d ranks the nodes itself; the store host is 0
        parts.append(f"node {step.node_id} of the step")
    if "rdzv_endpoint" in fallback:
        where = ", hosted on this node" if step.node_id == 0 else ""
        parts.append(f"rdzv endpoint {fallback['rdzv_endpoint'][0]} ({backend}{where})")
    if "master_addr" in fallback:
        parts.append(f"master addr {fallback['master_addr'][0]} ({backend})")
    if "rdzv_id" in fallback:
        parts.append(f"rdzv id {fallback['rdzv_id'][0]}")
    return "from Slurm: " + ", ".join(parts)
