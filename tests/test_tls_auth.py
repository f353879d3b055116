"""TLS and bearer tokens together, as ``make demo`` runs them: real ``raftkv serve``
processes with HTTPS, mutual peer TLS and a tokens file.

What only the combination can break: a node that proxies a table request must speak
HTTPS to the other node *and* pass the caller's token on; ``raftkv cluster status`` asks
every member it discovers with the caller's CA, certificate and token; a 401 or 403 is
still counted in the HTTP request metrics; the throughput benchmark's ``/metrics``
scrape sends the metrics token.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raftkv import cli
from raftkv.client import ClientError
from raftkv.placement.assignments import partition_of
from raftkv.server.auth import Role
from raftkv.testing.procs import ProcCluster, http_json

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("process tests need Linux", allow_module_level=True)

TABLE, PARTS = "secure", 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("tlsauth")), size=3, tick=0.02,
                     faults=False, tls=True, auth=True) as c:
        c.start()
        c.wait_leader()
        admin = c.client(timeout=30)
        admin.create_table(TABLE, PARTS, 1)  # one replica: two partitions of three proxied
        c.wait_until(lambda: all(p["leader"] for p in admin.describe_table(TABLE)["partitions"]),
                     30, "a leader for every partition")
        admin.close()
        yield c


def test_the_cluster_serves_https_and_refuses_a_request_without_a_token(
        cluster: ProcCluster) -> None:
    ep = cluster.nodes["n1"].endpoint
    assert ep.startswith("https://")
    assert http_json(ep + "/health", context=cluster.ssl_context)[0] == 200
    status, body = http_json(ep + "/v1/kv/k", context=cluster.ssl_context)
    assert status == 401 and "authentication required" in body["error"]


def test_table_requests_proxied_over_https_carry_the_callers_token(
        cluster: ProcCluster) -> None:
    keys = {p: next(f"k-{p}-{i}" for i in range(1000)
                    if partition_of(f"k-{p}-{i}".encode(), PARTS) == p) for p in range(PARTS)}
    for node in cluster.nodes:
        w = cluster.client([node], role=Role.WRITE)
        r = cluster.client([node], role=Role.READ)
        try:
            for p, k in keys.items():
                w.put(k, f"{node}-{p}", table=TABLE)
                assert r.get(k, table=TABLE) == f"{node}-{p}".encode()
            assert r.describe_table(TABLE)["nodes_answered"] == sorted(cluster.nodes)
            for k in keys.values():
                with pytest.raises(ClientError) as refused:
                    r.put(k, "x", table=TABLE)
                assert refused.value.status == 403
        finally:
            w.close()
            r.close()


def test_cluster_status_asks_every_member_with_the_callers_tls_files_and_token(
        cluster: ProcCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cc = cluster.client_cert
    assert cc is not None
    common = ["--endpoints", cluster.nodes["n2"].endpoint.removeprefix("https://"),
              "--cacert", cc.ca, "--cert", cc.cert, "--key", cc.key]
    assert cli.main([*common, "--token-file", cluster.token_file(Role.READ), "-w", "json",
                     "cluster", "status", "--group", "default"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["node"] for r in rows) == ["n1", "n2", "n3"]
    assert not [r for r in rows if "error" in r], rows
    # A token too weak for /v1/cluster: every node answers, and refuses.
    assert cli.main([*common, "--token-file", cluster.token_file(Role.METRICS), "-w", "json",
                     "cluster", "status", "--group", "default"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["error"].startswith("refused (HTTP 403") for r in rows), rows


def test_key_commands_work_over_mutual_tls(cluster: ProcCluster,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Found from outside: the TLS option --key and the data key of put/get/del/cas were
    one argument, so over TLS every key command read the data key as the key file
    ("TLS key file user:1 does not exist"), by flag and by $RAFTKV_KEY alike."""
    cc = cluster.client_cert
    assert cc is not None
    common = ["--endpoints", cluster.nodes["n1"].endpoint.removeprefix("https://"),
              "--cacert", cc.ca, "--cert", cc.cert, "--key", cc.key,
              "--token-file", cluster.token_file(Role.WRITE)]
    assert cli.main([*common, "put", "user:1", "alice"]) == 0
    capsys.readouterr()
    assert cli.main([*common, "get", "user:1"]) == 0
    assert capsys.readouterr().out.strip() == "alice"
    assert cli.main([*common, "cas", "user:1", "bob", "--prev-value", "alice"]) == 0
    assert cli.main([*common, "del", "user:1"]) == 0


def test_refusals_are_counted_in_the_request_metrics(cluster: ProcCluster) -> None:
    node = "n3"
    ep = cluster.nodes[node].endpoint
    for method, token in (("GET", None), ("PUT", cluster.tokens[Role.READ])):
        status, _ = http_json(ep + "/v1/kv/counted", {} if method == "PUT" else None,
                              method=method, token=token, context=cluster.ssl_context)
        assert status == (401 if token is None else 403)
    assert http_json(ep + "/metrics", context=cluster.ssl_context)[0] == 401
    scraper = cluster.client([node], role=Role.METRICS)
    try:
        text = scraper.request("GET", "/metrics")[1].decode()
    finally:
        scraper.close()
    counts = {(s.labels["method"], s.labels["status"]): s.value
              for f in text_string_to_metric_families(text)
              if f.name == "raftkv_http_requests" for s in f.samples
              if s.name == "raftkv_http_requests_total" and s.labels["route"] == "/v1/kv/{key}"}
    assert counts.get(("GET", "401"), 0) >= 1 and counts.get(("PUT", "403"), 0) >= 1, counts


def test_the_throughput_benchmarks_fsync_scrape_sends_the_metrics_token(
        cluster: ProcCluster) -> None:
    pytest.importorskip("lmdb")
    from benchmarks.throughput import fsync_metrics

    lead = cluster.wait_leader()
    cluster.client([lead]).put("fsynced", "1")
    got = fsync_metrics(cluster, lead)
    assert got["count"] >= 1 and got["sum"] > 0, got
