"""Leases against real ``raftkv serve`` processes (``raftkv.server.leases``).

A key attached to a lease that nobody keeps alive is deleted after its TTL, on every
replica, and a watcher sees the delete; a lease kept alive stays; across a SIGKILL of the
leader the new leader gives every lease its full TTL again (so a kept lease is not cut
short), and one left alone still expires; bad input is a 4xx that writes nothing.
"""

from __future__ import annotations

import threading
import time

import pytest

from raftkv.client import ClientError
from raftkv.testing.procs import ProcCluster


@pytest.fixture
def cluster(proc_cluster: ProcCluster) -> ProcCluster:
    return proc_cluster


def test_an_unkept_lease_expires_and_a_kept_one_stays_even_through_a_leader_kill(
        cluster: ProcCluster) -> None:
    c = cluster.client()
    first = c.put("other", "x")
    short, kept = c.lease_grant(2), c.lease_grant(3)
    c.put("lease/short", "1", lease=short)
    c.put("lease/kept", "2", lease=kept)
    assert c.lease_info(short)["keys"] == [b"lease/short"]
    seen: list[tuple[int, str, bytes]] = []

    def watch() -> None:
        for rev, events in cluster.client().watch(prefix="lease/", from_revision=first):
            seen.extend((rev, e["type"], e["key"]) for e in events)
            if any(t == "delete" and k == b"lease/short" for _, t, k in seen):
                return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    stop = threading.Event()

    def keep() -> None:
        k = cluster.client()
        while not stop.is_set():
            try:
                k.lease_keepalive(kept)
            except (ClientError, OSError):
                pass  # a leader change: the next one answers
            time.sleep(0.5)

    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    cluster.wait_until(lambda: c.get("lease/short") is None, 10, "the short lease expired")
    t.join(10)
    assert ("delete", b"lease/short") in [(ty, k) for _, ty, k in seen]
    assert c.get("lease/kept") == b"2"
    # Every replica deleted it (the revoke is a log entry).
    for n in cluster.nodes:
        cluster.wait_until(lambda n=n: cluster.client([n]).get("lease/short", stale=True)
                           is None, 10, f"{n} applied the revoke")
    leader = cluster.wait_leader()
    cluster.kill(leader)
    rest = [n for n in cluster.nodes if n != leader]
    cluster.wait_leader(rest)
    c = cluster.client(rest)
    time.sleep(4)  # longer than the kept lease's TTL: the keepalives keep it
    assert c.get("lease/kept") == b"2"
    stop.set()
    keeper.join(5)
    # Left alone, it goes within a TTL (3 s) and a keeper tick.
    cluster.wait_until(lambda: c.get("lease/kept") is None, 10, "the kept lease expired")
    assert c.get("other") == b"x"
    assert c.leases() == []


def test_lease_bad_input(cluster: ProcCluster) -> None:
    c = cluster.client()
    import http.client
    import json
    leader = cluster.nodes[cluster.wait_leader()]

    def call(method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, object]]:
        conn = http.client.HTTPConnection("127.0.0.1", leader.http_port, timeout=10)
        try:
            conn.request(method, path, body=body)
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    for body in (b'{"ttl": -1}', b'{"ttl": 0}', b'{"ttl": 1e12}', b'{"ttl": "5"}', b"{}",
                 b'{"ttl": 5, "id": 0}', b'{"ttl": 5, "colour": 1}', b"[5]"):
        status, answer = call("POST", "/v1/leases", body)
        assert status == 400 and "error" in answer, (body, answer)
    status, answer = call("PUT", "/v1/kv/k?lease=123456", b"v")
    assert status == 404 and "not found" in str(answer["error"])
    assert c.get("k") is None  # nothing written
    for path in ("/v1/leases/123456/keepalive", "/v1/leases/123456"):
        method = "POST" if path.endswith("keepalive") else "DELETE"
        assert call(method, path)[0] == 404
    assert call("GET", "/v1/leases/123456")[0] == 404
    assert call("GET", "/v1/leases/abc")[0] == 400
    assert call("PUT", "/v1/kv/k?lease=abc", b"v")[0] == 400
    lease = c.lease_grant(30, lease=77)
    assert call("POST", "/v1/leases", b'{"ttl": 5, "id": 77}')[0] == 409
    assert call("PUT", f"/v1/kv/k?lease={lease}&prev_absent=true", b"v")[0] == 400
    c.create_table("lt", 2, 1, storage="persistent")
    status, answer = call("PUT", f"/v1/tables/lt/kv/k?lease={lease}", b"v")
    assert status == 400 and "default KV group" in str(answer["error"])


def test_lease_info_asked_of_a_follower_has_its_remaining_seconds(
        cluster: ProcCluster) -> None:
    """Found from outside: ``lease info`` gave ``remaining`` or not depending on the node
    that answered (only the leader's lease clocks know it). A follower now names the
    leader, and the client asks it there."""
    import json
    import urllib.request

    lead = cluster.wait_leader()
    follower = next(n for n in cluster.nodes if n != lead)
    lease = cluster.client().lease_grant(30)
    with urllib.request.urlopen(f"{cluster.nodes[follower].endpoint}/v1/leases/{lease}",
                                timeout=10) as r:
        raw = json.loads(r.read())
    assert "remaining" not in raw and raw["leader"] == lead, raw
    c = cluster.client([follower])
    info = c.lease_info(lease)
    assert 0 < info["remaining"] <= 30 and "leader" not in info, info
    listed = c.leases()
    assert [(x["id"], "leader" in x) for x in listed] == [(lease, False)], listed
    assert 0 < listed[0]["remaining"] <= 30
