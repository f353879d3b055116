"""The Raft log, hard state and membership in LMDB.

Theory of operation
-------------------
One LMDB environment (a directory holding ``data.mdb``) with three named databases:

- ``entries``: key = 8-byte big-endian index (so LMDB's byte order is log order),
  value = ``crc32 | term | type | data``. The CRC covers the index, term, type and data,
  so an entry that was damaged, or moved, is recognised.
- ``confs``: the indexes of CONF_CHANGE entries, so a restarting node rebuilds its
  membership without scanning the log.
- ``meta``: the hard state; the snapshot metadata (index, term, configuration); and the
  compaction boundary ``base`` (index, term of the last entry dropped), which may lie
  below the snapshot when compaction keeps a few entries for slightly-behind followers.

**Group commit.** ``save()`` writes one Ready batch (hard state, entries, snapshot) in one
write transaction. With durability on (the default), LMDB syncs once at commit, so a
batch of any size costs one fsync, never one per entry. A batch that only moves the
commit index (``sync=False``) is not written at all until the next transaction, as the
contract in ``storage.log_store`` allows. Durability off (Ignite's
``raft.fsync=false``) opens the environment without syncing; ``durable`` reports it.

**Crash safety.** LMDB is copy-on-write: a transaction is either wholly in the file or
not at all, so a process crash can never tear an entry. What checksums add is detection
of damage from outside (bit rot, a file truncated or scribbled on). On open:

1. The file length is checked against the page count recorded in LMDB's own meta pages
   *before* mapping it: reading a page past the end of a truncated file would kill the
   process with SIGBUS instead of raising.
2. Entries after the commit index (the tail not yet known to be committed) are verified.
   The first bad one and everything after it is truncated and reported (index and
   file); the leader will send them again.
3. Damage at or below the commit index cannot be repaired locally, because those entries
   may be the only copy of acknowledged writes: the store refuses to open with a
   ``CorruptLog`` naming the entry and the file.

Entries below the commit index are verified when they are read (replay, or sending to
a follower), so corruption is never applied or propagated silently.

**Snapshots.** This store keeps only snapshot *metadata*. The snapshot's data is the
state store itself (a forced checkpoint is the snapshot, IGNITE-16907), which the
driver streams in chunks. ``snapshot().data`` is therefore empty.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable
from itertools import islice
from typing import NamedTuple

import lmdb
import msgpack

from storage.errors import Compacted, CorruptLog, SnapshotUnavailable, StorageError, Unavailable
from storage.lmdb_files import check_lmdb_file
from storage.log_store import limit_size
from storage.records import (
    ENTRY_OVERHEAD,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Snapshot,
    SnapshotMeta,
    VoteFloor,
)

log = logging.getLogger(__name__)

_KEY = struct.Struct(">Q")
_HEAD = struct.Struct(">IQB")  # crc32, term, type; the data follows
_BODY = struct.Struct(">QB")  # term, type: the part of _HEAD the CRC covers
_HEAD_SIZE = _HEAD.size


class OpenReport(NamedTuple):
    """What opening the log found. ``truncated_from`` is 0 when the tail was intact."""

    first_index: int
    last_index: int
    commit: int
    truncated_from: int
    truncated_entries: int
    reason: str


def _record(e: Entry) -> tuple[bytes, bytes]:
    """(key, value) for an entry. The CRC covers key + value[4:] (index, term, type and
    data), computed over the bytes as stored so reads need no repacking."""
    key = _KEY.pack(e[1])
    body = _BODY.pack(e[0], e[2]) + e[3]
    return key, zlib.crc32(body, zlib.crc32(key)).to_bytes(4, "big") + body


def _intact(key: bytes, value: bytes) -> bool:
    return len(value) >= _HEAD_SIZE and zlib.crc32(
        value[4:], zlib.crc32(key)
    ) == int.from_bytes(value[:4], "big")


class LmdbLogStore:
    """The durable ``LogStorage`` (see storage.log_store for the contract)."""

    def __init__(
        self, path: str, *, durable: bool = True, map_size: int = 1 << 36,
        verify_from: int | None = None,
    ) -> None:
        """Open (or create) the log at ``path``.

        ``verify_from`` is where open-time verification starts; by default only the
        uncommitted tail is checked. Recovery does not need more: every read verifies
        each entry's checksum before returning it, so replay refuses a damaged entry
        before applying it, without paying for a second pass at open.
        """
        self.path = path
        self.durable = durable
        self.syncs = 0
        self._unsaved_hard = False  # a commit index saved with sync=False, not yet written
        os.makedirs(path, exist_ok=True)
        check_lmdb_file(path, "Raft log", CorruptLog)
        try:
            self._env = lmdb.open(
                path, map_size=map_size, max_dbs=3, subdir=True,
                sync=durable, metasync=durable, readahead=False,
            )
            self._entries = self._env.open_db(b"entries")
            self._confs = self._env.open_db(b"confs")
            self._meta = self._env.open_db(b"meta")
            self._load_meta()
        except lmdb.Error as e:
            raise CorruptLog(f"{path}: cannot open the Raft log: {e}") from e
        if not durable:
            log.warning(
                "%s: durability is OFF (like Ignite's raft.fsync=false): the log is not "
                "synced, so a machine crash can lose acknowledged writes", path,
            )
        self.open_report = self._verify_tail(verify_from)
        if self.open_report.truncated_from:
            log.warning("%s: %s", path, self.open_report.reason)

    # -- open-time checks ----------------------------------------------------------------
    def _load_meta(self) -> None:
        with self._env.begin() as txn:
            hs = txn.get(b"hard", db=self._meta)
            sm = txn.get(b"snap", db=self._meta)
            base = txn.get(b"base", db=self._meta)
            floor = txn.get(b"floor", db=self._meta)
            cur = txn.cursor(db=self._entries)
            last = _KEY.unpack(cur.key())[0] if cur.last() else None
        self._hard = HardState(*msgpack.unpackb(hs)) if hs else HardState()
        if sm:
            index, term, voters, learners, auto = msgpack.unpackb(sm)
            conf = ConfState(frozenset(voters), frozenset(learners), frozenset(auto))
            self._snap = SnapshotMeta(index, term, conf)
        else:
            self._snap = SnapshotMeta()
        self._base = tuple(msgpack.unpackb(base)) if base else (0, 0)
        self._last = last if last is not None else self._base[0]
        self._floor = VoteFloor(*msgpack.unpackb(floor)) if floor else None

    def _verify_tail(self, verify_from: int | None) -> OpenReport:
        commit = self._hard.commit
        start = max(commit + 1 if verify_from is None else verify_from, self._base[0] + 1)
        bad, why = 0, ""
        with self._env.begin(db=self._entries) as txn:
            cur = txn.cursor()
            expect = start
            if cur.set_range(_KEY.pack(start)):
                for k, v in cur:
                    index = _KEY.unpack(k)[0]
                    if index != expect:
                        bad, why = expect, f"entry {expect} is missing"
                        break
                    if not _intact(k, v):
                        bad, why = index, f"entry {index} fails its checksum"
                        break
                    expect += 1
        if bad and bad <= commit:
            raise CorruptLog(
                f"{self.path}/data.mdb: {why}, at or below the commit index {commit}; "
                "refusing to open (committed entries cannot be repaired locally: "
                "restore this node from a replica)"
            )
        if commit > self._last:
            raise CorruptLog(
                f"{self.path}/data.mdb: the log ends at {self._last} but entries up to "
                f"{commit} were committed; refusing to open (restore from a replica)"
            )
        if not bad:
            return OpenReport(self.first_index(), self._last, commit, 0, 0, "")
        dropped = self._last - bad + 1
        # Entries bad..last may have been acknowledged: remember that, durably and in
        # the same transaction, so a second crash cannot forget it (see VoteFloor).
        floor = VoteFloor(self._last, self._hard.term)
        if self._floor is not None:
            floor = VoteFloor(max(floor.index, self._floor.index), max(floor.term, self._floor.term))
        with self._env.begin(write=True) as txn:
            self._delete_from(txn, bad)
            txn.put(b"floor", msgpack.packb(list(floor)), db=self._meta)
        self._floor = floor
        reason = (f"{why} in {self.path}/data.mdb; truncated the uncommitted tail "
                  f"{bad}..{self._last} ({dropped} entries)")
        self._last = bad - 1
        return OpenReport(self.first_index(), self._last, commit, bad, dropped, reason)


    # -- reads ---------------------------------------------------------------------------
    def initial_state(self) -> tuple[HardState, ConfState]:
        return self._hard, self._snap.conf

    def first_index(self) -> int:
        return self._base[0] + 1

    def vote_floor(self) -> VoteFloor | None:
        """Set while this node may lack entries it acknowledged (see VoteFloor)."""
        return self._floor

    def _commit_term(self) -> int:
        commit = self._hard.commit
        return self.term(commit) if self._base[0] <= commit <= self._last else 0

    def last_index(self) -> int:
        return self._last

    def term(self, index: int) -> int:
        base, base_term = self._base
        if index < base:
            raise Compacted(index, base + 1)
        if index == base:
            return base_term
        if index > self._last:
            raise Unavailable(index, self._last)
        key = _KEY.pack(index)
        with self._env.begin(db=self._entries) as txn:
            v = txn.get(key)
        if v is None:
            raise CorruptLog(f"{self.path}/data.mdb: entry {index} is missing")
        if not _intact(key, v):
            raise CorruptLog(f"{self.path}/data.mdb: entry {index} fails its checksum")
        return _HEAD.unpack_from(v)[1]

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        self._check_range(lo, hi)
        if max_bytes is None:
            return self._read(lo, hi)
        # A byte budget usually covers a small part of a long range: read in growing
        # windows instead of decoding entries that would be trimmed away.
        out: list[Entry] = []
        total, window = 0, 64
        while lo < hi:
            part = self._read(lo, min(lo + window, hi))
            out += part
            total += sum(len(e[3]) for e in part) + ENTRY_OVERHEAD * len(part)
            if total > max_bytes:
                break
            lo += len(part)
            window *= 4
        return limit_size(out, max_bytes)

    def _rows(self, lo: int, hi: int) -> list[tuple[bytes, bytes]]:
        """Raw (key, value) records ``[lo, hi)`` from one read transaction."""
        with self._env.begin(db=self._entries) as txn:
            cur = txn.cursor()
            rows = list(islice(cur.iternext(), hi - lo)) if cur.set_key(_KEY.pack(lo)) else []
        # Keys are unique and sorted, so the right count and last key mean no gaps.
        if len(rows) != hi - lo or rows[-1][0] != _KEY.pack(hi - 1):
            have = {_KEY.unpack(k)[0] for k, _ in rows}
            missing = next(i for i in range(lo, hi) if i not in have)
            raise CorruptLog(f"{self.path}/data.mdb: entry {missing} is missing")
        return rows

    def _verified(self, lo: int, hi: int) -> list[tuple[bytes, bytes]]:
        """Records ``[lo, hi)`` with every checksum verified."""
        rows = self._rows(lo, hi)
        crc32, from_bytes = zlib.crc32, int.from_bytes
        for k, v in rows:
            if crc32(v[4:], crc32(k)) != from_bytes(v[:4], "big"):
                raise CorruptLog(
                    f"{self.path}/data.mdb: entry {_KEY.unpack(k)[0]} fails its checksum"
                )
        return rows

    def _read(self, lo: int, hi: int) -> list[Entry]:
        """Entries ``[lo, hi)``, each checksum verified."""
        if lo >= hi:
            return []
        new, term_of = tuple.__new__, _BODY.unpack_from
        return [
            new(Entry, (term_of(v, 4)[0], index, v[12], v[_HEAD_SIZE:]))
            for index, (_, v) in enumerate(self._verified(lo, hi), lo)
        ]

    def payloads(self, lo: int, hi: int) -> list[tuple[int, bytes]]:
        """(index, command) for ``[lo, hi)``, checksums verified, CONF_CHANGE entries as
        b"": what a state store applies. Replay's hot path, so it skips building Entries."""
        self._check_range(lo, hi)
        if lo >= hi:
            return []
        return [
            (index, v[_HEAD_SIZE:] if v[12] == EntryType.NORMAL else b"")
            for index, (_, v) in enumerate(self._verified(lo, hi), lo)
        ]

    def _check_range(self, lo: int, hi: int) -> None:
        if lo <= self._base[0]:
            raise Compacted(lo, self._base[0] + 1)
        if hi > self._last + 1:
            raise Unavailable(hi - 1, self._last)

    def conf_entries(self, lo: int) -> list[Entry]:
        with self._env.begin(db=self._confs) as txn:
            cur = txn.cursor()
            indexes = (
                [_KEY.unpack(k)[0] for k in cur.iternext(values=False)]
                if cur.set_range(_KEY.pack(max(lo, self._base[0] + 1))) else []
            )
        return [self.entries(i, i + 1)[0] for i in indexes]

    def snapshot(self) -> Snapshot:
        if not self._snap.index:
            raise SnapshotUnavailable("no snapshot has been taken yet")
        return Snapshot(self._snap, b"")

    # -- writes --------------------------------------------------------------------------
    def save(
        self, hard_state: HardState | None, entries: list[Entry],
        snapshot: Snapshot | None = None, sync: bool = True,
    ) -> None:
        if hard_state is not None:
            self._hard = hard_state
            self._unsaved_hard = True
        if not (sync or entries or snapshot is not None):
            # Only the commit index moved: it rides with the next write (log_store's
            # contract), which saves a transaction and two fdatasyncs per commit.
            return

        def batch(txn: lmdb.Transaction) -> None:
            if snapshot is not None:
                self._install(txn, snapshot.meta)
            if entries:
                self._append(txn, entries)

        self._write(batch, "save to the Raft log")
        if entries:
            self._last = entries[-1].index
        self.syncs += 1
        floor = self._floor
        if floor is not None and floor.cleared(self._last, self._commit_term()):
            # Clearing late is harmless (the rule still holds), so no need to do it in
            # the batch's own transaction.
            self._write(lambda txn: txn.delete(b"floor", db=self._meta), "clear the vote floor")
            self._floor = None

    def _append(self, txn: lmdb.Transaction, entries: list[Entry]) -> None:
        first = entries[0].index
        if first <= self._base[0]:
            raise StorageError(f"append at {first} overlaps the compacted prefix (to {self._base[0]})")
        if first > self._last + 1:
            raise StorageError(f"append at {first} leaves a gap after {self._last}")
        if first <= self._last:
            self._delete_from(txn, first)
        txn.cursor(db=self._entries).putmulti([_record(e) for e in entries], append=True)
        confs = [(_KEY.pack(e[1]), b"") for e in entries if e[2] == EntryType.CONF_CHANGE]
        if confs:
            txn.cursor(db=self._confs).putmulti(confs)

    def _delete_from(self, txn: lmdb.Transaction, first: int) -> None:
        """Suffix truncation: drop entries ``first..`` (and their conf markers)."""
        for db in (self._entries, self._confs):
            cur = txn.cursor(db=db)
            if cur.set_range(_KEY.pack(first)):
                while cur.delete():
                    pass

    def _install(self, txn: lmdb.Transaction, meta: SnapshotMeta) -> None:
        if meta.index <= self._snap.index:
            raise StorageError(
                f"snapshot {meta.index} is not newer than the current one ({self._snap.index})"
            )
        txn.drop(self._entries, delete=False)
        txn.drop(self._confs, delete=False)
        self._put_snap(txn, meta)
        self._put_base(txn, (meta.index, meta.term))
        self._last = meta.index

    def _put_snap(self, txn: lmdb.Transaction, meta: SnapshotMeta) -> None:
        c = meta.conf
        txn.put(b"snap", msgpack.packb(
            [meta.index, meta.term, sorted(c.voters), sorted(c.learners), sorted(c.auto_promote)]
        ), db=self._meta)
        self._snap = meta

    def _put_base(self, txn: lmdb.Transaction, base: tuple[int, int]) -> None:
        txn.put(b"base", msgpack.packb(list(base)), db=self._meta)
        self._base = base

    def create_snapshot(self, index: int, conf: ConfState, data: bytes = b"") -> Snapshot:
        """Record that the state store is durable through ``index`` (its forced
        checkpoint); ``data`` is ignored: the state store *is* the snapshot."""
        if index <= self._snap.index:
            raise SnapshotUnavailable(f"snapshot at {index} is older than {self._snap.index}")
        meta = SnapshotMeta(index, self.term(index), conf)
        self._write(lambda txn: self._put_snap(txn, meta), "record a snapshot")
        return Snapshot(meta, b"")

    def _write(self, body: Callable[[lmdb.Transaction], object], what: str) -> None:
        """Run ``body`` in a write transaction, with the hard state if it has changed
        since it was last written; if it fails, reload the in-memory view (``body`` may
        have updated it before the transaction aborted)."""
        try:
            with self._env.begin(write=True) as txn:
                body(txn)
                if self._unsaved_hard:
                    txn.put(b"hard", msgpack.packb(tuple(self._hard)), db=self._meta)
        except BaseException as e:  # whatever aborted the transaction, memory must follow
            self._load_meta()
            self._unsaved_hard = False
            if isinstance(e, lmdb.Error):
                raise StorageError(f"{self.path}: cannot {what}: {e}") from e
            raise
        self._unsaved_hard = False

    def compact(self, index: int) -> None:
        """Drop entries up to ``index`` (at most the snapshot's index)."""
        if index <= self._base[0]:
            return
        if index > self._snap.index:
            raise StorageError(
                f"cannot compact to {index}: the latest snapshot is at {self._snap.index}"
            )
        base = (index, self.term(index))

        def drop_prefix(txn: lmdb.Transaction) -> None:
            self._put_base(txn, base)
            for db in (self._entries, self._confs):
                cur = txn.cursor(db=db)
                if cur.first():
                    while cur.key() and _KEY.unpack(cur.key())[0] <= index:
                        if not cur.delete():
                            break

        self._write(drop_prefix, "compact the log")

    def close(self) -> None:
        if self._unsaved_hard:
            self._write(lambda txn: None, "save the hard state")
        self._env.close()
