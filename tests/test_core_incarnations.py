"""Incarnations: a voter whose storage was wiped is never counted as the voter it was.

Raft's safety rests on a voter's durable state (Raft §5.2, §5.4: a vote and an
acknowledgement are promises about what the voter holds). A node whose files were
wiped and that starts again with its old arguments keeps its name but not its
promises. These scenarios run the pure core with identities on (``Config.incarnation``)
and check the rules of "Incarnations" in ``raftkv.core.raft``. Each counterfactual runs
the same schedule with identities off and shows the loss the rule prevents.
"""

from __future__ import annotations

import pytest
from conftest import MT, cmd

from raftkv.core import ConfChange, ConfChangeOp, ConfChangeRejected, Role, decode_conf_entry
from raftkv.testing.cluster import Cluster

N3 = ["n1", "n2", "n3"]


def cluster(identities: bool = True, seed: int = 1) -> Cluster:
    return Cluster(N3, seed=seed, identities=identities)


def inc(c: Cluster, nid: str) -> int:
    return c.nodes[nid].storage.identity().incarnation


def changes(c: Cluster, nid: str) -> list[ConfChange]:
    log = c.raft(nid).log
    ents = log.entries(log.first_index(), log.last_index() + 1)
    out = []
    for e in ents:
        if e.type:
            cc = decode_conf_entry(e.data)[0]
            if cc is not None:
                out.append(cc)
    return out


def commit_one_without_n2(c: Cluster) -> int:
    """n1 leads; an entry is committed by n1 and n3 while n2 hears nothing."""
    c.elect("n1")
    c.stabilize()
    c.isolate("n2")
    index = c.propose("n1", cmd(1))
    assert c.raft("n1").log.committed >= index
    assert c.raft("n2").log.last_index() < index
    return index


def test_at_birth_a_newborn_voter_waits_to_hear_that_enough_voters_never_recorded_it() -> None:
    """A candidate at birth is no proof the group is at birth: a laggard that never
    received anything looks the same (simulator seed 92: two such laggards and a wiped
    node were three of five and elected a leader lacking a committed entry). A newborn
    node votes once more than n - majority(n) other voters (both others, of three) have
    shown it in their vote requests that they hold no record of it."""
    c = cluster()
    c.raft("n1").campaign()
    c.stabilize()
    assert c.leader() is None  # n2 and n3 have each heard from n1 only
    c.raft("n2").campaign()
    c.stabilize()  # n3 has now heard from n1 and n2, and n1 from n2
    assert c.leader() == "n2"


def test_five_voters_two_laggards_at_birth_and_a_wiped_one_elect_nobody() -> None:
    """Simulator seed 92 as a scenario: n5 leads and commits with n2 and n3; n1 and n4
    never hear anything; n3 is wiped. n1, n3 and n4 are three of five and all at birth."""
    c = Cluster(["n1", "n2", "n3", "n4", "n5"], seed=3, identities=True)
    c.elect("n5")
    c.isolate("n1")
    c.isolate("n4")
    index = c.propose("n5", cmd(1))
    assert c.raft("n5").log.committed >= index
    c.isolate("n5")
    c.cut("n2", "n1")
    c.cut("n2", "n3")
    c.cut("n2", "n4")
    c.wipe("n3")
    for n in ("n1", "n3", "n4"):
        for m in ("n1", "n3", "n4"):
            c.blocked.discard((n, m))
    for _ in range(60):
        c.tick(["n1", "n3", "n4"])
    assert all(c.raft(n).role != Role.LEADER for n in ("n1", "n3", "n4"))


def wiped_n3_and_dead_n1(identities: bool) -> tuple[Cluster, int]:
    c = cluster(identities)
    index = commit_one_without_n2(c)
    c.nodes["n1"].crash()
    c.wipe("n3")
    c.heal()
    for _ in range(60):  # n2 and n3 campaign as their timers allow
        c.tick(["n2", "n3"])
    return c, index


def test_the_first_leader_records_every_voter_it_hears_from() -> None:
    """At birth every storage is newborn and unrecorded: the first election's no-op
    records the leader and its voters, and a RECORD follows for any voter it hears from
    later, so every voter is counted on as the incarnation it is."""
    c = cluster()
    c.elect("n1")
    c.stabilize()
    want = frozenset((n, inc(c, n)) for n in N3)
    for n in N3:
        assert c.raft(n).conf.incarnations == want
    assert changes(c, "n1")[0].op == ConfChangeOp.RECORD  # the no-op of the first term


def test_a_wiped_voter_cannot_elect_a_leader_that_lacks_what_it_acknowledged() -> None:
    """The loss the issue describes: an entry committed with n3's acknowledgement, n3
    wiped, the leader dead, n2 lagging. n2 must not become leader with n3's vote: n2
    knows n3 by its old incarnation (``to_inc``) and n3, newborn and unrecorded, votes
    only for a candidate at the group's birth."""
    c, index = wiped_n3_and_dead_n1(identities=True)
    assert all(c.raft(n).role != Role.LEADER for n in ("n2", "n3"))
    # The old leader returns: the entry survives and reaches everyone.
    c.nodes["n1"].restart()
    for _ in range(80):
        c.tick()
        if c.leader() and all(c.raft(n).log.committed >= index for n in N3):
            break
    leader = c.leader()
    assert leader is not None
    for n in N3:
        assert c.raft(n).log.committed >= index
        assert c.raft(n).log.term(index) == c.raft(leader).log.term(index)


def test_counterfactual_without_identities_the_wiped_voter_elects_the_laggard() -> None:
    c, index = wiped_n3_and_dead_n1(identities=False)
    assert c.leader() == "n2"
    assert c.raft("n2").log.last_index() < index or c.raft("n2").log.term(index) != 2


def test_a_wiped_voter_is_readmitted_as_a_learner_and_promoted_once_caught_up() -> None:
    """The leader hears n3 answer as a new incarnation: it proposes READMIT (n3 becomes
    an automatically promoted learner, recorded anew), replicates to it, and promotes
    it. The leader's old match for n3 is void the moment the new incarnation answers."""
    c = cluster()
    c.elect("n1")
    for i in range(5):
        c.propose("n1", cmd(i))
    old = inc(c, "n3")
    c.wipe("n3")
    assert inc(c, "n3") != old
    for _ in range(10):
        c.tick(["n1"])
    ops = [(cc.op, cc.node) for cc in changes(c, "n1")]
    assert (ConfChangeOp.READMIT, "n3") in ops
    assert ops.index((ConfChangeOp.READMIT, "n3")) < ops.index((ConfChangeOp.PROMOTE, "n3"))
    conf = c.raft("n1").conf
    assert "n3" in conf.voters and conf.incarnation_of("n3") == inc(c, "n3")
    assert c.raft("n3").log.committed == c.raft("n1").log.committed
    assert c.nodes["n3"].state() == c.nodes["n1"].state()


def test_a_stale_leader_cannot_commit_with_a_wiped_voter_that_forgot_its_term() -> None:
    """A wiped node has forgotten its term, so it accepts a deposed leader's appends.
    Counting them would commit a second entry at an index the new leader already
    committed. The deposed leader knows n3 by its old incarnation: the answers of the
    new one do not count."""
    c = cluster()
    c.elect("n1")
    c.stabilize()
    c.isolate("n1")  # n1 still believes it leads (it is not ticked, so no check-quorum)
    c.tick(["n3"], n=10)  # n3's leader lease runs out, so it will vote
    c.elect("n2")  # with n3's vote
    theirs = c.propose("n2", cmd(7))
    assert c.raft("n2").log.committed >= theirs
    c.wipe("n3")
    c.heal()
    c.cut("n1", "n2")
    mine = c.raft("n1").propose(cmd(8))
    c.tick(["n1"], n=3)  # heartbeats: n1 probes n3 down to what it holds
    assert c.raft("n1").role == Role.LEADER
    assert c.raft("n1").log.committed < mine  # n3's answers to n1 count for nothing
    # Once n1 hears of the new term it steps down, and the logs agree.
    c.heal()
    for _ in range(40):
        c.tick()
    leader = c.leader()
    assert leader is not None and leader != "n1"
    committed = c.raft(leader).log.committed
    for n in N3:
        assert c.raft(n).log.committed == committed
        assert c.raft(n).log.term(theirs) == c.raft(leader).log.term(theirs)


def test_counterfactual_without_identities_the_stale_leader_commits_a_conflicting_entry() -> None:
    c = cluster(identities=False)
    c.elect("n1")
    c.stabilize()
    c.isolate("n1")
    c.tick(["n3"], n=10)
    c.elect("n2")
    c.propose("n2", cmd(7))
    c.wipe("n3")
    c.heal()
    c.cut("n1", "n2")
    mine = c.raft("n1").propose(cmd(8))
    c.tick(["n1"], n=3)
    # Two different entries committed at one index: n1's (with the wiped n3) and n2's.
    assert c.raft("n1").log.committed >= mine and c.raft("n2").log.committed >= mine
    assert c.raft("n1").log.term(mine) != c.raft("n2").log.term(mine)


def test_a_learner_is_promoted_only_once_recorded() -> None:
    """Auto-promotion waits for the learner's RECORD: a voter is only ever counted as a
    recorded incarnation."""
    c = cluster()
    c.elect("n1")
    c.propose("n1", cmd(0))
    c.add_empty_node("n4")
    c.nodes["n4"].identities = True
    c.nodes["n4"].restart()
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n4"))
    for _ in range(10):
        c.tick(["n1"])
    ops = [(cc.op, cc.node) for cc in changes(c, "n1")]
    assert ops.index((ConfChangeOp.RECORD, "n4")) < ops.index((ConfChangeOp.PROMOTE, "n4"))
    assert c.raft("n1").conf.incarnation_of("n4") == inc(c, "n4")


def test_logs_written_before_incarnations_elect_and_are_recorded() -> None:
    """An upgraded node's log predates incarnations: its storage is adopted, not newborn,
    so it votes as before, and the first leader records everyone."""
    c = cluster()
    for n in N3:
        store = c.nodes[n].storage
        store._identity = store._identity._replace(newborn=False)
        c.nodes[n].restart()
    c.elect("n2")
    c.stabilize()
    assert {n for n, _ in c.raft("n2").conf.incarnations} == set(N3)


def test_a_newborn_voter_refuses_a_candidate_past_birth_until_recorded() -> None:
    """The vote rule on its own: a newborn, unrecorded n3 refuses n2 once n2's log holds
    a leader's entry, and grants it at birth."""
    at_birth = cluster()
    at_birth.elect("n2")  # n1 and n3 grant: both have seen every voter at birth
    c = cluster()
    commit_one_without_n2(c)
    c.nodes["n1"].crash()
    c.wipe("n3")
    c.heal()
    c.raft("n2").campaign()
    c.stabilize()
    assert c.raft("n2").role != Role.LEADER
    votes = [m for m in c.delivered if m.frm == "n3" and m.to == "n2"
             and m.type.name.endswith("VOTE_RESP")]
    assert votes and all(m.reject for m in votes)


def test_a_learner_is_not_promoted_by_hand_before_it_is_recorded() -> None:
    """Simulator seed 132: a hand promotion of a learner the leader had not yet recorded
    made a voter whose record, proposed later, needed its own acknowledgement to commit."""
    c = cluster()
    c.elect("n1")
    c.add_empty_node("n4")
    c.nodes["n4"].identities = True
    c.nodes["n4"].restart()
    c.isolate("n4")  # added, but not heard from
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n4"))
    c.stabilize()
    with pytest.raises(ConfChangeRejected, match="not yet recorded"):
        c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.PROMOTE, "n4"))
    c.heal()
    for _ in range(10):
        c.tick(["n1"])
    assert "n4" in c.raft("n1").conf.voters  # recorded, then promoted automatically



N5 = ["n1", "n2", "n3", "n4", "n5"]


def readmit_dropped_on_n1(snapshot: bool) -> tuple[Cluster, int]:
    """n3 is wiped while n1 leads, cut off from all but n3: n1 hears the new n3 and
    appends a READMIT of it that it cannot commit. n2 leads the next term with n4 and
    n5, and n1 drops the READMIT: its conflicting entries are replaced by n2's (Raft
    §5.3), or by n2's snapshot (§7), and the configuration it carried is rolled back
    (dissertation §4.1). Then n2 hears n3 and readmits it, the same incarnation."""
    c = Cluster(N5, seed=1, identities=True)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.wipe("n3")
    new = inc(c, "n3")
    for other in ("n2", "n4", "n5"):
        c.cut("n1", other)
    c.tick(["n1"], n=3)  # n1 hears the new n3: READMIT, uncommitted
    dropped = c.raft("n1").log.last_index()
    assert c.raft("n1").conf.incarnation_of("n3") == new
    assert c.raft("n1").log.committed < dropped
    if snapshot:
        c.cut("n2", "n3")  # so the snapshot's configuration still records the old n3
    # Their leader lease on n1 runs out; n2 is to lead next, so n4's and n5's timers,
    # which may run out too, reach no one.
    def rivals_unheard(m):
        return not (m.type == MT.PRE_VOTE and m.frm in ("n4", "n5"))

    c.filters.append(rivals_unheard)
    c.tick(["n2", "n4", "n5"], n=10)
    c.filters.remove(rivals_unheard)
    if c.raft("n2").role != Role.LEADER:
        c.elect("n2")
    if snapshot:
        for i in range(3):
            c.propose("n2", cmd(10 + i))
        assert c.nodes["n2"].compact()
        c.blocked -= {("n1", "n2"), ("n2", "n1")}
        c.tick(["n2"], n=3)
        assert c.raft("n1").log.first_index() > dropped  # installed n2's snapshot
        assert c.raft("n1").conf.incarnation_of("n3") != new
    c.heal()
    c.tick(["n2"], n=10)
    assert c.raft("n1").role == Role.FOLLOWER and c.raft("n1").lead == "n2"
    assert c.raft("n2").conf.incarnation_of("n3") == new  # n2 readmitted it
    assert c.raft("n1").conf.incarnation_of("n3") == new
    return c, new


@pytest.mark.parametrize("snapshot", [False, True], ids=["truncated", "snapshot"])
def test_an_incarnation_recorded_by_a_dropped_entry_is_not_retired(snapshot: bool) -> None:
    """Simulator seed 68 (--kv-api): when n1 rolled its configuration back past the
    dropped READMIT, it took the live n3 for an incarnation its configuration had
    replaced, and ignored every message of it from then on, although n2 recorded that
    same n3 again. Once n1 led, it never heard n3: n3 stayed a learner, far behind, for
    good. Going back in the log retires nobody; the leader hears n3 and catches it up."""
    c, new = readmit_dropped_on_n1(snapshot)
    c.raft("n2").transfer_leadership("n1")
    c.stabilize()
    assert c.leader() == "n1"
    index = c.propose("n1", cmd(2))
    c.tick(["n1"], n=10)
    assert c.raft("n3").log.committed >= index
    assert c.raft("n3").log.committed == c.raft("n1").log.committed
    assert "n3" in c.raft("n1").conf.voters  # caught up and promoted again
    assert c.raft("n1").conf.incarnation_of("n3") == new
    assert c.nodes["n3"].state() == c.nodes["n1"].state()



def _all_founders_heard_from_each_other() -> Cluster:
    """A new group whose founders have each seen the others' vote requests (a real
    cluster's first-tick pre-votes): each campaigns with every answer to it dropped."""
    c = cluster()
    for nid in N3:
        deaf = {(other, nid) for other in N3}
        c.blocked |= deaf
        c.raft(nid).campaign()
        c.stabilize()
        c.blocked -= deaf
    return c


def _stale_n1_records_a_wiped_n3() -> tuple[Cluster, dict[int, int], int]:
    """n1 is born leader of term 2 with n2's grant only (n3's link to n1 is cut), so it
    records n1 and n2. n1 is isolated and not ticked: a stale leader that does not know
    it. n2 leads term 3 with n3's grant and commits with n3. n3 is wiped; only n1 and n3
    reach each other, and n1 hears the new incarnation and appends an on-contact RECORD
    of it (uncommitted), which n3 takes: n3's own configuration now records it as it
    is. Returns the cluster, the terms of what n2 committed, and n2's term."""
    c = _all_founders_heard_from_each_other()
    c.cut("n1", "n3")
    c.elect("n1")
    assert c.raft("n1").conf.incarnation_of("n3") is None
    c.isolate("n1")
    c.raft("n2").campaign()
    c.stabilize()
    assert c.raft("n2").role == Role.LEADER
    for i in range(6):
        c.propose("n2", cmd(100 + i))
    n2 = c.raft("n2")
    theirs = {i: n2.log.term(i) for i in range(1, n2.log.committed + 1)}
    c.wipe("n3")
    c.heal()
    c.isolate("n2")
    c.tick(["n1"], n=2)
    assert c.raft("n3").conf.incarnation_of("n3") == inc(c, "n3")
    return c, theirs, n2.term


def _leaders_and_conflicts(c: Cluster, theirs: dict[int, int], rounds: int) -> dict[int, set[str]]:
    leaders: dict[int, set[str]] = {}
    for _ in range(rounds):
        c.tick(["n1", "n3"])
        for n in ("n1", "n3"):
            r = c.raft(n)
            if r.role == Role.LEADER:
                leaders.setdefault(r.term, set()).add(n)
            for i, term in theirs.items():
                assert i > r.log.committed or r.log.term(i) == term, (
                    f"{n} committed index {i} as term {r.log.term(i)}, n2 as {term}")
    return leaders


@pytest.mark.xfail(strict=True, reason="known hole, not closed yet (raftkv.core.raft, "
                   "'Incarnations', what this does not cover)")
def test_a_wiped_voter_recorded_only_by_a_stale_leader_does_not_vote_again() -> None:
    """Found in review: n3, wiped, forgot that it voted for n2 in term 3. Recorded as
    itself only by the stale n1's uncommitted RECORD, it took that for a record that
    counts and skipped the newborn vote rule: n1 restarted and n3 elected itself in
    term 3 with n1's grant, a second leader of n2's term, with an (index, term) entry
    unlike n2's (Log Matching broken). A record of itself should count for a node's own
    votes only once committed, and a candidate's own vote obey the rule it applies to
    others'. That rule slowed the birth of groups under load enough to fail placement
    tests, so it is not in yet: this documents the hole."""
    c, theirs, term = _stale_n1_records_a_wiped_n3()
    c.nodes["n1"].crash()
    c.nodes["n1"].restart()
    leaders = _leaders_and_conflicts(c, theirs, 300)
    assert term not in leaders, f"a second leader of term {term}: {leaders[term]}"
    assert not leaders  # n3 cannot prove it never counted: n2 holds its old record


def test_a_stale_leader_and_a_wiped_voter_it_recorded_commit_nothing() -> None:
    """The same schedule with n1 left running (it steps down by check-quorum, since the
    wiped n3's answers count for nothing): n1 and n3 commit nothing, for only n2 can
    tell that n3's earlier incarnation counted. A review's counterexample to counting a
    granter of the current leader's campaign from its first entry (reverted)."""
    c, theirs, term = _stale_n1_records_a_wiped_n3()
    leaders = _leaders_and_conflicts(c, theirs, 300)
    assert all(c.raft(n).log.committed <= 2 for n in ("n1", "n3"))
    assert term not in leaders or leaders[term] == set()


def test_a_voter_recorded_on_contact_counts_once_its_record_commits_which_may_wait() -> None:
    """What "Incarnations" does not cover, as a scenario (found from outside, in a test
    that stopped a follower right after the first election): n1 is elected with n2's
    grant only, so its first entry records n1 and n2; n3 is recorded on contact, and
    counts once that record commits. n2 stops before it does: n1 and n3 are a live
    majority but commit nothing, since from where they stand the schedule is the one of
    the test above, where counting n3 loses a committed entry. Once n2 is back, all
    commit."""
    c = _all_founders_heard_from_each_other()
    c.cut("n1", "n3")
    c.elect("n1")
    c.isolate("n2")
    c.blocked -= {("n1", "n3"), ("n3", "n1")}
    c.tick(["n1"], n=2)  # n1 hears n3 and replicates its RECORD, which cannot commit
    assert c.raft("n1").conf.incarnation_of("n3") == inc(c, "n3")
    index = c.raft("n1").propose(cmd(1))
    c.tick(["n1", "n3"], n=100)
    assert all(c.raft(n).log.committed < index for n in ("n1", "n3"))
    c.heal()
    for _ in range(100):
        c.tick()
        leader = c.leader()
        if leader and all(c.raft(n).log.committed >= index for n in N3):
            break
    assert all(c.raft(n).log.committed >= index for n in N3)


def test_a_founder_heard_only_once_connected_then_lost_leaves_the_others_able_to_elect() -> None:
    """Found from outside: three founders started; the third was SIGKILLed half a second
    later, after the others had logged it reachable, and the two left never elected
    (2 runs in 5). Each founder announces itself with a pre-vote at its first tick, but
    that tick came before any connection was up, and the third died before its first
    timed campaign: nobody ever heard it, so no newborn voter could prove it had never
    counted. A founder now announces itself again when the driver reports a voter
    reachable (``peer_up``) while its group is not born."""
    c = cluster()
    for nid in N3:
        c.isolate(nid)  # no connection is up yet
    c.tick(n=1)  # every first-tick announcement is lost
    for nid in N3:
        for peer in N3:
            if peer != nid:
                c.raft(nid).peer_down(peer)
    c.heal()
    for nid in N3:  # the connections come up, and the driver says so
        for peer in N3:
            if peer != nid:
                c.raft(nid).peer_up(peer)
    c.tick(n=1)  # each founder's announcement lands
    c.nodes["n3"].crash()
    for _ in range(200):
        c.tick(["n1", "n2"])
        if c.leader() in ("n1", "n2"):
            break
    leader = c.leader()
    assert leader in ("n1", "n2")
    index = c.propose(leader, cmd(1))
    c.tick(["n1", "n2"], n=3)
    assert c.raft(leader).log.committed >= index


def test_an_older_copy_of_a_replaced_incarnation_is_ignored_and_reported() -> None:
    """Found from outside: n3 was wiped and readmitted as a new incarnation; then its
    files from before the wipe were put back (a file-level backup). The leader ignores
    that incarnation for good, rightly (its promises since the copy are lost, and only a
    new incarnation is readmitted), but said nothing: the core now notes it
    (``retired_heard``) for the driver to log."""
    import copy

    c = cluster()
    c.elect("n1")
    for i in range(3):
        c.propose("n1", cmd(i))
    c.nodes["n3"].crash()
    backup = copy.deepcopy(c.nodes["n3"].storage)
    old = backup.identity().incarnation
    c.nodes["n3"].restart()
    c.wipe("n3")
    for _ in range(10):
        c.tick(["n1"])
    assert c.raft("n1").conf.incarnation_of("n3") == inc(c, "n3") != old
    assert c.raft("n1").retired_heard == {}
    c.nodes["n3"].crash()
    c.nodes["n3"].replace_storage(backup)
    c.nodes["n3"].restart()
    index = c.propose("n1", cmd(9))
    c.tick(n=10)
    assert c.raft("n1").retired_heard == {"n3": old}
    assert c.raft("n3").log.committed < index  # ignored, never counted
    assert c.leader() == "n1"
    # Stopped, its directory removed and started again, as the report says: readmitted
    # as a new incarnation, it is no longer reported (cluster status shows the report).
    c.wipe("n3")
    for _ in range(10):
        c.tick(["n1"])
    c.tick(n=10)
    assert c.raft("n1").retired_heard == {}
    assert c.raft("n3").log.committed >= index
