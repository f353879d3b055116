"""The KV commands carried in Raft log entries: encoding, decoding and limits.

A command is the ``data`` of a NORMAL log entry. The state store decodes and applies it at
the entry's log index (the proposedIndex). Reads are *not* commands: a read is served
locally from the state store once ReadIndex (§6.4) says the replica is current enough.

Wire format (msgpack, ``use_bin_type=True`` so keys and values stay ``bytes``)::

    PUT     [1, key, value]
    DELETE  [2, key]
    CAS     [3, key, expected | nil, new | nil]   expected nil: the key must be absent
                                                  new nil: delete the key on success
    CAS_INDEX [5, key, mod_revision, new | nil]   the key's mod revision must be this
                                                  (0: absent; ``raftkv.storage.revisions``)
    TXN     [6, compares, then, else]             a transaction (``raftkv.storage.txn``)
    LEASE_GRANT [7, id, ttl], PUT_LEASE [8, key, value, id], LEASE_REVOKE [9, id]
                                                  leases (``raftkv.storage.leases``)
    BATCH   [4, [[key, value | nil], ...]]        nil value: delete; applied in order, atomically
    BATCH   [4, [[key, value | nil], ...], id]    an idempotent batch (see below)

Idempotent batches (bulk loads): a batch may carry an ``id`` (1..128 bytes; the Spark loader
derives it from its load id, the Raft partition and the batch number). The state machine
applies a batch with an id at most once: applying it also writes the marker key
``BATCH_MARK_PREFIX + id``, and a batch whose marker already exists is skipped (its result is
False; a first apply gives True). The markers are ordinary rows under a reserved prefix, so
they are replicated, checkpointed, carried in snapshots and replayed after a crash exactly
like the data they guard. No client can write a reserved key: ``check_key`` refuses them when
encoding (``decode`` admits them, as the fast put path does, so every replica treats a log
entry the same way whichever path decodes it), and ``user_key`` tells digests that compare user data to leave them out. They are
kept until the table is dropped: a retried or speculative Spark task may arrive at any time
while its job runs, and a few bytes per 1,000-row batch are cheap.

The encoding is the on-disk format of the Raft log, so it is as permanent as the log.

Limits (checked when encoding, so an oversized command never reaches the log, and checked
again when decoding, so a log written by a buggy or hostile peer cannot smuggle one in):

- key: 1..511 bytes. 511 is LMDB's default maximum key size (``mdb_env_get_maxkeysize``).
  LMDB also rejects empty keys, so the range is the same in every implementation.
- value: 0..1 MiB. A Raft entry is replicated to every member and retained in the log until
  a checkpoint, so big values make heartbeats and catch-up lumpy. 1 MiB also keeps a full
  batch within the entry byte budget.
- batch: at most 10,000 operations and at most 16 MiB encoded. The op count bounds the
  apply time of one entry, so one entry cannot stall the apply loop. The byte bound applies
  to every encoded command, which is also the decoder's input cap.

Errors: every violation, whether while encoding or decoding, raises ``CommandError``, a
``ValueError``. The message names the limit and the actual size. ``decode`` never lets a
raw msgpack, ``TypeError`` or ``RecursionError`` escape. The state store turns a
``CommandError`` at decode time into that entry's *result* instead of raising it, so a bad
entry in the log is skipped the same way on every replica and never crashes a node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import msgpack

if TYPE_CHECKING:
    from raftkv.storage.txn import Txn

MAX_KEY_BYTES = 511  # LMDB's default max key size (compile-time MDB_MAXKEYSIZE)
MAX_VALUE_BYTES = 1 << 20  # 1 MiB
MAX_BATCH_OPS = 10_000
MAX_COMMAND_BYTES = 16 << 20  # 16 MiB: the cap on any encoded command (in practice, a batch)
MAX_BATCH_ID_BYTES = 128
# Keys under this prefix belong to the state machine (batch markers), never to a client. A
# leading NUL keeps them out of the way of printable keys; the name says what they are.
RESERVED_PREFIX = b"\x00raftkv."
BATCH_MARK_PREFIX = RESERVED_PREFIX + b"batch."


class Op(IntEnum):
    # Written into the Raft log: never renumber, only append.
    PUT = 1
    DELETE = 2
    CAS = 3
    BATCH = 4
    CAS_INDEX = 5
    TXN = 6
    LEASE_GRANT = 7
    PUT_LEASE = 8
    LEASE_REVOKE = 9


class CommandError(ValueError):
    """A command breaks a limit or is malformed. ``limit`` and ``size`` are set for limits."""

    def __init__(self, message: str, *, limit: int | None = None, size: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.size = size


class Put(NamedTuple):
    key: bytes
    value: bytes


class Delete(NamedTuple):
    key: bytes


class Cas(NamedTuple):
    """Compare-and-set. ``expected is None``: the key must be absent. ``new is None``: delete."""

    key: bytes
    expected: bytes | None
    new: bytes | None


class CasIndex(NamedTuple):
    """Compare-and-set on the key's mod revision (``expected == 0``: the key must be
    absent). ``new is None``: delete."""

    key: bytes
    expected: int
    new: bytes | None


class LeaseGrant(NamedTuple):
    lease: int
    ttl: int


class PutLease(NamedTuple):
    """A put attached to a lease (``raftkv.storage.leases``)."""

    key: bytes
    value: bytes
    lease: int


class LeaseRevoke(NamedTuple):
    lease: int


class Batch(NamedTuple):
    """Puts (value is bytes) and deletes (value is None), applied in order, all or nothing.
    With an ``id`` it is applied at most once (see the module docstring)."""

    ops: tuple[tuple[bytes, bytes | None], ...]
    id: bytes | None = None


# A string: Txn lives in raftkv.storage.txn, which builds on this module.
Command: TypeAlias = "Put | Delete | Cas | CasIndex | Batch | Txn | LeaseGrant | PutLease | LeaseRevoke"

# Everything msgpack.unpackb raises on hostile input: truncation and trailing bytes
# (ValueError subclasses), nesting past its stack (StackError), bad UTF-8, unhashable map keys.
UNPACK_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
    msgpack.UnpackException,
)

# Plain ints: msgpack packs an IntEnum fine, but the hot path should not pay for the lookup.
_PUT, _DELETE, _CAS, _BATCH = int(Op.PUT), int(Op.DELETE), int(Op.CAS), int(Op.BATCH)
_CAS_INDEX, _TXN = int(Op.CAS_INDEX), int(Op.TXN)
_GRANT, _PUT_LEASE, _REVOKE = int(Op.LEASE_GRANT), int(Op.PUT_LEASE), int(Op.LEASE_REVOKE)


# -- validation (shared by encode and decode) --------------------------------------------------
def check_key(key: object, what: str = "key", *, reserved: bool = False) -> bytes:
    """A valid client key. ``reserved=True`` also admits the state machine's own rows
    (snapshot images carry them)."""
    if type(key) is not bytes:
        raise CommandError(f"{what} must be bytes, not {type(key).__name__}")
    n = len(key)
    if n == 0:
        raise CommandError(
            f"{what} is empty: keys must be 1..{MAX_KEY_BYTES} bytes", limit=MAX_KEY_BYTES, size=0
        )
    if n > MAX_KEY_BYTES:
        raise CommandError(
            f"{what} is {n} bytes, over the limit of {MAX_KEY_BYTES} bytes "
            f"(LMDB's default max key size)",
            limit=MAX_KEY_BYTES,
            size=n,
        )
    if not reserved and key.startswith(RESERVED_PREFIX):
        raise CommandError(f"{what} starts with {RESERVED_PREFIX!r}, which is reserved for raftkv")
    return key


def user_key(key: bytes) -> bool:
    """False for the state machine's own rows (batch markers): digests of user data skip them."""
    return not key.startswith(RESERVED_PREFIX)


def _check_batch_id(batch_id: object) -> bytes:
    if type(batch_id) is not bytes or not 0 < len(batch_id) <= MAX_BATCH_ID_BYTES:
        raise CommandError(f"a batch id is 1..{MAX_BATCH_ID_BYTES} bytes, not {batch_id!r:.60}")
    return batch_id


def check_value(value: object, what: str = "value") -> bytes:
    if type(value) is not bytes:
        raise CommandError(f"{what} must be bytes, not {type(value).__name__}")
    n = len(value)
    if n > MAX_VALUE_BYTES:
        raise CommandError(
            f"{what} is {n} bytes, over the limit of {MAX_VALUE_BYTES} bytes (1 MiB)",
            limit=MAX_VALUE_BYTES,
            size=n,
        )
    return value


def _check_optional_value(value: object, what: str) -> bytes | None:
    return None if value is None else check_value(value, what)


def _check_op_count(n: int) -> None:
    if n > MAX_BATCH_OPS:
        raise CommandError(
            f"batch has {n} operations, over the limit of {MAX_BATCH_OPS}",
            limit=MAX_BATCH_OPS,
            size=n,
        )


def _check_encoded_size(n: int, what: str) -> None:
    if n > MAX_COMMAND_BYTES:
        raise CommandError(
            f"{what} is {n} bytes encoded, over the limit of {MAX_COMMAND_BYTES} bytes (16 MiB)",
            limit=MAX_COMMAND_BYTES,
            size=n,
        )


# -- encoding ----------------------------------------------------------------------------------
def _pack(obj: list[object], what: str) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    _check_encoded_size(len(data), what)
    return data


def encode_put(key: bytes, value: bytes) -> bytes:
    return _pack([_PUT, check_key(key), check_value(value)], "put")


def split_put(data: bytes) -> tuple[bytes, bytes] | None:
    """The (key, value) of a put as ``encode_put`` writes it, read straight from its bytes;
    None for anything else, which then goes through ``decode``.

    The layout is fixed by msgpack: 0x93 (array of 3), 0x01 (PUT), 0xc4 + 1-byte length +
    key (keys under 256 bytes), then the value as bin8, bin16 or bin32. Requiring the
    lengths to add up to exactly ``len(data)`` makes this accept only what ``decode``
    would accept as a valid put, at a fraction of the cost (it is most of replay).
    """
    if type(data) is not bytes:  # slices of other buffers would not be bytes
        return None
    n = len(data)
    if n < 6 or data[0] != 0x93 or data[1] != _PUT or data[2] != 0xC4:
        return None
    klen = data[3]
    p = 4 + klen
    if klen == 0 or p >= n:
        return None
    tag = data[p]
    if tag == 0xC4:
        start = p + 2
        if start > n:
            return None
        vlen = data[p + 1]
    elif tag == 0xC5:
        start = p + 3
        vlen = int.from_bytes(data[p + 1 : start], "big")
    elif tag == 0xC6:
        start = p + 5
        vlen = int.from_bytes(data[p + 1 : start], "big")
    else:
        return None
    if start + vlen != n or vlen > MAX_VALUE_BYTES:
        return None
    return data[4:p], data[start:]


def encode_delete(key: bytes) -> bytes:
    return _pack([_DELETE, check_key(key)], "delete")


def encode_cas(key: bytes, expected: bytes | None, new: bytes | None) -> bytes:
    """``expected=None``: succeed only if the key is absent. ``new=None``: delete on success."""
    return _pack(
        [
            _CAS,
            check_key(key),
            _check_optional_value(expected, "expected value"),
            _check_optional_value(new, "new value"),
        ],
        "cas",
    )


def encode_cas_index(key: bytes, mod_revision: int, new: bytes | None) -> bytes:
    """Succeed only if the key's mod revision is ``mod_revision`` (0: absent)."""
    return _pack([_CAS_INDEX, check_key(key), _check_revision(mod_revision),
                  _check_optional_value(new, "new value")], "cas")


def _check_revision(rev: object) -> int:
    if type(rev) is not int or not 0 <= rev < 1 << 63:
        raise CommandError(f"a revision is an integer from 0 (absent) up, not {rev!r:.40}")
    return rev


def encode_txn(txn: Txn) -> bytes:
    """A transaction (``raftkv.storage.txn``), checked as ``decode`` will check it."""
    from raftkv.storage.txn import check_txn, wire
    fields = wire(txn)
    check_txn(fields[0], fields[1], fields[2])
    return _pack([_TXN, *fields], "transaction")


def encode_lease_grant(lease: int, ttl: int) -> bytes:
    from raftkv.storage.leases import check_lease_id, check_ttl
    return _pack([_GRANT, check_lease_id(lease), check_ttl(ttl)], "lease grant")


def encode_put_lease(key: bytes, value: bytes, lease: int) -> bytes:
    from raftkv.storage.leases import check_lease_id
    return _pack([_PUT_LEASE, _check_leased_key(check_key(key)), check_value(value),
                  check_lease_id(lease)], "put")


def encode_lease_revoke(lease: int) -> bytes:
    from raftkv.storage.leases import check_lease_id
    return _pack([_REVOKE, check_lease_id(lease)], "lease revoke")


def _check_leased_key(key: bytes) -> bytes:
    from raftkv.storage.leases import MAX_LEASED_KEY_BYTES
    if len(key) > MAX_LEASED_KEY_BYTES:
        raise CommandError(f"a key attached to a lease is at most {MAX_LEASED_KEY_BYTES} "
                           f"bytes, not {len(key)}", limit=MAX_LEASED_KEY_BYTES, size=len(key))
    return key


def encode_batch(ops: Iterable[Sequence[bytes | None]], batch_id: bytes | None = None) -> bytes:
    """An atomic list of puts (``(key, value)``) and deletes (``(key, None)``), in order.
    ``batch_id``: apply at most once (an idempotent bulk-load batch)."""
    items = list(ops)
    # Count first: a 10-million-op batch should fail fast, not after validating every op.
    _check_op_count(len(items))
    body: list[Sequence[bytes | None]] = []
    append = body.append
    for i, op in enumerate(items):
        # The common op inline (bulk loads send 10^6 of them); anything else gets the full
        # checks, which raise with the reason. msgpack packs a tuple as an array.
        if type(op) in (tuple, list) and len(op) == 2:
            key, value = op
            if (type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES
                    and (value is None or (type(value) is bytes
                                           and len(value) <= MAX_VALUE_BYTES))
                    and not key.startswith(RESERVED_PREFIX)):
                append(op)
                continue
        if not isinstance(op, tuple | list) or len(op) != 2:
            raise CommandError(f"batch op {i} must be a (key, value | None) pair, not {op!r:.80}")
        key, value = op
        append(
            [
                check_key(key, f"batch op {i}: key"),
                _check_optional_value(value, f"batch op {i}: value"),
            ]
        )
    if batch_id is None:
        return _pack([_BATCH, body], "batch")
    return _pack([_BATCH, body, _check_batch_id(batch_id)], "batch")


# -- decoding ----------------------------------------------------------------------------------
# Safe settings for big inputs: no str, map or ext may appear in a command, and no bin or array
# may claim more than the limits allow (msgpack checks a length before allocating for it).
_UNPACK_LIMITS: dict[str, int] = {
    "max_bin_len": MAX_VALUE_BYTES,
    "max_str_len": 0,
    "max_array_len": MAX_BATCH_OPS,
    "max_map_len": 0,
    "max_ext_len": 0,
}
_SMALL_COMMAND_BYTES = MAX_BATCH_OPS  # below this, msgpack's defaults are tighter than ours
_unpackb = msgpack.unpackb  # raw=False, use_list=True, strict_map_key=True by default
_new_put = tuple.__new__  # builds a Put without the NamedTuple __new__ frame (hot path)


def decode(data: bytes | bytearray | memoryview) -> Command:
    """Decode and validate one command. Anything malformed raises ``CommandError``."""
    n = len(data)
    if n == 0:
        raise CommandError("empty command (a Raft no-op carries no command)")
    try:
        if n <= _SMALL_COMMAND_BYTES:
            # msgpack caps every length at len(data) by default, which is tighter than
            # _UNPACK_LIMITS here. Passing keywords costs about 0.5 us, a fifth of an apply.
            obj = _unpackb(data)
        else:
            _check_encoded_size(n, "command")
            obj = _unpackb(data, **_UNPACK_LIMITS)
    except UNPACK_ERRORS as e:
        raise CommandError(f"malformed command ({n} bytes): {type(e).__name__} {e}") from None
    if type(obj) is list and len(obj) == 3 and obj[0] == _PUT:
        # Fast path for the common command; any failure falls through to the exact checks.
        key, value = obj[1], obj[2]
        if (
            type(key) is bytes
            and type(value) is bytes
            and 0 < len(key) <= MAX_KEY_BYTES
            and len(value) <= MAX_VALUE_BYTES
            and type(obj[0]) is int
        ):
            return _new_put(Put, (key, value))
    if type(obj) is not list or not obj:
        raise CommandError(f"malformed command: expected [op, ...], got {type(obj).__name__}")
    op = obj[0]
    if type(op) is not int:  # also rejects bool, which msgpack keeps distinct from int
        raise CommandError(f"malformed command: op must be an int, not {type(op).__name__}")
    size = len(obj)
    if op == _PUT:
        if size != 3:
            raise CommandError(f"malformed put: expected 3 fields, got {size}")
        return Put(check_key(obj[1], reserved=True), check_value(obj[2]))
    if op == _DELETE:
        if size != 2:
            raise CommandError(f"malformed delete: expected 2 fields, got {size}")
        return Delete(check_key(obj[1], reserved=True))
    if op == _CAS:
        if size != 4:
            raise CommandError(f"malformed cas: expected 4 fields, got {size}")
        return Cas(
            check_key(obj[1], reserved=True),
            _check_optional_value(obj[2], "expected value"),
            _check_optional_value(obj[3], "new value"),
        )
    if op == _CAS_INDEX:
        if size != 4:
            raise CommandError(f"malformed cas: expected 4 fields, got {size}")
        return CasIndex(check_key(obj[1], reserved=True), _check_revision(obj[2]),
                        _check_optional_value(obj[3], "new value"))
    if op in (_GRANT, _PUT_LEASE, _REVOKE):
        from raftkv.storage.leases import check_lease_id, check_ttl
        if op == _GRANT and size == 3:
            return LeaseGrant(check_lease_id(obj[1]), check_ttl(obj[2]))
        if op == _PUT_LEASE and size == 4:
            return PutLease(_check_leased_key(check_key(obj[1])), check_value(obj[2]),
                            check_lease_id(obj[3]))
        if op == _REVOKE and size == 2:
            return LeaseRevoke(check_lease_id(obj[1]))
        raise CommandError(f"malformed lease command {op}: {size} fields")
    if op == _TXN:
        if size != 4:
            raise CommandError(f"malformed transaction: expected 4 fields, got {size}")
        from raftkv.storage.txn import check_txn  # it builds on this module
        return check_txn(obj[1], obj[2], obj[3], reserved=True)
    if op == _BATCH:
        if size not in (2, 3) or type(obj[1]) is not list:
            raise CommandError("malformed batch: expected [4, [[key, value | nil], ...], id?]")
        body = obj[1]
        _check_op_count(len(body))
        ops: list[tuple[bytes, bytes | None]] = []
        append = ops.append
        for i, pair in enumerate(body):
            if type(pair) is not list or len(pair) != 2:
                raise CommandError(f"malformed batch: op {i} is not a [key, value | nil] pair")
            key, value = pair
            if (type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES
                    and (value is None or (type(value) is bytes
                                           and len(value) <= MAX_VALUE_BYTES))):
                append((key, value))  # the checks below, inline: this is most of an apply
                continue
            append(
                (
                    check_key(key, f"batch op {i}: key", reserved=True),
                    _check_optional_value(value, f"batch op {i}: value"),
                )
            )
        return Batch(tuple(ops), _check_batch_id(obj[2]) if size == 3 else None)
    raise CommandError(f"unknown op {op} (known: {', '.join(f'{o.name}={o.value}' for o in Op)})")
