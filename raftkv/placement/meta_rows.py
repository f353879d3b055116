"""The metastore's rows: how keys, the event history and the counters are laid out, both in
its LMDB databases and in the snapshot image, and the checks an incoming image must pass.

Theory of operation
-------------------
A metastore snapshot must carry more than key -> value: a follower that installs one has to
answer ``get`` with the same revisions and serve watches from the same history as the
leader. The shared snapshot format (``raftkv.storage.state_store``) is a strictly increasing list of
``[row key, row value]`` pairs with values of at most 1 MiB, so the whole state is flattened
into rows whose key prefixes sort in this order:

    c/compacted                 8-byte big-endian: events up to here were dropped
    c/revision                  8-byte big-endian: the store's revision
    e/<rev:8><seq:4>            msgpack [key, value | nil]: the seq-th event of revision rev
    k/<key>                     msgpack [value, mod_revision, create_revision]

The counters come first so an install knows the revision range before the events stream
in. Every revision in ``(compacted, revision]`` has at least one event (the revision only
moves when a command produced one), with ``seq`` 0, 1, ... in op order, so an image can be
checked for gaps. The LMDB store keeps the same bytes: its ``events`` DB maps
``<rev:8><seq:4>`` to the event row value, and its ``data`` DB maps ``<key>`` to the key row
value. Export and install are therefore copies, and the StateStore-level ``get``/``scan``/
``digest`` read exactly these rows, so equal digests mean equal images.

``ImageChecker`` validates an image row by row (layout, ranges, gap-free history, record
invariants, canonical msgpack) so a bad image is refused before anything is committed.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import msgpack

from raftkv.placement.meta_commands import (
    MAX_REVISION,
    VersionedValue,
    check_meta_key,
    check_meta_value,
)
from raftkv.storage.commands import UNPACK_ERRORS, CommandError
from raftkv.storage.errors import StorageError

META_PREFIX = b"c/"
EVENT_PREFIX = b"e/"
KEY_PREFIX = b"k/"
COMPACTED_ROW = META_PREFIX + b"compacted"
REVISION_ROW = META_PREFIX + b"revision"
EVENT_KEY_BYTES = 12


class Event(NamedTuple):
    """One change: ``value`` is the new value, or None when the key was removed."""

    revision: int
    key: bytes
    value: bytes | None


class Segment(Enum):
    """Where a row lives in the LMDB store."""

    META = 0
    EVENTS = 1
    DATA = 2


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def counter_bytes(n: int) -> bytes:
    return n.to_bytes(8, "big")


def event_key(revision: int, seq: int) -> bytes:
    return revision.to_bytes(8, "big") + seq.to_bytes(4, "big")


def split_event_key(k: bytes) -> tuple[int, int]:
    return int.from_bytes(k[:8], "big"), int.from_bytes(k[8:12], "big")


def pack_record(value: bytes, mod_revision: int, create_revision: int) -> bytes:
    return pack([value, mod_revision, create_revision])


def unpack_record(raw: bytes) -> VersionedValue:
    value, mod, create = msgpack.unpackb(raw)
    return VersionedValue(value, mod, create)


def pack_event(key: bytes, value: bytes | None) -> bytes:
    return pack([key, value])


def unpack_event(revision: int, raw: bytes) -> Event:
    key, value = msgpack.unpackb(raw)
    return Event(revision, key, value)


# -- image validation --------------------------------------------------------------------------
def _strict_unpack(raw: bytes, what: str) -> list[object]:
    try:
        obj = msgpack.unpackb(raw, max_str_len=0, max_map_len=0, max_ext_len=0)
    except UNPACK_ERRORS as e:
        raise StorageError(f"metastore image: {what} is malformed: {e}") from None
    if type(obj) is not list:
        raise StorageError(f"metastore image: {what} is not a list")
    if pack(obj) != raw:  # canonical bytes: replicas must hold byte-identical rows
        raise StorageError(f"metastore image: {what} is not canonically encoded")
    return obj


def _revision_field(x: object, what: str) -> int:
    if type(x) is not int or not 0 <= x <= MAX_REVISION:
        raise StorageError(f"metastore image: {what} must be a revision, got {x!r:.40}")
    return x


class ImageChecker:
    """Validates a metastore image's rows in stream order. ``row(k, v)`` returns where the
    row goes (segment, key in that DB); ``finish()`` checks the end. Raises StorageError."""

    def __init__(self) -> None:
        self.compacted: int | None = None
        self.revision: int | None = None
        self._last: tuple[int, int] | None = None  # (rev, seq) of the last event row

    def row(self, key: bytes, value: bytes) -> tuple[Segment, bytes]:
        if key.startswith(META_PREFIX):
            return self._meta(key, value)
        if self.revision is None:
            raise StorageError(
                f"metastore image: row {key[:32]!r} comes before the c/compacted and "
                "c/revision counters (is this a metastore image? a KV store's, perhaps)"
            )
        if key.startswith(EVENT_PREFIX):
            return self._event(key[len(EVENT_PREFIX) :], value)
        if key.startswith(KEY_PREFIX):
            return self._key(key[len(KEY_PREFIX) :], value)
        raise StorageError(f"metastore image: unknown row {key[:32]!r}")

    def _meta(self, key: bytes, value: bytes) -> tuple[Segment, bytes]:
        if len(value) != 8:
            raise StorageError(f"metastore image: {key!r} must be 8 bytes, got {len(value)}")
        n = _revision_field(int.from_bytes(value, "big"), key.decode("ascii", "replace"))
        if key == COMPACTED_ROW and self.compacted is None:
            self.compacted = n
        elif key == REVISION_ROW and self.compacted is not None and self.revision is None:
            if n < self.compacted:
                raise StorageError(
                    f"metastore image: revision {n} is below the compacted revision "
                    f"{self.compacted}"
                )
            self.revision = n
        else:
            raise StorageError(f"metastore image: unexpected counter row {key[:32]!r}")
        return Segment.META, key

    def _event(self, k: bytes, value: bytes) -> tuple[Segment, bytes]:
        assert self.revision is not None and self.compacted is not None
        if len(k) != EVENT_KEY_BYTES:
            raise StorageError(f"metastore image: event row key {k!r:.40} is not 12 bytes")
        rev, seq = split_event_key(k)
        last = self._last
        expected = (
            [(self.compacted + 1, 0)]
            if last is None
            else [(last[0], last[1] + 1), (last[0] + 1, 0)]
        )
        if (rev, seq) not in expected or rev > self.revision:
            raise StorageError(
                f"metastore image: event ({rev}, {seq}) breaks the history, expected one of "
                f"{expected} within revision {self.revision} (a gap or a foreign row)"
            )
        self._last = (rev, seq)
        f = _strict_unpack(value, f"event ({rev}, {seq})")
        try:
            if len(f) != 2:
                raise CommandError("expected [key, value | nil]")
            check_meta_key(f[0])
            if f[1] is not None:
                check_meta_value(f[1])
        except CommandError as e:
            raise StorageError(f"metastore image: event ({rev}, {seq}): {e}") from None
        return Segment.EVENTS, k

    def _key(self, k: bytes, value: bytes) -> tuple[Segment, bytes]:
        assert self.revision is not None
        try:
            check_meta_key(k)
            f = _strict_unpack(value, f"key {k[:32]!r}")
            if len(f) != 3:
                raise CommandError("expected [value, mod_revision, create_revision]")
            check_meta_value(f[0])
        except CommandError as e:
            raise StorageError(f"metastore image: key {k[:32]!r}: {e}") from None
        mod = _revision_field(f[1], "mod_revision")
        create = _revision_field(f[2], "create_revision")
        if not 1 <= create <= mod <= self.revision:
            raise StorageError(
                f"metastore image: key {k[:32]!r} has create_revision {create} and "
                f"mod_revision {mod}: need 1 <= create <= mod <= revision {self.revision}"
            )
        return Segment.DATA, k

    def finish(self) -> tuple[int, int]:
        """``(revision, compacted)`` once the history is known to be complete."""
        if self.revision is None or self.compacted is None:
            raise StorageError(
                "metastore image has no c/compacted and c/revision counters "
                "(is this a metastore image?)"
            )
        last_rev = self.compacted if self._last is None else self._last[0]
        if last_rev != self.revision:
            raise StorageError(
                f"metastore image: the history ends at revision {last_rev}, "
                f"the image is at revision {self.revision}"
            )
        return self.revision, self.compacted
