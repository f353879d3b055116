"""A removed node learns it was removed ("A removed node learns it was removed" in
``raftkv.core.raft``).

A voter removed while it was down never receives the entry that removed it (the leader
stops replicating to a node once it is out of the configuration, dissertation §4.2.2),
so it restarts believing itself a voter, campaigns for ever and answers every client
"no leader". Its pre-votes were not even answered: the members follow a live leader and
drop them unread (stickiness, §9.6). etcd answers such a member that it was removed, and
the member stops. Here a member refuses the vote request of a node that the
configuration it has applied (a committed one) leaves out, when the candidate's log
ends before that configuration: "not a member". The candidate then stops campaigning,
until a leader contacts it again (it was added back).
"""

from __future__ import annotations

from conftest import MT, cmd

from raftkv.core import ConfChange, ConfChangeOp, Role
from raftkv.testing.cluster import Cluster

N3 = ["n1", "n2", "n3"]


def _n3_removed_while_down(seed: int = 1) -> Cluster:
    c = Cluster(N3, seed=seed)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.nodes["n3"].crash()
    index = c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    c.propose("n1", cmd(2))
    assert c.raft("n2").log.applied >= index
    c.nodes["n3"].restart()
    return c


def test_a_node_removed_while_down_is_told_so_and_stops_campaigning() -> None:
    c = _n3_removed_while_down()
    n3 = c.raft("n3")
    assert "n3" in n3.conf.voters and n3.removed is None  # it cannot know yet
    term = c.raft("n1").term
    for _ in range(40):
        c.tick()
        if n3.removed is not None:
            break
    assert n3.removed is not None and n3.removed[0] in ("n1", "n2")
    assert n3.removed[1] > n3.log.last_index()
    # It campaigns no more, and it disturbed no one.
    sent = len(c.delivered)
    c.tick(n=60)
    assert not any(m.frm == "n3" and m.type in (MT.PRE_VOTE, MT.VOTE)
                   for m in c.delivered[sent:])
    assert c.leader() == "n1" and c.raft("n1").term == term
    assert n3.role == Role.FOLLOWER and not n3.promotable()


def test_the_control_without_the_notice_it_campaigns_unanswered_for_ever() -> None:
    """What the notice replaces: with the answer dropped, n3 keeps campaigning."""
    c = _n3_removed_while_down()
    c.filters.append(lambda m: m.context != "not a member")
    c.tick(n=40)
    sent = len(c.delivered)
    c.tick(n=40)
    assert c.raft("n3").removed is None
    assert any(m.frm == "n3" and m.type == MT.PRE_VOTE for m in c.delivered[sent:])


def test_a_removed_node_added_back_takes_part_again() -> None:
    """Added back (as a learner, promoted once caught up), n3 hears from the leader, which
    clears the notice: it is a voter that may campaign again."""
    c = _n3_removed_while_down()
    c.tick(n=40)
    assert c.raft("n3").removed is not None
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n3",
                                                auto_promote=True))
    c.tick(n=10)
    n3 = c.raft("n3")
    assert n3.removed is None and "n3" in c.raft("n1").conf.voters
    assert n3.log.committed == c.raft("n1").log.committed and n3.promotable()


def test_a_lagging_member_never_calls_a_newly_added_voter_removed() -> None:
    """n3 lags: it never received n4's addition. n4, a voter now, campaigns and asks n3;
    n3's applied configuration leaves n4 out, but n4's log ends beyond what n3 applied,
    so n3 cannot tell that n4 is not a member and answers as before."""
    c = Cluster(N3, seed=2)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.isolate("n3")
    c.add_empty_node("n4")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n4",
                                                auto_promote=True))
    c.tick(["n1", "n2", "n4"], n=10)
    assert "n4" in c.raft("n1").conf.voters and "n4" not in c.raft("n3").conf.members()
    c.tick(["n3"], n=30)  # its leader's lease runs out: it will answer a vote request
    assert c.raft("n3").lead is None
    c.heal()
    c.cut("n1", "n3")  # n3 stays behind
    c.cut("n2", "n3")
    sent = len(c.delivered)
    c.raft("n4").campaign()
    c.stabilize()
    answers = [m for m in c.delivered[sent:] if m.frm == "n3" and m.to == "n4"]
    assert answers and all(m.context != "not a member" for m in answers)
    assert c.raft("n4").removed is None


def test_a_removed_old_leader_whose_log_runs_ahead_is_told_too() -> None:
    """Found in review: n1 leads, is cut off and appends proposals nobody acknowledges;
    the others elect a leader and remove n1. Back, n1's log ends beyond the index the
    members applied (its uncommitted tail), so comparing indexes alone never told it.
    Its last term is below the term of the members' applied entry, which proves its tail
    can never commit (§5.4.1's comparison): it is told, and stops campaigning."""
    c = Cluster(N3, seed=4)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.isolate("n1")
    for i in range(10):
        c.raft("n1").propose(cmd(100 + i))
    c.stabilize()
    c.tick(["n2", "n3"], n=30)
    lead = next(n for n in ("n2", "n3") if c.raft(n).role == Role.LEADER)
    c.raft(lead).propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n1"))
    c.stabilize()
    c.propose(lead, cmd(2))
    n1 = c.raft("n1")
    assert n1.log.last_index() >= c.raft(lead).log.applied
    assert n1.log.last_term() < c.raft(lead).log.last_term()
    term = c.raft(lead).term
    c.heal()
    c.tick(n=40)
    assert n1.removed is not None and not n1.promotable()
    sent = len(c.delivered)
    c.tick(n=40)
    assert not any(m.frm == "n1" and m.type in (MT.PRE_VOTE, MT.VOTE)
                   for m in c.delivered[sent:])
    assert c.leader() == lead and c.raft(lead).term == term


def test_added_back_after_its_term_ran_ahead_it_still_catches_up() -> None:
    """Found in review, without pre-vote and check-quorum (both Config options): n3's
    real campaign raised its term past the group's before the notice came. Added back,
    it ignored the leader's lower-term appends without a word (the stale-leader answer
    is sent only with pre-vote or check-quorum), so it never caught up. A node told it
    was removed answers them, as check-quorum does, and the group moves to its term."""
    c = Cluster(N3, seed=1, pre_vote=False, check_quorum=False)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.nodes["n3"].crash()
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    c.propose("n1", cmd(2))
    c.nodes["n3"].restart()
    group_term = c.raft("n1").term
    c.tick(["n3"], n=40)
    n3 = c.raft("n3")
    assert n3.removed is not None and n3.term > group_term
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n3",
                                                auto_promote=True))
    c.tick(n=200)
    lead = c.leader()
    assert lead is not None and n3.removed is None
    assert n3.log.committed == c.raft(lead).log.committed


def test_a_node_removed_while_up_is_told_when_its_removal_applies() -> None:
    """Found from outside: n3, removed while up on an idle cluster, never received its
    removal (a leader stops sending to a node once a configuration without it is
    appended) and, quiet, never campaigned: its /ready said ready for as long as it ran.
    The leader sends it the notice when the removal applies."""
    c = Cluster(N3, seed=5)
    c.elect("n1")
    c.propose("n1", cmd(1))
    index = c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    n3 = c.raft("n3")
    assert n3.log.last_index() < index  # it never received its removal
    assert n3.removed == ("n1", c.raft("n1").log.applied) and not n3.promotable()
    assert c.leader() == "n1"


def _n3_removed_unheard(seed: int) -> Cluster:
    """n3 removed while up, and the notice sent when its removal applied is lost (a
    dropped connection, say)."""
    c = Cluster(N3, seed=seed)
    c.elect("n1")
    c.propose("n1", cmd(1))
    c.filters.append(lambda m: not (m.to == "n3" and m.context == "not a member"))
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.REMOVE, "n3"))
    c.stabilize()
    c.filters.clear()
    return c


def test_a_removed_node_that_asks_for_a_read_is_told() -> None:
    """Found from outside: n3, removed while idle, never received its removal (a leader
    stops sending to a node once a configuration without it is appended) and, quiet,
    never campaigned: its /ready said ready, and a linearizable read waited 5 s for an
    index it would never receive. The leader answers a read request from a node that its
    latest and applied configurations leave out with the "not a member" notice."""
    c = _n3_removed_unheard(seed=6)
    c.propose("n1", cmd(2))
    n3 = c.raft("n3")
    assert "n3" in n3.conf.voters and n3.removed is None and n3.lead == "n1"
    n3.read_index("ctx")
    c.stabilize()
    assert n3.removed is not None and n3.removed[0] == "n1"
    assert not n3.read_states  # no read point was given


def test_a_removed_node_that_forwards_a_write_is_told() -> None:
    """Found from outside: a learner removed while idle (a drained placement node's
    metastore replica) missed its removal, and a learner never campaigns, so it was never
    told: table administration sent through it waited 5 s and answered 504. The leader
    now answers a write forwarded from a node outside its latest and applied
    configurations with the notice (``tell_if_removed``, called by the driver): here n3,
    whose removal notice was lost, is told when it forwards one."""
    c = _n3_removed_unheard(seed=7)
    n3 = c.raft("n3")
    assert n3.removed is None and n3.lead == "n1"
    assert not c.raft("n1").tell_if_removed("n2")  # a member is not told anything
    assert c.raft("n1").tell_if_removed("n3")
    c.stabilize()
    assert n3.removed is not None and n3.removed[0] == "n1" and not n3.promotable()
    assert c.leader() == "n1"
