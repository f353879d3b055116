"""Per-key revisions and lease: what every row of a KV state store holds besides its value.

Each key carries etcd's three numbers (``mvccpb.KeyValue``), kept in the same row as the
value, so one apply transaction writes all four together and no reader can see one
without the others:

- ``mod_revision``: the Raft index of the entry that last wrote the key (its proposedIndex);
- ``create_revision``: the index of the entry that created it, since it last did not exist;
- ``version``: how many writes since then (1 after the creating write).

and the id of the lease the key is attached to (0: none; ``raftkv.storage.leases``). A
delete removes the row, so a key written again starts over (new create revision, version
1), as in etcd. The revision *is* the log index, the same on every replica, so replicas
stay byte-identical and a compare on ``mod_revision`` (``?prev_index=``) is decided the same
way everywhere. A write that leaves the value as it was still moves the revision (etcd
does too: it is a write a watcher sees).

A row is a fixed 32-byte header, big-endian ``(create_revision, mod_revision, version,
lease)``, then the value. Fixed width keeps the apply path to one ``struct`` call and lets a reader
take the value as a slice.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from raftkv.storage.commands import MAX_VALUE_BYTES

_HEADER = struct.Struct(">QQQQ")
HEADER_BYTES = _HEADER.size
MAX_ROW_BYTES = HEADER_BYTES + MAX_VALUE_BYTES
_pack, _unpack = _HEADER.pack, _HEADER.unpack_from


class KeyMeta(NamedTuple):
    """A key's value and revisions, as a read with ``?meta=true`` returns them."""

    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


def write_row(old: bytes | None, value: bytes, index: int, lease: int = 0) -> bytes:
    """The row of a write of ``value`` at log ``index`` over the key's ``old`` row,
    attached to ``lease`` (0: none)."""
    if old is None:
        return _pack(index, index, 1, lease) + value
    create, _, version, _ = _unpack(old)
    return _pack(create, index, version + 1, lease) + value


def lease_of(row: bytes) -> int:
    return int(_unpack(row)[3])


def value_of(row: bytes) -> bytes:
    return row[HEADER_BYTES:]


def mod_revision_of(row: bytes | None) -> int:
    """The row's mod revision; 0 for an absent key (etcd's "mod_revision == 0")."""
    return 0 if row is None else int(_unpack(row)[1])


def meta_of(row: bytes) -> KeyMeta:
    create, mod, version, lease = _unpack(row)
    return KeyMeta(row[HEADER_BYTES:], create, mod, version, lease)


def check_row(row: bytes, applied: int) -> str | None:
    """Why ``row`` is not one a store at ``applied`` could hold (None if it could): the
    snapshot loader's check of every incoming row. (A version may exceed the indexes
    spanned: a batch that writes a key twice writes it twice in one entry.)"""
    if not HEADER_BYTES <= len(row) <= MAX_ROW_BYTES:
        return f"a row is {len(row)} bytes, not {HEADER_BYTES}..{MAX_ROW_BYTES}"
    create, mod, version, _ = _unpack(row)
    if not 0 < create <= mod <= applied or version < 1:
        return (f"a row's revisions are inconsistent (create {create}, mod {mod}, "
                f"version {version}, at applied index {applied})")
    return None
