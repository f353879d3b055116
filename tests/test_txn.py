"""Transactions (``raftkv.storage.txn``) in both state stores, against a model.

The model is the text of the module docstring, written plainly: a dict of key ->
(value, create, mod, version). Random transactions over a few keys run through the
real encode/decode and apply paths of a memory and an LMDB store; both must agree with
the model on every result and on the final rows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from raftkv.storage.commands import CommandError, decode, encode_txn
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.revisions import KeyMeta
from raftkv.storage.state_store import MemoryStateStore
from raftkv.storage.txn import MAX_TXN_GETS, MAX_TXN_OPS, CmpOp, Compare, Kind, Target, Txn, TxnOp

KEYS = [b"a", b"b", b"c"]
Model = dict[bytes, tuple[bytes, int, int, int]]


def _model_holds(m: Model, c: Compare) -> bool:
    row = m.get(c.key)
    if c.target is Target.EXISTS:
        return (row is not None) == c.operand if c.op is CmpOp.EQ else (row is not None) != c.operand
    if c.target is Target.VALUE and row is None:
        return False
    got = {Target.VALUE: row[0] if row else None, Target.CREATE: row[1] if row else 0,
           Target.MOD: row[2] if row else 0, Target.VERSION: row[3] if row else 0}[c.target]
    return {CmpOp.EQ: got == c.operand, CmpOp.NE: got != c.operand,
            CmpOp.LT: got < c.operand, CmpOp.GT: got > c.operand}[c.op]  # type: ignore[operator]


def _model_apply(m: Model, t: Txn, index: int) -> tuple[bool, list[Any]]:
    ok = all(_model_holds(m, c) for c in t.compares)
    out: list[Any] = []
    for op in (t.success if ok else t.failure):
        row = m.get(op.key)
        if op.kind is Kind.PUT:
            assert op.value is not None
            m[op.key] = ((op.value, index, index, 1) if row is None
                         else (op.value, row[1], index, row[3] + 1))
            out.append(None)
        elif op.kind is Kind.DELETE:
            out.append(m.pop(op.key, None) is not None)
        else:
            out.append(None if row is None else KeyMeta(*row))
    return ok, out


compares = st.one_of(
    st.builds(Compare, st.sampled_from(KEYS), st.just(Target.VALUE),
              st.sampled_from(list(CmpOp)), st.sampled_from([b"", b"x", b"y"])),
    st.builds(Compare, st.sampled_from(KEYS),
              st.sampled_from([Target.MOD, Target.CREATE, Target.VERSION]),
              st.sampled_from(list(CmpOp)), st.integers(0, 12)),
    st.builds(Compare, st.sampled_from(KEYS), st.just(Target.EXISTS),
              st.sampled_from([CmpOp.EQ, CmpOp.NE]), st.booleans()),
)
ops = st.one_of(
    st.builds(TxnOp, st.just(Kind.PUT), st.sampled_from(KEYS), st.sampled_from([b"x", b"y"])),
    st.builds(TxnOp, st.sampled_from([Kind.DELETE, Kind.GET]), st.sampled_from(KEYS),
              st.none()),
)
def _writes_once(os: list[TxnOp]) -> bool:
    """A branch writes a key at most once (``check_txn`` refuses it otherwise)."""
    written = [o.key for o in os if o.kind is not Kind.GET]
    return len(set(written)) == len(written)


branch = st.lists(ops, max_size=4).filter(_writes_once).map(tuple)
txns = st.builds(Txn, st.lists(compares, max_size=3).map(tuple), branch, branch)


@settings(max_examples=80, deadline=None)
@given(st.lists(txns, min_size=1, max_size=10))
def test_transactions_match_the_model_in_both_stores(seq: list[Txn]) -> None:
    model: Model = {}
    want = [_model_apply(model, t, i + 1) for i, t in enumerate(seq)]
    entries = [(i + 1, encode_txn(t)) for i, t in enumerate(seq)]
    with tempfile.TemporaryDirectory() as d:
        for store in (MemoryStateStore(), LmdbStateStore(Path(d) / "s")):
            try:
                got = store.apply(entries)
                assert [(r.succeeded, list(r.responses)) for r in got] == want
                rows = {k: store.get_meta(k) for k in KEYS}
                assert rows == {k: (KeyMeta(*model[k]) if k in model else None) for k in KEYS}
            finally:
                store.close()


def test_a_transaction_round_trips_and_bad_ones_are_refused() -> None:
    t = Txn((Compare(b"k", Target.MOD, CmpOp.EQ, 0),),
            (TxnOp(Kind.PUT, b"k", b"v"),), (TxnOp(Kind.GET, b"k"),))
    assert decode(encode_txn(t)) == t
    bad = [
        [6, [[b"k", 9, 0, 0]], [], []],            # unknown target
        [6, [[b"k", 1, 7, 0]], [], []],            # unknown operator
        [6, [[b"k", 4, 2, True]], [], []],         # < on existence
        [6, [[b"k", 1, 0, -1]], [], []],           # negative revision
        [6, [[b"k", 1, 0, True]], [], []],         # a boolean is not a revision
        [6, [[b"k", 0, 0, 5]], [], []],            # a value compare takes bytes
        [6, [], [[1, b"k", None]], []],            # a put needs a value
        [6, [], [[2, b"k", b"v"]], []],            # a delete takes none
        [6, [], [[4, b"k", None]], []],            # unknown kind
        [6, [], [[1, b"", b"v"]], []],             # empty key
        [6, [], [], [[3, b"k" * 600, None]]],      # key too long
        [6, [], []],                               # missing a branch
        [6, [[b"k", 1, 0, 0]] * (MAX_TXN_OPS + 1), [], []],
        [6, [], [[3, b"k", None]] * (MAX_TXN_GETS + 1), []],   # too many gets
        [6, [], [[1, b"k", b"v"], [2, b"k", None]], []],        # k written twice
    ]
    for b in bad:
        with pytest.raises(CommandError):
            decode(msgpack.packb(b, use_bin_type=True))
    with pytest.raises(CommandError):
        encode_txn(Txn((), (TxnOp(Kind.PUT, b"\x00raftkv.batch.x", b"v"),), ()))
    # A bad entry in the log is a result, and the store goes on.
    s = MemoryStateStore()
    res = s.apply([(1, msgpack.packb(bad[0], use_bin_type=True)), (2, encode_txn(t))])
    assert isinstance(res[0], CommandError) and res[1].succeeded
