"""Regressions for defects found in review, each named after the rule it restores."""

from __future__ import annotations

import random

from conftest import MT, RowsHashed
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.records import VoteFloor
from raftkv.storage.state_store import MemoryStateStore

from raftkv.core import (
    ConfChange,
    ConfChangeOp,
    Config,
    Entry,
    EntryType,
    HardState,
    Message,
    Raft,
    Snapshot,
    SnapshotMeta,
    bootstrap,
)
from raftkv.node.group_storage import GroupStorage
from raftkv.testing.cluster import Cluster


def _grown_cluster() -> Cluster:
    """n1..n3 plus n4, added as a learner and promoted: config entries in the log."""
    c = Cluster(["n1", "n2", "n3"])
    c.elect("n1")
    c.add_empty_node("n4")
    c.raft("n1").propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n4"))
    c.stabilize()
    c.tick(n=3)
    assert c.raft("n1").conf.voters == {"n1", "n2", "n3", "n4"}
    return c


def test_restart_past_config_entries_reports_the_applied_config() -> None:
    """Config.applied may start the core after its config entries; conf_at() must
    still answer with the configuration in effect there, or compaction
    records a wrong membership in the snapshot (and a restart then uses it)."""
    c = _grown_cluster()
    store = c.nodes["n2"].storage
    commit = store.initial_state()[0].commit
    r = Raft(Config(id="n2", applied=commit), store, random.Random(1))
    assert not r.has_ready()  # an idle restart: advance() never runs to trim the history
    want = c.raft("n1").conf
    assert r.conf_at(commit) == want
    assert r.conf_at(commit + 1) is None  # beyond what the core has applied: unknown

    gs = GroupStorage(store, MemoryStateStore())
    gs.state.apply([(i, b"") for i in range(1, commit + 1)])
    gs.compaction = gs.compaction.__class__(max_entries=1, keep=0)
    assert gs.maybe_compact(r.conf_at) == commit
    again = Raft(Config(id="n2", applied=commit), store, random.Random(2))
    assert again.conf == want and store.snapshot().meta.conf == want


def test_malformed_peer_bytes_are_dropped_without_changing_the_log() -> None:
    """A garbage TIMEOUT_NOW context or configuration entry must neither escape step()
    nor leave the log half-updated (DESIGN: bad input never corrupts state)."""
    c = Cluster(["n1", "n2", "n3"])
    c.elect("n1")
    r = c.raft("n2")
    term, last = r.term, r.log.last_index()
    r.step(Message(MT.TIMEOUT_NOW, "n2", "n1", term, context=b"\x93\x01\x02\x03"))
    bad = Entry(term, last + 1, EntryType.CONF_CHANGE, b"\xc1 not msgpack")
    r.step(Message(MT.APP, "n2", "n1", term, log_term=r.log.last_term(), index=last,
                   entries=[bad], commit=r.log.committed))
    assert r.log.last_index() == last and r.term == term
    assert len(r.confs) == 1


def test_snapshot_fast_forward_claims_only_the_snapshot_index() -> None:
    """When the follower already holds the snapshot's last entry it commits to it, but
    must acknowledge only what the snapshot proves (etcd answers with the commit index)."""
    store = MemoryLogStore()
    store.save(HardState(2, None, 0), [Entry(1, i) for i in range(1, 11)])
    r = Raft(Config(id="n2"), store, random.Random(1))
    snap = Snapshot(SnapshotMeta(5, 1), b"")
    r.step(Message(MT.SNAPSHOT, "n2", "n1", 2, snapshot=snap))
    resp = r.msgs[-1]
    assert resp.type == MT.APP_RESP and resp.index == 5 and r.log.committed == 5


def test_truncated_tail_keeps_the_node_from_voting_until_caught_up() -> None:
    """Entries dropped at open may have been acknowledged: under a VoteFloor the node
    neither votes nor campaigns until its log is back to the old last index, or it has
    committed an entry of a newer term (records.VoteFloor explains why either suffices)."""
    store = MemoryLogStore()
    bootstrap(store, ["n1", "n2", "n3"])
    store.save(HardState(3, None, 4), [Entry(3, i) for i in range(2, 6)])
    r = Raft(Config(id="n2", vote_floor=VoteFloor(8, 3)), store, random.Random(1))
    assert not r.promotable()
    r.step(Message(MT.VOTE, "n2", "n3", 4, log_term=3, index=9))
    assert r.msgs[-1].reject
    # A leader of term 4 (elected without us) gets us to commit one of its entries.
    r.step(Message(MT.APP, "n2", "n3", 4, log_term=3, index=5,
                   entries=[Entry(4, 6)], commit=6))
    assert r.log.committed == 6 and r.promotable()
    r2 = Raft(Config(id="n2", vote_floor=VoteFloor(5, 3)), store, random.Random(1))
    r2.step(Message(MT.VOTE, "n2", "n3", 5, log_term=4, index=9))
    assert not r2.msgs[-1].reject  # the log already reaches the floor


def test_the_vote_floor_survives_a_second_crash(tmp_path) -> None:
    """The damaged tail is deleted at the first open, so the floor must be stored with
    the truncation, or a second restart would forget it; it clears durably."""
    from raftkv.storage.lmdb_log import LmdbLogStore
    from test_log_store import _flip_byte_of, _marked

    p = str(tmp_path / "log")
    s = LmdbLogStore(p)
    s.save(HardState(2, None, 3), _marked(1, 11))
    s.close()
    _flip_byte_of(p, b"<payload-000006>" * 4)
    assert LmdbLogStore(p).vote_floor() == VoteFloor(10, 2)
    s = LmdbLogStore(p)  # the second open finds an intact, shorter log
    assert s.vote_floor() == VoteFloor(10, 2) and s.last_index() == 5
    s.save(HardState(3, None, 6), [Entry(3, 6)])  # committed an entry of term 3 > 2
    assert s.vote_floor() is None
    s.close()
    assert LmdbLogStore(p).vote_floor() is None


def test_entries_of_unknown_type_from_a_peer_are_refused() -> None:
    """Only NORMAL and CONF_CHANGE exist; a type-2 entry carrying a config would change
    the running membership but not the one rebuilt on restart."""
    from raftkv.storage.records import ConfState

    from raftkv.core.membership import encode_conf_entry

    c = Cluster(["n1", "n2", "n3"])
    c.elect("n1")
    r = c.raft("n2")
    last, term = r.log.last_index(), r.term
    conf = ConfState(frozenset({"n1", "n2", "n3", "n9"}))
    odd = Entry(term, last + 1, 2, encode_conf_entry(None, conf))
    r.step(Message(MT.APP, "n2", "n1", term, log_term=r.log.last_term(), index=last,
                   entries=[odd], commit=r.log.committed))
    assert r.log.last_index() == last and "n9" not in r.conf.voters


def test_a_malformed_snapshot_image_is_refused_before_the_core_sees_it() -> None:
    """Every chunk, the order and the trailing digest are checked before the core may
    adopt the snapshot, and the image must reach the snapshot's index."""
    import msgpack

    donor = MemoryStateStore()
    donor.apply([(i, b"") for i in range(1, 10)])
    chunks = list(donor.snapshot_chunks())
    gs = GroupStorage(MemoryLogStore(), MemoryStateStore())

    def snap(image: object, index: int = 9) -> Message:
        data = msgpack.packb(image, use_bin_type=True)
        return Message(MT.SNAPSHOT, "n2", "n1", 3, snapshot=Snapshot(SnapshotMeta(index, 3), data))

    assert gs.accept(snap(chunks))
    assert not gs.accept(snap(chunks[:-1]))  # no trailer
    assert not gs.accept(snap([b"\x00garbage"]))
    assert not gs.accept(snap(chunks, index=12))  # image older than the snapshot
    assert not gs.accept(Message(MT.SNAPSHOT, "n2", "n1", 3,
                                 snapshot=Snapshot(SnapshotMeta(9, 3), b"junk")))
    assert gs.accept(Message(MT.HEARTBEAT, "n2", "n1", 3))


def test_an_accepted_image_is_installed_without_a_second_check_and_not_held_after(
    rows_hashed: RowsHashed,
) -> None:
    """accept() checks the image before the core may adopt it; the persist of the Ready
    that carries the same snapshot installs what was checked without hashing it again.
    An image whose snapshot the core did not take is dropped at the next persist, and a
    snapshot that was not the accepted one is checked in full."""
    import msgpack
    from raftkv.storage.commands import encode_put

    from raftkv.core import Ready

    donor = MemoryStateStore()
    donor.apply([(i, encode_put(b"k%d" % i, b"v")) for i in range(1, 10)])

    def image(index: int) -> Snapshot:
        data = msgpack.packb(list(donor.snapshot_chunks()), use_bin_type=True)
        return Snapshot(SnapshotMeta(index, 3), data)

    gs = GroupStorage(MemoryLogStore(), MemoryStateStore())
    first = image(9)
    rows_hashed.n = 0  # the donor's encoder hashes too
    assert gs.accept(Message(MT.SNAPSHOT, "n2", "n1", 3, snapshot=first))
    assert rows_hashed.n == 9
    gs.persist(Ready(snapshot=first, must_sync=True))
    assert rows_hashed.n == 9 and gs.state.applied_index() == 9
    assert state_of(gs.state) == state_of(donor)
    # Accepted, then not taken by the core: the next persist drops it, and the same
    # snapshot arriving in a later Ready is checked in full.
    donor.apply([(i, encode_put(b"k%d" % i, b"w")) for i in range(10, 13)])
    second = image(12)
    assert gs.accept(Message(MT.SNAPSHOT, "n2", "n1", 3, snapshot=second))
    gs.persist(Ready(must_sync=True))
    rows_hashed.n = 0
    gs.persist(Ready(snapshot=second, must_sync=True))
    assert rows_hashed.n == 12 and gs.state.applied_index() == 12
    assert state_of(gs.state) == state_of(donor)


def state_of(store: MemoryStateStore) -> dict[bytes, bytes | None]:
    return {b"k%d" % i: store.get(b"k%d" % i) for i in range(1, 13)}
