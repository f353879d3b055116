"""The driver's loop turn on real nodes (127.0.0.1, LMDB files):

- the linearizable reads one turn receives share one ReadIndex round
  (``Node._flush_reads``);
- a leader's AppendEntries leave before its own log sync, and its entries are
  acknowledged only after it (``Node._send_first``, dissertation §10.2.1), except where
  they carry a commit index the sync has yet to make true (a single voter's);
- a read waiting on a leader that dies is asked of the next leader
  (``Node._on_soft_state``), not left to the request timeout. Found from outside
  (tests/test_heal_procs.py): a table read through a follower took 5.45 s when the
  partition's leader was SIGKILLed, though a new leader was elected in 1.4 s: the
  follower had sent its ReadIndex request to the dead leader and waited out the 5 s
  request timeout. The request timeout here is 30 s, so the two behaviours cannot be
  confused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from raftkv.recovery.compaction import compact
from raftkv.storage.commands import encode_put
from raftkv.storage.errors import CorruptLog

from raftkv.core import (
    ConfChange,
    ConfChangeOp,
    ConfChangeRejected,
    Entry,
    EntryType,
    MessageType,
    NotAMember,
    Ready,
    Snapshot,
    SnapshotMeta,
)
from raftkv.node.driver import Node, NodeConfig, _applies_first
from raftkv.node.errors import NodeStopped, RequestTimeout
from raftkv.node.stores import open_group_storage
from raftkv.testing.procs import free_ports

GID = "g"
TIMEOUT = 30.0


@contextmanager
def _started(tmp_path: Path, size: int, founders: list[str] | None = None,
             request_timeout: float = TIMEOUT,
             quiesce: bool = False) -> Iterator[dict[str, Node]]:
    """``size`` real nodes hosting group ``GID`` (founded by ``founders``, by default
    all of them), stopped on the way out."""
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(size))}
    out = {nid: Node(NodeConfig(nid, addr, b"turn-secret", peers=peers,
                                data_dir=str(tmp_path / nid), request_timeout=request_timeout,
                                quiesce=quiesce))
           for nid, addr in peers.items()}
    try:
        for nid, n in out.items():
            n.start()
            storage = open_group_storage(str(tmp_path / nid), GID)
            n.call(lambda n=n, s=storage: n.add_group(GID, s, founders or sorted(peers),
                                                       birth_known=True)).result(5)
        yield out
    finally:
        for n in out.values():
            n.stop()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    with _started(tmp_path, 3) as out:
        yield out


def _leader(nodes: dict[str, Node], among: list[str], within: float = 10.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        leads = {nodes[n].groups[GID].leader for n in among}
        if len(leads) == 1 and None not in leads:
            lead = leads.pop()
            assert lead is not None
            if lead in among:
                return lead
        time.sleep(0.02)
    raise AssertionError("no leader")


@pytest.mark.parametrize("where", ["leader", "follower"])
def test_the_reads_of_one_turn_share_one_read_index_round(
    nodes: dict[str, Node], where: str,
) -> None:
    """Twenty reads queued by one loop call run in the same turn: the leader confirms
    one read point for all of them (one heartbeat round, not twenty), and each read
    still gets its own answer, which reflects every write acknowledged before it."""
    lead = _leader(nodes, list(nodes))
    node = nodes[lead] if where == "leader" else nodes[next(n for n in nodes if n != lead)]
    for i in range(20):
        nodes[lead].propose(GID, encode_put(b"k%d" % i, b"v%d" % i)).result(5)
    leader_reads = nodes[lead].groups[GID].raft.read_only
    before = leader_reads._seq

    def ask() -> list[Future[Any]]:
        return [node.read(GID, lambda s, i=i: s.get(b"k%d" % i)) for i in range(20)]

    reads = node.call(ask).result(5)
    assert [r.result(5) for r in reads] == [b"v%d" % i for i in range(20)]
    assert leader_reads._seq - before == 1


def test_a_read_sent_to_a_leader_that_dies_is_answered_by_the_next(
    nodes: dict[str, Node],
) -> None:
    lead = _leader(nodes, list(nodes))
    nodes[lead].propose(GID, encode_put(b"k", b"v")).result(5)
    follower = next(n for n in nodes if n != lead)
    time.sleep(0.3)  # the follower has applied the write
    nodes[lead].stop()  # its ReadIndex request below goes nowhere
    t0 = time.monotonic()
    got = nodes[follower].read(GID, lambda s: s.get(b"k")).result(TIMEOUT + 5)
    took = time.monotonic() - t0
    assert got == b"v"
    # An election (at most two election timeouts of 1 s, plus the pre-vote round),
    # not the 30 s request timeout.
    assert took < TIMEOUT / 3, f"the read waited {took:.1f}s"
    survivors = [n for n in nodes if n != lead]
    assert _leader(nodes, survivors) in survivors


def test_a_removal_meant_for_a_learner_never_removes_a_voter(
    nodes: dict[str, Node],
) -> None:
    """``change_membership(..., learner_only=True)``: the placement layer decides to drop
    a learner on one loop call and proposes on a later one; if the core promoted it in
    between, the removal must not take out a voter (that needs the removal phase's
    quorum checks)."""
    lead = _leader(nodes, list(nodes))
    voter = next(n for n in nodes if n != lead)
    cc = ConfChange(ConfChangeOp.REMOVE, voter)
    with pytest.raises(ConfChangeRejected, match="no longer a learner"):
        nodes[lead].change_membership(GID, cc, learner_only=True).result(5)
    assert voter in nodes[lead].groups[GID].raft.conf.voters


def _hold_sync(node: Node, marker: bytes) -> tuple[threading.Event, threading.Event]:
    """Make ``node``'s sync of the Ready that carries ``marker`` wait for the returned
    ``release``; ``holding`` is set once it waits (on the node's loop thread)."""
    storage = node.groups[GID].storage
    persist: Callable[[Ready], None] = storage.persist
    holding, release = threading.Event(), threading.Event()

    def held(rd: Ready) -> None:
        if any(marker in e.data for e in rd.entries):
            holding.set()
            release.wait(10)
        persist(rd)

    storage.persist = held  # type: ignore[method-assign]
    return holding, release


def _last_index(node: Node) -> int:
    return node.groups[GID].raft.log.last_index()


def test_a_leader_replicates_an_entry_while_it_syncs_it_and_acknowledges_after(
    nodes: dict[str, Node],
) -> None:
    lead = _leader(nodes, list(nodes))
    followers = [nodes[n] for n in nodes if n != lead]
    nodes[lead].propose(GID, encode_put(b"warm", b"up")).result(5)
    before = nodes[lead].groups[GID].raft.log.last_index()
    holding, release = _hold_sync(nodes[lead], b"held")
    fut = nodes[lead].propose(GID, encode_put(b"held", b"v"))
    try:
        assert holding.wait(5)
        deadline = time.monotonic() + 5
        while not all(_last_index(f) > before for f in followers):
            assert time.monotonic() < deadline, "the followers never got the entry"
            time.sleep(0.01)
        time.sleep(0.2)  # their acknowledgements have arrived and wait to be read
        assert not fut.done()  # the leader's own copy is not durable yet
    finally:
        release.set()
    assert fut.result(5)[0] > before


def test_a_single_voters_entry_reaches_its_learner_only_once_durable(
    tmp_path: Path,
) -> None:
    """A single voter commits an entry the moment it appends it: the AppendEntries that
    tell its learner so wait for its sync. Sent first, a learner would apply an entry
    the voter could still lose to a crash, and later commit another at that index."""
    with _started(tmp_path, 2, founders=["n1"]) as pair:
        voter, learner = pair["n1"], pair["n2"]
        _leader({"n1": voter}, ["n1"])
        voter.change_membership(GID, ConfChange(ConfChangeOp.ADD_LEARNER, "n2",
                                                learner.cfg.raft_addr.encode(),
                                                auto_promote=False)).result(5)
        voter.propose(GID, encode_put(b"warm", b"up")).result(5)
        deadline = time.monotonic() + 5
        while _last_index(learner) < _last_index(voter):
            assert time.monotonic() < deadline, "the learner never caught up"
            time.sleep(0.01)
        before = _last_index(voter)
        holding, release = _hold_sync(voter, b"held")
        fut = voter.propose(GID, encode_put(b"held", b"v"))
        try:
            assert holding.wait(5)
            time.sleep(0.3)
            assert _last_index(learner) == before
            assert learner.groups[GID].raft.log.committed <= before
        finally:
            release.set()
        index = fut.result(5)[0]
        deadline = time.monotonic() + 5
        while learner.groups[GID].raft.log.committed < index:
            assert time.monotonic() < deadline, "the learner never got the entry"
            time.sleep(0.01)


def _ready(committed: range, new: range, conf_at: int | None = None,
           snapshot: bool = False) -> Ready:
    rd = Ready()
    rd.committed_entries = [
        Entry(1, i, EntryType.CONF_CHANGE if i == conf_at else EntryType.NORMAL)
        for i in committed]
    rd.entries = [Entry(1, i) for i in new]
    rd.snapshot = Snapshot(SnapshotMeta(1, 1)) if snapshot else None
    return rd


def test_only_entries_durable_before_a_ready_are_applied_before_its_sync() -> None:
    """``_applies_first``: a leader's new entries and the ones committed before them go
    in one Ready; the committed ones are answered while the new ones sync. A follower
    (or a single voter) whose Ready commits an entry it is only now writing, a snapshot
    to install first, and a configuration change keep the order of the Ready contract."""
    assert _applies_first(_ready(range(5, 10), range(10, 20)))
    assert _applies_first(_ready(range(5, 10), range(0)))
    assert not _applies_first(_ready(range(0), range(10, 20)))
    assert not _applies_first(_ready(range(5, 11), range(10, 20)))  # 10 is not durable
    assert not _applies_first(_ready(range(5, 10), range(10, 20), conf_at=7))
    assert not _applies_first(_ready(range(5, 10), range(0), snapshot=True))


def test_a_read_that_arrives_as_its_node_loses_the_leader_waits_for_the_next(
    nodes: dict[str, Node],
) -> None:
    """Found in review: a read queued in the same turn as a tick that starts an election
    on a follower (its election timer ran out) reached ``_flush_reads`` with no leader in
    the core and failed with NotLeader; one at a time, reads had been asked of the known
    leader and asked again of the next one. The batch now waits for the next leader."""
    lead = _leader(nodes, list(nodes))
    nodes[lead].propose(GID, encode_put(b"k", b"v")).result(5)
    node = nodes[next(n for n in nodes if n != lead)]
    time.sleep(0.3)  # the follower has applied the write
    gate = threading.Event()
    node.call(lambda: gate.wait(5))  # holds the loop: the next two calls share a turn

    def time_out() -> None:
        raft = node.groups[GID].raft
        raft.election_elapsed = raft.randomized_election_timeout - 1
        node._next_tick = 0.0  # this turn ticks, and the tick starts an election

    node.call(time_out)
    read = node.read(GID, lambda s: s.get(b"k"))
    gate.set()
    assert read.result(TIMEOUT / 3) == b"v"


def test_a_write_proposed_again_at_once_on_a_leader_that_stepped_down_waits_for_the_next(
    nodes: dict[str, Node],
) -> None:
    """Found from outside: a PySyncObj-compat program transferring its leadership under
    load wedged the old leader's loop for good. A vote request stepped in a turn's poll
    makes the core a follower, and the turn drains its inbox before it hands the new soft
    state over, so the driver still names this node the leader. Each write then failed
    with NotLeader(no leader), and the compat layer proposed it again at once, into the
    inbox the same drain was emptying: the turn never ended. Such a write now waits for
    the next leader, and a drain takes only what was queued before it began.

    Reached here by the same state, made by hand: the core steps down and the driver's
    record of the leader is put back to this node before the write is queued."""
    lead = _leader(nodes, list(nodes))
    node = nodes[lead]
    g = node.groups[GID]
    attempts: list[BaseException | None] = []
    done: Future[Any] = Future()

    def propose() -> None:
        fut = node.propose(GID, encode_put(b"k", b"v"))

        def answered(f: Future[Any]) -> None:
            attempts.append(f.exception())
            if f.exception() is not None and len(attempts) < 1000:
                propose()  # what the compat layer does with "no leader"
            else:
                done.set_result(f.exception())
        fut.add_done_callback(answered)

    def stale() -> None:
        g.raft._become_follower(g.raft.term, None)

    node.call(stale).result(5)
    node.call(lambda: setattr(g, "leader", node.id)).result(5)
    propose()
    assert done.result(TIMEOUT / 3) is None, attempts[-3:]
    assert attempts == [None]
    others = [n for n in nodes if n != lead]
    assert nodes[others[0]].read(GID, lambda s: s.get(b"k")).result(5) == b"v"


def test_a_parked_write_forwarded_later_keeps_its_own_deadline(tmp_path: Path) -> None:
    """Found in review: a write parked with no leader known, then forwarded, got a fresh
    request timeout at the forward, so it could wait about twice its own. Here the
    leader swallows forwarded writes; the write, parked for 90% of its 2 s and then
    forwarded, must fail by its deadline (it failed after 3.8 s)."""
    timeout = 2.0
    with _started(tmp_path, 3, request_timeout=timeout) as nodes:
        lead = _leader(nodes, list(nodes))
        leader = nodes[lead]
        leader.call(lambda: setattr(leader, "_answer_forward", lambda *a: None)).result(5)
        node = nodes[next(n for n in nodes if n != lead)]
        g = node.groups[GID]
        node.call(lambda: setattr(g, "leader", None)).result(5)  # no leader known
        t0 = time.monotonic()
        fut = node.propose(GID, encode_put(b"k", b"v"))
        time.sleep(timeout * 0.9)
        node.call(lambda: setattr(g, "leader", lead)).result(5)  # known just in time
        with pytest.raises(Exception):  # noqa: B017  # its kind is not the point
            fut.result(10 * timeout)
        assert time.monotonic() - t0 < timeout + 0.5


def _versions(node: Node, keys: Iterable[bytes]) -> set[int]:
    """Each key's version (one per put applied) as ``node``'s replica holds it."""
    got = node.read_kv(GID, lambda s: {s.get_meta(k).version for k in keys}).result(5)
    return set(got)


def test_writes_forwarded_to_a_leader_replaced_while_alive_get_its_answer(
    nodes: dict[str, Node],
) -> None:
    """Found in CI: a metastore write forwarded at a cluster's birth failed "leader n3
    was replaced before answering; the outcome is unknown", because the follower failed
    every write it had forwarded as soon as it heard of a new leader. A replaced leader
    that is alive answers each of them, so only one that is down has its forwards
    failed early. Here the old leader's answers are held back until the follower knows
    the new leader (a review's test): each write still gets its answer, applied once."""
    lead = _leader(nodes, list(nodes))
    follower, heir = [n for n in nodes if n != lead]
    node = nodes[follower]
    held: list[tuple[Any, ...]] = []
    on_reply = node._on_reply
    node.call(lambda: setattr(node, "_on_reply", lambda *a: held.append(a))).result(5)
    futs = {b"h%d" % i: node.propose(GID, encode_put(b"h%d" % i, b"v")) for i in range(20)}
    deadline = time.monotonic() + 10
    while not nodes[lead].read(GID, lambda s: all(s.get(k) for k in futs)).result(5):
        assert time.monotonic() < deadline, "the writes never applied"
        time.sleep(0.05)
    nodes[lead].transfer_leadership(GID, heir).result(10)
    while node.groups[GID].leader != heir:
        assert time.monotonic() < deadline, "the follower never heard of the new leader"
        time.sleep(0.02)
    assert not any(f.done() for f in futs.values())
    node.call(lambda: (setattr(node, "_on_reply", on_reply),
                       [on_reply(*a) for a in held])).result(5)
    errors = [e for e in (f.exception(TIMEOUT) for f in futs.values()) if e is not None]
    assert errors == [], errors[:3]
    assert _versions(node, futs) == {1}


def test_writes_forwarded_through_leadership_transfers_apply_once(
    nodes: dict[str, Node],
) -> None:
    """A leader handing its leadership over refuses proposals (ProposalDropped, nothing
    appended), and that reached the forwarding follower's caller: in this test all 300
    writes of a round were refused. The follower knows nothing was applied and retries
    them with the next leader until their deadline, as it does NotLeader. Five transfers
    with writes in flight: every write is applied, once."""
    lead = _leader(nodes, list(nodes))
    follower, heir = [n for n in nodes if n != lead]
    futs: dict[bytes, Future[Any]] = {}
    for round_ in range(5):
        for i in range(60):
            key = b"r%d-%d" % (round_, i)
            futs[key] = nodes[follower].propose(GID, encode_put(key, b"v"))
        nodes[lead].transfer_leadership(GID, heir).result(10)
        lead, heir = heir, lead
        _leader(nodes, list(nodes))
    errors = [e for e in (f.exception(TIMEOUT) for f in futs.values()) if e is not None]
    assert errors == [], errors[:3]
    assert _versions(nodes[follower], futs) == {1}


@pytest.mark.parametrize("quiesce", [True, False])
def test_a_write_forwarded_to_a_leader_that_died_and_was_replaced_fails_early(
        tmp_path: Path, quiesce: bool) -> None:
    """The other side of the rule above, found in review: a leader that is replaced
    and down will never answer, so its forwarded writes fail (outcome unknown) once it
    is down, not at their deadline. The driver tracked who is down only with
    quiescence on; without it, such a write waited out its whole request timeout."""
    timeout = 8.0
    with _started(tmp_path, 3, request_timeout=timeout, quiesce=quiesce) as nodes:
        lead = _leader(nodes, list(nodes))
        leader = nodes[lead]
        leader.call(lambda: setattr(leader, "_answer_forward", lambda *a: None)).result(5)
        fut = nodes[next(n for n in nodes if n != lead)].propose(GID, encode_put(b"k", b"v"))
        time.sleep(0.2)
        t0 = time.monotonic()
        leader.stop()
        _leader(nodes, [n for n in nodes if n != lead])
        with pytest.raises(RequestTimeout, match="replaced before answering"):
            fut.result(3 * timeout)
        assert time.monotonic() - t0 < timeout / 2


def test_a_parked_write_this_node_proposes_once_it_leads_keeps_its_own_deadline(
        tmp_path: Path) -> None:
    """Found in review: a write parked on a follower and proposed there once it leads
    got a fresh request timeout from the batch it joined, so it could wait about twice
    its own. Here its entry never commits (the others drop the appends that carry it):
    it must fail by its own deadline."""
    timeout = 3.0
    with _started(tmp_path, 3, request_timeout=timeout) as nodes:
        lead = _leader(nodes, list(nodes))
        fid = next(n for n in nodes if n != lead)
        node = nodes[fid]
        data = encode_put(b"late", b"v")
        for nid, other in nodes.items():
            if nid == fid:
                continue
            step = other._step

            def dropping(peer: str, group: str, msg: Any, step: Any = step) -> None:
                if peer == fid and msg.type == MessageType.APP and any(
                        e.data == data for e in msg.entries or ()):
                    return  # the write never commits
                step(peer, group, msg)

            other.call(lambda o=other, d=dropping: setattr(o, "_step", d)).result(5)
        g = node.groups[GID]
        node.call(lambda: setattr(g, "leader", None)).result(5)  # no leader known: parked
        t0 = time.monotonic()
        fut = node.propose(GID, data)
        time.sleep(timeout * 0.8)
        nodes[lead].transfer_leadership(GID, fid).result(5)
        with pytest.raises(RequestTimeout):
            fut.result(5 * timeout)
        assert time.monotonic() - t0 < timeout + 0.5


def test_a_snapshot_image_is_checked_off_the_loop_thread(tmp_path: Path) -> None:
    """A received image is checked before the core adopts it, and a large one takes
    seconds (2-3 s at 1M keys): on the loop thread, that stopped every group's
    heartbeats on the node. The check runs on a worker thread and the message is stepped
    after it. Here the learner's check is held until released: its loop keeps turning
    meanwhile, and the snapshot then installs. A check that fails outright frees the
    group to take the next image."""
    with _started(tmp_path, 2, founders=["n1"]) as pair:
        voter, learner = pair["n1"], pair["n2"]
        _leader({"n1": voter}, ["n1"])
        for i in range(50):
            voter.propose(GID, encode_put(b"k%d" % i, b"v%d" % i)).result(5)
        g, st = voter.groups[GID], voter.groups[GID].storage
        assert voter.call(lambda: compact(st.log, st.state, g.raft.conf_at, 0)).result(5)
        storage = learner.groups[GID].storage
        check = storage.check
        checking, release = threading.Event(), threading.Event()
        calls: list[int] = []

        def held(msg: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in the check")
            checking.set()
            release.wait(10)
            return check(msg)

        storage.check = held  # type: ignore[method-assign]
        voter.change_membership(GID, ConfChange(ConfChangeOp.ADD_LEARNER, "n2",
                                                learner.cfg.raft_addr.encode(),
                                                auto_promote=False)).result(5)
        try:
            deadline = time.monotonic() + 5
            while len(calls) < 1 or GID in learner._checking:
                assert time.monotonic() < deadline, "the failed check kept its group"
                time.sleep(0.01)
            # The leader sends the snapshot again after its snapshot timeout (10 s or
            # more); sooner here, by having its core probe the learner at once.
            voter.call(lambda: g.raft.prs["n2"].become_probe()).result(5)
            assert checking.wait(20), "no second snapshot"
            for _ in range(3):
                t0 = time.monotonic()
                learner.call(lambda: None).result(5)
                assert time.monotonic() - t0 < 1.0, "the loop waited for the check"
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while learner.read(GID, lambda s: s.get(b"k49"), False).result(5) != b"v49":
            assert time.monotonic() - deadline < 0, "the snapshot was not installed"
            time.sleep(0.05)


def _nodes_at(tmp_path: Path, peers: dict[str, str], quiesce: bool,
              tick: float) -> dict[str, Node]:
    """Nodes hosting ``GID`` (founded by all of ``peers``), added before they start."""
    out = {}
    for nid, addr in peers.items():
        n = Node(NodeConfig(nid, addr, b"turn-secret", peers=peers, quiesce=quiesce,
                            data_dir=str(tmp_path / nid), tick_seconds=tick))
        n.add_group(GID, open_group_storage(str(tmp_path / nid), GID), sorted(peers),
                    birth_known=True)
        out[nid] = n
    return out


@pytest.mark.parametrize("quiesce", [True, False])
def test_a_cluster_restarted_whole_elects_as_its_nodes_connect(
        tmp_path: Path, quiesce: bool) -> None:
    """A whole-cluster restart, with 2 s ticks: election timeouts of 20-40 s, early
    campaigns on ticks 1 to 3 ("Campaigning at restart" in raftkv.core.raft). Every peer
    counts as down until its handshake, which the cores hear of at once, so with
    quiescence (the default) the first node up campaigns as the second connects: a
    leader exists before any node's first tick. Without quiescence the cores are told
    nothing either way (review finding: they were told every peer down at start and
    never up), and the early campaign on a tick elects.

    Two nodes that dial each other keep one connection: what went out on the other is
    still delivered (the transport retires it), and a candidate asks again a voter
    reported on a new connection. Before those, 1 to 5 restarts in 15 lost a vote
    request or its answer and waited out an election timeout (here 20-40 s)."""
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}
    first = _nodes_at(tmp_path, peers, quiesce, 0.05)
    try:
        for n in first.values():
            n.start()
        lead = _leader(first, list(peers))
        first[lead].propose(GID, encode_put(b"k", b"v")).result(TIMEOUT)
    finally:
        for n in first.values():
            n.stop()
    again = _nodes_at(tmp_path, peers, quiesce, 2.0)
    for n in again.values():
        n.start()
    try:
        _leader(again, list(peers), within=1.8 if quiesce else 20)
        if quiesce:
            assert all(n.call(lambda n=n: n._ticks).result(5) == 0 for n in again.values())
        # Once every connection is up, no core believes a peer unreachable.
        deadline = time.monotonic() + 5
        while any(n.call(lambda n=n: bool(n._down)).result(5) for n in again.values()):
            assert time.monotonic() < deadline, "some peer never connected"
            time.sleep(0.02)
        for n in again.values():
            assert not n.call(lambda n=n: n.groups[GID].raft._unreachable).result(5)
    finally:
        for n in again.values():
            n.stop()


def test_a_node_whose_loop_failed_says_why_to_every_later_call(
        nodes: dict[str, Node]) -> None:
    """Found from outside: after the loop died (on a damaged log), every call raised a
    bare "node n1 is not running", which gave the program no reason."""
    n = nodes["n1"]
    n.failure = CorruptLog("/data/n1/log/data.mdb: entry 303 fails its checksum")
    for fut in (n.propose(GID, encode_put(b"k", b"v")), n.call(lambda: None)):
        with pytest.raises(NodeStopped, match="entry 303 fails its checksum"):
            fut.result(5)
    n.failure = None  # the fixture stops it as usual


@pytest.mark.parametrize("moved", [False, True])
def test_a_removed_node_that_forwards_a_write_is_refused_and_told(
        nodes: dict[str, Node], moved: bool) -> None:
    """Found from outside: a node removed while idle that missed its removal notice
    (a drained node's metastore learner: a learner never campaigns, so nothing else tells
    it) still forwarded writes to its old leader: table administration through it waited
    5 s and answered 504. A member refuses a write forwarded by a node outside its
    latest and applied configurations with ``NotAMember`` and sends it the notice, so
    what it is asked next fails at once too. ``moved``: the leadership moved since the
    removal, so the node asks a member that no longer leads (it was sent NotLeader and
    retried until its deadline)."""
    lead = _leader(nodes, list(nodes))
    fid = next(n for n in nodes if n != lead)
    node = nodes[fid]
    nodes[lead].propose(GID, encode_put(b"k", b"v")).result(5)
    dropping = threading.Event()
    dropping.set()
    step = node._step

    def deaf(peer: str, group: str, msg: Any) -> None:
        if dropping.is_set() and msg.context == "not a member":
            return  # the notice sent when the removal applies is lost
        step(peer, group, msg)

    node.call(lambda: setattr(node, "_step", deaf)).result(5)
    nodes[lead].change_membership(GID, ConfChange(ConfChangeOp.REMOVE, fid)).result(5)
    if moved:
        other = next(n for n in nodes if n not in (lead, fid))
        nodes[lead].transfer_leadership(GID, other).result(5)
        assert _leader(nodes, [lead, other]) == other
    g = node.groups[GID]
    dropping.clear()
    assert g.leader == lead and g.raft.removed is None  # it knows nothing yet
    t0 = time.monotonic()
    # The group is named (found from outside: a drained node's metastore replica said
    # "this group" while the node still led the default group).
    with pytest.raises(NotAMember, match=f"node {fid} is not a member of group {GID} any"):
        node.propose(GID, encode_put(b"k", b"from the removed node")).result(TIMEOUT)
    assert time.monotonic() - t0 < 1.0
    assert node.call(lambda: g.raft.removed).result(5) is not None  # told
    with pytest.raises(NotAMember, match=f"of group {GID} any more"):
        node.propose(GID, encode_put(b"k", b"again")).result(1)
    assert nodes[lead].read(GID, lambda s: s.get(b"k")).result(5) == b"v"
