"""``MetaStore``: the metastore's replicated state machine, a revisioned KV store with
conditional multi-key invoke and a watchable event history, as a ``StateStore`` in LMDB.

Theory of operation
-------------------
The placement layer (Ignite 3's rebalance design, IGNITE-16668) keeps each partition's
``assignments.*`` keys
in a metastore hosted by one Raft group, and drives rebalance with atomic conditional
writes and watches. This module is that group's state machine. It keeps the ``StateStore``
contract (``raftkv.storage.state_store``): applied index, checkpoint index, ``IndexMismatch``,
chunked snapshots. The Raft log is its WAL, exactly as for ``LmdbStateStore``: LMDB without
a per-commit sync, one write transaction per apply batch that also writes the applied
index, ``checkpoint()`` = ``env.sync``.

**Data model (etcd's).** One global ``revision``, starting at 0. A command that produces at
least one event moves it by exactly one, however many keys it touches, so an invoke is one
revision with several events, as an etcd txn is. A put always produces an event, even when
the value does not change (as in etcd: the key's mod_revision moves and watchers see the
write). A remove produces one only if the key existed. A command that produces nothing (a
failed invoke with an empty failure branch, a remove of an absent key, a malformed command)
leaves the revision alone. Each key carries its value, ``mod_revision`` (revision of its
last change) and ``create_revision`` (revision that created it since it last did not exist).
Commands and their conditions are in ``meta_commands``.

**Event history and watches.** Each revision's events ``(revision, key, value | None)`` are
stored in op order. ``read_events(prefix, from_revision, limit)`` returns the events with
revision >= ``from_revision`` for keys under ``prefix``, in order and without gaps, plus
``next_revision``, the ``from_revision`` to pass next time. A watcher that has seen
everything up to revision R resumes with ``R + 1`` on any replica and gets exactly the rest:
the history is part of the replicated state (and of snapshots), so every replica at
revision >= R holds the same events after R. A replica behind R returns nothing yet (and
``next_revision == from_revision``); the caller waits and asks again. ``limit`` bounds the
events returned, but a revision is never split: a watcher must see an invoke's changes
together, and resuming at ``last.revision + 1`` must not skip the rest of that revision.
(So the first revision is returned whole even if it alone exceeds ``limit``.)

**Retention.** The history keeps the last ``history`` revisions (default 100,000; at a few
hundred bytes per event that is tens of MB). After each apply batch, events of revisions
``<= revision - history`` are dropped and ``compacted_revision()`` records that bound.
Asking for ``from_revision <= compacted_revision()`` raises ``HistoryCompacted``: the
watcher missed events and must re-read its keys with ``range(prefix)``, which returns the
revision it read at, and watch from that revision + 1 (etcd's recipe). The bound depends
only on the revision, so every replica drops the same events whatever its batching. The
history is in the digest, so every replica of a group must be configured with the same
``history``.

**Reads.** ``get_entry``/``get_many``/``range`` return ``VersionedValue(value,
mod_revision, create_revision)``. The StateStore-level ``get``/``scan``/``digest`` do not:
they read the store's *rows*, the flat layout that snapshots carry (``meta_rows``), so
``digest()`` covers the keys, their revisions, the counters and the history, and two
replicas with equal digests hold byte-identical state. Every read opens its own LMDB read
transaction (MVCC): it sees one consistent state and does not block the writer.

**Snapshots** export the rows (``meta_rows``: counters, events, keys) in the shared chunk
format from one read transaction. ``install_snapshot`` validates the stream twice over
(``SnapshotLoader``: order, sizes, digest; ``ImageChecker``: layout, gap-free history,
record invariants) inside one write transaction, and commits only if both pass.

**Not here:** the long-polling watch and its resumption across leader changes (the driver
side) are built on ``read_events``; there is no in-memory variant yet (tests use LMDB in a
temporary directory, which is fast enough).

Not thread-safe for writes: the driver thread applies. Reads may run on other threads while
the driver applies (each opens its own read transaction), but not concurrently with
``close()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import lmdb

from raftkv.placement.meta_commands import (
    MAX_META_KEY_BYTES,
    Op,
    OpKind,
    VersionedValue,
    decode,
    run,
)
from raftkv.placement.meta_rows import (
    COMPACTED_ROW,
    EVENT_KEY_BYTES,
    EVENT_PREFIX,
    KEY_PREFIX,
    REVISION_ROW,
    Event,
    ImageChecker,
    Segment,
    counter_bytes,
    event_key,
    pack_event,
    pack_record,
    unpack_event,
    unpack_record,
)
from raftkv.storage.commands import CommandError
from raftkv.storage.digest import Digest, DigestBuilder
from raftkv.storage.errors import Compacted, StorageError
from raftkv.storage.lmdb_files import check_lmdb_file
from raftkv.storage.lmdb_state import DEFAULT_MAP_SIZE, IMAGE_INDEX, LmdbBacked, _ReadIterator
from raftkv.storage.state_store import (
    DEFAULT_CHECKPOINT_ENTRIES,
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_CHUNK_BYTES,
    SnapshotLoader,
    check_apply,
    check_chunk_bytes,
    encode_snapshot,
    in_range,
    storable_key,
)

__all__ = [
    "DEFAULT_HISTORY",
    "Event",
    "EventBatch",
    "HistoryCompacted",
    "MetaStore",
    "RangeResult",
]

T = TypeVar("T")

DEFAULT_HISTORY = 100_000
_DATA = b"data"
_EVENTS = b"events"
_META = b"meta"
_APPLIED = b"applied"
_REVISION = b"revision"
_COMPACTED = b"compacted"
_FORMAT = b"format"
_FORMAT_V1 = b"raftkv-metastore-v1"


class HistoryCompacted(Compacted):
    """Events from ``index`` (the requested revision) are gone; ``first_index`` is the first
    revision still in the history. Re-read with ``range`` and watch from its revision + 1."""

    def __init__(self, index: int, first_index: int) -> None:
        super().__init__(index, first_index)
        message = (
            f"metastore history before revision {first_index} is compacted "
            f"(asked for revision {index}); re-read with range() and watch from its revision"
        )
        self.args = (message,)

    @property
    def from_revision(self) -> int:
        return self.index

    @property
    def first_revision(self) -> int:
        return self.first_index


class EventBatch(NamedTuple):
    """``events`` in (revision, op) order; pass ``next_revision`` as the next from_revision."""

    events: list[Event]
    next_revision: int


class RangeResult(NamedTuple):
    """The keys under a prefix, in key order, as of ``revision``."""

    revision: int
    items: list[tuple[bytes, VersionedValue]]


def _int(raw: bytes | None) -> int:
    return int.from_bytes(raw or b"", "big")


def _segment(
    cursor: lmdb.Cursor[bytes], prefix: bytes, lo: bytes | None, hi: bytes | None
) -> Iterator[tuple[bytes, bytes]]:
    """The rows ``prefix + k`` of one DB that fall in ``[lo, hi)``, in order."""
    if hi is not None and hi <= prefix:
        return
    start = b""
    if lo is not None and lo > prefix:
        if not lo.startswith(prefix):
            return  # lo sorts above every prefixed row (lo > prefix and not extending it)
        start = lo[len(prefix) : len(prefix) + 511]
    if not (cursor.set_range(start) if start else cursor.first()):
        return
    for k, v in cursor.iternext():
        row = prefix + k
        if hi is not None and row >= hi:
            return
        if lo is not None and row < lo:
            continue
        yield row, v


class _Writer:
    """One apply transaction's view: ``lookup`` and ``write`` for ``meta_commands.run``."""

    __slots__ = ("data", "events", "revision", "txn")

    def __init__(
        self,
        txn: lmdb.Transaction[bytes],
        data: lmdb._Database,
        events: lmdb._Database,
        revision: int,
    ) -> None:
        self.txn = txn
        self.data = data
        self.events = events
        self.revision = revision

    def lookup(self, key: bytes) -> VersionedValue | None:
        raw = self.txn.get(key, db=self.data)
        return None if raw is None else unpack_record(raw)

    def write(self, ops: Sequence[Op]) -> tuple[bool, int]:
        txn, data, events = self.txn, self.data, self.events
        rev = self.revision + 1
        seq = 0
        for op in ops:
            if op.kind is OpKind.PUT:
                assert op.value is not None
                cur = self.lookup(op.key)
                create = rev if cur is None else cur.create_revision
                txn.put(op.key, pack_record(op.value, rev, create), db=data)
            elif not txn.delete(op.key, db=data):
                continue  # removing an absent key changes nothing: no event
            txn.put(event_key(rev, seq), pack_event(op.key, op.value), db=events)
            seq += 1
        if not seq:
            return False, self.revision
        self.revision = rev
        return True, rev


class MetaStore(LmdbBacked):
    """The metastore ``StateStore`` (contract: raftkv.storage.state_store; theory: this module).

    ``path`` is the LMDB env directory, created if missing. ``history`` is how many
    revisions of events to keep (>= 1; the same on every replica). ``map_size``,
    ``checkpoint_entries`` and ``checkpoint_seconds`` are as for ``LmdbStateStore``.
    """

    _what = "metastore"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        history: int = DEFAULT_HISTORY,
        map_size: int = DEFAULT_MAP_SIZE,
        checkpoint_entries: int = DEFAULT_CHECKPOINT_ENTRIES,
        checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS,
    ) -> None:
        if type(history) is not int or history < 1:
            raise ValueError(f"history must be an int >= 1, got {history!r}")
        self._init_checkpointing(path, checkpoint_entries, checkpoint_seconds)
        self.history = history
        rec = self._prepare_env()  # the pinned checkpoint (raftkv.storage.lmdb_checkpoint)
        check_lmdb_file(self.path, "metastore")
        try:
            self._env = lmdb.open(
                self.path,
                subdir=True,
                create=True,
                map_size=map_size,
                max_dbs=3,
                sync=False,  # ACI, not D: the Raft log is the WAL
                metasync=False,
                readahead=False,
            )
        except lmdb.Error as e:
            raise StorageError(f"cannot open the metastore at {self.path}: {e}") from e
        try:
            applied, self._revision, self._compacted = self._open_dbs()
            self._env.sync(True)  # the stored applied index is now the checkpointIndex
            self._opened(applied, rec)
        except lmdb.Error as e:
            self._env.close()
            raise StorageError(f"cannot open the metastore at {self.path}: {e}") from e
        except StorageError:
            self._env.close()
            raise
        self._applied = self._checkpoint = applied
        self._closed = False

    def _open_dbs(self) -> tuple[int, int, int]:
        env = self._env
        with env.begin(write=True) as txn:
            names = set(txn.cursor().iternext(values=False))
            if not names:
                self._data = env.open_db(_DATA, txn=txn, create=True)
                self._events = env.open_db(_EVENTS, txn=txn, create=True)
                self._meta = env.open_db(_META, txn=txn, create=True)
                txn.put(_FORMAT, _FORMAT_V1, db=self._meta)
                for name in (_APPLIED, _REVISION, _COMPACTED, IMAGE_INDEX):
                    txn.put(name, counter_bytes(0), db=self._meta)
                return 0, 0, 0
            if names != {_DATA, _EVENTS, _META}:
                shown = ", ".join(repr(n) for n in sorted(names)[:5])
                raise StorageError(
                    f"cannot open the metastore at {self.path}: it is an LMDB env, but not a "
                    f"metastore (its main DB holds {shown})"
                )
            self._data = env.open_db(_DATA, txn=txn, create=False)
            self._events = env.open_db(_EVENTS, txn=txn, create=False)
            self._meta = env.open_db(_META, txn=txn, create=False)
            fmt = txn.get(_FORMAT, db=self._meta)
            if fmt != _FORMAT_V1:
                raise StorageError(
                    f"cannot open the metastore at {self.path}: unknown format {fmt!r} "
                    f"(expected {_FORMAT_V1!r})"
                )
            counters = []
            for name in (_APPLIED, _REVISION, _COMPACTED):
                raw = txn.get(name, db=self._meta)
                if raw is None or len(raw) != 8:
                    raise StorageError(
                        f"cannot open the metastore at {self.path}: corrupt {name!r} {raw!r}"
                    )
                counters.append(_int(raw))
            return counters[0], counters[1], counters[2]

    # -- writes --------------------------------------------------------------------------------
    def apply(self, entries: Sequence[tuple[int, bytes]]) -> list[object]:
        """Apply a batch in one transaction. Results: None for an empty entry, a
        ``CommandError`` for a malformed one, else ``WriteResult`` / ``InvokeResult`` /
        ``BranchResult`` (``meta_commands``)."""
        self._live()
        if not entries:
            return []
        last = check_apply(entries, self._applied, self._checkpoint)
        try:
            with self._env.begin(write=True) as txn:
                w = _Writer(txn, self._data, self._events, self._revision)
                results: list[object] = []
                for _, data in entries:
                    if not data:
                        results.append(None)
                        continue
                    try:
                        cmd = decode(data)
                    except CommandError as e:
                        results.append(e)  # skipped the same way on every replica
                        continue
                    results.append(run(cmd, w.lookup, w.write))
                compacted = self._compact(txn, w.revision)
                meta = self._meta
                txn.put(_APPLIED, counter_bytes(last), db=meta)
                txn.put(_REVISION, counter_bytes(w.revision), db=meta)
                txn.put(_COMPACTED, counter_bytes(compacted), db=meta)
        except lmdb.Error as e:  # aborted: nothing was applied
            raise self._fail(f"apply of [{entries[0][0]}, {last}] failed", e) from e
        self._applied = last
        self._revision = w.revision
        self._compacted = compacted
        return results

    def _compact(self, txn: lmdb.Transaction[bytes], revision: int) -> int:
        """Drop the events of revisions <= revision - history; return the new bound."""
        bound = revision - self.history
        if bound <= self._compacted:
            return self._compacted
        cursor = txn.cursor(db=self._events)
        if cursor.first():
            while True:
                k = cursor.key()
                if not k or _int(k[:8]) > bound:
                    break
                cursor.delete()  # moves to the next event
        return bound

    # -- metastore reads -----------------------------------------------------------------------
    def revision(self) -> int:
        """The revision of everything applied (0 for an empty store)."""
        self._live()
        return self._revision

    def compacted_revision(self) -> int:
        """Events of revisions up to this one are no longer in the history."""
        self._live()
        return self._compacted

    def _txn(self) -> lmdb.Transaction[bytes]:
        self._live()
        try:
            return self._env.begin()
        except lmdb.Error as e:
            raise self._fail("read failed", e) from e

    def get_entry(self, key: bytes) -> VersionedValue | None:
        """``(value, mod_revision, create_revision)`` of ``key``, or None if absent."""
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[bytes]) -> list[VersionedValue | None]:
        """Like ``get_entry`` for each key, all read in one consistent view."""
        keys = list(keys)
        with self._txn() as txn:
            out: list[VersionedValue | None] = []
            for key in keys:
                ok = storable_key(key) and len(key) <= MAX_META_KEY_BYTES  # TypeError if not bytes
                raw = txn.get(key, db=self._data) if ok else None
                out.append(None if raw is None else unpack_record(raw))
            return out

    def range(self, prefix: bytes = b"") -> RangeResult:
        """Every key starting with ``prefix``, in key order, and the revision of that view
        (watch from ``revision + 1`` to follow the prefix from there)."""
        if type(prefix) is not bytes:
            raise TypeError(f"prefix must be bytes, not {type(prefix).__name__}")
        with self._txn() as txn:
            revision = _int(txn.get(_REVISION, db=self._meta))
            items: list[tuple[bytes, VersionedValue]] = []
            if len(prefix) <= MAX_META_KEY_BYTES:
                cursor = txn.cursor(db=self._data)
                if cursor.set_range(prefix) if prefix else cursor.first():
                    for k, v in cursor.iternext():
                        if not k.startswith(prefix):
                            break
                        items.append((k, unpack_record(v)))
            return RangeResult(revision, items)

    def read_events(
        self, prefix: bytes = b"", from_revision: int = 1, limit: int | None = None
    ) -> EventBatch:
        """Events of keys under ``prefix`` with revision >= ``from_revision`` (>= 1), gap-free,
        whole revisions only; raises ``HistoryCompacted`` if some were dropped. See the
        module docstring (Event history and watches)."""
        if type(prefix) is not bytes:
            raise TypeError(f"prefix must be bytes, not {type(prefix).__name__}")
        if type(from_revision) is not int or from_revision < 1:
            raise ValueError(f"from_revision must be an int >= 1, got {from_revision!r}")
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError(f"limit must be None or an int >= 1, got {limit!r}")
        with self._txn() as txn:
            revision = _int(txn.get(_REVISION, db=self._meta))
            compacted = _int(txn.get(_COMPACTED, db=self._meta))
            if from_revision <= compacted:
                raise HistoryCompacted(from_revision, compacted + 1)
            out: list[Event] = []
            next_revision = max(from_revision, revision + 1)
            if from_revision > revision:
                return EventBatch(out, next_revision)
            cursor = txn.cursor(db=self._events)
            if cursor.set_range(event_key(from_revision, 0)):
                for k, v in cursor.iternext():
                    rev = _int(k[:8])
                    ev = unpack_event(rev, v)
                    if not ev.key.startswith(prefix):
                        continue
                    if limit is not None and len(out) >= limit and rev != out[-1].revision:
                        next_revision = rev  # never split a revision
                        break
                    out.append(ev)
            return EventBatch(out, next_revision)

    def events(
        self, prefix: bytes = b"", from_revision: int = 1, limit: int | None = None
    ) -> list[Event]:
        """``read_events(...).events``."""
        return self.read_events(prefix, from_revision, limit).events

    # -- StateStore reads: the rows (meta_rows) --------------------------------------------------
    def _rows(
        self, txn: lmdb.Transaction[bytes], lo: bytes | None, hi: bytes | None
    ) -> Iterator[tuple[bytes, bytes]]:
        for row, name in ((COMPACTED_ROW, _COMPACTED), (REVISION_ROW, _REVISION)):
            if in_range(row, lo, hi):
                yield row, txn.get(name, db=self._meta) or b""
        yield from _segment(txn.cursor(db=self._events), EVENT_PREFIX, lo, hi)
        yield from _segment(txn.cursor(db=self._data), KEY_PREFIX, lo, hi)

    def _read(self, make: Callable[[lmdb.Transaction[bytes]], Iterator[T]]) -> _ReadIterator[T]:
        txn = self._txn()
        return _ReadIterator(make(txn), txn, self.path)

    def get(self, key: bytes) -> bytes | None:
        """The StateStore view: the value of the *row* ``key`` (see ``meta_rows``); use
        ``get_entry`` for a metastore key."""
        if not storable_key(key):
            self._live()
            return None
        with self._txn() as txn:
            value: bytes | None = None
            if key == COMPACTED_ROW:
                value = txn.get(_COMPACTED, db=self._meta)
            elif key == REVISION_ROW:
                value = txn.get(_REVISION, db=self._meta)
            elif key.startswith(EVENT_PREFIX) and len(key) == 2 + EVENT_KEY_BYTES:
                value = txn.get(key[2:], db=self._events)
            elif key.startswith(KEY_PREFIX) and len(key) > 2:
                value = txn.get(key[2:], db=self._data)
            return value

    def scan(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        return self._read(lambda txn: self._rows(txn, lo, hi))

    def digest(
        self,
        lo: bytes | None = None,
        hi: bytes | None = None,
        keys: Callable[[bytes], bool] | None = None,
    ) -> Digest:
        b = DigestBuilder()
        with self._read(lambda txn: self._rows(txn, lo, hi)) as rows:
            for k, v in rows:
                if keys is None or keys(k):
                    b.add(k, v)
        return b.result()

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        check_chunk_bytes(chunk_bytes)

        def make(txn: lmdb.Transaction[bytes]) -> Iterator[bytes]:
            applied = _int(txn.get(_APPLIED, db=self._meta))
            count = 2 + txn.stat(self._events)["entries"] + txn.stat(self._data)["entries"]
            return encode_snapshot(applied, count, self._rows(txn, None, None), chunk_bytes)

        return self._read(make)

    def install_snapshot(self, chunks: Iterable[bytes]) -> int:
        self._live()
        loader = SnapshotLoader(chunks)  # header checked before touching anything
        loader.expect(None, "the metastore")
        checker = ImageChecker()
        try:
            with self._env.begin(write=True) as txn:
                txn.drop(self._data, delete=False)  # rolled back if anything below raises
                txn.drop(self._events, delete=False)
                data = txn.cursor(db=self._data)
                events = txn.cursor(db=self._events)
                for key, value in loader.rows():
                    segment, k = checker.row(key, value)
                    # Rows arrive strictly increasing, so each DB is appended in order.
                    if segment is Segment.DATA:
                        data.put(k, value, append=True)
                    elif segment is Segment.EVENTS:
                        events.put(k, value, append=True)
                if not loader.verified:  # rows() raises unless verified; belt and braces
                    raise StorageError("snapshot stream was not verified")
                revision, compacted = checker.finish()
                meta = self._meta
                txn.put(_APPLIED, counter_bytes(loader.applied), db=meta)
                txn.put(IMAGE_INDEX, counter_bytes(loader.applied), db=meta)
                txn.put(_REVISION, counter_bytes(revision), db=meta)
                txn.put(_COMPACTED, counter_bytes(compacted), db=meta)
            self._env.sync(True)  # the snapshot's index is the new checkpointIndex
            self._record_now(loader.applied)
        except lmdb.Error as e:
            raise self._fail("install of snapshot failed", e) from e
        self._applied = self._checkpoint = loader.applied
        self._revision, self._compacted = revision, compacted
        self._policy.reset()
        self.checkpoints += 1
        return loader.applied
