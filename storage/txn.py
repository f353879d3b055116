"""Transactions: compares over several keys, then one of two lists of operations, applied
as ONE log entry (etcd's ``Txn``).

    TXN  [6, [[key, target, op, operand], ...], [[kind, key, value | nil], ...] (then),
                                                [[kind, key, value | nil], ...] (else)]

A compare's ``target`` is the key's value, mod revision, create revision, version, or
whether it exists (``Target``); ``op`` is ``==``, ``!=``, ``<`` or ``>`` (``CmpOp``; only
``==`` and ``!=`` for existence). The operand is bytes for a value, an integer for a
revision or version (0 for an absent key, as etcd counts), a boolean for existence. A value
compare on an absent key is false, whatever the operator. The state machine evaluates every
compare at the entry's place in the log, against the rows as they are there; if all hold it
applies ``then``, else ``else``, in order, in the same transaction as everything else in the
entry. An operation is a put, a delete or a get (``Kind``); a get returns the key's value and
revisions as of that point of the transaction, so a transaction can read what it wrote.

The result of a transaction entry is a ``TxnResult``: whether the compares held, and one
answer per operation of the branch taken (a put: None; a delete: whether the key existed; a
get: a ``KeyMeta`` or None).

Limits: at most ``MAX_TXN_OPS`` compares and as many operations per branch (etcd's default
is 128 in all), of which at most ``MAX_TXN_GETS`` gets: a get answers up to a 1 MiB value,
read inside the apply on the Raft loop, and a transaction asking for hundreds of them
stalled the loop long enough to depose the leader (found from outside); read more with a
range read. No key may be written twice in one branch (etcd refuses it too): its version
would count two writes at one revision. Keys and values as for every command. Everything is checked when encoding
and again when decoding (``CommandError``), as for the other commands.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple, Protocol

from raftkv.storage.commands import (
    CommandError,
    check_key,
    check_value,
)
from raftkv.storage.revisions import KeyMeta, meta_of

MAX_TXN_OPS = 1_000
MAX_TXN_GETS = 8


class Target(IntEnum):
    # Written into the Raft log: never renumber, only append.
    VALUE = 0
    MOD = 1
    CREATE = 2
    VERSION = 3
    EXISTS = 4


class CmpOp(IntEnum):
    EQ = 0
    NE = 1
    LT = 2
    GT = 3


class Kind(IntEnum):
    PUT = 1
    DELETE = 2
    GET = 3


_TARGETS, _CMP_OPS, _KINDS = frozenset(Target), frozenset(CmpOp), frozenset(Kind)


class Compare(NamedTuple):
    key: bytes
    target: Target
    op: CmpOp
    operand: bytes | int | bool


class TxnOp(NamedTuple):
    kind: Kind
    key: bytes
    value: bytes | None = None


class Txn(NamedTuple):
    compares: tuple[Compare, ...]
    success: tuple[TxnOp, ...]
    failure: tuple[TxnOp, ...]


class TxnResult(NamedTuple):
    succeeded: bool
    responses: tuple[bool | KeyMeta | None, ...]


def check_compare(c: object, i: int, reserved: bool = False) -> Compare:
    what = f"compare {i}"
    if not isinstance(c, list | tuple) or len(c) != 4:
        raise CommandError(f"{what} must be [key, target, op, operand]")
    key, target, op, operand = c
    key = check_key(key, f"{what}: key", reserved=reserved)
    if type(target) is not int or target not in _TARGETS:
        raise CommandError(f"{what}: unknown target {target!r}")
    if type(op) is not int or op not in _CMP_OPS:
        raise CommandError(f"{what}: unknown operator {op!r}")
    t, o = Target(target), CmpOp(op)
    if t is Target.VALUE:
        operand = check_value(operand, f"{what}: value")
    elif t is Target.EXISTS:
        if type(operand) is not bool or o not in (CmpOp.EQ, CmpOp.NE):
            raise CommandError(f"{what}: existence compares == or != with true or false")
    elif type(operand) is not int or not 0 <= operand < 1 << 63:
        raise CommandError(f"{what}: a revision or version is an integer from 0, "
                           f"not {operand!r:.40}")
    return Compare(key, t, o, operand)


def check_op(op: object, i: int, branch: str, reserved: bool = False) -> TxnOp:
    what = f"{branch} op {i}"
    if not isinstance(op, list | tuple) or len(op) != 3:
        raise CommandError(f"{what} must be [kind, key, value | nil]")
    kind, key, value = op
    if type(kind) is not int or kind not in _KINDS:
        raise CommandError(f"{what}: unknown kind {kind!r} (1 put, 2 delete, 3 get)")
    k = Kind(kind)
    key = check_key(key, f"{what}: key", reserved=reserved)
    if k is Kind.PUT:
        return TxnOp(k, key, check_value(value, f"{what}: value"))
    if value is not None:
        raise CommandError(f"{what}: a {k.name.lower()} takes no value")
    return TxnOp(k, key)


def _list(xs: object, name: str) -> list[object]:
    if not isinstance(xs, list | tuple):
        raise CommandError(f"a transaction's {name} must be a list")
    if len(xs) > MAX_TXN_OPS:
        raise CommandError(f"a transaction's {name} has {len(xs)} entries, over the limit "
                           f"of {MAX_TXN_OPS}", limit=MAX_TXN_OPS, size=len(xs))
    return list(xs)


def check_txn(compares: object, success: object, failure: object,
              reserved: bool = False) -> Txn:
    """A valid ``Txn`` of the three lists, or ``CommandError``."""
    cs, ss, fs = (_list(compares, "compares"), _list(success, "success"),
                  _list(failure, "failure"))
    txn = Txn(tuple(check_compare(c, i, reserved) for i, c in enumerate(cs)),
              tuple(check_op(o, i, "success", reserved) for i, o in enumerate(ss)),
              tuple(check_op(o, i, "failure", reserved) for i, o in enumerate(fs)))
    for name, ops in (("success", txn.success), ("failure", txn.failure)):
        gets = sum(1 for o in ops if o.kind is Kind.GET)
        if gets > MAX_TXN_GETS:
            raise CommandError(f"a transaction's {name} has {gets} gets, over the limit of "
                               f"{MAX_TXN_GETS} (read more with a range read)",
                               limit=MAX_TXN_GETS, size=gets)
        written = [o.key for o in ops if o.kind is not Kind.GET]
        if len(set(written)) != len(written):
            twice = next(k for k in written if written.count(k) > 1)
            raise CommandError(f"a transaction's {name} writes key {twice[:64]!r} more than "
                               f"once")
    return txn


def wire(txn: Txn) -> list[object]:
    """The command's fields after the op code (``commands.encode_txn`` packs them)."""
    return [[[c.key, int(c.target), int(c.op), c.operand] for c in txn.compares],
            [[int(o.kind), o.key, o.value] for o in txn.success],
            [[int(o.kind), o.key, o.value] for o in txn.failure]]


def holds(c: Compare, row: bytes | None) -> bool:
    """Whether compare ``c`` holds for the key's ``row`` (None: absent)."""
    if c.target is Target.EXISTS:
        return (row is not None) == c.operand if c.op is CmpOp.EQ else (row is not None) != c.operand
    if c.target is Target.VALUE:
        if row is None:
            return False
        got: bytes | int = meta_of(row).value
    elif row is None:
        got = 0
    else:
        m = meta_of(row)
        got = {Target.MOD: m.mod_revision, Target.CREATE: m.create_revision,
               Target.VERSION: m.version}[c.target]
    want = c.operand
    if c.op is CmpOp.EQ:
        return got == want
    if c.op is CmpOp.NE:
        return got != want
    if c.op is CmpOp.LT:
        return got < want  # type: ignore[operator]
    return got > want  # type: ignore[operator]


class Rows(Protocol):
    """What a transaction needs of the apply (``state_store._Rows``)."""

    def get(self, key: bytes) -> bytes | None: ...

    def write(self, key: bytes, value: bytes, index: int, lease: int = 0) -> None: ...

    def remove(self, key: bytes) -> bool: ...


def apply_txn(txn: Txn, index: int, rows: Rows) -> TxnResult:
    """Run ``txn`` as the entry at ``index`` on one apply transaction's rows."""
    get = rows.get
    ok = all(holds(c, get(c.key)) for c in txn.compares)
    out: list[bool | KeyMeta | None] = []
    ops: Sequence[TxnOp] = txn.success if ok else txn.failure
    for op in ops:
        if op.kind is Kind.PUT:
            assert op.value is not None
            rows.write(op.key, op.value, index)
            out.append(None)
        elif op.kind is Kind.DELETE:
            out.append(rows.remove(op.key))
        else:
            row = get(op.key)
            out.append(None if row is None else meta_of(row))
    return TxnResult(ok, tuple(out))
