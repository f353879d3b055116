"""Log replication scenarios for the pure core (Raft paper §5.3, §5.4.2 and Figure 8, §7;
dissertation §4.2.1 for learners; DESIGN "The core contract" for the Ready cycle)."""

from __future__ import annotations

import pytest
from conftest import (
    MT,
    Hold,
    cluster_from_logs,
    cmd,
    drain,
    make_raft,
    msg,
    terms_log,
    tick_until,
)
from raftkv.storage.records import ENTRY_OVERHEAD, VoteFloor

from raftkv.core import ConfChange, ConfChangeOp, Entry, HardState, Message, Role
from raftkv.core.quorum import committed_index
from raftkv.testing.cluster import Cluster
from raftkv.testing.node import encode_command

N3 = ["n1", "n2", "n3"]


def stored(r) -> list[Entry]:
    log = r.log
    return log.entries(log.first_index(), log.last_index() + 1)


# ----------------------------------------------------------------------------- §5.3 --
def test_conflicting_uncommitted_suffix_is_replaced_prefix_kept():
    """§5.3: "If an existing entry conflicts with a new one (same index but different
    terms), delete the existing entry and all that follow it"; entries before the conflict
    stay. Follower: 1@1 2@1 3@2 4@2 5@2 (only 1..2 committed). Leader of term 3 sends
    prev=2@1 with 3@3 4@3."""
    f = make_raft("n2", entries=terms_log([1, 1, 2, 2, 2], N3), hard=HardState(2, "n1", 2))
    drain(f)
    before = stored(f)
    new = [Entry(3, 3, 0, b"a"), Entry(3, 4, 0, b"b")]
    f.step(msg(MT.APP, "n3", "n2", 3, index=2, log_term=1, entries=new, commit=2))
    rd = drain(f)
    assert rd.entries == new  # only the replacement is persisted
    assert stored(f) == before[:2] + new
    assert f.log.last_index() == 4 and f.log.committed == 2
    assert [(m.type, m.reject, m.index) for m in rd.messages] == [(MT.APP_RESP, False, 4)]


def test_conflict_truncates_from_first_differing_entry_only():
    """§5.3: matching entries inside the message are kept; truncation starts at the first
    entry whose term differs. Follower 1@1 2@1 3@2 4@2 5@2 6@2; message prev=2@1 carrying
    3@2 4@2 5@3: entries 3, 4 are kept (same objects), 5..6 replaced by 5@3."""
    f = make_raft("n2", entries=terms_log([1, 1, 2, 2, 2, 2], N3), hard=HardState(3, None, 2))
    drain(f)
    before = stored(f)
    ents = [before[2], before[3], Entry(3, 5, 0, b"new")]
    f.step(msg(MT.APP, "n3", "n2", 3, index=2, log_term=1, entries=ents, commit=2))
    rd = drain(f)
    assert rd.entries == [Entry(3, 5, 0, b"new")]
    assert stored(f) == before[:4] + [Entry(3, 5, 0, b"new")]


def test_conflict_resolution_in_cluster_old_leader_entries_overwritten():
    """§5.3 end to end: a deposed leader's uncommitted entries on a follower are replaced by
    the new leader's; the committed prefix (and what was applied from it) is kept."""
    c = Cluster([f"n{i}" for i in range(1, 6)], seed=9)
    c.elect("n1")
    c.propose("n1", cmd(0))
    committed = c.raft("n1").log.committed
    prefix = c.logs("n2")
    c.filters.append(lambda m: not (m.frm == "n1" and m.to in ("n3", "n4", "n5")))
    for i in range(1, 4):
        c.propose("n1", cmd(i))
    assert c.raft("n2").log.last_index() == committed + 3
    assert c.raft("n1").log.committed == committed
    c.heal()
    for a in ("n1", "n2"):
        for b in ("n3", "n4", "n5"):
            c.cut(a, b)
    tick_until(c, lambda: any(c.raft(n).role == Role.LEADER for n in ("n3", "n4", "n5")),
               ["n3", "n4", "n5"])
    lead = next(n for n in ("n3", "n4", "n5") if c.raft(n).role == Role.LEADER)
    for i in range(10, 14):
        c.propose(lead, cmd(i))
    applied_before = {n: list(c.applied[n]) for n in ("n1", "n2")}
    c.heal()
    c.tick(n=3)
    assert c.leader() == lead
    for n in c.nodes:
        assert c.logs(n) == c.logs(lead)
        assert c.logs(n)[: len(prefix)] == prefix
        assert c.nodes[n].sm.data == c.nodes[lead].sm.data
    # the old leader's entries 1..3 are gone; nothing committed before was re-applied
    assert "k1" not in c.nodes["n2"].sm.data and "k10" in c.nodes["n2"].sm.data
    for n in ("n1", "n2"):
        got = [a.entry.index for a in c.applied[n]]
        assert got == list(range(1, len(got) + 1))
        assert c.applied[n][: len(applied_before[n])] == applied_before[n]


# ------------------------------------------------- stale / reordered AppendEntries --
TEN = [1] + [2] * 9  # 1@1 (bootstrap conf), 2..10@2 from the current leader n1


def _follower_with_ten(commit: int):
    f = make_raft("n2", entries=terms_log(TEN, N3), hard=HardState(2, "n1", commit))
    rd = drain(f)  # applies 1..commit
    assert [e.index for e in rd.committed_entries] == list(range(1, commit + 1))
    f.step(msg(MT.HEARTBEAT, "n1", "n2", 2, commit=commit))
    drain(f)
    return f


@pytest.mark.parametrize("commit", [0, 2, 3, 4, 5, 7, 10])
@pytest.mark.parametrize("stale_commit", [0, 3, 5])
def test_stale_append_entries_never_truncates_matching_entries(commit, stale_commit):
    """§5.3 ("If an existing entry conflicts with a new one ... delete the existing entry
    and all that follow it": only on a conflict) - the PySyncObj 0.3.17 regression, which
    deleted everything after prevLogIdx on a duplicated AppendEntries and then logged
    "truncating already-applied log entries ... state machine may have diverged". A stale
    AppendEntries(prev=3@2, entries 4..5) reaching a follower that holds 1..10 of the same
    leader must leave 1..10 alone, never move the commit index back and re-apply nothing."""
    f = _follower_with_ten(commit)
    before = stored(f)
    applied = f.log.applied
    ents = before[3:5]
    assert [e.index for e in ents] == [4, 5]
    f.step(msg(MT.APP, "n1", "n2", 2, index=3, log_term=2, entries=ents, commit=stale_commit))
    assert f.log.last_index() == 10 and not f.log.unstable
    rd = drain(f)
    assert rd.entries == []  # nothing rewritten to storage
    assert stored(f) == before
    # The commit index never moves back (it may learn the stale message's commit, which
    # is still true: entries 4..5 match).
    assert commit <= f.log.committed <= max(commit, stale_commit)
    assert f.log.storage.last_index() == 10
    # Applied entries are not delivered again; at most the newly committed ones are.
    assert [e.index for e in rd.committed_entries] == list(
        range(applied + 1, f.log.committed + 1)
    )
    (resp,) = rd.messages
    assert resp.type == MT.APP_RESP and not resp.reject
    # It acknowledges what it knows to match: the message's end, or its commit index.
    assert resp.index in (5, f.log.committed) and resp.index <= 10


@pytest.mark.parametrize("persist_between", [False, True])
def test_reordered_older_append_after_newer_keeps_newer_entries(persist_between):
    """§5.3: an older AppendEntries (prev=3, entries 4..5) overtaken by a newer one
    (prev=3, entries 4..10) must not cut the log back to 5, whether or not the newer entries
    have been persisted yet (they may still sit in the unstable tail)."""
    f = make_raft("n2", entries=terms_log(TEN[:3], N3), hard=HardState(2, "n1", 3))
    drain(f)
    full = terms_log(TEN, N3)
    newer = msg(MT.APP, "n1", "n2", 2, index=3, log_term=2, entries=full[3:10], commit=3)
    older = msg(MT.APP, "n1", "n2", 2, index=3, log_term=2, entries=full[3:5], commit=3)
    f.step(newer)
    if persist_between:
        drain(f)
    f.step(older)
    rd = drain(f)
    assert stored(f) == full
    assert f.log.storage.entries(1, 11) == full
    assert [m.index for m in rd.messages if m.type == MT.APP_RESP][-1] >= 5


def test_reordered_old_append_below_commit_after_progress():
    """§5.3 + §5.4: an AppendEntries overtaken by later ones that already committed 8
    entries changes nothing: commit stays at 8, nothing is truncated or re-applied."""
    f = make_raft("n2", entries=terms_log(TEN[:3], N3), hard=HardState(2, "n1", 3))
    drain(f)
    full = terms_log(TEN, N3)
    f.step(msg(MT.APP, "n1", "n2", 2, index=3, log_term=2, entries=full[3:10], commit=8))
    rd = drain(f)
    assert [e.index for e in rd.committed_entries] == [4, 5, 6, 7, 8]
    f.step(msg(MT.APP, "n1", "n2", 2, index=3, log_term=2, entries=full[3:5], commit=3))
    rd = drain(f)
    assert rd.committed_entries == [] and rd.entries == []
    assert stored(f) == full and f.log.committed == 8 and f.log.applied == 8


def test_duplicated_and_reordered_appends_in_cluster_change_nothing():
    """§5.3 in a running group: replaying every AppendEntries a follower ever received, in
    order and reversed, while it holds entries it has not yet seen committed, leaves every
    log, commit index and state machine as it was; nothing is applied twice (SimNode also
    raises on any gap or replay)."""
    c = Cluster(N3, seed=21)
    c.elect("n1")
    for i in range(5):
        c.propose("n1", cmd(i))
    c.cut("n1", "n3")
    hold = Hold(lambda m: m.type == MT.APP_RESP and m.frm == "n2")
    c.filters.append(hold)
    for i in range(5, 10):
        c.propose("n1", cmd(i))
    r2 = c.raft("n2")
    assert r2.log.last_index() == c.raft("n1").log.last_index() > r2.log.committed
    old = [m for m in c.delivered if m.type == MT.APP and m.to == "n2"]
    assert len(old) >= 10
    snap = {n: (c.logs(n), c.raft(n).log.committed, len(c.applied[n])) for n in c.nodes}
    for batch in (old, list(reversed(old))):
        c.deliver(batch)
        c.stabilize()
        for n in c.nodes:
            assert (c.logs(n), c.raft(n).log.committed, len(c.applied[n])) == snap[n]
    hold.release(c)
    c.heal()
    c.stabilize()
    match = c.raft("n1").prs["n2"].match
    assert match == r2.log.last_index()
    c.deliver(old)  # once more, now that everything is committed
    c.stabilize()
    assert c.raft("n1").prs["n2"].match == match
    c.propose("n1", cmd(99))
    c.tick(n=2)
    for n in c.nodes:
        assert c.logs(n) == c.logs("n1")
        got = [a.entry.index for a in c.applied[n]]
        assert got == list(range(1, c.raft("n1").log.committed + 1))


# -------------------------------------------------------------- commit notices --
def test_a_new_commit_index_reaches_up_to_date_followers_as_an_unanswered_notice():
    """"Commit notices" (raftkv.core.raft): once an entry commits, followers that already
    hold it learn the commit index from a COMMIT, the empty append it replaces, and do
    not answer it. One write then costs three messages per follower, not four, and
    every replica still applies it at once."""
    c = Cluster(N3, seed=5)
    c.elect("n1")
    c.delivered.clear()
    index = c.propose("n1", cmd(1))
    kinds = [(m.type, m.frm, m.to) for m in c.delivered]
    assert sorted(kinds) == sorted([
        (MT.APP, "n1", "n2"), (MT.APP, "n1", "n3"),
        (MT.APP_RESP, "n2", "n1"), (MT.APP_RESP, "n3", "n1"),
        (MT.COMMIT, "n1", "n2"), (MT.COMMIT, "n1", "n3"),
    ])
    notice = next(m for m in c.delivered if m.type == MT.COMMIT)
    assert (notice.index, notice.commit, len(notice.entries)) == (index, index, 0)
    for n in N3:
        assert c.raft(n).log.committed == index
        assert [a.entry.index for a in c.applied[n]][-1] == index


def test_a_commit_notice_commits_only_up_to_the_entry_it_matched():
    """§5.3: a follower may commit only entries it knows to match the leader's. A notice
    says prev=7@2, commit=10: entries up to 7 are known to match, so the follower
    commits 7, not 10, and sends nothing."""
    f = _follower_with_ten(3)
    f.step(msg(MT.COMMIT, "n1", "n2", 2, index=7, log_term=2, commit=10))
    rd = drain(f)
    assert f.log.committed == 7
    assert [e.index for e in rd.committed_entries] == [4, 5, 6, 7]
    assert rd.messages == []
    # A notice behind the follower's commit index (reordered, or duplicated) is dropped.
    f.step(msg(MT.COMMIT, "n1", "n2", 2, index=5, log_term=2, commit=5))
    rd = drain(f)
    assert f.log.committed == 7 and rd.messages == [] and rd.committed_entries == []


def test_a_commit_notice_for_an_entry_the_follower_lacks_is_rejected():
    """§5.3's consistency check applies to a notice as to any append: a follower that
    does not hold the notice's previous entry rejects it (with the usual conflict hint)
    and commits nothing."""
    f = make_raft("n2", entries=terms_log(TEN[:3], N3), hard=HardState(2, "n1", 3))
    drain(f)
    f.step(msg(MT.COMMIT, "n1", "n2", 2, index=6, log_term=2, commit=6))
    rd = drain(f)
    assert f.log.committed == 3
    (resp,) = rd.messages
    assert (resp.type, resp.reject, resp.index, resp.reject_hint) == (MT.APP_RESP, True, 6, 3)


def test_a_lost_append_is_repaired_through_the_rejected_commit_notice():
    """The one answer a notice can draw: n3 never got the append carrying entry i (lost
    on the wire), so the notice for i fails its check; the rejection puts n3 in PROBE,
    the leader probes with an ordinary, answered APP, and n3 catches up and commits."""
    c = Cluster(N3, seed=6)
    c.elect("n1")
    lost = []

    def drop_first_append_to_n3(m) -> bool:
        if not lost and m.type == MT.APP and m.to == "n3" and m.entries:
            lost.append(m)
            return False
        return True

    c.filters.append(drop_first_append_to_n3)
    c.delivered.clear()
    index = c.propose("n1", cmd(1))
    assert lost
    assert any(m.type == MT.APP_RESP and m.frm == "n3" and m.reject for m in c.delivered)
    assert any(m.type == MT.APP and m.to == "n3" and m.entries for m in c.delivered)
    assert c.raft("n3").log.committed == index
    assert c.logs("n3") == c.logs("n1")


def test_a_stale_leaders_commit_notice_is_answered_with_the_newer_term():
    """§5.1 with pre-vote/check-quorum: a deposed leader's notice, like its appends,
    draws an answer carrying the newer term, so it steps down."""
    f = make_raft("n2", entries=terms_log(TEN, N3), hard=HardState(3, "n3", 3), pre_vote=True)
    drain(f)
    f.step(msg(MT.COMMIT, "n1", "n2", 2, index=10, log_term=2, commit=10))
    rd = drain(f)
    (resp,) = rd.messages
    assert (resp.type, resp.to, resp.term) == (MT.APP_RESP, "n1", 3)
    assert f.log.committed == 3


def test_a_commit_notice_of_a_newer_term_makes_a_candidate_follow_its_sender():
    """§5.2: a candidate that hears from a leader of at least its term steps down and
    follows it, whatever the message; a notice included."""
    f = make_raft("n2", entries=terms_log(TEN, N3), hard=HardState(2, "n1", 3))
    drain(f)
    f.campaign()
    drain(f)
    assert f.role in (Role.CANDIDATE, Role.PRE_CANDIDATE)
    f.step(msg(MT.COMMIT, "n3", "n2", f.term + 1, index=3, log_term=2, commit=3))
    assert (f.role, f.lead) == (Role.FOLLOWER, "n3")


def test_a_follower_that_lost_acknowledged_entries_is_probed_below_its_match():
    """Storage may truncate a damaged uncommitted tail at open, entries the follower had
    acknowledged included (VoteFloor). The leader's probe at pr.match is then rejected:
    the follower's acknowledgement no longer counts (match drops), probing continues
    below it, and the follower catches up. Before, next was clamped at match + 1 and
    the same probe and rejection repeated forever (found in review, predates commit
    notices). etcd keeps that clamp: its followers never lose what they acknowledged."""
    c = Cluster(N3, seed=3, quiesce=False)
    c.elect("n1")
    # n3 stores entries but hears no commit for the last of them.
    c.filters.append(lambda m: not (m.to == "n3" and m.type in (MT.COMMIT, MT.HEARTBEAT)))
    for i in range(3):
        c.propose("n1", cmd(i))
    c.heal()
    leader, n3 = c.raft("n1"), c.nodes["n3"]
    acked = leader.prs["n3"].match
    assert acked == leader.log.last_index() > n3.raft.log.committed
    n3.crash()
    n3.storage._ents = n3.storage._ents[:-1]  # the damaged, uncommitted last entry
    n3.config["vote_floor"] = VoteFloor(acked, leader.term)
    n3.restart()
    assert n3.raft.log.last_index() == acked - 1
    for i in range(3):
        c.tick(n=1)
        c.propose("n1", cmd(10 + i))  # stabilize() fails if the probes never end
    assert c.logs("n3") == c.logs("n1")
    assert leader.prs["n3"].match == leader.log.last_index() == n3.raft.log.committed


def test_a_stale_rejection_below_match_costs_one_probe_not_a_snapshot():
    """The other side of the test above: a rejection reordered behind later
    acknowledgements looks like a lost tail. It drops n3's acknowledgement and the
    leader probes the same index once more, which n3 accepts; it does not walk below
    the leader's compacted log and send a whole snapshot (found in review)."""
    c = Cluster(N3, seed=3, quiesce=False)
    c.elect("n1")
    for i in range(6):
        c.propose("n1", cmd(i))
    leader = c.raft("n1")
    last = leader.log.last_index()
    assert c.nodes["n1"].compact(keep=0) and leader.log.first_index() == last + 1
    c.filters.append(lambda m: m.to != "n3")  # n3 misses two appends
    c.propose("n1", cmd(100))
    c.propose("n1", cmd(101))
    c.heal()
    pr, t = leader.prs["n3"], leader.term
    # n3's real rejection puts it in PROBE at last + 1...
    leader.step(msg(MT.APP_RESP, "n3", "n1", t, log_term=leader.log.term(last),
                    index=last + 1, reject=True, reject_hint=last))
    assert (pr.match, pr.next) == (last, last + 1)
    # ...then a stale one, from before n3 held `last`, arrives late.
    leader.step(msg(MT.APP_RESP, "n3", "n1", t, log_term=t, index=last, reject=True,
                    reject_hint=last - 3))
    assert (pr.match, pr.next) == (0, last + 1)
    c.delivered.clear()
    c.stabilize()
    assert not any(m.type == MT.SNAPSHOT for m in c.delivered)
    assert pr.match == leader.log.last_index() == c.raft("n3").log.last_index()


# ---------------------------------------------------------------- fast back-off --
@pytest.mark.parametrize("follower_tail", [100, 20])
def test_fast_backoff_divergent_follower_converges_in_few_round_trips(follower_tail):
    """§5.3 ("the follower can include the term of the conflicting entry and the first index
    it stores for that term ... one AppendEntries RPC will be required for each term with
    conflicting entries"): a follower with many divergent entries converges in a handful of
    AppendEntries, not one per entry."""
    voters = N3
    common = [1] + [2] * 9  # 1..10
    leader_log = terms_log(common + [4] * 50, voters)  # 11..60 @4
    follower_log = terms_log(common + [3] * follower_tail, voters)  # 11.. @3
    c = cluster_from_logs({
        "n1": (HardState(4, "n1", 10), leader_log),
        "n2": (HardState(4, "n1", 10), leader_log),
        "n3": (HardState(3, None, 10), follower_log),
    }, seed=1)
    c.elect("n1")
    c.tick(n=2)
    assert c.logs("n3") == c.logs("n1")
    apps = [m for m in c.delivered if m.type == MT.APP and m.to == "n3"]
    rejects = [m for m in c.delivered if m.type == MT.APP_RESP and m.frm == "n3" and m.reject]
    divergent = min(follower_tail, 50)
    assert len(rejects) <= 2, rejects
    assert len(apps) <= 6 < divergent, apps


# ------------------------------------------------------------------ pipelining --
def _hold_n2_resp():
    return Hold(lambda m: m.type == MT.APP_RESP and m.frm == "n2")


def _big(i: int, size: int = 100) -> bytes:
    return encode_command(1, i, "put", f"k{i}", "x" * size)


def test_pipelining_keeps_max_inflight_msgs_in_flight_without_waiting():
    """Dissertation §10.2.2 / etcd's replicate state: once a follower is in REPLICATE the
    leader streams AppendEntries without waiting for each answer, up to
    ``max_inflight_msgs``; then it pauses until acknowledgements free the window."""
    cap = 4
    c = Cluster(N3, seed=1, max_inflight_msgs=cap)
    c.elect("n1")
    c.propose("n1", cmd(0))
    assert c.raft("n1").status().peers["n2"].state == "replicate"
    hold = _hold_n2_resp()
    c.filters.append(hold)
    start = len(c.delivered)
    for i in range(1, 11):
        c.propose("n1", cmd(i))
    with_entries = [m for m in c.delivered[start:]
                    if m.type == MT.APP and m.to == "n2" and m.entries]
    assert len(with_entries) == cap  # in flight at once, none acknowledged
    assert c.raft("n2").log.last_index() == 3 + cap
    assert c.raft("n1").log.committed == c.raft("n1").log.last_index()  # n3 keeps up
    assert c.raft("n1").prs["n2"].match == 3
    hold.release(c)
    c.stabilize()
    c.filters.clear()
    c.tick(["n1"])
    assert c.logs("n2") == c.logs("n1")


def test_pipelining_byte_cap_pauses_sending():
    """The in-flight byte budget ``max_inflight_bytes`` also pauses a follower in
    REPLICATE (backpressure for a slow follower instead of an unbounded queue)."""
    payload = len(_big(1)) + ENTRY_OVERHEAD
    c = Cluster(N3, seed=1, max_inflight_msgs=100, max_inflight_bytes=2 * payload,
                max_msg_bytes=payload)
    c.elect("n1")
    c.propose("n1", cmd(0))
    hold = _hold_n2_resp()
    c.filters.append(hold)
    start = len(c.delivered)
    for i in range(1, 8):
        c.propose("n1", _big(i))
    sent = [m for m in c.delivered[start:] if m.type == MT.APP and m.to == "n2" and m.entries]
    assert len(sent) == 2  # 2 * payload bytes in flight: the window is full
    assert c.raft("n1").prs["n2"].inflights.full()
    # n3 is unaffected.
    assert c.raft("n3").log.last_index() == c.raft("n1").log.last_index()
    hold.release(c)
    c.stabilize()
    c.filters.clear()
    c.tick(["n1"])
    assert c.logs("n2") == c.logs("n1")


def test_max_msg_bytes_splits_a_batch_and_window_refills_on_ack():
    """Pipelining with a message-size cap: a large batch goes out as several messages, never
    more than ``max_inflight_msgs`` unacknowledged at once."""
    cap = 3
    one = len(cmd(0)) + ENTRY_OVERHEAD
    c = Cluster(N3, seed=1, max_inflight_msgs=cap, max_msg_bytes=one)
    c.elect("n1")
    c.propose("n1", cmd(0))
    hold = _hold_n2_resp()
    c.filters.append(hold)
    start = len(c.delivered)
    c.raft("n1").propose_batch([cmd(i) for i in range(1, 21)])
    c.stabilize()
    max_outstanding = 0
    for _ in range(40):
        sent = [m for m in c.delivered[start:] if m.type == MT.APP and m.to == "n2"
                and m.entries]
        acked = max([m.index for m in c.delivered[start:]
                     if m.type == MT.APP_RESP and m.frm == "n2"], default=3)
        outstanding = sum(1 for m in sent if m.entries[-1].index > acked)
        max_outstanding = max(max_outstanding, outstanding)
        assert all(len(m.entries) == 1 for m in sent)
        if not hold.held:
            break
        hold.release(c, 1)
        c.stabilize()
    assert max_outstanding == cap
    c.filters.clear()
    c.tick(["n1"])
    assert c.logs("n2") == c.logs("n1")


# -------------------------------------------------------------- §5.4.2 Figure 8 --
S5 = ["s1", "s2", "s3", "s4", "s5"]


def _figure8_c():
    """Figure 8 (c): S1 (term 2) had replicated index 2 to S2 only; S5 won term 3 with
    S3, S4, S5 and appended index 2@3 locally. S5 is down; S1 wins term 4, appends its
    own no-op at index 3 and replicates index 2 (term 2) to S3."""
    c = cluster_from_logs({
        "s1": (HardState(2, "s1", 1), terms_log([1, 2], S5)),
        "s2": (HardState(2, "s1", 1), terms_log([1, 2], S5)),
        "s3": (HardState(3, "s5", 1), terms_log([1], S5)),
        "s4": (HardState(3, "s5", 1), terms_log([1], S5)),
        "s5": (HardState(3, "s5", 1), terms_log([1, 3], S5)),
    }, seed=8)
    c.nodes["s5"].crash()

    def only_up_to_2(m):
        # The network delivers at most index 2 from S1: its term-4 entry reaches nobody.
        if m.type == MT.APP and m.frm == "s1" and m.entries and m.entries[-1].index > 2:
            m.entries = [e for e in m.entries if e.index <= 2]
        return True

    c.filters.append(only_up_to_2)
    c.cut("s1", "s4")
    for _ in range(3):  # the first pre-vote may only teach S1 that term 3 exists
        c.raft("s1").campaign()
        c.stabilize()
        if c.raft("s1").role == Role.LEADER:
            break
    s1 = c.raft("s1")
    assert s1.role == Role.LEADER and s1.term == 4
    assert c.logs("s1") == [(1, 1), (2, 2), (3, 4)]
    assert c.logs("s2")[1] == c.logs("s3")[1] == (2, 2)
    return c


def test_figure8_old_term_entry_on_majority_is_not_committed():
    """§5.4.2 / Figure 8 (c): "a leader cannot determine commitment using log entries from
    older terms". Index 2@2 is stored on S1, S2, S3 (a majority of 5) and the leader knows
    it, but it must not commit it by counting replicas."""
    c = _figure8_c()
    s1 = c.raft("s1")
    match = {n: pr.match for n, pr in s1.prs.items()}
    assert match["s2"] == 2 and match["s3"] == 2 and match["s1"] == 3
    assert committed_index(S5, match) == 2  # a naive count would commit index 2
    c.tick(["s1"], n=3)
    assert s1.log.committed == 1
    assert all(c.raft(n).log.committed == 1 for n in ("s2", "s3", "s4"))
    assert all(a.entry.index == 1 for n in S5 for a in c.applied[n])


def test_figure8_old_entry_commits_with_current_term_entry():
    """§5.4.2 / Figure 8 (e): once S1's term-4 entry is on a majority, entries 2 and 3
    commit together; commit never stops at 2 on its own."""
    c = _figure8_c()
    s1 = c.raft("s1")
    seen = []
    c.heal()
    c.cut("s1", "s4")  # the term-4 entry reaches S2 and S3: a majority with S1
    c.filters.append(lambda m: (seen.append(s1.log.committed), True)[1])
    c.tick(["s1"], n=2)
    assert s1.log.committed == 3
    assert seen[0] == 1 and 2 not in seen
    for n in ("s2", "s3"):
        assert c.raft(n).log.committed == 3
        assert [a.entry.index for a in c.applied[n]] == [1, 2, 3]


def test_figure8_why_counting_old_replicas_is_unsafe():
    """§5.4.2 / Figure 8 (d): from state (c), if S1 crashes, S5 can still be elected (its
    last term 3 beats the term-2 entry) and overwrite index 2 on S2 and S3. Had S1
    committed index 2 by counting replicas, a committed entry would have been lost."""
    c = _figure8_c()
    c.nodes["s1"].crash()
    c.heal()
    c.nodes["s5"].restart()
    # Only S5 can gather votes: the others cannot reach each other.
    for a, b in (("s2", "s3"), ("s2", "s4"), ("s3", "s4")):
        c.cut(a, b)
    tick_until(c, lambda: c.raft("s5").role == Role.LEADER, ["s2", "s3", "s4", "s5"], 400)
    c.tick(["s5"], n=2)
    for n in ("s2", "s3", "s4"):
        assert c.logs(n)[1] == (2, 3)
        assert c.raft(n).log.committed >= 2


# ------------------------------------------------------------------- learners --
def test_learner_ack_is_never_counted_toward_commit():
    """Dissertation §4.2.1 / Kudu PRE_FOLLOWER: a learner's acknowledgement does not count:
    2 voters + 1 learner, one voter cut off: nothing new commits although the learner has
    every entry."""
    c = Cluster(["n1", "n2"], seed=2)
    c.elect("n1")
    c.add_empty_node("n3")
    c.raft("n1").propose_conf_change(
        ConfChange(ConfChangeOp.ADD_LEARNER, "n3", auto_promote=False))
    c.stabilize()
    c.tick(n=2)
    assert c.raft("n1").conf.learners == {"n3"}
    committed = c.raft("n1").log.committed
    c.cut("n1", "n2")
    for i in range(3):
        c.propose("n1", cmd(i))
    c.tick(["n1", "n3"], n=3)
    assert c.raft("n3").log.last_index() == c.raft("n1").log.last_index() == committed + 3
    assert c.raft("n1").prs["n3"].match == committed + 3
    assert c.raft("n1").log.committed == committed
    c.heal()
    c.tick(n=2)
    assert c.raft("n1").log.committed == committed + 3


# ------------------------------------------------------------------- snapshots --
def _last(c: Cluster, nid: str) -> tuple[int, int]:
    log = c.raft(nid).log
    return log.last_index(), log.last_term()


def _lagging_follower_gets_snapshot(c: Cluster, lagging: str, leader: str = "n1"):
    c.nodes[leader].compact()
    first = c.raft(leader).log.first_index()
    assert first > 2
    c.tick([leader], n=3)
    snaps = [m for m in c.delivered if m.type == MT.SNAPSHOT and m.to == lagging]
    assert snaps, "no snapshot was sent"
    assert _last(c, lagging) == _last(c, leader)
    assert c.nodes[lagging].sm.data == c.nodes[leader].sm.data
    assert c.raft(lagging).log.committed == c.raft(leader).log.committed
    return snaps


def test_snapshot_catches_up_restarted_lagging_follower():
    """§7 (log compaction, InstallSnapshot): a follower that needs entries the leader has
    compacted receives the snapshot, then the log after it; its state machine data equals
    the leader's."""
    c = Cluster(N3, seed=5)
    c.elect("n1")
    c.propose("n1", cmd(0))
    c.nodes["n3"].crash()
    for i in range(1, 20):
        c.propose("n1", cmd(i))
    c.nodes["n3"].restart()
    _lagging_follower_gets_snapshot(c, "n3")
    c.propose("n1", cmd(100))
    assert c.nodes["n3"].sm.data == c.nodes["n1"].sm.data and "k100" in c.nodes["n3"].sm.data


def test_snapshot_catches_up_new_learner():
    """§7 + Kudu add-server ("Tablet Copy"): a new, empty member added after compaction is
    brought up by a snapshot; it then follows the log."""
    c = Cluster(N3, seed=6)
    c.elect("n1")
    for i in range(15):
        c.propose("n1", cmd(i))
    c.nodes["n1"].compact()
    c.add_empty_node("n4")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n4"))
    c.stabilize()
    c.tick(["n1"], n=3)
    assert any(m.type == MT.SNAPSHOT and m.to == "n4" for m in c.delivered)
    assert c.nodes["n4"].sm.data == c.nodes["n1"].sm.data
    assert c.nodes["n4"].storage.snapshot().index >= 16
    c.propose("n1", cmd(100))
    assert _last(c, "n4") == _last(c, "n1")
    assert c.nodes["n4"].sm.data == c.nodes["n1"].sm.data


# --------------------------------------------------------- Ready / group commit --
def test_group_commit_one_sync_per_ready_for_a_batch():
    """DESIGN "The core contract" + IGNITE-16907 group commit: a batch of many proposals
    is persisted by the leader with one sync (one Ready), and each follower receives it in
    one AppendEntries and persists it with one sync."""
    c = Cluster(N3, seed=1)
    c.elect("n1")
    syncs = {n: c.nodes[n].storage.syncs for n in c.nodes}
    last = c.raft("n1").propose_batch([cmd(i) for i in range(200)])
    out = c.nodes["n1"].handle_ready()
    assert c.nodes["n1"].storage.syncs == syncs["n1"] + 1
    assert out.ready is not None and len(out.ready.entries) == 200 and out.ready.must_sync
    assert [m.to for m in out.messages if m.type == MT.APP] == ["n2", "n3"]
    c.deliver(out.messages)
    replies = []
    for n in ("n2", "n3"):
        replies += c.nodes[n].handle_ready().messages
        assert c.nodes[n].storage.syncs == syncs[n] + 1
        assert c.raft(n).log.storage.last_index() == last
    c.deliver(replies)
    c.stabilize()
    assert c.raft("n1").log.committed == last


def test_every_committed_entry_applied_once_in_order_with_its_index():
    """DESIGN "proposedIndex" + §5.3 State Machine Safety: each node applies every committed
    entry exactly once per incarnation, in index order, without gaps, and the same entry at
    each index on every node, across leader changes and a crash/restart."""
    c = Cluster(N3, seed=13)
    c.elect("n1")
    expected: dict[int, bytes] = {}
    for i in range(5):
        expected[c.propose("n1", cmd(i))] = cmd(i)
    c.isolate("n1")
    tick_until(c, lambda: c.leader() not in (None, "n1") and c.raft(c.leader()).term
               > c.raft("n1").term, ["n2", "n3"])
    lead = c.leader()
    c.heal()
    c.tick(n=2)
    victim = min(n for n in c.nodes if n != lead)
    restart_at = len(c.applied[victim])
    c.nodes[victim].crash()
    for i in range(5, 10):
        expected[c.propose(lead, cmd(i))] = cmd(i)
    c.nodes[victim].restart()
    c.tick(n=3)
    assert c.leader() == lead
    commit = c.raft(lead).log.committed
    by_index = {}
    for n in c.nodes:
        segments = [c.applied[n]]
        if n == victim:
            segments = [c.applied[n][:restart_at], c.applied[n][restart_at:]]
        for seg in segments:
            idx = [a.entry.index for a in seg]
            assert idx == list(range(1, len(idx) + 1)), (n, idx)
            for a in seg:
                assert by_index.setdefault(a.entry.index, a.entry) == a.entry
        assert len(segments[-1]) == commit
        assert c.raft(n).log.applied == commit
    # Each acknowledged proposal was applied at the index propose() returned.
    for idx, data in expected.items():
        assert by_index[idx].data == data


def test_an_acknowledgement_beyond_the_leaders_log_is_ignored() -> None:
    """Only a second history of the group could acknowledge an index past the leader's
    log (the placement layer once let one form: two members restarted without their
    state founded one). Taken as a match, the next append read the term of an entry the
    leader does not have, and the error stopped the whole node. It is ignored."""
    c = Cluster(["n1", "n2", "n3"], seed=1)
    c.elect("n1")
    c.propose("n1", cmd(1))
    n1 = c.raft("n1")
    last, match = n1.log.last_index(), n1.prs["n2"].match
    n1.step(Message(MT.APP_RESP, "n1", "n2", n1.term, index=last + 12))
    assert n1.prs["n2"].match == match and n1.role == Role.LEADER
    c.propose("n1", cmd(2))
    assert c.raft("n2").log.committed == n1.log.committed == last + 1
