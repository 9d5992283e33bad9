"""Rendezvous settings and the parsing of ``--rdzv-conf`` into them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from relaunch.errors import ConfigError

__all__ = [
    "BEATS_PER_SECOND",
    "COMMON_CONF_KEYS",
    "RendezvousSettings",
    "check_conf_keys",
    "conf_seconds",
    "settings_from_conf",
]

_SECONDS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
)
COMMON_CONF_KEYS = (*_SECONDS, "keep_alive_max_attempt", "allow_mixed", "secret_file")
"""``--rdzv-conf`` keys every dynamic backend accepts."""


@dataclass(frozen=True, kw_only=True)
class RendezvousSettings:
    """What every node of a run must agree on. All durations are in seconds.

    The defaults are tuned for fast failure handling: a node whose heartbeat is
    older than ``keep_alive_interval * keep_alive_max_attempt`` (2 s) is dead, and
    every live node checks every ``keep_alive_interval`` (0.5 s), so a lost node
    is noticed within 2.5 s while a node stalled for up to 1.5 s survives (a job of
    more than 2,048 nodes beats less often: :data:`BEATS_PER_SECOND`).
    """

    run_id: str
    """The job id; the state of another run id is refused."""
    min_nodes: int
    """A round may complete with this many participants (after the last call)."""
    max_nodes: int
    """A round completes at once with this many participants; later nodes are spares."""
    join_timeout: float = 600.0
    """How long ``next_rendezvous`` may take before it raises a timeout."""
    last_call_timeout: float = 30.0
    """Extra wait for more nodes once ``min_nodes`` joined a fresh round. A round
    reopened after a loss or a restart completes as soon as every node expected
    (the previous participants still alive, the wait list and the spares) rejoined;
    for this long it holds the previous participants' seats for them (spares and new
    nodes take only the others)."""
    close_timeout: float = 30.0
    """How long closing (and a hosting node's shutdown) may take."""
    heartbeat_timeout: float = 5.0
    """How long one keep-alive write may take."""
    keep_alive_interval: float = 0.5
    """How often each node writes its heartbeat and looks for dead nodes."""
    keep_alive_max_attempt: int = 4
    """Missed heartbeats after which a node is dead."""
    allow_mixed: bool = False
    """Let nodes that run another program (heterogeneous roles) join the job; by
    default a node whose entrypoint and arguments differ from the job's is refused."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigError(f"run_id must be a non-empty string, got {self.run_id!r}")
        if not isinstance(self.min_nodes, int) or self.min_nodes < 1:
            raise ConfigError(f"min_nodes must be an integer >= 1, got {self.min_nodes!r}")
        if not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes:
            raise ConfigError(
                f"max_nodes must be an integer >= min_nodes ({self.min_nodes}), "
                f"got {self.max_nodes!r}"
            )
        for name in _SECONDS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        attempts = self.keep_alive_max_attempt
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
            raise ConfigError(f"keep_alive_max_attempt must be an integer >= 1, got {attempts!r}")

    @property
    def dead_after(self) -> float:
        """A node whose last heartbeat is older than this many seconds is dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


def check_conf_keys(conf: Mapping[str, str], valid: Iterable[str]) -> None:
    """Raise ConfigError naming the first key of ``conf`` not in ``valid``."""
    allowed = sorted(set(valid))
    for key in conf:
        if key not in allowed:
            raise ConfigError(
                f"unknown --rdzv-conf key {key!r}; valid keys are: {', '.join(allowed)}"
            )


def _number(conf: Mapping[str, str], key: str) -> float | None:
    raw = conf.get(key)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"--rdzv-conf {key} must be a positive number of seconds, got {raw!r}"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--rdzv-conf {key} must be a positive number of seconds, got {raw!r}")
    return value


def conf_seconds(conf: Mapping[str, str], key: str, default: float) -> float:
    """``conf[key]`` as a positive number of seconds, else ``default``; ConfigError naming
    the key when it is not one."""
    value = _number(conf, key)
    return default if value is None else value


BEATS_PER_SECOND = 4096
"""The heartbeats a second the store takes at most from a job whose ``--rdzv-conf``
leaves ``keep_alive_interval`` out: up to 2,048 nodes beat every 0.5 s; a bigger job
every ``max_nodes / 4096`` s (16,384 nodes: every 4 s, so a silent machine is dropped
after 16 s; a node whose processes die is still noticed by its lifeline at once). At
0.5 s, 16,384 nodes would send the store 32,768 heartbeats a second, about 74,000
calls with the steward's key: more than one store host serves."""


def settings_from_conf(
    *, run_id: str, min_nodes: int, max_nodes: int, conf: Mapping[str, str]
) -> RendezvousSettings:
    """Build settings from ``--rdzv-conf`` values (only the common keys are read here);
    without ``keep_alive_interval``, one that keeps a big job's heartbeats within
    :data:`BEATS_PER_SECOND`."""
    values: dict[str, float | int] = {}
    for key in _SECONDS:
        number = _number(conf, key)
        if number is not None:
            values[key] = number
    if "keep_alive_interval" not in values and isinstance(max_nodes, int):
        values["keep_alive_interval"] = max(0.5, max_nodes / BEATS_PER_SECOND)
    raw = conf.get("keep_alive_max_attempt")
    if raw is not None:
        try:
            values["keep_alive_max_attempt"] = int(raw)
        except ValueError:
            raise ConfigError(
                f"--rdzv-conf keep_alive_max_attempt must be an integer >= 1, got {raw!r}"
            ) from None
    mixed = conf.get("allow_mixed", "0").strip().lower()
    if mixed not in ("0", "1", "true", "false"):
        raise ConfigError(f"--rdzv-conf allow_mixed must be 0 or 1, got {mixed!r}")
    return RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        allow_mixed=mixed in ("1", "true"),
        **values,  # type: ignore[arg-type]
    )
