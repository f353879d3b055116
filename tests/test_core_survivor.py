"""The lone survivor of two voters (``raftkv.core.raft``, "The lone survivor of two voters").

A configuration of two voters {n1, n2} needs both for every election and every commit.
When n2 loses its state, n1 holds everything the group committed but cannot win an
election, so no leader ever READMITs n2 and the group waits for ever (issue 14, "no
reachable state waits for ever"). ``Raft.campaign_without(n2)`` is a survivor election:
n1 wins with its own vote and the grants of every learner that may have been promoted,
and its first entry removes n2. These scenarios run the pure core with identities on,
each named after the part of the rule's proof it checks.
"""

from __future__ import annotations

import pytest
from conftest import cmd

from raftkv.core import (
    CampaignRejected,
    ConfChange,
    ConfChangeOp,
    Role,
    decode_conf_entry,
)
from raftkv.testing.cluster import Cluster

N2 = ["n1", "n2"]


def two_voters() -> Cluster:
    return Cluster(N2, seed=7, identities=True)


def changes(c: Cluster, nid: str) -> list[tuple[ConfChangeOp, str]]:
    log = c.raft(nid).log
    out = []
    for e in log.entries(log.first_index(), log.last_index() + 1):
        if e.type:
            cc = decode_conf_entry(e.data)[0]
            if cc is not None:
                out.append((cc.op, cc.node))
    return out


def committed_data(c: Cluster, nid: str) -> list[bytes]:
    log = c.raft(nid).log
    ents = log.entries(log.first_index(), log.committed + 1)
    return [e.data for e in ents if not e.type and e.data]


def wait_without_leader(c: Cluster, nodes: list[str], ticks: int = 60) -> None:
    for _ in range(ticks):
        c.tick(nodes)
    assert all(c.raft(n).role != Role.LEADER for n in nodes)


def add_learner(c: Cluster, leader: str, nid: str, auto_promote: bool = False) -> None:
    """``nid`` joins empty and is added as a learner; the leader records it."""
    c.add_empty_node(nid)
    c.nodes[nid].identities = True
    c.nodes[nid].restart()
    c.raft(leader).propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, nid,
                                                  auto_promote=auto_promote))
    for _ in range(5):
        c.tick([leader])
    assert (ConfChangeOp.RECORD, nid) in changes(c, leader)


def test_the_lone_holder_of_two_voters_continues_alone_with_every_committed_entry() -> None:
    """Leader completeness (part 2) with no learner: every entry the pair committed was
    acknowledged by both, so n1 holds it. Without the rule n1 never leads again."""
    c = two_voters()
    c.elect("n1")
    for i in range(5):
        c.propose("n1", cmd(i))
    before = committed_data(c, "n1")
    assert len(before) == 5
    c.nodes["n2"].crash()  # an in-memory replica: it will come back with nothing
    wait_without_leader(c, ["n1"])  # check-quorum deposed n1; no election can be won
    c.raft("n1").campaign_without("n2")
    c.stabilize()
    r = c.raft("n1")
    assert r.role == Role.LEADER
    assert set(r.conf.voters) == {"n1"} and "n2" not in r.conf.members()
    assert changes(c, "n1")[-1] == (ConfChangeOp.REMOVE, "n2")
    assert r.log.committed == r.log.last_index()  # the removal committed with n1 alone
    index = c.propose("n1", cmd(99))
    assert r.log.committed >= index
    assert committed_data(c, "n1")[:5] == before


def test_a_recorded_learner_is_part_of_the_electorate() -> None:
    """Part 1: a recorded learner may have been promoted beyond n1's log, so its grant
    is needed. While it is down n1 cannot win; once it answers, n1 wins."""
    c = two_voters()
    c.elect("n1")
    c.propose("n1", cmd(0))
    add_learner(c, "n1", "n3")
    c.nodes["n2"].crash()
    c.nodes["n3"].crash()
    wait_without_leader(c, ["n1"])
    c.raft("n1").campaign_without("n2")
    c.stabilize()
    assert c.raft("n1").role != Role.LEADER  # no answer from n3: it waits
    c.nodes["n3"].restart()
    for _ in range(30):  # n3's leader lease runs out (stickiness)
        c.tick(["n3"])
    c.raft("n1").campaign_without("n2")
    c.stabilize()
    r = c.raft("n1")
    assert r.role == Role.LEADER
    assert set(r.conf.voters) == {"n1"} and set(r.conf.learners) == {"n3"}


def promoted_beyond_n1() -> tuple[Cluster, int]:
    """n2 leads {n1, n2} with learner n3 (recorded); n1 is cut off; n2 promotes n3 and
    commits an entry with n3 alone; then n2 loses its state."""
    c = two_voters()
    c.elect("n2")
    c.propose("n2", cmd(0))
    add_learner(c, "n2", "n3")
    c.stabilize()
    c.isolate("n1")
    c.raft("n2").propose_conf_change(ConfChange(ConfChangeOp.PROMOTE, "n3"))
    c.stabilize()
    index = c.propose("n2", cmd(1))
    assert c.raft("n2").log.committed >= index and c.raft("n3").log.committed >= index
    assert c.raft("n1").log.last_index() < index
    c.nodes["n2"].crash()
    c.heal()
    return c, index


def test_a_learner_promoted_beyond_the_survivors_log_refuses_and_nothing_is_lost() -> None:
    """Part 2 with a learner: n3 holds an entry committed by {n2, n3} that n1 lacks, so
    n3 refuses n1 (§5.4.1). n1 does not win; n3 and n1 then elect n3 as usual, and the
    entry stays committed."""
    c, index = promoted_beyond_n1()
    c.raft("n1").campaign_without("n2")
    c.stabilize()
    assert c.raft("n1").role != Role.LEADER
    for _ in range(80):
        c.tick(["n1", "n3"])
        if c.leader() == "n3":
            break
    assert c.leader() == "n3"
    c.propose("n3", cmd(2))
    for n in ("n1", "n3"):
        assert c.raft(n).log.committed > index
        assert c.raft(n).log.term(index) == c.raft("n3").log.term(index)


def test_a_removal_of_the_survivor_after_a_promotion_beyond_its_log_is_refused() -> None:
    """(B) needs only "no removal of n1 made from a configuration of W": a removal
    further down follows another change beyond n1's log, which committed with a member
    of the electorate (part 1), and that member refuses n1 (part 3). n2 promotes n3 and
    then removes n1, both beyond n1's log, and commits an entry with n3; n2 is lost.
    n3 is a voter of no configuration of n1's W (``voters_since_commit``), so the
    placement layer, seeing pending [n3], lets n1 campaign (placement simulator seed
    1076); n3 refuses, n1 does not lead, and the entry stays committed."""
    c = two_voters()
    c.elect("n2")
    c.propose("n2", cmd(0))
    add_learner(c, "n2", "n3")
    c.stabilize()
    c.isolate("n1")
    c.raft("n2").propose_conf_change(ConfChange(ConfChangeOp.PROMOTE, "n3"))
    c.stabilize()
    c.raft("n2").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n1"))
    c.stabilize()
    index = c.propose("n2", cmd(1))
    assert set(c.raft("n3").conf.voters) == {"n2", "n3"}
    assert c.raft("n3").log.committed >= index
    r = c.raft("n1")
    assert r.voters_since_commit() == {"n1", "n2"}  # n3 was never a voter in n1's log
    c.nodes["n2"].crash()
    c.heal()
    wait_without_leader(c, ["n1"])
    r.campaign_without("n2")
    c.stabilize()
    assert r.role != Role.LEADER
    assert c.raft("n3").log.term(index) is not None
    assert c.raft("n3").log.committed >= index


def test_a_learner_ahead_with_uncommitted_entries_attests_and_does_not_block() -> None:
    """Part 3's exception: n3, a recorded learner that was never a voter, holds an entry
    n1 lacks (n2 sent it before it was lost; with n1 cut off it never committed). By
    §5.4.1 alone n3 would refuse n1 for ever, and as a learner it never campaigns. It was
    a voter in no configuration from n1's commit index on, so it acknowledged nothing
    there as a voter: it grants, and n1 leads."""
    c = two_voters()
    c.elect("n2")
    c.propose("n2", cmd(0))
    add_learner(c, "n2", "n3")
    c.stabilize()
    c.cut("n1", "n2")
    index = c.propose("n2", cmd(1))
    assert c.raft("n3").log.last_index() >= index > c.raft("n1").log.last_index()
    assert c.raft("n2").log.committed < index
    c.nodes["n2"].crash()
    c.heal()
    r = c.raft("n1")
    assert not c.raft("n3").log.is_up_to_date(r.log.last_index(), r.log.last_term())
    c.tick(["n1", "n3"], n=30)  # n1 steps down; n3's lease on n2 runs out
    r.campaign_without("n2")
    c.stabilize()
    assert r.role == Role.LEADER
    assert set(r.conf.voters) == {"n1"} and set(r.conf.learners) == {"n3"}
    c.propose("n1", cmd(2))
    assert c.raft("n3").log.committed == r.log.committed  # n3's extra entry was replaced


def test_counterfactual_without_the_learner_the_survivor_overwrites_a_committed_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same schedule with an electorate of n1 alone: n1 wins at once and commits its
    removal of n2 at an index where n3 holds a different committed entry (two entries
    committed at one index: the loss the learner's grant prevents)."""
    c, _ = promoted_beyond_n1()
    monkeypatch.setattr(type(c.raft("n1")), "_survivor_electorate",
                        lambda self, lost: frozenset({self.id}))
    c.raft("n1").campaign_without("n2")
    r1, r3 = c.raft("n1"), c.raft("n3")
    assert r1.role == Role.LEADER
    k = r1.log.last_index()
    assert r1.log.committed == k and r3.log.committed >= k
    assert r1.log.term(k) != r3.log.term(k)


def test_an_unrecorded_learner_is_not_asked_and_an_uncommitted_change_is_finished() -> None:
    """Bug C's shape: n1 led {n1, n2} and appended ADD_LEARNER n3 after n2 was gone, so
    the change is not committed and n3 was never recorded (it could not have been
    promoted anywhere). n1 wins alone; its removal of n2 commits the addition too."""
    c = two_voters()
    c.elect("n1")
    c.propose("n1", cmd(0))
    c.nodes["n2"].crash()
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n3"))
    c.stabilize()
    assert c.raft("n1").log.committed < c.raft("n1").log.last_index()
    wait_without_leader(c, ["n1"])
    c.raft("n1").campaign_without("n2")
    c.stabilize()
    r = c.raft("n1")
    assert r.role == Role.LEADER
    assert set(r.conf.voters) == {"n1"} and set(r.conf.learners) == {"n3"}
    assert r.log.committed == r.log.last_index()


def test_refused_outside_the_rule() -> None:
    """Not a leader, not a latest configuration of three voters (an ordinary majority
    election works there), not the node itself."""
    c = Cluster(["n1", "n2", "n3"], seed=3, identities=True)
    c.elect("n1")
    c.propose("n1", cmd(0))
    with pytest.raises(CampaignRejected, match="already leads"):
        c.raft("n1").campaign_without("n2")
    with pytest.raises(CampaignRejected, match=r"voters are \['n1', 'n2', 'n3'\]"):
        c.raft("n2").campaign_without("n3")
    c.isolate("n1")
    with pytest.raises(CampaignRejected, match="itself"):
        c.raft("n2").campaign_without("n2")


def test_an_uncommitted_removal_from_three_voters_is_finished_with_the_third_grant() -> None:
    """Chaos seed 102's second shape: n1 led {n1, n2, n3} and appended "remove n3"; the
    new configuration {n1, n2} needs n2, which is lost before acknowledging it. The
    configuration at n1's commit index still has three voters, so n3 is in the
    electorate; it grants, and n1's removal of n2 commits both changes."""
    c = Cluster(["n1", "n2", "n3"], seed=5, identities=True)
    c.elect("n1")
    c.propose("n1", cmd(0))
    c.cut("n1", "n2")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    r = c.raft("n1")
    assert set(r.conf.voters) == {"n1", "n2"} and r.log.committed < r.log.last_index()
    c.nodes["n2"].crash()
    c.heal()
    wait_without_leader(c, ["n1", "n3"])
    r.campaign_without("n2")
    c.stabilize()
    assert r.role == Role.LEADER
    assert set(r.conf.voters) == {"n1"} and r.log.committed == r.log.last_index()
    assert changes(c, "n1")[-2:] == [(ConfChangeOp.REMOVE, "n3"), (ConfChangeOp.REMOVE, "n2")]


def test_a_third_voter_holding_entries_committed_without_the_survivor_refuses() -> None:
    """Part 3 for a three-voter configuration of W. n1 appended "remove n3" (so its
    latest configuration is {n1, n2}) and was cut off; n2 and n3, still on {n1, n2, n3},
    elected n2 and committed an entry n1 lacks; then n2 was lost. n3 refuses n1 (§5.4.1),
    n1 does not lead, and n3, with n1's vote, does: the entry stays committed."""
    c = Cluster(["n1", "n2", "n3"], seed=11, identities=True)
    c.elect("n1")
    c.propose("n1", cmd(0))
    c.isolate("n1")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    c.tick(["n1", "n3"], n=30)  # n1 steps down (check-quorum); n3's lease on it runs out
    c.elect("n2")
    index = c.propose("n2", cmd(1))
    assert c.raft("n3").log.committed >= index
    c.nodes["n2"].crash()
    c.heal()
    r = c.raft("n1")
    assert set(r.conf.voters) == {"n1", "n2"}
    r.campaign_without("n2")
    c.stabilize()
    assert r.role != Role.LEADER
    for _ in range(80):
        c.tick(["n1", "n3"])
        if c.leader() == "n3":
            break
    assert c.leader() == "n3"
    c.propose("n3", cmd(2))
    for n in ("n1", "n3"):
        assert c.raft(n).log.committed > index
        assert c.raft(n).log.term(index) == c.raft("n3").log.term(index)


def test_a_commit_learned_from_outside_shrinks_the_electorate() -> None:
    """``Raft.learn_commit`` (placement simulator seed 1187): n1 appended "remove n3" and
    acknowledged it, but the leader's notice that it committed never came; n3's replica
    is then gone for good and n2 lost its state. With n1's commit index below the removal,
    n3 is in its electorate and n1 waits for ever; told from outside that the entry
    (index, term) committed, n1 adopts it (only that very entry), and wins alone."""
    c = Cluster(["n1", "n2", "n3"], seed=5, identities=True)
    c.elect("n2")
    c.propose("n2", cmd(0))
    c.stabilize()
    r2, r1 = c.raft("n2"), c.raft("n1")
    index = r2.log.last_index() + 1
    # Every notice from n2 to n1 that the removal committed is lost.
    c.filters.append(lambda m: not (m.frm == "n2" and m.to == "n1"
                                    and (m.commit or 0) >= index))
    r2.propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    term = r2.log.term(index)
    assert r2.confs[-1][0] == index and r2.log.committed >= index
    assert r1.log.last_index() >= index > r1.log.committed
    c.nodes["n2"].crash()
    c.nodes["n3"].crash()
    wait_without_leader(c, ["n1"])
    assert r1.voters_since_commit() == {"n1", "n2", "n3"}
    assert not r1.learn_commit(index, term + 1)  # another entry at that index: refused
    assert not r1.learn_commit(r1.log.last_index() + 5, term)  # beyond the log
    assert r1.learn_commit(index, term) and r1.log.committed == index
    assert not r1.learn_commit(index, term)  # already
    assert r1.voters_since_commit() == {"n1", "n2"}
    r1.campaign_without("n2")
    c.stabilize()
    assert r1.role == Role.LEADER and set(r1.conf.voters) == {"n1"}
