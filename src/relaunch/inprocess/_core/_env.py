"""Everything the wrapper reads from the environment, read in one place."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from relaunch._contract import MARKER_ENV, call_namespace
from relaunch.errors import ConfigError
from relaunch.inprocess._core._logs import get_logger

__all__ = ["StoreEndpoint", "announce_to_agent", "namespace", "resolve_store"]

AGENT_MARKER_ENV = MARKER_ENV

_calls = itertools.count()


def namespace(env: Mapping[str, str] | None = None) -> str:
    """Key prefix unique per job, per launcher restart and per wrapped call.

    All ranks call wrapped functions in the same order, so the call counter agrees.
    """
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID", "standalone")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return call_namespace(run_id, attempt, next(_calls))


def announce_to_agent(
    env: Mapping[str, str] | None = None, *, iteration: int | None = None, active: bool = True
) -> None:
    """Tell a relaunch agent that this worker restarts in-process (and, from the first
    iteration on, which iteration it is in and whether it is active: ``relaunch status``
    shows them).

    The agent names a file in ``RELAUNCH_INPROCESS_MARKER``; while it exists, the
    death of this worker is not a reason to stop its in-process peers, which go on
    without it. It stays until the attempt ends (a rank this wrapper terminated
    must not bring its peers down either). Other launchers do not set the variable.
    The file is replaced atomically: the agent never reads half of it.
    """
    env = os.environ if env is None else env
    path = env.get(AGENT_MARKER_ENV)
    if not path:
        return
    doc: dict[str, object] = {"version": 1, "pid": os.getpid()}
    if iteration is not None:
        doc.update(iteration=iteration, active=active)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(doc) + "\n")
        os.replace(path + ".tmp", path)
    except OSError as exc:
        get_logger(__name__).warning("cannot write %s=%s: %s", AGENT_MARKER_ENV, path, exc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreEndpoint:
    """Where the default coordination store is, and whether rank 0's monitor hosts it."""

    host: str
    port: int
    hosted_by_rank0: bool
    timeout: float


def resolve_store(
    store_kwargs: Mapping[str, Any], timeout: float, env: Mapping[str, str] | None = None
) -> StoreEndpoint:
    """The default store: the agent's (``TORCHELASTIC_USE_AGENT_STORE=True``, at
    ``MASTER_PORT``) or one hosted by rank 0's monitor process.

    ``store_kwargs`` may give ``host`` and ``port``. Standalone, the default port is
    ``MASTER_PORT + 1`` (``MASTER_PORT`` stays free for the user's own use); a port
    given other than the agent's ``MASTER_PORT`` is hosted by rank 0.
    """
    env = os.environ if env is None else env
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("true", "1")
    host = store_kwargs.get("host", env.get("MASTER_ADDR", "127.0.0.1"))
    port_text = store_kwargs.get("port")
    if port_text is None:
        master_port = env.get("MASTER_PORT")
        if master_port is None:
            raise ConfigError(
                "store_kwargs: no 'port' and MASTER_PORT is not set: "
                "expected a store endpoint (run under relaunch/torchrun or set MASTER_PORT)"
            )
        port_text = int(master_port) if agent else int(master_port) + 1
    try:
        port = int(port_text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"store_kwargs['port']: expected an int, got {port_text!r}") from exc
    unknown = set(store_kwargs) - {"host", "port", "timeout"}
    if unknown:
        raise ConfigError(
            f"store_kwargs: unknown keys {sorted(unknown)}; expected host, port, timeout"
        )
    if "timeout" in store_kwargs:
        timeout = _seconds(store_kwargs["timeout"])
    # A port of the program's own (NVIDIA's examples use MASTER_PORT + 2) is hosted by
    # rank 0, as NVIDIA's wrapper does, even under an agent that hosts MASTER_PORT.
    agents = agent and str(port) == env.get("MASTER_PORT", "").strip()
    return StoreEndpoint(host=str(host), port=port, hosted_by_rank0=not agents, timeout=timeout)


def _seconds(value: object) -> float:
    """``store_kwargs['timeout']``: a timedelta (NVIDIA's type) or seconds, > 0."""
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ConfigError(
            f"store_kwargs['timeout']: expected a positive datetime.timedelta or seconds, "
            f"got {value!r}"
        )
    return float(seconds)


def tcp_client_factory(endpoint: StoreEndpoint) -> Callable[[], Any]:
    """A factory of torch TCPStore clients connected to ``endpoint``."""

    def make() -> Any:
        from torch._C._distributed_c10d import TCPStore

        return TCPStore(
            endpoint.host,
            endpoint.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=endpoint.timeout),
        )

    return make


def refuse_initialized_group() -> None:
    """NVIDIA's precondition: the wrapped function initializes the process group itself
    (at every iteration), so none may exist when it is called."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ConfigError(
            "expected not torch.distributed.is_initialized() when the wrapped function is "
            "called: the function initializes the process group (at every iteration)"
        )


def warn_if_logging_is_off() -> None:
    """Warn (as NVIDIA's wrapper does) when the root logger has no handler."""
    import logging
    import warnings

    if not logging.getLogger().hasHandlers():
        warnings.warn(
            "logging is not configured (the root logger has no handler): the in-process "
            "wrapper's records go nowhere; call logging.basicConfig() to see them",
            UserWarning,
            stacklevel=4,
        )


class StallClock:
    """How long a rank has made no progress across restarts.

    A rank whose iterations keep ending by its own soft timeout makes no progress,
    however often it restarts: :meth:`observe` gets, after each iteration, when its
    last progress was if the iteration ended by its soft timeout (else None), and
    returns for how long the rank has been stalled (None: it is not, or not yet for
    :attr:`MIN_ITERATIONS` iterations in a row). NVIDIA's wrapper
    kills such a rank at the hard timeout; relaunch's early wake-up at the soft
    timeout would otherwise restart it forever.
    """

    MIN_ITERATIONS = 3
    """Stalled iterations in a row before the rank counts as stuck: a rank blocked in a
    collective by a peer that hung also times out, once; then the peer is gone."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.count = 0

    def observe(self, stalled_at: float | None, now: float) -> float | None:
        if stalled_at is None:
            self.since, self.count = None, 0
            return None
        if self.since is None:
            self.since = stalled_at
        self.count += 1
        return now - self.since if self.count >= self.MIN_ITERATIONS else None

    def overdue(self, stalled_at: float | None, hard_timeout: float, rank: int) -> str | None:
        """After an iteration: why ``rank`` must leave (no progress for ``hard_timeout``
        across restarts), or None."""
        stalled = self.observe(stalled_at, time.monotonic())
        if stalled is None or stalled < hard_timeout:
            return None
        return (
            f"rank {rank}: no progress for {stalled:.1f} s across restarts "
            f"(hard_timeout {hard_timeout:g} s)"
        )


def store_factory(cfg: Any, initial_rank: int) -> tuple[Callable[[], Any], int | None]:
    """The factory of the wrapper's store clients, and the port this rank's monitor
    process hosts the store on (standalone rank 0), or None."""
    kwargs = cfg.store_kwargs or {}
    if cfg.store_factory is None:
        endpoint = resolve_store(kwargs, cfg.seconds("barrier_timeout"))
        host = endpoint.port if endpoint.hosted_by_rank0 and initial_rank == 0 else None
        return tcp_client_factory(endpoint), host
    factory = cfg.store_factory
    return (lambda: factory(**kwargs)), None


def terminate_self(why: str, grace: float) -> None:
    """End this rank as NVIDIA's monitor process ends a rank at its hard timeout:
    SIGTERM (the process's own handler, if any, runs), SIGKILL after ``grace``."""
    from relaunch.procs import terminate

    get_logger(__name__).error("%s: terminating (SIGTERM, SIGKILL after %g s)", why, grace)
    terminate(os.getpid(), lambda: False, grace=grace, what="this rank")
