"""Per-key revisions (``raftkv.storage.revisions``) in both state stores.

Every write sets the key's mod revision to its entry's log index, keeps its create
revision and counts its version; a delete starts the key over. The rows carry them
through snapshots and crash replay, so replicas stay byte-identical (``digest(revisions=
True)``), and a compare on the mod revision (``CAS_INDEX``, ``?prev_index=``) is decided the
same way everywhere.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from raftkv.storage.commands import (
    CommandError,
    decode,
    encode_batch,
    encode_cas,
    encode_cas_index,
    encode_delete,
    encode_put,
)
from raftkv.storage.errors import StorageError
from raftkv.storage.lmdb_checkpoint import RECORD_FILE
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.revisions import KeyMeta
from raftkv.storage.state_store import KVStateStore, MemoryStateStore


def test_writes_set_revisions_and_a_delete_starts_the_key_over(kv_store: KVStateStore) -> None:
    kv_store.apply([(1, encode_put(b"k", b"a")), (2, b""), (3, encode_put(b"k", b"b"))])
    assert kv_store.get_meta(b"k") == KeyMeta(b"b", 1, 3, 2)
    assert kv_store.get(b"k") == b"b"
    kv_store.apply([(4, encode_put(b"k", b"b"))])  # the same value is still a write
    assert kv_store.get_meta(b"k") == KeyMeta(b"b", 1, 4, 3)
    kv_store.apply([(5, encode_delete(b"k")), (6, encode_put(b"k", b"c"))])
    assert kv_store.get_meta(b"k") == KeyMeta(b"c", 6, 6, 1)
    assert kv_store.get_meta(b"nope") is None
    kv_store.apply([(7, encode_batch([(b"k", b"d"), (b"j", b"x"), (b"k", b"e")]))])
    assert kv_store.get_meta(b"k") == KeyMeta(b"e", 6, 7, 3)  # written twice in the entry
    assert kv_store.get_meta(b"j") == KeyMeta(b"x", 7, 7, 1)
    assert list(kv_store.scan()) == [(b"j", b"x"), (b"k", b"e")]  # values, not rows


def test_a_compare_on_the_mod_revision(kv_store: KVStateStore) -> None:
    res = kv_store.apply([
        (1, encode_cas_index(b"k", 0, b"a")),   # absent: swaps
        (2, encode_cas_index(b"k", 0, b"b")),   # no longer absent
        (3, encode_cas_index(b"k", 1, b"c")),   # mod revision 1: swaps
        (4, encode_cas_index(b"k", 1, b"d")),   # now 3
        (5, encode_cas(b"k", b"c", b"e")),      # the value compare sets revisions too
        (6, encode_cas_index(b"k", 5, None)),   # a compare-and-delete
    ])
    assert res == [True, False, True, False, True, True]
    assert kv_store.get_meta(b"k") is None
    assert kv_store.apply([(7, encode_cas_index(b"k", 5, None))]) == [False]


def test_the_command_is_validated() -> None:
    for bad in (-1, 1 << 63, True, "3"):
        with pytest.raises(CommandError):
            encode_cas_index(b"k", bad, b"v")  # type: ignore[arg-type]
        with pytest.raises(CommandError):
            decode(msgpack.packb([5, b"k", bad, b"v"], use_bin_type=True))
    with pytest.raises(CommandError):
        decode(msgpack.packb([5, b"k", 1], use_bin_type=True))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]),
                          st.one_of(st.none(), st.binary(max_size=3))), max_size=30),
       st.integers(1, 29))
def test_snapshots_and_crash_replay_keep_the_rows_byte_identical(
        ops: list[tuple[bytes, bytes | None]], checkpoint_at: int) -> None:
    """The same log through a crash (memory) and through a snapshot into the other
    implementation gives the same rows, revisions included."""
    entries = [(i + 1, encode_put(k, v) if v is not None else encode_delete(k))
               for i, (k, v) in enumerate(ops)]
    ref = MemoryStateStore()
    ref.apply(entries)
    crashed = MemoryStateStore()
    cut = min(checkpoint_at, len(entries))
    crashed.apply(entries[:cut])
    crashed.checkpoint()
    crashed.apply(entries[cut:])
    crashed.crash()
    crashed.apply(entries[crashed.applied_index():])
    assert list(crashed.scan_rows()) == list(ref.scan_rows())
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        lm = LmdbStateStore(Path(d) / "s")
        try:
            lm.install_snapshot(ref.snapshot_chunks(chunk_bytes=64))
            assert list(lm.scan_rows()) == list(ref.scan_rows())
            assert lm.digest(revisions=True) == ref.digest(revisions=True)
        finally:
            lm.close()


def test_the_revisions_digest_tells_apart_what_the_value_digest_cannot() -> None:
    a, b = MemoryStateStore(), MemoryStateStore()
    a.apply([(1, encode_put(b"k", b"v")), (2, b"")])
    b.apply([(1, b""), (2, encode_put(b"k", b"v"))])
    assert a.digest() == b.digest()
    assert a.digest(revisions=True) != b.digest(revisions=True)


def test_a_snapshot_without_revisions_or_with_bad_ones_is_refused(kv_store: KVStateStore) -> None:
    kv_store.apply([(1, encode_put(b"keep", b"me"))])
    src = MemoryStateStore()
    src.apply([(1, encode_put(b"k", b"v")), (2, encode_put(b"k", b"w"))])
    good = list(src.snapshot_chunks())
    header = msgpack.unpackb(good[0])
    old = [msgpack.packb({k: v for k, v in header.items() if k != "kind"}), *good[1:]]
    with pytest.raises(StorageError, match="before per-key revisions"):
        kv_store.install_snapshot(old)
    rows = msgpack.unpackb(good[1])
    bad_row = ((9).to_bytes(8, "big") + (2).to_bytes(8, "big") + (1).to_bytes(8, "big")
               + bytes(8) + b"w")
    rows[0][1] = bad_row  # created after it was last written
    with pytest.raises(StorageError, match="revisions are inconsistent"):
        kv_store.install_snapshot([good[0], msgpack.packb(rows, use_bin_type=True), good[2]])
    assert kv_store.get_meta(b"keep") == KeyMeta(b"me", 1, 1, 1)


def test_a_store_from_before_revisions_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    import lmdb
    path = tmp_path / "old"
    s = LmdbStateStore(path)
    s.apply([(1, encode_put(b"k", b"v"))])
    s.close()
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"raftkv-state-v1", db=env.open_db(b"meta", txn=txn))
    env.close()
    # Versions that old kept no checkpoint record (a store with one would take this
    # edit for commits after its checkpoint, and roll it back).
    (path / RECORD_FILE).unlink()
    with pytest.raises(StorageError, match="before per-key revisions.*move the directory away"):
        LmdbStateStore(path)
