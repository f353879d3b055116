"""Range reads against real ``raftkv serve`` processes (``raftkv.server.range_ops``):
``GET /v1/kv?prefix=``/``?start=&end=`` on the default group, ``GET /v1/tables/{t}/kv?...``
merged over a table's partitions (2 replicas of 3 nodes, so every node serves some
partitions itself and proxies the rest), ``Client.scan`` and the CLI, and the 400s that
bad input gets without changing anything.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from raftkv.client import Client
from raftkv.testing.procs import ProcCluster

TABLE, PARTS = "ranges", 4
KEYS = {b"a/%02d" % i: b"value %d" % i for i in range(25)}
OTHER = {b"b/x": b"1", b"c": b"2", b"a": b"3", b"a0": b"4", b"\xff\xfe": b"\x00\xff"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("ranges")), size=3, tick=0.02) as c:
        c.start()
        c.wait_leader()
        c.create_table(TABLE, PARTS, 2)
        admin = c.client()
        rows = {**KEYS, **OTHER}
        admin.batch(list(rows.items()))
        admin.batch(list(rows.items()), table=TABLE)
        yield c


def _get(c: ProcCluster, node: str, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", c.nodes[node].http_port, timeout=20)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _bases() -> list[str]:
    return ["/v1/kv", f"/v1/tables/{TABLE}/kv"]


@pytest.mark.parametrize("node", ["n1", "n2", "n3"])
@pytest.mark.parametrize("table", [None, TABLE])
def test_a_prefix_scan_pages_through_every_key_once_in_order(
        cluster: ProcCluster, node: str, table: str | None) -> None:
    c = Client([cluster.nodes[node].endpoint])
    try:
        got = list(c.scan(prefix="a/", page=7, table=table))
        assert got == sorted(KEYS.items())
        page = c.range_page(prefix="a/", limit=7, table=table)
        assert len(page["kvs"]) == 7 and page["more"] and page["continue"]
        revision = page["revision"]
        if table is None:
            assert isinstance(revision, int) and revision > 0
        else:  # each partition is its own group: one revision each
            assert sorted(revision) == [str(p) for p in range(PARTS)]
        counted = c.range_page(prefix="a/", count_only=True, table=table)
        assert counted["count"] == len(KEYS) and "kvs" not in counted
        keys = c.range_page(prefix="a/", keys_only=True, table=table)["kvs"]
        assert keys == [(k, None) for k in sorted(KEYS)]
        stale = list(c.scan(prefix="a/", stale=True, table=table))
        assert {k for k, _ in stale} <= set(KEYS)  # a replica may lag, never invent
    finally:
        c.close()


@pytest.mark.parametrize("table", [None, TABLE])
def test_start_end_ranges_and_binary_keys(cluster: ProcCluster, table: str | None) -> None:
    c = cluster.client()
    everything = sorted({**KEYS, **OTHER}.items())
    assert list(c.scan(start="a/10", end="a/20", table=table)) == [
        (k, v) for k, v in everything if b"a/10" <= k < b"a/20"]
    assert list(c.scan(start="b", table=table)) == [(k, v) for k, v in everything if k >= b"b"]
    assert list(c.scan(end="a/", table=table)) == [(b"a", b"3")]
    assert list(c.scan(prefix=b"\xff", table=table)) == [(b"\xff\xfe", b"\x00\xff")]
    assert list(c.scan(prefix="", page=3, table=table)) == everything
    assert list(c.scan(start="a/05", end="a/05", table=table)) == []


def test_batch_markers_never_show(cluster: ProcCluster) -> None:
    """An idempotent partition batch writes a reserved marker row beside its data."""
    c = cluster.client()
    key = next(b"m%d" % i for i in range(100) if _partition(b"m%d" % i) == 0)
    c.partition_batch(TABLE, 0, [(key, b"v")], batch_id=b"load-1")
    rows = list(c.scan(prefix="", table=TABLE))
    assert (key, b"v") in rows and not any(k.startswith(b"\x00") for k, _ in rows)
    assert c.range_page(prefix="", count_only=True, table=TABLE)["count"] == len(rows)


def _partition(key: bytes) -> int:
    from raftkv.placement.assignments import partition_of
    return partition_of(key, PARTS)


BAD = [
    ("?start=b&end=a", "inverted range"),
    ("?prefix=a&start=a", "not both"),
    ("?prefix=a&limit=0", "limit"),
    ("?prefix=a&limit=10001", "limit"),
    ("?prefix=a&limit=ten", "limit"),
    ("?prefix=a&continue=%25%25%25", "continuation token"),
    ("?prefix=a&continue=YQ%3D%3D", "continuation token"),
    ("?prefix=a&keys_only=true&count_only=true", "not both"),
    ("?prefix=a&keys_only=maybe", "true or false"),
    ("?prefix=a&revision=3", "unknown query parameter"),
    ("", "needs ?prefix="),
]


@pytest.mark.parametrize("query, why", BAD)
def test_bad_input_is_a_400_on_both_and_changes_nothing(
        cluster: ProcCluster, query: str, why: str) -> None:
    before = cluster.client().range_page(prefix="", count_only=True)["count"]
    for base in _bases():
        status, body = _get(cluster, "n2", base + query)
        assert status == 400 and why in body["error"], (base, query, body)
    assert cluster.client().range_page(prefix="", count_only=True)["count"] == before


def test_an_unknown_table_is_a_404(cluster: ProcCluster) -> None:
    status, body = _get(cluster, "n1", "/v1/tables/nosuch/kv?prefix=")
    assert status == 404 and "nosuch" in body["error"]


def _cli(cluster: ProcCluster, *args: str) -> subprocess.CompletedProcess[str]:
    ends = ",".join(n.endpoint for n in cluster.nodes.values())
    return subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", ends, *args],
                          check=False, capture_output=True, text=True, timeout=60)


def test_cli_get_prefix_and_scan(cluster: ProcCluster) -> None:
    res = _cli(cluster, "get", "--prefix", "a/0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[:4] == ["a/00", "value 0", "a/01", "value 1"] and len(lines) == 20
    res = _cli(cluster, "-w", "json", "scan", "--start", "a/20", "--keys-only", "--limit", "3",
               "--table", TABLE)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [{"key": "a/20"}, {"key": "a/21"}, {"key": "a/22"}]
    res = _cli(cluster, "-w", "json", "scan", "--prefix", "a/", "--count")
    assert json.loads(res.stdout)["count"] == len(KEYS)
    res = _cli(cluster, "-w", "json", "scan", "--prefix", "\udcff")  # not UTF-8: base64
    assert res.returncode == 0 and "key_base64" in res.stdout, res.stderr
    res = _cli(cluster, "scan", "--start", "b", "--end", "a")
    assert res.returncode == 1 and "inverted range" in res.stderr
    assert "Traceback" not in res.stderr
    res = _cli(cluster, "get", "a/00", "--prefix", "a/")
    assert res.returncode == 1 and "not both" in res.stderr
    # A key that is not UTF-8 goes through the CLI as the bytes given.
    assert _cli(cluster, "put", "\udcfe\x01", "v").returncode == 0
    res = _cli(cluster, "-w", "json", "get", "\udcfe\x01")
    assert res.returncode == 0 and json.loads(res.stdout)["key_base64"] == "/gE=", res.stderr
    assert _cli(cluster, "del", "\udcfe\x01").returncode == 0
    res = _cli(cluster, "watch", "--table", TABLE)
    assert res.returncode == 1 and "--partition" in res.stderr


@pytest.mark.parametrize("table", [None, TABLE])
def test_a_range_with_meta_carries_each_keys_revisions(cluster: ProcCluster,
                                                       table: str | None) -> None:
    c = cluster.client()
    page = c.range_page(prefix="a/0", meta=True, table=table)
    assert len(page["kvs"]) == 10
    for key, value, meta in page["kvs"]:
        single = c.get_meta(key, table=table)
        assert single is not None and value == single["value"] == KEYS[key]
        assert meta == {k: single[k] for k in ("create_revision", "mod_revision", "version")}
    assert all(len(kv) == 3 and kv[1] is None
               for kv in c.range_page(prefix="a/0", meta=True, keys_only=True,
                                      table=table)["kvs"])


def test_a_watch_closed_early_is_a_quiet_hang_up_not_a_500(cluster: ProcCluster) -> None:
    """A watcher that reads its first lines and hangs up, on a table partition and on the
    default group: the node counts a 400 (the client's doing) and logs no traceback. The
    partition's watch answered 500 with an ERROR traceback ("Connection lost") 4 times in
    6 (found outside-in, ``raftkv watch --table T --partition P --count 2``)."""
    import socket

    from prometheus_client.parser import text_string_to_metric_families

    hosts = {p: [n for n in cluster.nodes
                 if _get(cluster, n, f"/v1/tables/{TABLE}/leaders")[1]["leaders"][p]]
             for p in range(PARTS)}
    p = 1
    node = hosts[p][0]
    port = cluster.nodes[node].http_port
    paths = [f"/v1/tables/{TABLE}/partitions/{p}/watch?prefix=&from_revision=1",
             "/v1/watch?prefix=&from_revision=1"]
    for path in paths * 6:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = b""
            while b'"revision"' not in got:  # the head, then a revision line
                try:
                    chunk = s.recv(4096)
                except TimeoutError:
                    raise AssertionError((path, got)) from None
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
    def watch_statuses() -> list[str]:
        """One status per watch answered (each is counted once its stream ends, when the
        node next writes to it and finds the connection gone)."""
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return [str(s.labels.get("status")) for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "raftkv_http_requests_total"
                and "watch" in s.labels.get("route", "") for _ in range(int(s.value))]

    cluster.wait_until(lambda: len(watch_statuses()) >= len(paths) * 6, 30,
                       "every watch counted")
    statuses = watch_statuses()
    assert statuses and "500" not in statuses, statuses
    assert "request failed" not in cluster.nodes[node].log_text()
