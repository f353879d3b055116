"""``LmdbStateStore``: the KV state machine in LMDB, without a per-commit sync.

It keeps the ``StateStore`` contract (``raftkv.storage.state_store``). Its theory of operation is
IGNITE-16907's: the Raft log is the WAL. What is LMDB-specific:

- **No per-commit sync.** The env is opened with ``sync=False, metasync=False``. A commit
  is then a ``pwrite`` into the page cache, so it is atomic, consistent and isolated but not
  durable. A *process* crash loses nothing: the page cache survives it. A *machine* crash
  may undo the commits since the last ``env.sync``. With ``MDB_NOSYNC``, LMDB's docs say
  integrity across a machine crash relies on the filesystem preserving write order; without
  that, the last transactions can be corrupted, not just lost, so each checkpoint is
  *pinned* and recorded, and an uncleanly shut store is rolled back to it on open
  (``raftkv.storage.lmdb_checkpoint``; docs/durability.md). The Raft log keeps every
  entry after the checkpointIndex, so a store that comes back at an older, consistent index
  simply replays.
- **checkpoint = ``env.sync(True)``**: one fdatasync covering everything committed so far.
  The applied index it covers becomes the checkpointIndex. It is kept in memory. On disk
  there is only the applied index, and after a checkpoint the two are equal.
- **Layout.** Two named DBs. ``data`` holds key -> value. ``meta`` holds ``b"applied"``
  (8-byte big-endian) and ``b"format"``. The applied index is written in the same write
  transaction as the data it covers, so whatever a crash leaves, data and index agree.
- **Open.** ``data.mdb`` is first checked against the length its meta page records:
  reading past the end of a truncated file through the mmap would kill the process with
  SIGBUS instead of raising (after the checkpoint record has rolled back a meta page
  that a power loss kept without its data). Then applied_index = checkpoint_index = the
  stored applied index, and open syncs once and records it.
- **Readers never block the writer.** ``scan`` and ``snapshot_chunks`` hold one read
  transaction (MVCC), so a snapshot export is not a stop-the-world. A long-lived reader does
  pin old pages, so the file can grow until it finishes. Consume or ``close()`` those
  iterators.
- **Errors.** Every ``lmdb.Error`` surfaces as ``StorageError`` naming the path, and a
  failed write transaction is aborted, leaving the state untouched. One ``LmdbStateStore``
  per path per process: LMDB forbids opening the same env twice in one process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import takewhile
from typing import Self, TypeVar

import lmdb
from raftkv.storage.commands import MAX_KEY_BYTES
from raftkv.storage.digest import Digest, DigestBuilder
from raftkv.storage.durable_fs import fsync_dir, makedirs_durable, space_hint
from raftkv.storage.errors import CheckpointDeferred, StorageError, out_of_descriptors
from raftkv.storage.lmdb_checkpoint import CheckpointFile, Record
from raftkv.storage.lmdb_files import check_lmdb_file
from raftkv.storage.revisions import HEADER_BYTES, KeyMeta, meta_of
from raftkv.storage.state_store import (
    DEFAULT_CHECKPOINT_ENTRIES,
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_CHUNK_BYTES,
    KV_ROWS,
    OUTCOME_WINDOW,
    Checkpointing,
    CheckpointPolicy,
    SnapshotLoader,
    apply_commands,
    check_apply,
    check_chunk_bytes,
    decode_outcome,
    encode_outcome,
    encode_snapshot,
    storable_key,
)

T = TypeVar("T")
_log = logging.getLogger(__name__)

DEFAULT_MAP_SIZE = 1 << 34  # 16 GiB of address space; the file is sparse and grows as used
_DATA = b"data"
_META = b"meta"
_APPLIED = b"applied"
_FORMAT = b"format"
_OUTCOMES = b"outcomes"  # index -> whether that conditional entry wrote (StateStore.outcome)
_OUTCOMES_FROM = b"outcomes_from"
# The index of the last snapshot image installed (0: none), in the same transaction as
# the image: a crash before the log records that snapshot leaves the store ahead of its
# log with no other trace, and an offline tool must tell that apart from applies past the
# log's commit record (``LmdbBacked.image_index``). Absent in stores made before it.
IMAGE_INDEX = b"image_index"
_FORMAT_V1 = b"raftkv-state-v1"  # values without revisions: refused (see _open_dbs)
_FORMAT_V2 = b"raftkv-state-v2"  # rows: revisions, then the value (raftkv.storage.revisions)


def _index_bytes(index: int) -> bytes:
    return index.to_bytes(8, "big")


class _ReadIterator(Iterator[T]):
    """An iterator over one LMDB read transaction that releases it as soon as it is done,
    errs, is closed, or is garbage collected. A lingering reader would pin old pages."""

    def __init__(self, it: Iterator[T], txn: lmdb.Transaction[bytes], path: str) -> None:
        self._it = it
        self._txn: lmdb.Transaction[bytes] | None = txn
        self._path = path

    def __iter__(self) -> _ReadIterator[T]:
        return self

    def __next__(self) -> T:
        if self._txn is None:
            raise StopIteration
        try:
            return next(self._it)
        except StopIteration:
            self.close()
            raise
        except lmdb.Error as e:
            self.close()
            raise StorageError(f"reading LMDB state store at {self._path}: {e}") from e
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            try:
                txn.abort()
            except lmdb.Error:
                pass  # the env was closed under us; the reader is gone either way

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class LmdbBacked(Checkpointing):
    """What every store kept in one LMDB environment shares: errors that name the store,
    checkpoint = ``env.sync``, and an idempotent ``close``. ``_what`` names the store."""

    _env: lmdb.Environment
    _closed: bool
    _meta: lmdb._Database

    def image_index(self) -> int | None:
        """The index of the last snapshot image installed (0: never), or None for a
        store made before it was recorded (see ``IMAGE_INDEX``)."""
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(IMAGE_INDEX)
        return None if raw is None else int.from_bytes(raw, "big")
    path: str
    _what = "LMDB state store"

    def _live(self) -> None:
        if self._closed:
            raise StorageError(f"{self._what} at {self.path} is closed")

    def _fail(self, what: str, e: lmdb.Error) -> StorageError:
        hint = (" (raise map_size)" if isinstance(e, lmdb.MapFullError)
                else space_hint(self.path))
        return StorageError(f"{what} in the {self._what} at {self.path}: {e}{hint}")

    def _init_checkpointing(self, path: str | os.PathLike[str], entries: int,
                            seconds: float) -> None:
        self.path = os.fspath(path)
        self._policy = CheckpointPolicy(entries, seconds)
        self.checkpoints = 0  # checkpoints that made something durable (for tests)
        # Held by a background checkpoint's sync and by close: closing the env under a
        # sync running on another thread would free what the sync is using.
        self._sync_lock = threading.Lock()

    # -- the pinned checkpoint (raftkv.storage.lmdb_checkpoint) -------------------------------
    def _prepare_env(self) -> Record | None:
        """Before ``lmdb.open``: the directory, durably, and the checkpoint record (which
        rolls an uncleanly shut environment back to its last checkpoint)."""
        self._pin: lmdb.Transaction[bytes] | None = None
        self._next_pin: tuple[int, lmdb.Transaction[bytes]] | None = None
        self._ckpt = CheckpointFile(self.path, self._what)
        try:
            makedirs_durable(self.path)
            return self._ckpt.prepare()
        except OSError as e:
            raise StorageError(f"cannot open the {self._what} at {self.path}: {e}") from e

    def _opened(self, applied: int, rec: Record | None) -> None:
        """After LMDB opened the environment (and synced it): make the names of its
        files durable, check it is at its recorded checkpoint, and record and pin it."""
        try:
            fsync_dir(self.path)
        except OSError as e:
            raise StorageError(f"cannot open the {self._what} at {self.path}: {e}") from e
        if rec is not None and rec.txnid and applied != rec.applied:
            raise StorageError(
                f"cannot open the {self._what} at {self.path}: its checkpoint record says "
                f"applied index {rec.applied}, the store holds {applied}: it is damaged; "
                f"rebuild this replica (move the directory away)")
        self._record_now(applied)

    def _begin_pin(self) -> tuple[lmdb.Transaction[bytes], int, bytes]:
        """A reader on the newest snapshot, its transaction id and meta page."""
        pin = self._env.begin()
        try:
            txnid = pin.id()
            return pin, txnid, self._ckpt.capture(txnid)
        except OSError as e:  # capture reads the meta pages from the data file
            pin.abort()
            if out_of_descriptors(e):
                raise CheckpointDeferred(f"checkpoint of the {self._what} at {self.path} "
                                         f"deferred: {e}") from e
            raise
        except BaseException:
            pin.abort()
            raise

    def _write_record(self, txnid: int, applied: int, meta: bytes) -> None:
        try:
            self._ckpt.write(txnid, applied, meta)
        except OSError as e:
            if out_of_descriptors(e):  # the record file did not open: nothing written
                raise CheckpointDeferred(f"checkpoint record of the {self._what} at "
                                         f"{self.path} deferred: {e}") from e
            raise StorageError(f"checkpoint record failed in the {self._what} at "
                               f"{self.path}: {e}") from e

    def _swap_pin(self, pin: lmdb.Transaction[bytes]) -> None:
        old, self._pin = self._pin, pin
        if old is not None:
            old.abort()

    def _record_now(self, applied: int) -> None:
        """Record the newest snapshot, already synced, as the checkpoint, and pin it."""
        pin, txnid, meta = self._begin_pin()
        try:
            self._write_record(txnid, applied, meta)
        except BaseException:
            pin.abort()
            raise
        self._swap_pin(pin)

    def _make_durable(self, applied: int) -> bool:
        pin, txnid, meta = self._begin_pin()
        try:
            if not self._sync():
                pin.abort()
                return False
            self._write_record(txnid, applied, meta)
        except BaseException:
            pin.abort()
            raise
        self._swap_pin(pin)
        return True

    def _sync(self) -> bool:
        """``env.sync``, unless the store closed meanwhile (then False)."""
        with self._sync_lock:
            if self._closed:
                return False
            try:
                self._env.sync(True)
            except lmdb.Error as e:
                raise self._fail("checkpoint (sync) failed", e) from e
        return True

    def background_checkpoint(self) -> Callable[[], int] | None:
        """``env.sync`` is an fdatasync of the data file, which flushes every commit made
        before it starts; commits made meanwhile on the store's thread are simply not
        promised. So the job promises the applied index as of now (0 if the store
        closed first: nothing to record)."""
        self._live()
        applied = self._applied
        if applied == self._checkpoint:
            return None
        self._drop_next_pin()
        pin, txnid, meta = self._begin_pin()
        self._next_pin = (applied, pin)

        def job() -> int:
            if not self._sync():
                return 0
            with self._sync_lock:
                if self._closed:
                    return 0
                self._write_record(txnid, applied, meta)
            return applied

        return job

    def _drop_next_pin(self) -> None:
        nxt, self._next_pin = self._next_pin, None
        if nxt is not None:
            nxt[1].abort()

    def checkpointed(self, index: int) -> None:
        self._live()
        nxt = self._next_pin
        if nxt is not None and nxt[0] == index and index > self._checkpoint:
            self._next_pin = None
            self._swap_pin(nxt[1])
        else:
            self._drop_next_pin()
        super().checkpointed(index)

    def _close_checkpoint(self) -> None:
        """A clean close records the newest snapshot, so the next open keeps it."""
        last = self._ckpt.last
        with self._env.begin() as txn:
            txnid = txn.id()
        if last is not None and last.txnid >= txnid:
            return
        self._env.sync(True)
        self._ckpt.write(txnid, self._applied, self._ckpt.capture(txnid))

    def close(self) -> None:
        with self._sync_lock:
            if not getattr(self, "_closed", True):
                self._closed = True
                try:
                    self._close_checkpoint()
                except (lmdb.Error, OSError, StorageError) as e:
                    _log.warning("%s: no checkpoint at close (%s): the next open rolls "
                                 "back to the last one and replays", self.path, e)
                self._drop_next_pin()
                if self._pin is not None:
                    self._pin.abort()
                    self._pin = None
                self._env.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LmdbStateStore(LmdbBacked):
    """The durable ``StateStore`` (contract: raftkv.storage.state_store; theory: this module).

    ``path`` is the env directory, created if missing. ``map_size`` is address space, not
    disk: the file is sparse and grows as used. ``checkpoint_entries`` and
    ``checkpoint_seconds`` configure ``maybe_checkpoint`` (see ``CheckpointPolicy``).
    Opening anything other than a raftkv state store (a file, garbage, a truncated file,
    another program's LMDB env) raises ``StorageError`` naming the path.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        checkpoint_entries: int = DEFAULT_CHECKPOINT_ENTRIES,
        checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS,
    ) -> None:
        self._init_checkpointing(path, checkpoint_entries, checkpoint_seconds)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise StorageError(f"cannot create the LMDB state store at {self.path}: "
                               "Not a directory")
        rec = self._prepare_env()
        check_lmdb_file(self.path, "LMDB state store")
        try:
            self._env = lmdb.open(
                self.path,
                subdir=True,
                create=True,
                map_size=map_size,
                max_dbs=3,
                sync=False,  # ACI, not D: the Raft log is the WAL (module docstring)
                metasync=False,
                readahead=False,  # random point reads; readahead only pollutes the cache
            )
        except lmdb.Error as e:
            raise StorageError(f"cannot open LMDB state store at {self.path}: {e}") from e
        try:
            self._data, self._meta, self._outcomes, applied = self._open_dbs()
            # Make "stored applied index == checkpointIndex" true (module docstring: Open).
            self._env.sync(True)
            self._opened(applied, rec)
        except lmdb.Error as e:
            self._env.close()
            raise StorageError(f"cannot open LMDB state store at {self.path}: {e}") from e
        except StorageError:
            self._env.close()
            raise
        self._applied = self._checkpoint = applied
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(_OUTCOMES_FROM)
        # Kept here too: a watch asks for every conditional entry it reads.
        self._outcomes_from = int.from_bytes(raw, "big") if raw is not None else 1
        self._closed = False

    def _open_dbs(self) -> tuple[lmdb._Database, lmdb._Database, lmdb._Database, int]:
        env = self._env
        with env.begin(write=True) as txn:
            # The main DB of an env with named DBs lists their names. Anything else here
            # is some other program's LMDB env (a LogStore, say): refuse rather than mix.
            names = set(txn.cursor().iternext(values=False))
            if not names:
                data = env.open_db(_DATA, txn=txn, create=True)
                meta = env.open_db(_META, txn=txn, create=True)
                outcomes = env.open_db(_OUTCOMES, txn=txn, create=True)
                txn.put(_FORMAT, _FORMAT_V2, db=meta)
                txn.put(_APPLIED, _index_bytes(0), db=meta)
                txn.put(_OUTCOMES_FROM, _index_bytes(1), db=meta)
                txn.put(IMAGE_INDEX, _index_bytes(0), db=meta)
                return data, meta, outcomes, 0
            if names not in ({_DATA, _META}, {_DATA, _META, _OUTCOMES}):
                shown = ", ".join(repr(n) for n in sorted(names)[:5])
                raise StorageError(
                    f"cannot open LMDB state store at {self.path}: it is an LMDB env, but not "
                    f"a raftkv state store (its main DB holds {shown})"
                )
            data = env.open_db(_DATA, txn=txn, create=False)
            meta = env.open_db(_META, txn=txn, create=False)
            fmt = txn.get(_FORMAT, db=meta)
            if fmt == _FORMAT_V1:
                # Its keys carry no revisions, and none can be made up: two replicas
                # converted at different indexes would disagree about every key written
                # in between. Rebuilt from its log (or a peer's snapshot), it gets them.
                raise StorageError(
                    f"cannot open LMDB state store at {self.path}: it was written by a "
                    f"raftkv before per-key revisions (format {fmt!r}, this build needs "
                    f"{_FORMAT_V2!r}); move the directory away to rebuild it from the "
                    f"Raft log, or from a peer's snapshot"
                )
            if fmt != _FORMAT_V2:
                raise StorageError(
                    f"cannot open LMDB state store at {self.path}: unknown format {fmt!r} "
                    f"(expected {_FORMAT_V2!r})"
                )
            if _OUTCOMES not in names:  # a v1 store would have stopped above
                raise StorageError(
                    f"cannot open LMDB state store at {self.path}: it has no outcomes "
                    f"database (a damaged store?)"
                )
            outcomes = env.open_db(_OUTCOMES, txn=txn, create=False)
            raw = txn.get(_APPLIED, db=meta)
            if raw is None or len(raw) != 8:
                raise StorageError(
                    f"cannot open LMDB state store at {self.path}: corrupt applied index {raw!r}"
                )
            return data, meta, outcomes, int.from_bytes(raw, "big")

    # -- writes --------------------------------------------------------------------------------
    def apply(self, entries: Sequence[tuple[int, bytes]]) -> list[object]:
        self._live()
        if not entries:
            return []
        last = check_apply(entries, self._applied, self._checkpoint)
        try:
            # db=data makes txn.get/put/delete default to the data DB: the shared apply loop
            # calls them directly, with no per-op wrapper.
            with self._env.begin(write=True, db=self._data) as txn:
                outcomes = self._outcomes

                def outcome(index: int, what: bool | list[bytes]) -> None:
                    txn.put(_index_bytes(index), encode_outcome(what), db=outcomes)

                def keys(prefix: bytes) -> list[bytes]:
                    cursor = txn.cursor()
                    if not cursor.set_range(prefix):
                        return []
                    return list(takewhile(lambda k: k.startswith(prefix),
                                          cursor.iternext(values=False)))

                results = apply_commands(entries, txn.get, txn.put, txn.delete, keys,
                                         outcome)
                txn.put(_APPLIED, _index_bytes(last), db=self._meta)
                floor = self._prune_outcomes(txn, last - OUTCOME_WINDOW + 1)
        except lmdb.Error as e:  # the context manager aborted: nothing was applied
            raise self._fail(f"apply of [{entries[0][0]}, {last}] failed", e) from e
        self._applied = last
        self._outcomes_from = floor
        return results

    def _prune_outcomes(self, txn: lmdb.Transaction[bytes], floor: int) -> int:
        """Drop the outcomes below ``floor`` (a bound on the index alone: every replica
        keeps the same ones) and record it; the outcomes' floor after this apply."""
        if self._outcomes_from >= floor:
            return self._outcomes_from
        cursor = txn.cursor(db=self._outcomes)
        end = _index_bytes(floor)
        while cursor.first() and cursor.key() < end:
            cursor.delete()
        txn.put(_OUTCOMES_FROM, end, db=self._meta)
        return floor

    # -- reads ---------------------------------------------------------------------------------
    def outcome(self, index: int) -> bool | list[bytes] | None:
        self._live()
        if not self.outcomes_from() <= index <= self._applied:
            return None
        with self._env.begin(db=self._outcomes) as txn:
            raw = txn.get(_index_bytes(index))
        return None if raw is None else decode_outcome(raw)

    def outcomes_from(self) -> int:
        self._live()
        return self._outcomes_from

    def _get_row(self, key: bytes) -> bytes | None:
        self._live()
        if not storable_key(key):
            return None
        try:
            with self._env.begin(db=self._data) as txn:
                row: bytes | None = txn.get(key)
                return row
        except lmdb.Error as e:
            raise self._fail("get failed", e) from e

    def get(self, key: bytes) -> bytes | None:
        row = self._get_row(key)
        return None if row is None else row[HEADER_BYTES:]

    def get_meta(self, key: bytes) -> KeyMeta | None:
        row = self._get_row(key)
        return None if row is None else meta_of(row)

    def _read(self, make: Callable[[lmdb.Transaction[bytes]], Iterator[T]]) -> _ReadIterator[T]:
        """Open a read txn *now* (the view is fixed at call time) and iterate it lazily."""
        self._live()
        try:
            txn = self._env.begin(db=self._data)
        except lmdb.Error as e:
            raise self._fail("read failed", e) from e
        return _ReadIterator(make(txn), txn, self.path)

    def _range(
        self, txn: lmdb.Transaction[bytes], lo: bytes | None, hi: bytes | None
    ) -> Iterator[tuple[bytes, bytes]]:
        cursor = txn.cursor()
        # set_range with a key LMDB cannot hold would raise: position on its 511-byte prefix,
        # which sorts at or below it, and skip the few keys between the two.
        clamped = lo is not None and len(lo) > MAX_KEY_BYTES
        found = cursor.set_range(lo[:MAX_KEY_BYTES]) if lo else cursor.first()
        if not found:
            return
        if hi is None and not clamped:
            yield from cursor.iternext()
            return
        for k, v in cursor.iternext():
            if hi is not None and k >= hi:
                return
            if clamped and k < lo:  # type: ignore[operator]
                continue
            yield k, v

    def scan(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        return self._read(lambda txn: ((k, r[HEADER_BYTES:])
                                       for k, r in self._range(txn, lo, hi)))

    def scan_rows(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        return self._read(lambda txn: self._range(txn, lo, hi))

    def digest(
        self,
        lo: bytes | None = None,
        hi: bytes | None = None,
        keys: Callable[[bytes], bool] | None = None,
        revisions: bool = False,
    ) -> Digest:
        b = DigestBuilder()
        add = b.add
        skip = 0 if revisions else HEADER_BYTES
        with self._read(lambda txn: self._range(txn, lo, hi)) as rows:
            for k, r in rows:
                if keys is None or keys(k):
                    add(k, r[skip:])
        return b.result()

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        check_chunk_bytes(chunk_bytes)

        def make(txn: lmdb.Transaction[bytes]) -> Iterator[bytes]:
            # The applied index and the count come from the same read txn as the rows, so
            # they describe exactly the exported state, even while applies continue.
            raw = txn.get(_APPLIED, db=self._meta)
            applied = int.from_bytes(raw or b"", "big")  # present: written at creation
            count = txn.stat(self._data)["entries"]
            return encode_snapshot(applied, count, txn.cursor().iternext(), chunk_bytes,
                                   KV_ROWS)

        return self._read(make)

    def install_snapshot(self, chunks: Iterable[bytes]) -> int:
        self._live()
        loader = SnapshotLoader(chunks)  # header checked before touching anything
        loader.expect(KV_ROWS, "an LMDB KV state store")
        try:
            with self._env.begin(write=True, db=self._data) as txn:
                txn.drop(self._data, delete=False)  # empty it; rolled back if we abort
                txn.drop(self._outcomes, delete=False)  # they describe the old log
                txn.put(_OUTCOMES_FROM, _index_bytes(loader.applied + 1), db=self._meta)
                # Rows arrive validated and strictly increasing, so append=True is safe and
                # skips the B-tree search for every row.
                txn.cursor().putmulti(loader.rows(), append=True)
                if not loader.verified:  # rows() raises unless verified; belt and braces
                    raise StorageError("snapshot stream was not verified")
                txn.put(_APPLIED, _index_bytes(loader.applied), db=self._meta)
                txn.put(IMAGE_INDEX, _index_bytes(loader.applied), db=self._meta)
            self._env.sync(True)  # the snapshot's index is the new checkpointIndex
            self._record_now(loader.applied)
        except lmdb.Error as e:
            raise self._fail("install of snapshot failed", e) from e
        self._applied = self._checkpoint = loader.applied
        self._outcomes_from = loader.applied + 1
        self._policy.reset()
        self.checkpoints += 1
        return loader.applied
