"""The composition root: from a parsed command line to a running agent.

``launch(config)`` is what the ``relaunch`` command does after parsing its flags:
it installs the signal handlers, builds the rendezvous handler and the agent's
:class:`~relaunch.agent.WorkerSpec` from the :class:`~relaunch.config.LaunchConfig`,
runs the agent and turns its result into an exit code and the root-cause report.
The agent knows the WorkerSpec only; everything about flags lives on this side.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from relaunch._endpoint import any_address
from relaunch.agent import (
    LocalAgent,
    RoundHook,
    RoundStart,
    RunResult,
    SnapshotFacts,
    SnapshotSource,
    WorkerSpec,
    WorkerState,
)
from relaunch.checkpoint._area import SnapshotArea
from relaunch.checkpoint._peers import PeerRound
from relaunch.checkpoint._restores import Restore
from relaunch.config import LaunchConfig
from relaunch.errors import ChildFailedError, ConfigError, RelaunchError, StoreError
from relaunch.procs import Entrypoint, raise_open_files_limit
from relaunch.rendezvous import RendezvousHandler, ReplicatedStore, SharedBoard
from relaunch.status import StatusServer
from relaunch.store import Store

__all__ = ["build_spec", "create_rendezvous_handler", "launch"]

log = logging.getLogger(__name__)


def create_rendezvous_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous handler the config asks for. Raises ConfigError on bad parameters."""
    from relaunch.rendezvous.static import StandaloneRendezvousHandler

    if config.alone:
        return StandaloneRendezvousHandler(config.rdzv_id)
    params = config.rendezvous_parameters()
    if config.rdzv_backend == "static":
        from relaunch.rendezvous.static import create_static_handler

        return create_static_handler(params)
    from relaunch.rendezvous.registry import create_handler

    return create_handler(params)


def _entrypoint(config: LaunchConfig) -> Entrypoint:
    if config.no_python and not config.run_path:
        return Entrypoint(kind="binary", target=config.entrypoint)
    if config.module:
        return Entrypoint(kind="module", target=config.entrypoint)
    return Entrypoint(kind="script", target=config.entrypoint, run_path=config.run_path)


def _worker_base_env(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    env = dict(environ)
    if "OMP_NUM_THREADS" not in env and config.nproc_per_node > 1:
        log.warning(
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 by default, "
            "to avoid your system being overloaded; tune it for optimal performance."
        )
        env["OMP_NUM_THREADS"] = "1"
    # torchrun exports the signals it handles; scripts may read it.
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
        signal.Signals(s).name for s in config.signals_to_handle
    )
    return env


def build_spec(
    config: LaunchConfig,
    handler: RendezvousHandler,
    environ: Mapping[str, str],
    round_hooks: tuple[RoundHook, ...] = (),
    snapshots: SnapshotSource | None = None,
) -> WorkerSpec:
    """The agent's WorkerSpec for a parsed command line."""
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=_entrypoint(config),
        args=config.args,
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=config.master_addr if config.rdzv_backend == "static" else None,
        master_port=config.master_port if config.rdzv_backend == "static" else None,
        local_addr=config.local_addr,
        redirects=config.redirects,
        tee=config.tee,
        local_ranks_filter=config.local_ranks_filter,
        log_line_prefix_template=config.log_line_prefix_template,
        log_dir=config.log_dir,
        exit_barrier_timeout=config.exit_barrier_timeout,
        warm_standby=config.warm_standby,
        hang_timeout=config.hang_timeout or None,
        stop_grace=config.shutdown_timeout,
        watchdog=config.watchdog,
        watchdog_file=config.watchdog_file,
        base_env=_worker_base_env(config, environ),
        round_hooks=round_hooks,
        snapshots=snapshots,
    )


class _Snapshots:
    """The node's snapshot area as the agent sees it: told of each round (the peer
    copies), read for the status report."""

    def __init__(self, area: SnapshotArea) -> None:
        self._area = area

    def snapshot_facts(self) -> SnapshotFacts:
        try:
            restores = self._area.restores()
            return SnapshotFacts(
                newest=self._area.newest_steps(),
                restores=len(restores),
                steps_redone=sum(
                    Restore(0, step, newest, source).redone for step, newest, source in restores
                ),
            )
        except OSError as exc:
            log.warning("cannot read the snapshot directory for the status: %s", exc)
            return SnapshotFacts()

    def round_started(self, start: RoundStart) -> None:
        info = start.info
        self._area.round_started(
            PeerRound(
                store=info.store,
                round_number=info.round,
                group_rank=info.rank,
                world_size=info.world_size,
                ranks=start.ranks,
                addr=start.addr,
                admits=info.admits,
                earlier=info.earlier,
            )
        )


class _JobSource:
    """Reads the job's status document for the status page, over a store connection of
    its own (made on first use, made again after a failure)."""

    def __init__(self, config: LaunchConfig, agent: LocalAgent, handler: RendezvousHandler) -> None:
        self._config = config
        self._agent = agent
        self._handler = handler
        self._store: Store | None = None

    def __call__(self) -> dict[str, Any]:
        from relaunch.status import local_document, read_job

        config = self._config
        backend = "standalone" if config.alone else config.rdzv_backend
        if backend not in ("c10d", "etcd"):  # nodes share no store: this node alone
            return local_document(self._agent.status_report, run_id=config.rdzv_id, backend=backend)
        from relaunch.rendezvous.registry import connect_store

        try:
            if self._store is None:
                # the embedded store's members this agent knows: not only the endpoint
                handler = self._handler
                members = handler.store_endpoints() if isinstance(handler, ReplicatedStore) else []
                params = config.rendezvous_parameters()
                self._store = connect_store(params, timeout=5.0, members=members)
            doc = read_job(self._store, config.rdzv_id, backend=backend)
            if isinstance(self._handler, ReplicatedStore):
                doc.update(_store_members(self._handler.store_endpoints()))
            return doc
        except StoreError:
            self.close()
            raise

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()


def _store_members(endpoints: list[tuple[str, int]]) -> dict[str, Any]:
    """The embedded store's members and their health, as ``relaunch status`` shows them
    (``store_members``); nothing when there are none or none answers (the page shows
    the job still)."""
    if not endpoints:
        return {}
    from relaunch.rendezvous._embedded_setup import members_health

    try:
        return {"store_members": members_health(endpoints, timeout=2.0)}
    except StoreError as exc:
        log.warning("status page: the store's members could not be listed: %s", exc)
        return {}


def _status_server(
    config: LaunchConfig, agent: LocalAgent, handler: RendezvousHandler
) -> tuple[StatusServer, _JobSource] | None:
    """The status page's server, listening, or None (off, or its port is taken: warned)."""
    if config.status_port is None:
        return None
    source = _JobSource(config, agent, handler)
    server = StatusServer(config.status_host, config.status_port, source)
    if not server.start():
        return None
    log.info("status page on http://%s:%s/", config.status_host, server.port)
    return server, source


def _program(config: LaunchConfig) -> str:
    """What this node runs, as a command line: nodes of one job must agree on it."""
    head = ["-m", config.entrypoint] if config.module else [config.entrypoint]
    if config.no_python:
        head = ["--no-python", config.entrypoint]
    return shlex.join([*head, *config.args])


class _Unwind(BaseException):
    """Raised by the signal handler while this node makes its rendezvous handler, which
    may connect to the store for up to the join timeout with no agent yet to stop (a
    BaseException: no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Joining:
    """Whether a signal now unwinds the making of the rendezvous handler."""

    now = False


def _error(message: str) -> None:
    print(f"relaunch: error: {message}", file=sys.stderr, flush=True)


def launch(config: LaunchConfig, environ: Mapping[str, str] | None = None) -> int:
    """Run the job on this node; return the exit code for the process.

    0 when every worker succeeded; 1 when workers failed for good (the root-cause
    report is printed to stderr); 128+N when stopped by signal N; 2 for a
    configuration the rendezvous backend refuses.
    """
    environ = os.environ if environ is None else environ
    raise_open_files_limit()  # (the stores this node hosts: a connection per node, per worker)
    received: list[int] = []
    agents: list[LocalAgent] = []
    joining = _Joining()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for agent_ in agents:
            agent_.request_stop(signum)
        if joining.now:  # no agent yet to stop: end the handler's making (a connect)
            joining.now = False
            raise _Unwind(signum)

    # Handlers first: from here on a signal is never the default, process-killing one.
    previous = {}
    for sig in config.signals_to_handle:
        try:
            previous[sig] = signal.signal(sig, on_signal)
        except (OSError, ValueError):
            log.warning("cannot handle signal %s", sig)
    try:
        area = _snapshot_area(config)
        try:
            area.open()
        except OSError as exc:
            _error(f"cannot prepare the snapshot directory: {exc}")
            return 2
        try:
            code = _launch(
                config, {**environ, **area.env()}, agents, received, _Snapshots(area), joining
            )
            line = area.summary()
            if line is not None:
                print(f"relaunch: {line}", file=sys.stderr, flush=True)
            return code
        finally:
            area.close()
    finally:
        for sig, handler_ in previous.items():
            signal.signal(sig, handler_)


def _snapshot_area(config: LaunchConfig) -> SnapshotArea:
    peers = None  # a job of one node has no peer to copy its snapshots to
    if not config.alone and config.max_nodes > 1:
        local = config.local_addr or ""
        loopback = local.startswith("127.") or local == "localhost"
        peers = "127.0.0.1" if loopback else any_address(local)
    return SnapshotArea(
        job=config.rdzv_id,
        directory=config.snapshot_dir,
        keep=config.snapshot_keep,
        limit=config.snapshot_limit,
        durable=config.checkpoint_dir,
        peers=peers,
        guarded="secret_file" in config.rdzv_conf,
    )


def _launch(
    config: LaunchConfig,
    environ: Mapping[str, str],
    agents: list[LocalAgent],
    received: list[int],
    snapshots: _Snapshots | None,
    joining: _Joining,
) -> int:
    try:
        if received:  # (while the snapshot area was made)
            raise _Unwind(received[0])
        joining.now = True
        handler = create_rendezvous_handler(config)
        joining.now = False
        if isinstance(handler, SharedBoard):
            handler.set_program(_program(config))
        hooks = () if snapshots is None else (snapshots,)
        spec = build_spec(config, handler, environ, hooks, snapshots)
    except _Unwind as stop:
        _error(f"stopped by signal {signal.Signals(stop.signum).name} while joining the job")
        return 128 + stop.signum
    except ConfigError as exc:
        _error(str(exc))
        return 2
    except RelaunchError as exc:
        _error(str(exc))
        return 128 + received[0] if received else 1
    finally:
        joining.now = False
    agent = LocalAgent(spec)
    agents.append(agent)
    if received:
        agent.request_stop(received[0])
    status = _status_server(config, agent, handler)
    try:
        result = agent.run()
    except RelaunchError as exc:
        if agent.stop_signal is not None:
            return 128 + agent.stop_signal
        _error(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        if status is not None:
            status[0].close()
            status[1].close()
    return _exit_code(config, result, agent.stop_signal)


def _exit_code(config: LaunchConfig, result: RunResult, stop_signal: int | None) -> int:
    """The process's exit code for the agent's result; says why on stderr."""
    if result.state == WorkerState.SUCCEEDED:
        if result.reason:
            print(f"relaunch: warning: {result.reason}", file=sys.stderr, flush=True)
        return 0
    if result.reason:
        _error(result.reason)
    if result.state == WorkerState.STOPPED and stop_signal is not None:
        _error(f"stopped by signal {signal.Signals(stop_signal).name}")
        return 128 + stop_signal
    if not result.failures:
        if result.reason:
            return 1
        _error(
            "the job was closed by another node after a failure; no failure record reached this node"
        )
        return 1
    failure = ChildFailedError(name=config.entrypoint, failures=dict(result.failures))
    print(failure.format_msg(), file=sys.stderr, flush=True)
    return 1
