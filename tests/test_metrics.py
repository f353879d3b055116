"""``/metrics`` of real ``raftkv serve`` processes (issue 17 item 6): Prometheus naming,
HTTP request metrics, a has-leader gauge, process metrics, no ``*_created`` series, a
dropped table's series removed, and a Grafana dashboard that graphs only metrics a real
scrape has."""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import raftkv.server.metrics
from raftkv.testing.procs import ProcCluster

ROOT = Path(__file__).resolve().parents[1]
Scrape = dict[str, list[tuple[str, dict[str, str], float]]]  # family -> samples


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("metrics")), size=3, faults=False) as c:
        c.start()
        c.wait_leader()
        client = c.client()
        client.put("k", "v")
        client.create_table("gone", partitions=2, replicas=3)
        client.put("k", "v", table="gone")
        client.close()
        c.wait_caught_up()
        yield c


def _http(c: ProcCluster, node: str, method: str, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", c.nodes[node].http_port, timeout=30)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def _scrape(c: ProcCluster, node: str) -> tuple[str, Scrape]:
    status, text = _http(c, node, "GET", "/metrics")
    assert status == 200
    return text, {f.name: [(s.name, s.labels, s.value) for s in f.samples]
                  for f in text_string_to_metric_families(text)}


def _value(scrape: Scrape, family: str, **labels: str) -> float:
    (value,) = [v for _, lab, v in scrape[family] if labels.items() <= lab.items()]
    return value


def test_names_follow_prometheus_conventions(cluster: ProcCluster) -> None:
    leader = cluster.wait_leader()
    text, scrape = _scrape(cluster, leader)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, kind in types.items():
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
    assert "_created" not in text
    assert "raftkv_transport{" not in text and 'what="' not in text  # the mixed gauge is gone
    assert types["raftkv_fsync_seconds"] == types["raftkv_http_request_duration_seconds"] \
        == "histogram"
    assert _value(scrape, "raftkv_transport_sent_bytes") > 0
    assert _value(scrape, "raftkv_transport_connected_peers") == 2
    assert _value(scrape, "raftkv_has_leader", group="default") == 1
    assert _value(scrape, "raftkv_is_leader", group="default") == 1
    assert _value(scrape, "process_cpu_seconds") > 0
    assert _value(scrape, "process_resident_memory_bytes") > 0
    lags = {lab["peer"] for _, lab, _ in scrape["raftkv_replication_lag_entries"]
            if lab["group"] == "default"}
    assert lags == set(cluster.nodes) - {leader}


def test_every_documented_metric_is_exported(cluster: ProcCluster) -> None:
    doc = raftkv.server.metrics.__doc__ or ""
    documented = set(re.findall(r"^    ((?:raftkv|process)_[a-z_]+)", doc, re.MULTILINE))
    assert len(documented) > 20
    text, _ = _scrape(cluster, "n1")
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    assert documented <= exported, documented - exported
    assert {n for n in exported if n.startswith("raftkv_")} <= documented


def test_http_requests_are_counted_by_route_template_and_status(cluster: ProcCluster) -> None:
    _, before = _scrape(cluster, "n2")

    def count(scrape: Scrape, **labels: str) -> float:
        return sum(v for name, lab, v in scrape.get("raftkv_http_requests", [])
                   if name.endswith("_total") and labels.items() <= lab.items())

    for key in ("absent-1", "absent-2", "absent-3"):
        assert _http(cluster, "n2", "GET", f"/v1/kv/{key}")[0] == 404
    assert _http(cluster, "n2", "GET", "/v1/kv/k?bogus=1")[0] == 400
    assert _http(cluster, "n2", "GET", "/no/such/route")[0] == 404
    _, after = _scrape(cluster, "n2")
    route = {"method": "GET", "route": "/v1/kv/{key}"}
    assert count(after, **route, status="404") - count(before, **route, status="404") == 3
    assert count(after, **route, status="400") - count(before, **route, status="400") == 1
    assert count(after, route="unmatched", status="404") \
        - count(before, route="unmatched", status="404") == 1
    latencies = [lab for name, lab, _ in after["raftkv_http_request_duration_seconds"]
                 if name.endswith("_count")]
    assert {**route, "status": "404"} in latencies
    assert not any("absent" in lab["route"] for lab in latencies)  # templates, not paths


def test_a_dropped_tables_series_are_removed(cluster: ProcCluster) -> None:
    def table_series(node: str) -> list[str]:
        text, _ = _scrape(cluster, node)
        return [line for line in text.splitlines() if 'group="t.gone.' in line]

    assert all(table_series(n) for n in cluster.nodes)
    client = cluster.client()
    try:
        client.drop_table("gone")
    finally:
        client.close()
    deadline = time.monotonic() + 60
    left = {n: table_series(n) for n in cluster.nodes}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {n: table_series(n) for n in cluster.nodes}
    assert not any(left.values()), left


def test_the_grafana_dashboard_graphs_only_metrics_that_exist(cluster: ProcCluster) -> None:
    """Every metric name in every query of docs/grafana-dashboard.json (and of its
    template variables) is a sample name of a real scrape: a renamed metric cannot leave
    the dashboard graphing nothing."""
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"\b((?:raftkv|process)_[a-z0-9_]+)", e)}
    assert len(used) > 15
    _, scrape = _scrape(cluster, cluster.wait_leader())
    samples = {name for family in scrape.values() for name, _, _ in family}
    assert used <= samples, used - samples
