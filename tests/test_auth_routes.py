"""Every route of a real cluster that checks tokens, called without a token, with a role
too low and with the right one (``raftkv.server.app.ROLES``).

The routes are read from the app's own router, not listed here: a route added later is
called too, and one missing from ``ROLES`` fails ``test_auth.py`` before this runs. A
table with one replica per partition on three nodes makes some table requests go
through another node's proxy, which must pass the caller's token on.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from raftkv.placement.assignments import partition_of
from raftkv.server.app import Api, role_of
from raftkv.server.auth import Role
from raftkv.testing.procs import ProcCluster

TABLE, PARTS = "rt", 3
KEY0 = next(f"p0-{i}" for i in range(1000) if partition_of(f"p0-{i}".encode(), PARTS) == 0)

# Placeholders of the route patterns, and per route what a harmless, mostly valid call
# looks like: destructive admin routes get a target that does not exist or a bad body,
# so the cluster is the same afterwards (the right role must pass the check, whatever
# the route then answers).
FILL = {"key": "route-key", "table": TABLE, "id": "n9", "p": "0"}
CALLS: dict[tuple[str, str], tuple[dict[str, str], bytes | None]] = {
    ("PUT", "/v1/kv/{key}"): ({}, b"v"),
    ("POST", "/v1/batch"): ({}, json.dumps({"ops": [["route-batch", "1"]]}).encode()),
    ("POST", "/v1/cluster/learners"): ({}, b'{"id": "n9", "raft_addr": "notanaddr"}'),
    ("POST", "/v1/cluster/transfer"): ({}, b'{"to": "n9"}'),
    ("POST", "/v1/test/partition"): ({}, b'{"block": []}'),
    ("POST", "/v1/tables"): ({}, b'{"name": "not a name"}'),
    ("DELETE", "/v1/tables/{table}"): ({"table": "nosuch"}, None),
    ("PUT", "/v1/tables/{table}/replicas"): ({}, b'{"replicas": 0}'),
    ("PUT", "/v1/tables/{table}/kv/{key}"): ({}, b"v"),
    ("POST", "/v1/tables/{table}/batch"): ({}, json.dumps({"ops": [["tb", "1"]]}).encode()),
    ("POST", "/v1/tables/{table}/partitions/{p}/batch"): (
        {}, msgpack.packb({"id": None, "ops": [[KEY0.encode(), b"v"]]}, use_bin_type=True)),
    ("POST", "/v1/cluster/nodes"): ({}, b'{"id": "n9", "raft_addr": "bad"}'),
}


def routes() -> list[tuple[str, str]]:
    app = Api("n1", CollectorRegistry(), faults=True).app()
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes()
                   if r.resource is not None})


def _path(method: str, canonical: str) -> str:
    fill = {**FILL, **CALLS.get((method, canonical), ({}, None))[0]}
    return re.sub(r"\{(\w+)\}", lambda m: fill[m.group(1)], canonical)


def call(c: ProcCluster, node: str, method: str, path: str, body: bytes | None = None,
         token: str | None = None) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", c.nodes[node].http_port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        got = dict(r.getheaders())
        if method != "HEAD" and r.getheader("Content-Type", "").startswith("application/json"):
            return r.status, got, json.loads(raw)
        return r.status, got, raw
    finally:
        conn.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("routes")), size=3, tick=0.02,
                     auth=True) as c:
        c.start()
        c.wait_leader()
        admin = c.client(timeout=30)
        admin.create_table(TABLE, PARTS, 1)
        c.wait_until(lambda: all(p["leader"] for p in admin.describe_table(TABLE)["partitions"]),
                     30, "a leader for every partition")
        yield c


ROUTES = routes()


@pytest.mark.parametrize(("method", "canonical"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_each_route_without_a_token_with_a_lower_role_and_with_its_role(
        cluster: ProcCluster, method: str, canonical: str) -> None:
    need = role_of(method, canonical)
    path = _path(method, canonical)
    body = CALLS.get((method, canonical), ({}, None))[1]

    status, headers, answer = call(cluster, "n1", method, path, body)
    if need is None:  # the probes
        assert status in (200, 503) and "WWW-Authenticate" not in headers, (status, answer)
        return
    assert status == 401, (status, answer)
    assert headers["WWW-Authenticate"] == 'Bearer realm="raftkv"'
    if method != "HEAD":
        assert "authentication required" in answer["error"]

    if need > Role.METRICS:
        lower = Role(need - 1)
        status, headers, answer = call(cluster, "n1", method, path, body,
                                       cluster.tokens[lower])
        assert status == 403, (lower, status, answer)
        assert 'error="insufficient_scope"' in headers["WWW-Authenticate"]
        if method != "HEAD":
            assert answer == {"error": f"{method} {path} needs the {need.label} role; this "
                                       f"token has {lower.label}", "role": need.label}
    status, headers, answer = call(cluster, "n1", method, path, body, "u" * 20)
    assert status == 401 and 'error="invalid_token"' in headers["WWW-Authenticate"]

    for role in (need, Role.ADMIN):  # its own role, and the one that includes every role
        status, headers, answer = call(cluster, "n1", method, path, body,
                                       cluster.tokens[role])
        assert status not in (401, 403) and status < 500, (role, status, answer)
        if status >= 400 and method != "HEAD":
            assert isinstance(answer, dict) and answer["error"], answer


def test_refused_writes_and_admin_calls_change_nothing(cluster: ProcCluster) -> None:
    before = {n: cluster.digest(n) for n in cluster.nodes}
    members = (cluster.group_status("n1") or {})["members"]
    read = cluster.tokens[Role.READ]
    for method, canonical in ROUTES:
        need = role_of(method, canonical)
        if need is None or need <= Role.READ:
            continue
        real = {("POST", "/v1/cluster/transfer"): b'{"to": "n2"}',
                ("DELETE", "/v1/cluster/members/{id}"): None,
                ("POST", "/v1/test/partition"): b'{"block": ["n2", "n3"]}'}
        body = real.get((method, canonical), CALLS.get((method, canonical), ({}, None))[1])
        path = _path(method, canonical).replace("/n9", "/n2")  # a real member and node
        for node in cluster.nodes:
            assert call(cluster, node, method, path, body, read)[0] == 403, (method, path)
    cluster.wait_caught_up()
    assert {n: cluster.digest(n) for n in cluster.nodes} == before
    assert (cluster.group_status("n1") or {})["members"] == members
    assert cluster.client().get(KEY0 + "-never", table=TABLE) is None


def test_a_token_with_bytes_no_token_has_is_a_401(cluster: ProcCluster) -> None:
    """Found from outside: a token that is not ASCII failed to hash, a 500 and a
    traceback in the log, for anyone."""
    for token in ("\xff\xfeAAAAAAAAAAAAAAAAAAAA", "bad;token;AAAAAAAAAAAAAAAA"):
        status, _, answer = call(cluster, "n1", "GET", "/v1/kv/anything", token=token)
        assert status == 401, (token, status, answer)
    assert "Traceback" not in cluster.nodes["n1"].log_text()


def test_a_path_that_matches_no_route_needs_a_token_before_it_is_a_404(
        cluster: ProcCluster) -> None:
    status, headers, _ = call(cluster, "n2", "GET", "/v1/nope")
    assert status == 401
    status, _, answer = call(cluster, "n2", "GET", "/v1/nope", token=cluster.tokens[Role.METRICS])
    assert status == 404 and answer["error"]
    status, _, _ = call(cluster, "n2", "PATCH", "/v1/kv/k", b"v")
    assert status == 401
    status, headers, answer = call(cluster, "n2", "PATCH", "/v1/kv/k", b"v",
                                   cluster.tokens[Role.READ])
    assert status == 405 and "PUT" in headers["Allow"] and answer["error"]


def test_table_requests_proxied_to_another_node_carry_the_callers_token(
        cluster: ProcCluster) -> None:
    """One replica per partition: from any node, two of the three partitions are served
    through another node's proxy, the describe fans out to every node, and a table batch
    sends its shares to their partitions' nodes."""
    keys = {p: next(f"px-{p}-{i}" for i in range(1000)
                    if partition_of(f"px-{p}-{i}".encode(), PARTS) == p) for p in range(PARTS)}
    for node in cluster.nodes:
        w = cluster.client([node], role=Role.WRITE)
        r = cluster.client([node], role=Role.READ)
        for p, k in keys.items():
            w.put(k, f"{node}-{p}", table=TABLE)
            assert r.get(k, table=TABLE) == f"{node}-{p}".encode()
        assert sorted(w.batch([(k, node) for k in keys.values()], table=TABLE)) == [0, 1, 2]
        assert r.describe_table(TABLE)["nodes_answered"] == sorted(cluster.nodes)
        # Without the right role, the node that proxies is refused as the caller would be.
        for k in keys.values():
            status, _, answer = call(cluster, node, "PUT", f"/v1/tables/{TABLE}/kv/{k}", b"x",
                                     cluster.tokens[Role.READ])
            assert status == 403, answer
        w.close()
        r.close()
