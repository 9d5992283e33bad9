"""The Prometheus metrics of a job document (``/metrics`` of the status server)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from relaunch.status._document import JobDocument, RecoverySeconds, as_document

__all__ = ["render_metrics"]


class _Collector:
    """The metrics of one document, for a registry of their own."""

    def __init__(self, doc: JobDocument) -> None:
        self._doc = doc

    def collect(self) -> Iterator[Metric]:
        """Every family of the document, each labelled with the job's ``run_id``."""
        doc = self._doc
        job = [doc["run_id"]]
        yield from _budget(doc, job)
        yield _recovery_seconds(doc["recovery_seconds"], job)
        yield from _world(doc, job)
        yield from _snapshot_families(doc, job)


_LABELS = ["run_id"]


def _gauge(name: str, help_: str, job: list[str], value: float) -> GaugeMetricFamily:
    """A gauge of the job alone."""
    g = GaugeMetricFamily(name, help_, labels=_LABELS)
    g.add_metric(job, value)
    return g


def _counter(name: str, help_: str, job: list[str], value: float) -> CounterMetricFamily:
    """A counter of the job alone."""
    c = CounterMetricFamily(name, help_, labels=_LABELS)
    c.add_metric(job, value)
    return c


def _budget(doc: JobDocument, job: list[str]) -> Iterator[Metric]:
    """The restarts (used, allowed), the faults by kind, the recoveries by tier."""
    yield _counter("relaunch_restarts", "Failure restarts of the job", job, doc["restarts"]["used"])
    if doc["restarts"]["max"] is not None:
        yield _gauge(
            "relaunch_restarts_max", "Failure restarts allowed", job, doc["restarts"]["max"]
        )
    faults = CounterMetricFamily(
        "relaunch_faults", "Worker faults by kind", labels=[*_LABELS, "kind"]
    )
    for kind, n in doc["faults"].items():
        faults.add_metric([*job, kind], n)
    yield faults
    tiers = CounterMetricFamily(
        "relaunch_recoveries", "Recoveries by tier", labels=[*_LABELS, "tier"]
    )
    for tier, n in doc["recoveries"].items():
        tiers.add_metric([*job, tier], n)
    yield tiers


def _recovery_seconds(rec: RecoverySeconds, job: list[str]) -> HistogramMetricFamily:
    """The recovery times as a Prometheus histogram (cumulative buckets, ``+Inf`` last)."""
    cumulative, buckets = 0, []
    for bound, n in zip([*rec["bounds"], float("inf")], rec["buckets"], strict=True):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
    hist = HistogramMetricFamily(
        "relaunch_recovery_seconds", "Seconds from a fault to workers running again",
        labels=_LABELS,
    )  # fmt: skip
    hist.add_metric(job, buckets, rec["sum"])
    return hist


def _world(doc: JobDocument, job: list[str]) -> Iterator[Metric]:
    """The round, the world's sizes, each node's heartbeat age."""
    world = doc["world"]
    yield _gauge("relaunch_round", "Rendezvous round", job, doc["round"]["number"])
    yield _gauge("relaunch_world_nodes", "Nodes in the round", job, world["nodes"])
    yield _gauge("relaunch_world_workers", "Workers reported", job, world["workers"])
    yield _gauge("relaunch_nodes_waiting", "Nodes waiting to join", job, world["nodes_waiting"])
    yield _gauge("relaunch_spares", "Spare nodes", job, world["spares"])
    beats = GaugeMetricFamily(
        "relaunch_heartbeat_age_seconds", "Age of a node's last heartbeat",
        labels=[*_LABELS, "node"],
    )  # fmt: skip
    for row in doc["nodes"]:
        if row["heartbeat_age"] is not None:
            beats.add_metric([*job, row["node"]], row["heartbeat_age"])
    yield beats


def _snapshot_families(doc: JobDocument, job: list[str]) -> Iterator[Metric]:
    """Each rank's newest snapshot step, the restores and the steps redone."""
    steps = GaugeMetricFamily(
        "relaunch_snapshot_step", "Step of a rank's newest complete snapshot",
        labels=[*_LABELS, "rank"],
    )  # fmt: skip
    for row in doc["nodes"]:
        for w in () if row["report"] is None else row["report"]["workers"]:
            if w["snapshot"] is not None:
                steps.add_metric([*job, str(w["rank"])], w["snapshot"])
    yield steps
    snap = doc["snapshots"]
    restores, redone = (0, 0) if snap is None else (snap["restores"], snap["steps_redone"])
    yield _counter("relaunch_snapshot_restores", "Restores from snapshots", job, restores)
    yield _counter("relaunch_steps_redone", "Steps the job did again after restores", job, redone)


def render_metrics(doc: Mapping[str, object]) -> bytes:
    """The document in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(as_document(doc)))
    return generate_latest(registry)
