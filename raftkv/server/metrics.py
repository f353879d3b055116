"""Prometheus metrics: counters the driver pushes, gauges read from status at scrape time.

Each server has its own ``CollectorRegistry`` (no process-global state), so several
nodes can live in one process in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


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
        self._leader_changes.labels(group).inc()


class StatusCollector(Collector):
    """Per-group Raft gauges from a node status snapshot, taken when scraped."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self._status()
        gauges = {
            name: GaugeMetricFamily(f"raftkv_{name}", doc, labels=["group"])
            for name, doc in (
                ("term", "Current Raft term"),
                ("commit_index", "Highest log index known committed"),
                ("applied_index", "Highest index applied to the state store"),
                ("checkpoint_index", "Highest index the state store made durable"),
                ("checkpoint_lag", "Applied entries not yet checkpointed (replay on crash)"),
                ("last_index", "Last index in the local log"),
                ("is_leader", "1 if this node leads the group"),
                ("members", "Members of the group (voters and pre-followers)"),
            )
        }
        lag = GaugeMetricFamily(
            "raftkv_replication_lag", "Entries a peer is behind the leader's log (leader only)",
            labels=["group", "peer"],
        )
        for gid, g in st["groups"].items():
            values = {
                "term": g["term"], "commit_index": g["commit"], "applied_index": g["applied"],
                "checkpoint_index": g["checkpoint"],
                "checkpoint_lag": g["applied"] - g["checkpoint"], "last_index": g["last_index"],
                "is_leader": int(g["role"] == "leader"), "members": len(g["members"]),
            }
            for name, v in values.items():
                gauges[name].add_metric([gid], v)
            for peer, p in g["peers"].items():
                lag.add_metric([gid, peer], max(0, g["last_index"] - p["match"]))
        yield from gauges.values()
        yield lag
        transport = GaugeMetricFamily(
            "raftkv_transport", "Transport counters (bytes, frames, drops, rejected peers)",
            labels=["what"],
        )
        for what, v in st["transport"].items():
            transport.add_metric([what], v)
        yield transport
        connected = GaugeMetricFamily("raftkv_connected_peers", "Authenticated peer links")
        connected.add_metric([], len(st["connected"]))
        yield connected
