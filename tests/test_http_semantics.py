"""A table key has exactly the semantics of a default-group key (``raftkv.server.kv_ops``).

Real ``raftkv serve`` processes. Every request goes both to ``/v1/kv/{key}`` and to
``/v1/tables/{t}/kv/{key}``, on every node (so a table's key is served both by a node
hosting its partition and through the proxy of one that does not), and the two answers
must agree: the same compare-and-set outcomes, the same 4xx for the same bad input.

Before the shared request layer, a table PUT with a wrong ``?prev_value`` answered 200
and overwrote the value (a silent lost update), and ``?stale=bogus`` read as false.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from raftkv.client import ClientError
from raftkv.testing.procs import ProcCluster, free_ports

TABLE, PARTS = "sem", 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("sem")), size=3, tick=0.02) as c:
        c.start()
        c.wait_leader()
        c.create_table(TABLE, PARTS, 2)  # 2 of 3 nodes: one node proxies each key
        yield c


def _call(c: ProcCluster, node: str, method: str, path: str,
          body: bytes | None = None) -> tuple[int, Any]:
    """One request, sent again while it gets a 503: "nothing was done, retry" (a leader
    moving, as the leader balancer does on a young table; seen on a loaded machine)."""
    for _ in range(40):
        conn = http.client.HTTPConnection("127.0.0.1", c.nodes[node].http_port, timeout=20)
        try:
            conn.request(method, path, body=body)
            r = conn.getresponse()
            raw = r.read()
            answer = (r.status, json.loads(raw) if r.getheader("Content-Type", "")
                      .startswith("application/json") else raw)
        finally:
            conn.close()
        if answer[0] != 503:
            break
        time.sleep(0.25)
    return answer


def _paths(key: bytes) -> tuple[str, str]:
    k = quote(key, safe="")
    return f"/v1/kv/{k}", f"/v1/tables/{TABLE}/kv/{k}"


def _both(c: ProcCluster, node: str, method: str, key: bytes, query: str = "",
          body: bytes | None = None) -> tuple[tuple[int, Any], tuple[int, Any]]:
    kv, table = _paths(key)
    return (_call(c, node, method, kv + query, body),
            _call(c, node, method, table + query, body))


def _status(answer: tuple[int, Any]) -> int:
    return answer[0]


@pytest.mark.parametrize("node", ["n1", "n2", "n3"])
def test_a_table_compare_and_set_refuses_a_wrong_prev_value_as_kv_does(
        cluster: ProcCluster, node: str) -> None:
    key = f"cas-{node}".encode()
    steps: list[tuple[str, str, bytes | None, int]] = [
        ("PUT", "?prev_absent=true", b"v1", 200),    # absent: created
        ("PUT", "?prev_absent=true", b"v2", 412),    # present: refused
        ("PUT", "?prev_value=WRONG", b"v2", 412),    # the lost update of the old table API
        ("PUT", "?prev_value=v1", b"v2", 200),
        ("DELETE", "?prev_value=v1", None, 412),     # compare-and-delete on a stale value
        ("DELETE", "?prev_value=v2", None, 200),
        ("PUT", "?prev_value=v2", b"v3", 412),       # gone: nothing to compare with
    ]
    for method, query, body, want in steps:
        kv, table = _both(cluster, node, method, key, query, body)
        assert (_status(kv), _status(table)) == (want, want), (method, query, kv, table)
        assert kv[1]["swapped"] is (want == 200) and table[1]["swapped"] is (want == 200)
    kv, table = _both(cluster, node, "GET", key)
    assert _status(kv) == _status(table) == 404  # the final value: deleted, not v3
    kv, table = _both(cluster, node, "PUT", key, "?prev_absent=true", b"v4")
    assert _status(kv) == _status(table) == 200
    # A stale read on a follower may lag the write by a moment (seen under load).
    deadline = time.monotonic() + 10
    while True:
        kv, table = _both(cluster, node, "GET", key, "?stale=true")
        if (_status(table) == 200 and table[1] == b"v4" and kv[1] == b"v4"
                or time.monotonic() > deadline):
            break
        time.sleep(0.05)
    assert _status(table) == 200 and table[1] == b"v4" and kv[1] == b"v4"


def test_binary_prev_values_compare_byte_for_byte(cluster: ProcCluster) -> None:
    value = bytes(range(256))
    for path in _paths(b"binary"):
        assert _call(cluster, "n1", "PUT", path, value)[0] == 200
        assert _call(cluster, "n2", "PUT", path + "?prev_value=" + quote(value[:-1]),
                     b"x")[0] == 412
        assert _call(cluster, "n3", "PUT", path + "?prev_value=" + quote(value), b"x")[0] == 200


BAD: list[tuple[str, str, bytes, str, bytes | None, int]] = [
    # (what, method, key, query, body, status)
    ("empty key", "GET", b"", "", None, 400),
    ("stale is not a boolean", "GET", b"k", "?stale=bogus", None, 400),
    ("unknown parameter on a read", "GET", b"k", "?consistent=false", None, 400),
    ("misspelt prev_value", "PUT", b"k", "?prev_valu=x", b"v", 400),
    ("prev_value and prev_absent together", "PUT", b"k", "?prev_value=a&prev_absent=true",
     b"v", 400),
    ("prev_value twice", "PUT", b"k", "?prev_value=a&prev_value=b", b"v", 400),
    ("prev_absent not a boolean", "PUT", b"k", "?prev_absent=maybe", b"v", 400),
    # etcd v2's prevExist=false means "must be absent": not a silent blind overwrite.
    ("prev_absent false", "PUT", b"k", "?prev_absent=false", b"v", 400),
    ("prev_absent 0", "PUT", b"k", "?prev_absent=0", b"v", 400),
    ("prev_index not a number", "PUT", b"k", "?prev_index=three", b"v", 400),
    ("prev_index negative", "DELETE", b"k", "?prev_index=-1", None, 400),
    ("prev_index and prev_value together", "PUT", b"k", "?prev_index=3&prev_value=a", b"v",
     400),
    ("meta is not a boolean", "GET", b"k", "?meta=yes", None, 400),
    ("key over 511 bytes", "PUT", b"k" * 600, "", b"v", 400),
    ("reserved key prefix", "PUT", b"\x00raftkv.batch.x", "", b"v", 400),
    ("value over 1 MiB", "PUT", b"k", "", b"v" * ((1 << 20) + 1), 413),
    ("prev_absent on a delete", "DELETE", b"k", "?prev_absent=true", None, 400),
    ("missing key", "GET", b"never-written", "", None, 404),
    ("unsupported method", "PATCH", b"k", "", b"v", 405),
]


@pytest.mark.parametrize("node", ["n1", "n2", "n3"])
def test_the_same_bad_input_gets_the_same_answer_from_both_apis(
        cluster: ProcCluster, node: str) -> None:
    mismatches = []
    for what, method, key, query, body, want in BAD:
        kv, table = _both(cluster, node, method, key, query, body)
        if not (_status(kv) == _status(table) == want):
            mismatches.append((what, want, kv, table))
            continue
        for answer in (kv, table):
            assert isinstance(answer[1], dict) and answer[1].get("error"), (what, answer)
    assert not mismatches, mismatches
    # Nothing above wrote: the key the bad writes named is still absent in both.
    kv, table = _both(cluster, node, "GET", b"k")
    assert _status(kv) == _status(table) == 404


def test_the_table_parameter_of_the_cli_cas(cluster: ProcCluster) -> None:
    eps = ",".join(n.endpoint for n in cluster.nodes.values())

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", eps, *args],
                              check=False, capture_output=True, text=True,
                              timeout=60)

    key = "cli-key"
    assert cli("put", "--table", TABLE, key, "one").returncode == 0
    wrong = cli("cas", "--table", TABLE, key, "two", "--prev-value", "nope")
    assert wrong.returncode == 2 and json.loads(wrong.stdout)["swapped"] is False
    assert cli("get", "--table", TABLE, key).stdout.strip() == "one"
    right = cli("cas", "--table", TABLE, key, "two", "--prev-value", "one")
    assert right.returncode == 0 and json.loads(right.stdout)["swapped"] is True
    assert cli("get", "--table", TABLE, key).stdout.strip() == "two"
    assert cli("get", key).returncode == 1  # the default group is another keyspace


def test_every_replica_agrees_after_the_traffic_above(cluster: ProcCluster) -> None:
    admin = cluster.client()
    for p in range(PARTS):
        digests = set()
        for n in cluster.nodes.values():
            try:
                d = admin.partition_digest(TABLE, p, n.endpoint, linearizable=True)
            except ClientError as e:
                assert e.status == 404  # this node hosts no replica of p
                continue
            digests.add((d["count"], d["digest"]))
        assert len(digests) == 1, (p, digests)


def test_a_405_names_the_methods_the_resource_takes(cluster: ProcCluster) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", cluster.nodes["n1"].http_port, timeout=10)
    try:
        conn.request("PATCH", "/v1/kv/k", body=b"v")
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 405 and body["error"]
        assert {"GET", "PUT", "DELETE"} <= {m.strip() for m in r.getheader("Allow", "").split(",")}
    finally:
        conn.close()


def test_a_learner_with_a_malformed_address_is_refused(cluster: ProcCluster) -> None:
    for addr in ("notanaddr", "127.0.0.1", "127.0.0.1:99999", "host:port"):
        status, body = _call_json(cluster, "POST", "/v1/cluster/learners",
                                  {"id": "n9", "raft_addr": addr})
        assert status == 400 and "raft_addr" in body["error"], (addr, status, body)
    members = (cluster.group_status(cluster.wait_leader()) or {})["members"]
    assert "n9" not in members


def test_learners_that_cannot_be_told_apart_are_refused(cluster: ProcCluster) -> None:
    """Found from outside: a learner given another member's raft address was accepted
    (it could never catch up: the address answers as that member), and so were ids that
    ``--peers`` cannot name."""
    lead = cluster.wait_leader()
    other = next(n for n in cluster.nodes if n != lead)
    for body, want in (({"id": "n9", "raft_addr": cluster.nodes[other].raft_addr},
                        f"is {other}'s"),
                       ({"id": "n9", "raft_addr": cluster.nodes[lead].raft_addr},
                        f"is {lead}'s"),
                       ({"id": "a b,c=d", "raft_addr": "127.0.0.1:7009"}, "node id"),
                       # a member moved to another port (found outside-in: accepted, and
                       # every node's peers map then named the wrong port)
                       ({"id": other, "raft_addr": "127.0.0.1:7009"},
                        f"{other} is already a member at")):
        status, answer = _call_json(cluster, "POST", "/v1/cluster/learners", body)
        assert status == 400 and want in answer["error"], (body, status, answer)
    st = cluster.group_status(lead) or {}
    assert "n9" not in st["members"] and "a b,c=d" not in st["members"]
    assert (cluster.status(lead) or {})["addresses"][other] == cluster.nodes[other].raft_addr


def test_text_that_is_not_unicode_is_a_400_not_a_500(cluster: ProcCluster) -> None:
    """Found from outside: a JSON string with a lone surrogate ("\\ud800") passed
    json.loads and failed at encode(): 500 and a traceback, for anyone."""
    for path, body in (("/v1/batch", b'{"ops": [["s\\ud800", "1"]]}'),
                       ("/v1/batch", b'{"ops": [["k", "\\udfff"]]}'),
                       (f"/v1/tables/{TABLE}/batch", b'{"ops": [["s\\ud800", "1"]]}'),
                       ("/v1/cluster/learners",
                        b'{"id": "n\\ud800", "raft_addr": "127.0.0.1:7009"}')):
        status, answer = _call(cluster, "n1", "POST", path, body)
        assert status == 400 and "Unicode" in answer["error"], (path, status, answer)


def test_an_empty_batch_is_refused_alike_on_both_apis_and_writes_nothing(
        cluster: ProcCluster) -> None:
    """Found outside-in: the default group's batch accepted no operations with a 200 and
    wrote an empty log entry, where a table's refused it."""
    before = cluster.group_status("n1")
    assert before is not None
    for path in ("/v1/batch", f"/v1/tables/{TABLE}/batch"):
        status, answer = _call(cluster, "n1", "POST", path, b'{"ops": []}')
        assert status == 400 and "at least one operation" in answer["error"], (
            path, status, answer)
    after = cluster.group_status("n1")
    assert after is not None and after["commit"] == before["commit"]


def test_a_placement_node_with_a_malformed_address_is_refused(cluster: ProcCluster) -> None:
    for body in ({"id": "n9", "raft_addr": "notanaddr"},
                 {"id": "n9", "raft_addr": "127.0.0.1:99999"},
                 {"id": "n9", "raft_addr": 7},
                 {"id": "n9", "raft_addr": "127.0.0.1:7009", "http_addr": "nohttp"},
                 {"id": "n9", "raft_addr": "127.0.0.1:7009", "http_addr": ""},
                 {"id": "n9", "raft_addr": "127.0.0.1:7009", "http_addr": ["h:1"]},
                 # found outside-in: accepted, then dialled in vain until declared dead
                 {"id": "n9", "raft_addr": "host with space:1"},
                 {"id": "n9", "raft_addr": "127.0.0.1:7009", "http_addr": "a/b:1"}):
        status, answer = _call_json(cluster, "POST", "/v1/cluster/nodes", body)
        field = "http_addr" if "http_addr" in body else "raft_addr"
        assert status == 400 and field in answer["error"], (body, status, answer)
    # Another node's HTTP address, as its raft address already was (found outside-in:
    # status then showed n1 twice and n9 never).
    n1_http = f"127.0.0.1:{cluster.nodes['n1'].http_port}"
    status, answer = _call_json(cluster, "POST", "/v1/cluster/nodes",
                                {"id": "n9", "raft_addr": "127.0.0.1:7009", "http_addr": n1_http})
    assert status == 409 and "is n1's" in answer["error"], (status, answer)
    topology = cluster.client().describe_table(TABLE)["nodes_answered"]
    assert "n9" not in topology
    meta = (cluster.group_status(cluster.wait_leader(), "meta") or {})["members"]
    assert "n9" not in meta


def _call_json(c: ProcCluster, method: str, path: str, body: Any) -> tuple[int, Any]:
    leader = c.wait_leader()
    conn = http.client.HTTPConnection("127.0.0.1", c.nodes[leader].http_port, timeout=10)
    try:
        conn.request(method, path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_removing_a_node_not_in_the_topology_is_a_404(cluster: ProcCluster) -> None:
    status, body = _call_json(cluster, "DELETE", "/v1/cluster/nodes/n9", None)
    assert status == 404 and "not in the placement topology" in body["error"]
    assert sorted(body["topology"]) == ["n1", "n2", "n3"]


def test_the_cli_says_unknown_table_not_key_not_found(cluster: ProcCluster) -> None:
    eps = ",".join(n.endpoint for n in cluster.nodes.values())
    res = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", eps,
                          "get", "--table", "nosuch", "k"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "unknown table nosuch" in res.stderr and "not found" not in res.stderr
    assert "Traceback" not in res.stderr


def test_cluster_status_with_every_endpoint_down_reports_them() -> None:
    ports = free_ports(2)
    eps = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    res = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", eps, "--timeout",
                          "2", "cluster", "status"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stdout.count("unreachable") == 2, res.stdout


@pytest.mark.parametrize("node", ["n1", "n2", "n3"])
def test_revisions_and_a_compare_on_the_mod_revision_agree_on_both_apis(
        cluster: ProcCluster, node: str) -> None:
    """``?meta=true``, the revision headers and ``?prev_index=`` mean the same on a table
    key (served here or proxied) as on a default-group key."""
    key = f"rev-{node}".encode()
    for path in _paths(key):
        status, body = _call(cluster, node, "PUT", path + "?prev_index=0", b"one")
        assert status == 200 and body["swapped"], body
        created = body["index"]
        status, body = _call(cluster, node, "PUT", path + "?prev_index=0", b"two")
        assert status == 412 and not body["swapped"], body
        status, meta = _call(cluster, node, "GET", path + "?meta=true")
        assert status == 200 and meta["create_revision"] == meta["mod_revision"] == created
        assert meta["version"] == 1 and meta["value"] == "b25l"  # base64 of b"one"
        status, body = _call(cluster, node, "PUT", path + f"?prev_index={created}", b"two")
        assert status == 200 and body["swapped"], body
        second = body["index"]
        conn = http.client.HTTPConnection("127.0.0.1", cluster.nodes[node].http_port,
                                          timeout=20)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            assert r.read() == b"two"
            assert (r.getheader("X-Raftkv-Create-Revision"), r.getheader("X-Raftkv-Mod-Revision"),
                    r.getheader("X-Raftkv-Version")) == (str(created), str(second), "2")
        finally:
            conn.close()
        status, body = _call(cluster, node, "DELETE", path + f"?prev_index={created}")
        assert status == 412, body  # stale revision: nothing deleted
        status, body = _call(cluster, node, "DELETE", path + f"?prev_index={second}")
        assert status == 200 and body["swapped"], body
        assert _call(cluster, node, "GET", path)[0] == 404


def _txn_paths() -> tuple[str, str]:
    return "/v1/txn", f"/v1/tables/{TABLE}/txn"


@pytest.mark.parametrize("node", ["n1", "n2", "n3"])
def test_a_transaction_is_one_atomic_entry_on_both_apis(cluster: ProcCluster, node: str) -> None:
    """Compare-then-write on one key (a table's keys: one partition), from every node:
    the compare decides, the branch runs whole, gets see the branch's own writes."""
    key = f"txn-{node}"
    for path in _txn_paths():
        absent = {"compare": [{"key": key, "target": "exists", "op": "==", "operand": False}],
                  "success": [{"put": {"key": key, "value": "v1"}}, {"get": {"key": key}}],
                  "failure": [{"get": {"key": key}}]}
        status, body = _call(cluster, node, "POST", path, json.dumps(absent).encode())
        assert status == 200 and body["succeeded"], body
        got = body["responses"][1]["get"]
        assert got["value"] == "djE=" and got["mod_revision"] == body["index"]  # b"v1"
        status, body = _call(cluster, node, "POST", path, json.dumps(absent).encode())
        assert status == 200 and not body["succeeded"]
        assert body["responses"][0]["get"]["value"] == "djE="
        mod = body["responses"][0]["get"]["mod_revision"]
        swap = {"compare": [{"key": key, "target": "mod", "op": "==", "operand": mod},
                            {"key": key, "target": "value", "op": "==", "operand": "v1"}],
                "success": [{"delete": {"key": key}}]}
        status, body = _call(cluster, node, "POST", path, json.dumps(swap).encode())
        assert status == 200 and body["succeeded"]
        assert body["responses"] == [{"delete": {"deleted": True}}]


BAD_TXN = [
    (b"{not json", "JSON object"),
    (b'{"compare": {}}', "must be a list"),
    (b'{"compare": [{"key": "k", "target": "colour", "op": "==", "operand": 1}]}', "target"),
    (b'{"compare": [{"key": "k", "target": "mod", "op": "=~", "operand": 1}]}', "op must"),
    (b'{"compare": [{"key": "k", "target": "mod", "op": "==", "operand": -3}]}', "integer"),
    (b'{"compare": [{"key": "k", "target": "exists", "op": "<", "operand": true}]}', "exist"),
    (b'{"success": [{"put": {"key": "k"}}]}', "value"),
    (b'{"success": [{"upsert": {"key": "k"}}]}', "must be one of"),
    (b'{"success": [{"put": {"key_b64": "%%%", "value": "v"}}]}', "base64"),
    (b'{"success": [], "then": []}', "unknown field"),
    (b'{"success": [{"delete": {"key": "u:", "range_end": "u;"}}]}', "unknown field"),
    (b'{"compare": [{"key": "k", "target": "mod", "op": "==", "operand": 1, "x": 2}]}',
     "unknown field"),
    (b'{"success": [], "success": [{"put": {"key": "k", "value": "v"}}]}', "twice"),
    (b'{"success": [' + b",".join([b'{"get": {"key": "k"}}'] * 9) + b"]}", "gets"),
    (b'{"success": [{"put": {"key": "k", "value": "1"}}, {"delete": {"key": "k"}}]}',
     "more than once"),
]


@pytest.mark.parametrize("raw, why", BAD_TXN)
def test_a_malformed_transaction_is_a_400_on_both_apis(
        cluster: ProcCluster, raw: bytes, why: str) -> None:
    for path in _txn_paths():
        status, body = _call(cluster, "n2", "POST", path, raw)
        assert status == 400 and why in body["error"], (path, raw, body)


def test_a_table_transaction_across_partitions_is_refused(cluster: ProcCluster) -> None:
    from raftkv.placement.assignments import partition_of
    a = "x0"
    b = next(f"x{i}" for i in range(1, 100)
             if partition_of(f"x{i}".encode(), PARTS) != partition_of(a.encode(), PARTS))
    body = {"success": [{"put": {"key": a, "value": "1"}}, {"put": {"key": b, "value": "2"}}]}
    status, answer = _call(cluster, "n1", "POST", f"/v1/tables/{TABLE}/txn",
                           json.dumps(body).encode())
    assert status == 400 and "one partition" in answer["error"], answer
    for key in (a, b):
        assert _call(cluster, "n1", "GET", f"/v1/tables/{TABLE}/kv/{key}")[0] == 404
    status, answer = _call(cluster, "n1", "POST", f"/v1/tables/{TABLE}/txn", b"{}")
    assert status == 400 and "at least one key" in answer["error"]
    status, answer = _call(cluster, "n1", "POST", "/v1/tables/nosuch/txn", b"{}")
    assert status == 404


@pytest.mark.parametrize("node", ["n1", "n2"])
def test_a_key_with_a_newline_is_served_like_any_other(cluster: ProcCluster, node: str) -> None:
    for path in _paths(b"line\nbreak"):
        assert _call(cluster, node, "PUT", path, b"v")[0] == 200
        assert _call(cluster, node, "GET", path) == (200, b"v")
        assert _call(cluster, node, "DELETE", path)[0] == 200
        assert _call(cluster, node, "GET", path)[0] == 404
