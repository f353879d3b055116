"""The StateStore contract (storage/state_store.py), checked against both implementations.

Contract tests run over ``MemoryStateStore`` and ``LmdbStateStore`` (in tmp_path), then
LMDB-specific tests cover reopen, open errors, map-full atomicity and reader isolation.
Each test is named after the rule it checks. IGNITE-16907 is the protocol: the Raft log is
the WAL, proposedIndex goes with every apply, and the checkpointIndex answers replay with
``IndexMismatch``.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from hashlib import blake2b
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest
from conftest import RowsHashed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raftkv.storage.commands import (
    BATCH_MARK_PREFIX,
    MAX_BATCH_OPS,
    MAX_COMMAND_BYTES,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    RESERVED_PREFIX,
    Batch,
    Cas,
    CommandError,
    Delete,
    Op,
    Put,
    decode,
    encode_batch,
    encode_cas,
    encode_delete,
    encode_put,
    user_key,
)
from raftkv.storage.digest import EMPTY, Digest, digest_rows
from raftkv.storage.errors import IndexMismatch, StorageError
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.state_store import CheckpointPolicy, MemoryStateStore, StateStore

KINDS = ["memory", "lmdb"]
Store = MemoryStateStore | LmdbStateStore


# -- fixtures and helpers ----------------------------------------------------------------------
class Stores:
    """Makes stores of either kind and closes them all at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.opened: list[Store] = []
        self._n = itertools.count()

    def make(self, kind: str, **kw: Any) -> Store:
        s: Store
        if kind == "memory":
            s = MemoryStateStore(**kw)
        else:
            s = LmdbStateStore(self.root / f"state{next(self._n)}", **kw)
        self.opened.append(s)
        return s

    def restart(self, s: Store) -> Store:
        """What a node restart leaves: memory loses all but the checkpoint; LMDB reopens."""
        if isinstance(s, MemoryStateStore):
            s.crash()
            return s
        s.close()
        s2 = LmdbStateStore(s.path)
        self.opened.append(s2)
        return s2

    def close_all(self) -> None:
        for s in self.opened:
            s.close()


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Stores]:
    s = Stores(tmp_path)
    yield s
    s.close_all()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, stores: Stores) -> Store:
    return stores.make(kind)


def at(first: int, *cmds: bytes) -> list[tuple[int, bytes]]:
    """Log entries ``first, first+1, ...`` carrying ``cmds``."""
    return [(first + i, c) for i, c in enumerate(cmds)]


def puts(first: int, rows: dict[bytes, bytes]) -> list[tuple[int, bytes]]:
    return at(first, *(encode_put(k, v) for k, v in rows.items()))


def state(s: Store) -> dict[bytes, bytes]:
    return dict(s.scan())


@pytest.fixture(scope="module")
def lmdb_tmp() -> Iterator[Callable[[], LmdbStateStore]]:
    """Fresh LMDB stores for hypothesis examples (function-scoped tmp_path does not reset)."""
    root = Path(tempfile.mkdtemp(prefix="state_store_hyp"))
    n = itertools.count()
    opened: list[LmdbStateStore] = []

    def make() -> LmdbStateStore:
        s = LmdbStateStore(root / f"s{next(n)}", map_size=1 << 26)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
    shutil.rmtree(root, ignore_errors=True)


def test_both_implementations_satisfy_the_protocol(stores: Stores) -> None:
    for k in KINDS:
        s: StateStore = stores.make(k)  # a type-checker assertion as much as a runtime one
        assert s.applied_index() == 0 and s.checkpoint_index() == 0


# -- apply: data and applied index together ----------------------------------------------------
def test_apply_writes_data_and_applied_index_together(store: Store) -> None:
    res = store.apply(puts(1, {b"a": b"1", b"b": b"2", b"c": b"3"}))
    assert res == [None, None, None]
    assert store.applied_index() == 3
    assert store.checkpoint_index() == 0  # applied, not yet durable
    assert state(store) == {b"a": b"1", b"b": b"2", b"c": b"3"}
    store.apply(at(4, encode_delete(b"b"), encode_put(b"a", b"x")))
    assert store.applied_index() == 5
    assert state(store) == {b"a": b"x", b"c": b"3"}


def test_empty_apply_is_a_no_op_and_a_raft_no_op_entry_advances_the_index(store: Store) -> None:
    assert store.apply([]) == []
    assert store.applied_index() == 0
    assert store.apply(at(1, b"", encode_put(b"k", b"v"), b"")) == [None, None, None]
    assert store.applied_index() == 3
    assert state(store) == {b"k": b"v"}


def test_checkpoint_makes_the_applied_index_the_checkpoint_index(store: Store) -> None:
    store.apply(puts(1, {b"a": b"1", b"b": b"2"}))
    assert store.checkpoint() == 2
    assert store.checkpoint_index() == 2
    assert store.checkpoint() == 2  # nothing new: idempotent
    store.apply(puts(3, {b"c": b"3"}))
    assert store.checkpoint_index() == 2
    assert store.checkpoint() == 3


def test_background_checkpoint_promises_what_was_applied_when_it_started(tmp_path) -> None:
    """The driver's non-blocking checkpoint: the sync runs on another thread while
    applies go on, and only the index applied when the job was made becomes the
    checkpointIndex."""
    import threading

    s = LmdbStateStore(tmp_path / "s", checkpoint_entries=2)
    assert s.background_checkpoint() is None  # nothing pending
    s.apply(puts(1, {b"a": b"1", b"b": b"2"}))
    assert s.checkpoint_due(0.0)
    job = s.background_checkpoint()
    assert job is not None
    s.apply(puts(3, {b"c": b"3"}))  # after the job was made: not promised by it
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(job()))
    t.start()
    s.apply(puts(4, {b"d": b"4"}))  # applies go on while it syncs
    t.join()
    assert out == [2]
    s.checkpointed(out[0])
    assert (s.checkpoint_index(), s.applied_index()) == (2, 4)
    s.checkpointed(1)  # a late, older result never moves the checkpoint back
    assert s.checkpoint_index() == 2
    late = s.background_checkpoint()
    assert late is not None
    s.close()
    assert late() == 0  # the store closed first: nothing was made durable by it


def test_stores_without_background_checkpoints_say_so() -> None:
    s = MemoryStateStore()
    s.apply(puts(1, {b"a": b"1"}))
    assert s.background_checkpoint() is None  # the caller checkpoints inline


# -- the IGNITE-16907 protocol -----------------------------------------------------------------
def test_replay_at_or_below_the_checkpoint_raises_index_mismatch_and_applies_nothing(
    store: Store,
) -> None:
    store.apply(puts(1, {b"k1": b"v1", b"k2": b"v2", b"k3": b"v3"}))
    store.checkpoint()
    store.apply(puts(4, {b"k4": b"v4"}))
    before = state(store)
    for first in (0, 1, 3):
        with pytest.raises(IndexMismatch) as ei:
            store.apply(at(first, *[encode_put(b"new", b"x")] * (5 - first)))
        assert ei.value.index == first
        assert ei.value.checkpoint_index == 3
        assert "resume from 4" in str(ei.value)
    assert state(store) == before
    assert store.applied_index() == 4


def test_restart_replays_from_checkpoint_plus_one_after_index_mismatch(
    kind: str, stores: Stores
) -> None:
    """The issue's worked example, driven as the driver would: offer the whole log from 1,
    take IndexMismatch, resume at checkpoint_index + 1."""
    log = at(
        1,
        encode_put(b"k1", b"v1"),
        encode_put(b"k2", b"v2"),
        encode_put(b"k3", b"v3"),
        encode_cas(b"k4", None, b"v4"),  # not idempotent: applying it twice would be visible
    )
    s = stores.make(kind)
    s.apply(log[:3])
    s.checkpoint()
    s.apply(log[3:])
    expected = s.digest()
    s = stores.restart(s)
    assert s.applied_index() == s.checkpoint_index()
    with pytest.raises(IndexMismatch) as ei:
        s.apply(log)
    resume = ei.value.checkpoint_index + 1
    results = s.apply(log[resume - 1 :]) if resume <= len(log) else []
    assert s.applied_index() == 4
    assert s.digest() == expected
    assert s.get(b"k4") == b"v4"
    if kind == "memory":  # the crash lost k4, so the replay re-ran the CAS, which succeeded
        assert results == [True]


def test_double_apply_gap_and_non_contiguous_batch_raise_storage_error(store: Store) -> None:
    store.apply(puts(1, {b"a": b"1"}))
    store.checkpoint()
    store.apply(puts(2, {b"b": b"2", b"c": b"3"}))
    before = state(store)
    cases = {
        "already applied": at(2, encode_put(b"x", b"x")),  # in (checkpoint, applied]
        "leaves a gap": at(6, encode_put(b"x", b"x")),
        "not contiguous": [(4, encode_put(b"x", b"x")), (6, encode_put(b"y", b"y"))],
    }
    for phrase, entries in cases.items():
        with pytest.raises(StorageError) as ei:
            store.apply(entries)
        assert not isinstance(ei.value, IndexMismatch)  # a driver bug, not a replay to skip
        assert phrase in str(ei.value)
    assert state(store) == before
    assert store.applied_index() == 3


# -- command semantics -------------------------------------------------------------------------
def test_cas_succeeds_only_on_the_expected_value_absent_or_present(store: Store) -> None:
    res = store.apply(
        at(
            1,
            encode_cas(b"k", None, b"v1"),  # absent, expected absent: creates
            encode_cas(b"k", None, b"v2"),  # present, expected absent: fails
            encode_cas(b"k", b"v1", b"v3"),  # present, matches: updates
            encode_cas(b"k", b"v1", b"v4"),  # mismatch: fails, unchanged
            encode_cas(b"other", b"x", b"y"),  # absent, expected a value: fails
        )
    )
    assert res == [True, False, True, False, False]
    assert state(store) == {b"k": b"v3"}
    assert store.apply(at(6, encode_cas(b"k", b"v3", None))) == [True]  # new=None deletes
    assert store.get(b"k") is None
    assert store.apply(at(7, encode_cas(b"k", b"", b"e"))) == [False]  # b"" is not absent
    store.apply(at(8, encode_put(b"k", b"")))
    assert store.apply(at(9, encode_cas(b"k", b"", b"e"))) == [True]
    assert store.get(b"k") == b"e"


def test_batch_applies_in_order_and_all_or_nothing(store: Store) -> None:
    store.apply(puts(1, {b"gone": b"x", b"keep": b"y"}))
    res = store.apply(
        at(3, encode_batch([(b"a", b"1"), (b"gone", None), (b"a", b"2"), (b"b", b"3")]))
    )
    assert res == [None]
    assert state(store) == {b"a": b"2", b"b": b"3", b"keep": b"y"}
    # A batch in the log with one bad op (crafted: encode_batch would refuse it) is one bad
    # command: none of its ops apply, and the store moves on.
    bad = msgpack.packb([Op.BATCH, [[b"c", b"4"], [b"", b"5"]]], use_bin_type=True)
    res = store.apply(at(4, bad, encode_put(b"d", b"6")))
    assert isinstance(res[0], CommandError) and "batch op 1" in str(res[0])
    assert res[1] is None
    assert store.get(b"c") is None and store.get(b"d") == b"6"
    assert store.applied_index() == 5


def test_a_batch_with_an_id_applies_once_even_after_a_crash_or_a_snapshot(
    store: Store, stores: Stores
) -> None:
    """Issue 6's idempotent bulk-load batch: a retried or duplicated batch id is skipped on
    every replica, and the marker survives what the data survives (crash replay, snapshot)."""
    b1 = encode_batch([(b"a", b"1"), (b"b", b"2")], batch_id=b"load1/p3/0")
    assert store.apply(at(1, b1)) == [True]
    store.apply(at(2, encode_put(b"a", b"changed")))
    # The same batch again (a retried Spark task) changes nothing and says so.
    assert store.apply(at(3, b1)) == [False]
    assert store.get(b"a") == b"changed"
    b2 = encode_batch([(b"c", b"3")], batch_id=b"load1/p3/1")
    store.checkpoint()
    assert store.apply(at(4, b2)) == [True]
    if isinstance(store, MemoryStateStore):
        store.crash()  # lost with the data: replay re-applies it exactly once
        assert store.get(b"c") is None
        assert store.apply(at(4, b2, b2)) == [True, False]
    # A replica that installs a snapshot inherits the markers.
    other = stores.make("memory")
    other.install_snapshot(store.snapshot_chunks())
    assert other.apply(at(store.applied_index() + 1, b1, b2)) == [False, False]
    user = {k: v for k, v in state(other).items() if user_key(k)}
    assert user == {b"a": b"changed", b"b": b"2", b"c": b"3"}
    assert other.digest(keys=user_key) == digest_rows(sorted(user.items()))


def test_reserved_keys_and_bad_batch_ids_are_refused() -> None:
    with pytest.raises(CommandError, match="reserved"):
        encode_put(RESERVED_PREFIX + b"x", b"v")
    with pytest.raises(CommandError, match="reserved"):
        encode_batch([(BATCH_MARK_PREFIX + b"forged", b"")])
    for bad in (b"", b"x" * 129):
        with pytest.raises(CommandError, match="batch id"):
            encode_batch([(b"k", b"v")], batch_id=bad)
    crafted = msgpack.packb([Op.BATCH, [[b"k", b"v"]], "str-id"], use_bin_type=True)
    with pytest.raises(CommandError, match="batch id"):
        decode(crafted)
    assert decode(encode_batch([(b"k", b"v")], batch_id=b"i")) == Batch(((b"k", b"v"),), b"i")


def test_malformed_command_in_the_log_is_a_result_and_the_store_continues(store: Store) -> None:
    p = lambda obj: msgpack.packb(obj, use_bin_type=True)
    bad = [
        b"\xc1garbage",  # 0xc1 is never valid msgpack
        b"\x93\x01",  # truncated array
        p([1, b"k", b"v"]) + b"\x00",  # trailing bytes
        p({"op": 1}),  # wrong shape
        p([]),
        p([99, b"k"]),  # unknown op
        p([True, b"k", b"v"]),  # bool is not an op
        p([1, "str-key", b"v"]),  # keys are bytes, not str
        p([1, b"k", 7]),  # values are bytes
        p([1, b"k" * (MAX_KEY_BYTES + 1), b"v"]),  # over the key limit, smuggled into the log
        p([2, b"k", b"extra"]),
        p([3, b"k", None]),
        p([4, "not a list"]),
        b"\x91" * 5000,  # deep nesting
    ]
    res = store.apply(at(1, *bad, encode_put(b"ok", b"1")))
    assert all(isinstance(r, CommandError) for r in res[:-1]), res
    assert res[-1] is None
    assert store.applied_index() == len(bad) + 1
    assert state(store) == {b"ok": b"1"}


# -- limits ------------------------------------------------------------------------------------
def _err(fn: Callable[..., object], *args: object) -> CommandError:
    with pytest.raises(CommandError) as ei:
        fn(*args)
    assert isinstance(ei.value, ValueError)
    return ei.value


def test_limits_are_enforced_at_encode_time_with_a_clear_message() -> None:
    e = _err(encode_put, b"k" * 512, b"v")
    assert "512 bytes" in str(e) and "511" in str(e) and (e.limit, e.size) == (511, 512)
    e = _err(encode_put, b"", b"v")
    assert "empty" in str(e) and "1..511" in str(e)
    e = _err(encode_put, b"k", b"v" * (MAX_VALUE_BYTES + 1))
    assert f"{MAX_VALUE_BYTES + 1} bytes" in str(e) and "1 MiB" in str(e)
    e = _err(encode_batch, [(b"k%d" % i, b"") for i in range(MAX_BATCH_OPS + 1)])
    assert "10001 operations" in str(e) and "10000" in str(e)
    e = _err(encode_batch, [(b"k%d" % i, b"v" * MAX_VALUE_BYTES) for i in range(17)])
    assert "16 MiB" in str(e) and e.size is not None and e.size > MAX_COMMAND_BYTES
    e = _err(encode_batch, [(b"a", b"1"), (b"b" * 600, b"2")])
    assert "batch op 1: key is 600 bytes" in str(e)
    assert "must be bytes" in str(_err(encode_put, "str", b"v"))
    assert "must be bytes" in str(_err(encode_delete, 5))
    assert "new value" in str(_err(encode_cas, b"k", None, b"v" * (MAX_VALUE_BYTES + 1)))
    assert "pair" in str(_err(encode_batch, [(b"k",)]))


def test_values_at_the_limits_are_accepted_and_round_trip() -> None:
    big = b"v" * MAX_VALUE_BYTES
    assert decode(encode_put(b"k" * MAX_KEY_BYTES, big)) == Put(b"k" * MAX_KEY_BYTES, big)
    assert decode(encode_put(b"k", b"")) == Put(b"k", b"")
    assert decode(encode_delete(b"k")) == Delete(b"k")
    assert decode(encode_cas(b"k", None, None)) == Cas(b"k", None, None)
    ops = [(b"k%d" % i, None if i % 3 else b"v") for i in range(MAX_BATCH_OPS)]
    assert decode(encode_batch(ops)) == Batch(tuple(ops))
    assert decode(encode_batch([])) == Batch(())


def test_decode_rejects_a_command_over_the_size_limit_before_unpacking() -> None:
    e = _err(decode, b"\x00" * (MAX_COMMAND_BYTES + 1))
    assert "16 MiB" in str(e)
    assert "empty" in str(_err(decode, b""))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decoding_arbitrary_bytes_raises_only_command_error(data: bytes) -> None:
    try:
        decode(data)
    except CommandError:
        pass


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(0, 5)
        | st.integers(-(2**63), 2**64 - 1)
        | st.binary(max_size=8)
        | st.text(max_size=4),
        lambda children: st.lists(children, max_size=4),
        max_leaves=12,
    )
)
def test_decoding_wrong_shapes_raises_only_command_error(obj: object) -> None:
    try:
        decode(msgpack.packb(obj, use_bin_type=True))
    except CommandError:
        pass


# -- reads -------------------------------------------------------------------------------------
def test_scan_is_half_open_and_in_key_order(store: Store) -> None:
    rows = {b"b": b"2", b"a": b"1", b"d": b"4", b"c": b"3", b"ca": b"5"}
    store.apply(puts(1, rows))
    assert [k for k, _ in store.scan()] == [b"a", b"b", b"c", b"ca", b"d"]
    assert list(store.scan(b"b", b"d")) == [(b"b", b"2"), (b"c", b"3"), (b"ca", b"5")]
    assert [k for k, _ in store.scan(lo=b"c")] == [b"c", b"ca", b"d"]
    assert [k for k, _ in store.scan(hi=b"c")] == [b"a", b"b"]
    assert list(store.scan(b"d", b"b")) == []
    assert list(store.scan(b"z")) == []
    # A lo longer than any storable key still sorts correctly (LMDB clamps internally).
    assert [k for k, _ in store.scan(lo=b"c" + b"\x00" * 600)] == [b"ca", b"d"]


def test_keys_that_could_never_be_stored_read_as_absent(store: Store) -> None:
    assert store.get(b"") is None
    assert store.get(b"k" * 600) is None
    with pytest.raises(TypeError):
        store.get("str")  # type: ignore[arg-type]


# -- digest ------------------------------------------------------------------------------------
def _reference_digest(rows: dict[bytes, bytes]) -> Digest:
    """The documented formula, written out independently of storage.digest."""
    total = 0
    for k, v in rows.items():
        h = blake2b(len(k).to_bytes(4, "big") + k + v, digest_size=8).digest()
        total = (total + int.from_bytes(h, "big")) % 2**64
    return Digest(len(rows), format(total, "016x"))


def test_digest_follows_the_documented_formula(store: Store) -> None:
    rows = {b"a": b"1", b"ab": b"c", b"a\x00": b"", b"z" * 511: b"v" * 1000}
    store.apply(puts(1, rows))
    assert store.digest() == _reference_digest(rows)
    assert store.digest(b"q", b"r") == EMPTY == Digest(0, "0000000000000000")
    # The length prefix separates (b"ab", b"c") from (b"a", b"bc").
    assert digest_rows([(b"ab", b"c")]) != digest_rows([(b"a", b"bc")])


rows_strategy = st.dictionaries(
    st.binary(min_size=1, max_size=12).filter(user_key), st.binary(max_size=16),
    min_size=0, max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=rows_strategy, data=st.data())
def test_digest_is_order_independent_and_equal_across_implementations(
    rows: dict[bytes, bytes], data: st.DataObject, lmdb_tmp: Callable[[], LmdbStateStore]
) -> None:
    items = list(rows.items())
    order = data.draw(st.permutations(items))
    # Memory: one put per entry, in insertion order, with a stale value overwritten first.
    mem = MemoryStateStore()
    junk = [encode_put(k, v + b"stale") for k, v in items[:3]]
    mem.apply(at(1, *junk, *(encode_put(k, v) for k, v in items)))
    # LMDB: a shuffled order, grouped into batch commands of random sizes.
    db = lmdb_tmp()
    cmds = []
    rest = list(order)
    while rest:
        n = data.draw(st.integers(1, 5))
        cmds.append(encode_batch(rest[:n]))
        rest = rest[n:]
    if cmds:
        db.apply(at(1, *cmds))
    expected = _reference_digest(rows)
    assert mem.digest() == expected
    assert db.digest() == expected
    # Different data gives a different digest (a 64-bit collision is not going to happen).
    if items:
        k, v = items[0]
        mem.apply(at(mem.applied_index() + 1, encode_put(k, v + b"!")))
        assert mem.digest() != expected
        mem.apply(at(mem.applied_index() + 1, encode_delete(k)))
        assert mem.digest() != expected and mem.digest().count == len(rows) - 1


@settings(max_examples=60, deadline=None)
@given(a=rows_strategy, b=rows_strategy)
def test_different_data_gives_a_different_digest(
    a: dict[bytes, bytes], b: dict[bytes, bytes]
) -> None:
    if a != b:
        assert digest_rows(a.items()).digest != digest_rows(b.items()).digest


def test_digest_over_a_range_and_with_a_key_predicate(kind: str, stores: Stores) -> None:
    rows = {b"%s%03d" % (p, i): b"v%d" % i for p in (b"a", b"b", b"c") for i in range(50)}
    s = stores.make(kind)
    s.apply(puts(1, rows))
    in_b = {k: v for k, v in rows.items() if b"b" <= k < b"c"}
    assert s.digest(b"b", b"c") == _reference_digest(in_b)
    assert s.digest(b"b", b"c").count == 50
    even = lambda k: int(k[1:]) % 2 == 0
    assert s.digest(keys=even) == _reference_digest({k: v for k, v in rows.items() if even(k)})
    assert s.digest(lo=b"a", hi=b"b", keys=even).count == 25
    # The parts of a partition add up: digests of disjoint ranges sum to the whole.
    parts = [s.digest(None, b"b"), s.digest(b"b", b"c"), s.digest(b"c", None)]
    total = sum(int(d.digest, 16) for d in parts) % 2**64
    assert Digest(sum(d.count for d in parts), f"{total:016x}") == s.digest()


# -- snapshots ---------------------------------------------------------------------------------
def _fill(s: Store, n: int = 300, first: int = 1) -> None:
    s.apply(
        at(
            first,
            *(encode_put(b"key%05d" % i, b"val%d" % i * (i % 7 + 1)) for i in range(n)),
            encode_delete(b"key00003"),
            encode_cas(b"key00004", b"val4" * 5, b"swapped"),
        )
    )


@pytest.mark.parametrize("src_kind,dst_kind", [(a, b) for a in KINDS for b in KINDS])
def test_snapshot_round_trips_between_implementations(
    src_kind: str, dst_kind: str, stores: Stores
) -> None:
    src = stores.make(src_kind)
    _fill(src)
    dst = stores.make(dst_kind)
    dst.apply(puts(1, {b"stale": b"replaced wholesale", b"key00001": b"old"}))
    chunks = list(src.snapshot_chunks(chunk_bytes=512))
    assert len(chunks) > 10  # header, many row chunks, trailer
    header = msgpack.unpackb(chunks[0])
    assert header == {"v": 1, "applied": 302, "count": 299, "kind": "kv-rows"}
    assert set(msgpack.unpackb(chunks[-1])) == {"applied", "count", "digest"}
    assert dst.install_snapshot(chunks) == 302
    assert dst.applied_index() == dst.checkpoint_index() == 302
    assert dst.digest() == src.digest()
    assert state(dst) == state(src)
    assert dst.get(b"stale") is None
    # The store carries on from the snapshot's index.
    dst.apply(puts(303, {b"after": b"1"}))
    with pytest.raises(IndexMismatch):
        dst.apply(puts(302, {b"x": b"1"}))


@pytest.mark.parametrize("src_kind,dst_kind", [(a, b) for a in KINDS for b in KINDS])
def test_a_verified_image_installs_the_same_state_without_being_hashed_again(
    src_kind: str, dst_kind: str, stores: Stores, rows_hashed: RowsHashed
) -> None:
    """A receiver checks an image before its core adopts the snapshot (verify_image);
    installing what it checked decodes the rows once more but neither re-checks nor
    re-hashes them, and ends in the same state as installing the raw chunks."""
    from raftkv.storage import state_store

    src = stores.make(src_kind)
    _fill(src)
    image = state_store.verify_image(list(src.snapshot_chunks(chunk_bytes=512)))
    assert image.applied == 302 and image.received == src.digest(revisions=True)
    rows_hashed.n = 0
    dst = stores.make(dst_kind)
    dst.apply(puts(1, {b"stale": b"replaced wholesale"}))
    assert dst.install_snapshot(image) == 302
    assert rows_hashed.n == 0
    assert dst.applied_index() == dst.checkpoint_index() == 302
    assert dst.digest() == src.digest() and state(dst) == state(src)
    assert dst.get(b"stale") is None
    # The control: the raw chunks are checked row by row.
    again = stores.make(dst_kind)
    rows_hashed.n = 0
    again.install_snapshot(list(image))
    assert rows_hashed.n == 299 and state(again) == state(src)


def test_verify_image_refuses_what_a_loader_refuses(stores: Stores) -> None:
    from raftkv.storage.state_store import verify_image

    src = stores.make("memory")
    _fill(src)
    chunks = list(src.snapshot_chunks(chunk_bytes=512))
    rows = msgpack.unpackb(chunks[3])
    rows[0][1] = rows[0][1][:-1] + b"?"  # one value changed: the digest no longer matches
    bad = [*chunks[:3], msgpack.packb(rows, use_bin_type=True), *chunks[4:]]
    for broken in (chunks[:-1], bad, [chunks[0], chunks[2], chunks[1], *chunks[3:]]):
        with pytest.raises(StorageError):
            verify_image(broken)


def test_snapshot_of_an_empty_store_round_trips(kind: str, stores: Stores) -> None:
    src = stores.make(kind)
    chunks = list(src.snapshot_chunks())
    assert len(chunks) == 2  # header and trailer
    dst = stores.make("lmdb" if kind == "memory" else "memory")
    dst.apply(puts(1, {b"a": b"1"}))
    assert dst.install_snapshot(chunks) == 0
    assert dst.digest() == EMPTY and dst.applied_index() == 0


def _corruptions(chunks: list[bytes]) -> dict[str, list[bytes]]:
    rows = msgpack.unpackb(chunks[1])
    tampered_rows = [[k, v + b"!"] if i == 0 else [k, v] for i, (k, v) in enumerate(rows)]
    trailer = msgpack.unpackb(chunks[-1])
    bad_digest = dict(trailer, digest="0" * 16)
    header = msgpack.unpackb(chunks[0])
    pk = lambda o: msgpack.packb(o, use_bin_type=True)
    return {
        "empty": [],
        "no trailer": chunks[:-1],
        "truncated": chunks[:3],
        "dropped middle chunk": chunks[:2] + chunks[3:],
        "duplicated chunk": chunks[:2] + chunks[1:],
        "swapped chunks": [chunks[0], chunks[2], chunks[1], *chunks[3:]],
        "flipped byte": [chunks[0], chunks[1][:-3] + b"\xc1" + chunks[1][-2:], *chunks[2:]],
        "tampered value": [chunks[0], pk(tampered_rows), *chunks[2:]],
        "bad trailer digest": [*chunks[:-1], pk(bad_digest)],
        "data after trailer": [*chunks, chunks[1]],
        "header version": [pk(dict(header, v=2)), *chunks[1:]],
        "header applied": [pk(dict(header, applied=7)), *chunks[1:]],
        "header count": [pk(dict(header, count=1)), *chunks[1:]],
        "no header": chunks[1:],
        "garbage header": [b"\xc1", *chunks[1:]],
        "not bytes": [chunks[0], "text", *chunks[1:]],  # type: ignore[list-item]
        "key over limit": [chunks[0], pk([[b"k" * 600, b"v"]]), *chunks[1:]],
        "row not a pair": [chunks[0], pk([[b"k"]]), *chunks[1:]],
    }


CORRUPTIONS = [
    "empty",
    "no trailer",
    "truncated",
    "dropped middle chunk",
    "duplicated chunk",
    "swapped chunks",
    "flipped byte",
    "tampered value",
    "bad trailer digest",
    "data after trailer",
    "header version",
    "header applied",
    "header count",
    "no header",
    "garbage header",
    "not bytes",
    "key over limit",
    "row not a pair",
]


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_install_of_a_corrupt_stream_raises_and_keeps_the_old_state(
    kind: str, corruption: str, stores: Stores
) -> None:
    src = stores.make("memory")
    _fill(src, 100)
    chunks = list(src.snapshot_chunks(chunk_bytes=256))
    assert len(chunks) > 5
    dst = stores.make(kind)
    dst.apply(puts(1, {b"mine": b"1", b"key00001": b"keep me"}))
    dst.checkpoint()
    dst.apply(puts(3, {b"unsynced": b"2"}))
    before = (dst.digest(), dst.applied_index(), dst.checkpoint_index())
    corruptions = _corruptions(chunks)
    assert sorted(corruptions) == sorted(CORRUPTIONS)
    with pytest.raises(StorageError) as ei:
        dst.install_snapshot(corruptions[corruption])
    assert "snapshot" in str(ei.value)
    assert (dst.digest(), dst.applied_index(), dst.checkpoint_index()) == before
    # Still fully usable afterwards, and a good stream installs.
    dst.apply(puts(4, {b"after": b"3"}))
    assert dst.install_snapshot(chunks) == src.applied_index()
    assert dst.digest() == src.digest()


def test_snapshot_export_is_consistent_while_writes_continue(kind: str, stores: Stores) -> None:
    s = stores.make(kind)
    _fill(s, 200)
    old_digest, old_applied = s.digest(), s.applied_index()
    it = s.snapshot_chunks(chunk_bytes=256)
    first = next(it)
    # The writer is not blocked by the open export (LMDB: an MVCC read txn).
    s.apply(
        at(
            old_applied + 1,
            encode_put(b"key00150", b"changed"),
            encode_delete(b"key00199"),
            encode_put(b"zzz-new", b"new"),
            encode_batch([(b"key%05d" % i, None) for i in range(100, 120)]),
        )
    )
    s.checkpoint()
    chunks = [first, *it]
    assert s.digest() != old_digest
    dst = stores.make("memory")
    assert dst.install_snapshot(chunks) == old_applied
    assert dst.digest() == old_digest


def test_snapshot_chunks_are_about_chunk_bytes(kind: str, stores: Stores) -> None:
    s = stores.make(kind)
    s.apply(puts(1, {b"k%04d" % i: b"x" * 100 for i in range(200)}))
    chunks = list(s.snapshot_chunks(chunk_bytes=4096))
    body = chunks[1:-1]
    assert all(len(c) < 4096 + 200 for c in body)
    assert all(len(c) > 3000 for c in body[:-1])
    with pytest.raises(ValueError):
        list(s.snapshot_chunks(chunk_bytes=0))


# -- checkpoint policy -------------------------------------------------------------------------
def test_checkpoint_policy_fires_on_the_entry_threshold(kind: str, stores: Stores) -> None:
    s = stores.make(kind, checkpoint_entries=5, checkpoint_seconds=1000.0)
    s.apply(at(1, *[b""] * 4))
    assert not s.maybe_checkpoint(0.0)
    assert s.checkpoint_index() == 0
    s.apply(at(5, b""))
    assert s.maybe_checkpoint(0.0)
    assert s.checkpoint_index() == 5
    assert not s.maybe_checkpoint(0.0)  # nothing pending


def test_checkpoint_policy_fires_on_the_time_threshold_from_injected_now(
    kind: str, stores: Stores
) -> None:
    s = stores.make(kind, checkpoint_entries=1000, checkpoint_seconds=1.0)
    assert not s.maybe_checkpoint(50.0)  # nothing pending: the timer does not even start
    s.apply(at(1, b""))
    assert not s.maybe_checkpoint(100.0)  # the timer starts at the first call seeing work
    assert not s.maybe_checkpoint(100.99)
    s.apply(at(2, b""))
    assert s.maybe_checkpoint(101.0)
    assert s.checkpoint_index() == 2
    # After the checkpoint the timer restarts with the next pending work, not at 101.
    s.apply(at(3, b""))
    assert not s.maybe_checkpoint(500.0)
    assert not s.maybe_checkpoint(500.5)
    assert s.maybe_checkpoint(501.0)
    # An explicit checkpoint resets the timer too.
    s.apply(at(4, b""))
    assert not s.maybe_checkpoint(600.0)
    s.checkpoint()
    s.apply(at(5, b""))
    assert not s.maybe_checkpoint(600.9)
    assert not s.maybe_checkpoint(601.5)
    assert s.maybe_checkpoint(601.9)


def test_checkpoint_deadline_is_when_the_timer_runs_out(kind: str, stores: Stores) -> None:
    """What the driver queues stores by: None until a due() call saw pending applies,
    then the start of that wait plus the policy's seconds; None again once checkpointed."""
    s = stores.make(kind, checkpoint_entries=1000, checkpoint_seconds=2.0)
    assert s.checkpoint_deadline() is None
    s.apply(at(1, b""))
    assert s.checkpoint_deadline() is None  # the timer starts when a due() call sees it
    assert not s.checkpoint_due(100.0)
    assert s.checkpoint_deadline() == 102.0
    assert not s.checkpoint_due(101.0)
    assert s.checkpoint_deadline() == 102.0  # a later look does not restart it
    assert s.checkpoint_due(102.0)
    s.checkpoint()
    assert s.checkpoint_deadline() is None


def test_checkpoint_policy_is_due_at_its_own_deadline() -> None:
    """0.7 + 0.1 rounds below 0.8, so ``now - since >= seconds`` said "not due" at the
    deadline itself, and the driver, woken by that deadline, re-queued it for ever
    (review finding). Due is now measured against ``deadline()``."""
    p = CheckpointPolicy(entries=1000, seconds=0.1)
    assert not p.due(5, 0.7)
    at = p.deadline()
    assert at is not None and at - 0.7 < 0.1  # the rounding that hid the deadline
    assert p.due(5, at)


def test_checkpoint_policy_defaults_and_validation() -> None:
    p = CheckpointPolicy()
    assert (p.entries, p.seconds) == (10_000, 1.0)
    with pytest.raises(ValueError):
        CheckpointPolicy(entries=0)
    with pytest.raises(ValueError):
        CheckpointPolicy(seconds=0)


# -- MemoryStateStore: the buffered-storage model ----------------------------------------------
def test_memory_crash_reverts_data_and_applied_index_to_the_last_checkpoint() -> None:
    s = MemoryStateStore()
    s.apply(puts(1, {b"k1": b"v1", b"k2": b"v2", b"k3": b"v3"}))
    s.checkpoint()
    at_checkpoint = (state(s), s.digest())
    s.apply(
        at(
            4,
            encode_put(b"k4", b"v4"),  # new key
            encode_put(b"k1", b"changed"),  # overwrite
            encode_delete(b"k2"),  # delete
            encode_put(b"k2", b"back"),  # re-create
            encode_cas(b"k3", b"v3", None),  # delete via CAS
            encode_put(b"k3", b"x"),
            encode_delete(b"k3"),
        )
    )
    s.crash()
    assert (state(s), s.digest()) == at_checkpoint
    assert s.applied_index() == s.checkpoint_index() == 3
    s.crash()  # a second crash loses nothing more
    assert state(s) == at_checkpoint[0]
    # A crash with no checkpoint ever taken loses everything.
    fresh = MemoryStateStore()
    fresh.apply(puts(1, {b"a": b"1"}))
    fresh.crash()
    assert state(fresh) == {} and fresh.applied_index() == 0


def test_memory_install_is_the_new_durable_image() -> None:
    src = MemoryStateStore()
    _fill(src, 20)
    s = MemoryStateStore()
    s.apply(puts(1, {b"a": b"1"}))
    s.install_snapshot(src.snapshot_chunks())
    s.apply(puts(s.applied_index() + 1, {b"lost": b"1"}))
    s.crash()
    assert s.digest() == src.digest() and s.applied_index() == src.applied_index()


def test_closed_store_raises_storage_error_and_close_is_idempotent(store: Store) -> None:
    store.close()
    store.close()
    for call in (
        lambda: store.apply(at(1, b"")),
        store.applied_index,
        lambda: store.get(b"k"),
        lambda: store.digest(),
        store.checkpoint,
    ):
        with pytest.raises(StorageError, match="closed"):
            call()


# -- LMDB-specific -----------------------------------------------------------------------------
def test_lmdb_reopen_starts_with_applied_equal_checkpoint_equal_last_applied(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s"
    s = LmdbStateStore(path)
    s.apply(puts(1, {b"a": b"1", b"b": b"2"}))
    s.checkpoint()
    s.apply(at(3, encode_delete(b"a"), encode_put(b"c", b"3"), b""))
    expected = (state(s), s.digest())
    s.close()
    s = LmdbStateStore(path)
    try:
        assert s.applied_index() == s.checkpoint_index() == 5
        assert (state(s), s.digest()) == expected
        with pytest.raises(IndexMismatch) as ei:
            s.apply(puts(1, {b"a": b"1"}))
        assert ei.value.checkpoint_index == 5
        s.apply(puts(6, {b"d": b"4"}))
    finally:
        s.close()
    # The applied index is stored as 8 bytes big-endian under b"applied" in the meta DB.
    env = lmdb.open(str(path), max_dbs=2, readonly=True)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin(db=meta) as txn:
            assert txn.get(b"applied") == (6).to_bytes(8, "big")
    finally:
        env.close()


def test_lmdb_opening_garbage_raises_a_clear_storage_error(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"not a directory")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(b"\xde\xad\xbe\xef" * 4096)
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign))
    with env.begin(write=True) as txn:
        txn.put(b"somebody", b"else's data")
    env.close()
    # A truncated file (a partial copy, a lost file extension) must not SIGBUS the process.
    truncated = tmp_path / "truncated"
    s = LmdbStateStore(truncated)
    s.apply(puts(1, {b"k%05d" % i: b"v" * 200 for i in range(5000)}))
    s.close()
    with open(truncated / "data.mdb", "r+b") as f:
        f.truncate(40_000)
    for path, phrase in (
        (a_file, "Not a directory"),
        (garbage, "not an LMDB file"),
        (foreign, "not a raftkv state store"),
        (truncated, "truncated"),
    ):
        with pytest.raises(StorageError) as ei:
            LmdbStateStore(path)
        assert str(path) in str(ei.value) and phrase in str(ei.value)
        assert not isinstance(ei.value, lmdb.Error)


def test_lmdb_apply_that_fails_midway_applies_nothing(tmp_path: Path) -> None:
    s = LmdbStateStore(tmp_path / "s", map_size=1 << 20)
    try:
        s.apply(puts(1, {b"a": b"1"}))
        big = [encode_put(b"k%d" % i, b"v" * 100_000) for i in range(30)]  # ~3 MiB > map
        with pytest.raises(StorageError, match="map_size"):
            s.apply(at(2, *big))
        assert s.applied_index() == 1
        assert state(s) == {b"a": b"1"}
        s.apply(puts(2, {b"b": b"2"}))  # the store carries on
        assert s.applied_index() == 2
    finally:
        s.close()


def test_lmdb_install_keeps_the_old_state_on_disk_when_rejected(tmp_path: Path) -> None:
    src = MemoryStateStore()
    _fill(src, 100)
    chunks = list(src.snapshot_chunks(chunk_bytes=256))
    path = tmp_path / "s"
    s = LmdbStateStore(path)
    s.apply(puts(1, {b"mine": b"1"}))
    with pytest.raises(StorageError):
        s.install_snapshot(chunks[:-1])
    s.close()
    s = LmdbStateStore(path)
    try:
        assert state(s) == {b"mine": b"1"} and s.applied_index() == 1
    finally:
        s.close()


def test_lmdb_snapshot_iterator_releases_its_reader_when_closed(tmp_path: Path) -> None:
    s = LmdbStateStore(tmp_path / "s")
    try:
        _fill(s, 50)
        # LMDB's reader table, as text: one line per reader. The store itself holds one,
        # on its last checkpoint (the pin, raftkv.storage.lmdb_checkpoint).
        readers = lambda: len(s._env.readers().strip().splitlines())
        idle = readers()
        it = s.snapshot_chunks(chunk_bytes=64)
        next(it)
        assert readers() == idle + 1
        it.close()  # type: ignore[attr-defined]
        assert readers() == idle
        assert list(it) == []
        scan = s.scan()
        list(scan)  # exhausting it releases the reader too
        assert readers() == idle
    finally:
        s.close()


def test_lmdb_apply_of_a_10k_batch_is_one_fast_transaction(tmp_path: Path) -> None:
    s = LmdbStateStore(tmp_path / "s")
    try:
        ents = puts(1, {b"key%08d" % i: b"v" * 100 for i in range(10_000)})
        t = time.perf_counter()
        s.apply(ents)
        elapsed = time.perf_counter() - t
        assert s.applied_index() == 10_000
        # Loose bound (CI machines vary); benchmarks measure the real rate (~450k puts/s).
        assert elapsed < 1.0, f"10k puts took {elapsed:.3f}s"
    finally:
        s.close()


@settings(max_examples=300, deadline=None)
@given(key=st.binary(min_size=1, max_size=300), value=st.binary(max_size=70_000))
def test_put_fast_path_agrees_with_decode(key: bytes, value: bytes) -> None:
    """split_put reads a put straight from its bytes; it must agree with decode on every
    put it accepts, and decline (None) rather than guess on anything else."""
    from raftkv.storage.commands import Put, decode, split_put

    # Packed directly: encode_put refuses reserved keys, but the log may hold any key.
    data = msgpack.packb([Op.PUT, key, value], use_bin_type=True)
    fast = split_put(data)
    if fast is not None:
        assert Put(*fast) == decode(data)
    else:
        assert len(key) >= 256  # only keys needing bin16 fall back
    assert split_put(bytearray(data)) is None and split_put(memoryview(data)) is None
    for bad in (data[:-1], data + b"x", data[:3] + b"\xff" + data[4:]):
        got = split_put(bad)
        if got is not None:
            assert Put(*got) == decode(bad)
