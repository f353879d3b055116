"""The partition-aware client against real ``raftkv serve`` processes (``raftkv.client``).

Four nodes, a table of 8 partitions with 2 replicas: every node leads or follows only some
partitions, so a request sent to the wrong node takes a proxy hop. The nodes' own
``raftkv_http_requests_total`` counts every request a node answers, a proxied one on both
nodes it passes, so "the table route was answered exactly N times across the cluster for
N requests" says that no request was proxied. Plain requests all sent to one node show
their proxies in the same count: the check can fail. A client given one endpoint finds
the others from ``/v1/cluster``.

A leadership change during a measured run (the leader balancer still spreading the new
table's leaders, or an election) rightly costs a request a detour, so a run counts only if
every partition's (leader, term) is the same before and after it; otherwise it is run
again, at most three times. A client that routes wrongly fails every attempt.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raftkv.client import Client
from raftkv.testing.procs import ProcCluster

TABLE, PARTS = "routed", 8
ROUTE = "/v1/tables/{table}/kv/{key}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("routed")), size=4, tick=0.02) as c:
        c.start()
        c.wait_leader()
        c.create_table(TABLE, PARTS, 2)
        yield c


def _answered(c: ProcCluster) -> int:
    """Table KV requests answered, summed over the nodes."""
    total = 0
    for node in c.nodes.values():
        conn = http.client.HTTPConnection("127.0.0.1", node.http_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (sample.name == "raftkv_http_requests_total"
                        and sample.labels.get("route") == ROUTE):
                    total += int(sample.value)
    return total


def _leadership(c: ProcCluster) -> list[tuple[object, object]]:
    """Each partition's (leader, term), as ``describe`` merges the nodes' views."""
    admin = c.client()
    try:
        return [(p["leader"], p["term"]) for p in admin.describe_table(TABLE)["partitions"]]
    finally:
        admin.close()


def _answered_straight(c: ProcCluster, new_client: Callable[[], Client],
                       run: Callable[[Client, int], int]) -> None:
    """``run(client, attempt)`` makes requests and returns how many; each must be answered
    once (module docstring: a run during a leadership change is repeated). Each attempt
    has a new client, whose first request reads the routes within the attempt."""
    for attempt in range(3):
        leaders = _leadership(c)
        client = new_client()
        try:
            client.put(f"warm{attempt}", "1", table=TABLE)  # learns the routes
            before = _answered(c)
            n = run(client, attempt)
            answered = _answered(c) - before
        finally:
            client.close()
        if _leadership(c) == leaders and all(lead for lead, _ in leaders):
            assert answered == n
            return
    pytest.fail("the partition leaders changed during every attempt")


def test_table_requests_go_straight_to_the_partition_leader(cluster: ProcCluster) -> None:
    def run(c: Client, attempt: int) -> int:
        for i in range(40):
            key = f"k{attempt}.{i}"
            c.put(key, f"v{i}", table=TABLE)
            assert c.get(key, table=TABLE) == f"v{i}".encode()
            swapped, _ = c.cas(key, f"v{i}", f"w{i}", table=TABLE)
            assert swapped
        return 40 * 3

    _answered_straight(cluster, cluster.client, run)


def test_requests_sent_to_one_node_are_proxied_and_the_count_shows_it(
        cluster: ProcCluster) -> None:
    """The control: plain HTTP PUTs all sent to n4, which leads or holds only some
    partitions, so the others' are proxied and answered twice."""
    before = _answered(cluster)
    conn = http.client.HTTPConnection("127.0.0.1", cluster.nodes["n4"].http_port, timeout=20)
    try:
        for i in range(16):
            conn.request("PUT", f"/v1/tables/{TABLE}/kv/one{i}", body=b"x")
            r = conn.getresponse()
            r.read()
            assert r.status == 200
    finally:
        conn.close()
    assert _answered(cluster) - before > 16


def test_a_client_given_one_endpoint_finds_the_leaders_from_the_cluster(
        cluster: ProcCluster) -> None:
    """Only n4 given: the partition leaders' addresses come from ``/v1/cluster``, so the
    requests still go straight to them."""
    def run(c: Client, attempt: int) -> int:
        for i in range(16):
            c.put(f"found{attempt}.{i}", "x", table=TABLE)
        assert len(c.endpoints) > 1
        return 16

    _answered_straight(cluster, lambda: Client([cluster.nodes["n4"].endpoint]), run)


def test_a_stale_route_costs_a_detour_never_a_wrong_answer(cluster: ProcCluster) -> None:
    c = cluster.client()
    try:
        c.put("stale", "1", table=TABLE)
        # Every cached leader wrong: the nodes still answer right, the client then looks again.
        when, count, leaders = c._routes[TABLE]
        c._routes[TABLE] = (when, count, ["n1" if x != "n1" else "n2" for x in leaders])
        for i in range(8):
            c.put(f"stale{i}", str(i), table=TABLE)
        assert dict(c.scan(prefix="stale", table=TABLE)) == {
            b"stale": b"1", **{f"stale{i}".encode(): str(i).encode() for i in range(8)}}
    finally:
        c.close()


def test_a_dead_endpoint_does_not_stop_routing(cluster: ProcCluster) -> None:
    """An endpoint nobody listens on is skipped when routes are read (and not asked again
    for a while); the table requests still reach their leaders and answer right."""
    from raftkv.testing.procs import free_ports

    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    c = Client([dead, cluster.nodes["n2"].endpoint], timeout=20)
    try:
        for i in range(8):
            c.put(f"dead{i}", str(i), table=TABLE)
        assert dead in c._silent
        assert [c.get(f"dead{i}", table=TABLE) for i in range(8)] == [
            str(i).encode() for i in range(8)]
    finally:
        c.close()


def test_a_route_read_during_an_election_is_read_again_soon(cluster: ProcCluster) -> None:
    """A cached route with a partition whose leader was unknown (read mid-election) is
    trusted for ``ROUTE_RETRY``, not ``ROUTE_TTL``: the next request after it reads the
    leaders again, rather than proxy that partition's requests for ten seconds. A
    complete route of the same age is kept."""
    from raftkv.client import ROUTE_RETRY, ROUTE_TTL

    assert ROUTE_RETRY < ROUTE_TTL
    c = cluster.client()
    try:
        c.put("hole", "1", table=TABLE)
        when, count, leaders = c._routes[TABLE]
        holed = [None, *leaders[1:]]
        c._routes[TABLE] = (when, count, holed)
        c._partition_leader(TABLE, 1)
        assert c._routes[TABLE] == (when, count, holed)  # younger than ROUTE_RETRY
        old = when - ROUTE_RETRY - 0.01
        c._routes[TABLE] = (old, count, list(leaders))
        c._partition_leader(TABLE, 1)
        assert c._routes[TABLE] == (old, count, leaders)  # complete: kept
        c._routes[TABLE] = (old, count, holed)
        assert c._partition_leader(TABLE, 0) is not None  # read again
        refreshed, _, now_known = c._routes[TABLE]
        assert refreshed > old and all(now_known)
    finally:
        c.close()
