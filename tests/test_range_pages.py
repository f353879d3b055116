"""Range pages (``raftkv.server.range_ops``) over the real state stores, without a server.

Properties: paging through a range with any limit returns exactly the user keys of the
range, in key order, each once; the state machine's own rows (batch markers) never
appear; a table's merged pages, made from one page per partition, do the same across
partitions; and a key that does not change during a scan is returned exactly once while
other keys are written between pages.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from raftkv.storage.commands import encode_batch, encode_delete, encode_put
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.state_store import MemoryStateStore, StateStore

from raftkv.placement.assignments import partition_of
from raftkv.server.range_ops import (
    RangeRequest,
    decode_token,
    merge_pages,
    page_from_json,
    page_json,
    prefix_end,
    read_page,
)

KEYS = st.binary(min_size=1, max_size=6)


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    s: StateStore = (MemoryStateStore() if request.param == "memory"
                     else LmdbStateStore(tmp_path / "state"))
    yield s
    s.close()


class _Writer:
    def __init__(self, store: StateStore) -> None:
        self.store, self.index = store, 0

    def run(self, cmd: bytes) -> None:
        self.index += 1
        self.store.apply([(self.index, cmd)])


def _page_all(state: StateStore, start: bytes, end: bytes | None, limit: int,
              between: list[bytes] | None = None) -> list[bytes]:
    """Every key of ``[start, end)``, page by page as a client pages; ``between``: keys to
    write after each page."""
    out: list[bytes] = []
    after = None
    w = _Writer(state)
    w.index = state.applied_index()
    while True:
        req = RangeRequest(start, end, limit, after)
        doc = page_json(read_page(state, req), req)
        out += [k for k, _ in page_from_json(doc)["kvs"]]
        if between:
            w.run(encode_put(between.pop(), b"written between pages"))
        if not doc["more"]:
            return out
        after = decode_token(doc["continue"].encode(), start, end)


def test_prefix_end() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") is None
    assert prefix_end(b"") is None


@settings(max_examples=60, deadline=None)
@given(keys=st.sets(KEYS, max_size=40), lo=KEYS, hi=st.one_of(st.none(), KEYS),
       limit=st.integers(1, 7))
def test_paging_returns_every_user_key_of_the_range_once_in_order(
        keys: set[bytes], lo: bytes, hi: bytes | None, limit: int) -> None:
    state = MemoryStateStore()
    w = _Writer(state)
    for k in keys:
        w.run(encode_put(k, b"v" + k))
    w.run(encode_batch([(b"loaded", b"x")], b"batch-1"))  # writes a reserved marker row
    if hi is not None and hi < lo:
        lo, hi = hi, lo
    want = sorted(k for k in keys | {b"loaded"} if k >= lo and (hi is None or k < hi))
    assert _page_all(state, lo, hi, limit) == want


def test_lmdb_and_memory_pages_agree_and_values_come_back(store: StateStore) -> None:
    w = _Writer(store)
    for i in range(30):
        w.run(encode_put(b"k%02d" % i, b"value %d" % i))
    w.run(encode_delete(b"k05"))
    w.run(encode_batch([(b"k05", None)], b"id"))  # and writes its reserved marker row
    page = read_page(store, RangeRequest(b"k", prefix_end(b"k"), 10))
    assert [k for k, _ in page["kvs"]] == [b"k%02d" % i for i in range(11) if i != 5]
    assert page["kvs"][0] == (b"k00", b"value 0") and page["more"]
    assert page["revision"] == store.applied_index()
    assert read_page(store, RangeRequest(b"", None, count_only=True))["count"] == 29
    assert all(v is None for _, v in
               read_page(store, RangeRequest(b"", None, 5, keys_only=True))["kvs"])


def test_a_key_unchanged_during_a_scan_is_returned_once(store: StateStore) -> None:
    """Writes between pages (new keys on both sides of the continuation point) neither
    repeat nor hide a key that was there all along."""
    w = _Writer(store)
    stable = [b"s%03d" % i for i in range(0, 60, 2)]
    for k in stable:
        w.run(encode_put(k, b"x"))
    between = [b"s%03d" % i for i in range(1, 60, 2)]
    random.Random(3).shuffle(between)
    got = _page_all(store, b"s", prefix_end(b"s"), 4, between=between)
    assert len(got) == len(set(got)) and got == sorted(got)
    assert set(stable) <= set(got)


def test_a_page_stops_at_its_byte_budget(store: StateStore) -> None:
    from raftkv.server import range_ops
    w = _Writer(store)
    big = b"x" * (512 << 10)
    for i in range(12):
        w.run(encode_put(b"big%02d" % i, big))
    page = read_page(store, RangeRequest(b"big", None, 100))
    assert page["more"] and 0 < len(page["kvs"]) <= range_ops.PAGE_BYTES // len(big)


@settings(max_examples=60, deadline=None)
@given(keys=st.sets(KEYS, max_size=60), parts=st.integers(1, 5), limit=st.integers(1, 6))
def test_merged_table_pages_return_every_key_once_in_order(
        keys: set[bytes], parts: int, limit: int) -> None:
    """One page per partition, each read with the same limit and continuation, merged:
    paging through gives exactly the table's keys in order."""
    stores = [MemoryStateStore() for _ in range(parts)]
    writers = [_Writer(s) for s in stores]
    for k in keys:
        writers[partition_of(k, parts)].run(encode_put(k, k))
    out: list[bytes] = []
    after = None
    while True:
        req = RangeRequest(b"", None, limit, after)
        merged = page_json(merge_pages({p: read_page(s, req) for p, s in enumerate(stores)},
                                       limit), req)
        assert set(merged["revision"]) == {str(p) for p in range(parts)}
        page = page_from_json({**merged, "revision": 0})
        assert len(page["kvs"]) <= limit
        out += [k for k, _ in page["kvs"]]
        if not merged["more"]:
            break
        after = decode_token(merged["continue"].encode(), b"", None)
    assert out == sorted(keys)
    counts = merge_pages({p: read_page(s, RangeRequest(b"", None, count_only=True))
                          for p, s in enumerate(stores)}, 1)
    assert counts["count"] == len(keys)


def test_a_token_names_its_range() -> None:
    import pytest as _pytest
    from raftkv.storage.commands import CommandError
    req = RangeRequest(b"a", b"b", 1)
    token = page_json({"revision": 1, "kvs": [(b"a1", b"x")], "more": True}, req)["continue"]
    assert decode_token(token.encode(), b"a", b"b") == b"a1"
    for start, end in ((b"a", None), (b"", b"b"), (b"user:", b"user;")):
        with _pytest.raises(CommandError, match="another range"):
            decode_token(token.encode(), start, end)
    for junk in (b"YQ==", b"%%%", b"", b"kQ=="):
        with _pytest.raises(CommandError, match="not a continuation token"):
            decode_token(junk, b"a", b"b")


def test_a_token_names_the_table_it_was_read_from() -> None:
    """Found from outside: a token from table t1 given to t2 (or to the default group)
    was accepted, and the page silently skipped t2's keys up to t1's last key."""
    import pytest as _pytest
    from raftkv.storage.commands import CommandError
    t1 = page_json({"revision": 1, "kvs": [(b"m", b"x")], "more": True},
                   RangeRequest(b"", None, 1, space="t1"))["continue"].encode()
    assert decode_token(t1, b"", None, "t1") == b"m"
    for space, whose in (("t2", "table 't1'"), ("", "table 't1'")):
        with _pytest.raises(CommandError, match=whose):
            decode_token(t1, b"", None, space)
    default = page_json({"revision": 1, "kvs": [(b"m", b"x")], "more": True},
                        RangeRequest(b"", None, 1))["continue"].encode()
    with _pytest.raises(CommandError, match="default key space"):
        decode_token(default, b"", None, "t2")
