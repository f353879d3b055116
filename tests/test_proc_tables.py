"""Tables on real ``raftkv serve`` processes: create, route keys, describe, grow the cluster.

Three founders host the metastore (voters) and the default group; a fourth node starts
with ``--join`` and is added to the placement topology with ``POST /v1/cluster/nodes``
(``ProcCluster.add_table_node``), which rebalances every table onto it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raftkv.client import Client, ClientError
from raftkv.placement.assignments import calc_assignments, partition_of
from raftkv.placement.catalog import partition_group
from raftkv.placement.leader_balance import preferred_leader
from raftkv.testing.procs import ProcCluster

TABLE, PARTS = "users", 8


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path), size=3, tick=0.02) as c:
        c.start()
        yield c


def _describe(c: Client) -> dict[str, Any]:
    return c.describe_table(TABLE)


def _converged(d: dict[str, Any], nodes: list[str], replicas: int) -> bool:
    for p in d["partitions"]:
        want = calc_assignments(TABLE, p["partition"], nodes, replicas)
        if (p["stable"] != want or p["pending"] or p["planned"] or p["leader"] is None
                or p["voters"] != want or p["learners"]):
            return False
    return True


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last is True:
                return
        except (ClientError, OSError) as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout}s; last: {last!r}")


def test_tables_route_describe_errors_and_a_fourth_node(cluster: ProcCluster) -> None:
    ids = ["n1", "n2", "n3"]
    clients = {i: cluster.client([i]) for i in ids}
    admin = cluster.client()
    created = admin.create_table(TABLE, PARTS, 3)
    assert created == {"name": TABLE, "partitions": PARTS, "replicas": 3,
                       "storage": "persistent"}
    assert [t["name"] for t in cluster.client(["n3"]).list_tables()] == [TABLE]
    _wait(lambda: _converged(_describe(admin), ids, 3), 20, "leaders for every partition")
    d = _describe(clients["n2"])
    assert len(d["partitions"]) == PARTS
    for p in d["partitions"]:
        assert p["stable"] == ids and p["leader"] in ids

    data = {f"key-{i:03d}": f"value-{i}" for i in range(200)}
    for i, (k, v) in enumerate(data.items()):
        clients[ids[i % 3]].put(k, v, table=TABLE)
    for i, (k, v) in enumerate(data.items()):
        assert clients[ids[(i + 1) % 3]].get(k, table=TABLE) == v.encode()
    assert admin.get("key-000") is None  # the default group is a separate keyspace
    admin.delete("key-199", table=TABLE)
    assert admin.get("key-199", table=TABLE) is None
    del data["key-199"]

    with pytest.raises(ClientError) as e:
        admin.put("x", "y", table="nope")
    assert e.value.status == 404 and "unknown table" in e.value.body["error"]
    with pytest.raises(ClientError) as e:
        admin.describe_table("nope")
    assert e.value.status == 404
    with pytest.raises(ClientError) as e:
        admin.create_table("big", 2, 4)
    assert e.value.status == 400 and "exceeds" in e.value.body["error"]
    with pytest.raises(ClientError) as e:
        admin.create_table("bad.name", 2, 1)
    assert e.value.status == 400
    with pytest.raises(ClientError) as e:
        admin.create_table(TABLE, 2, 1)
    assert e.value.status == 409
    with pytest.raises(ClientError) as e:
        admin.set_replicas(TABLE, 4)
    assert e.value.status == 400
    with pytest.raises(ClientError) as e:
        admin.drop_table("nope")
    assert e.value.status == 404 and "unknown table" in e.value.body["error"]
    with pytest.raises(ClientError) as e:
        admin.drop_table("bad.name")
    assert e.value.status == 400
    with pytest.raises(ClientError) as e:
        admin.put("k" * 600, "v", table=TABLE)  # over the key size limit
    assert e.value.status == 400
    with pytest.raises(ClientError) as e:
        admin.get("", table=TABLE)  # an empty key
    assert e.value.status == 400

    all4 = [*ids, "n4"]
    moving = [p for p in range(PARTS) if calc_assignments(TABLE, p, all4, 3) != ids]
    assert moving
    cluster.add_table_node("n4")
    _wait(lambda: _converged(_describe(admin), all4, 3), 40, "the rebalance onto n4")
    d = _describe(cluster.client(["n4"]))
    assert not d["errors"], d["errors"]
    assert sum("n4" in p["stable"] for p in d["partitions"]) == len(moving)
    n4 = cluster.client(["n4"])
    for i, (k, v) in enumerate(data.items()):
        c = n4 if i % 2 else clients[ids[i % 3]]
        assert c.get(k, table=TABLE) == v.encode()
    n4.put("after", "growth", table=TABLE)
    assert clients["n1"].get("after", table=TABLE) == b"growth"
    for c in [*clients.values(), admin, n4]:
        c.close()


def test_drop_a_table_under_load_on_it_and_on_another(cluster: ProcCluster) -> None:
    """DELETE /v1/tables/{t} while clients write to it and to another table: the other
    table keeps every acknowledged write (replicas equal per partition); the dropped
    table's writes fail with 404 (in flight: "was dropped", later: "unknown table"); the
    re-created table starts empty."""
    other = "orders"
    ids = ["n1", "n2", "n3"]
    admin = cluster.client()
    admin.create_table(TABLE, PARTS, 3)
    admin.create_table(other, PARTS, 3)
    for t in (TABLE, other):
        _wait(lambda t=t: _converged(admin.describe_table(t), ids, 3), 30, f"{t} leaders")
    acked: dict[str, dict[str, str]] = {TABLE: {}, other: {}}
    failures: dict[str, list[ClientError]] = {TABLE: [], other: []}
    stop = threading.Event()

    def writer(table: str, w: int) -> None:
        c = cluster.client([ids[w % 3]])
        i = 0
        try:
            while not stop.is_set():
                k, v = f"w{w}-{i:04d}", f"v{i}"
                try:
                    c.put(k, v, table=table)
                    acked[table][k] = v
                except ClientError as e:
                    failures[table].append(e)
                    if table == TABLE:
                        time.sleep(0.02)
                i += 1
        finally:
            c.close()

    threads = [threading.Thread(target=writer, args=(t, w)) for t in (TABLE, other)
               for w in range(3)]
    for th in threads:
        th.start()
    _wait(lambda: len(acked[TABLE]) > 60 and len(acked[other]) > 60, 30, "writes")
    before = dict(acked[TABLE])
    started = time.monotonic()
    assert admin.drop_table(TABLE)["dropped"] == TABLE
    drop_call = time.monotonic() - started
    _wait(lambda: len(failures[TABLE]) >= 20, 20, "writes to the dropped table failing")
    n_other = len(acked[other])
    _wait(lambda: len(acked[other]) > n_other + 30, 20, "the other table to keep going")
    stop.set()
    for th in threads:
        th.join(30)
    assert not failures[other], [str(e) for e in failures[other][:3]]
    assert {e.status for e in failures[TABLE]} == {404}, {
        (e.status, e.body.get("error")) for e in failures[TABLE]}
    assert all("dropped" in e.body["error"] or "unknown table" in e.body["error"]
               for e in failures[TABLE])
    readers = [cluster.client([n]) for n in ids]
    for i, (k, v) in enumerate(acked[other].items()):
        assert readers[i % 3].get(k, table=other) == v.encode(), k
    for r in readers:
        r.close()

    def same_replicas() -> Any:
        d = admin.describe_table(other)
        if not _converged(d, ids, 3):
            return d
        return True

    _wait(same_replicas, 20, "the other table converged")
    with pytest.raises(ClientError) as e:
        admin.put("x", "y", table=TABLE)
    assert e.value.status == 404
    with pytest.raises(ClientError) as e:
        admin.drop_table(TABLE)
    assert e.value.status == 404

    # Every node forgets the dropped table (and its files) before it is re-created.
    def forgotten() -> bool:
        for n in ids:
            groups = Path(cluster.nodes[n].data_dir) / "groups"
            if any(p.name.startswith(f"t.{TABLE}.") for p in groups.iterdir()):
                return False
        return True

    _wait(forgotten, 20, "the dropped table's files deleted everywhere")
    admin.create_table(TABLE, PARTS, 3)
    _wait(lambda: _converged(admin.describe_table(TABLE), ids, 3), 30, "re-created leaders")
    for k in list(before)[:50]:
        assert admin.get(k, table=TABLE) is None
    admin.put("fresh", "1", table=TABLE)
    assert admin.get("fresh", table=TABLE) == b"1"
    print(f"drop call {drop_call:.3f}s, {len(acked[other])} writes to {other} kept, "
          f"{len(failures[TABLE])} refused on {TABLE}")
    admin.close()


def test_partition_leadership_moves_to_each_partitions_preferred_voter(
    cluster: ProcCluster,
) -> None:
    """Elections leave most partitions on whichever node timed out first; the balancer
    hands each to its preferred voter, so every node leads its share: exactly a third of
    12 partitions whose voters are the same three nodes. Then a table batch writes across
    the partitions."""
    admin = cluster.client()
    admin.create_table("balanced", 12, 3)
    want = {p: preferred_leader(partition_group("balanced", p), ["n1", "n2", "n3"])
            for p in range(12)}

    def balanced() -> Any:
        d = admin.describe_table("balanced")
        got = {p["partition"]: p["leader"] for p in d["partitions"]}
        return True if got == want else got

    _wait(balanced, 60, "every partition led by its preferred voter")
    counts = {n: sum(v == n for v in want.values()) for n in ("n1", "n2", "n3")}
    assert counts == {"n1": 4, "n2": 4, "n3": 4}, counts
    # A table batch: one atomic entry per partition, every partition it touches.
    data = {f"b-{i}": f"v{i}" for i in range(60)}
    indexes = admin.batch(list(data.items()), table="balanced")
    assert set(indexes) == {partition_of(k.encode(), 12) for k in data}
    assert all(admin.get(k, table="balanced") == v.encode() for k, v in data.items())
    with pytest.raises(ClientError) as e:  # checked before anything is proposed
        admin.batch([("b-0", "changed"), ("k" * 600, "v")], table="balanced")
    assert e.value.status == 400 and admin.get("b-0", table="balanced") == b"v0"
    with pytest.raises(ClientError) as e:
        admin.batch([("x", "y")], table="nope")
    assert e.value.status == 404


def test_two_in_memory_replicas_are_refused_unless_allowed_and_survive_a_restart(
    cluster: ProcCluster,
) -> None:
    """Issue 14, "no reachable state waits for ever". Two replicas cannot survive one
    failure: the API refuses them for an in-memory table unless ``allow_unsafe`` (and
    warns for a persistent one). Accepted anyway, a partition whose replica is SIGKILLed
    and restarted (its state gone) must converge: before the lone-holder rule
    (``raftkv.placement.rebalance``) the restarted replica waited for a majority of two
    holders and the other one sat in PRE_CANDIDATE for ever."""
    ids = ["n1", "n2", "n3"]
    admin = cluster.client()
    with pytest.raises(ClientError) as e:
        admin.create_table("mem2", 4, 2, "memory")
    assert e.value.status == 400 and "allow_unsafe" in e.value.body["error"]
    created = admin.create_table("mem2", 4, 2, "memory", allow_unsafe=True)
    assert "cannot survive one failure" in created["warning"]
    assert "cannot survive one failure" in admin.create_table("disk2", 1, 2)["warning"]
    assert "warning" not in admin.create_table("mem3", 1, 3, "memory")
    # One replica: in memory, every row goes with a restart (found from outside: a
    # 1-replica in-memory table was accepted silently and lost its rows on restart).
    with pytest.raises(ClientError) as e:
        admin.create_table("mem1", 1, 1, "memory")
    assert e.value.status == 400 and "allow_unsafe" in e.value.body["error"]
    assert "any failure" in admin.create_table("disk1", 1, 1)["warning"]
    # A misspelt field is refused, not ignored (it created a persistent table).
    typo = b'{"name": "typo", "partitions": 1, "replicas": 3, "storgae": "memory"}'
    for path, body in (("/v1/tables", typo),
                       ("/v1/tables/mem3/replicas", b'{"replicas": 3, "alow_unsafe": true}')):
        with pytest.raises(ClientError) as e:
            admin.request("POST" if path == "/v1/tables" else "PUT", path, body)
        assert e.value.status == 400 and "unknown field" in e.value.body["error"], path
    assert "typo" not in {t["name"] for t in admin.list_tables()}
    # So are an unknown query parameter and an unknown batch field (found from outside:
    # a batch "id" was dropped silently, though a client may think it idempotent).
    for method, path, body in (
            ("POST", "/v1/batch?foo=1", b'{"ops": [["q", "1"]]}'),
            ("POST", "/v1/batch", b'{"ops": [["q", "1"]], "id": "my-batch-1"}'),
            ("POST", "/v1/tables/mem3/batch?foo=1", b'{"ops": [["q", "1"]]}'),
            ("POST", "/v1/tables/mem3/txn?foo=1",
             b'{"success": [{"put": {"key": "q", "value": "1"}}]}'),
            ("POST", "/v1/leases?foo=1", b'{"ttl": 10}'),
            ("POST", "/v1/tables?foo=1", b'{"name": "q", "partitions": 1, "replicas": 3}')):
        with pytest.raises(ClientError) as e:
            admin.request(method, path, body)
        err = e.value.body["error"]
        assert e.value.status == 400 and ("foo" in err or "unknown field 'id'" in err), \
            (path, e.value.body)
    assert admin.get("q") is None and admin.get("q", table="mem3") is None
    assert "q" not in {t["name"] for t in admin.list_tables()}
    # A table batch keeps /v1/batch's limit on the batch as a whole (found from outside:
    # 10,001 operations split over partitions were each under it, and applied).
    too_many = json.dumps({"ops": [[f"b{i}", "1"] for i in range(10_001)]}).encode()
    with pytest.raises(ClientError) as e:
        admin.request("POST", "/v1/tables/mem3/batch", too_many)
    assert e.value.status == 400 and "10000" in e.value.body["error"].replace(",", "")
    assert admin.get("b0", table="mem3") is None
    # A bad operation is named by its place in the request, not in a partition's share.
    ninth_bad = json.dumps({"ops": [[f"c{i}", "1"] for i in range(8)] + [["", "1"]]}).encode()
    with pytest.raises(ClientError) as e:
        admin.request("POST", "/v1/tables/mem3/batch", ninth_bad)
    assert e.value.status == 400 and "batch op 8" in e.value.body["error"], e.value.body
    with pytest.raises(ClientError) as e:
        admin.set_replicas("mem3", 2)
    assert e.value.status == 400 and "allow_unsafe" in e.value.body["error"]

    def settled(table: str) -> Any:
        d = admin.describe_table(table)
        for p in d["partitions"]:
            want = calc_assignments(table, p["partition"], ids, d["replicas"])
            if (p["stable"] != want or p["pending"] or p["planned"] or p["switch_reduce"]
                    or p["switch_append"] or p["leader"] is None or p["voters"] != want
                    or p["learners"]):
                return p
        return True

    _wait(lambda: settled("mem2"), 30, "mem2 placed")
    data = {f"key-{i:03d}": f"value-{i}" for i in range(40)}
    for k, v in data.items():
        admin.put(k, v, table="mem2")
    victim = "n3"
    hit = [p for p in range(4) if victim in calc_assignments("mem2", p, ids, 2)]
    assert hit
    cluster.kill(victim)
    started = time.monotonic()
    cluster.start(victim)  # in memory: its replicas of mem2 are gone

    def rejoined() -> Any:
        """The victim hosts each of its partitions again as a voter recorded under its
        new incarnation (so it was removed and re-added), and everything settled."""
        st = cluster.status(victim)
        for p in hit:
            g = (st or {}).get("groups", {}).get(partition_group("mem2", p))
            if (g is None or g["members"].get(victim) != "voter"
                    or g["incarnations"].get(victim) != g["incarnation"]):
                return (p, g)
        return settled("mem2")

    _wait(rejoined, 60, "mem2 converged after the restart")
    took = time.monotonic() - started
    for k, v in data.items():
        assert admin.get(k, table="mem2") == v.encode(), k
    admin.put("after", "restart", table="mem2")
    assert cluster.client([victim]).get("after", table="mem2") == b"restart"
    assert took < 45, took
    logs = "".join(cluster.nodes[n].log_text() for n in ids)
    assert "the lone holder campaigns without it" in logs


def test_describe_does_not_wait_for_a_drained_node_still_running(
    cluster: ProcCluster,
) -> None:
    """Found from outside: while a drained node kept running, every ``describe_table`` (the
    partition-aware client's route lookup) took 3 s on every node, waiting for the
    drained node's frozen view. Only the metastore's members are asked now."""
    admin = cluster.client()
    cluster.add_table_node("n4")
    admin.create_table(TABLE, 2, 3)
    cluster.wait_until(lambda: "n4" in {r["id"] for r in admin.cluster_nodes()}, 20,
                       "n4 listed")
    # A body that says something is refused, not ignored (found from outside: "garbage"
    # drained the node).
    for junk in (b"garbage", b'{"force": true}'):
        req = urllib.request.Request(f"{cluster.nodes['n1'].endpoint}/v1/cluster/nodes/n4/drain",
                                     data=junk, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400, junk
    assert not {r["id"]: r for r in admin.cluster_nodes()}["n4"]["draining"]
    admin.drain("n4")
    cluster.wait_until(lambda: "n4" not in {r["id"] for r in admin.cluster_nodes()}, 60,
                       "n4 drained")
    n4 = cluster.nodes["n4"]
    assert n4.alive  # still running, as an operator may leave it
    # Its own status still answers once its metastore replica is gone, with the groups it
    # still serves (found from outside: a 503 left a drained node that led the default
    # group out of `cluster status`).
    def own_status() -> Any:
        with urllib.request.urlopen(f"{n4.endpoint}/v1/cluster", timeout=10) as r:
            return json.loads(r.read())
    cluster.wait_until(lambda: own_status()["groups"]["meta"].get("removed") is not None,
                       30, "n4 told its metastore replica was removed")
    st = own_status()
    assert "default" in st["groups"] and st["http"] == {} and "not a member" in st["note"]
    # A table it has not heard of (created after its drain, or none at all) is a 503 at
    # once that says why; it was a 504 after 5 s (found from outside: "no read index
    # confirmed in time", which says the outcome is unknown).
    admin.create_table("later", 1, 3)
    for table in ("later", "nosuch"):
        req = urllib.request.Request(f"{n4.endpoint}/v1/tables/{table}/kv/k", data=b"v",
                                     method="PUT")
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(e.value.read())
        assert e.value.code == 503 and "not a member" in body["error"], body
        assert time.monotonic() - t0 < 3
    assert admin.get("k", table="later") is None

    def asked() -> float:
        """Describe requests n4 has received (its own request counter)."""
        with urllib.request.urlopen(f"{n4.endpoint}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("raftkv_http_requests_total{")
                   and 'route="/v1/tables/{table}"' in line and 'method="GET"' in line)

    before = asked()
    for _ in range(3):
        described = admin.describe_table(TABLE)
        assert "n4" not in described["nodes_answered"]
        assert "n4" not in described["http"] and "n1" in described["http"]
    assert asked() == before
    # Stopped for good, it is no longer one of the cluster's HTTP addresses, and status
    # does not report it unreachable (found outside-in: for ever, exiting 1).
    cluster.kill("n4")
    body = cluster.status("n1")
    assert body is not None and "n4" not in body["http"] and "n1" in body["http"], body
    ends = ",".join(cluster.nodes[n].endpoint for n in ("n1", "n2", "n3"))
    res = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", ends,
                          "cluster", "status"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "n4" not in res.stdout, (res.stdout, res.stderr)
    admin.close()


def test_add_node_never_moves_or_shares_a_nodes_addresses_and_cancels_a_drain(
    cluster: ProcCluster,
) -> None:
    """Found from outside: ``cluster add-node`` of an existing id answered 200 and
    overwrote its HTTP address (other nodes then proxied to nowhere), and a new id with
    another node's raft address was placed partitions it could never host. Both are 409
    now, a repeat with the same addresses is a harmless 200, and adding back a node that
    is draining cancels the drain (its status said draining for ever)."""
    admin = cluster.client()
    n1 = cluster.nodes["n1"]
    for args, want in (
        (("n1", "10.9.9.9:1"), "already a node at"),
        (("n1", n1.raft_addr, "127.0.0.1:1"), "already serves HTTP at"),
        (("n9", n1.raft_addr), "is n1's"),
    ):
        with pytest.raises(ClientError) as e:
            admin.add_node(*args)
        assert e.value.status == 409 and want in e.value.body["error"], e.value.body
    added = admin.add_node("n1", n1.raft_addr, f"127.0.0.1:{n1.http_port}")
    assert added["id"] == "n1" and "warning" not in added  # a running node
    assert admin.status(n1.endpoint)  # its HTTP address still works for the others
    assert "n9" not in {r["id"] for r in admin.cluster_nodes()}
    # A node nobody has heard from is taken (it may start later) with a warning (found
    # from outside: a mistyped add-node took most partitions' replicas without a word).
    ghost = admin.add_node("n8", "127.0.0.1:1")
    assert "n8 has not been heard from" in ghost["warning"], ghost
    admin.remove_node("n8")

    cluster.add_table_node("n4")
    admin.create_table(TABLE, 2, 3)
    admin.drain("n4")
    rows = {r["id"]: r for r in admin.cluster_nodes()}
    if "n4" in rows:  # not yet gone: add it back while it drains
        n4 = cluster.nodes["n4"]
        admin.add_node("n4", n4.raft_addr)
        cluster.wait_until(lambda: not {r["id"]: r for r in admin.cluster_nodes()}
                           .get("n4", {"draining": True})["draining"], 20,
                           "n4 no longer draining")
    admin.close()


@pytest.mark.parametrize("dead", [True, False])
def test_describe_names_the_under_replicated_partitions(cluster: ProcCluster,
                                                        dead: bool) -> None:
    """Found outside-in: partitions left with two voters of three (there, a drain begun
    while another node was only suspect) showed no error and no change in ``describe``.
    A node declared dead on a three-node cluster leaves every partition two voters: each
    is named in ``under_replicated`` until the node is back (``dead``). Found from
    outside later: a table created while a topology node was down had that node as a
    voter of most partitions for the 30 s until it was declared dead, and the list was
    empty though only two copies existed. A voter that does not host its partition (its
    node is down) counts too, before any declaration (not ``dead``)."""
    admin = cluster.client()
    if dead:
        admin.update_settings(scale_down_timeout=2.0, scale_up_timeout=1.0)
    else:
        admin.update_settings(scale_down_timeout=600.0)
    admin.create_table("short", 2, 3)
    _wait(lambda: admin.describe_table("short")["under_replicated"] == [], 60,
          "fully replicated")
    cluster.kill("n3")
    _wait(lambda: admin.describe_table("short")["under_replicated"] == [0, 1], 60,
          "both partitions named while n3 is away")
    if not dead:
        assert all("n3" in p["voters"] for p in admin.describe_table("short")["partitions"])
    cluster.start("n3")
    _wait(lambda: admin.describe_table("short")["under_replicated"] == [], 90,
          "fully replicated again")
    admin.close()


def test_the_client_deletes_on_a_cas_to_none_and_refuses_what_is_not_a_key_or_value(
    cluster: ProcCluster,
) -> None:
    """Found from outside: ``Client.put(k, None)`` and ``Client.cas(k, v, None)`` sent an
    empty body and stored an empty value, where the embedded ``RaftKV`` refuses the put
    and takes the CAS to None as a delete, and ``Client.batch`` takes None as a delete.
    Now the client's CAS to None is a compare-and-delete (on a table and on the default
    group), and a None, an int or a malformed batch op is a TypeError before anything
    is sent."""
    cluster.wait_leader()
    c = cluster.client()
    c.create_table(TABLE, 2, 3)
    for table in (None, TABLE):
        c.put("k", "v", table=table)
        assert c.cas("k", "wrong", None, table=table)[0] is False
        assert c.get("k", table=table) == b"v"
        assert c.cas("k", "v", None, table=table)[0] is True
        assert c.get("k", table=table) is None
        assert c.cas("k", None, None, table=table)[0] is True  # absent, and stays so
        c.put("k", "v", table=table)
        assert c.cas("k", None, None, table=table)[0] is False
        meta = c.get_meta("k", table=table)
        assert meta is not None
        assert c.cas("k", None, None, table=table, prev_index=meta["mod_revision"])[0]
        assert c.get("k", table=table) is None
        c.put("k", "v", table=table)
        bad: list[tuple[Any, ...]] = [
            (c.put, "k", None), (c.put, 5, "v"), (c.cas, "k", 5, "w"),
            (c.batch, [("k",)]), (c.batch, [("k", 7)])]
        for fn, *args in bad:
            with pytest.raises(TypeError, match="bytes or str|pair"):
                fn(*args, table=table)
        assert c.get("k", table=table) == b"v"


def _memory_table_with_a_key(c: ProcCluster, admin: Client, name: str,
                             replicas: int) -> None:
    """A 1-partition in-memory table, fully replicated, holding k=v on every replica."""
    admin.create_table(name, 1, replicas, "memory")
    _wait(lambda: admin.describe_table(name)["under_replicated"] == [], 60,
          "fully replicated")
    admin.put("k", "v", table=name)
    c.wait_caught_up()


def test_an_in_memory_partition_that_lost_a_majority_says_so(cluster: ProcCluster) -> None:
    """Found from outside: two of three in-memory replicas restarted together left the
    partition without a leader for good (rightly: a write they acknowledged may exist
    nowhere else), and ``describe`` had no error, so it looked like an election under
    way. Its ``errors`` now name the partition, the replicas that restarted empty and
    the node that still holds what survives; the survivor's stale reads still work."""
    admin = cluster.client()
    _memory_table_with_a_key(cluster, admin, "lost", 3)
    for nid in ("n2", "n3"):
        cluster.kill(nid)
    for nid in ("n2", "n3"):
        cluster.start(nid)

    def said() -> Any:
        d = admin.describe_table("lost")
        return d["under_replicated"] == [0] and any(
            "restarted empty" in e and "n2, n3" in e and "only on n1" in e
            for e in d["errors"]) or (d["partitions"], d["errors"])

    _wait(said, 60, "the lost majority named in describe's errors")
    assert cluster.client(["n1"]).get("k", stale=True, table="lost") == b"v"
    # A count through any node says no leader is known, as a key's request does (found
    # from outside: it said the partition was not hosted here and may have just moved).
    for node in cluster.nodes.values():
        url = (f"http://127.0.0.1:{node.http_port}/v1/tables/lost/kv?prefix=&count_only=true")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=30)
        body = e.value.read().decode()
        assert e.value.code == 503 and "no leader" in body, (node.id, body)
    assert admin.describe_table("lost")["restarted_empty"] == []
    # The last holder restarts too: nothing holds the data, and the partition starts
    # again empty and writable, which describe says (found from outside: it did not).
    cluster.kill("n1")
    cluster.start("n1")
    _wait(lambda: admin.describe_table("lost")["restarted_empty"] == [0], 60,
          "the full-partition restart named in describe")
    _wait(lambda: admin.put("k2", "v2", table="lost") is not None, 60, "writable again")
    assert admin.get("k", table="lost") is None
    admin.close()


def test_a_replica_removed_by_set_replicas_routes_its_requests_to_the_partition(
    cluster: ProcCluster,
) -> None:
    """Found from outside: raw HTTP writers on every node while a table went from 3
    replicas to 2 and back got 503 "not a member of this group any more ... it will not
    serve this group unless it is added back" from healthy nodes, 13 times in 20 s: the
    node's replica had been removed, its group not yet stopped, and the request was
    served by it. A removed replica's requests now go where the partition is, as for a
    partition not hosted here; a table batch's shares too. Every acknowledged write is
    read back."""
    admin = cluster.client()
    admin.create_table("shrink", 2, 3)
    ports = [n.http_port for n in cluster.nodes.values()]
    acked: dict[str, str] = {}
    refused: list[str] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        i = 0
        while not stop.is_set():
            key, port = f"w{w}-{i}", ports[(w + i) % len(ports)]
            base = f"http://127.0.0.1:{port}/v1/tables/shrink"
            if i % 2:  # a table batch: its partitions' shares take the same route
                keys = [key, f"{key}b"]
                req = urllib.request.Request(
                    f"{base}/batch", data=json.dumps({"ops": [[k, "v"] for k in keys]}).encode(),
                    method="POST", headers={"Content-Type": "application/json"})
            else:
                # Only if absent: a copy applied twice (sent again by a proxy after the
                # first applied) would answer 412.
                keys = [key]
                req = urllib.request.Request(f"{base}/kv/{key}?prev_absent=true", data=b"v",
                                             method="PUT")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    if r.status == 200:
                        acked.update(dict.fromkeys(keys, "v"))
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")
                if "not a member" in body or e.code == 412:
                    refused.append(body)
            except OSError:
                pass
            i += 1

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    try:
        for replicas in (2, 3, 2, 3):
            admin.set_replicas("shrink", replicas)

            def settled(n: int = replicas) -> bool:
                d = admin.describe_table("shrink")
                return all(len(p["stable"]) == n and not p["pending"] and p["leader"]
                           and len(p["hosted_on"]) == n for p in d["partitions"])
            _wait(settled, 60, f"{replicas} replicas")
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert not refused, refused[:3]
    assert len(acked) > 50
    for key in acked:
        assert admin.get(key, table="shrink") == b"v", key


def test_half_of_an_in_memory_partitions_replicas_restarted_says_so_and_serves_stale(
    tmp_path: Path,
) -> None:
    """Found from outside: an in-memory partition of 4 replicas, 2 of them restarted,
    stayed leaderless for good (rightly: 2 of 4 is not a majority) with ``errors: []``,
    since the rule counted a lost majority only (3 of 4). And a stale read of one of its
    keys, sent to a node whose first candidate host had restarted empty, was answered
    503 "not hosted here" by that candidate, where a stale scan found the survivors.
    Now ``errors`` says so, naming only stable survivors as holders, and the request
    goes on to the next host."""
    with ProcCluster(str(tmp_path), size=5, tick=0.02) as c:
        c.start()
        admin = c.client()
        _memory_table_with_a_key(c, admin, "half", 4)
        stable = sorted(admin.describe_table("half")["partitions"][0]["stable"])
        lost, left = stable[:2], stable[2:]
        outside = next(n for n in c.nodes if n not in stable)
        for nid in lost:
            c.kill(nid)
        for nid in lost:
            c.start(nid)

        def said(holders: str = ", ".join(left)) -> Any:
            d = admin.describe_table("half")
            return any(f"({', '.join(lost)}) restarted empty, leaving 2" in e
                       and f"only on {holders};" in e for e in d["errors"]) or (
                d["partitions"], d["errors"])

        _wait(said, 60, "the lost majority named in describe's errors")
        for nid in [outside, *lost]:
            url = f"http://127.0.0.1:{c.nodes[nid].http_port}/v1/tables/half/kv/k?stale=true"
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.read() == b"v", nid
        # A fifth replica, pending: its node hosts the partition, empty, and no leader
        # will send it anything. Its stale digest is a 503, not the digest of no rows
        # (found from outside: 200, count 0), and errors do not name it as a holder.
        admin.set_replicas("half", 5)
        digest = (f"http://127.0.0.1:{c.nodes[outside].http_port}"
                  "/v1/tables/half/partitions/0/digest?timeout=0")

        def refused() -> Any:
            try:
                with urllib.request.urlopen(digest, timeout=30) as r:
                    return ("answered", r.status, r.read())
            except urllib.error.HTTPError as e:
                body = e.read().decode()
                return (e.code == 503 and "has not caught up" in body) or (e.code, body)

        _wait(refused, 60, f"{outside}'s pending replica refusing a stale digest")
        _wait(lambda: said(f"{', '.join(left)} ({outside}, pending, may hold part of it)"),
              30, "the pending replica named apart from the holders")
        admin.close()


def test_an_in_memory_partition_with_a_replica_restarted_and_one_down_says_so(
    cluster: ProcCluster,
) -> None:
    """Found from outside: one replica of three restarted empty while another's node was
    down left no majority, and ``errors`` stayed empty until the down node restarted too.
    It now names both, and that the silent one may hold the rows if it still runs."""
    admin = cluster.client()
    _memory_table_with_a_key(cluster, admin, "gone", 3)
    cluster.kill("n3")
    cluster.kill("n2")
    cluster.start("n2")

    def said() -> Any:
        d = admin.describe_table("gone")
        return any("(n2) restarted empty and n3 did not answer" in e and "leaving 1" in e
                   and "only on n1 (and n3, if still running);" in e
                   for e in d["errors"]) or d["errors"]

    _wait(said, 60, "the restarted and the silent replica named in describe's errors")
    assert cluster.client(["n1"]).get("k", stale=True, table="gone") == b"v"
    admin.close()


def test_a_persistent_partition_whose_majority_lost_its_files_says_so(
    cluster: ProcCluster,
) -> None:
    """Found from outside: two replicas of three lost their partition logs (SIGKILL, the
    directory deleted, restart); every partition went leaderless, rightly, and
    ``describe`` said ``errors: []``, with no pointer to the way out. It now names the
    replicas that lost their files, the survivor, and ``unsafe-reset``."""
    import shutil

    from raftkv.storage.layout import partition_logs_path

    admin = cluster.client()
    admin.create_table("disk", 1, 3)
    _wait(lambda: admin.describe_table("disk")["under_replicated"] == [], 60,
          "fully replicated")
    admin.put("k", "v", table="disk")
    cluster.wait_caught_up()
    for nid in ("n2", "n3"):
        cluster.kill(nid)
        shutil.rmtree(partition_logs_path(cluster.nodes[nid].data_dir))
    for nid in ("n2", "n3"):
        cluster.start(nid)

    def said() -> Any:
        d = admin.describe_table("disk")
        return any("2 of its 3 replicas (n2, n3) are not hosted by their running nodes" in e
                   and "leaving 1" in e and "only on n1." in e
                   and "If this lasts" in e and "unsafe-reset --group t.disk.0" in e
                   for e in d["errors"]) or (d["partitions"], d["errors"])

    _wait(said, 60, "the lost majority named in describe's errors")
    assert cluster.client(["n1"]).get("k", stale=True, table="disk") == b"v"
    admin.close()
