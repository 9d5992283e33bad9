"""The launch configuration: what the command line (or a Python caller) asks the agent to do.

:class:`LaunchConfig` is frozen, keyword-only and validated on construction: a bad value
raises :class:`relaunch.errors.ConfigError` naming the field and what was expected.
The value parsers (:meth:`Std.parse`, :func:`parse_nnodes`, :func:`parse_rdzv_conf`,
:func:`parse_signals`, :func:`parse_endpoint`) are shared with the CLI; each takes the
``name`` to put in its error message (a flag such as ``--nnodes`` or a field name).

This module never reads the environment and never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from relaunch._parse import bad as _bad
from relaunch._parse import (
    check_run_id,
    check_template,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
    signal_number,
)
from relaunch.procs import Std

if TYPE_CHECKING:
    from relaunch.rendezvous import RendezvousParameters

__all__ = [
    "BACKENDS",
    "DEFAULT_SIGNALS",
    "START_METHODS",
    "LaunchConfig",
    "Std",
    "check_run_id",
    "check_template",
    "parse_endpoint",
    "parse_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
    "parse_std",
]

BACKENDS = ("static", "c10d", "etcd")
"""The rendezvous backends relaunch implements."""
START_METHODS = ("spawn", "fork", "forkserver")
"""torchrun's start methods: fork and forkserver fork workers from relaunch's fork server,
spawn starts a fresh interpreter for each."""
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's default ``--signals-to-handle``."""


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):  # type: ignore[operator]
        limit = f"{low} <= n" + (f" <= {high}" if high is not None else "")
        raise _bad(name, f"an integer with {limit}", value)


def _check_float(name: str, value: object, *, positive: bool) -> float:
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else -1
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise _bad(name, "a finite number " + ("> 0" if positive else ">= 0"), value)
    return number


def _check_text(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise _bad(name, "a non-empty string" + (" or None" if optional else ""), value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _bad(name, "True or False", value)


def _std_map(name: str, value: object, nproc: int) -> Mapping[int, Std]:
    expected = f"a mapping of local ranks 0..{nproc - 1} to Std"
    if not isinstance(value, Mapping):
        raise _bad(name, expected, value)
    result: dict[int, Std] = {}
    for rank, std in value.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < nproc:
            raise _bad(name, expected, dict(value))
        if not isinstance(std, int) or isinstance(std, bool) or not 0 <= std <= 3:
            raise _bad(name, expected, dict(value))
        result[rank] = Std(std)
    return MappingProxyType(Std.to_map(result, nproc))


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Everything the agent needs to run one job on this node. Validated on construction.

    Raises ConfigError naming the first bad field and what was expected.
    """

    min_nodes: int
    """Fewest nodes a round may start with (``--nnodes MIN:MAX``), >= 1."""
    max_nodes: int
    """Most nodes a round may have, >= ``min_nodes``; equal to it for ``static``."""
    nproc_per_node: int
    """Workers per node (``LOCAL_WORLD_SIZE``), already resolved from auto/cpu/gpu, >= 1."""
    node_rank: int = 0
    """This node's fixed rank for ``static`` (0 <= node_rank < max_nodes); ignored otherwise."""
    rdzv_backend: str
    """``"static"``, ``"c10d"`` or ``"etcd"``."""
    rdzv_endpoint: str
    """``host:port`` (static, c10d; port 0 = pick a free one) or a comma-separated etcd list."""
    rdzv_id: str
    """The job id shared by all nodes (``TORCHELASTIC_RUN_ID``)."""
    rdzv_conf: Mapping[str, str]
    """``--rdzv-conf`` key/value pairs as given; the backend validates its keys."""
    standalone: bool
    """``--standalone`` was asked for (single node, c10d on 127.0.0.1:0, fresh run id)."""
    max_restarts: int
    """Worker group restarts allowed before the job fails, >= 0."""
    monitor_interval: float
    """Seconds between two checks of the workers, > 0."""
    start_method: str
    """How workers start: ``"forkserver"`` or ``"fork"``, forked from a fork server that has
    imported what the workers import (fast restarts; started while restarts remain or
    the job's membership can change, and not for ``no_python`` entrypoints);
    ``"spawn"``, a fresh interpreter each."""
    role: str
    """The workers' role (``ROLE_NAME``)."""
    entrypoint: str
    """The script path, the module name (``module``) or the binary (``no_python``)."""
    args: tuple[str, ...]
    """Arguments for the entrypoint; ``${local_rank}`` is substituted by the agent."""
    module: bool
    """Run ``entrypoint`` as ``python -m entrypoint``."""
    no_python: bool
    """Execute ``entrypoint`` directly, not through Python."""
    run_path: bool
    """Run the script with ``runpy.run_path`` in an interpreter (never with module/no_python)."""
    log_dir: str | None
    """Base directory for per-attempt logs; None = a temporary directory."""
    redirects: Mapping[int, Std]
    """Per local rank (0..nproc_per_node-1): streams written to log files only."""
    tee: Mapping[int, Std]
    """Per local rank (0..nproc_per_node-1): streams written to log files and the console."""
    local_ranks_filter: frozenset[int] | None
    """Local ranks whose output is shown on the console; None = all of them."""
    master_addr: str | None
    """``--master-addr`` when given (static uses it in ``rdzv_endpoint``), else None."""
    master_port: int | None
    """``--master-port`` when given (0..65535), else None."""
    local_addr: str | None
    """This node's address as the others should reach it; None = let the backend decide."""
    exit_barrier_timeout: float
    """Seconds a finished node waits at the exit barrier for the others, >= 0."""
    log_line_prefix_template: str | None
    """Console prefix template using ``${role_name}``, ``${rank}``, ``${local_rank}``."""
    signals_to_handle: tuple[int, ...]
    """Signal numbers the agent catches and forwards to the workers."""
    shutdown_timeout: float = 30.0
    """Seconds between SIGTERM and SIGKILL when the agent stops workers, >= 0."""
    watchdog: bool = False
    """Serve the worker watchdog's named pipe (``TORCHELASTIC_ENABLE_FILE_TIMER=1``)."""
    watchdog_file: str | None = None
    """The named pipe's path (``TORCHELASTIC_TIMER_FILE``); a temporary one if None."""
    hang_timeout: float = 0.0
    """Seconds without Python progress in a worker's main thread that make it hung; 0: off."""
    status_port: int | None = None
    """Serve the job's status page, ``/status.json`` and ``/metrics`` on this port; None: off."""
    status_host: str = "127.0.0.1"
    """The address the status page binds to."""
    snapshot_dir: str | None = None
    """Where this node keeps its ranks' snapshots (``relaunch.checkpoint``); None: a new
    folder under /dev/shm, removed when the agent ends."""
    snapshot_keep: int = 2
    """Snapshots each rank keeps, newest first, >= 1."""
    snapshot_limit: int | None = None
    """Bytes the node's snapshots may take, all ranks together; None: half the size of
    the file system that holds them."""
    checkpoint_dir: str | None = None
    """Shared storage that receives copies of the snapshots in the background; None: off."""

    def __post_init__(self) -> None:
        self._check_rendezvous()
        self._check_workers()
        self._check_output()
        self._check_services()
        self._check_signals()

    def _check_rendezvous(self) -> None:
        """The nodes, the backend, its endpoint, the job id and ``rdzv_conf``."""
        _check_int("min_nodes", self.min_nodes, 1)
        _check_int("max_nodes", self.max_nodes, self.min_nodes)
        _check_int("nproc_per_node", self.nproc_per_node, 1)
        if self.rdzv_backend not in BACKENDS:
            raise _bad("rdzv_backend", " or ".join(map(repr, BACKENDS)), self.rdzv_backend)
        static = self.rdzv_backend == "static"
        if static and self.min_nodes != self.max_nodes:
            raise _bad("max_nodes", "max_nodes == min_nodes for the static backend", self.max_nodes)
        _check_int("node_rank", self.node_rank, 0, self.max_nodes - 1 if static else None)
        _check_text("rdzv_endpoint", self.rdzv_endpoint)
        for item in self.rdzv_endpoint.split(","):
            parse_endpoint(item, None, "rdzv_endpoint")
        check_run_id(self.rdzv_id, "rdzv_id")
        conf = self.rdzv_conf
        if not isinstance(conf, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k.strip() and v.strip()
            for k, v in conf.items()
        ):
            raise _bad("rdzv_conf", "a mapping of non-empty str to non-empty str", conf)
        self._set("rdzv_conf", MappingProxyType(dict(conf)))

    def _check_workers(self) -> None:
        """What the workers run and how they start and restart."""
        _check_bool("standalone", self.standalone)
        _check_int("max_restarts", self.max_restarts, 0)
        self._set(
            "monitor_interval",
            _check_float("monitor_interval", self.monitor_interval, positive=True),
        )
        if self.start_method not in START_METHODS:
            raise _bad("start_method", " or ".join(map(repr, START_METHODS)), self.start_method)
        _check_text("role", self.role)
        _check_text("entrypoint", self.entrypoint)
        if not isinstance(self.args, tuple | list) or not all(
            isinstance(a, str) for a in self.args
        ):
            raise _bad("args", "a tuple of str", self.args)
        self._set("args", tuple(self.args))
        for name in ("module", "no_python", "run_path"):
            _check_bool(name, getattr(self, name))
        if self.module and self.no_python:
            raise _bad("no_python", "False when module is True", self.no_python)
        if self.run_path and (self.module or self.no_python):
            raise _bad("run_path", "False when module or no_python is True", self.run_path)

    def _check_output(self) -> None:
        """Where the workers' output goes and how the console shows it."""
        _check_text("log_dir", self.log_dir, optional=True)
        self._set("redirects", _std_map("redirects", self.redirects, self.nproc_per_node))
        self._set("tee", _std_map("tee", self.tee, self.nproc_per_node))
        ranks = self.local_ranks_filter
        if ranks is not None:
            if not isinstance(ranks, frozenset | set) or not ranks:
                raise _bad("local_ranks_filter", "None or a non-empty frozenset of ranks", ranks)
            for rank in ranks:
                _check_int("local_ranks_filter", rank, 0)
            self._set("local_ranks_filter", frozenset(ranks))
        if self.log_line_prefix_template is not None:
            check_template(self.log_line_prefix_template, "log_line_prefix_template")

    def _check_services(self) -> None:
        """Addresses, timeouts, and what the agent serves beside the workers (the
        watchdog pipe, the status page, snapshots)."""
        _check_text("master_addr", self.master_addr, optional=True)
        if self.master_port is not None:
            _check_int("master_port", self.master_port, 0, 65535)
        _check_text("local_addr", self.local_addr, optional=True)
        timeout = _check_float("exit_barrier_timeout", self.exit_barrier_timeout, positive=False)
        self._set("exit_barrier_timeout", timeout)
        grace = _check_float("shutdown_timeout", self.shutdown_timeout, positive=False)
        self._set("hang_timeout", _check_float("hang_timeout", self.hang_timeout, positive=False))
        self._set("shutdown_timeout", grace)
        _check_bool("watchdog", self.watchdog)
        if self.status_port is not None:
            _check_int("status_port", self.status_port, 1, 65535)
        _check_text("status_host", self.status_host)
        _check_text("watchdog_file", self.watchdog_file, optional=True)
        _check_text("snapshot_dir", self.snapshot_dir, optional=True)
        _check_int("snapshot_keep", self.snapshot_keep, 2)
        if self.snapshot_limit is not None:
            _check_int("snapshot_limit", self.snapshot_limit, 1)
        _check_text("checkpoint_dir", self.checkpoint_dir, optional=True)

    def _check_signals(self) -> None:
        """The signals the agent forwards to the workers."""
        signals = self.signals_to_handle
        expected = "a tuple of distinct signal numbers that can be handled"
        if not isinstance(signals, tuple | list) or len(set(signals)) != len(signals):
            raise _bad("signals_to_handle", expected, signals)
        for number in signals:
            if not isinstance(number, int) or isinstance(number, bool):
                raise _bad("signals_to_handle", expected, signals)
            if signal_number(str(int(number))) is None:
                raise _bad("signals_to_handle", expected, signals)
        self._set("signals_to_handle", tuple(int(number) for number in signals))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @property
    def warm_standby(self) -> bool:
        """Workers are forked from the fork server (``start_method`` fork or forkserver)."""
        return self.start_method != "spawn"

    @property
    def alone(self) -> bool:
        """This node is the whole job with nothing to rendezvous with: ``--standalone``,
        torchrun's single-node default (static, or c10d on port 0, one node)."""
        if self.standalone:
            return True
        port_zero = self.rdzv_backend == "c10d" and self.rdzv_endpoint.endswith(":0")
        return self.max_nodes == 1 and (self.rdzv_backend == "static" or port_zero)

    def rendezvous_parameters(self) -> RendezvousParameters:
        """The rendezvous part of this configuration, for the backend's handler."""
        from relaunch.rendezvous import RendezvousParameters

        return RendezvousParameters(
            backend=self.rdzv_backend,
            endpoint=self.rdzv_endpoint,
            run_id=self.rdzv_id,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            local_addr=self.local_addr,
            node_rank=self.node_rank if self.rdzv_backend == "static" else None,
            conf=self.rdzv_conf,
        )
