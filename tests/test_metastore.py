"""The metastore state machine (raftkv.placement): revisioned keys, conditional invoke and
its if/else tree, the watchable event history, and the StateStore contract (IGNITE-16907)
it keeps as the state machine of the metastore's Raft group.

The worked examples are seed 004's "Write new pending assignments (1)" and "changePeersAsync
done" invokes, and IGNITE-16668's switch.reduce retry loop, written with the builders.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raftkv.storage.commands import CommandError
from raftkv.storage.errors import Compacted, IndexMismatch, StorageError
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.records import Snapshot, SnapshotMeta
from raftkv.storage.state_store import SnapshotLoader, encode_snapshot

from raftkv.core import Message, MessageType
from raftkv.node.group_storage import GroupStorage, pack_image
from raftkv.placement.assignments import (
    DONE_RETRY,
    PENDING_WRITTEN,
    PLANNED_REMOVED,
    PLANNED_WRITTEN,
    SKIPPED,
    PartitionKeys,
    encode_nodes,
    partition_keys,
    write_pending_assignments,
)
from raftkv.placement.assignments import rebalance_done as done_tree
from raftkv.placement.meta_commands import (
    MAX_DEPTH,
    MAX_META_KEY_BYTES,
    MAX_META_VALUE_BYTES,
    BranchResult,
    Cond,
    Condition,
    Do,
    If,
    InvokeResult,
    Op,
    VersionedValue,
    WriteResult,
    decode,
    decode_revision,
    encode,
    encode_iif,
    encode_invoke,
    encode_put,
    encode_remove,
    encode_revision,
    restore_result,
    run,
)
from raftkv.placement.meta_rows import COMPACTED_ROW, REVISION_ROW, Event
from raftkv.placement.metastore import HistoryCompacted, MetaStore

MAP = 1 << 26  # 64 MiB of address space is plenty for tests


class Meta:
    """A MetaStore plus the log index it is at: ``run(cmd)`` applies one entry."""

    def __init__(self, path: Path | str, history: int = 100_000) -> None:
        self.path = path
        self.store = MetaStore(path, history=history, map_size=MAP)

    def run(self, *cmds: bytes) -> object:
        first = self.store.applied_index() + 1
        results = self.store.apply([(first + i, c) for i, c in enumerate(cmds)])
        return results[0] if len(results) == 1 else results

    def reopen(self) -> None:
        self.store.close()
        self.store = MetaStore(self.path, history=self.store.history, map_size=MAP)


@pytest.fixture
def meta(tmp_path: Path) -> Iterator[Meta]:
    m = Meta(tmp_path / "meta")
    yield m
    m.store.close()


def value_of(m: Meta, key: bytes) -> bytes | None:
    e = m.store.get_entry(key)
    return None if e is None else e.value


# -- conditions --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cond_store() -> Iterator[Meta]:
    """a = b"5" at revision 1, e = b"" at revision 2, z absent."""
    with tempfile.TemporaryDirectory() as d:
        m = Meta(d)
        m.run(encode_put(b"a", b"5"), encode_put(b"e", b""))
        yield m
        m.store.close()


_V = Cond.value
_R = Cond.revision
COND_CASES: list[tuple[str, Condition, bool]] = [
    # value: lexicographic bytes; an absent key is != everything and orders with nothing
    ("value eq", _V(b"a").eq(b"5"), True),
    ("value eq other", _V(b"a").eq(b"6"), False),
    ("value ne", _V(b"a").ne(b"6"), True),
    ("value ne same", _V(b"a").ne(b"5"), False),
    ("value lt", _V(b"a").lt(b"6"), True),
    ("value lt same", _V(b"a").lt(b"5"), False),
    ("value le same", _V(b"a").le(b"5"), True),
    ("value gt", _V(b"a").gt(b"4"), True),
    ("value gt longer", _V(b"a").gt(b"50"), False),
    ("value ge same", _V(b"a").ge(b"5"), True),
    ("value ge", _V(b"a").ge(b"6"), False),
    ("value eq empty value", _V(b"e").eq(b""), True),
    ("absent value eq", _V(b"z").eq(b""), False),
    ("absent value ne", _V(b"z").ne(b"x"), True),
    ("absent value lt", _V(b"z").lt(b"\xff"), False),
    ("absent value ge", _V(b"z").ge(b""), False),
    # revision: the key's mod_revision; an absent key is at revision 0 (etcd)
    ("revision eq", _R(b"a").eq(1), True),
    ("revision ne", _R(b"a").ne(1), False),
    ("revision lt", _R(b"a").lt(2), True),
    ("revision lt same", _R(b"a").lt(1), False),
    ("revision le", _R(b"a").le(1), True),
    ("revision gt", _R(b"e").gt(1), True),
    ("revision gt same", _R(b"e").gt(2), False),
    ("revision ge", _R(b"e").ge(2), True),
    ("absent revision eq 0", _R(b"z").eq(0), True),
    ("absent revision lt 1", _R(b"z").lt(1), True),
    # existence and emptiness (empty = absent or an empty value, seed 004's pending.empty())
    ("exists", Cond.exists(b"a"), True),
    ("exists empty value", Cond.exists(b"e"), True),
    ("exists absent", Cond.exists(b"z"), False),
    ("not exists absent", Cond.not_exists(b"z"), True),
    ("not exists", Cond.not_exists(b"a"), False),
    ("empty absent", Cond.empty(b"z"), True),
    ("empty empty value", Cond.empty(b"e"), True),
    ("empty value", Cond.empty(b"a"), False),
    ("not empty value", Cond.not_empty(b"a"), True),
    ("not empty empty value", Cond.not_empty(b"e"), False),
    ("not empty absent", Cond.not_empty(b"z"), False),
    # combinators
    ("and", Cond.exists(b"a") & Cond.empty(b"e"), True),
    ("and false", Cond.exists(b"a") & Cond.exists(b"z"), False),
    ("or", Cond.exists(b"z") | Cond.empty(b"e"), True),
    ("or false", Cond.exists(b"z") | Cond.not_empty(b"e"), False),
    ("all_of empty is true", Cond.all_of(), True),
    ("any_of empty is false", Cond.any_of(), False),
    ("nested", Cond.any_of(Cond.exists(b"z"), _V(b"a").eq(b"5") & _R(b"e").eq(2)), True),
]


@pytest.mark.parametrize(("name", "cond", "expected"), COND_CASES, ids=[c[0] for c in COND_CASES])
def test_invoke_condition_types(
    cond_store: Meta, name: str, cond: Condition, expected: bool
) -> None:
    before = cond_store.store.revision()
    result = cond_store.run(encode_invoke([cond], [], []))
    assert result == InvokeResult(expected, before)  # no ops: no revision change
    tree = cond_store.run(encode_iif(If(cond, Do(1), Do(2))))
    assert tree == BranchResult(1 if expected else 2, before)


def test_invoke_conditions_are_anded_and_read_the_state_before_the_ops(meta: Meta) -> None:
    meta.run(encode_put(b"k", b"v"))
    # The brief's example: every condition holds, so the success branch runs.
    ok = meta.run(
        encode_invoke(
            [Cond.value(b"k").eq(b"v"), Cond.revision(b"k").lt(5), Cond.exists(b"k")],
            [Op.put(b"k", b"w")],
            [Op.noop()],
        )
    )
    assert ok == InvokeResult(True, 2)
    # One false condition: the failure branch runs (and is a revision of its own).
    failed = meta.run(
        encode_invoke(
            [Cond.value(b"k").eq(b"w"), Cond.not_exists(b"k")],
            [Op.put(b"k", b"x")],
            [Op.put(b"failed", b"1")],
        )
    )
    assert failed == InvokeResult(False, 3)
    assert value_of(meta, b"k") == b"w" and value_of(meta, b"failed") == b"1"


# -- multi-key invoke and revisions ------------------------------------------------------------
def test_multi_key_invoke_is_one_revision_with_one_event_per_key(meta: Meta) -> None:
    meta.run(encode_put(b"a", b"1"), encode_put(b"b", b"2"))  # revisions 1, 2
    res = meta.run(
        encode_invoke(
            [Cond.revision(b"a").eq(1), Cond.revision(b"b").eq(2), Cond.not_exists(b"c")],
            [Op.put(b"c", b"3"), Op.remove(b"a"), Op.put(b"b", b"22")],
            [],
        )
    )
    assert res == InvokeResult(True, 3)
    assert meta.store.revision() == 3
    assert meta.store.events(b"", 3) == [  # in op order
        Event(3, b"c", b"3"),
        Event(3, b"a", None),
        Event(3, b"b", b"22"),
    ]
    assert meta.store.get_many([b"a", b"b", b"c"]) == [
        None,
        VersionedValue(b"22", 3, 2),
        VersionedValue(b"3", 3, 3),
    ]
    # A stale precondition on any one key fails the whole invoke atomically.
    res = meta.run(
        encode_invoke(
            [Cond.revision(b"b").eq(2), Cond.revision(b"c").eq(3)],
            [Op.put(b"b", b"x"), Op.put(b"c", b"y")],
        )
    )
    assert res == InvokeResult(False, 3)
    assert value_of(meta, b"b") == b"22" and value_of(meta, b"c") == b"3"


def test_revision_moves_by_one_per_command_that_produced_events(meta: Meta) -> None:
    s = meta.store
    assert s.revision() == 0
    assert meta.run(encode_put(b"k", b"v")) == WriteResult(True, 1)
    assert s.get_entry(b"k") == VersionedValue(b"v", 1, 1)
    # A put of the same value is still a change (etcd): mod_revision moves, watchers see it.
    assert meta.run(encode_put(b"k", b"v")) == WriteResult(True, 2)
    assert s.get_entry(b"k") == VersionedValue(b"v", 2, 1)  # create_revision stays
    # Nothing produced: no revision.
    assert meta.run(encode_remove(b"absent")) == WriteResult(False, 2)
    assert meta.run(encode_invoke([Cond.exists(b"absent")], [Op.put(b"x", b"1")])) == (
        InvokeResult(False, 2)
    )
    assert meta.run(encode_iif(Do(7, Op.noop()))) == BranchResult(7, 2)
    assert meta.run(encode_invoke([], [Op.remove(b"absent")], [])) == InvokeResult(True, 2)
    assert isinstance(meta.run(b"\xc1"), CommandError)
    assert meta.run(b"") is None  # a Raft no-op entry
    assert s.revision() == 2
    # A remove is a change; re-creating the key starts a new create_revision.
    assert meta.run(encode_remove(b"k")) == WriteResult(True, 3)
    assert meta.run(encode_put(b"k", b"again")) == WriteResult(True, 4)
    assert s.get_entry(b"k") == VersionedValue(b"again", 4, 4)
    assert s.applied_index() == 10
    # Every revision has its events, and nothing else does.
    assert [e.revision for e in s.events()] == [1, 2, 3, 4]


def test_range_returns_the_prefix_and_the_revision_it_was_read_at(meta: Meta) -> None:
    meta.run(encode_put(b"t/1/a", b"1"), encode_put(b"t/2/a", b"2"), encode_put(b"t/1/b", b"3"))
    r = meta.store.range(b"t/1/")
    assert r.revision == 3
    assert r.items == [
        (b"t/1/a", VersionedValue(b"1", 1, 1)),
        (b"t/1/b", VersionedValue(b"3", 3, 3)),
    ]
    assert [k for k, _ in meta.store.range().items] == [b"t/1/a", b"t/1/b", b"t/2/a"]
    assert meta.store.range(b"u").items == []
    assert meta.store.get_entry(b"") is None and meta.store.get_entry(b"x" * 600) is None


# -- seed 004: "Write new pending assignments (1)" ------------------------------------------------
def keys(part: bytes) -> PartitionKeys:
    table, p = part.decode().rsplit(".", 1)
    return partition_keys(table, int(p))


def nodes(*names: str) -> bytes:
    return encode_nodes(names)


def rebalance_done(meta: Meta, part: bytes, applied_peers: bytes) -> int:
    """Run onNewPeersConfigurationApplied's invoke, re-reading planned until the guard
    holds (the seeds' retry-on-changed-revision); returns the attempts it took."""
    for attempt in itertools.count(1):
        planned = meta.store.get_entry(keys(part).planned)
        res = meta.run(encode_iif(done_tree(keys(part), applied_peers, planned)))
        assert isinstance(res, BranchResult)
        if res.tag != DONE_RETRY:
            return attempt
    raise AssertionError("unreachable")


def assignments(
    meta: Meta, part: bytes
) -> tuple[bytes | None, bytes | None, bytes | None, int | None]:
    got = [None if e is None else e.value for e in meta.store.get_many(keys(part))]
    return got[0], got[1], got[2], None if got[3] is None else decode_revision(got[3])


def test_seed_004_write_new_pending_assignments(meta: Meta) -> None:
    p = b"t1.0"
    stable, _, _, trigger, *_ = keys(p)
    meta.run(encode_put(stable, nodes("A", "B", "C")))

    def on_replica_number_change(event_revision: int, calculated: bytes) -> int:
        res = meta.run(encode_iif(write_pending_assignments(keys(p), event_revision, calculated)))
        assert isinstance(res, BranchResult)
        return res.tag

    # No rebalance yet, and the new assignments differ from stable: write pending.
    abcd = nodes("A", "B", "C", "D")
    assert on_replica_number_change(10, abcd) == PENDING_WRITTEN
    assert assignments(meta, p) == (nodes("A", "B", "C"), abcd, None, 10)
    # The same event processed again (another node, a retry): the trigger makes it a no-op.
    rev = meta.store.revision()
    assert on_replica_number_change(10, abcd) == SKIPPED
    assert meta.store.revision() == rev
    # A newer event while that rebalance is pending: plan the next one.
    abd = nodes("A", "B", "D")
    assert on_replica_number_change(12, abd) == PLANNED_WRITTEN
    assert assignments(meta, p) == (nodes("A", "B", "C"), abcd, abd, 12)
    # An older event is skipped, whatever it computed.
    assert on_replica_number_change(11, nodes("X")) == SKIPPED
    # A newer event that computes the pending set again: the planned one is dropped.
    # (The seed's pseudocode leaves the trigger where it was on this branch.)
    assert on_replica_number_change(13, abcd) == PLANNED_REMOVED
    assert assignments(meta, p) == (nodes("A", "B", "C"), abcd, None, 12)

    # changePeers done: stable = applied peers, and with nothing planned, pending = empty.
    assert rebalance_done(meta, p, abcd) == 1
    assert assignments(meta, p) == (abcd, b"", None, 12)
    # pending now holds an *empty value*, which empty() accepts: a new event starts a rebalance.
    # 256 > 255 only numerically-as-bytes thanks to the fixed-width encoding.
    meta.run(encode_put(trigger, encode_revision(255)))
    assert on_replica_number_change(256, nodes("A", "B", "C")) == PENDING_WRITTEN
    assert assignments(meta, p) == (abcd, nodes("A", "B", "C"), None, 256)


def test_seed_004_rebalance_done_moves_planned_to_pending(meta: Meta) -> None:
    p = b"t1.1"
    stable = keys(p)[0]
    meta.run(encode_put(stable, nodes("A", "B", "C")))
    meta.run(encode_iif(write_pending_assignments(keys(p), 5, nodes("A", "B", "C", "D"))))
    meta.run(encode_iif(write_pending_assignments(keys(p), 6, nodes("A", "B", "D"))))
    assert rebalance_done(meta, p, nodes("A", "B", "C", "D")) == 1
    assert assignments(meta, p) == (nodes("A", "B", "C", "D"), nodes("A", "B", "D"), None, 6)


def test_seed_004_literal_pseudocode_plans_when_nothing_is_pending_and_stable_matches(
    meta: Meta,
) -> None:
    """A quirk of step (1) as written: with pending empty and stable == calculated, the else
    branch runs and, since empty pending != calculated, writes planned. (The seed's
    Approach 1 variant skips instead.) The builders reproduce the pseudocode exactly."""
    p = b"t1.2"
    stable, *_ = keys(p)
    meta.run(encode_put(stable, nodes("A", "B", "C")))
    res = meta.run(encode_iif(write_pending_assignments(keys(p), 3, nodes("A", "B", "C"))))
    assert res == BranchResult(PLANNED_WRITTEN, 2)
    assert assignments(meta, p)[2] == nodes("A", "B", "C")


def test_ignite_16668_switch_reduce_retry_loop(meta: Meta) -> None:
    """IGNITE-16668, "on in-memory partition restart": add the current node to
    assignments.switch.reduce in a retry loop guarded by empty() / the read revision.
    Two nodes read the same state; the slower one's invoke fails and it retries."""
    key = b"t1.p0.assignments.switch.reduce"

    def read() -> tuple[set[str], int | None]:
        cur = meta.store.get_entry(key)
        if cur is None or not cur.value:
            return set(), None
        return set(cur.value.decode().split(",")), cur.mod_revision

    def attempt(node: str, seen: tuple[set[str], int | None]) -> bool:
        members, rev = seen
        new = nodes(*(members | {node}))
        guard = Cond.empty(key) if rev is None else Cond.revision(key).eq(rev)
        res = meta.run(encode_invoke([guard], [Op.put(key, new)], []))
        assert isinstance(res, InvokeResult)
        return res.succeeded

    seen_by_c, seen_by_d = read(), read()
    assert attempt("C", seen_by_c)
    assert not attempt("D", seen_by_d)  # stale: C's write moved the key
    assert attempt("D", read())
    assert read()[0] == {"C", "D"}


# -- watches -----------------------------------------------------------------------------------
def test_watch_resumes_at_last_seen_revision_plus_one(meta: Meta) -> None:
    for i in range(5):
        meta.run(encode_put(b"w/%d" % i, b"v"), encode_put(b"other", b"%d" % i))
    s = meta.store
    seen = s.events(b"w/", 1)
    assert [e.revision for e in seen] == [1, 3, 5, 7, 9]
    meta.run(encode_put(b"w/9", b"x"), encode_remove(b"w/0"))
    rest = s.events(b"w/", seen[-1].revision + 1)
    assert rest == [Event(11, b"w/9", b"x"), Event(12, b"w/0", None)]
    # Asking ahead of the store (a lagging replica) yields nothing and keeps the position.
    assert s.read_events(b"w/", 50) == ([], 50)
    assert s.read_events(b"w/", 13) == ([], 13)


def test_watch_limit_never_splits_a_revision(meta: Meta) -> None:
    meta.run(encode_put(b"a", b"0"))
    meta.run(encode_invoke([], [Op.put(b"a", b"1"), Op.put(b"b", b"1"), Op.put(b"c", b"1")]))
    meta.run(encode_put(b"b", b"2"), encode_put(b"zz", b"-"), encode_put(b"c", b"3"))
    s = meta.store
    batch = s.read_events(b"", 1, limit=2)
    assert [e.revision for e in batch.events] == [1, 2, 2, 2]  # revision 2 whole
    assert batch.next_revision == 3
    # Paging with any limit reconstructs the full stream.
    everything = s.events()
    for limit in (1, 2, 3, 10):
        got: list[Event] = []
        nxt = 1
        while True:
            b = s.read_events(b"", nxt, limit)
            if not b.events:
                break
            got += b.events
            nxt = b.next_revision
        assert got == everything
    # A prefix filter skips other keys' revisions without ending the page early.
    assert s.read_events(b"c", 3, limit=1) == ([Event(5, b"c", b"3")], 6)


def test_history_retention_and_compacted(tmp_path: Path) -> None:
    m = Meta(tmp_path / "m", history=3)
    s = m.store
    for i in range(6):
        m.run(encode_put(b"k", b"%d" % i))
    assert s.revision() == 6 and s.compacted_revision() == 3
    assert [e.revision for e in s.events(b"", 4)] == [4, 5, 6]
    with pytest.raises(HistoryCompacted) as info:
        s.events(b"", 3)
    assert isinstance(info.value, Compacted)  # storage's named error
    assert info.value.from_revision == 3 and info.value.first_revision == 4
    # The recipe after Compacted: range() and watch from its revision + 1.
    r = s.range(b"k")
    assert r.items[0][1].value == b"5" and s.events(b"k", r.revision + 1) == []
    m.store.close()


def test_watch_events_continue_across_a_snapshot_install(tmp_path: Path) -> None:
    leader = Meta(tmp_path / "leader", history=8)
    for i in range(12):
        leader.run(encode_put(b"p/%d" % (i % 4), b"v%d" % i))
        if i % 3 == 0:
            leader.run(encode_invoke([], [Op.remove(b"p/%d" % (i % 4)), Op.put(b"x", b"%d" % i)]))
    watcher_saw = leader.store.events(b"p/", leader.store.compacted_revision() + 1)
    last_seen = watcher_saw[-3].revision  # the watcher is a little behind

    chunks = list(leader.store.snapshot_chunks(chunk_bytes=64))  # many small chunks
    assert len(chunks) > 5
    loader = SnapshotLoader(chunks)  # the shared format, as GroupStorage.accept checks it
    assert sum(1 for _ in loader.rows()) == loader.count and loader.verified
    follower = Meta(tmp_path / "follower", history=8)
    index = follower.store.install_snapshot(chunks)
    assert index == leader.store.applied_index() == follower.store.applied_index()
    assert follower.store.checkpoint_index() == index
    assert follower.store.digest() == leader.store.digest()
    assert follower.store.revision() == leader.store.revision()
    assert follower.store.range() == leader.store.range()

    # The watcher fails over to the follower and resumes exactly where it was.
    assert follower.store.events(b"p/", last_seen + 1) == watcher_saw[-2:]
    # Both apply the same new entries; the histories stay equal, the events continue.
    for m in (leader, follower):
        m.run(encode_put(b"p/new", b"1"), encode_remove(b"p/1"))
    assert follower.store.events(b"p/", last_seen + 1) == leader.store.events(b"p/", last_seen + 1)
    assert follower.store.digest() == leader.store.digest()
    # Replaying the snapshot's own entries is refused (IGNITE-16907).
    with pytest.raises(IndexMismatch):
        follower.store.apply([(index, encode_put(b"q", b"1"))])
    leader.store.close()
    follower.store.close()


def test_group_storage_accepts_a_metastore_image(meta: Meta) -> None:
    meta.run(encode_put(b"a", b"1"), encode_put(b"b", b"2"))
    image = pack_image(meta.store)
    gs = GroupStorage(MemoryLogStore(), meta.store)
    snap = Snapshot(SnapshotMeta(index=2, term=1), image)
    msg = Message(MessageType.SNAPSHOT, "n2", "n1", 1, snapshot=snap)
    assert gs.accept(msg)


def test_install_refuses_foreign_or_broken_images_and_keeps_the_state(
    meta: Meta, tmp_path: Path
) -> None:
    meta.run(encode_put(b"a", b"1"), encode_put(b"b", b"2"), encode_remove(b"a"))
    before = (meta.store.digest(), meta.store.applied_index(), meta.store.revision())
    rows = list(meta.store.scan())

    kv = LmdbStateStore(tmp_path / "kv", map_size=MAP)
    kv.apply([(1, b"\x93\x01\xc4\x01k\xc4\x01v")])  # a KV put
    kv_image = list(kv.snapshot_chunks())
    kv.close()

    def image(rs: list[tuple[bytes, bytes]], applied: int = 9) -> list[bytes]:
        return list(encode_snapshot(applied, len(rs), rs, 1 << 20))

    gap = [r for r in rows if r[0] != b"e/" + (2).to_bytes(8, "big") + (0).to_bytes(4, "big")]
    bad_record = [(k, msgpack.packb([b"1", 9, 1]) if k == b"k/b" else v) for k, v in rows]
    no_counters = [r for r in rows if r[0] not in (COMPACTED_ROW, REVISION_ROW)]
    short_history = [(k, (5).to_bytes(8, "big") if k == REVISION_ROW else v) for k, v in rows]
    for bad in (
        kv_image,
        image(gap),
        image(bad_record),
        image(no_counters),
        image(short_history),
        image(rows)[:-1],
    ):
        with pytest.raises(StorageError):
            meta.store.install_snapshot(bad)
        assert (meta.store.digest(), meta.store.applied_index(), meta.store.revision()) == before
    assert meta.store.install_snapshot(image(rows)) == 9  # the untouched rows are fine


# -- StateStore contract -----------------------------------------------------------------------
def test_restart_keeps_revision_history_and_applied_index(meta: Meta) -> None:
    meta.run(encode_put(b"a", b"1"), encode_put(b"b", b"2"))
    assert meta.store.checkpoint() == 2
    meta.run(encode_invoke([Cond.exists(b"a")], [Op.remove(b"a"), Op.put(b"c", b"3")]))
    digest, events = meta.store.digest(), meta.store.events()
    meta.reopen()
    s = meta.store
    assert s.applied_index() == s.checkpoint_index() == 3
    assert s.revision() == 3 and s.events() == events and s.digest() == digest
    assert s.get_entry(b"c") == VersionedValue(b"3", 3, 3)
    # Replay from the start of the log is refused; the driver skips to checkpoint + 1.
    with pytest.raises(IndexMismatch) as info:
        s.apply([(1, encode_put(b"x", b"1"))])
    assert info.value.checkpoint_index == 3
    assert meta.run(encode_put(b"d", b"4")) == WriteResult(True, 4)


def test_apply_index_errors_change_nothing(meta: Meta) -> None:
    meta.run(encode_put(b"a", b"1"), encode_put(b"b", b"2"), encode_put(b"c", b"3"))
    meta.store.checkpoint()
    meta.run(encode_put(b"d", b"4"))
    s = meta.store
    state = (s.digest(), s.applied_index(), s.revision())
    with pytest.raises(IndexMismatch):
        s.apply([(3, encode_put(b"x", b"1")), (4, b""), (5, b"")])
    for batch in (
        [(4, encode_put(b"x", b"1"))],  # double apply
        [(6, encode_put(b"x", b"1"))],  # gap
        [(5, encode_put(b"x", b"1")), (7, b"")],  # not contiguous
    ):
        with pytest.raises(StorageError):
            s.apply(batch)
    assert (s.digest(), s.applied_index(), s.revision()) == state
    assert s.apply([]) == []
    assert s.maybe_checkpoint(0.0) is False and s.maybe_checkpoint(5.0) is True
    assert s.checkpoint_index() == 4
    s.close()
    s.close()  # idempotent
    with pytest.raises(StorageError):
        s.revision()


def test_scan_get_and_digest_read_the_snapshot_rows(meta: Meta) -> None:
    meta.run(encode_put(b"a", b"1"), encode_put(b"bb", b"2"), encode_remove(b"a"))
    s = meta.store
    rows = list(s.scan())
    assert [k[:2] for k, _ in rows] == [b"c/", b"c/", b"e/", b"e/", b"e/", b"k/"]
    assert all(s.get(k) == v for k, v in rows)
    assert s.get(b"k/a") is None and s.get(b"zz") is None and s.get(b"e/") is None
    bounds = [
        None,
        b"",
        b"c",
        b"c/revision",
        b"e/",
        b"e/\x00",
        b"k",
        b"k/b",
        b"k/bb",
        b"k/bc",
        b"z",
        b"e/" + b"\xff" * 600,
    ]
    for lo in bounds:
        for hi in bounds:
            want = [(k, v) for k, v in rows if (lo is None or k >= lo) and (hi is None or k < hi)]
            assert list(s.scan(lo, hi)) == want, (lo, hi)
    snap_rows = list(SnapshotLoader(s.snapshot_chunks()).rows())
    assert snap_rows == rows
    assert s.digest(b"k/", b"k0") == (1, s.digest(keys=lambda k: k.startswith(b"k/")).digest)


# -- malformed commands ------------------------------------------------------------------------
def _p(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _deep(n: int) -> list[object]:
    c: list[object] = [3, b"k"]
    for _ in range(n):
        c = [7, [c]]
    return c


MALFORMED = [
    b"\xc1",  # never-used msgpack byte
    b"\x93\x01",  # truncated
    _p([1, b"k", b"v"]) + b"\x00",  # trailing bytes
    _p({"op": 1}),
    _p("put"),
    _p([]),
    _p([9, b"k"]),
    _p([True, b"k", b"v"]),  # bool is not an int
    _p([1, "k", b"v"]),  # str key
    _p([1, b"k"]),
    _p([1, b"", b"v"]),
    _p([1, b"k" * (MAX_META_KEY_BYTES + 1), b"v"]),
    _p([1, b"k", b"v" * (MAX_META_VALUE_BYTES + 1)]),
    _p([2, b"k", b"extra"]),
    _p([3, [[1, b"k", 7, b"v"]], [], []]),  # bad cmp
    _p([3, [[2, b"k", 1, -1]], [], []]),  # negative revision
    _p([3, [[2, b"k", 1, b"1"]], [], []]),  # revision as bytes
    _p([3, [[99, b"k"]], [], []]),  # unknown condition
    _p([3, [], [[1, b"k", b"1"], [2, b"k"]], []]),  # same key twice in a branch
    _p([3, [], [[3, b"k"]], []]),  # unknown op
    _p([3, [], []]),
    _p([4, [0, -1, []]]),  # negative tag
    _p([4, [1, [3, b"k"], [0, 1, []]]]),  # If without else
    _p([4, [2, [3, b"k"], [0, 1, []], [0, 2, []]]]),
    _p([3, [_deep(MAX_DEPTH + 1)], [], []]),
    b"[" * 5000,
]


def test_malformed_commands_are_results_not_exceptions(meta: Meta) -> None:
    meta.run(encode_put(b"k", b"v"))
    results = meta.store.apply([(2 + i, c) for i, c in enumerate(MALFORMED)])
    assert all(isinstance(r, CommandError) for r in results), results
    assert meta.store.revision() == 1
    assert meta.store.applied_index() == 1 + len(MALFORMED)
    assert meta.store.events() == [Event(1, b"k", b"v")]
    # The same bytes give the same verdict every time (deterministic skip).
    assert [str(r) for r in results] == [str(decode_error(c)) for c in MALFORMED]
    # At the limit of depth is fine.
    assert decode(_p([3, [_deep(MAX_DEPTH - 1)], [], []]))


def decode_error(data: bytes) -> CommandError:
    with pytest.raises(CommandError) as info:
        decode(data)
    return info.value


def test_encoders_refuse_what_decode_would_refuse() -> None:
    with pytest.raises(CommandError):
        encode_put(b"", b"v")
    with pytest.raises(CommandError):
        encode_put(b"k", "v")  # type: ignore[arg-type]
    with pytest.raises(CommandError):
        encode_invoke([Cond.exists(b"k")], [Op.put(b"a", b"1"), Op.remove(b"a")])
    with pytest.raises(CommandError):
        encode_iif(Do(-1))
    with pytest.raises(CommandError):
        encode_invoke(["not a condition"], [])  # type: ignore[list-item]
    with pytest.raises(CommandError):
        encode_revision(-1)
    tree = If(
        Cond.value(b"k").ge(b"1") | Cond.revision(b"k").le(3),
        Do(1, Op.put(b"k", b"v"), Op.noop()),
        If(Cond.not_empty(b"k"), Do(2), Do(3)),
    )
    assert decode(encode_iif(tree)) == If(tree.cond, Do(1, Op.put(b"k", b"v")), tree.otherwise)
    assert decode(encode(decode(encode_iif(tree)))) == decode(encode_iif(tree))


def test_results_survive_msgpack_via_restore_result(meta: Meta) -> None:
    """A proposal forwarded to the leader gets its result back through msgpack (a list)."""
    cmds = [
        encode_put(b"k", b"v"),
        encode_invoke([Cond.exists(b"k")], [Op.remove(b"k")]),
        encode_iif(If(Cond.exists(b"k"), Do(1), Do(2, Op.put(b"k", b"w")))),
    ]
    results = meta.run(*cmds)
    assert isinstance(results, list)
    wire = [msgpack.unpackb(msgpack.packb(r)) for r in results]
    assert [restore_result(c, w) for c, w in zip(cmds, wire, strict=True)] == [
        WriteResult(True, 1),
        InvokeResult(True, 2),
        BranchResult(2, 3),
    ]
    assert restore_result(b"\xc1", [1, 2]) == [1, 2]


# -- determinism (property) --------------------------------------------------------------------
KEYS = [b"a", b"b", b"p/1", b"p/2"]
VALUES = [b"", b"1", b"2", b"\xff"]
keys_st = st.sampled_from(KEYS)
values_st = st.sampled_from(VALUES)
leaf_conds = st.one_of(
    st.builds(
        lambda k, v, c: getattr(Cond.value(k), c)(v),
        keys_st,
        values_st,
        st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"]),
    ),
    st.builds(
        lambda k, r, c: getattr(Cond.revision(k), c)(r),
        keys_st,
        st.integers(0, 12),
        st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"]),
    ),
    st.builds(Cond.exists, keys_st),
    st.builds(Cond.not_exists, keys_st),
    st.builds(Cond.empty, keys_st),
    st.builds(Cond.not_empty, keys_st),
)
conds_st = st.recursive(
    leaf_conds,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda cs: Cond.all_of(*cs)),
        st.lists(inner, max_size=3).map(lambda cs: Cond.any_of(*cs)),
    ),
    max_leaves=5,
)
op_st = st.one_of(st.builds(Op.put, keys_st, values_st), st.builds(Op.remove, keys_st))


@st.composite
def ops_st(draw: st.DrawFn) -> list[Op]:
    ops = draw(st.lists(op_st, max_size=4))
    unique: dict[bytes, Op] = {}
    for op in ops:
        unique.setdefault(op.key, op)
    return list(unique.values())


branch_st = st.recursive(
    st.builds(lambda t, ops: Do(t, *ops), st.integers(0, 5), ops_st()),
    lambda inner: st.builds(If, conds_st, inner, inner),
    max_leaves=4,
)
command_st = st.one_of(
    st.builds(encode_put, keys_st, values_st),
    st.builds(encode_remove, keys_st),
    st.builds(encode_invoke, st.lists(conds_st, max_size=3), ops_st(), ops_st()),
    st.builds(encode_iif, branch_st),
    st.just(b""),
    st.binary(max_size=8),  # mostly malformed
)


class Model:
    """The data model in a few lines: dicts, the shared pure evaluator, no LMDB."""

    def __init__(self) -> None:
        self.kv: dict[bytes, VersionedValue] = {}
        self.revision = 0
        self.history: list[Event] = []

    def write(self, ops: list[Op]) -> tuple[bool, int]:
        rev, changed = self.revision + 1, False
        for op in ops:
            if op.value is not None:
                cur = self.kv.get(op.key)
                self.kv[op.key] = VersionedValue(
                    op.value, rev, rev if cur is None else cur.create_revision
                )
            elif self.kv.pop(op.key, None) is None:
                continue
            self.history.append(Event(rev, op.key, op.value))
            changed = True
        if changed:
            self.revision = rev
        return changed, self.revision

    def apply(self, data: bytes) -> object:
        if not data:
            return None
        try:
            cmd = decode(data)
        except CommandError as e:
            return e
        return run(cmd, self.kv.get, self.write)  # type: ignore[arg-type]


def _norm(results: list[object]) -> list[object]:
    return [repr(r) if isinstance(r, CommandError) else r for r in results]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cmds=st.lists(command_st, min_size=1, max_size=30),
    cuts_a=st.sets(st.integers(1, 29)),
    cuts_b=st.sets(st.integers(1, 29)),
    history=st.sampled_from([1, 3, 100]),
    snap_at=st.integers(0, 30),
)
def test_same_commands_any_batching_give_identical_stores(
    cmds: list[bytes], cuts_a: set[int], cuts_b: set[int], history: int, snap_at: int
) -> None:
    entries = [(i + 1, c) for i, c in enumerate(cmds)]

    def batches(cuts: set[int]) -> list[list[tuple[int, bytes]]]:
        edges = [0, *sorted(c for c in cuts if c < len(entries)), len(entries)]
        return [entries[a:b] for a, b in itertools.pairwise(edges) if b > a]

    model = Model()
    expected = _norm([model.apply(c) for c in cmds])
    with tempfile.TemporaryDirectory() as d:
        a = MetaStore(Path(d) / "a", history=history, map_size=MAP)
        b = MetaStore(Path(d) / "b", history=history, map_size=MAP)
        c = MetaStore(Path(d) / "c", history=history, map_size=MAP)
        try:
            results_a = [r for batch in batches(cuts_a) for r in a.apply(batch)]
            results_b = [r for batch in batches(cuts_b) for r in b.apply(batch)]
            assert _norm(results_a) == _norm(results_b) == expected
            # c: a follower that installs a's image taken part-way, then applies the rest.
            snap_at = min(snap_at, len(entries))
            with tempfile.TemporaryDirectory() as d2:
                src = MetaStore(Path(d2) / "src", history=history, map_size=MAP)
                if snap_at:
                    src.apply(entries[:snap_at])
                c.install_snapshot(list(src.snapshot_chunks(chunk_bytes=32)))
                src.close()
            if snap_at < len(entries):
                c.apply(entries[snap_at:])

            assert a.digest() == b.digest() == c.digest()
            assert list(a.scan()) == list(b.scan()) == list(c.scan())
            assert a.revision() == b.revision() == c.revision() == model.revision
            assert a.compacted_revision() == max(0, model.revision - history)
            first = a.compacted_revision() + 1
            retained = [e for e in model.history if e.revision >= first]
            assert a.events(b"", first) == b.events(b"", first) == c.events(b"", first) == retained
            assert a.events(b"p/", first) == [e for e in retained if e.key.startswith(b"p/")]
            assert dict(a.range().items) == model.kv
        finally:
            for s in (a, b, c):
                s.close()


def test_rendezvous_assignments_are_stable_and_move_little_when_a_node_joins() -> None:
    """Assignments are a pure function of (table, partition, nodes, replicas); a fourth
    node takes over roughly a quarter of the replicas and nothing else moves."""
    from raftkv.placement.assignments import calc_assignments, partition_of

    three = {p: calc_assignments("t", p, ["n1", "n2", "n3"], 3) for p in range(64)}
    assert all(v == ["n1", "n2", "n3"] for v in three.values())
    four = {p: calc_assignments("t", p, ["n4", "n3", "n2", "n1"], 3) for p in range(64)}
    assert four == {p: calc_assignments("t", p, ["n1", "n2", "n3", "n4"], 3) for p in range(64)}
    moved = sum(1 for p in range(64) if "n4" in four[p])
    assert 32 <= moved <= 64  # n4 should hold ~3/4 of partitions' replica sets
    assert all(len(set(v)) == 3 for v in four.values())
    counts = [0] * 16
    for i in range(16000):
        counts[partition_of(b"key-%d" % i, 16)] += 1
    assert min(counts) > 800 and partition_of(b"x", 16) == partition_of(b"x", 16)
