"""Election scenarios for the pure core (Raft paper §5.2, §5.4.1; dissertation §3.10, §4.2.3,
§6.2, §9.6; Kudu's "Raft configuration change design", "Preventing disruptive
servers")."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import MT, cmd, drain, leaders, make_raft, msg, terms_log, tick_until

from raftkv.core import HardState, Role
from raftkv.testing.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent


def _record_leaders(c: Cluster, seen: dict[int, set[str]]) -> None:
    for nid, node in c.nodes.items():
        if node.alive and node.raft.role == Role.LEADER:
            seen[node.raft.term].add(nid)


def test_election_safety_at_most_one_leader_per_term():
    """§5.2 Election Safety: at most one leader can be elected in a given term, across
    several elections forced by isolating the current leader."""
    c = Cluster([f"n{i}" for i in range(1, 6)], seed=3)
    seen: dict[int, set[str]] = defaultdict(set)

    def step_and_check(nodes=None):
        c.tick(nodes)
        _record_leaders(c, seen)

    terms = []
    for _round in range(4):
        for _ in range(60):
            step_and_check()
            if c.leader() is not None and len(leaders(c)) == 1:
                break
        old = c.leader()
        assert old is not None
        terms.append(c.raft(old).term)
        c.isolate(old)
        rest = [n for n in c.nodes if n != old]
        for _ in range(80):
            step_and_check()
            if any(c.raft(n).role == Role.LEADER for n in rest):
                break
        assert any(c.raft(n).role == Role.LEADER for n in rest)
        c.heal()
        for _ in range(5):
            step_and_check()

    # Leaders also reveal themselves by sending AppendEntries/heartbeats in their term.
    for m in c.delivered:
        if m.type in (MT.APP, MT.HEARTBEAT, MT.SNAPSHOT, MT.TIMEOUT_NOW):
            seen[m.term].add(m.frm)
    assert len(terms) == 4 and terms == sorted(set(terms)), terms
    for term, who in seen.items():
        assert len(who) == 1, f"term {term} had leaders {who}"


def test_prevote_isolated_node_does_not_raise_term_or_depose_leader():
    """Dissertation §9.6 (pre-vote): an isolated node's pre-elections fail without raising
    its term, so when it rejoins it does not force the leader to step down."""
    c = Cluster(["n1", "n2", "n3"], seed=1)
    c.elect("n1")
    term = c.raft("n1").term
    c.isolate("n3")
    roles = set()
    for _ in range(100):
        c.tick(["n3"])
        roles.add(c.raft("n3").role)
    assert Role.PRE_CANDIDATE in roles, "the isolated node never even tried"
    assert Role.CANDIDATE not in roles
    assert c.raft("n3").term == term

    c.heal()
    c.tick(n=50)
    assert c.leader() == "n1"
    assert all(c.raft(n).term == term for n in c.nodes)
    assert c.raft("n3").lead == "n1"


def test_without_prevote_isolated_node_raises_term_and_deposes_leader():
    """Control for the pre-vote test (§9.6): with pre-vote off the same schedule does
    raise the isolated node's term, and its return disrupts the leader."""
    c = Cluster(["n1", "n2", "n3"], seed=1, pre_vote=False)
    c.elect("n1")
    term = c.raft("n1").term
    c.isolate("n3")
    c.tick(["n3"], n=100)
    assert c.raft("n3").term > term
    c.heal()
    c.tick(n=50)
    assert c.raft("n1").term > term


@pytest.mark.parametrize("vote_type", [MT.VOTE, MT.PRE_VOTE])
def test_leader_stickiness_ignores_votes_while_leader_is_live(vote_type):
    """Kudu design ("a pre-vote check that checks whether the recipient has heard from the
    leader in the past heartbeat period") and dissertation §4.2.3: a node that heard from a
    live leader within election_tick ignores (pre-)vote requests: no response, no term
    change. After election_tick ticks without the leader it grants."""
    et = 10
    r = make_raft("n2", election_tick=et)
    r.step(msg(MT.HEARTBEAT, "n1", "n2", 2, commit=1))
    drain(r)
    assert (r.term, r.lead) == (2, "n1")

    def request():
        r.step(msg(vote_type, "n3", "n2", 3, index=1, log_term=1))
        return drain(r).messages

    for _ in range(et - 1):
        assert request() == []
        assert r.term == 2 and r.vote is None and r.lead == "n1"
        r.tick()
    assert request() == []  # election_elapsed == et - 1: still within the lease
    r.tick()  # et ticks since the heartbeat: the leader is presumed gone
    out = request()
    assert [(m.type, m.to, m.reject) for m in out] == [(vote_type + 1, "n3", False)]
    if vote_type == MT.VOTE:
        assert (r.term, r.vote) == (3, "n3")
    else:
        assert r.term == 2 and r.vote is None  # pre-vote never changes terms


def test_leader_stickiness_a_leader_ignores_higher_term_votes():
    """§4.2.3: the leader itself disregards a disruptive higher-term vote request while it
    has a lease (it hears from a quorum); it keeps its term and role."""
    c = Cluster(["n1", "n2", "n3"], seed=2)
    c.elect("n1")
    term = c.raft("n1").term
    c.raft("n1").step(msg(MT.VOTE, "n3", "n1", term + 5, index=100, log_term=term))
    c.stabilize()
    assert c.leader() == "n1" and c.raft("n1").term == term


def test_check_quorum_leader_steps_down_when_cut_off():
    """Dissertation §6.2 (check quorum): a leader that has not heard from a majority within
    an election timeout steps down; a leader that hears from a majority stays."""
    et = 10
    c = Cluster(["n1", "n2", "n3"], seed=4, election_tick=et)
    c.elect("n1")
    c.cut("n1", "n3")  # a majority (n1, n2) is still connected
    c.tick(["n1"], n=5 * et)
    assert c.raft("n1").role == Role.LEADER

    # Pass a quorum check with everyone active, and cut the leader off completely at that
    # very tick (before any heartbeat response can refresh the activity flags).
    c.heal()
    c.tick(["n1"], n=et - 1 - c.raft("n1").election_elapsed)
    c.raft("n1").tick()
    assert c.raft("n1").election_elapsed == 0 and c.raft("n1").role == Role.LEADER
    c.isolate("n1")
    c.stabilize()
    c.tick(["n1"], n=et - 1)
    assert c.raft("n1").role == Role.LEADER
    c.tick(["n1"])
    assert c.raft("n1").role == Role.FOLLOWER
    assert c.raft("n1").lead is None


def test_check_quorum_step_down_bounded_by_two_timeouts_from_any_phase():
    """§6.2: wherever the leader is in its check cycle when partitioned, it steps down
    within two election timeouts."""
    et = 10
    for phase in range(et):
        c = Cluster(["n1", "n2", "n3"], seed=5, election_tick=et)
        c.elect("n1")
        c.tick(["n1"], n=phase)
        c.isolate("n1")
        r = c.raft("n1")
        n = tick_until(c, lambda r=r: r.role != Role.LEADER, ["n1"], 2 * et)
        assert n <= 2 * et


def _diverged_for_up_to_date(**cfg):
    c = Cluster(["n1", "n2", "n3"], seed=6, **cfg)
    c.elect("n1")
    c.cut("n1", "n3")
    for i in range(3):
        c.propose("n1", cmd(i))
    assert c.raft("n2").log.last_index() > c.raft("n3").log.last_index()
    c.heal()
    c.nodes["n1"].crash()
    return c


def test_up_to_date_check_shorter_log_cannot_win_vote():
    """§5.4.1: a voter denies its vote to a candidate whose log is less up to date, so a node
    missing committed entries cannot become leader (pre-vote and check-quorum off so that
    only the log comparison decides)."""
    c = _diverged_for_up_to_date(pre_vote=False, check_quorum=False)
    committed = c.raft("n2").log.committed
    c.raft("n3").campaign()
    c.stabilize()
    assert c.raft("n3").role != Role.LEADER
    resp = [m for m in c.delivered if m.type == MT.VOTE_RESP and m.frm == "n2" and m.to == "n3"]
    assert resp and all(m.reject for m in resp)
    c.raft("n2").campaign()
    c.stabilize()
    assert c.leader() == "n2"
    assert c.raft("n2").log.committed >= committed


def test_up_to_date_check_with_prevote_the_longer_log_wins():
    """§5.4.1 with pre-vote on (§9.6 applies the same check): after the leader dies, only
    the node holding every committed entry can win, however the timeouts fall."""
    c = _diverged_for_up_to_date()
    committed = c.raft("n2").log.committed
    for _ in range(200):
        c.tick(["n2", "n3"])
        assert c.raft("n3").role != Role.LEADER
        if c.raft("n2").role == Role.LEADER:
            break
    assert c.leader() == "n2"
    assert c.raft("n2").log.committed > committed  # its no-op committed with n3's help


@pytest.mark.parametrize(
    "cand_last,cand_term,granted",
    [
        (2, 2, False),  # shorter log, same last term
        (3, 2, True),   # same log
        (5, 2, True),   # longer log, same last term
        (9, 1, False),  # longer log but older last term: term is compared first
        (2, 3, True),   # shorter log but newer last term
    ],
)
def test_up_to_date_check_compares_last_term_then_length(cand_last, cand_term, granted):
    """§5.4.1: "If the logs have last entries with different terms, then the log with the
    later term is more up-to-date. If the logs end with the same term, then whichever log
    is longer is more up-to-date." Voter's log: 1@t1, 2@t2, 3@t2."""
    r = make_raft("n2", entries=terms_log([1, 2, 2], ["n1", "n2", "n3"]),
                  hard=HardState(2, None, 1))
    r.step(msg(MT.VOTE, "n3", "n2", 5, index=cand_last, log_term=cand_term))
    out = drain(r).messages
    assert [(m.type, m.reject) for m in out] == [(MT.VOTE_RESP, not granted)]
    assert r.vote == ("n3" if granted else None)


def test_role_transitions_illegal_moves_raise():
    """Closed role enum with guarded transitions (DESIGN "Habits" 3; §5.2 Figure 4: a leader
    only ever steps down to follower, only a candidate becomes leader)."""
    r = make_raft("n1")
    assert r.role == Role.FOLLOWER
    with pytest.raises(AssertionError, match="invalid transition"):
        r._become_leader()
    assert r.role == Role.FOLLOWER and r.lead is None

    r._become_pre_candidate()
    with pytest.raises(AssertionError, match="invalid transition"):
        r._become_leader()
    assert r.role == Role.PRE_CANDIDATE

    solo = make_raft("n1", voters=["n1"])
    solo.campaign()
    assert solo.role == Role.LEADER
    term = solo.term
    with pytest.raises(AssertionError, match="invalid transition"):
        solo._become_candidate()
    with pytest.raises(AssertionError, match="invalid transition"):
        solo._become_pre_candidate()
    assert solo.role == Role.LEADER and solo.term == term


def _schedule(seed: int) -> tuple:
    """A fixed schedule with elections driven only by randomized timeouts."""
    c = Cluster([f"n{i}" for i in range(1, 6)], seed=seed)
    c.tick(n=40)
    lead = c.leader()
    assert lead is not None
    for i in range(5):
        c.propose(lead, cmd(i))
    c.isolate(lead)
    c.tick(n=60)
    c.heal()
    c.tick(n=10)
    lead = c.leader()
    victim = min(n for n in c.nodes if n != lead)
    c.nodes[victim].crash()
    for i in range(5, 9):
        c.propose(lead, cmd(i))
    c.nodes[victim].restart()
    c.tick(n=10)
    state = {
        nid: (n.raft.term, n.raft.vote, n.raft.role, n.raft.lead, n.raft.log.committed,
              c.logs(nid), sorted(n.sm.data.items()))
        for nid, n in c.nodes.items()
    }
    return state, [repr(m) for m in c.delivered]


def test_determinism_same_seed_same_run():
    """DESIGN "The core contract" (purity): the same seed replays the same schedule, message
    for message, and ends in identical states."""
    a = _schedule(11)
    b = _schedule(11)
    assert a[0] == b[0]
    assert a[1] == b[1]
    _schedule(12)  # another seed runs too (it may or may not differ)


_CHILD = """
import hashlib, sys
sys.path.insert(0, {tests!r})
from test_core_election import _schedule
state, msgs = _schedule(11)
print(hashlib.sha256(repr((sorted(state.items()), msgs)).encode()).hexdigest())
"""


def test_determinism_across_processes_with_different_hash_seeds():
    """DESIGN: "replay a failing seed exactly". Set iteration order changes between
    processes (PYTHONHASHSEED); the core's output order must not depend on it."""
    outs = set()
    for hs in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": hs}
        res = subprocess.run(
            [sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests"))],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=120,
        )
        outs.add(res.stdout.strip())
    assert len(outs) == 1, outs
