"""The pinned checkpoint: an ``MDB_NOSYNC`` LMDB environment that a power loss cannot corrupt.

Why it is needed
----------------
The state stores (``LmdbStateStore``, the metastore) commit without syncing and sync at
checkpoints. LMDB then promises atomicity after a *process* crash (the page cache keeps
every write), but not after a *machine* crash: unsynced pages reach the disk in any
order, or not at all, so the disk may hold the meta page of a transaction without its
data pages, or pages of the last synced snapshot overwritten by later transactions
(LMDB reuses a page as soon as no reader needs it). The power-loss harness showed both:
stale and wrong rows after a torn loss (issue 22, ``raftkv.testing.powerloss_workload``).

The discipline
--------------
1. **Pin.** At each checkpoint, the store begins a read transaction on the snapshot it
   is about to make durable (transaction id ``T``, applied index ``A``) and holds it
   until the next checkpoint is durable. LMDB never reuses a page a live reader can
   see, so every page of snapshot ``T`` stays as synced, whatever is written later.
2. **Sync and record.** ``env.sync`` (one fdatasync of ``data.mdb``) makes ``T`` durable,
   then a checkpoint record (``T``, ``A`` and a copy of ``T``'s meta page, with a CRC) is
   written to ``checkpoint`` beside ``data.mdb`` and fdatasynced. The file has two slots
   in separate pages, written alternately, so a torn record write leaves the previous
   record whole. Only then is ``A`` the checkpointIndex (the log may be compacted to it).
3. **Roll back on open.** If the environment's current meta page is not the recorded one
   (an unclean shutdown: a SIGKILL or a power loss after commits that were not
   checkpointed), both meta pages are overwritten with the recorded one and synced
   *before* LMDB opens the file. The environment is then snapshot ``T`` exactly, whose
   pages the pin kept intact, and the store checks that its applied index is ``A``.
   Replay from the Raft log brings it forward, as after any crash (IGNITE-16907).
4. **Creation** writes a record with ``T = 0`` ("being created") and makes its name
   durable before LMDB creates anything; a record still at 0 on open means the power
   failed during creation, and the half-made environment is removed and made again.
   An environment without a record was written by an earlier version: it is trusted
   as it is (as those versions did) and gets a record at once. So is a data file older
   than its record (put back from a copy: no crash can leave that).

A clean ``close`` checkpoints, so reopening after it rolls nothing back.

What it costs: per checkpoint, reading two meta pages and one small fdatasync more; the
data file may grow by what is written between two checkpoints (the pinned snapshot's
pages are not reused meanwhile); after a crash, replay starts at the checkpoint even
when the page cache kept more. The meta-page layout is LMDB's on 64-bit builds
(``raftkv.storage.lmdb_files`` reads the same fields).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from typing import NamedTuple

from raftkv.storage.durable_fs import write_durable
from raftkv.storage.errors import StorageError

log = logging.getLogger(__name__)

RECORD_FILE = "checkpoint"
_MAGIC = 0xBEEFC0DE  # LMDB's
_PAGE_HEADER = 16
_META_SIZE = 136  # sizeof(MDB_meta), 64-bit
_SLOT = 4096
_REC_MAGIC = b"RKVCKPT1"
_REC = struct.Struct(">8sQQQH")  # magic, seq, txnid, applied, meta length; meta; crc32


class Record(NamedTuple):
    seq: int
    txnid: int  # 0: the environment is being created
    applied: int
    meta: bytes  # MDB_meta of snapshot txnid, as on disk


def _pack(rec: Record) -> bytes:
    body = _REC.pack(_REC_MAGIC, rec.seq, rec.txnid, rec.applied, len(rec.meta)) + rec.meta
    return body + zlib.crc32(body).to_bytes(4, "big")


def _unpack(raw: bytes) -> Record | None:
    if len(raw) < _REC.size or raw[:8] != _REC_MAGIC:
        return None
    _, seq, txnid, applied, n = _REC.unpack_from(raw)
    end = _REC.size + n
    if len(raw) < end + 4 or zlib.crc32(raw[:end]) != int.from_bytes(raw[end:end + 4], "big"):
        return None
    return Record(seq, txnid, applied, raw[_REC.size:end])


def read_metas(data: str) -> tuple[int, list[tuple[int, bytes]]]:
    """(page size, [(txnid, MDB_meta bytes)] of the valid meta pages) of ``data.mdb``."""
    with open(data, "rb") as f:
        head = f.read(_PAGE_HEADER + _META_SIZE)
        if len(head) < _PAGE_HEADER + _META_SIZE:
            return 0, []
        psize = struct.unpack_from("<I", head, _PAGE_HEADER + 24)[0]
        metas = []
        for page in (0, 1):
            f.seek(page * psize + _PAGE_HEADER)
            m = f.read(_META_SIZE)
            if len(m) == _META_SIZE and struct.unpack_from("<I", m)[0] == _MAGIC:
                metas.append((struct.unpack_from("<Q", m, 128)[0], m))
    return psize, metas


class CheckpointFile:
    """The checkpoint record of the LMDB environment at ``path`` (module docstring)."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self.what = what
        self.file = os.path.join(path, RECORD_FILE)
        self.data = os.path.join(path, "data.mdb")
        self.last: Record | None = None
        self._lock = threading.Lock()

    def read(self) -> Record | None:
        """The newest whole record; None if there is no file. A file with no whole
        record is damage (its first slot was synced, with its name, at creation)."""
        try:
            with open(self.file, "rb") as f:
                raw = f.read(2 * _SLOT)
        except FileNotFoundError:
            return None
        recs = [r for r in (_unpack(raw[:_SLOT]), _unpack(raw[_SLOT:])) if r is not None]
        if not recs:
            raise StorageError(f"cannot open the {self.what} at {self.path}: its checkpoint "
                               f"record {self.file} is damaged; rebuild this replica")
        return max(recs, key=lambda r: r.seq)

    def prepare(self) -> Record | None:
        """Before LMDB opens the environment: create it (a record at 0), finish or undo
        an interrupted creation, or roll an uncleanly shut environment back to its
        recorded checkpoint. Returns the record it stands on (None: an old store)."""
        rec = self.read()
        exists = os.path.exists(self.data)
        if rec is not None and rec.txnid == 0:
            # The power failed while it was being created: nothing in it was promised.
            for name in ("data.mdb", "lock.mdb"):
                try:
                    os.unlink(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass
            exists = False
        if not exists:
            if rec is None:
                rec = Record(0, 0, 0, b"")
                write_durable(self.file, _pack(rec).ljust(2 * _SLOT, b"\0"))
            self.last = rec
            return rec
        if rec is None:
            return None  # written before checkpoint records: trusted, as it was
        self.last = rec
        psize, metas = read_metas(self.data)
        current = max(metas)[1] if metas else None
        if current == rec.meta and len(metas) == 2:
            return rec
        if metas and max(metas)[0] < rec.txnid:
            # Older than its record: no crash does that (the record follows the sync),
            # so the file was put back from elsewhere (a copy, a restore). It is trusted
            # as it is, like a store without a record, and recorded anew at open.
            log.warning("%s: the %s's data file (transaction %d) is older than its "
                        "checkpoint record (%d): put back from a copy? Trusting the file",
                        self.path, self.what, max(metas)[0], rec.txnid)
            self.last = Record(rec.seq, 0, 0, b"")
            return None
        if not metas or psize not in (4096, 8192, 16384, 32768, 65536) or len(rec.meta) != _META_SIZE:
            raise StorageError(f"cannot open the {self.what} at {self.path}: its meta pages "
                               f"are unreadable; rebuild this replica")
        fd = os.open(self.data, os.O_RDWR)
        try:
            for page in (0, 1):
                os.pwrite(fd, rec.meta, page * psize + _PAGE_HEADER)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        newer = max(metas)[0] if metas else "?"
        log.warning("%s: %s was not shut down cleanly (transaction %s on disk): rolled back "
                    "to its checkpoint, transaction %d at applied index %d; the Raft log "
                    "replays the rest", self.path, self.what, newer, rec.txnid, rec.applied)
        return rec

    def capture(self, txnid: int) -> bytes:
        """The meta page of transaction ``txnid``, the newest committed (read on the
        writer's thread, right after its commit, so no later one can have replaced it)."""
        _, metas = read_metas(self.data)
        found = [m for t, m in metas if t == txnid]
        if not found:
            raise StorageError(f"{self.path}: the {self.what}'s meta page for transaction "
                               f"{txnid} is not where LMDB keeps it")
        return found[0]

    def write(self, txnid: int, applied: int, meta: bytes) -> bool:
        """Record snapshot ``txnid`` (already synced) as the checkpoint, durably. A record
        older than the current one is not written (False): checkpoints never go back."""
        with self._lock:
            last = self.last
            if last is not None and last.txnid >= txnid and last.txnid:
                return False
            seq = last.seq + 1 if last is not None else 0
            rec = Record(seq, txnid, applied, meta)
            if last is None:  # an old store's first record: whole, or not there at all
                write_durable(self.file, _pack(rec).ljust(2 * _SLOT, b"\0"))
            else:
                fd = os.open(self.file, os.O_WRONLY)
                try:
                    os.pwrite(fd, _pack(rec), (seq % 2) * _SLOT)
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            self.last = rec
            return True
