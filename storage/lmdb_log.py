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
contract in ``raftkv.storage.log_store`` allows. Durability off (Ignite's
``raft.fsync=false``) opens the environment without syncing; ``durable`` reports it.

**Crash safety.** LMDB is copy-on-write: a transaction is either wholly in the file or
not at all, so a process crash can never tear an entry. What checksums add is detection
of damage from outside (bit rot, a file truncated or scribbled on). On open:

1. The file length is checked against the page count recorded in LMDB's own meta pages
   *before* mapping it: reading a page past the end of a truncated file would kill the
   process with SIGBUS instead of raising.
2. Entries after the commit index (the tail not yet known to be committed), and the last
   entry in any case, are verified. The first bad one after the commit index and
   everything after it is truncated and reported (index and file); the leader will send
   them again.
3. Damage at or below the commit index cannot be repaired locally, because those entries
   may be the only copy of acknowledged writes: the store refuses to open with a
   ``CorruptLog`` naming the entry and the file.

Entries below the commit index are verified when they are read (replay, or sending to
a follower), so corruption is never applied or propagated silently.

**Recent entries.** The core reads back what it has just written: the term of the last
entry (to match a leader's append, to commit, to quiesce) and, once committed, the
entries to apply. Each read from LMDB is a transaction plus a checksum, and under a
table's load these reads cost a node more than the writes. So the store keeps the
entries its last saves wrote (``RECENT_BYTES`` of them per store; the log cache of
Kudu, or etcd's in-memory storage) and answers from them. They came from the caller,
not from disk, so there is no checksum to verify; a truncating append, a snapshot or a
compaction updates them in the same step as ``last_index``.

**Shared environments.** A node hosting a table's partitions keeps all their logs in one
environment (``LogEnv(path, shared=True)``, ``DATA_DIR/partition-logs``): each group's
keys in the three databases are prefixed with its id (length first), and the driver
writes every partition's Ready of a turn in one transaction (``LogEnv.save_many``), so
a turn that writes into sixteen partitions costs one commit instead of sixteen. The
CRC covers the prefix too, so an entry under the wrong group is recognised as damaged.
A group's own environment (``LmdbLogStore(path)``) is the same layout with an empty
prefix, byte for byte the format of earlier versions.

**Snapshots.** This store keeps only snapshot *metadata*. The snapshot's data is the
state store itself (a forced checkpoint is the snapshot, IGNITE-16907), which the
driver streams in chunks. ``snapshot().data`` is therefore empty.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable
from itertools import islice, takewhile
from typing import NamedTuple

import lmdb
import msgpack
from raftkv.storage.durable_fs import fsync_dir, makedirs_durable, space_hint
from raftkv.storage.errors import (
    Compacted,
    CorruptLog,
    SnapshotUnavailable,
    StorageError,
    Unavailable,
)
from raftkv.storage.identity import new_incarnation
from raftkv.storage.lmdb_files import check_lmdb_file
from raftkv.storage.log_store import limit_size
from raftkv.storage.records import (
    ENTRY_OVERHEAD,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Identity,
    Snapshot,
    SnapshotMeta,
    VoteFloor,
    payload_bytes,
)

log = logging.getLogger(__name__)

_KEY = struct.Struct(">Q")
_HEAD = struct.Struct(">IQB")  # crc32, term, type; the data follows
_BODY = struct.Struct(">QB")  # term, type: the part of _HEAD the CRC covers
_HEAD_SIZE = _HEAD.size
# The newest entries each store keeps in memory (see "Recent entries"): many turns'
# worth, yet with hundreds of stores per node a few tens of MiB in all. An entry
# costs its payload plus what Python spends on it (a 4-tuple, a bytes object, ints),
# so that many empty entries cannot grow the cache without bound.
RECENT_BYTES = 128 << 10
_CACHED_ENTRY_COST = 160


def _cost(entries: list[Entry]) -> int:
    return payload_bytes(entries) + _CACHED_ENTRY_COST * len(entries)


class OpenReport(NamedTuple):
    """What opening the log found. ``truncated_from`` is 0 when the tail was intact."""

    first_index: int
    last_index: int
    commit: int
    truncated_from: int
    truncated_entries: int
    reason: str


def _record(e: Entry, prefix: bytes = b"") -> tuple[bytes, bytes]:
    """(key, value) for an entry. The CRC covers key + value[4:] (group prefix, index,
    term, type and data), computed over the bytes as stored so reads need no repacking."""
    key = prefix + _KEY.pack(e[1])
    return key, _sealed(key, _BODY.pack(e[0], e[2]) + e[3])


def _sealed(key: bytes, body: bytes) -> bytes:
    """The stored value: the CRC over key + body, then the body."""
    return zlib.crc32(body, zlib.crc32(key)).to_bytes(4, "big") + body


def _key_at(cur: lmdb.Cursor) -> bytes:
    """The cursor's key (b"" past the end); no environment here returns buffers."""
    return bytes(cur.key())


def _intact(key: bytes, value: bytes) -> bool:
    return len(value) >= _HEAD_SIZE and zlib.crc32(
        value[4:], zlib.crc32(key)
    ) == int.from_bytes(value[:4], "big")


class LogEnv:
    """An LMDB environment holding Raft logs: one group's, or many groups' (shared).

    ``LmdbLogStore(path)`` opens an environment of its own, whose keys are the bare
    indexes (the layout the module docstring describes). ``LogEnv(path, shared=True)``
    holds the logs of many groups, as a node hosting a table's partitions needs: each
    group's keys in the three databases start with the group's prefix (its id, length
    first, so no group's keys can fall inside another's range), ``store(group)`` opens
    one group's ``LmdbLogStore`` over it, and ``save_many`` writes several groups'
    batches in one transaction. That is the point of sharing: a turn of the driver that
    writes into many groups pays one commit (one fsync) instead of one per group.

    References: whoever creates the environment holds one and each open store one;
    ``close()`` drops one, and the environment closes with the last. So the owner may
    close it before or after the stores still open on it.
    """

    def __init__(self, path: str, *, durable: bool = True, map_size: int = 1 << 36,
                 shared: bool = False) -> None:
        self.path = path
        self.durable = durable
        self.shared = shared
        self._refs = 1
        self._open: set[str] = set()  # groups with a store open (shared only)
        try:
            makedirs_durable(path)
        except OSError as e:
            raise StorageError(f"{path}: cannot create the Raft log: {e}") from e
        check_lmdb_file(path, "Raft log", CorruptLog)
        try:
            self.env = lmdb.open(
                path, map_size=map_size, max_dbs=3, subdir=True,
                sync=durable, metasync=durable, readahead=False,
            )
            self.entries = self.env.open_db(b"entries")
            self.confs = self.env.open_db(b"confs")
            self.meta = self.env.open_db(b"meta")
        except lmdb.Error as e:
            raise CorruptLog(f"{path}: cannot open the Raft log: {e}") from e
        if durable:
            # LMDB never fsyncs the directory it creates data.mdb in: without this, a
            # power loss could take the whole log, votes included, however often its
            # data was synced (issue 22; raftkv.storage.durable_fs).
            try:
                fsync_dir(path)
            except OSError as e:
                self.env.close()
                raise StorageError(f"{path}: cannot sync the Raft log's directory: {e}") from e
        if not durable:
            log.warning(
                "%s: durability is OFF (like Ignite's raft.fsync=false): the log is not "
                "synced, so a machine crash can lose acknowledged writes", path,
            )

    @staticmethod
    def prefix(group: str) -> bytes:
        name = group.encode()
        if not 0 < len(name) < 256:
            raise StorageError(f"group id {group!r} must be 1..255 bytes to share a log")
        return bytes([len(name)]) + name

    def store(self, group: str, verify_from: int | None = None) -> LmdbLogStore:
        """Open ``group``'s log in this shared environment (one store per group)."""
        if not self.shared:
            raise StorageError(f"{self.path} holds one group's log; it is not shared")
        if group in self._open:
            raise StorageError(f"{self.path}: group {group}'s log is already open")
        store = LmdbLogStore(self, group=group, verify_from=verify_from)
        self._open.add(group)
        return store

    def save_many(
        self, batches: list[tuple[LmdbLogStore, HardState | None, list[Entry], Snapshot | None]],
    ) -> None:
        """Several stores' ``save`` (synced) in one transaction: one commit, one fsync."""
        stores = [b[0] for b in batches]
        for st, hard, _, _ in batches:
            st._stage_hard(hard)

        def put(txn: lmdb.Transaction) -> None:
            for st, _, entries, snap in batches:
                st._put_batch(txn, entries, snap)

        _transaction(self.env, stores, put, "save to the Raft log")
        for st, _, entries, _ in batches:
            st._saved(entries)

    def groups(self) -> set[str]:
        """The groups with any record here (shared environments only)."""
        found: set[str] = set()
        with self.env.begin() as txn:
            for db in (self.entries, self.confs, self.meta):
                cur = txn.cursor(db=db)
                ok = cur.first()
                while ok:
                    key = _key_at(cur)
                    pfx = key[: key[0] + 1]
                    found.add(pfx[1:].decode(errors="replace"))
                    ok = cur.set_range(pfx + b"\xff" * 9)
        return found

    def adopt(self, group: str, path: str) -> int:
        """Move ``group``'s log from an environment of its own at ``path`` (where logs
        lived before they were shared) into this one, in one transaction, and return
        the number of entries moved. The caller deletes ``path`` afterwards. Checksums
        cover the key, so each entry's is recomputed for its new key, but only if it
        verifies under the old one: a damaged entry stays detectably damaged."""
        if self.has(group):
            raise StorageError(f"{self.path}: group {group} already has a log here")
        pfx = self.prefix(group)
        old = lmdb.open(path, max_dbs=3, subdir=True, readonly=True, lock=False)
        moved = 0
        try:
            with old.begin() as src, self.env.begin(write=True) as dst:
                for name, db in ((b"entries", self.entries), (b"confs", self.confs),
                                 (b"meta", self.meta)):
                    rows = src.cursor(db=old.open_db(name, txn=src, create=False))
                    for k, v in rows:
                        key = pfx + k
                        if db is self.entries:
                            moved += 1
                            if _intact(k, v):
                                v = _sealed(key, v[4:])
                        dst.put(key, v, db=db)
        except lmdb.Error as e:
            raise StorageError(f"cannot move the Raft log at {path} into {self.path}: {e}") from e
        finally:
            old.close()
        log.info("moved %d entries of %s's log from %s into %s", moved, group, path, self.path)
        return moved

    def has(self, group: str) -> bool:
        """Whether ``group`` has any record here."""
        pfx = self.prefix(group)
        with self.env.begin() as txn:
            for db in (self.meta, self.entries):
                cur = txn.cursor(db=db)
                if cur.set_range(pfx) and _key_at(cur).startswith(pfx):
                    return True
        return False

    def drop(self, group: str) -> None:
        """Delete every record of ``group`` (its store must be closed)."""
        if group in self._open:
            raise StorageError(f"{self.path}: cannot drop group {group}'s log while it is open")
        pfx = self.prefix(group)

        def delete(txn: lmdb.Transaction) -> None:
            for db in (self.entries, self.confs, self.meta):
                cur = txn.cursor(db=db)
                if cur.set_range(pfx):
                    while _key_at(cur).startswith(pfx):
                        if not cur.delete():
                            break

        _transaction(self.env, [], delete, f"drop group {group}'s log")

    def _closed_store(self, group: str | None) -> None:
        if group is not None:
            self._open.discard(group)
        self.close()

    def close(self) -> None:
        """Drop one reference; the last closes the environment. Once closed, a no-op."""
        if self._refs <= 0:
            return
        self._refs -= 1
        if self._refs == 0:
            self.env.close()

    def _ref(self) -> None:
        if self._refs <= 0:
            raise StorageError(f"{self.path}: the Raft log environment is closed")
        self._refs += 1


def _transaction(env: lmdb.Environment, stores: list[LmdbLogStore],
                 body: Callable[[lmdb.Transaction], object], what: str) -> None:
    """Run ``body`` in one write transaction, with the hard state of each of ``stores``
    that changed since it was last written. If it fails, the stores reload their
    in-memory view (``body`` may have updated it before the transaction aborted)."""
    try:
        with env.begin(write=True) as txn:
            body(txn)
            for st in stores:
                if st._unsaved_hard:
                    txn.put(st._mkey(b"hard"), msgpack.packb(tuple(st._hard)), db=st._meta)
    except BaseException as e:  # whatever aborted the transaction, memory must follow
        for st in stores:
            st._load_meta()
            st._unsaved_hard = False
        if isinstance(e, lmdb.Error):
            where = stores[0]._where if len(stores) == 1 else env.path()
            raise StorageError(f"{where}: cannot {what}: {e}{space_hint(env.path())}") from e
        raise
    for st in stores:
        st._unsaved_hard = False


class LmdbLogStore:
    """The durable ``LogStorage`` (see raftkv.storage.log_store for the contract)."""

    def __init__(
        self, path: str | LogEnv, *, group: str | None = None, durable: bool = True,
        map_size: int = 1 << 36, verify_from: int | None = None,
    ) -> None:
        """Open (or create) the log at ``path``, in an environment of its own, or
        ``group``'s log in a shared ``LogEnv`` (use ``LogEnv.store``).

        ``verify_from`` is where open-time verification starts; by default only the
        uncommitted tail is checked. Recovery does not need more: every read verifies
        each entry's checksum before returning it, so replay refuses a damaged entry
        before applying it, without paying for a second pass at open.
        """
        if isinstance(path, LogEnv):
            if group is None:
                raise StorageError("a store in a shared Raft log environment needs a group")
            path._ref()
            self.env = path
            self._pfx = LogEnv.prefix(group)
            self.path = f"{path.path}[{group}]"
            self._where = f"{path.path}/data.mdb (group {group})"
        else:
            self.env = LogEnv(path, durable=durable, map_size=map_size)
            self._pfx = b""
            self.path = path
            self._where = f"{path}/data.mdb"
        self._group = group
        self._closed = False
        self._plen = len(self._pfx)
        self.durable = self.env.durable
        self.syncs = 0
        self._unsaved_hard = False  # a commit index saved with sync=False, not yet written
        # The newest saved entries, contiguous and ending at _last (or empty); their
        # cost (payload plus _CACHED_ENTRY_COST each) is _recent_bytes.
        self._recent: list[Entry] = []
        self._recent_bytes = 0
        self.created = False  # this open made the log (it had no incarnation yet)
        self._env = self.env.env
        self._entries, self._confs, self._meta = self.env.entries, self.env.confs, self.env.meta
        try:
            try:
                self._load_meta()
            except lmdb.Error as e:
                raise CorruptLog(f"{self._where}: cannot open the Raft log: {e}") from e
            self.open_report = self._verify_tail(verify_from)
            if self._identity is None:
                self._create_identity()
                self.created = True
        except BaseException:
            self.env._closed_store(None)
            raise
        if self.open_report.truncated_from:
            log.warning("%s: %s", self.path, self.open_report.reason)

    # -- keys ----------------------------------------------------------------------------
    def _key(self, index: int) -> bytes:
        return self._pfx + _KEY.pack(index)

    def _index(self, key: bytes) -> int:
        return _KEY.unpack_from(key, self._plen)[0]

    def _mine(self, key: bytes) -> bool:
        """``key`` is one of this group's entry (or conf) keys."""
        return len(key) == self._plen + 8 and key.startswith(self._pfx)

    def _mkey(self, name: bytes) -> bytes:
        return self._pfx + name

    # -- open-time checks ----------------------------------------------------------------
    def _load_meta(self) -> None:
        mkey = self._mkey
        with self._env.begin() as txn:
            hs = txn.get(mkey(b"hard"), db=self._meta)
            sm = txn.get(mkey(b"snap"), db=self._meta)
            base = txn.get(mkey(b"base"), db=self._meta)
            floor = txn.get(mkey(b"floor"), db=self._meta)
            ident = txn.get(mkey(b"ident"), db=self._meta)
            cur = txn.cursor(db=self._entries)
            # The greatest key of this group: step back from above its greatest index.
            ok = cur.prev() if cur.set_range(self._pfx + b"\xff" * 9) else cur.last()
            last = self._index(_key_at(cur)) if ok and self._mine(_key_at(cur)) else None
        self._hard = HardState(*msgpack.unpackb(hs)) if hs else HardState()
        if sm:
            index, term, voters, learners, auto, *rest = msgpack.unpackb(sm)
            records = frozenset((n, i) for n, i in rest[0]) if rest else frozenset()
            conf = ConfState(frozenset(voters), frozenset(learners), frozenset(auto), records)
            self._snap = SnapshotMeta(index, term, conf)
        else:
            self._snap = SnapshotMeta()
        self._base = tuple(msgpack.unpackb(base)) if base else (0, 0)
        self._last = last if last is not None else self._base[0]
        self._floor = VoteFloor(*msgpack.unpackb(floor)) if floor else None
        self._identity = Identity(*msgpack.unpackb(ident)) if ident else None

    def _verify_tail(self, verify_from: int | None) -> OpenReport:
        commit = self._hard.commit
        start = max(commit + 1 if verify_from is None else verify_from, self._base[0] + 1)
        # The last entry too, committed or not: the core reads its term at once (to
        # campaign, to match an append), and a bad one found there stopped the node
        # after it had opened (found from outside), where it belongs here, at open.
        start = min(start, max(self._last, self._base[0] + 1))
        bad, why = 0, ""
        with self._env.begin(db=self._entries) as txn:
            cur = txn.cursor()
            expect = start
            if cur.set_range(self._key(start)):
                for k, v in cur:
                    if not self._mine(k):
                        break
                    index = self._index(k)
                    if index != expect:
                        bad, why = expect, f"entry {expect} is missing"
                        break
                    if not _intact(k, v):
                        bad, why = index, f"entry {index} fails its checksum"
                        break
                    expect += 1
        if bad and bad <= commit:
            raise CorruptLog(
                f"{self._where}: {why}, at or below the commit index {commit}; "
                "refusing to open (committed entries cannot be repaired locally: "
                "restore this node from a replica)"
            )
        if commit > self._last:
            raise CorruptLog(
                f"{self._where}: the log ends at {self._last} but entries up to "
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
            txn.put(self._mkey(b"floor"), msgpack.packb(list(floor)), db=self._meta)
        self._floor = floor
        reason = (f"{why} in {self._where}; truncated the uncommitted tail "
                  f"{bad}..{self._last} ({dropped} entries)")
        self._last = bad - 1
        return OpenReport(self.first_index(), self._last, commit, bad, dropped, reason)


    # -- reads ---------------------------------------------------------------------------
    def initial_state(self) -> tuple[HardState, ConfState]:
        return self._hard, self._snap.conf

    def first_index(self) -> int:
        return self._base[0] + 1

    def identity(self) -> Identity:
        assert self._identity is not None  # made at open
        return self._identity

    def _create_identity(self) -> None:
        """The first open of this group's log: make its incarnation, durably, before
        anything can be written under it. A log that already holds state (written by a
        version without incarnations) is adopted, not newborn."""
        empty = self._hard == HardState() and self._last == 0 and self._snap.index == 0
        ident = Identity(new_incarnation(), empty)

        def put(txn: lmdb.Transaction) -> None:
            txn.put(self._mkey(b"ident"), msgpack.packb(list(ident)), db=self._meta)

        _transaction(self._env, [], put, "record the log's incarnation")
        self._identity = ident

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
        recent = self._recent
        if recent and index >= recent[0][1]:
            return recent[index - recent[0][1]][0]
        key = self._key(index)
        with self._env.begin(db=self._entries) as txn:
            v = txn.get(key)
        if v is None:
            raise CorruptLog(f"{self._where}: entry {index} is missing")
        if not _intact(key, v):
            raise CorruptLog(f"{self._where}: entry {index} fails its checksum")
        return _HEAD.unpack_from(v)[1]

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        self._check_range(lo, hi)
        recent = self._recent
        if recent and lo >= recent[0][1] and lo < hi:
            first = recent[0][1]
            return limit_size(recent[lo - first : hi - first], max_bytes)
        return limit_size(self._read(lo, hi, max_bytes), max_bytes)

    def _rows(self, lo: int, hi: int, max_bytes: int | None = None
              ) -> list[tuple[bytes, bytes]]:
        """Raw (key, value) records ``[lo, hi)`` from one read transaction; with
        ``max_bytes``, only up to the first whose entries pass that budget (the one that
        passes it included, for ``limit_size`` to keep or drop). A byte budget usually
        covers a small part of a long range, and entries may be large: reading windows
        of 64 entries and more, then trimming, read 128 MB to send one 2 MB entry to a
        follower catching up, on every append, and the leader's loop fell behind its
        heartbeats until the other follower deposed it, again and again (found from
        outside, restarting a wiped node)."""
        with self._env.begin(db=self._entries) as txn:
            cur = txn.cursor()
            if not cur.set_key(self._key(lo)):
                rows = []
            elif max_bytes is None:
                rows = list(islice(cur.iternext(), hi - lo))
            else:
                rows, total = [], 0
                for row in islice(cur.iternext(), hi - lo):
                    rows.append(row)
                    total += len(row[1]) - _HEAD_SIZE + ENTRY_OVERHEAD
                    if total > max_bytes:
                        hi = lo + len(rows)
                        break
        # Keys are unique and sorted, so the right count and last key mean no gaps.
        if len(rows) != hi - lo or rows[-1][0] != self._key(hi - 1):
            have = {self._index(k) for k, _ in rows if self._mine(k)}
            missing = next(i for i in range(lo, hi) if i not in have)
            raise CorruptLog(f"{self._where}: entry {missing} is missing")
        return rows

    def _verified(self, lo: int, hi: int, max_bytes: int | None = None
                  ) -> list[tuple[bytes, bytes]]:
        """Records ``[lo, hi)`` (``_rows``) with every checksum verified."""
        rows = self._rows(lo, hi, max_bytes)
        crc32, from_bytes = zlib.crc32, int.from_bytes
        for k, v in rows:
            if crc32(v[4:], crc32(k)) != from_bytes(v[:4], "big"):
                raise CorruptLog(
                    f"{self._where}: entry {self._index(k)} fails its checksum"
                )
        return rows

    def _read(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries ``[lo, hi)`` (``_rows``), each checksum verified."""
        if lo >= hi:
            return []
        new, term_of = tuple.__new__, _BODY.unpack_from
        return [
            new(Entry, (term_of(v, 4)[0], index, v[12], v[_HEAD_SIZE:]))
            for index, (_, v) in enumerate(self._verified(lo, hi, max_bytes), lo)
        ]

    def payloads(self, lo: int, hi: int, max_bytes: int | None = None
                 ) -> list[tuple[int, bytes]]:
        """(index, command) for ``[lo, hi)``, checksums verified, CONF_CHANGE entries as
        b"": what a state store applies (with ``max_bytes``, as ``_rows`` reads). Replay's
        hot path, so it skips building Entries."""
        self._check_range(lo, hi)
        if lo >= hi:
            return []
        return [
            (index, v[_HEAD_SIZE:] if v[12] == EntryType.NORMAL else b"")
            for index, (_, v) in enumerate(self._verified(lo, hi, max_bytes), lo)
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
                [self._index(k) for k in takewhile(self._mine, cur.iternext(values=False))]
                if cur.set_range(self._key(max(lo, self._base[0] + 1))) else []
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
        self._stage_hard(hard_state)
        if not (sync or entries or snapshot is not None):
            # Only the commit index moved: it rides with the next write (log_store's
            # contract), which saves a transaction and two fdatasyncs per commit.
            return
        self._write(lambda txn: self._put_batch(txn, entries, snapshot), "save to the Raft log")
        self._saved(entries)

    def _stage_hard(self, hard_state: HardState | None) -> None:
        if hard_state is not None:
            self._hard = hard_state
            self._unsaved_hard = True

    def _put_batch(self, txn: lmdb.Transaction, entries: list[Entry],
                   snapshot: Snapshot | None) -> None:
        if snapshot is not None:
            self._install(txn, snapshot.meta)
        if entries:
            self._append(txn, entries)

    def _saved(self, entries: list[Entry]) -> None:
        """After a batch's transaction committed."""
        if entries:
            self._last = entries[-1].index
            self._remember(entries)
        self.syncs += 1
        floor = self._floor
        if floor is not None and floor.cleared(self._last, self._commit_term()):
            # Clearing late is harmless (the rule still holds), so no need to do it in
            # the batch's own transaction.
            self._write(lambda txn: txn.delete(self._mkey(b"floor"), db=self._meta),
                        "clear the vote floor")
            self._floor = None

    def _remember(self, entries: list[Entry]) -> None:
        """Keep ``entries``, just saved, as the newest of the recent ones."""
        recent = self._recent
        first = entries[0][1]
        if not recent or first != recent[-1][1] + 1:  # not the usual: right after the last
            if recent and recent[0][1] <= first <= recent[-1][1]:
                cut = first - recent[0][1]
                self._recent_bytes -= _cost(recent[cut:])
                del recent[cut:]
            else:
                recent.clear()
                self._recent_bytes = 0
        recent += entries
        self._recent_bytes += _cost(entries)
        if self._recent_bytes > RECENT_BYTES:
            # Drop the oldest quarter at once rather than one entry per save.
            drop, freed = 0, 0
            while self._recent_bytes - freed > RECENT_BYTES * 3 // 4 and drop < len(recent):
                freed += len(recent[drop][3]) + _CACHED_ENTRY_COST
                drop += 1
            self._recent_bytes -= freed
            del recent[:drop]

    def _forget(self, upto: int | None = None) -> None:
        """Drop the recent entries up to ``upto`` (all of them if None)."""
        recent = self._recent
        if upto is None or (recent and upto >= recent[-1][1]):
            recent.clear()
            self._recent_bytes = 0
        elif recent and upto >= recent[0][1]:
            cut = upto - recent[0][1] + 1
            self._recent_bytes -= _cost(recent[:cut])
            del recent[:cut]

    def _append(self, txn: lmdb.Transaction, entries: list[Entry]) -> None:
        first = entries[0].index
        if first <= self._base[0]:
            raise StorageError(f"append at {first} overlaps the compacted prefix (to {self._base[0]})")
        if first > self._last + 1:
            raise StorageError(f"append at {first} leaves a gap after {self._last}")
        if first <= self._last:
            self._delete_from(txn, first)
        # append=True skips the B-tree search, but only the last keys of the database
        # qualify: in a shared environment other groups' keys may follow this group's.
        txn.cursor(db=self._entries).putmulti(
            [_record(e, self._pfx) for e in entries], append=not self._pfx)
        confs = [(self._key(e[1]), b"") for e in entries if e[2] == EntryType.CONF_CHANGE]
        if confs:
            txn.cursor(db=self._confs).putmulti(confs)

    def _delete_from(self, txn: lmdb.Transaction, first: int) -> None:
        """Suffix truncation: drop entries ``first..`` (and their conf markers)."""
        for db in (self._entries, self._confs):
            cur = txn.cursor(db=db)
            if cur.set_range(self._key(first)):
                while self._mine(_key_at(cur)) and cur.delete():
                    pass

    def _install(self, txn: lmdb.Transaction, meta: SnapshotMeta) -> None:
        if meta.index <= self._snap.index:
            raise StorageError(
                f"snapshot {meta.index} is not newer than the current one ({self._snap.index})"
            )
        self._delete_from(txn, 0)
        self._put_snap(txn, meta)
        self._put_base(txn, (meta.index, meta.term))
        self._last = meta.index
        self._forget()

    def _put_snap(self, txn: lmdb.Transaction, meta: SnapshotMeta) -> None:
        c = meta.conf
        txn.put(self._mkey(b"snap"), msgpack.packb(
            [meta.index, meta.term, sorted(c.voters), sorted(c.learners), sorted(c.auto_promote),
             [[n, i] for n, i in sorted(c.incarnations)]]
        ), db=self._meta)
        self._snap = meta

    def _put_base(self, txn: lmdb.Transaction, base: tuple[int, int]) -> None:
        txn.put(self._mkey(b"base"), msgpack.packb(list(base)), db=self._meta)
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
        _transaction(self._env, [self], body, what)

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
                if cur.set_range(self._pfx):
                    while self._mine(_key_at(cur)) and self._index(_key_at(cur)) <= index:
                        if not cur.delete():
                            break

        self._write(drop_prefix, "compact the log")
        self._forget(index)

    def close(self) -> None:
        """Write a pending hard state and release the environment; idempotent (a
        second close must not drop another store's reference to a shared one)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._unsaved_hard:
                self._write(lambda txn: None, "save the hard state")
        finally:
            self.env._closed_store(self._group)
