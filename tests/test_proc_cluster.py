"""Real ``raftkv serve`` processes: leader failure, restart and catch-up, membership.

Each test starts its own cluster on 127.0.0.1 (ports from the kernel) and SIGKILLs
every process at the end. Timing bounds are loose liveness checks, not benchmarks
(``benchmarks/throughput.py --failover`` measures failover).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Self

import pytest

from raftkv.client import Client, ClientError, Unavailable
from raftkv.testing.procs import ProcCluster, http_json


class Writers:
    """Client threads writing unique keys; remembers every acknowledged write."""

    def __init__(self, cluster: ProcCluster, n: int = 3) -> None:
        self.cluster = cluster
        self.acked: dict[str, str] = {}
        self.failed = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(n)]

    def _run(self, i: int) -> None:
        client = self.cluster.client(timeout=3.0)
        n = 0
        while not self._stop.is_set():
            key, value = f"w{i}-{n}", f"v{i}-{n}"
            n += 1
            try:
                client.put(key, value)
            except (ClientError, Unavailable):
                with self._lock:
                    self.failed += 1
                continue
            with self._lock:
                self.acked[key] = value
        client.close()

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=15)

    def count(self) -> int:
        with self._lock:
            return len(self.acked)

    def wait_for(self, n: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count() < n:
            assert time.monotonic() < deadline, f"only {self.count()} writes acknowledged"
            time.sleep(0.02)


def assert_all_present(client: Client, acked: dict[str, str]) -> None:
    missing = {k: v for k, v in acked.items() if client.get(k) != v.encode()}
    assert not missing, f"{len(missing)} acknowledged writes lost, e.g. {list(missing)[:5]}"


def assert_replicas_equal(cluster: ProcCluster) -> None:
    cluster.wait_caught_up()
    digests = {nid: cluster.digest(nid) for nid in cluster.alive_ids()}
    assert len({(d["count"], d["digest"]) for d in digests.values()}) == 1, digests


def test_leader_sigkill_under_load_elects_a_new_leader_and_loses_no_acknowledged_write(
    tmp_path: Path,
) -> None:
    """Raft §5.2 (election) and §5.4 (safety): after the leader dies under concurrent
    load, a new leader serves, and every write acknowledged before or after survives."""
    with ProcCluster(str(tmp_path)) as c:
        c.start()
        old = c.wait_leader()
        with Writers(c) as w:
            w.wait_for(200)
            killed_at = time.monotonic()
            c.kill(old)
            new = c.wait_leader(timeout=20)
            elected_in = time.monotonic() - killed_at
            before = w.count()
            w.wait_for(before + 100)
        assert new != old
        # Loose liveness bound (the election timeout is at most 1 s here).
        assert elected_in < 10 * c.election_timeout, elected_in
        client = c.client()
        assert_all_present(client, w.acked)
        # The old leader restarts, reports its recovery and catches up.
        c.start(old)
        assert_replicas_equal(c)
        assert "recovery:" in c.nodes[old].log_text()
        assert_all_present(c.client([old]), w.acked)


def test_killed_follower_catches_up_from_a_snapshot_after_compaction(tmp_path: Path) -> None:
    """IGNITE-16907 truncation + Raft §7: a follower that missed entries the leader has
    compacted away is brought back by a snapshot, then by the log."""
    with ProcCluster(str(tmp_path), extra_args=["--compact-entries", "300",
                                                 "--compact-keep", "20"]) as c:
        c.start()
        lead = c.wait_leader()
        victim = next(n for n in c.nodes if n != lead)
        c.kill(victim)
        client = c.client([n for n in c.nodes if n != victim])
        acked = {}
        for i in range(800):
            acked[f"k{i}"] = f"v{i}"
            client.put(f"k{i}", f"v{i}")
        # Compaction runs on the driver's one-second cadence.
        c.wait_until(lambda: (c.group_status(lead) or {}).get("first_index", 1) > 300,
                     what="the leader compacting its log")
        c.start(victim)
        assert_replicas_equal(c)
        assert_all_present(c.client([victim]), acked)
        # The victim's log starts after the snapshot it installed, not at entry 1.
        assert (c.group_status(victim) or {})["first_index"] > 1
        # Both ends say so in their logs, for an operator.
        assert any(f"sending {victim} a snapshot image of" in c.nodes[n].log_text()
                   for n in c.nodes if n != victim)
        assert "received a snapshot image of" in c.nodes[victim].log_text()


def test_restarted_follower_catches_up_from_the_log(tmp_path: Path) -> None:
    """Kudu design / IGNITE-16907: a restarted node replays its own log from its
    checkpoint, then receives the entries it missed by ordinary AppendEntries."""
    with ProcCluster(str(tmp_path)) as c:
        c.start()
        lead = c.wait_leader()
        victim = next(n for n in c.nodes if n != lead)
        client = c.client()
        for i in range(50):
            client.put(f"a{i}", "x")
        c.kill(victim)
        for i in range(50):
            client.put(f"b{i}", "y")
        c.start(victim)
        assert_replicas_equal(c)
        assert (c.group_status(victim) or {})["first_index"] == 1
        assert c.client([victim]).get("b49") == b"y"


def test_learner_added_under_load_is_promoted_automatically(tmp_path: Path) -> None:
    """Kudu design, adding a server: the new node joins as a PRE_FOLLOWER, never counts
    toward quorums while it catches up, and the leader promotes it once caught up."""
    with ProcCluster(str(tmp_path)) as c:
        c.start()
        c.wait_leader()
        with Writers(c, n=2) as w:
            w.wait_for(100)
            n4 = c.add_node("n4")
            admin = c.client([n for n in c.nodes if n != "n4"])
            admin.add_learner("n4", n4.raft_addr)
            c.wait_until(
                lambda: (c.group_status("n4") or {}).get("members", {}).get("n4") == "voter",
                what="n4 promoted to voter",
            )
            w.wait_for(w.count() + 50)
        assert_replicas_equal(c)
        assert_all_present(c.client(["n4"]), w.acked)


def test_removing_the_leader_transfers_leadership_first(tmp_path: Path) -> None:
    """Kudu design, removing the leader: it hands over to the most up-to-date voter,
    which performs the removal; the group keeps serving without the old leader."""
    with ProcCluster(str(tmp_path)) as c:
        c.start()
        lead = c.wait_leader()
        client = c.client()
        client.put("before", "1")
        client.remove(lead)
        rest = [n for n in c.nodes if n != lead]
        new = c.wait_leader(among=rest)
        assert new != lead
        c.wait_until(
            lambda: lead not in (c.group_status(new) or {}).get("members", {lead: 1}),
            what=f"{lead} removed from the configuration",
        )
        c.kill(lead)
        survivors = c.client(rest)
        survivors.put("after", "2")
        assert survivors.get("before") == b"1"


def test_admin_requests_to_a_follower_are_redirected_to_the_leader(tmp_path: Path) -> None:
    """Membership changes run on the leader: a follower answers 421 with the leader's
    id, and a client that knows the leader's endpoint follows it (one the cluster
    publishes too, once the metastore has it: not yet this soon after the start).
    (Transfers and writes need no redirect: the follower forwards them.)"""
    with ProcCluster(str(tmp_path)) as c:
        c.start()
        lead = c.wait_leader()
        follower = next(n for n in c.nodes if n != lead)
        status, body = http_json(c.nodes[follower].endpoint + "/v1/cluster/learners",
                                 {"id": "n9", "raft_addr": "127.0.0.1:1"})
        assert status == 421 and body["leader"] == lead
        reply = c.client([follower, lead]).add_learner("n9", "127.0.0.1:1")
        assert reply["kind"] == "pre-follower"
        # A transfer asked of a follower is forwarded by Raft itself.
        c.client([follower]).transfer(follower)
        assert c.wait_leader() == follower


def test_removing_a_live_voter_while_another_is_down_is_refused(tmp_path: Path) -> None:
    """Found from outside: with n1 of three down, removing a live voter was accepted and
    left two voters, one of them down: the group committed nothing until n1 came back,
    and the client heard "no answer". The leader refuses such a removal with a 409, as
    etcd's strict reconfiguration check does; removing the down voter is allowed."""
    with ProcCluster(str(tmp_path), tick=0.02) as c:
        c.start()
        lead = c.wait_leader()
        down, live = [n for n in c.nodes if n != lead]
        client = c.client([lead])
        client.put("before", "1")
        c.kill(down)
        time.sleep(4 * c.election_timeout)  # the leader counts it down after one
        with pytest.raises(ClientError) as refused:
            client.remove(live)
        assert refused.value.status == 409 and "quorum" in str(refused.value)
        assert set((c.group_status(lead) or {})["members"]) == set(c.nodes)
        client.put("still", "2")
        client.remove(down)
        c.wait_until(lambda: set((c.group_status(lead) or {})["members"]) == {lead, live},
                     what=f"{down} removed")
        assert client.get("before") == b"1"
