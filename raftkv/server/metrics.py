"""Prometheus metrics of a ``raftkv serve`` node (``GET /metrics``).

Theory of operation
-------------------
Four sources feed one ``CollectorRegistry`` per server (no process-global state, so
several nodes can live in one process in tests):

1. **Pushed by the driver** (``PrometheusMetrics``, in ``raftkv.server.node_metrics``,
   implements ``raftkv.node.driver.Metrics``): proposals, leader changes and fsync latency, as they
   happen. They are labelled by group, and when the node stops hosting a group (a
   dropped table's partition, a partition that moved away) ``group_removed`` deletes its
   series, so they do not linger as stale values for ever.
2. **Read from the node's status when scraped** (``StatusCollector``): the per-group
   Raft gauges and the transport counters. A group the node no longer hosts is simply
   not in the status, so nothing of it is exported.
3. **HTTP requests** (``HttpMetrics.middleware``, the outermost aiohttp middleware, so it
   sees the status the client gets, errors included): a count and a latency histogram
   per method, route template and status. The template (``/v1/kv/{key}``), never the
   path, so the label has a handful of values however many keys there are; a path no
   route matches is ``route="unmatched"`` and an unknown method ``method="other"``.
4. **The process** (prometheus_client's ``ProcessCollector``): CPU seconds, resident and
   virtual memory, open and maximum file descriptors, start time (Linux).

Naming follows the Prometheus conventions: a ``raftkv_`` prefix, the base unit in the
name (``_seconds``, ``_bytes``; ``_entries`` for counts of log entries), ``_total`` on
every counter, and one unit per metric name. ``exposition`` leaves out the ``*_created``
series that prometheus_client adds to each counter and histogram: in the text format
they are separate gauges that no dashboard needs, one per labelled child.

The metrics (``docs/grafana-dashboard.json`` graphs them)::

    raftkv_proposals_total{group}                 commands this node proposed as leader
    raftkv_leader_changes_total{group}            leaders this node has seen elected
    raftkv_fsync_seconds{group}                   histogram: one log fsync
    raftkv_term{group}                            current Raft term
    raftkv_commit_index{group}                    highest index known committed
    raftkv_applied_index{group}                   highest index applied to the state store
    raftkv_checkpoint_index{group}                highest index the state store made durable
    raftkv_checkpoint_lag_entries{group}          applied but not checkpointed (replayed on a crash)
    raftkv_last_index{group}                      last index in the local log
    raftkv_is_leader{group}                       1 if this node leads the group
    raftkv_has_leader{group}                      1 if this node knows a leader of the group
    raftkv_members{group}                         voters and pre-followers of the group
    raftkv_replication_lag_entries{group, peer}   entries a peer is behind (on the leader)
    raftkv_transport_sent_bytes_total             bytes written to peer connections
    raftkv_transport_received_bytes_total         bytes read from peer connections
    raftkv_transport_frames_sent_total            frames sent (one per peer per loop turn)
    raftkv_transport_frames_received_total        frames received
    raftkv_transport_dropped_messages_total       messages dropped: peer down or not reading
    raftkv_transport_rejected_connections_total   failed handshakes, bad frames, floods
    raftkv_transport_connections_total            peer connections authenticated
    raftkv_transport_connected_peers              authenticated peer links now
    raftkv_startup_seconds{phase}                 seconds from process start to each start-up phase
    raftkv_http_requests_total{method, route, status}
    raftkv_http_request_duration_seconds{method, route, status}   histogram
    process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# The transport's counters (``raftkv.transport.tcp``'s ``stats``): name and help of each.
TRANSPORT_COUNTERS = {
    "bytes_out": ("raftkv_transport_sent_bytes", "Bytes written to peer connections"),
    "bytes_in": ("raftkv_transport_received_bytes", "Bytes read from peer connections"),
    "frames_out": ("raftkv_transport_frames_sent",
                   ("Frames sent to peers (one per peer per loop turn, every group's "
                   "messages together)")),
    "frames_in": ("raftkv_transport_frames_received", "Frames received from peers"),
    "dropped": ("raftkv_transport_dropped_messages",
                ("Messages dropped because the peer was not connected or not reading "
                "(Raft retransmits)")),
    "rejected": ("raftkv_transport_rejected_connections",
                 ("Connections closed for a failed handshake or a malformed frame, or "
                 "refused over the cap on unauthenticated connections")),
    "connects": ("raftkv_transport_connections", "Peer connections authenticated"),
}
HTTP_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"})


class StatusCollector(Collector):
    """Per-group Raft gauges and the transport counters from a node status snapshot,
    taken when scraped."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        gauges = {
            name: GaugeMetricFamily(f"raftkv_{name}", doc, labels=["group"])
            for name, doc in (
                ("term", "Current Raft term"),
                ("commit_index", "Highest log index known committed"),
                ("applied_index", "Highest index applied to the state store"),
                ("checkpoint_index", "Highest index the state store made durable"),
                ("checkpoint_lag_entries",
                 "Applied entries not yet checkpointed (replayed after a crash)"),
                ("last_index", "Last index in the local log"),
                ("is_leader", "1 if this node leads the group"),
                ("has_leader", ("1 if this node knows a leader of the group (0: no "
                               "writes or linearizable reads until one is elected)")),
                ("members", "Members of the group (voters and pre-followers)"),
            )
        }
        lag = GaugeMetricFamily(
            "raftkv_replication_lag_entries",
            "Entries a peer is behind the leader's log (reported by the leader)",
            labels=["group", "peer"],
        )
        for gid, g in st["groups"].items():
            values = {
                "term": g["term"], "commit_index": g["commit"], "applied_index": g["applied"],
                "checkpoint_index": g["checkpoint"],
                "checkpoint_lag_entries": g["applied"] - g["checkpoint"],
                "last_index": g["last_index"], "is_leader": int(g["role"] == "leader"),
                "has_leader": int(g["leader"] is not None), "members": len(g["members"]),
            }
            for name, v in values.items():
                gauges[name].add_metric([gid], v)
            for peer, p in g["peers"].items():
                lag.add_metric([gid, peer], max(0, g["last_index"] - p["match"]))
        yield from gauges.values()
        yield lag
        for what, v in st["transport"].items():
            name, doc = TRANSPORT_COUNTERS[what]
            yield CounterMetricFamily(name, doc, value=v)
        connected = GaugeMetricFamily("raftkv_transport_connected_peers",
                                      "Authenticated peer links")
        connected.add_metric([], len(st["connected"]))
        yield connected


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpMetrics:
    """The HTTP request count and latency (source 3 in the module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["method", "route", "status"]
        self._requests = Counter("raftkv_http_requests", "HTTP requests answered", labels,
                                 registry=registry)
        self._seconds = Histogram(
            "raftkv_http_request_duration_seconds",
            "Time from a request's arrival to its answer (a linearizable read or a write "
            "includes its Raft round; a digest with min_index its wait)", labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0),
            registry=registry,
        )
        # (method, route, status) -> its counter and histogram children: ``labels()``
        # takes a lock and hashes the label values on every call, a measurable share of
        # a request's CPU at thousands a second; the label sets are few.
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500  # what the client gets if the handler raises past every middleware
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            method = request.method if request.method in HTTP_METHODS else "other"
            labels = (method, route, str(status))
            children = self._children.get(labels)
            if children is None:
                children = self._children[labels] = (self._requests.labels(*labels),
                                                     self._seconds.labels(*labels))
            children[0].inc()
            children[1].observe(time.perf_counter() - t0)


class _WithoutCreated(Collector):
    """A registry's metrics without their ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format of ``registry``, without the ``*_created`` series."""
    return generate_latest(_WithoutCreated(registry))
