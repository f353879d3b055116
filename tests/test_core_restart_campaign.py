"""Campaigning at restart (``Config.early_campaign``; "Campaigning at restart" in
raftkv.core.raft): a voter that restarts from a used log pre-campaigns within its first
``election_tick // 3`` ticks, and again at once whenever a voter comes up
(``peer_up``) until it knows a leader, backs a candidate or its term moves. Safe by pre-vote and stickiness (dissertation §9.6 and
§4.2.3): a healthy leader is never deposed by a restarting node."""

from __future__ import annotations

import random

import pytest
from conftest import MT, cmd

from raftkv.core import Role
from raftkv.testing.cluster import Cluster

NODES = ["n1", "n2", "n3"]


def _ticks_to_leader(c: Cluster, limit: int = 200) -> int:
    for n in range(1, limit + 1):
        c.tick()
        if c.leader() is not None:
            return n
    raise AssertionError("no leader")


def _restart_all(c: Cluster) -> None:
    for nid in c.nodes:
        c.nodes[nid].crash()
    for nid in c.nodes:
        c.nodes[nid].restart()


@pytest.mark.parametrize("seed", range(20))
def test_a_whole_group_restart_elects_within_its_first_ticks(seed):
    """All three restart at once: the first to campaign wins before any election timeout
    could have run out (election_tick 10: the first campaign comes at tick 1 to 3)."""
    c = Cluster(NODES, seed=seed, early_campaign=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    _restart_all(c)
    assert _ticks_to_leader(c) <= 10 // 3 + 1


@pytest.mark.parametrize("seed", range(5))
def test_without_the_rule_a_restart_waits_out_an_election_timeout(seed):
    """The control: the same restart waits at least election_tick ticks."""
    c = Cluster(NODES, seed=seed)
    c.elect("n1")
    _restart_all(c)
    assert _ticks_to_leader(c) >= 10


@pytest.mark.parametrize("option", [{"pre_vote": False}, {"check_quorum": False}])
def test_the_rule_needs_pre_vote_and_stickiness(option):
    """Without pre-vote an early campaign would raise terms, and without check-quorum
    nobody refuses it on a live leader's behalf: ``early_campaign`` then does nothing."""
    c = Cluster(NODES, seed=1, early_campaign=True, **option)
    c.elect("n1")
    _restart_all(c)
    assert _ticks_to_leader(c) >= 10


def test_a_node_that_never_held_a_term_does_not_hurry():
    """A first start (the bootstrap term) is not a restart: the founders wait as before."""
    c = Cluster(NODES, seed=2, early_campaign=True)
    assert _ticks_to_leader(c) >= 10


def test_the_second_node_up_wins_at_once_when_starts_are_staggered():
    """n1 comes back first: its early pre-election reaches no one and fails. n2 comes
    back 6 ticks later and campaigns on one of its first ticks; n1, knowing no leader,
    grants it, so a leader exists long before n1's next election timeout."""
    c = Cluster(NODES, seed=3, early_campaign=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    for nid in NODES:
        c.nodes[nid].crash()
    c.nodes["n1"].restart()
    roles = set()
    for _ in range(6):
        c.tick(["n1"])
        roles.add(c.raft("n1").role)
    assert Role.PRE_CANDIDATE in roles and c.leader() is None
    c.nodes["n2"].restart()
    assert _ticks_to_leader(c) <= 10 // 3 + 1


def _restart_after_crash(c: Cluster, restarted: list[str]) -> None:
    """Every node crashes; ``restarted`` come back, each told every peer is down (the
    driver counts a peer down until its connection's handshake)."""
    for nid in NODES:
        c.nodes[nid].crash()
    for nid in restarted:
        c.nodes[nid].restart()
        for peer in NODES:
            if peer != nid:
                c.raft(nid).peer_down(peer)


def _leaves_it_alone(c: Cluster, nid: str, peer: str, term: int) -> None:
    """``nid`` hears that ``peer`` connected and must not pre-campaign; once the messages
    held back flow, n1 leads at ``term`` everywhere."""
    sent = len(c.delivered)
    c.raft(nid).peer_up(peer)
    c.stabilize()
    assert not any(m.frm == nid and m.type == MT.PRE_VOTE for m in c.delivered[sent:])
    c.heal()
    c.tick(n=3)
    assert c.leader() == "n1" and all(c.raft(n).term == term for n in NODES)


def _restart_alone_and_fail(c: Cluster) -> None:
    """Everyone crashes; n1 restarts alone, and its early pre-election reaches no one."""
    c.elect("n1")
    c.propose("n1", cmd(1))
    _restart_after_crash(c, ["n1"])
    c.tick(["n1"], n=4)
    assert c.raft("n1").role == Role.PRE_CANDIDATE and c.leader() is None


@pytest.mark.parametrize("reported", [True, False])
def test_a_voter_coming_up_brings_a_restarted_nodes_campaign_forward(reported):
    """n2 restarts too, but its own early pre-election goes out before its connection to
    n1 is up, and is lost. When the driver reports n2 reachable, n1 campaigns at its next
    tick and wins. The control (no report): n1 waits out its election timeout."""
    c = Cluster(NODES, seed=4, early_campaign=True)
    _restart_alone_and_fail(c)
    c.nodes["n2"].restart()
    c.cut("n1", "n2")
    c.tick(["n2"], n=4)
    assert c.leader() is None
    c.heal()
    if reported:
        c.raft("n1").peer_up("n2")
    c.tick(["n1"])
    assert c.leader() == ("n1" if reported else None)


def test_a_connection_reported_again_brings_a_lost_campaign_back():
    """Two nodes that dial each other keep one connection; a campaign that went out on
    the other is lost with it (a driver test with 2 s ticks found it: no leader until
    the first tick). The driver reports the kept connection again, a peer_up for a peer
    not reported down, and a restarted node with no leader yet campaigns again."""
    c = Cluster(NODES, seed=9, early_campaign=True)
    _restart_alone_and_fail(c)
    c.nodes["n2"].restart()
    c.cut("n1", "n2")  # the connection its campaign goes out on is closed
    c.raft("n1").peer_up("n2")
    c.stabilize()
    c.heal()
    assert c.leader() is None and "n2" not in c.raft("n1")._unreachable
    c.raft("n1").peer_up("n2")
    c.stabilize()
    assert c.leader() == "n1"


def test_a_node_that_voted_since_its_restart_leaves_that_election_alone():
    """n1 and n3 restart; n1 campaigns when n3 connects and wins with n3's vote, but
    its first append to n3 is still on the way when n2 connects to n3. n3, which voted
    in the new term, must not campaign again: with n2's vote it would depose n1 (seen
    from outside, a full election timeout lost)."""
    c = Cluster(NODES, seed=6, early_campaign=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    _restart_after_crash(c, ["n1", "n3"])
    c.filters.append(lambda m: not (m.frm == "n1" and m.to == "n3"
                                    and m.type in (MT.APP, MT.HEARTBEAT)))
    c.raft("n1").peer_up("n3")
    c.stabilize()
    term = c.raft("n1").term
    assert c.leader() == "n1" and c.raft("n3").term == term and c.raft("n3").lead is None
    c.nodes["n2"].restart()
    _leaves_it_alone(c, "n3", "n2", term)


def test_a_node_that_backed_a_pre_candidate_leaves_its_pre_election_alone():
    """n1 and n2 restart and pre-campaign together when they connect; n2 grants n1's
    pre-vote and steps back (the lower id goes on). When n3 connects to n2 before n1's
    vote request reaches n2, n2 must not campaign again: with n3's vote it would split
    the vote with n1 (seen from outside: a full election timeout lost)."""
    c = Cluster(NODES, seed=7, early_campaign=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    _restart_after_crash(c, ["n1", "n2"])
    c.raft("n1").peer_up("n2")
    c.raft("n2").peer_up("n1")
    held: list = []  # n1's vote requests, on the way
    c.filters.append(lambda m: m.type != MT.VOTE or held.append(m))
    c.stabilize()
    assert c.raft("n1").role == Role.CANDIDATE and c.raft("n2").role == Role.FOLLOWER
    c.nodes["n3"].restart()
    sent = len(c.delivered)
    c.raft("n2").peer_up("n3")
    c.stabilize()
    assert not any(m.frm == "n2" and m.type == MT.PRE_VOTE for m in c.delivered[sent:])
    c.heal()
    c.deliver(held)
    c.stabilize()
    assert c.leader() == "n1"


def test_the_rule_ends_once_a_leader_is_known():
    """n2 restarts under a live leader n1 and follows it at its own term (no vote, no new
    term). Later n1 and n3 die and n2's own timed pre-election gets no answer: it knows
    no leader again, at the same term. It is an ordinary node by then: a voter coming up
    must not make it start a campaign (review finding: nothing tested this clause). It
    asks that voter again in the round under way, and nobody else."""
    c = Cluster(NODES, seed=5, early_campaign=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.nodes["n2"].crash()
    c.nodes["n2"].restart()
    for peer in ("n1", "n3"):
        c.raft("n2").peer_down(peer)
    c.raft("n2").peer_up("n1")
    c.tick(n=2)
    term = c.raft("n2").term
    assert c.raft("n2").lead == "n1" and c.raft("n1").term == term
    c.nodes["n1"].crash()
    c.nodes["n3"].crash()
    c.raft("n2").peer_down("n1")
    c.tick(["n2"], n=30)
    n2 = c.raft("n2")
    assert n2.role == Role.PRE_CANDIDATE and n2.term == term and n2.lead is None
    c.nodes["n3"].restart()
    elapsed = n2.election_elapsed
    n2.peer_up("n3")
    assert [(m.to, m.type, m.term) for m in n2.msgs] == [("n3", MT.PRE_VOTE, term + 1)]
    assert n2.election_elapsed == elapsed  # the round under way, not a new one


def test_a_node_whose_term_moved_leaves_that_election_alone():
    """n3 restarts with the longest log, so it refuses n1's vote request; refusing, it
    takes n1's term. n1 wins with n2's vote, but neither has heard from n1 as leader yet
    when n2 connects to n3. n3 granted nothing, but its term moved: an election it took
    part in is under way, and it must not campaign against it (with n2's grant it would
    depose n1 at once)."""
    c = Cluster(NODES, seed=8, early_campaign=True)
    c.elect("n3")
    c.propose("n3", cmd(1))
    c.isolate("n3")
    c.propose("n3", cmd(2))  # only n3 holds it: its log is the longest
    c.heal()
    _restart_after_crash(c, NODES)
    c.filters.append(lambda m: not (m.frm == "n1" and m.type in (MT.APP, MT.HEARTBEAT)))
    c.raft("n1").peer_up("n2")  # n1 and n2 connect: n1 pre-campaigns, n2 grants
    c.raft("n1").peer_up("n3")  # then n3: it refuses, and takes the term of n1's election
    c.stabilize()
    term = c.raft("n1").term
    assert c.leader() == "n1" and c.raft("n3").term == term
    assert c.raft("n2").lead is None and c.raft("n3").lead is None
    _leaves_it_alone(c, "n3", "n2", term)


@pytest.mark.parametrize("quiesce", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_a_healthy_leader_is_never_deposed_by_restarting_nodes(seed, quiesce):
    """Followers crash and restart at random moments (one at a time, or two of five at
    once) while the leader and a majority stay up and connected: every restarted node's
    early pre-election is refused, the leader keeps its term, and every restarted node
    ends up following it. Checked after every tick."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(1, 6)] if seed % 2 else NODES
    c = Cluster(nodes, seed=seed, early_campaign=True, quiesce=quiesce)
    c.elect("n1")
    term = c.raft("n1").term
    followers = nodes[1:]
    restarts = refused = 0
    for step in range(40):
        down = rng.sample(followers, 2 if len(nodes) == 5 and rng.random() < 0.5 else 1)
        for nid in down:
            c.nodes[nid].crash()
            for peer in nodes:  # its connections drop: the others' drivers see it
                if peer != nid:
                    c.raft(peer).peer_down(nid)
        if rng.random() < 0.5:
            c.propose("n1", cmd(step))
        for _ in range(rng.randrange(4)):
            c.tick()
            assert c.raft("n1").role == Role.LEADER and c.raft("n1").term == term
        for nid in down:
            c.nodes[nid].restart()
            restarts += 1
            for peer in nodes:  # its driver's first report, before any connection
                if peer != nid:
                    c.raft(nid).peer_down(peer)
        for _ in range(rng.randrange(1, 15)):
            for nid in down:  # connections come up one by one, seen from both ends
                peer = rng.choice([p for p in nodes if p != nid])
                c.raft(nid).peer_up(peer)
                c.raft(peer).peer_up(nid)
            c.tick()
            assert c.raft("n1").role == Role.LEADER and c.raft("n1").term == term, (
                f"step {step}: the leader was deposed")
    c.tick(n=25)
    refused = sum(m.type == MT.PRE_VOTE for m in c.delivered)
    assert restarts >= 40 and refused > 0  # some early pre-elections ran, and failed
    assert all(c.raft(n).term == term and c.raft(n).lead == "n1" for n in nodes)


@pytest.mark.parametrize("reported", [True, False])
def test_a_candidate_asks_again_a_voter_whose_connection_was_replaced(reported):
    """n1 wins its pre-vote, but its vote requests go out on connections that are then
    closed as duplicates, and are lost (a review of the restart path: a node already a
    candidate was outside "Campaigning at restart"). When the driver reports the kept
    connection, the candidate sends the request again to each voter that has not
    answered, and wins in that term, with no new campaign. The control: without the
    report it waits out an election timeout."""
    c = Cluster(NODES, seed=11, early_campaign=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    _restart_after_crash(c, ["n1", "n2"])
    c.filters.append(lambda m: m.type != MT.VOTE)  # lost with the closed connections
    c.raft("n1").peer_up("n2")
    c.stabilize()
    n1 = c.raft("n1")
    assert n1.role == Role.CANDIDATE
    term = n1.term
    c.filters.clear()
    if reported:
        sent = len(c.delivered)
        n1.peer_up("n2")
        n1.peer_up("n3")  # down: nothing is delivered, and nothing breaks
        c.stabilize()
        asked = [m for m in c.delivered[sent:] if m.frm == "n1" and m.type == MT.VOTE]
        assert [m.to for m in asked] == ["n2"] and asked[0].term == term
        assert c.leader() == "n1" and n1.term == term
        n1.peer_up("n2")  # it answered: a report now sends nothing more
        assert not any(m.type == MT.VOTE for m in n1.msgs)
    else:
        c.tick(["n1", "n2"], n=9)
        assert c.leader() is None
