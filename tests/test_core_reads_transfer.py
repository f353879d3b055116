"""Linearizable reads via ReadIndex (dissertation §6.4) and leadership transfer
(dissertation §3.10) in the pure core."""

from __future__ import annotations

import pytest
from conftest import MT, Hold, cmd, tick_until

from raftkv.core import NotLeader, ProposalDropped, ReadState, Role, TransferRejected
from raftkv.testing.cluster import Cluster

N3 = ["n1", "n2", "n3"]


def started(seed: int = 0, **cfg) -> Cluster:
    c = Cluster(N3, seed=seed, **cfg)
    c.elect("n1")
    c.propose("n1", cmd(0))
    return c


# ------------------------------------------------------------------ ReadIndex --
def test_read_index_waits_for_majority_heartbeat_ack():
    """§6.4 steps 1-3: the leader records its commit index as the read index, then "sends
    a new round of heartbeats ... Once it receives acknowledgments from a majority of the
    cluster" it may serve the read. No ReadState before that."""
    c = started(seed=1)
    hold = Hold(lambda m: m.type == MT.HEARTBEAT_RESP)
    c.filters.append(hold)
    commit = c.raft("n1").log.committed
    c.raft("n1").read_index("r1")
    c.stabilize()
    assert c.read_states["n1"] == []
    assert len(hold.held) == 2 and all(m.context is not None for m in hold.held)
    hold.release(c, 1)  # self + one follower = majority of 3
    c.stabilize()
    assert c.read_states["n1"] == [ReadState(commit, "r1")]
    hold.release(c)
    c.stabilize()
    assert c.read_states["n1"] == [ReadState(commit, "r1")]  # answered once


def test_read_index_needs_a_majority_not_just_one_ack():
    """§6.4 step 3 in a 5-voter group: one follower's acknowledgement is not enough; the
    second (leader + 2 of 5) confirms the read."""
    c = Cluster([f"n{i}" for i in range(1, 6)], seed=11)
    c.elect("n1")
    hold = Hold(lambda m: m.type == MT.HEARTBEAT_RESP)
    c.filters.append(hold)
    c.raft("n1").read_index("r5")
    c.stabilize()
    assert len(hold.held) == 4
    hold.release(c, 1)
    c.stabilize()
    assert c.read_states["n1"] == []
    hold.release(c, 1)
    c.stabilize()
    assert c.read_states["n1"] == [ReadState(c.raft("n1").log.committed, "r5")]


def test_read_index_not_served_by_partitioned_leader():
    """§6.4: a leader cut off from the majority must never confirm a read: meanwhile the
    majority elects a new leader and commits a write the old leader has not seen."""
    c = started(seed=2)
    c.isolate("n1")
    c.raft("n1").read_index("stale?")
    c.stabilize()
    tick_until(c, lambda: c.raft("n2").role == Role.LEADER or c.raft("n3").role == Role.LEADER,
               ["n2", "n3"])
    new = "n2" if c.raft("n2").role == Role.LEADER else "n3"
    c.propose(new, cmd(1, "k0"))
    for _ in range(40):
        c.tick(["n1"])
        if c.raft("n1").role == Role.LEADER:
            c.raft("n1").read_index(object())  # more reads while it still thinks it leads
    c.heal()
    c.tick(n=5)
    assert c.read_states["n1"] == []
    assert c.raft("n1").role == Role.FOLLOWER and c.leader() == new


def test_read_index_deferred_until_fresh_leader_commits_entry_of_its_term():
    """§6.4 step 1: "If the leader has not yet marked an entry from its current term
    committed, it waits until it has done so" (the no-op of §8 tells it the latest commit
    index). The read index is then at least that entry."""
    c = started(seed=3)
    hold = Hold(lambda m: m.type == MT.APP_RESP and m.to == "n2")
    c.filters.append(hold)
    c.raft("n1").transfer_leadership("n2")
    c.stabilize()
    r2 = c.raft("n2")
    assert r2.role == Role.LEADER
    noop = r2.log.last_index()
    assert r2.log.term(noop) == r2.term and r2.log.committed < noop
    r2.read_index("r")
    c.stabilize()
    c.tick(["n2"], n=3)
    assert c.read_states["n2"] == []
    c.filters.clear()
    hold.release(c)
    c.stabilize()
    c.tick(["n2"])
    assert c.read_states["n2"] == [ReadState(noop, "r")]


def test_follower_read_index_forwarded_returns_leader_commit():
    """§6.4 ("followers ... request the current read index from the leader"): a follower's
    read is forwarded, confirmed by the leader's heartbeat round, and answered with the
    leader's commit index even when the follower itself lags behind it."""
    c = started(seed=4)
    c.filters.append(lambda m: not (m.type == MT.APP and m.to == "n3"))
    for i in range(1, 4):
        c.propose("n1", cmd(i))
    leader_commit = c.raft("n1").log.committed
    assert c.raft("n3").log.applied < leader_commit
    c.raft("n3").read_index("f1")
    c.stabilize()
    assert c.read_states["n3"] == [ReadState(leader_commit, "f1")]
    assert any(m.type == MT.READ_INDEX and m.frm == "n3" and m.to == "n1" for m in c.delivered)
    c.raft("n2").read_index("f2")
    c.stabilize()
    assert c.read_states["n2"] == [ReadState(leader_commit, "f2")]


def test_concurrent_reads_with_equal_contexts_from_different_nodes_all_answered():
    """§6.4 / ``Raft.read_index`` ("a ReadState with ``context`` follows"): contexts are
    chosen by each node's driver independently, so reads forwarded from different nodes
    must not be confused with one another at the leader."""
    c = started(seed=12)
    c.raft("n1").read_index(7)
    c.raft("n2").read_index(7)
    c.raft("n3").read_index(7)
    c.stabilize()
    c.tick(n=3)
    commit = c.raft("n1").log.committed
    for n in N3:
        assert c.read_states[n] == [ReadState(commit, 7)], n


def test_read_index_without_known_leader_raises():
    """§6.4: with no leader to ask there is no read index; the caller retries elsewhere."""
    c = Cluster(N3, seed=5)
    with pytest.raises(NotLeader):
        c.raft("n2").read_index("x")


# ------------------------------------------------------- leadership transfer --
def test_transfer_to_up_to_date_node():
    """§3.10: the leader sends TimeoutNow to an up-to-date target, which starts an election
    at once (bypassing pre-vote and the stickiness lease) and wins the next term."""
    c = started(seed=6)
    term = c.raft("n1").term
    c.raft("n1").transfer_leadership("n2")
    c.stabilize()
    assert c.leader() == "n2" and c.raft("n2").term == term + 1
    assert c.raft("n1").role == Role.FOLLOWER and c.raft("n1").lead == "n2"
    assert [m.to for m in c.delivered if m.type == MT.TIMEOUT_NOW] == ["n2"]
    i = c.propose("n2", cmd(1))
    assert all(c.raft(n).log.committed == i for n in N3)


def test_transfer_to_lagging_node_catches_it_up_first():
    """§3.10 step 1: "The prior leader ... sends it log entries until the target server's
    log matches" before TimeoutNow, so the target wins with the leader's full log."""
    c = started(seed=7)
    c.cut("n1", "n3")
    for i in range(1, 8):
        c.propose("n1", cmd(i))
    c.heal()
    assert c.raft("n3").log.last_index() < c.raft("n1").log.last_index()
    at_timeout = {}

    def watch(m):
        if m.type == MT.TIMEOUT_NOW:
            at_timeout["n3"] = c.logs("n3")
            at_timeout["n1"] = c.logs("n1")
        return True

    c.filters.append(watch)
    c.raft("n1").transfer_leadership("n3")
    c.stabilize()
    assert at_timeout["n3"] == at_timeout["n1"]
    assert c.leader() == "n3"
    assert c.logs("n3")[: len(at_timeout["n1"])] == at_timeout["n1"]
    assert c.nodes["n3"].sm.data == c.nodes["n1"].sm.data


def test_transfer_pending_drops_proposals_then_aborts_after_election_timeout():
    """§3.10: during a transfer the leader stops accepting client requests; "if the
    transfer does not complete within an election timeout, the prior leader aborts the
    transfer and resumes accepting client requests"."""
    et = 10
    c = started(seed=8, election_tick=et)
    c.isolate("n3")
    c.propose("n1", cmd(1))  # n3 lags and cannot catch up
    term = c.raft("n1").term
    c.raft("n1").transfer_leadership("n3")
    c.stabilize()
    assert c.raft("n1").lead_transferee == "n3"
    with pytest.raises(ProposalDropped, match="n3"):
        c.raft("n1").propose(cmd(2))
    c.tick(["n1", "n2"], n=et - 1)
    with pytest.raises(ProposalDropped):
        c.raft("n1").propose(cmd(2))
    c.tick(["n1", "n2"])
    assert c.raft("n1").lead_transferee is None
    i = c.propose("n1", cmd(3))
    assert c.raft("n2").log.committed == i
    c.heal()
    c.tick(n=10)
    assert c.leader() == "n1" and c.raft("n1").term == term  # no late TimeoutNow
    assert not [m for m in c.delivered if m.type == MT.TIMEOUT_NOW]


def test_transfer_requested_on_follower_is_forwarded():
    """§3.10 via a follower: the request goes to the leader, which performs the transfer."""
    c = started(seed=9)
    c.raft("n3").transfer_leadership("n2")
    c.stabilize()
    assert c.leader() == "n2"


def test_transfer_to_non_voter_or_self_rejected():
    """§3.10: only a voter can take over; transferring to oneself is meaningless."""
    c = started(seed=10)
    with pytest.raises(TransferRejected):
        c.raft("n1").transfer_leadership("n9")
    with pytest.raises(TransferRejected):
        c.raft("n1").transfer_leadership("n1")
    c.propose("n1", cmd(1))  # still accepting proposals


def test_transfer_to_a_non_member_requested_on_a_follower_is_refused_there():
    """A follower forwards a transfer request to the leader (§3.10), which drops one to a
    node that is not a voter without a word to the follower, so its caller waited out
    a timeout (found from outside). The follower refuses a node that is no member of the
    configuration it knows, and sends nothing (a learner is forwarded: the leader may
    have promoted it already)."""
    c = started(seed=9)
    c.stabilize()
    sent = len(c.delivered)
    with pytest.raises(TransferRejected, match="n9 is not a member"):
        c.raft("n3").transfer_leadership("n9")
    c.stabilize()
    assert not [m for m in c.delivered[sent:] if m.type == MT.TRANSFER_LEADER]
    assert c.leader() == "n1"
