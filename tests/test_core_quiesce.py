"""Quiescence of idle groups (CockroachDB's quiesced ranges; raftkv.core.raft, "Quiescence").

An idle leader whose followers acknowledged its last index sends one flagged heartbeat
and stops ticking; its followers stop ticking too. Anything that needs the group wakes
it, and the driver's liveness report (``peer_down``) stands in for the heartbeats a
quiet follower no longer gets, so a dead leader is still replaced (Raft §5.2 liveness,
with pre-vote and stickiness from dissertation §9.6 still in force).
"""

from __future__ import annotations

from conftest import MT, Hold, cmd, make_raft, msg

from raftkv.core import Role
from raftkv.testing.cluster import Cluster

IDS = ["n1", "n2", "n3"]


def quiet_cluster(ids: list[str] = IDS, seed: int = 1) -> Cluster:
    """n1 leads, one command is committed everywhere, and the group has gone quiet."""
    c = Cluster(ids, seed=seed, quiesce=True)
    c.elect(ids[0])
    c.propose(ids[0], cmd(1))
    c.tick(n=3)
    for nid in ids:
        assert c.raft(nid).quiesced, f"{nid} did not quiesce"
    return c


def sent_during(c: Cluster, fn) -> list:
    before = len(c.delivered)
    fn()
    return c.delivered[before:]


def test_idle_group_quiesces_and_goes_silent():
    """The point of quiescence: once every follower acknowledged the leader's last index
    and commit, the group sends nothing and elects nobody, however long it idles."""
    c = quiet_cluster()
    term = c.raft("n1").term
    msgs = sent_during(c, lambda: c.tick(n=200))
    assert msgs == []
    assert c.raft("n1").role == Role.LEADER and c.raft("n1").term == term
    assert all(c.raft(n).lead == "n1" and c.raft(n).term == term for n in IDS)


def test_quiesce_heartbeat_carries_last_entry():
    """The leader's last heartbeat names its last entry (index, term); ordinary heartbeats
    carry index 0, so the flag needs no new message type or wire field. A new leader
    sends it as soon as its first entry is acknowledged everywhere."""
    c = Cluster(IDS, seed=1, quiesce=True)
    msgs = sent_during(c, lambda: c.elect("n1"))
    quiet = [m for m in msgs if m.type == MT.HEARTBEAT and m.index > 0]
    r = c.raft("n1")
    assert {m.to for m in quiet} == {"n2", "n3"}
    assert all(m.index == r.log.last_index() and m.log_term == r.term for m in quiet)
    assert all(m.commit == r.log.committed for m in quiet)


def test_quiescence_is_off_by_default():
    """Config.quiesce defaults to off: the plain core heartbeats forever (etcd's
    behaviour), so embedding applications opt in along with a liveness source."""
    c = Cluster(IDS, seed=1)
    c.elect("n1")
    msgs = sent_during(c, lambda: c.tick(n=20))
    assert any(m.type == MT.HEARTBEAT for m in msgs)
    assert not any(c.raft(n).quiesced for n in IDS)


def test_proposal_wakes_the_group_and_it_quiesces_again():
    """A proposal wakes the leader; its AppendEntries wake the followers; once the entry
    is acknowledged everywhere the group goes quiet again, without waiting for a tick."""
    c = quiet_cluster()
    index = c.raft("n1").propose(cmd(2))
    assert not c.raft("n1").quiesced
    c.stabilize()
    assert all(c.raft(n).quiesced for n in IDS)
    assert all(c.raft(n).log.committed >= index for n in IDS)


def test_last_acknowledgement_quiesces_in_place_of_commit_notices():
    """"Quiescing on the last acknowledgement": a write to a quiet group costs its
    appends, their answers and one quiesce heartbeat per follower, which carries the
    commit index. No COMMIT notice, no heartbeat answer, no tick."""
    c = quiet_cluster()
    index = c.raft("n1").propose(cmd(2))
    msgs = sent_during(c, c.stabilize)
    kinds = sorted((m.type.name, m.frm, m.to) for m in msgs)
    assert kinds == sorted([
        ("APP", "n1", "n2"), ("APP", "n1", "n3"),
        ("APP_RESP", "n2", "n1"), ("APP_RESP", "n3", "n1"),
        ("HEARTBEAT", "n1", "n2"), ("HEARTBEAT", "n1", "n3"),
    ])
    assert all(m.index == index and m.commit == index for m in msgs
               if m.type == MT.HEARTBEAT)
    assert all(c.raft(n).log.committed == index and c.raft(n).quiesced for n in IDS)


def test_held_notice_reaches_followers_by_heartbeat_if_an_answer_is_lost():
    """While the last follower's answer is in flight the commit notice is held (the
    quiesce heartbeat will carry it). If that answer is lost, the leader, still awake,
    tells the followers the commit index with its next heartbeat (which carries
    min(match, commit)); n3's answer to it shows its match behind, the leader probes
    with an empty append, and n3's acknowledgement of that lets the group quiesce."""
    c = quiet_cluster()
    lost = Hold(lambda m: m.type == MT.APP_RESP and m.frm == "n3")
    c.filters.append(lost)
    index = c.raft("n1").propose(cmd(2))
    c.stabilize()
    lead = c.raft("n1")
    assert lead.log.committed == index and not lead.quiesced
    assert c.raft("n2").log.committed < index  # held: n3's answer is still awaited
    c.filters.remove(lost)
    c.tick(["n1"], n=2)  # heartbeat_tick
    c.stabilize()
    assert c.raft("n2").log.committed == index and c.raft("n3").log.committed == index
    c.tick(n=3)
    assert all(c.raft(n).quiesced for n in IDS)


def test_notice_is_not_held_for_a_follower_that_will_not_answer():
    """Only an answer on its way (REPLICATE, sent the last index) holds the notice: a
    follower being probed may never answer for that index, so the followers that did
    acknowledge get their COMMIT notice at once."""
    c = Cluster(["n1", "n2", "n3", "n4", "n5"], seed=1, quiesce=True)
    c.elect("n1")
    lead = c.raft("n1")
    lead.prs["n5"].become_probe()
    lead.prs["n5"].probe_sent = True  # paused: nothing more goes to n5 for now
    c.cut("n1", "n5")
    index = lead.propose(cmd(2))
    msgs = sent_during(c, c.stabilize)
    notices = {m.to for m in msgs if m.type == MT.COMMIT}
    assert notices == {"n2", "n3", "n4"}
    assert all(c.raft(n).log.committed == index for n in ["n2", "n3", "n4"])


def test_follower_read_index_wakes_leader_and_is_answered():
    """§6.4 on a quiet group: the follower's READ_INDEX wakes the leader, which confirms
    leadership with a heartbeat round (ordinary heartbeats, which wake the followers)."""
    c = quiet_cluster()
    c.raft("n2").read_index("ctx")
    c.stabilize()
    assert [rs.context for rs in c.read_states["n2"]] == ["ctx"]
    assert c.read_states["n2"][0].index == c.raft("n1").log.committed
    c.tick(n=3)
    assert all(c.raft(n).quiesced for n in IDS)


def test_lagging_follower_keeps_leader_awake():
    """The leader quiesces only when every reachable follower has acknowledged its last
    index: a follower it cannot reach but was not told is down keeps it heartbeating."""
    c = Cluster(IDS, seed=1, quiesce=True)
    c.elect("n1")
    c.tick(n=3)
    c.cut("n1", "n3")
    c.propose("n1", cmd(2))
    c.tick(["n1"], n=6)
    assert not c.raft("n1").quiesced
    assert c.raft("n2").quiesced is False  # ordinary heartbeats keep it awake


def _quiet_without_n3() -> Cluster:
    """n1 leads; n3 is cut off and reported down; a write commits on n1 and n2, which then
    go quiet without n3 (exempt as unreachable)."""
    c = Cluster(IDS, seed=1, quiesce=True)
    c.elect("n1")
    c.tick(n=3)
    c.cut("n1", "n3")
    c.raft("n1").peer_down("n3")
    c.propose("n1", cmd(2))
    c.tick(["n1", "n2"], n=4)
    return c


def test_unreachable_follower_is_exempt_and_peer_up_wakes_leader():
    """CockroachDB quiesces with non-live followers: one reported down does not block
    quiescence (a quorum is still reachable). When it is reported up again the leader
    wakes and its heartbeats bring the follower up to date."""
    c = _quiet_without_n3()
    assert c.raft("n1").quiesced and c.raft("n2").quiesced
    last = c.raft("n1").log.last_index()
    assert c.raft("n3").log.last_index() < last
    c.heal()
    c.raft("n1").peer_up("n3")
    assert not c.raft("n1").quiesced
    c.tick(["n1"], n=4)
    assert c.raft("n3").log.last_index() == last
    c.tick(n=3)
    assert all(c.raft(n).quiesced for n in IDS)


def test_quiesce_commit_is_bounded_by_match_for_exempt_followers():
    """Like every heartbeat, the quiesce heartbeat carries min(match, commit): a follower
    exempt because it was unreachable may hold different entries below the leader's
    commit index, and must not commit them. (Found by the simulator.)"""
    c = Cluster(IDS, seed=1, quiesce=True)
    c.elect("n1")
    c.tick(n=3)
    hold = Hold(lambda m: m.to == "n3")  # n3 hears nothing; we keep what it was sent
    c.filters.append(hold)
    c.raft("n1").peer_down("n3")
    c.propose("n1", cmd(2))
    c.tick(["n1", "n2"], n=4)
    r = c.raft("n1")
    assert r.quiesced
    match = r.prs["n3"].match
    assert match < r.log.committed
    quiet = [m for m in hold.held if m.type == MT.HEARTBEAT and m.index > 0]
    assert quiet and all(m.commit <= match for m in quiet)


def test_leader_death_reported_by_liveness_elects_a_new_leader():
    """The hard case. A quiet follower keeps no election timer, so a dead leader must be
    noticed through node liveness (the transport's connection state): peer_down wakes
    the followers, and one of them is elected within a few election timeouts, through
    pre-vote as usual."""
    c = quiet_cluster()
    term = c.raft("n2").term
    c.nodes["n1"].crash()
    c.tick(["n2", "n3"], n=100)
    assert c.raft("n2").lead == "n1" and c.raft("n2").term == term  # nobody noticed
    for nid in ("n2", "n3"):
        c.raft(nid).peer_down("n1")
        assert not c.raft(nid).quiesced
    c.tick(["n2", "n3"], n=45)
    new = c.leader()
    assert new in ("n2", "n3") and c.raft(new).term == term + 1


def test_peer_down_of_a_non_leader_does_not_wake_a_follower():
    """A follower needs only its leader: losing another follower changes nothing for it."""
    c = quiet_cluster()
    c.raft("n2").peer_down("n3")
    assert c.raft("n2").quiesced


def test_isolated_leader_wakes_and_check_quorum_deposes_it():
    """A quiet leader keeps no check-quorum timer either. Told its followers are down, it
    wakes, cannot quiesce again without a reachable quorum, and steps down (§6.2)."""
    c = quiet_cluster()
    c.isolate("n1")
    c.raft("n1").peer_down("n2")
    c.raft("n1").peer_down("n3")
    assert not c.raft("n1").quiesced
    c.tick(["n1"], n=25)
    assert c.raft("n1").role == Role.FOLLOWER


def test_wrong_down_report_costs_no_election():
    """A false peer_down (a flapping connection) wakes a follower, whose pre-vote then
    wakes the leader; stickiness keeps the leader and the term (dissertation §9.6)."""
    c = quiet_cluster()
    term = c.raft("n1").term
    c.raft("n2").peer_down("n1")
    c.tick(["n2"], n=25)
    c.tick(n=10)
    assert c.leader() == "n1" and all(c.raft(n).term == term for n in IDS)


def test_follower_without_the_last_entry_refuses_and_wakes_the_leader():
    """A follower that lacks the entry named by the quiesce heartbeat does not go quiet
    (its timer keeps running); it answers with reject, and that answer wakes the leader."""
    r = make_raft("n2", quiesce=True)
    r.step(msg(MT.HEARTBEAT, "n1", "n2", 2, index=5, log_term=2, commit=1))
    assert not r.quiesced
    resp = [m for m in r.msgs if m.type == MT.HEARTBEAT_RESP]
    assert len(resp) == 1 and resp[0].reject

    c = quiet_cluster()
    lead = c.raft("n1")
    lead.step(msg(MT.HEARTBEAT_RESP, "n2", "n1", lead.term, reject=True))
    assert not lead.quiesced


def test_follower_told_leader_is_down_refuses_to_quiesce():
    """A follower that believes its leader unreachable must keep its timer: quiescing
    would leave it waiting on a report that already came."""
    c = Cluster(IDS, seed=1, quiesce=True)
    c.elect("n1")
    c.raft("n2").peer_down("n1")
    c.tick(["n1"], n=3)
    assert not c.raft("n2").quiesced and c.raft("n3").quiesced


def test_messages_wake_a_quiet_follower_but_its_leaders_flagged_heartbeat_does_not():
    """Any message other than its leader's (duplicate) quiesce heartbeat wakes a quiet
    follower: a vote request, say, from a node that noticed the leader is gone."""
    c = quiet_cluster()
    r = c.raft("n3")
    r.step(msg(MT.HEARTBEAT, "n1", "n3", r.term, index=r.log.last_index(), log_term=r.term,
               commit=r.log.committed))
    assert r.quiesced
    r.step(msg(MT.PRE_VOTE, "n2", "n3", r.term + 1, index=r.log.last_index(),
               log_term=r.term))
    assert not r.quiesced


def test_pending_transfer_or_read_blocks_quiescence():
    """Work in flight keeps the leader awake: a leadership transfer (§3.10) and a pending
    ReadIndex (§6.4) both need heartbeats or ticks to finish or time out."""
    c = Cluster(IDS, seed=1, quiesce=True)
    c.elect("n1")
    c.tick(n=3)
    r = c.raft("n1")
    c.cut("n1", "n3")
    c.cut("n1", "n2")
    r.read_index("r")
    assert r._quiesce_blocker() is not None
    c.heal()
    c.stabilize()
    c.tick(n=3)
    assert r.quiesced
    c.cut("n1", "n2")
    r.transfer_leadership("n2")
    assert r._quiesce_blocker() is not None


def test_learner_awaiting_promotion_keeps_leader_awake():
    """Heartbeat responses retry a blocked automatic promotion (Kudu's PRE_FOLLOWER), so a
    leader with a learner waiting for promotion must not go quiet."""
    from raftkv.core import ConfChange, ConfChangeOp

    c = Cluster(IDS, seed=1, quiesce=True)
    c.elect("n1")
    c.tick(n=3)
    c.add_empty_node("n4")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n4"))
    c.stabilize()
    c.tick(n=6)
    conf = c.raft("n1").conf
    assert "n4" in conf.voters  # promoted while the leader was kept awake
    c.tick(n=3)
    assert all(c.raft(n).quiesced for n in ["n1", "n2", "n3", "n4"])


def test_quiet_leader_that_has_to_send_wakes():
    """A quiet leader that must answer with something, here appends for a follower that
    answers before its peer_up arrives, is active again: its followers wake on receipt,
    and it must keep ticking and heartbeating with them."""
    c = _quiet_without_n3()
    r = c.raft("n1")
    assert r.quiesced and r.prs["n3"].match < r.log.last_index()
    c.heal()
    r.step(msg(MT.HEARTBEAT_RESP, "n3", "n1", r.term))
    assert not r.quiesced
    c.stabilize()
    assert c.raft("n3").log.last_index() == r.log.last_index()


def test_follower_behind_the_quiesce_commit_answers_and_catches_up():
    """A follower the leader wrongly thinks down is exempt, so the leader may quiesce
    with a stale match for it (its answer was lost). Its quiesce heartbeat then carries a
    commit index below the named entry; the follower, holding that entry, answers instead
    of staying silent, and the append that answer brings gives it the commit index.
    (Review finding: it stayed quiet behind the commit until the leader heard peer_up.)"""
    c = quiet_cluster()
    c.raft("n1").peer_down("n3")  # wrong: n3 is connected (a flapping connection)
    lost = Hold(lambda m: m.type == MT.APP_RESP and m.frm == "n3")
    c.filters.append(lost)
    index = c.raft("n1").propose(cmd(2))
    c.stabilize()
    c.filters.remove(lost)
    c.tick(n=20)
    c.stabilize()
    n3 = c.raft("n3")
    assert n3.log.last_index() == index and n3.log.committed == index


def test_late_answer_from_a_paused_follower_still_quiesces_the_group():
    """With one message in flight per follower, the last answer comes from a paused
    follower; it must still release the held notice (review finding: the paused branch
    skipped it, and the group waited for a heartbeat)."""
    c = Cluster(IDS, seed=1, quiesce=True, max_inflight_msgs=1)
    c.elect("n1")
    late = Hold(lambda m: m.type == MT.APP_RESP and m.frm == "n3")
    c.filters.append(late)
    index = c.raft("n1").propose(cmd(2))
    c.stabilize()
    assert c.raft("n1")._notice_held
    c.filters.remove(late)
    late.release(c)
    c.stabilize()
    assert all(c.raft(n).quiesced for n in IDS)
    assert all(c.raft(n).log.committed == index for n in IDS)


def test_a_follower_below_the_named_commit_stays_awake_until_it_learns_it():
    """Placement simulator seed 2104: a quiesce heartbeat whose commit is below the entry
    it names (the leader thought us down) must not put us to sleep. Asleep, a lost
    follow-up left us one entry behind for good; awake, our election timer's pre-vote
    wakes the leader, which brings the commit."""
    c = quiet_cluster()
    r1, r2 = c.raft("n1"), c.raft("n2")
    last = r1.log.last_index()
    # The leader's quiesce heartbeat as it is sent when it thought n2 was down.
    r2.quiesced = False
    r2.log.committed = last - 1
    r2.step(msg(MT.HEARTBEAT, "n1", "n2", r1.term, index=last,
                log_term=r1.log.term(last), commit=last - 1))
    assert not r2.quiesced and r2.log.committed == last - 1
    # Every follow-up from n1 to n2 is lost at first; n2's timer then wakes the group.
    c.cut("n1", "n2")
    c.tick(["n2"], n=5)
    c.heal()
    for _ in range(100):
        c.tick()
        if r2.log.committed == last and r2.quiesced:
            break
    assert r2.log.committed >= last and r1.role == Role.LEADER
    # With the commit named, it does go quiet.
    r2.quiesced = False
    r2.step(msg(MT.HEARTBEAT, "n1", "n2", r1.term, index=r2.log.last_index(),
                log_term=r2.log.term(r2.log.last_index()), commit=r2.log.last_index()))
    assert r2.quiesced


def test_followers_back_but_silent_do_not_let_a_leader_quiesce_without_a_quorum():
    """Found from outside (an in-memory table, two of three replicas SIGKILLed and
    restarted at once): a quiet leader whose followers are reported down, then up again
    within a check-quorum period, but which never answer for the group (restarted
    empty, they host nothing yet). Its progress still showed them caught up from before
    (REPLICATE, match at the last index), so it quiesced again and stayed leader for
    good, with no quorum behind it. Now a follower counts for quiescence only once it
    has answered since it was reported down (``Progress.unheard``), so the leader keeps
    ticking and check-quorum deposes it (§6.2). (Sending a replicating follower back to
    probe on peer_down, as etcd's ReportUnreachable does, also passed this, but left a
    settled simulator cluster without a leader for too long: seed 944, kept as a
    regression seed.)"""
    c = quiet_cluster()
    c.isolate("n1")  # n2 and n3 never answer again
    c.raft("n1").peer_down("n2")
    c.raft("n1").peer_down("n3")
    c.tick(["n1"], n=3)
    c.raft("n1").peer_up("n2")
    c.raft("n1").peer_up("n3")
    c.tick(["n1"], n=60)
    assert c.raft("n1").role != Role.LEADER
