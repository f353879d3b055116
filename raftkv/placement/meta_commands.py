"""Metastore commands: conditions, operations, the conditional multi-key ``invoke`` and its
if/else tree, their msgpack wire format, strict decoding, and pure evaluation.

Theory of operation
-------------------
The rebalance protocol (Ignite 3's rebalance design, IGNITE-16668) drives everything through *atomic
conditional writes* on the metastore: "if the trigger revision is older than this event and
nothing is pending, write pending and the trigger". A command is evaluated against the
store's state at its log index, on every replica, so evaluation must be a pure function of
(state, command bytes). This module holds that function; the store (``metastore.py``) only
supplies a ``lookup`` of the current ``VersionedValue`` of a key and a ``write`` that
applies the chosen operations.

Commands (each the ``data`` of one Raft entry):

- ``put(key, value)`` and ``remove(key)``: result ``WriteResult(changed, revision)``.
- ``invoke(conditions, success, failure)``: etcd's txn. The conditions are ANDed (an empty
  list is true); ``success`` runs if they hold, else ``failure``. Result
  ``InvokeResult(succeeded, revision)``.
- ``iif(tree)``: Ignite's multi-invoke, for the seeds' nested pseudocode. ``If(cond, then,
  otherwise)`` where each branch is another ``If`` or a leaf ``Do(tag, *ops)``. The leaf
  reached runs, and its ``tag`` (Ignite's ``yield``) says which one it was. Result
  ``BranchResult(tag, revision)``. Conditions may be combined with ``&`` (AND) and ``|``
  (OR), as the seeds' ``empty(trigger) || trigger < event.revision`` needs.

``revision`` in every result is the store's revision after the command (unchanged when the
command changed nothing). Conditions read the state *before* the command's operations.

Condition semantics (``lookup(key)`` is None when the key is absent):

- ``Cond.value(k).eq/ne/lt/le/gt/ge(v)``: the stored bytes against ``v``, compared
  lexicographically (as etcd and Ignite do). An absent key has no value: ``ne`` is true and
  every other comparison is false. Encode integers with ``encode_revision`` (8-byte
  big-endian) so byte order is numeric order, e.g. for ``change.trigger.revision``.
- ``Cond.revision(k).eq/ne/lt/le/gt/ge(r)``: the key's ``mod_revision``. An absent key has
  revision 0 (as in etcd), so ``revision(k).eq(0)`` means "still absent", which is what a
  read-modify-write retry loop wants after reading nothing.
- ``Cond.exists(k)`` / ``Cond.not_exists(k)``.
- ``Cond.empty(k)`` / ``Cond.not_empty(k)``: *empty* is "absent, or present with an empty
  value". Seed 004 sets ``pending = empty`` when a rebalance finishes and later tests
  ``empty(pending)``; Ignite writes an empty marker value rather than deleting. Both
  spellings must read as empty, so callers may either remove a key or write ``b""``.
- ``Cond.all_of(...)`` / ``&`` and ``Cond.any_of(...)`` / ``|``; ``all_of()`` is true and
  ``any_of()`` is false.

Operations: ``Op.put(k, v)``, ``Op.remove(k)`` and ``Op.noop()`` (the seeds' "skip"; it is
dropped at encoding). A branch may not touch the same key twice: the result would depend on
op order and the revision's events would be ambiguous (etcd refuses such a txn too).

Wire format (msgpack arrays, ``use_bin_type=True``; the numbers are written to the Raft log,
never renumber them)::

    PUT     [1, key, value]
    REMOVE  [2, key]
    INVOKE  [3, [cond, ...], [op, ...], [op, ...]]
    IIF     [4, branch]        branch = [0, tag, [op, ...]]            (Do)
                                      | [1, cond, branch, branch]      (If)
    op      [1, key, value] | [2, key]
    cond    [1, key, cmp, bytes]  value        cmp: 1 EQ 2 NE 3 LT 4 LE 5 GT 6 GE
            [2, key, cmp, int]    revision
            [3, key] exists   [4, key] not exists   [5, key] empty   [6, key] not empty
            [7, [cond, ...]] all of   [8, [cond, ...]] any of

Limits: keys 1..509 bytes (the store prefixes each key with 2 bytes and LMDB keys stop at
511); values up to 1 MiB - 1 KiB (an event row ``[key, value]`` must fit the snapshot
format's 1 MiB row value); revisions and tags 0..2**63-1 and 0..2**32-1; nesting depth
``MAX_DEPTH``; at most ``MAX_BATCH_OPS`` operations and as many conditions per command;
16 MiB encoded. ``encode_*`` validate by decoding what they produced, so anything they
return decodes. ``decode`` raises only ``CommandError``; the store turns it into the entry's
result, the same on every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple, TypeAlias

import msgpack

from raftkv.storage.commands import (
    MAX_BATCH_OPS,
    MAX_COMMAND_BYTES,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    UNPACK_ERRORS,
    CommandError,
)

KEY_ROW_PREFIX_BYTES = 2
MAX_META_KEY_BYTES = MAX_KEY_BYTES - KEY_ROW_PREFIX_BYTES  # 509
MAX_META_VALUE_BYTES = MAX_VALUE_BYTES - 1024  # room for the event row's key and framing
MAX_REVISION = (1 << 63) - 1
MAX_TAG = (1 << 32) - 1
MAX_DEPTH = 16  # nested If/any_of/all_of levels; the seeds need 3


class Kind(IntEnum):
    """Command kinds (written into the Raft log: never renumber, only append)."""

    PUT = 1
    REMOVE = 2
    INVOKE = 3
    IIF = 4


class OpKind(IntEnum):
    NOOP = 0  # builder only: never encoded
    PUT = 1
    REMOVE = 2


class CondKind(IntEnum):
    VALUE = 1
    REVISION = 2
    EXISTS = 3
    NOT_EXISTS = 4
    EMPTY = 5
    NOT_EMPTY = 6
    ALL = 7
    ANY = 8


class Cmp(IntEnum):
    EQ = 1
    NE = 2
    LT = 3
    LE = 4
    GT = 5
    GE = 6


class VersionedValue(NamedTuple):
    """A key's state: its value, the revision of its last change, the revision that created
    it (since it last did not exist)."""

    value: bytes
    mod_revision: int
    create_revision: int


Lookup: TypeAlias = Callable[[bytes], "VersionedValue | None"]


class WriteResult(NamedTuple):
    """Result of ``put``/``remove``: ``changed`` is False for a remove of an absent key."""

    changed: bool
    revision: int


class InvokeResult(NamedTuple):
    succeeded: bool
    revision: int


class BranchResult(NamedTuple):
    """Result of ``iif``: the ``tag`` of the ``Do`` leaf that ran."""

    tag: int
    revision: int


def encode_revision(revision: int) -> bytes:
    """An integer as 8 big-endian bytes: byte order is numeric order (for value conditions)."""
    if type(revision) is not int or not 0 <= revision <= MAX_REVISION:
        raise CommandError(f"revision must be an int in 0..2**63-1, got {revision!r}")
    return revision.to_bytes(8, "big")


def decode_revision(data: bytes) -> int:
    if type(data) is not bytes or len(data) != 8:
        raise CommandError(f"an encoded revision is 8 bytes, got {data!r:.40}")
    return int.from_bytes(data, "big")


# -- validation --------------------------------------------------------------------------------
def check_meta_key(key: object, what: str = "key") -> bytes:
    if type(key) is not bytes:
        raise CommandError(f"{what} must be bytes, not {type(key).__name__}")
    n = len(key)
    if not 0 < n <= MAX_META_KEY_BYTES:
        raise CommandError(
            f"{what} is {n} bytes: metastore keys must be 1..{MAX_META_KEY_BYTES} bytes",
            limit=MAX_META_KEY_BYTES,
            size=n,
        )
    return key


def check_meta_value(value: object, what: str = "value") -> bytes:
    if type(value) is not bytes:
        raise CommandError(f"{what} must be bytes, not {type(value).__name__}")
    n = len(value)
    if n > MAX_META_VALUE_BYTES:
        raise CommandError(
            f"{what} is {n} bytes, over the metastore limit of {MAX_META_VALUE_BYTES} bytes",
            limit=MAX_META_VALUE_BYTES,
            size=n,
        )
    return value


def _check_int(x: object, hi: int, what: str) -> int:
    if type(x) is not int or not 0 <= x <= hi:
        raise CommandError(f"{what} must be an int in 0..{hi}, got {x!r:.40}")
    return x


def _compare(cmp: Cmp, a: bytes | int, b: bytes | int) -> bool:
    if cmp is Cmp.EQ:
        return a == b
    if cmp is Cmp.NE:
        return a != b
    if cmp is Cmp.LT:
        return a < b  # type: ignore[operator]
    if cmp is Cmp.LE:
        return a <= b  # type: ignore[operator]
    if cmp is Cmp.GT:
        return a > b  # type: ignore[operator]
    return a >= b  # type: ignore[operator]


# -- conditions --------------------------------------------------------------------------------
class Condition:
    """A predicate over the store's state. Combine with ``&`` and ``|``."""

    __slots__ = ()

    def test(self, lookup: Lookup) -> bool:
        raise NotImplementedError

    def wire(self) -> list[object]:
        raise NotImplementedError

    def __and__(self, other: Condition) -> AllOf:
        return Cond.all_of(self, other)

    def __or__(self, other: Condition) -> AnyOf:
        return Cond.any_of(self, other)


@dataclass(frozen=True, slots=True)
class ValueCond(Condition):
    key: bytes
    cmp: Cmp
    operand: bytes

    def test(self, lookup: Lookup) -> bool:
        cur = lookup(self.key)
        if cur is None:  # no value: it differs from everything and orders with nothing
            return self.cmp is Cmp.NE
        return _compare(self.cmp, cur.value, self.operand)

    def wire(self) -> list[object]:
        return [int(CondKind.VALUE), self.key, int(self.cmp), self.operand]


@dataclass(frozen=True, slots=True)
class RevisionCond(Condition):
    key: bytes
    cmp: Cmp
    revision: int

    def test(self, lookup: Lookup) -> bool:
        cur = lookup(self.key)
        return _compare(self.cmp, 0 if cur is None else cur.mod_revision, self.revision)

    def wire(self) -> list[object]:
        return [int(CondKind.REVISION), self.key, int(self.cmp), self.revision]


@dataclass(frozen=True, slots=True)
class ExistsCond(Condition):
    key: bytes
    exists: bool

    def test(self, lookup: Lookup) -> bool:
        return (lookup(self.key) is not None) is self.exists

    def wire(self) -> list[object]:
        return [int(CondKind.EXISTS if self.exists else CondKind.NOT_EXISTS), self.key]


@dataclass(frozen=True, slots=True)
class EmptyCond(Condition):
    key: bytes
    empty: bool

    def test(self, lookup: Lookup) -> bool:
        cur = lookup(self.key)
        return (cur is None or cur.value == b"") is self.empty

    def wire(self) -> list[object]:
        return [int(CondKind.EMPTY if self.empty else CondKind.NOT_EMPTY), self.key]


@dataclass(frozen=True, slots=True)
class AllOf(Condition):
    conditions: tuple[Condition, ...]

    def test(self, lookup: Lookup) -> bool:
        return all(c.test(lookup) for c in self.conditions)

    def wire(self) -> list[object]:
        return [int(CondKind.ALL), [c.wire() for c in self.conditions]]


@dataclass(frozen=True, slots=True)
class AnyOf(Condition):
    conditions: tuple[Condition, ...]

    def test(self, lookup: Lookup) -> bool:
        return any(c.test(lookup) for c in self.conditions)

    def wire(self) -> list[object]:
        return [int(CondKind.ANY), [c.wire() for c in self.conditions]]


class _Target:
    __slots__ = ("key",)

    def __init__(self, key: bytes) -> None:
        self.key = key


class ValueTarget(_Target):
    """``Cond.value(key)``: compare the key's value bytes."""

    def _c(self, cmp: Cmp, v: bytes) -> ValueCond:
        return ValueCond(self.key, cmp, v)

    def eq(self, v: bytes) -> ValueCond:
        return self._c(Cmp.EQ, v)

    def ne(self, v: bytes) -> ValueCond:
        return self._c(Cmp.NE, v)

    def lt(self, v: bytes) -> ValueCond:
        return self._c(Cmp.LT, v)

    def le(self, v: bytes) -> ValueCond:
        return self._c(Cmp.LE, v)

    def gt(self, v: bytes) -> ValueCond:
        return self._c(Cmp.GT, v)

    def ge(self, v: bytes) -> ValueCond:
        return self._c(Cmp.GE, v)


class RevisionTarget(_Target):
    """``Cond.revision(key)``: compare the key's mod_revision (0 when absent)."""

    def _c(self, cmp: Cmp, r: int) -> RevisionCond:
        return RevisionCond(self.key, cmp, r)

    def eq(self, r: int) -> RevisionCond:
        return self._c(Cmp.EQ, r)

    def ne(self, r: int) -> RevisionCond:
        return self._c(Cmp.NE, r)

    def lt(self, r: int) -> RevisionCond:
        return self._c(Cmp.LT, r)

    def le(self, r: int) -> RevisionCond:
        return self._c(Cmp.LE, r)

    def gt(self, r: int) -> RevisionCond:
        return self._c(Cmp.GT, r)

    def ge(self, r: int) -> RevisionCond:
        return self._c(Cmp.GE, r)


class Cond:
    """Condition builders: ``Cond.value(k).eq(v)``, ``Cond.revision(k).lt(r)``,
    ``Cond.exists(k)``, ``Cond.empty(k)``, ``Cond.any_of(a, b)`` (or ``a | b``), ..."""

    @staticmethod
    def value(key: bytes) -> ValueTarget:
        return ValueTarget(key)

    @staticmethod
    def revision(key: bytes) -> RevisionTarget:
        return RevisionTarget(key)

    @staticmethod
    def exists(key: bytes) -> ExistsCond:
        return ExistsCond(key, True)

    @staticmethod
    def not_exists(key: bytes) -> ExistsCond:
        return ExistsCond(key, False)

    @staticmethod
    def empty(key: bytes) -> EmptyCond:
        return EmptyCond(key, True)

    @staticmethod
    def not_empty(key: bytes) -> EmptyCond:
        return EmptyCond(key, False)

    @staticmethod
    def all_of(*conditions: Condition) -> AllOf:
        flat: list[Condition] = []
        for c in conditions:  # flatten a & b & c into one level (keeps nesting shallow)
            flat.extend(c.conditions if isinstance(c, AllOf) else (c,))
        return AllOf(tuple(flat))

    @staticmethod
    def any_of(*conditions: Condition) -> AnyOf:
        flat: list[Condition] = []
        for c in conditions:
            flat.extend(c.conditions if isinstance(c, AnyOf) else (c,))
        return AnyOf(tuple(flat))


# -- operations and branches -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Op:
    """``Op.put(k, v)``, ``Op.remove(k)``, ``Op.noop()``. A decoded PUT/REMOVE command is an Op."""

    kind: OpKind
    key: bytes = b""
    value: bytes | None = None

    @staticmethod
    def put(key: bytes, value: bytes) -> Op:
        return Op(OpKind.PUT, key, value)

    @staticmethod
    def remove(key: bytes) -> Op:
        return Op(OpKind.REMOVE, key)

    @staticmethod
    def noop() -> Op:
        return Op(OpKind.NOOP)

    def wire(self) -> list[object]:
        if self.kind is OpKind.PUT:
            return [int(OpKind.PUT), self.key, self.value]
        return [int(OpKind.REMOVE), self.key]


def _real_ops(ops: Iterable[Op]) -> tuple[Op, ...]:
    out = []
    for op in ops:
        if not isinstance(op, Op):
            raise CommandError(f"expected an Op, got {type(op).__name__}")
        if op.kind is not OpKind.NOOP:
            out.append(op)
    return tuple(out)


class Do:
    """A leaf of an ``If`` tree: run ``ops`` and report ``tag`` (Ignite's ``yield``)."""

    __slots__ = ("ops", "tag")

    def __init__(self, tag: int, *ops: Op) -> None:
        self.tag = tag
        self.ops = _real_ops(ops)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Do) and (self.tag, self.ops) == (other.tag, other.ops)

    def __hash__(self) -> int:
        return hash((self.tag, self.ops))

    def __repr__(self) -> str:
        return f"Do({self.tag}{''.join(', ' + repr(o) for o in self.ops)})"


@dataclass(frozen=True, slots=True)
class If:
    """``If(cond, then, otherwise)``: each branch is another ``If`` or a ``Do`` leaf."""

    cond: Condition
    then: If | Do
    otherwise: If | Do


@dataclass(frozen=True, slots=True)
class Invoke:
    conditions: tuple[Condition, ...]
    success: tuple[Op, ...]
    failure: tuple[Op, ...]


Command: TypeAlias = Op | Invoke | If | Do


# -- encoding ----------------------------------------------------------------------------------
def _ops_wire(ops: Iterable[Op]) -> list[object]:
    return [op.wire() for op in _real_ops(ops)]


def _branch_wire(b: If | Do) -> list[object]:
    if isinstance(b, Do):
        return [0, b.tag, _ops_wire(b.ops)]
    if isinstance(b, If):
        if not isinstance(b.cond, Condition):
            raise CommandError(f"If.cond must be a Condition, got {type(b.cond).__name__}")
        return [1, b.cond.wire(), _branch_wire(b.then), _branch_wire(b.otherwise)]
    raise CommandError(f"an If branch must be an If or a Do, got {type(b).__name__}")


def _finish(obj: list[object]) -> bytes:
    try:
        data: bytes = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CommandError(f"cannot encode metastore command: {e}") from None
    decode(data)  # the same checks a replica runs: what we emit always decodes
    return data


def encode_put(key: bytes, value: bytes) -> bytes:
    return _finish([int(Kind.PUT), key, value])


def encode_remove(key: bytes) -> bytes:
    return _finish([int(Kind.REMOVE), key])


def encode_invoke(
    conditions: Iterable[Condition], success: Iterable[Op], failure: Iterable[Op] = ()
) -> bytes:
    """etcd-style txn: if every condition holds run ``success``, else ``failure``."""
    conds = list(conditions)
    for c in conds:
        if not isinstance(c, Condition):
            raise CommandError(f"expected a Condition, got {type(c).__name__}")
    return _finish(
        [int(Kind.INVOKE), [c.wire() for c in conds], _ops_wire(success), _ops_wire(failure)]
    )


def encode_iif(tree: If | Do) -> bytes:
    """Ignite-style multi-invoke: the ``Do`` leaf reached through the ``If`` tree runs."""
    return _finish([int(Kind.IIF), _branch_wire(tree)])


def encode(cmd: Command) -> bytes:
    """Encode a decoded (or built) command; ``decode(encode(c)) == c`` (noops dropped)."""
    if isinstance(cmd, Op):
        if cmd.kind is OpKind.PUT:
            return encode_put(cmd.key, cmd.value)  # type: ignore[arg-type]
        if cmd.kind is OpKind.REMOVE:
            return encode_remove(cmd.key)
        raise CommandError("a noop is not a command")
    if isinstance(cmd, Invoke):
        return encode_invoke(cmd.conditions, cmd.success, cmd.failure)
    return encode_iif(cmd)


# -- decoding ----------------------------------------------------------------------------------
_UNPACK_LIMITS: dict[str, int] = {
    "max_bin_len": MAX_VALUE_BYTES,
    "max_str_len": 0,
    "max_array_len": MAX_BATCH_OPS,
    "max_map_len": 0,
    "max_ext_len": 0,
}


class _Decoder:
    """One command's decoding, with its running totals (ops, conditions) for the limits."""

    def __init__(self) -> None:
        self.ops = 0
        self.conds = 0

    def _list(self, obj: object, what: str) -> list[object]:
        if type(obj) is not list:
            raise CommandError(f"malformed {what}: expected a list, got {type(obj).__name__}")
        return obj

    def op(self, obj: object, what: str) -> Op:
        f = self._list(obj, what)
        self.ops += 1
        if self.ops > MAX_BATCH_OPS:
            raise CommandError(
                f"command has over {MAX_BATCH_OPS} operations",
                limit=MAX_BATCH_OPS,
                size=self.ops,
            )
        if f and type(f[0]) is int and f[0] == OpKind.PUT:
            if len(f) != 3:
                raise CommandError(f"malformed {what}: put is [1, key, value]")
            return Op(
                OpKind.PUT,
                check_meta_key(f[1], f"{what} key"),
                check_meta_value(f[2], f"{what} value"),
            )
        if f and type(f[0]) is int and f[0] == OpKind.REMOVE:
            if len(f) != 2:
                raise CommandError(f"malformed {what}: remove is [2, key]")
            return Op(OpKind.REMOVE, check_meta_key(f[1], f"{what} key"))
        raise CommandError(f"malformed {what}: unknown op {f[0] if f else None!r:.20}")

    def ops_list(self, obj: object, what: str) -> tuple[Op, ...]:
        ops = tuple(self.op(o, f"{what} op {i}") for i, o in enumerate(self._list(obj, what)))
        keys = {op.key for op in ops}
        if len(keys) != len(ops):
            raise CommandError(f"{what} touches the same key twice (one op per key per branch)")
        return ops

    def cond(self, obj: object, depth: int, what: str) -> Condition:
        if depth > MAX_DEPTH:
            raise CommandError(f"{what}: nested deeper than {MAX_DEPTH} levels")
        f = self._list(obj, what)
        self.conds += 1
        if self.conds > MAX_BATCH_OPS:
            raise CommandError(f"command has over {MAX_BATCH_OPS} conditions")
        if not f or type(f[0]) is not int:
            raise CommandError(f"malformed {what}: expected [kind, ...]")
        kind = f[0]
        if kind in (CondKind.VALUE, CondKind.REVISION):
            if len(f) != 4 or type(f[2]) is not int or not Cmp.EQ <= f[2] <= Cmp.GE:
                raise CommandError(f"malformed {what}: expected [{kind}, key, cmp 1..6, operand]")
            key = check_meta_key(f[1], f"{what} key")
            if kind == CondKind.VALUE:
                return ValueCond(key, Cmp(f[2]), check_meta_value(f[3], f"{what} operand"))
            return RevisionCond(key, Cmp(f[2]), _check_int(f[3], MAX_REVISION, f"{what} revision"))
        if kind in (CondKind.EXISTS, CondKind.NOT_EXISTS, CondKind.EMPTY, CondKind.NOT_EMPTY):
            if len(f) != 2:
                raise CommandError(f"malformed {what}: expected [{kind}, key]")
            key = check_meta_key(f[1], f"{what} key")
            if kind in (CondKind.EXISTS, CondKind.NOT_EXISTS):
                return ExistsCond(key, kind == CondKind.EXISTS)
            return EmptyCond(key, kind == CondKind.EMPTY)
        if kind in (CondKind.ALL, CondKind.ANY):
            if len(f) != 2:
                raise CommandError(f"malformed {what}: expected [{kind}, [cond, ...]]")
            items = self._list(f[1], what)
            subs = tuple(self.cond(c, depth + 1, f"{what}.{i}") for i, c in enumerate(items))
            return AllOf(subs) if kind == CondKind.ALL else AnyOf(subs)
        raise CommandError(f"malformed {what}: unknown condition kind {kind}")

    def branch(self, obj: object, depth: int, what: str) -> If | Do:
        if depth > MAX_DEPTH:
            raise CommandError(f"{what}: nested deeper than {MAX_DEPTH} levels")
        f = self._list(obj, what)
        if len(f) == 3 and type(f[0]) is int and f[0] == 0:
            do = Do(_check_int(f[1], MAX_TAG, f"{what} tag"))
            do.ops = self.ops_list(f[2], what)
            return do
        if len(f) == 4 and type(f[0]) is int and f[0] == 1:
            return If(
                self.cond(f[1], depth + 1, f"{what} condition"),
                self.branch(f[2], depth + 1, f"{what}.then"),
                self.branch(f[3], depth + 1, f"{what}.else"),
            )
        raise CommandError(f"malformed {what}: expected [0, tag, ops] or [1, cond, then, else]")


def decode(data: bytes | bytearray | memoryview) -> Command:
    """Decode and validate one metastore command. Raises only ``CommandError``."""
    n = len(data)
    if n == 0:
        raise CommandError("empty command (a Raft no-op carries no command)")
    if n > MAX_COMMAND_BYTES:
        raise CommandError(
            f"command is {n} bytes, over the limit of {MAX_COMMAND_BYTES} bytes",
            limit=MAX_COMMAND_BYTES,
            size=n,
        )
    try:
        obj = msgpack.unpackb(data, **_UNPACK_LIMITS)
    except UNPACK_ERRORS as e:
        raise CommandError(f"malformed command ({n} bytes): {type(e).__name__}: {e}") from None
    if type(obj) is not list or not obj or type(obj[0]) is not int:
        raise CommandError("malformed metastore command: expected [kind, ...]")
    kind, size, d = obj[0], len(obj), _Decoder()
    if kind == Kind.PUT or kind == Kind.REMOVE:
        return d.op(obj, "command")  # same layout as an op: [1, key, value] / [2, key]
    if kind == Kind.INVOKE:
        if size != 4:
            raise CommandError("malformed invoke: expected [3, conds, success, failure]")
        conds = tuple(
            d.cond(c, 1, f"condition {i}") for i, c in enumerate(d._list(obj[1], "conditions"))
        )
        return Invoke(conds, d.ops_list(obj[2], "success"), d.ops_list(obj[3], "failure"))
    if kind == Kind.IIF:
        if size != 2:
            raise CommandError("malformed iif: expected [4, branch]")
        return d.branch(obj[1], 1, "iif")
    known = ", ".join(f"{k.name}={k.value}" for k in Kind)
    raise CommandError(f"unknown metastore command kind {kind} (known: {known})")


# -- evaluation --------------------------------------------------------------------------------
Write: TypeAlias = Callable[[Sequence[Op]], "tuple[bool, int]"]


def run(cmd: Command, lookup: Lookup, write: Write) -> WriteResult | InvokeResult | BranchResult:
    """Evaluate ``cmd`` against ``lookup`` and hand the chosen ops to ``write``, which applies
    them as one revision and returns ``(changed, revision after)``. Pure apart from ``write``."""
    if isinstance(cmd, Op):
        return WriteResult(*write((cmd,)))
    if isinstance(cmd, Invoke):
        ok = all(c.test(lookup) for c in cmd.conditions)
        _, revision = write(cmd.success if ok else cmd.failure)
        return InvokeResult(ok, revision)
    node: If | Do = cmd
    while isinstance(node, If):
        node = node.then if node.cond.test(lookup) else node.otherwise
    _, revision = write(node.ops)
    return BranchResult(node.tag, revision)


def restore_result(data: bytes, value: object) -> object:
    """The typed result of command ``data`` from ``value`` as it crossed msgpack (a proposal
    forwarded to the leader comes back as a plain ``[x, revision]`` list). Anything that
    does not fit is returned unchanged."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return value
    a: object = value[0]
    revision: object = value[1]
    if type(revision) is not int:
        return value
    try:
        cmd = decode(data)
    except CommandError:
        return value
    if isinstance(cmd, Op) and type(a) is bool:
        return WriteResult(a, revision)
    if isinstance(cmd, Invoke) and type(a) is bool:
        return InvokeResult(a, revision)
    if isinstance(cmd, If | Do) and type(a) is int:
        return BranchResult(a, revision)
    return value
