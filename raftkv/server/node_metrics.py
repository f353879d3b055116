"""The metrics the node's driver pushes (``raftkv.node.driver.Metrics``) into a
``raftkv serve`` registry; ``raftkv.server.metrics`` has the rest and the list of names.

Apart from that module because it needs no HTTP stack: ``raftkv serve`` opens its node
while aiohttp is still being imported (see ``raftkv.server.serve``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class PrometheusMetrics:
    """Implements ``raftkv.node.driver.Metrics``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._proposals = Counter(
            "raftkv_proposals", "Commands proposed by this node as leader", ["group"],
            registry=registry,
        )
        self._leader_changes = Counter(
            "raftkv_leader_changes", "Leaders this node has seen elected", ["group"],
            registry=registry,
        )
        self._fsync = Histogram(
            "raftkv_fsync_seconds",
            "Time of one log fsync: a group's Ready, or for group=partition-logs one loop "
            "turn's Readies of every table partition (their shared environment)", ["group"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=registry,
        )
        self._startup = Gauge(
            "raftkv_startup_seconds",
            "Seconds from this process's start to the end of each start-up phase: "
            "imported (the code loaded), opened (the default group's stores open and "
            "replayed), elected (a leader known), committed (that leader's first entry "
            "committed: writes are served), http (the API listening)", ["phase"],
            registry=registry,
        )
        # Each group's labelled children, kept: ``labels()`` takes a lock and builds a
        # tuple, and every turn reports proposals per proposing group and each fsync.
        self._children: dict[tuple[object, str], Any] = {}

    def _of(self, metric: Counter | Histogram, group: str) -> Any:
        key = (metric, group)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(group)
        return child

    def fsync(self, group: str, seconds: float) -> None:
        self._of(self._fsync, group).observe(seconds)

    def proposals(self, group: str, n: int) -> None:
        self._of(self._proposals, group).inc(n)

    def leader_change(self, group: str) -> None:
        self._of(self._leader_changes, group).inc()

    def group_removed(self, group: str) -> None:
        for metric in (self._proposals, self._leader_changes, self._fsync):
            if self._children.pop((metric, group), None) is not None:
                metric.remove(group)

    def startup(self, phase: str, seconds: float) -> None:
        self._startup.labels(phase).set(seconds)
