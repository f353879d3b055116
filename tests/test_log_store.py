"""The LogStorage contract (storage/log_store.py), checked against both stores, and the
LMDB store's crash-safety and corruption handling on real files."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import zlib
from collections.abc import Callable

import pytest
from raftkv.storage.errors import Compacted, CorruptLog, StorageError, Unavailable
from raftkv.storage.lmdb_log import RECENT_BYTES, LmdbLogStore, LogEnv
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.records import ConfState, Entry, EntryType, HardState, Snapshot, SnapshotMeta

from raftkv.core import ConfChange, ConfChangeOp, Config, Raft, bootstrap
from raftkv.core.membership import encode_conf_entry

V3 = ConfState(frozenset({"n1", "n2", "n3"}))


def ents(lo: int, hi: int, term: int = 1, size: int = 10) -> list[Entry]:
    return [Entry(term, i, EntryType.NORMAL, bytes([i % 251]) * size) for i in range(lo, hi)]


@pytest.fixture(params=["memory", "lmdb", "shared"])
def make_store(request: pytest.FixtureRequest, tmp_path) -> Callable[[], object]:
    if request.param == "memory":
        return MemoryLogStore
    if request.param == "lmdb":
        return lambda: LmdbLogStore(str(tmp_path / "log"))
    # Group t.b's log in a shared environment, between neighbours on both sides of its
    # key range (t.a and t.c sort around it, t.bb after all three-byte ids): every
    # contract test then also checks that no read or write crosses into them.
    env = LogEnv(str(tmp_path / "shared"), shared=True)

    def check_and_close() -> None:
        _neighbours_intact(env)
        env.close()

    request.addfinalizer(check_and_close)
    for g in NEIGHBOURS:
        n = env.store(g)
        n.save(HardState(1, None, 3), ents(1, 4, size=3))
        n.close()
    return lambda: env.store("t.b")


NEIGHBOURS = ("t.a", "t.c", "t.bb")


# -------------------------------------------------------------------- contract ------
def test_empty_store_has_no_entries(make_store) -> None:
    s = make_store()
    assert (s.first_index(), s.last_index(), s.term(0)) == (1, 0, 0)
    with pytest.raises(Unavailable):
        s.term(1)
    assert s.initial_state() == (HardState(), ConfState())


def test_ranges_are_half_open_and_bounded_by_named_errors(make_store) -> None:
    s = make_store()
    s.save(HardState(1, "n1", 0), ents(1, 11))
    assert [e.index for e in s.entries(3, 6)] == [3, 4, 5]
    assert s.entries(3, 6)[0] == ents(3, 4)[0]
    assert s.term(10) == 1
    with pytest.raises(Unavailable):
        s.entries(5, 12)
    assert len(s.entries(1, 11, max_bytes=60)) == 2  # 26 bytes each, at least one always
    assert len(s.entries(1, 11, max_bytes=1)) == 1


def test_append_replaces_the_suffix_from_its_first_index(make_store) -> None:
    """§5.3: the core decided to overwrite; the store drops the old suffix."""
    s = make_store()
    s.save(None, ents(1, 11, term=1))
    s.save(None, ents(6, 8, term=2))
    assert s.last_index() == 7
    assert [s.term(i) for i in range(1, 8)] == [1] * 5 + [2, 2]


def test_append_with_a_gap_is_refused_and_changes_nothing(make_store) -> None:
    s = make_store()
    s.save(None, ents(1, 4))
    with pytest.raises(StorageError, match="gap"):
        s.save(HardState(9, None, 0), ents(6, 8))
    assert s.last_index() == 3


def test_one_sync_per_saved_batch(make_store) -> None:
    """Group commit: a Ready batch of any size is one save (one fsync on LMDB)."""
    s = make_store()
    s.save(HardState(1, None, 0), ents(1, 1001))
    s.save(HardState(1, None, 1000), [])
    assert s.syncs == 2


def test_a_commit_only_save_without_sync_rides_with_the_next_write(make_store) -> None:
    """etcd's MustSync: a Ready that only moves the commit index is not synced; the
    store reports it at once and writes it with its next batch."""
    s = make_store()
    s.save(HardState(1, "n1", 0), ents(1, 11))
    s.save(HardState(1, "n1", 10), [], sync=False)
    assert s.syncs == 1
    assert s.initial_state()[0] == HardState(1, "n1", 10)
    s.save(None, ents(11, 12))
    assert s.syncs == 2 and s.initial_state()[0].commit == 10


def test_memory_crash_forgets_only_an_unsynced_commit() -> None:
    s = MemoryLogStore()
    s.save(HardState(2, "n2", 3), ents(1, 6, term=2))
    s.save(HardState(2, "n2", 5), [], sync=False)
    s.crash()
    assert s.initial_state()[0] == HardState(2, "n2", 3)
    assert s.last_index() == 5
    s.save(HardState(2, "n2", 5), [], sync=False)
    s.create_snapshot(4, V3, b"")  # a snapshot never lands ahead of the persisted commit
    s.crash()
    assert s.initial_state()[0].commit == 5


_UNSYNCED_THEN_KILLED = """
import os, sys
from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
from raftkv.storage.records import Entry, HardState
s = LmdbLogStore(sys.argv[1])
s.save(HardState(3, "n1", 2), [Entry(3, i, 0, b"x") for i in range(1, 6)])
s.save(HardState(3, "n1", 5), [], sync=False)
if sys.argv[2] == "compact":
    s.create_snapshot(4, s.initial_state()[1])
os._exit(0)  # no close: what a SIGKILL leaves
"""


@pytest.mark.parametrize("then", ["exit", "compact"])
def test_lmdb_unsynced_commit_is_lost_by_a_crash_unless_a_write_carried_it(
        tmp_path, then: str) -> None:
    import subprocess
    import sys

    p = str(tmp_path / "log")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", _UNSYNCED_THEN_KILLED, p, then], check=True,
                   cwd=root)
    s = LmdbLogStore(p)
    assert s.initial_state()[0] == HardState(3, "n1", 2 if then == "exit" else 5)
    assert s.last_index() == 5
    s.save(HardState(3, "n1", 5), [], sync=False)
    s.close()  # close writes what is pending
    s = LmdbLogStore(p)
    assert s.initial_state()[0].commit == 5
    s.close()


def test_conf_entries_are_found_without_a_scan(make_store) -> None:
    s = make_store()
    conf = ConfState(frozenset({"n1"}), frozenset({"n2"}), frozenset({"n2"}))
    cc = Entry(1, 5, EntryType.CONF_CHANGE,
               encode_conf_entry(ConfChange(ConfChangeOp.ADD_LEARNER, "n2"), conf))
    s.save(None, ents(1, 5) + [cc] + ents(6, 9))
    assert s.conf_entries(1) == [cc]
    s.save(None, ents(5, 6, term=2))  # the conf entry is truncated away
    assert s.conf_entries(1) == []


def test_payloads_are_what_a_state_store_applies(make_store) -> None:
    s = make_store()
    conf = Entry(1, 3, EntryType.CONF_CHANGE, b"membership")
    s.save(None, ents(1, 3) + [conf] + ents(4, 6))
    assert s.payloads(2, 5) == [(2, ents(2, 3)[0].data), (3, b""), (4, ents(4, 5)[0].data)]
    with pytest.raises(Unavailable):
        s.payloads(4, 7)


def test_snapshot_then_compaction_keeps_the_boundary_term(make_store) -> None:
    s = make_store()
    s.save(HardState(1, None, 20), ents(1, 21))
    s.create_snapshot(15, V3, b"")
    s.compact(12)  # keep a few entries below the snapshot for slow followers
    assert s.first_index() == 13 and s.term(12) == 1
    with pytest.raises(Compacted):
        s.entries(12, 14)
    with pytest.raises(StorageError):
        s.compact(18)  # beyond the snapshot
    assert s.snapshot().meta == SnapshotMeta(15, 1, V3)


def test_installing_a_snapshot_replaces_the_log(make_store) -> None:
    s = make_store()
    s.save(None, ents(1, 6))
    s.save(HardState(3, None, 50), [], Snapshot(SnapshotMeta(50, 3, V3), b""))
    assert (s.first_index(), s.last_index(), s.term(50)) == (51, 50, 3)
    s.save(None, ents(51, 53, term=3))
    assert s.last_index() == 52
    assert s.initial_state()[1] == V3


@pytest.mark.parametrize("seed", range(6))
def test_reads_agree_with_the_reference_store_through_truncation_snapshots_and_compaction(
    make_store, seed: int
) -> None:
    """The LMDB store answers recent reads from memory ("Recent entries" in
    storage/lmdb_log.py): after any mix of appends (overwriting suffixes under newer
    terms), large entries that push older ones out, snapshots, installs and compaction,
    every term and entry it reports equals the in-memory reference store's."""
    rng = random.Random(seed)
    s, ref = make_store(), MemoryLogStore()
    term = 1

    def check() -> None:
        first, last = ref.first_index(), ref.last_index()
        assert (s.first_index(), s.last_index()) == (first, last)
        for i in range(first - 1, last + 1):
            assert s.term(i) == ref.term(i), i
        for _ in range(5):
            lo = rng.randint(first, last + 1)
            hi = rng.randint(lo, last + 1)
            budget = rng.choice([None, 1, 200, 5000])
            assert s.entries(lo, hi, budget) == ref.entries(lo, hi, budget), (lo, hi, budget)

    for _ in range(60):
        op = rng.random()
        first, last = ref.first_index(), ref.last_index()
        if op < 0.6 or last < first:
            # Append, often overwriting a suffix (a new leader's entries) in a newer term.
            at = rng.randint(max(first, last - 3), last + 1)
            if at <= last:
                term += 1
            size = rng.choice([10, 10, 10, 100 << 10])  # big ones overflow the cache
            batch = [Entry(term, i, EntryType.NORMAL, bytes([i % 251]) * size)
                     for i in range(at, at + rng.randint(1, 4))]
            for st in (s, ref):
                st.save(HardState(term, None, 0), batch)
        elif op < 0.75:
            index = rng.randint(first, last)
            snap_index = ref.snapshot().meta.index if _has_snapshot(ref) else 0
            if index > snap_index:
                for st in (s, ref):
                    st.create_snapshot(index, V3, b"")
                keep = rng.randint(first - 1, index)
                for st in (s, ref):
                    st.compact(keep)
        elif op < 0.85:
            index = last + rng.randint(1, 5)
            term += 1
            for st in (s, ref):
                st.save(HardState(term, None, index), [],
                        Snapshot(SnapshotMeta(index, term, V3), b""))
        check()


def test_lmdb_recent_entries_are_bounded_even_when_empty(tmp_path) -> None:
    """The cache's bound counts Python's own cost per entry, so thousands of empty
    entries (a leader's no-ops, say) cannot grow it without limit."""
    s = LmdbLogStore(str(tmp_path / "log"))
    for lo in range(1, 20_001, 1000):
        s.save(None, ents(lo, lo + 1000, size=0))
    assert s._recent_bytes <= RECENT_BYTES
    assert 0 < len(s._recent) < 20_000 and s._recent[-1].index == 20_000
    assert s.entries(19_990, 20_001) == ents(19_990, 20_001, size=0)
    s.close()


def test_lmdb_a_byte_budget_reads_only_the_entries_it_can_hold(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found from outside: a leader sending a wiped follower a log of 2 MB entries read
    and checksummed a window of 64 of them (128 MB) for each append, which carries one;
    its loop fell behind its heartbeats and the other follower deposed it, 7 times in 7
    s, the new leader in turn. A budgeted read now stops at the first entry past the
    budget."""
    s = LmdbLogStore(str(tmp_path / "log"))
    big = ents(1, 101, size=200_000)  # 20 MB: far past the recent-entries cache
    for lo in range(0, 100, 10):
        s.save(None, big[lo:lo + 10])
    read: list[int] = []
    crc32 = zlib.crc32

    def counted(data: bytes, value: int = 0) -> int:
        if len(data) > 1000:
            read.append(len(data))  # an entry's body checksummed: it was read
        return crc32(data, value)

    monkeypatch.setattr(zlib, "crc32", counted)
    assert s.entries(1, 101, max_bytes=1 << 20) == big[:5]
    assert len(read) == 6  # the sixth passed the budget and was left out
    read.clear()
    assert s.entries(40, 101, max_bytes=1) == big[39:40]  # at least one, as etcd
    assert len(read) == 1
    read.clear()
    assert s.entries(1, 101) == big  # no budget: the whole range
    assert len(read) == 100
    s.close()


def _has_snapshot(store: MemoryLogStore) -> bool:
    try:
        store.snapshot()
    except Exception:  # noqa: BLE001  # SnapshotUnavailable: none taken yet
        return False
    return True


# ------------------------------------------------------------------ LMDB only ------
def test_lmdb_everything_survives_reopen(tmp_path) -> None:
    p = str(tmp_path / "log")
    s = LmdbLogStore(p)
    s.save(HardState(4, "n2", 8), ents(1, 11, term=4))
    s.create_snapshot(5, V3)
    s.compact(3)
    s.close()
    s = LmdbLogStore(p)
    assert s.initial_state() == (HardState(4, "n2", 8), V3)
    assert (s.first_index(), s.last_index(), s.term(3)) == (4, 10, 4)
    assert s.entries(4, 11) == ents(4, 11, term=4)
    assert s.open_report.truncated_from == 0
    assert s.durable


def test_lmdb_durability_off_is_reported(tmp_path, caplog) -> None:
    assert not LmdbLogStore(str(tmp_path / "log"), durable=False).durable
    assert "durability is OFF" in caplog.text


# ------------------------------------------------------------ shared environment ------
def _neighbours_intact(env: LogEnv) -> None:
    for g in NEIGHBOURS:
        n = env.store(g)
        assert (n.first_index(), n.last_index()) == (1, 3)
        assert n.entries(1, 4) == ents(1, 4, size=3)
        n.close()


def test_shared_save_many_is_one_transaction_for_every_group(tmp_path) -> None:
    env = LogEnv(str(tmp_path / "shared"), shared=True)
    stores = [env.store(f"t.x.{p}") for p in range(16)]
    before = env.env.info()["last_txnid"]
    env.save_many([(st, HardState(1, "n1", 0), ents(1, 3 + p), None)
                   for p, st in enumerate(stores)])
    assert env.env.info()["last_txnid"] == before + 1  # one commit: one fsync
    stores[3].save(HardState(1, "n1", 5), [], sync=False)  # rides with the next batch
    env.save_many([(stores[3], None, ents(6, 7), None), (stores[4], None, ents(7, 8), None)])
    for st in stores:
        st.close()
    env.close()
    env = LogEnv(str(tmp_path / "shared"), shared=True)
    assert env.groups() == {f"t.x.{p}" for p in range(16)}
    for p in range(16):
        st = env.store(f"t.x.{p}")
        last = {3: 6, 4: 7}.get(p, 2 + p)
        assert st.last_index() == last and st.entries(1, last + 1)[0] == ents(1, 2)[0]
        assert st.initial_state()[0].commit == (5 if p == 3 else 0)
        st.close()
    env.close()


def test_shared_drop_deletes_one_group_and_only_when_closed(tmp_path) -> None:
    env = LogEnv(str(tmp_path / "shared"), shared=True)
    for g in NEIGHBOURS + ("t.b",):
        st = env.store(g)
        st.save(HardState(1, None, 3), ents(1, 4, size=3))
        st.create_snapshot(2, V3)
        st.compact(1)
        if g != "t.b":
            st.close()
    with pytest.raises(StorageError, match="already open"):
        env.store("t.b")
    with pytest.raises(StorageError, match="while it is open"):
        env.drop("t.b")
    st.close()
    env.drop("t.b")
    assert env.groups() == set(NEIGHBOURS)
    fresh = env.store("t.b")  # a group dropped and hosted again starts empty
    assert (fresh.last_index(), fresh.initial_state()[0]) == (0, HardState())
    fresh.close()
    for g in NEIGHBOURS:  # compacted to 1 above; the rest untouched
        n = env.store(g)
        assert (n.first_index(), n.last_index(), n.term(1)) == (2, 3, 1)
        n.close()
    env.close()


def test_snapshot_install_and_truncation_stay_inside_the_group(make_store) -> None:
    s = make_store()
    s.save(HardState(1, None, 2), ents(1, 10))
    s.save(None, ents(5, 7, term=2))  # suffix replaced from 5
    assert s.last_index() == 6
    s.save(HardState(3, None, 20), [], Snapshot(SnapshotMeta(20, 3, V3)))
    assert (s.first_index(), s.last_index()) == (21, 20)
    if isinstance(s, LmdbLogStore):
        s.close()
        if s.env.shared:
            _neighbours_intact(s.env)


def test_shared_corruption_names_the_group(tmp_path) -> None:
    path = str(tmp_path / "shared")
    env = LogEnv(path, shared=True)
    a, b = env.store("t.a"), env.store("t.b")
    env.save_many([(a, HardState(1, None, 20), _marked(1, 21), None),
                   (b, HardState(1, None, 5), [Entry(1, i, EntryType.NORMAL, b"b" * 40)
                                                for i in range(1, 9)], None)])
    a.close()
    b.close()
    env.close()
    _flip_byte_of(path, b"<payload-000012>" * 4)
    env = LogEnv(path, shared=True)
    with pytest.raises(CorruptLog, match=r"group t\.a\): entry 12 fails its checksum"):
        env.store("t.a", verify_from=1)
    b = env.store("t.b")  # the other group opens and reads as before
    assert b.last_index() == 8 and b.open_report.truncated_from == 0
    b.close()
    env.close()


def test_a_partition_log_of_its_own_is_moved_into_the_shared_environment(tmp_path) -> None:
    """A data directory from before logs were shared: the partition's log is adopted
    (entries, confs, hard state, snapshot), its directory deleted, and a damaged
    entry stays damaged rather than being re-checksummed into a valid one."""
    from raftkv.storage.layout import group_paths, partition_logs_path

    from raftkv.node.stores import open_group_storage

    data = str(tmp_path / "node")
    log_path = group_paths(data, "t.x.0")[0]
    own = LmdbLogStore(log_path)
    marked = _marked(1, 7)
    marked[2] = Entry(1, 3, EntryType.CONF_CHANGE, marked[2].data)
    own.save(HardState(1, "n1", 5), marked)
    own.create_snapshot(2, V3)  # writes only the meta database: one copy of each entry
    own.close()
    _flip_byte_of(log_path, b"<payload-000006>" * 4)  # the uncommitted tail
    env = LogEnv(partition_logs_path(data), shared=True)
    gs = open_group_storage(data, "t.x.0", shared_log=env)
    st = gs.log
    assert isinstance(st, LmdbLogStore) and st.env is env
    assert not os.path.exists(log_path)
    assert st.initial_state() == (HardState(1, "n1", 5), V3)
    assert st.open_report.truncated_from == 6  # detected, not laundered
    assert (st.first_index(), st.last_index(), st.snapshot().index) == (1, 5, 2)
    assert st.entries(1, 6) == marked[:5]
    assert [e.index for e in st.conf_entries(1)] == [3]
    gs.state.close()
    st.close()
    env.close()


def test_closing_a_store_twice_does_not_close_the_environment_under_others(tmp_path) -> None:
    """A failed driver loop closes every store, and stop() closes them again."""
    env = LogEnv(str(tmp_path / "shared"), shared=True)
    a, b = env.store("t.a"), env.store("t.b")
    a.close()
    a.close()
    env.close()
    b.save(HardState(1, None, 0), ents(1, 3))  # still open: b holds the last reference
    b.close()
    b.close()
    env.close()  # already closed: nothing to do
    with pytest.raises(StorageError, match="closed"):
        env.store("t.c")


def test_a_group_id_that_cannot_be_a_prefix_is_refused(tmp_path) -> None:
    env = LogEnv(str(tmp_path / "shared"), shared=True)
    with pytest.raises(StorageError, match="1..255 bytes"):
        env.store("x" * 300)
    solo = LmdbLogStore(str(tmp_path / "solo"))
    with pytest.raises(StorageError, match="not shared"):
        solo.env.store("t.a")
    solo.close()
    env.close()


def _flip_byte_of(path: str, needle: bytes) -> None:
    """Corrupt the entry whose payload is ``needle`` in place, as bit rot would."""
    data_file = os.path.join(path, "data.mdb")
    with open(data_file, "r+b") as f:
        blob = f.read()
        at = blob.find(needle)
        assert at >= 0, "payload not found in the file"
        f.seek(at + len(needle) // 2)
        f.write(bytes([blob[at + len(needle) // 2] ^ 0xFF]))


def _marked(lo: int, hi: int) -> list[Entry]:
    return [Entry(1, i, EntryType.NORMAL, f"<payload-{i:06d}>".encode() * 4) for i in range(lo, hi)]


def test_lmdb_corrupt_uncommitted_tail_is_reported_and_truncated(tmp_path) -> None:
    p = str(tmp_path / "log")
    s = LmdbLogStore(p)
    s.save(HardState(1, None, 10), _marked(1, 21))
    s.close()
    _flip_byte_of(p, b"<payload-000015>" * 4)
    s = LmdbLogStore(p)
    r = s.open_report
    assert (r.truncated_from, r.truncated_entries, s.last_index()) == (15, 6, 14)
    assert "entry 15 fails its checksum" in r.reason and "data.mdb" in r.reason
    assert s.entries(1, 15) == _marked(1, 15)


def test_lmdb_recent_entries_come_from_memory_and_damage_is_still_found_on_open(
    tmp_path,
) -> None:
    """Entries just saved are read back from memory (no transaction, no checksum): the
    bytes the caller handed over, even if the file is damaged meanwhile. The damage is
    still found where it matters, when the file is read: here on reopening."""
    p = str(tmp_path / "log")
    s = LmdbLogStore(p)
    s.save(HardState(1, None, 10), _marked(1, 21))
    _flip_byte_of(p, b"<payload-000015>" * 4)
    assert s.entries(11, 21) == _marked(11, 21) and s.term(15) == 1
    s.close()
    s = LmdbLogStore(p)
    assert s.open_report.truncated_from == 15
    s.close()


def _committed_log_with_bad(tmp_path, index: int) -> str:
    """A log of entries 1..20, all committed, with entry ``index`` damaged on disk."""
    p = str(tmp_path / "log")
    s = LmdbLogStore(p)
    s.save(HardState(1, None, 20), _marked(1, 21))
    s.close()
    _flip_byte_of(p, f"<payload-{index:06d}>".encode() * 4)
    return p


def test_lmdb_corruption_below_commit_refuses_to_open(tmp_path) -> None:
    p = _committed_log_with_bad(tmp_path, 12)
    with pytest.raises(CorruptLog, match=r"entry 12 fails its checksum.*commit index 20"):
        LmdbLogStore(p, verify_from=11)
    # Entries below where verification starts are checked when read: never served.
    s = LmdbLogStore(p)
    with pytest.raises(CorruptLog, match="entry 12"):
        s.entries(10, 14)
    with pytest.raises(CorruptLog, match="entry 12"):
        s.payloads(1, 21)  # replay's read path checks too
    with pytest.raises(CorruptLog, match="entry 12"):
        s.term(12)  # and so do term lookups (log matching must not use a bad term)


def test_lmdb_a_bad_last_entry_at_the_commit_index_refuses_to_open(tmp_path) -> None:
    """Everything committed and the state store checkpointed there: no replay reads the
    last entry, but the core reads its term at once. Found from outside: the store
    opened, and the node's loop died at its first campaign on the checksum error."""
    p = _committed_log_with_bad(tmp_path, 20)
    with pytest.raises(CorruptLog, match=r"entry 20 fails its checksum.*commit index 20"):
        LmdbLogStore(p)


def test_lmdb_truncated_file_is_refused_without_crashing(tmp_path) -> None:
    p = str(tmp_path / "log")
    s = LmdbLogStore(p)
    s.save(HardState(1, None, 0), ents(1, 5001, size=100))
    s.close()
    data_file = os.path.join(p, "data.mdb")
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    with pytest.raises(CorruptLog, match="truncated"):
        LmdbLogStore(p)


def test_lmdb_garbage_file_is_refused_clearly(tmp_path) -> None:
    p = tmp_path / "log"
    p.mkdir()
    (p / "data.mdb").write_bytes(random.Random(1).randbytes(64 * 1024))
    with pytest.raises(CorruptLog, match="not an LMDB file"):
        LmdbLogStore(str(p))


def test_core_restarts_from_the_lmdb_log(tmp_path) -> None:
    """The core runs on the LMDB store: hard state, log and membership come back."""
    p = str(tmp_path / "log")
    store = LmdbLogStore(p)
    bootstrap(store, ["n1"])
    raft = Raft(Config(id="n1"), store, random.Random(1))
    raft.campaign()
    for i in range(10):
        raft.propose(b"cmd%d" % i)
    applied = []
    while raft.has_ready():
        rd = raft.ready()
        store.save(rd.hard_state, rd.entries, rd.snapshot)
        applied += [e.index for e in rd.committed_entries]
        raft.advance(rd)
    assert applied == list(range(1, 13))
    term = raft.term
    store.close()
    store = LmdbLogStore(p)
    again = Raft(Config(id="n1"), store, random.Random(2))
    assert (again.term, again.log.committed, again.conf.voters) == (term, 12, {"n1"})
    assert again.log.entries(3, 4)[0].data == b"cmd0"
    shutil.rmtree(p)


def test_storage_errors_survive_pickling() -> None:
    """Worker pools (the simulator's --jobs) return errors by pickling them."""
    import pickle

    from raftkv.storage.errors import IndexMismatch

    from raftkv.core import LeaderStepping, NotLeader

    for err in (Compacted(3, 7), Unavailable(9, 4), IndexMismatch(2, 5),
                NotLeader("n1", "n2"), LeaderStepping("moving", "n3")):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err)
        assert again.__dict__ == err.__dict__


def test_a_failed_write_on_a_nearly_full_file_system_says_so(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found from outside: a full tmpfs made the log's commit fail with
    'mdb_txn_commit: Input/output error', which says nothing of the disk. The message
    now names the free space when it is low. (The free space is made low by hand: the
    write failure itself is LMDB's.)"""
    import shutil as sh

    from raftkv.storage import durable_fs

    usage = sh.disk_usage(str(tmp_path))
    monkeypatch.setattr(durable_fs.shutil, "disk_usage",
                        lambda p: usage._replace(free=4096))
    assert "has only 4,096 bytes free: is it full?" in durable_fs.space_hint(str(tmp_path))
    monkeypatch.setattr(durable_fs.shutil, "disk_usage", lambda p: usage._replace(free=1 << 40))
    assert durable_fs.space_hint(str(tmp_path)) == ""
