"""Campaigning at restart (``Config.early_campaign``; "Campaigning at restart" in
raftkv.core.raft): a voter that restarts from a used log pre-campaigns within its first
``election_tick // 3`` ticks. Safe by pre-vote and stickiness (dissertation §9.6 and
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
        if rng.random() < 0.5:
            c.propose("n1", cmd(step))
        for _ in range(rng.randrange(4)):
            c.tick()
            assert c.raft("n1").role == Role.LEADER and c.raft("n1").term == term
        for nid in down:
            c.nodes[nid].restart()
            restarts += 1
        for _ in range(rng.randrange(1, 15)):
            c.tick()
            assert c.raft("n1").role == Role.LEADER and c.raft("n1").term == term, (
                f"step {step}: the leader was deposed")
    c.tick(n=25)
    refused = sum(m.type == MT.PRE_VOTE for m in c.delivered)
    assert restarts >= 40 and refused > 0  # some early pre-elections ran, and failed
    assert all(c.raft(n).term == term and c.raft(n).lead == "n1" for n in nodes)
