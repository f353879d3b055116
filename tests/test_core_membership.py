"""Membership-change scenarios for the pure core: one-by-one changes (dissertation ch. 4:
§4.1, §4.2.1, §4.2.2, §4.2.3) as refined by Kudu's "Raft configuration change design"
(PRE_FOLLOWER learners promoted by the leader,
config applied on receipt and rolled back on truncation, leader removal by transfer)."""

from __future__ import annotations

import pytest
from conftest import (
    MT,
    Hold,
    cmd,
    conf_entry,
    drain,
    make_raft,
    msg,
    tick_until,
)

from raftkv.core import (
    ConfChange,
    ConfChangeOp,
    ConfChangeRejected,
    ConfState,
    Entry,
    LeaderStepping,
    Raft,
    Role,
    decode_conf_entry,
)
from raftkv.core.raft import CampaignKind, Config
from raftkv.testing.cluster import Cluster

N3 = ["n1", "n2", "n3"]
V3 = frozenset(N3)


def add_learner(node: str, auto: bool = True) -> ConfChange:
    return ConfChange(ConfChangeOp.ADD_LEARNER, node, auto_promote=auto)


def conf_changes(c: Cluster, nid: str) -> list[ConfChange]:
    log = c.raft(nid).log
    ents = log.entries(log.first_index(), log.last_index() + 1)
    return [decode_conf_entry(e.data)[0] for e in ents if e.type]


def started(seed: int = 0, **cfg) -> Cluster:
    c = Cluster(N3, seed=seed, **cfg)
    c.elect("n1")
    c.propose("n1", cmd(0))
    return c


# ----------------------------------------------------------------- add server --
@pytest.mark.parametrize("how", ["filter", "cut"])
def test_add_server_pre_follower_does_not_change_quorum_until_promoted(how):
    """Kudu "Process for adding a new node" step 2: the new node joins as a PRE_FOLLOWER
    (no vote, majority unchanged) and "the leader will automatically transition a
    PRE_FOLLOWER to a FOLLOWER ... when it detects new_node has caught up sufficiently"
    (dissertation §4.2.1). While it catches up, commits proceed with the old majority."""
    c = started(seed=3)
    c.add_empty_node("n4")
    if how == "filter":
        c.filters.append(lambda m: m.frm != "n4")  # n4 receives but cannot answer
    else:
        c.isolate("n4")
    idx = c.raft("n1").propose_conf_change(add_learner("n4"))
    c.stabilize()
    for n in N3:
        r = c.raft(n)
        assert r.conf == ConfState(V3, frozenset({"n4"}), frozenset({"n4"}))
        assert r.log.committed >= idx
    # Old majority: n1 + n2 of {n1, n2, n3}. Were n4 a voter, 2 of 4 could not commit.
    c.cut("n1", "n3")
    c.tick(["n1"], n=3)
    before = c.raft("n1").log.committed
    c.propose("n1", cmd(1))
    assert c.raft("n1").log.committed == before + 1
    assert c.raft("n1").conf.voters == V3 and "n4" in c.raft("n1").prs
    assert c.raft("n1").prs["n4"].match == 0

    c.heal()
    c.tick(["n1"], n=3)  # heartbeats reach n4; nobody calls anything else
    for n in ("n1", "n2", "n3", "n4"):
        assert c.raft(n).conf == ConfState(frozenset(N3 + ["n4"])), n
    promotes = [cc for cc in conf_changes(c, "n1") if cc and cc.op == ConfChangeOp.PROMOTE]
    assert promotes == [ConfChange(ConfChangeOp.PROMOTE, "n4")]
    assert c.logs("n4") == c.logs("n1")
    assert c.nodes["n4"].sm.data == c.nodes["n1"].sm.data
    # Now four voters: n1 + n2 alone are no longer a majority.
    c.cut("n1", "n3")
    c.cut("n1", "n4")
    before = c.raft("n1").log.committed
    c.propose("n1", cmd(2))
    assert c.raft("n1").log.committed == before


def test_add_server_promotion_waits_until_within_promote_lag():
    """Dissertation §4.2.1 / Kudu: the learner is promoted only once it is close enough
    (``promote_lag`` entries) to finish catching up quickly; before that it stays a
    learner. One entry per message and one message in flight make the lag visible."""
    lag = 3
    c = started(seed=4, promote_lag=lag, max_msg_bytes=1, max_inflight_msgs=1)
    for i in range(1, 20):
        c.propose("n1", cmd(i))
    c.add_empty_node("n4")
    hold = Hold(lambda m: m.frm == "n4")
    c.filters.append(hold)
    c.raft("n1").propose_conf_change(add_learner("n4"))
    c.stabilize()
    leader = c.raft("n1")
    history = []
    for _ in range(100):
        if not hold.held:
            break
        hold.release(c, 1)
        c.stabilize()
        pr = leader.prs["n4"]
        history.append(("n4" in leader.conf.voters, leader.log.last_index() - pr.match))
    assert history[-1][0], "never promoted"
    assert any(not voter and behind > lag + 1 for voter, behind in history)
    assert all(behind <= lag + 1 for voter, behind in history if voter)


def test_several_learners_wait_and_are_promoted_one_at_a_time():
    """Kudu add-server step 2: "Several nodes may be in PRE_FOLLOWER mode at a given time,
    but when transitioning to FOLLOWER the one-by-one rules still apply": the leader never
    has two uncommitted configuration entries, and both learners end up voters."""
    c = started(seed=15)
    for n in ("n4", "n5"):
        c.add_empty_node(n)
    c.filters.append(lambda m: m.frm not in ("n4", "n5"))
    for n in ("n4", "n5"):
        c.raft("n1").propose_conf_change(add_learner(n))
        c.stabilize()
    assert c.raft("n1").conf.learners == {"n4", "n5"}
    leader = c.raft("n1")
    worst = []

    def one_at_a_time(m):
        log = leader.log
        ents = log.entries(log.committed + 1, log.last_index() + 1)
        worst.append(sum(1 for e in ents if e.type))
        return True

    c.heal()
    c.filters.append(one_at_a_time)
    c.tick(["n1"], n=5)
    assert max(worst) == 1
    for n in ("n1", "n2", "n3", "n4", "n5"):
        assert c.raft(n).conf == ConfState(frozenset(N3 + ["n4", "n5"])), n
    promotes = [cc.node for cc in conf_changes(c, "n1") if cc and cc.op == ConfChangeOp.PROMOTE]
    assert sorted(promotes) == ["n4", "n5"]


def test_add_server_learner_caught_up_before_its_entry_commits_is_still_promoted():
    """Kudu add-server step 2 / DESIGN "Promotion": promotion is automatic once the learner
    has caught up. Here the learner acknowledges the whole log before the voters do (their
    acks are delayed), so at that moment the one-change-at-a-time rule blocks promotion.
    Once the ADD_LEARNER entry commits, the leader must still promote it without another
    proposal."""
    c = started(seed=5)
    c.add_empty_node("n4")
    hold = Hold(lambda m: m.type == MT.APP_RESP and m.frm in ("n2", "n3"))
    c.filters.append(hold)
    idx = c.raft("n1").propose_conf_change(add_learner("n4"))
    c.stabilize()
    assert c.raft("n1").prs["n4"].match == idx  # caught up, entry not committed
    assert c.raft("n1").log.committed < idx
    c.filters.clear()
    hold.release(c)
    c.stabilize()
    assert c.raft("n1").log.committed >= idx
    c.tick(n=30)  # an idle group: heartbeats only
    assert "n4" in c.raft("n1").conf.voters


# ------------------------------------------------------------------ removal --
def test_conf_entry_is_committed_by_the_new_configuration():
    """§4.1: a configuration is used as soon as it is appended, including for committing
    its own entry. A lone voter promoting a learner must wait for the learner's ack;
    committing by itself under the old {n1} majority is the bug simulator seed
    (nodes=1, seed=19) found."""
    c = Cluster(["n1"])
    c.elect("n1")
    c.add_empty_node("n2")
    r = c.raft("n1")
    r.propose_conf_change(add_learner("n2", auto=False))
    c.stabilize()
    hold = Hold(lambda m: m.type == MT.APP_RESP and m.frm == "n2")
    c.filters.append(hold)
    index = r.propose_conf_change(ConfChange(ConfChangeOp.PROMOTE, "n2"))
    c.stabilize()
    assert r.conf.voters == {"n1", "n2"}
    assert r.log.committed < index, "promotion committed without the new voter"
    hold.release(c)
    c.stabilize()
    assert r.log.committed >= index


def test_remove_follower():
    """Kudu "Process for removing a node" step 2 / §4.1: the leader replicates a
    configuration without the follower; afterwards the remaining two voters are a full
    quorum and the removed node receives nothing more."""
    c = started(seed=6)
    idx = c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    for n in ("n1", "n2"):
        assert c.raft(n).conf == ConfState(frozenset({"n1", "n2"}))
        assert c.raft(n).log.committed >= idx
    assert "n3" not in c.raft("n1").prs
    n3_last = c.raft("n3").log.last_index()
    c.nodes["n3"].crash()
    i = c.propose("n1", cmd(1))
    assert c.raft("n1").log.committed == c.raft("n2").log.committed == i
    c.nodes["n3"].restart()
    c.tick(["n1", "n2"], n=5)
    assert c.raft("n3").log.last_index() == n3_last
    assert not [m for m in c.delivered if m.to == "n3" and m.frm == "n1"
                and m.type in (MT.APP, MT.HEARTBEAT) and m.index >= idx]


def test_remove_leader_transfers_leadership_first():
    """Kudu "Process for removing a node" step 3: "If doomed_node is the leader, the leader
    transfers configuration ownership to the most up-to-date follower ... and returns
    STEPPING_DOWN"; dissertation §3.10 (TimeoutNow). The new leader performs the removal."""
    c = started(seed=7)
    c.cut("n1", "n3")
    c.propose("n1", cmd(1))  # n2 is now strictly more up to date than n3
    c.heal()
    term = c.raft("n1").term
    with pytest.raises(LeaderStepping) as ei:
        c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n1"))
    assert ei.value.transferee == "n2"
    assert "n2" in str(ei.value) and "remove n1" in str(ei.value)
    c.stabilize()
    assert c.leader() == "n2" and c.raft("n2").term == term + 1
    assert c.raft("n1").role == Role.FOLLOWER
    for n in ("n2", "n3"):
        assert c.raft(n).conf == ConfState(frozenset({"n2", "n3"}))
    assert c.raft("n2").log.committed == c.raft("n2").log.last_index()
    # The old leader, not told it was removed, cannot disrupt the group (§4.2.3).
    c.tick(n=100)
    assert c.leader() == "n2" and c.raft("n2").term == term + 1
    i = c.propose("n2", cmd(2))
    assert c.raft("n3").log.committed == i


def test_without_auto_handover_the_transferee_leaves_the_removal_to_its_owner():
    """§3.10 transfer for a leader removing itself, with ``Config.auto_handover`` off (the
    placement layer's partition groups, issue 14 item 4): the transferee is elected but
    does not propose the removal its predecessor asked for, because the owner's target
    may have moved to keep the old leader by then; the owner proposes what its target
    says (here: nothing, then the removal), one change at a time as usual."""
    c = started(seed=7, auto_handover=False)
    c.cut("n1", "n3")
    c.propose("n1", cmd(1))
    c.heal()
    term = c.raft("n1").term
    with pytest.raises(LeaderStepping):
        c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n1"))
    c.stabilize()
    assert c.leader() == "n2" and c.raft("n2").term == term + 1
    for n in N3:  # nobody removed n1: its owner's target may keep it
        assert c.raft(n).conf == ConfState(V3)
    assert c.raft("n2").log.committed == c.raft("n2").log.last_index()
    # The owner still wants n1 gone: the new leader proposes it like any removal.
    c.raft("n2").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n1"))
    c.stabilize()
    for n in ("n2", "n3"):
        assert c.raft(n).conf == ConfState(frozenset({"n2", "n3"}))


def test_a_handover_that_timed_out_goes_to_another_voter_next_time():
    """Kudu's leader removal hands over to "the most up-to-date follower"; §3.10 abandons
    a transfer that does not finish within an election timeout. If that follower cannot
    take over (here it is cut off; in placement, its replica lost its state and waits
    stopped to be removed), the retry must not pick it again for ever: it goes to the
    next voter."""
    c = started(seed=7)
    c.cut("n1", "n3")
    c.propose("n1", cmd(1))  # n2 is now strictly more up to date than n3
    c.heal()
    c.cut("n1", "n2")
    c.cut("n3", "n2")
    remove = ConfChange(ConfChangeOp.REMOVE, "n1")
    with pytest.raises(LeaderStepping) as ei:
        c.raft("n1").propose_conf_change(remove)
    assert ei.value.transferee == "n2"
    c.tick(n=12)  # more than an election timeout: the transfer is abandoned
    assert c.raft("n1").role == Role.LEADER and c.raft("n1").lead_transferee is None
    with pytest.raises(LeaderStepping) as ei:
        c.raft("n1").propose_conf_change(remove)
    assert ei.value.transferee == "n3"
    c.stabilize()
    assert c.leader() == "n3"
    assert c.raft("n3").conf == ConfState(frozenset({"n2", "n3"}))


@pytest.mark.parametrize("how", ["prevote", "vote"])
def test_removed_node_with_higher_term_cannot_disrupt(how):
    """Dissertation §4.2.3 (disruptive servers) via the Kudu rule ("a pre-vote check that
    checks whether the recipient has heard from the leader in the past heartbeat period"):
    a removed node that keeps campaigning, even from a much higher term and even bypassing
    pre-vote, does not change the remaining group's leader or term. (The "not a member"
    notice that would stop its campaigns is dropped: this is the protection without it.)"""
    c = started(seed=8)
    c.filters.append(lambda m: m.context != "not a member")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    term = c.raft("n1").term
    c.isolate("n3")
    c.tick(["n3"], n=100)
    r3 = c.raft("n3")
    r3.term += 10
    r3.vote = None
    if how == "prevote":
        r3.campaign()
    else:
        r3._campaign(CampaignKind.ELECTION)
    c.heal()
    for _ in range(10):
        c.tick(n=15)
        if how == "vote" and r3.role == Role.FOLLOWER:
            r3._campaign(CampaignKind.ELECTION)
    assert [m for m in c.delivered if m.frm == "n3" and m.type in (MT.VOTE, MT.PRE_VOTE)]
    assert c.leader() == "n1"
    assert c.raft("n1").term == c.raft("n2").term == term
    i = c.propose("n1", cmd(1))
    assert c.raft("n2").log.committed == i


# ------------------------------------------------------------ one at a time --
def test_second_conf_change_refused_while_first_uncommitted():
    """Dissertation §4.1 / Kudu "One-by-one": "Until one such change ... commits or aborts,
    no others may be started"."""
    c = started(seed=9)
    c.cut("n1", "n2")
    c.cut("n1", "n3")
    idx = c.raft("n1").propose_conf_change(add_learner("n4"))
    c.stabilize()
    assert c.raft("n1").log.committed < idx
    with pytest.raises(ConfChangeRejected, match="not yet committed") as ei:
        c.raft("n1").propose_conf_change(add_learner("n5"))
    assert str(idx) in str(ei.value)
    assert c.raft("n1").log.last_index() == idx
    c.heal()
    c.tick(["n1"])
    assert c.raft("n1").log.committed >= idx
    c.raft("n1").propose_conf_change(add_learner("n5"))  # accepted now


def test_no_conf_change_before_new_leader_commits_entry_of_its_term():
    """Dissertation §4.1 (the single-server-change bug fix, Ongaro's raft-dev post): a
    new leader may not change membership before it has committed an entry of its own term."""
    c = started(seed=10)
    hold = Hold(lambda m: m.type == MT.APP_RESP and m.to == "n2")
    c.filters.append(hold)
    c.raft("n1").transfer_leadership("n2")
    c.stabilize()
    r2 = c.raft("n2")
    assert r2.role == Role.LEADER
    assert r2.log.term(r2.log.committed) != r2.term
    with pytest.raises(ConfChangeRejected, match="its term"):
        r2.propose_conf_change(add_learner("n4"))
    last = r2.log.last_index()
    assert r2.log.last_index() == last and r2.conf.learners == frozenset()
    hold.release(c)
    c.stabilize()
    assert r2.log.term(r2.log.committed) == r2.term
    r2.propose_conf_change(add_learner("n4"))


# --------------------------------------------------- config on append, rollback --
def test_conf_used_when_appended_and_rolled_back_on_truncation_unit():
    """Kudu step 3 ("As soon as a replica receives the ConfigChangeRequest it applies the
    configuration change in-memory. It does not wait for commitment", dissertation §4.1)
    and "This approach allows us to roll back ... in the case that a change config
    transaction is aborted and replaced by the new leader"."""
    f = make_raft("n2", election_tick=10)
    base = f.conf
    cc = add_learner("n4")
    e2 = conf_entry(2, 2, N3, ["n4"], cc, ["n4"])
    f.step(msg(MT.APP, "n1", "n2", 2, index=1, log_term=1, entries=[e2], commit=1))
    assert f.conf.learners == {"n4"}  # in use before commit or even persistence
    drain(f)
    assert f.log.committed == 1 and f.conf.learners == {"n4"}
    f.step(msg(MT.APP, "n3", "n2", 3, index=1, log_term=1, entries=[Entry(3, 2)], commit=1))
    assert f.conf == base
    drain(f)
    assert f.conf == base
    again = Raft(Config(id="n2"), f.log.storage, f.rng)  # a restart agrees
    assert again.conf == base


def test_conf_rollback_to_previous_uncommitted_conf_unit():
    """Kudu rollback with two configuration entries: truncating only the later one falls
    back to the earlier one, not to the committed configuration."""
    f = make_raft("n2")
    e2 = conf_entry(2, 2, N3, ["n4"], add_learner("n4"), ["n4"])
    e3 = conf_entry(2, 3, N3 + ["n4"], [], ConfChange(ConfChangeOp.PROMOTE, "n4"))
    f.step(msg(MT.APP, "n1", "n2", 2, index=1, log_term=1, entries=[e2, e3], commit=1))
    drain(f)
    assert f.conf.voters == V3 | {"n4"}
    f.step(msg(MT.APP, "n3", "n2", 3, index=2, log_term=2, entries=[Entry(3, 3)], commit=2))
    drain(f)
    assert f.conf == ConfState(V3, frozenset({"n4"}), frozenset({"n4"}))


def test_conf_rolled_back_when_new_leader_overwrites_it_in_cluster():
    """Kudu "Config change transaction implementation details" end to end: a follower
    uses a configuration from an old leader as soon as it appends it; a new leader that
    never had the entry overwrites it, and the follower reverts."""
    c = Cluster([f"n{i}" for i in range(1, 6)], seed=11)
    c.elect("n1")
    c.propose("n1", cmd(0))
    base = c.raft("n2").conf
    c.filters.append(lambda m: not (m.frm == "n1" and m.to in ("n3", "n4", "n5")))
    c.filters.append(lambda m: not (m.frm == "n2" and m.type == MT.APP_RESP))
    idx = c.raft("n1").propose_conf_change(add_learner("n6"))
    c.stabilize()
    r2 = c.raft("n2")
    assert r2.log.last_index() == idx and r2.log.committed < idx
    assert r2.conf.learners == {"n6"}
    c.heal()
    for a in ("n1", "n2"):
        for b in ("n3", "n4", "n5"):
            c.cut(a, b)
    rest = ["n3", "n4", "n5"]
    tick_until(c, lambda: any(c.raft(n).role == Role.LEADER for n in rest), rest)
    lead = next(n for n in rest if c.raft(n).role == Role.LEADER)
    c.propose(lead, cmd(1))
    c.heal()
    c.tick(n=3)
    assert c.leader() == lead
    for n in ("n1", "n2"):
        assert c.logs(n) == c.logs(lead)
        assert c.raft(n).conf == base, n
    assert all(cc is None or cc.node != "n6" for cc in conf_changes(c, "n2"))


# ------------------------------------------------------------ demote, learners --
def test_demoted_voter_becomes_learner_and_is_not_auto_promoted():
    """Kudu appendix ("demote the dead replica from LVE to L") / DESIGN "Promotion": a
    demoted voter is a learner that is not in ``auto_promote``, so it stays a learner."""
    c = started(seed=12)
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.DEMOTE, "n3"))
    c.stabilize()
    want = ConfState(frozenset({"n1", "n2"}), frozenset({"n3"}), frozenset())
    for n in N3:
        assert c.raft(n).conf == want
    for i in range(1, 10):
        c.propose("n1", cmd(i))
    c.tick(n=30)
    for n in N3:
        assert c.raft(n).conf == want
    assert c.raft("n1").prs["n3"].match == c.raft("n1").log.last_index()  # caught up
    assert c.raft("n3").log.committed == c.raft("n1").log.committed  # still replicated


def test_demote_leader_transfers_first():
    """Kudu step 3 applied to demotion: demoting the leader hands leadership over first."""
    c = started(seed=13)
    with pytest.raises(LeaderStepping) as ei:
        c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.DEMOTE, "n1"))
    c.stabilize()
    new = ei.value.transferee
    assert c.leader() == new
    assert c.raft(new).conf == ConfState(frozenset(N3) - {"n1"}, frozenset({"n1"}))


def test_learner_never_votes_nor_counts_in_election_quorum():
    """Kudu PRE_FOLLOWER ("does not have voting rights") / dissertation §4.2.1: a learner is
    never asked for a vote, never campaigns, and a grant from it does not count."""
    c = Cluster(["n1", "n2"], seed=14)
    c.elect("n1")
    c.add_empty_node("n3")
    c.raft("n1").propose_conf_change(add_learner("n3", auto=False))
    c.stabilize()
    c.tick(n=2)
    assert c.raft("n3").conf.learners == {"n3"}
    term3 = c.raft("n3").term
    c.nodes["n1"].crash()
    roles = set()
    for _ in range(200):
        c.tick(["n2", "n3"])
        roles.add(c.raft("n3").role)
        assert c.raft("n2").role != Role.LEADER  # 1 of 2 voters; the learner is no help
    assert roles == {Role.FOLLOWER}
    assert c.raft("n3").term >= term3
    assert not [m for m in c.delivered if m.to == "n3" and m.type in (MT.VOTE, MT.PRE_VOTE)]
    assert not [m for m in c.delivered if m.frm == "n3" and m.type in (MT.VOTE, MT.PRE_VOTE)]

    # A grant that does arrive from the learner (or a stranger) is not counted.
    r2 = c.raft("n2")
    r2.campaign()
    c.stabilize()
    assert r2.role == Role.PRE_CANDIDATE
    for frm in ("n3", "n9"):
        r2.step(msg(MT.PRE_VOTE_RESP, frm, "n2", r2.term + 1))
    assert r2.role == Role.PRE_CANDIDATE
    r2._campaign(CampaignKind.ELECTION)
    c.stabilize()
    assert r2.role == Role.CANDIDATE
    for frm in ("n3", "n9"):
        r2.step(msg(MT.VOTE_RESP, frm, "n2", r2.term))
    assert r2.role == Role.CANDIDATE
