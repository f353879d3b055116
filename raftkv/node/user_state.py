"""``UserStateStore``: the ``StateStore`` contract (``raftkv.storage.state_store``) over a user's
``StateMachine`` (``raftkv.statemachine``), so a custom state machine runs on the same driver,
recovery, compaction and snapshot path as the KV stores.

Theory of operation
-------------------
The state machine keeps its state in memory, and the Raft log is its write-ahead log, as
for the KV stores (IGNITE-16907). What differs is what is durable:

- **apply** runs ``sm.apply(index, data)`` for each entry. An empty entry (a leader's no-op
  or a CONF_CHANGE, which the driver passes as ``b""``) reaches no state machine and gives
  ``None``. If ``sm.apply`` raises, the exception becomes the entry's result and the
  applied index still advances. A state machine must therefore be deterministic when it
  fails too. (``ReplicatedObject.apply`` never raises; this is the safety net for
  hand-written state machines. A poison entry must not stop a replica for good, because
  replay would meet it again at every restart.) The applied index advances entry by entry,
  since a state machine in memory cannot roll back a half-applied batch.
- **checkpoint** writes ``sm.snapshot()`` and the applied index to ``<path>/statemachine.ckpt``
  in one file: it writes a temporary file, fsyncs it, renames it over the old one and fsyncs
  the directory. So the file always holds one whole checkpoint, the old one or the new one.
  Its header carries a magic number, the applied index, the length and a blake2b checksum,
  so a truncated or corrupt file is refused at open with ``StorageError``, before anything
  is restored. A checkpoint costs a whole ``sm.snapshot()``, O(state) work on the driver
  thread. For a large state, pass a larger ``checkpoint_seconds`` and ``checkpoint_entries``:
  the cost is a longer replay after a restart.
- **a failing snapshot** (``ReplicatedObject.snapshot`` raises a ``TypeError`` naming an
  attribute that is not plain data) fails the checkpoint with ``SnapshotFailed``, a
  ``StorageError``, and nothing is written: the file and the checkpoint index stay where
  they were, so compaction keeps the log after them and a restart replays it. No state is
  lost, but the log grows until a snapshot succeeds. The next attempt comes when the
  policy is due again, counted from the failed one (the same state would fail the same
  way, and trying at every apply would cost a snapshot each time). The driver logs every
  failure as an error and carries on; a leader whose image fails sends a follower none.
- **open** restores the checkpoint file if there is one; applied = checkpoint = its index.
  Without a file the state machine starts as the caller built it, at index 0.
- **path=None** (purely in memory): nothing survives the process, so the store promises
  nothing across a crash. ``checkpoint()`` is a no-op and ``checkpoint_index()`` stays where
  it is: 0, or the index of the last installed snapshot, which the contract says becomes
  the checkpointIndex. Why not advance it as ``MemoryStateStore`` does: the log may be
  compacted up to the checkpointIndex, and a restart replays only what follows it. With a
  durable log, an advanced index would let compaction drop entries this state needs after
  a restart. Staying at 0 keeps the whole log, so replay always rebuilds the state. The
  price is that the log grows until a snapshot is installed: use ``path=None`` for tests
  and short-lived or in-memory groups, and give a path otherwise. After an install the
  log starts at the snapshot, so a restarted path=None replica on a durable log cannot
  replay. Recovery then refuses it with "needs a snapshot", not silently.
  With ``volatile=True`` the caller says the log is in memory too (an in-memory node:
  PySyncObj's default, or ``ReplicatedNode`` without a ``data_dir``): nothing is replayed
  after a restart, so the state is its own checkpoint, as ``MemoryStateStore``'s is.
  ``checkpoint()`` then advances the index once ``sm.snapshot()`` succeeds, writing
  nothing, and the log is compacted by its policy instead of growing for as long as the
  process runs; a snapshot that fails keeps the log, as below.
- **snapshots** travel in the KV stores' chunk format, because ``GroupStorage.accept`` and
  the receiving store validate images with ``SnapshotLoader``. The bytes of ``sm.snapshot()``
  are cut into pieces of at most ``MAX_VALUE_BYTES`` (1 MiB), stored as the rows
  ``sm/000000000000``, ``sm/000000000001``, ... The zero padding keeps the keys in strictly
  increasing order. ``install_snapshot`` validates the whole stream (format, order, digest,
  contiguous piece keys) before it touches the state machine. It then restores and, with a
  path, writes the checkpoint file. If either step fails, the previous state is restored
  from a copy taken first. Images are rare, so the extra ``sm.snapshot()`` is affordable.
- **results**: what ``apply`` returns answers the caller on this replica as it is. For a
  call forwarded by a follower, the leader sends it back through ``encode_result`` and
  the follower reads it with ``decode_result`` (the driver calls both when a state store
  has them): ``raftkv.statemachine``'s result codec, so a tuple, a set or the exception
  a method raised reaches the follower's caller as what the leader's caller would get.
- **reads**: ``get``, ``scan`` and ``digest`` see those same rows, computed from
  ``sm.snapshot()`` when called. ``digest()`` compares replicas as it does for the KV
  stores, provided ``snapshot()`` is deterministic (``ReplicatedObject``'s default is).
  Application reads go through the object's own methods instead.

Not thread-safe, like every store: the driver thread calls it, and the state machine is
applied, snapshotted and restored on that thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from hashlib import blake2b

from raftkv.statemachine import StateMachine, decode_result, encode_result
from raftkv.storage.commands import MAX_VALUE_BYTES
from raftkv.storage.digest import Digest, DigestBuilder
from raftkv.storage.durable_fs import makedirs_durable
from raftkv.storage.errors import StorageError
from raftkv.storage.state_store import (
    DEFAULT_CHECKPOINT_ENTRIES,
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_CHUNK_BYTES,
    Checkpointing,
    CheckpointPolicy,
    SnapshotLoader,
    check_apply,
    check_chunk_bytes,
    encode_snapshot,
    in_range,
    storable_key,
)

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "statemachine.ckpt"
# File layout: magic (8) | applied index, payload length (2 x u64 big-endian) |
# blake2b-128 of those 16 bytes + payload | payload (the state machine's snapshot).
_MAGIC = b"RKVSMCK1"  # the last byte is the format version
_FIELDS = struct.Struct(">QQ")
_SUM_BYTES = 16
_HEADER_BYTES = len(_MAGIC) + _FIELDS.size + _SUM_BYTES

PIECE_BYTES = MAX_VALUE_BYTES


class SnapshotFailed(StorageError):
    """The state machine's ``snapshot()`` raised, or returned something other than bytes.
    Nothing was written or changed: the checkpoint and its index, the state machine and
    the log after the checkpoint are as they were (module docstring)."""


def piece_key(n: int) -> bytes:
    """The row key of the ``n``-th piece of a state machine image."""
    return b"sm/%012d" % n


def _checksum(fields: bytes, payload: bytes) -> bytes:
    h = blake2b(digest_size=_SUM_BYTES)
    h.update(fields)
    h.update(payload)
    return h.digest()


def _pieces(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    view = memoryview(data)
    for n, start in enumerate(range(0, len(data), PIECE_BYTES)):
        yield piece_key(n), bytes(view[start : start + PIECE_BYTES])


def _piece_count(data: bytes) -> int:
    return -(-len(data) // PIECE_BYTES)


class UserStateStore(Checkpointing):
    """A ``StateStore`` over ``sm`` (contract: raftkv.storage.state_store; theory: this module).

    ``path`` is a directory, created if missing, for the checkpoint file. ``None`` keeps
    everything in memory. ``checkpoint_entries`` and ``checkpoint_seconds`` configure
    ``maybe_checkpoint`` (see ``CheckpointPolicy``). If ``path`` holds a checkpoint, ``sm``
    is restored from it. A corrupt file, or a ``restore`` that fails, raises
    ``StorageError`` naming the file. ``volatile``: with ``path=None``, the group's log is
    in memory too (module docstring, "path=None").
    """

    def __init__(
        self,
        sm: StateMachine,
        path: str | os.PathLike[str] | None = None,
        *,
        checkpoint_entries: int = DEFAULT_CHECKPOINT_ENTRIES,
        checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS,
        volatile: bool = False,
    ) -> None:
        if volatile and path is not None:
            raise ValueError("a state machine with a checkpoint file is not volatile")
        self.sm = sm
        self.path = None if path is None else os.fspath(path)
        self.volatile = volatile
        self._policy = CheckpointPolicy(checkpoint_entries, checkpoint_seconds)
        self._applied = self._checkpoint = 0
        self._failed_at = 0  # the applied index of the last checkpoint whose snapshot failed
        self._closed = False
        # when_applied's callbacks, a heap of (index, arrival, deadline, fn): the arrival
        # number keeps equal indexes from comparing the rest.
        self._waiting: list[tuple[int, int, float, Callable[[bool | None], None]]] = []
        self._arrivals = itertools.count()
        self.checkpoints = 0  # checkpoints that wrote something (for tests)
        if self.path is not None:
            self._open(self.path)

    @property
    def file(self) -> str | None:
        return None if self.path is None else os.path.join(self.path, CHECKPOINT_FILE)

    def _live(self) -> None:
        if self._closed:
            raise StorageError("user state store is closed")

    @property
    def applied(self) -> int:
        """The index of the last entry applied to the object (or restored into it)."""
        return self._applied

    def when_applied(self, index: int, fn: Callable[[bool | None], None],
                     deadline: float = float("inf")) -> None:
        """Call ``fn(True)`` once this replica has applied ``index`` (at once if it has),
        ``fn(False)`` if the store closes first, or ``fn(None)`` from ``expire`` once
        ``deadline`` (a monotonic time) has passed. A call forwarded to the leader comes
        back with the leader's result before this replica has applied the entry; its
        caller waits here so that it reads its own write on this replica, as PySyncObj's
        (and etcd's) callers do, but not for ever: a replica cut off after the leader
        answered would hold the call until it heals. On the driver thread, like
        everything here."""
        if self._applied >= index or self._closed:
            fn(not self._closed)
            return
        heapq.heappush(self._waiting, (index, next(self._arrivals), deadline, fn))

    def expire(self, now: float) -> None:
        """Give up the waits whose deadline has passed (``fn(None)``)."""
        if not self._waiting or all(w[2] > now for w in self._waiting):
            return
        late = [w for w in self._waiting if w[2] <= now]
        self._waiting = [w for w in self._waiting if w[2] > now]
        heapq.heapify(self._waiting)
        for w in late:
            w[3](None)

    def _release(self) -> None:
        while self._waiting and self._waiting[0][0] <= self._applied:
            heapq.heappop(self._waiting)[3](True)

    # -- the checkpoint file -----------------------------------------------------------------
    def _open(self, path: str) -> None:
        try:
            makedirs_durable(path)
        except OSError as e:
            raise StorageError(f"cannot create the state machine directory {path}: {e}") from e
        file = os.path.join(path, CHECKPOINT_FILE)
        try:
            os.unlink(file + ".tmp")  # a checkpoint interrupted before its rename
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot remove the stale {file}.tmp: {e}") from e
        try:
            with open(file, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError(f"cannot read the state machine checkpoint {file}: {e}") from e
        applied, payload = _parse_checkpoint(raw, file)
        try:
            self.sm.restore(payload)
        except Exception as e:
            raise StorageError(
                f"the state machine could not restore its checkpoint {file} (index {applied}): "
                f"{type(e).__name__}: {e}"
            ) from e
        self._applied = self._checkpoint = applied

    def _write(self, applied: int, payload: bytes) -> None:
        assert self.path is not None
        file = os.path.join(self.path, CHECKPOINT_FILE)
        tmp = file + ".tmp"
        fields = _FIELDS.pack(applied, len(payload))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_MAGIC + fields + _checksum(fields, payload))
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            os.replace(tmp, file)
            dfd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dfd)  # make the rename itself durable
            finally:
                os.close(dfd)
        except OSError as e:
            raise StorageError(f"cannot write the state machine checkpoint {file}: {e}") from e

    def _image(self) -> bytes:
        """``sm.snapshot()`` as bytes, or ``StorageError`` saying why not."""
        try:
            data = self.sm.snapshot()
        except Exception as e:
            raise SnapshotFailed(
                f"the state machine's snapshot() failed: {type(e).__name__}: {e}"
            ) from e
        if isinstance(data, bytearray | memoryview):
            data = bytes(data)
        if type(data) is not bytes:
            raise SnapshotFailed(
                f"the state machine's snapshot() returned a {type(data).__name__}, not bytes"
            )
        return data

    # -- writes ------------------------------------------------------------------------------
    def apply(self, entries: Sequence[tuple[int, bytes]]) -> list[object]:
        self._live()
        if not entries:
            return []
        check_apply(entries, self._applied, self._checkpoint)
        sm_apply = self.sm.apply
        results: list[object] = []
        for index, data in entries:
            if not data:
                results.append(None)
            else:
                try:
                    results.append(sm_apply(index, data))
                except Exception as e:  # noqa: BLE001 - a failing entry is its result
                    log.warning("state machine apply at index %d raised %r", index, e)
                    results.append(e)
            self._applied = index
        if self._waiting:
            self._release()
        return results

    @staticmethod
    def encode_result(result: object) -> bytes:
        """An apply result, as the leader sends it to the follower that forwarded the call."""
        return encode_result(result)

    @staticmethod
    def decode_result(data: object) -> object:
        """The inverse of ``encode_result`` (an exception comes back as an instance);
        ``ValueError`` if ``data`` is not such bytes."""
        if type(data) is not bytes:
            raise ValueError(f"a result is bytes, not {type(data).__name__}")
        return decode_result(data)

    def _make_durable(self, applied: int) -> bool:
        if self.path is None:
            # Nothing can be made durable; in a volatile group nothing needs to be, but
            # the state must still snapshot, or a follower that the compacted log no
            # longer reaches could never catch up (module docstring, "path=None").
            if self.volatile:
                self._image()
            return self.volatile
        self._write(applied, self._image())
        return True

    def checkpoint(self) -> int:
        try:
            return super().checkpoint()
        except SnapshotFailed:
            self._failed_at = self._applied
            self._policy.reset()  # due again counted from here (checkpoint_due)
            raise

    def checkpoint_due(self, now: float) -> bool:
        self._live()
        since = max(self._checkpoint, self._failed_at)
        return self._policy.due(self._applied - since, now)

    def maybe_checkpoint(self, now: float) -> bool:
        return (self.path is not None or self.volatile) and super().maybe_checkpoint(now)

    # -- reads -------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        self._live()
        if not storable_key(key):
            return None
        for k, v in _pieces(self._image()):
            if k == key:
                return v
        return None

    def scan(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        self._live()
        data = self._image()  # taken now: a consistent view; bytes are immutable
        return ((k, v) for k, v in _pieces(data) if in_range(k, lo, hi))

    def digest(
        self,
        lo: bytes | None = None,
        hi: bytes | None = None,
        keys: Callable[[bytes], bool] | None = None,
    ) -> Digest:
        self._live()
        b = DigestBuilder()
        for k, v in _pieces(self._image()):
            if in_range(k, lo, hi) and (keys is None or keys(k)):
                b.add(k, v)
        return b.result()

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        self._live()
        check_chunk_bytes(chunk_bytes)
        data = self._image()  # now, on the caller's thread; slicing it later is safe
        return encode_snapshot(self._applied, _piece_count(data), _pieces(data), chunk_bytes)

    def install_snapshot(self, chunks: Iterable[bytes]) -> int:
        self._live()
        loader = SnapshotLoader(chunks)
        loader.expect(None, "a replicated object's state")
        parts: list[bytes] = []
        for n, (key, value) in enumerate(loader.rows()):
            if key != piece_key(n):
                raise StorageError(
                    f"snapshot row {n} has key {key[:32]!r}, expected {piece_key(n)!r}: "
                    "this is not a state machine image (a KV store's, perhaps)"
                )
            parts.append(value)
        if not loader.verified:  # rows() raises unless verified; belt and braces
            raise StorageError("snapshot stream was not verified")
        data = b"".join(parts)
        del parts
        old = self._image()  # to put back if restoring or writing fails
        try:
            self.sm.restore(data)
            if self.path is not None:
                self._write(loader.applied, data)
        except Exception as e:
            self._rollback(old, e)
            if isinstance(e, StorageError):
                raise
            raise StorageError(
                f"the state machine could not restore a snapshot at index {loader.applied}: "
                f"{type(e).__name__}: {e}"
            ) from e
        self._applied = self._checkpoint = loader.applied
        self._policy.reset()
        if self._waiting:
            self._release()
        return loader.applied

    def _rollback(self, old: bytes, cause: Exception) -> None:
        try:
            self.sm.restore(old)
        except Exception as e:
            # The state machine is now in an unknown state: stop serving from it.
            self._closed = True
            raise StorageError(
                f"installing a snapshot failed ({type(cause).__name__}: {cause}) and the "
                f"previous state could not be restored ({type(e).__name__}: {e}); "
                "the store is closed"
            ) from e

    def close(self) -> None:
        self._closed = True
        waiting, self._waiting = self._waiting, []
        for *_, fn in waiting:
            fn(False)


def _parse_checkpoint(raw: bytes, file: str) -> tuple[int, bytes]:
    """(applied index, payload) of a checkpoint file, or ``StorageError`` saying what is wrong."""
    if len(raw) < _HEADER_BYTES:
        raise StorageError(
            f"corrupt state machine checkpoint {file}: {len(raw)} bytes, shorter than its "
            f"{_HEADER_BYTES}-byte header"
        )
    if raw[: len(_MAGIC)] != _MAGIC:
        raise StorageError(
            f"{file} is not a raftkv state machine checkpoint (magic {raw[:8]!r}, "
            f"expected {_MAGIC!r})"
        )
    fields = raw[len(_MAGIC) : len(_MAGIC) + _FIELDS.size]
    applied, length = _FIELDS.unpack(fields)
    payload = raw[_HEADER_BYTES:]
    if len(payload) != length:
        raise StorageError(
            f"corrupt state machine checkpoint {file}: the header announces {length} bytes "
            f"of state, the file holds {len(payload)}"
        )
    if raw[len(_MAGIC) + _FIELDS.size : _HEADER_BYTES] != _checksum(fields, payload):
        raise StorageError(f"corrupt state machine checkpoint {file}: checksum mismatch")
    return applied, payload
