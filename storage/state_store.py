"""The KV state machine contract (IGNITE-16907: the Raft log is the storage WAL), the pieces
every implementation shares, and the in-memory reference implementation.

Theory of operation
-------------------
The state store has no write-ahead log of its own. It does not need one, because the Raft log
already is one: every mutation is a committed entry, durable in the LogStore before it is
applied, and it stays there until the log is compacted. So the state store may apply entries
*without* making them durable. LMDB is opened without a per-commit sync, so it keeps ACI but
drops D. A crash can then lose the tail of what was applied. Recovery replays that tail from
the log. Two indexes make this exact, even for non-idempotent commands such as CAS:

- **proposedIndex**: every command is applied together with its log index. One apply
  transaction writes the data *and* the applied index, so the two can never disagree. After
  any crash the store holds the state "as of index N" for some N, never a mix.
- **checkpointIndex**: the applied index at the last ``checkpoint()``, which makes
  everything applied durable (LMDB: ``env.sync(True)``). It is what the store can promise to
  still hold after a crash. So the Raft log may be compacted only up to it (a forced
  checkpoint is the snapshot), and restart replay starts at most there.
- **IndexMismatch**: on restart the driver may not know the checkpointIndex and replays from
  wherever its log starts. ``apply`` rejects a batch starting at or below the checkpointIndex
  with ``IndexMismatch(index, checkpoint_index)`` and applies nothing. The driver skips to
  ``checkpoint_index + 1`` and carries on. Replaying an already-applied entry would be wrong
  for CAS, which is why "apply from appliedIndex - bufferSize" was rejected in the issue.

Worked example (the issue's): put k1..k3, inner checkpoint at 3, put k4, crash. The store
comes back with k1..k3 and applied = checkpoint = 3. Replay offers index 1 and gets
``IndexMismatch(1, 3)``. The driver offers 4, and the store ends with k1..k4 at index 4.

Contract (every implementation keeps it)
----------------------------------------
- ``apply(entries)``: ``entries`` are ``(proposedIndex, command data)`` in increasing,
  contiguous index order. The call is ONE atomic transaction that applies every command and
  sets the applied index to the last index. It returns one result per entry: ``None`` for a
  put, a delete, a batch or an empty no-op entry (``b""``), ``True``/``False`` for a CAS and
  for a batch with an id (False: that id was applied before, so nothing was written). An
  entry that fails to decode yields its ``CommandError`` as the *result*: it is skipped the
  same way on every replica, and it still advances the applied index. An empty ``entries``
  is a no-op. The driver passes ``(e.index, e.data)`` for NORMAL entries and
  ``(e.index, b"")`` for CONF_CHANGE entries: every log index reaches the store, so the
  applied index stays contiguous.
- Index errors apply nothing and change no state:
  - the first index is ``<= checkpoint_index()``: ``IndexMismatch(index, checkpoint_index)``
    (resume from ``checkpoint_index + 1``);
  - the first index is in ``(checkpoint_index, applied_index]`` (double apply), leaves a gap
    after ``applied_index``, or the batch is not contiguous: ``StorageError``. Each of these
    is a driver bug.
- ``applied_index()`` and ``checkpoint_index()`` start equal after open, after a crash and
  after ``install_snapshot``. Otherwise ``checkpoint_index() <= applied_index()``.
- ``checkpoint()`` makes everything applied durable and returns the new checkpointIndex.
  ``maybe_checkpoint(now)`` applies the policy (see ``CheckpointPolicy``). ``now`` comes from
  the caller, and the store reads no clock for the policy. The driver should call it
  periodically (every tick), not only after applies. A caller that must not wait for the
  sync asks ``checkpoint_due(now)``, runs the job ``background_checkpoint()`` returns on
  another thread, and hands its result to ``checkpointed(index)`` (an LMDB store syncs
  while its thread goes on applying; other stores return no job).
- Every key carries its revisions (``raftkv.storage.revisions``: create and mod revision,
  the log indexes of the entries that created and last wrote it, and its version), set by
  the apply that writes it, in the same transaction. A *row* is the revisions and the
  value together.
- Reads see everything applied, durable or not: ``get(key)`` (the value),
  ``get_meta(key)`` (a ``KeyMeta``: value and revisions), ``scan(lo, hi)`` over the
  half-open key range ``[lo, hi)`` in key order (``None`` = unbounded) of ``(key, value)``,
  ``scan_rows(lo, hi)`` the same of ``(key, row)``, and ``digest(lo, hi, keys,
  revisions)``, the ``(count, digest)`` of the ``(key, value)`` pairs in the range whose key
  passes the ``keys`` predicate (see ``raftkv.storage.digest``), or of ``(key, row)`` with
  ``revisions=True``: the first is what a bulk load's source can compute, the second tells
  replicas apart that hold the same values with different histories. A scan is a
  consistent view taken when it is called. Keys that could never be stored (empty, or over
  511 bytes) read as absent.
- ``outcome(index)``: whether the conditional entry at ``index`` (a compare-and-set, a
  transaction, a batch with an id, a put to a lease) wrote, or the keys a lease revoke
  deleted, as its apply recorded it; None if the entry was not of those kinds, not
  applied, or is older than ``outcomes_from()``. An apply keeps the
  outcomes of the last ``OUTCOME_WINDOW`` indexes (a bound on the index alone, so every
  replica keeps the same ones); an installed snapshot starts them over at its index.
  They are not in snapshots or digests: they describe the log, not the state.
- ``snapshot_chunks(chunk_bytes)`` exports the state as one consistent view, taken when the
  method is called (LMDB: one read transaction, which does not block writers). Chunks:
  1. a header ``{"v": 1, "applied": index, "count": rows, "kind": "kv-rows"}``;
  2. zero or more msgpack lists of ``[key, row]`` pairs, in strictly increasing key
     order, each about ``chunk_bytes`` (rows carry the revisions: a replica installed from a
     snapshot is byte-identical to its source);
  3. a trailer ``{"applied": index, "count": rows, "digest": hex}``.
  The applied index is read in the same view as the data, so it is exactly the index of the
  exported state.
- ``install_snapshot(chunks)`` replaces the whole state atomically with the snapshot and
  returns the snapshot's index, which becomes both the applied index and the checkpointIndex
  (the install is made durable before returning). Validation covers: the header first, pairs
  in order and within the command limits, and the trailer last, matching the header and the
  digest of what was loaded. If anything is malformed, truncated or mismatched, nothing is
  installed, the old state is intact, and ``StorageError`` says what was wrong. An exception
  raised by the chunk source itself propagates unchanged, with the same guarantee. Whether a
  snapshot is *newer* than the current state is the Raft core's decision, not the store's.
- ``close()`` is idempotent. Any other call on a closed store raises ``StorageError``.
- A store is not thread-safe: the driver thread calls it. An iterator it returned may be
  consumed on another thread, one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import msgpack
from raftkv.storage.commands import (
    BATCH_MARK_PREFIX,
    MAX_VALUE_BYTES,
    UNPACK_ERRORS,
    Batch,
    Cas,
    CasIndex,
    Command,
    CommandError,
    Delete,
    LeaseGrant,
    LeaseRevoke,
    Put,
    PutLease,
    check_key,
    check_value,
    decode,
    split_put,
)
from raftkv.storage.digest import Digest, DigestBuilder
from raftkv.storage.errors import IndexMismatch, StorageError
from raftkv.storage.leases import attach_key, attach_prefix, lease_key
from raftkv.storage.revisions import (
    HEADER_BYTES,
    MAX_ROW_BYTES,
    KeyMeta,
    check_row,
    lease_of,
    meta_of,
    mod_revision_of,
    value_of,
    write_row,
)
from raftkv.storage.txn import Txn, TxnResult, apply_txn

# Checkpoint policy defaults.
#
# etcd commits its bbolt backend every 10,000 ops or 100 ms. Its reason is the same as ours:
# the WAL already holds the data, so the batch interval only trades sync cost against replay
# work. Our numbers:
# - 10,000 entries bounds restart replay. At our measured apply rate in one LMDB transaction
#   (~650k puts/s with sequential keys, ~320k/s with random keys, 100-byte values) 10k entries
#   replay in 15-30 ms. Even with 1 KiB values (~200k/s) that is ~50 ms, so a restart is
#   dominated by opening files, not by replay.
# - 1.0 s bounds the time under light load. It limits how long applied entries stay
#   non-durable, and therefore how far log compaction (which may only go up to the
#   checkpointIndex) lags behind. We take 1 s rather than etcd's 100 ms because a
#   checkpoint here is an fsync of the whole LMDB data file (msync + fdatasync, a few ms).
#   Durability is not what it buys: the Raft log already gives that. At 10 checkpoints a
#   second, that fsync would cost a fair share of one core's I/O budget under light load
#   and buy nothing.
# Outcomes of conditional entries kept (``outcome``): twice the compaction policy's
# largest log, so a watch can read every entry the log still holds.
OUTCOME_WINDOW = 200_000
DEFAULT_CHECKPOINT_ENTRIES = 10_000
DEFAULT_CHECKPOINT_SECONDS = 1.0

SNAPSHOT_VERSION = 1
KV_ROWS = "kv-rows"  # a snapshot header's kind: KV rows with their revisions
DEFAULT_CHUNK_BYTES = 1 << 20
# Cap on one incoming chunk: a sender's chunk_bytes plus one max-size row, with slack.
MAX_SNAPSHOT_CHUNK_BYTES = 64 << 20
_ROW_OVERHEAD = 8  # rough msgpack framing per [k, v] pair, for chunk sizing only


class StateStore(Protocol):
    def apply(self, entries: Sequence[tuple[int, bytes]]) -> list[object]: ...

    def applied_index(self) -> int: ...

    def checkpoint_index(self) -> int: ...

    def checkpoint(self) -> int: ...

    def maybe_checkpoint(self, now: float) -> bool: ...

    def checkpoint_due(self, now: float) -> bool: ...

    def checkpoint_deadline(self) -> float | None: ...

    def background_checkpoint(self) -> Callable[[], int] | None: ...

    def checkpointed(self, index: int) -> None: ...

    def get(self, key: bytes) -> bytes | None: ...

    def scan(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]: ...

    def digest(
        self,
        lo: bytes | None = None,
        hi: bytes | None = None,
        keys: Callable[[bytes], bool] | None = None,
    ) -> Digest: ...

    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]: ...

    def install_snapshot(self, chunks: Iterable[bytes]) -> int: ...

    def close(self) -> None: ...


class KVStateStore(StateStore, Protocol):
    """A KV state store (``MemoryStateStore``, ``LmdbStateStore``): the contract's
    revisions, rows and outcomes on top of every state store's part (the metastore's
    and a replicated object's stores keep only that part)."""

    def get_meta(self, key: bytes) -> KeyMeta | None: ...

    def scan_rows(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]: ...

    def digest(
        self,
        lo: bytes | None = None,
        hi: bytes | None = None,
        keys: Callable[[bytes], bool] | None = None,
        revisions: bool = False,
    ) -> Digest: ...

    def outcome(self, index: int) -> bool | list[bytes] | None: ...

    def outcomes_from(self) -> int: ...


# -- shared pieces -----------------------------------------------------------------------------
class CheckpointPolicy:
    """Checkpoint when ``entries`` indexes are pending, or ``seconds`` after the first
    ``due()`` call that saw something pending.

    There is no clock inside: ``now`` is whatever monotonic time the caller passes. The timer
    starts at the first call that sees pending work, which keeps the policy deterministic
    under the simulator's virtual time. It resets when nothing is pending (after a checkpoint,
    a crash or an install).
    """

    def __init__(
        self,
        entries: int = DEFAULT_CHECKPOINT_ENTRIES,
        seconds: float = DEFAULT_CHECKPOINT_SECONDS,
    ) -> None:
        if entries < 1:
            raise ValueError(f"checkpoint_entries must be >= 1, got {entries}")
        if not seconds > 0:
            raise ValueError(f"checkpoint_seconds must be > 0, got {seconds}")
        self.entries = entries
        self.seconds = seconds
        self._since: float | None = None

    def reset(self) -> None:
        self._since = None

    def deadline(self) -> float | None:
        """When the timer makes a checkpoint due: None until a ``due()`` call saw
        something pending (and again after a reset)."""
        return None if self._since is None else self._since + self.seconds

    def due(self, pending: int, now: float) -> bool:
        if pending <= 0:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        # Against deadline() itself, not now - since >= seconds: with floats the two can
        # disagree at the deadline, and the driver, woken by that deadline, would find
        # the store not due and queue the same deadline again, for ever.
        return pending >= self.entries or now >= self._since + self.seconds


def check_apply(entries: Sequence[tuple[int, bytes]], applied: int, checkpoint: int) -> int:
    """Validate the indexes of an apply batch; return its last index. Raises, changing nothing."""
    first = entries[0][0]
    if first <= checkpoint:
        raise IndexMismatch(first, checkpoint)
    if first <= applied:
        raise StorageError(
            f"apply at index {first}, but index {applied} is already applied "
            f"(checkpointIndex {checkpoint}): a driver bug, entries would be applied twice"
        )
    if first != applied + 1:
        raise StorageError(
            f"apply at index {first} leaves a gap after the applied index {applied}: "
            f"a driver bug, expected index {applied + 1}"
        )
    expected = first
    for index, _ in entries:
        if index != expected:
            raise StorageError(
                f"apply batch is not contiguous: index {index} where {expected} was expected"
            )
        expected += 1
    return expected - 1


class _Rows:
    """One apply transaction's writes through a store's row primitives: revisions and
    lease attachments kept with every write (``raftkv.storage.revisions``,
    ``raftkv.storage.leases``)."""

    __slots__ = ("delete", "get", "keys", "put")

    def __init__(self, get: Callable[[bytes], bytes | None], put: Callable[[bytes, bytes], object],
                 delete: Callable[[bytes], object],
                 keys: Callable[[bytes], list[bytes]]) -> None:
        self.get, self.put, self.delete, self.keys = get, put, delete, keys

    def write(self, key: bytes, value: bytes, index: int, lease: int = 0) -> None:
        old = self.get(key)
        if old is not None and old[_LEASE_FIELD] != _NO_LEASE:
            self.delete(attach_key(lease_of(old), key))
        self.put(key, write_row(old, value, index, lease))
        if lease:
            self.put(attach_key(lease, key), write_row(None, b"", index))

    def remove(self, key: bytes) -> bool:
        old = self.get(key)
        if old is None:
            return False
        if old[_LEASE_FIELD] != _NO_LEASE:
            self.delete(attach_key(lease_of(old), key))
        self.delete(key)
        return True


_LEASE_FIELD = slice(HEADER_BYTES - 8, HEADER_BYTES)
_NO_LEASE = bytes(8)


def execute(cmd: Command, index: int, rows: _Rows) -> object:
    """Run one decoded command, the entry at ``index``. Cannot fail: ``decode`` has
    already validated every field, so a batch is all-or-nothing by construction."""
    get = rows.get
    if isinstance(cmd, Put):  # first: by far the most common command
        rows.write(cmd.key, cmd.value, index)
        return None
    if isinstance(cmd, Delete):
        rows.remove(cmd.key)
        return None
    if isinstance(cmd, Txn):
        return apply_txn(cmd, index, rows)
    if isinstance(cmd, Cas | CasIndex):
        row = get(cmd.key)
        if isinstance(cmd, Cas):
            if (None if row is None else value_of(row)) != cmd.expected:
                return False
        elif mod_revision_of(row) != cmd.expected:
            return False
        if cmd.new is None:
            rows.remove(cmd.key)
        else:
            rows.write(cmd.key, cmd.new, index)
        return True
    if isinstance(cmd, LeaseGrant):
        if get(lease_key(cmd.lease)) is not None:
            return False
        rows.put(lease_key(cmd.lease), write_row(None, _pack(cmd.ttl), index))
        return True
    if isinstance(cmd, PutLease):
        if get(lease_key(cmd.lease)) is None:
            return False  # etcd: "requested lease not found"; nothing written
        rows.write(cmd.key, cmd.value, index, cmd.lease)
        return True
    if isinstance(cmd, LeaseRevoke):
        if get(lease_key(cmd.lease)) is None:
            return False
        prefix = attach_prefix(cmd.lease)
        deleted = [k[len(prefix):] for k in rows.keys(prefix)]
        for key in deleted:
            rows.remove(key)  # drops its attachment row too
        rows.delete(lease_key(cmd.lease))
        return deleted
    assert isinstance(cmd, Batch)
    mark = None if cmd.id is None else BATCH_MARK_PREFIX + cmd.id
    if mark is not None and get(mark) is not None:
        return False  # applied before: a retried or duplicated bulk-load batch
    for key, value in cmd.ops:
        if value is None:
            rows.remove(key)
        else:
            rows.write(key, value, index)
    if mark is None:
        return None
    rows.put(mark, write_row(None, b"", index))
    return True


def apply_commands(
    entries: Sequence[tuple[int, bytes]],
    get: Callable[[bytes], bytes | None],
    put: Callable[[bytes, bytes], object],
    delete: Callable[[bytes], object],
    keys: Callable[[bytes], list[bytes]],
    outcome: Callable[[int, bool | list[bytes]], object],
) -> list[object]:
    """The apply loop shared by both stores (inside the caller's transaction): ``get``
    and ``put`` read and write rows (``raftkv.storage.revisions``), ``keys(prefix)``
    lists the keys under a prefix; ``outcome(index, what)`` records what a conditional
    entry did (a compare-and-set, a transaction, a batch with an id, a put to a lease:
    whether it wrote; a lease revoke: the keys it deleted), which the log alone cannot
    say (a watch reads it, ``StateStore.outcome``)."""
    rows = _Rows(get, put, delete, keys)
    results: list[object] = []
    append = results.append
    for index, data in entries:
        if not data:  # a Raft no-op (e.g. the leader's empty entry at the start of a term)
            append(None)
            continue
        kv = split_put(data)
        if kv is not None:
            key = kv[0]
            old = get(key)
            if old is not None and old[_LEASE_FIELD] != _NO_LEASE:
                rows.write(key, kv[1], index)
            else:
                put(key, write_row(old, kv[1], index))
            append(None)
            continue
        try:
            cmd = decode(data)
        except CommandError as e:
            append(e)  # deterministic skip: every replica decodes the same bytes the same way
            continue
        res = execute(cmd, index, rows)
        if res is not None:
            outcome(index, res.succeeded if isinstance(res, TxnResult) else res)  # type: ignore[arg-type]
        append(res)
    return results


def encode_outcome(what: bool | list[bytes]) -> bytes:
    """An outcome as an outcomes row stores it: one byte for a bool, msgpack for keys."""
    if isinstance(what, bool):
        return b"\x01" if what else b"\x00"
    return _pack(what)


def decode_outcome(raw: bytes) -> bool | list[bytes]:
    if raw in (b"\x00", b"\x01"):
        return raw == b"\x01"
    keys = msgpack.unpackb(raw)
    return [bytes(k) for k in keys]


def in_range(key: bytes, lo: bytes | None, hi: bytes | None) -> bool:
    return (lo is None or key >= lo) and (hi is None or key < hi)


def prefix_end(prefix: bytes) -> bytes | None:
    """The least key above every key that starts with ``prefix`` (None: no bound)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


def storable_key(key: bytes) -> bool:
    """A key ``put`` could have stored; anything else reads as absent without asking LMDB."""
    if not isinstance(key, bytes):
        raise TypeError(f"keys are bytes, not {type(key).__name__}")
    return 0 < len(key) <= 511


# -- snapshot format ---------------------------------------------------------------------------
def _pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def check_chunk_bytes(chunk_bytes: int) -> None:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")


def encode_snapshot(
    applied: int, count: int, rows: Iterable[tuple[bytes, bytes]], chunk_bytes: int,
    kind: str | None = None,
) -> Iterator[bytes]:
    """Header, ``[k, v]`` list chunks of about ``chunk_bytes``, trailer (see the contract).

    ``rows`` must come from one consistent view, in key order. ``count`` is that view's row
    count, announced up front so a receiver can preallocate and show progress. ``kind``:
    what the values are (``KV_ROWS``: KV rows with their revisions; None: plain values,
    as the metastore's and a replicated object's images carry)."""
    check_chunk_bytes(chunk_bytes)
    header: dict[str, object] = {"v": SNAPSHOT_VERSION, "applied": applied, "count": count}
    if kind is not None:
        header["kind"] = kind
    yield _pack(header)
    digest = DigestBuilder()
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for k, v in rows:
        digest.add(k, v)
        batch.append((k, v))
        size += len(k) + len(v) + _ROW_OVERHEAD
        if size >= chunk_bytes:
            yield _pack(batch)
            batch = []
            size = 0
    if batch:
        yield _pack(batch)
    d = digest.result()
    if d.count != count:  # impossible from one read view; a cheap guard against a broken source
        raise StorageError(f"snapshot source announced {count} rows but produced {d.count}")
    yield _pack({"applied": applied, "count": d.count, "digest": d.digest})


def _unpack_chunk(chunk: object, what: str, max_bin: int = MAX_VALUE_BYTES) -> object:
    if not isinstance(chunk, bytes | bytearray | memoryview):
        raise StorageError(f"snapshot {what} is a {type(chunk).__name__}, not bytes")
    if len(chunk) > MAX_SNAPSHOT_CHUNK_BYTES:
        raise StorageError(
            f"snapshot {what} is {len(chunk)} bytes, over the limit of "
            f"{MAX_SNAPSHOT_CHUNK_BYTES} bytes"
        )
    try:
        return msgpack.unpackb(
            chunk,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=max_bin,
            max_str_len=64,
            max_map_len=8,
            max_ext_len=0,
        )
    except UNPACK_ERRORS as e:
        raise StorageError(
            f"snapshot {what} is malformed ({len(chunk)} bytes): {type(e).__name__}: {e}"
        ) from None


def _nonneg_int(obj: dict[object, object], field: str, what: str) -> int:
    value = obj.get(field)
    if type(value) is not int or value < 0:
        raise StorageError(f"snapshot {what}: {field!r} must be a non-negative int, got {value!r}")
    return value


class VerifiedImage:
    """The chunks of an image that a ``SnapshotLoader`` has read to its end and found whole
    and valid (``verify_image``). A loader given one decodes its rows without checking each
    again or recomputing the digest: the receiver of a snapshot checks the image before
    its core adopts the snapshot (an install that fails after that cannot be undone), and
    the install that follows should not pay for the same checks twice. Only
    ``verify_image`` makes one, and the chunks are a tuple, so what was checked is what is
    installed."""

    __slots__ = ("applied", "chunks", "received")

    def __init__(self, chunks: tuple[bytes, ...], applied: int, received: Digest) -> None:
        self.chunks = chunks
        self.applied = applied
        self.received = received

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.chunks)


def verify_image(chunks: Sequence[bytes]) -> VerifiedImage:
    """Read an image through a ``SnapshotLoader`` (every chunk, the order, the sizes, the
    trailing digest); ``StorageError`` if any of it is wrong."""
    kept = tuple(chunks)
    loader = SnapshotLoader(kept)
    for _ in loader.rows():
        pass
    if not loader.verified or loader.received is None:  # rows() raises first
        raise StorageError("snapshot stream was not verified")
    return VerifiedImage(kept, loader.applied, loader.received)


class SnapshotLoader:
    """Streams and validates a snapshot. The constructor reads and checks the header.
    ``rows()`` yields validated ``(key, value)`` pairs in strictly increasing key order, and
    raises ``StorageError`` at the point where the stream turns out bad, including at the end
    if the trailer is missing or does not match. ``verified`` is True only once the whole
    stream, trailer included, has checked out. A store must not commit before that.
    Given a ``VerifiedImage``, it only decodes: those checks have passed already."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._checked = chunks if isinstance(chunks, VerifiedImage) else None
        self._chunks = iter(chunks)
        first = next(self._chunks, None)
        if first is None:
            raise StorageError("snapshot stream is empty: no header")
        header = _unpack_chunk(first, "header (chunk 1)")
        if type(header) is not dict or "v" not in header:
            raise StorageError(f"snapshot chunk 1 is not a header: got {type(header).__name__}")
        if header["v"] != SNAPSHOT_VERSION or type(header["v"]) is not int:
            raise StorageError(
                f"snapshot format version {header['v']!r} is not supported "
                f"(this build reads version {SNAPSHOT_VERSION})"
            )
        self.applied = _nonneg_int(header, "applied", "header")
        self.count = _nonneg_int(header, "count", "header")
        kind = header.get("kind")
        if kind not in (None, KV_ROWS):
            raise StorageError(f"snapshot header: unknown kind {kind!r}")
        self.kind: str | None = kind
        self.verified = False
        self.received: Digest | None = None  # the rows' count and digest, once verified

    def expect(self, kind: str | None, what: str) -> None:
        """Refuse an image of another kind than ``what`` takes (``StorageError``)."""
        if self.kind != kind:
            got = "KV rows with revisions" if self.kind == KV_ROWS else "plain values"
            raise StorageError(
                f"{what} cannot install this snapshot: it holds {got}"
                + (" (from a raftkv before per-key revisions?)" if kind == KV_ROWS else "")
            )

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        if self._checked is not None:
            yield from self._checked_rows(self._checked)
            return
        digest = DigestBuilder()
        prev = b""  # keys are non-empty, so b"" sorts below every real key
        n = 1
        for chunk in self._chunks:
            n += 1
            what = f"chunk {n}"
            obj = _unpack_chunk(chunk, what, MAX_ROW_BYTES if self.kind == KV_ROWS else
                                MAX_VALUE_BYTES)
            if type(obj) is dict:
                self._check_trailer(obj, digest.result(), n)
                return
            if type(obj) is not list:
                raise StorageError(f"snapshot {what} is a {type(obj).__name__}, not a row list")
            for i, pair in enumerate(obj):
                if type(pair) is not list or len(pair) != 2:
                    raise StorageError(f"snapshot {what}, row {i}: not a [key, value] pair")
                try:
                    key = check_key(pair[0], reserved=True)
                    if self.kind == KV_ROWS:
                        value = pair[1]
                        why = (check_row(value, self.applied) if type(value) is bytes
                               else f"a row is a {type(value).__name__}, not bytes")
                        if why is not None:
                            raise CommandError(why)
                    else:
                        value = check_value(pair[1])
                except CommandError as e:
                    raise StorageError(f"snapshot {what}, row {i}: {e}") from None
                if key <= prev:
                    raise StorageError(
                        f"snapshot {what}, row {i}: key {key[:32]!r} is not above the previous "
                        f"key {prev[:32]!r} (rows must be in strictly increasing key order)"
                    )
                prev = key
                digest.add(key, value)
                yield key, value
        raise StorageError(
            f"snapshot stream is truncated: no trailer after {n} chunks ({digest.count} rows)"
        )

    def _checked_rows(self, image: VerifiedImage) -> Iterator[tuple[bytes, bytes]]:
        for chunk in self._chunks:
            obj = msgpack.unpackb(chunk, raw=False, use_list=False)
            if type(obj) is dict:  # the trailer, and the last chunk
                self.verified = True
                self.received = image.received
                return
            yield from obj

    def _check_trailer(self, trailer: dict[object, object], got: Digest, n: int) -> None:
        what = f"trailer (chunk {n})"
        applied = _nonneg_int(trailer, "applied", what)
        count = _nonneg_int(trailer, "count", what)
        digest = trailer.get("digest")
        if applied != self.applied:
            raise StorageError(
                f"snapshot {what}: applied index {applied} != header's {self.applied}"
            )
        if count != self.count or got.count != count:
            raise StorageError(
                f"snapshot {what}: row count mismatch: header {self.count}, "
                f"trailer {count}, received {got.count}"
            )
        if digest != got.digest:
            raise StorageError(
                f"snapshot {what}: digest mismatch: trailer {digest!r}, "
                f"received rows digest to {got.digest!r}"
            )
        if next(self._chunks, None) is not None:
            raise StorageError(f"snapshot stream has data after the trailer (chunk {n})")
        self.verified = True
        self.received = got


# -- the in-memory reference implementation ----------------------------------------------------
_ABSENT = None  # in the undo log: the key did not exist at the last checkpoint


class Checkpointing:
    """The applied/checkpoint bookkeeping every store shares (the contract's
    ``applied_index``, ``checkpoint_index``, ``checkpoint`` and ``maybe_checkpoint``).

    A store sets ``_applied``, ``_checkpoint``, ``_policy`` and ``checkpoints``, provides
    ``_live()`` (raise if closed), and says in ``_make_durable(applied)`` how its applied
    state becomes durable, returning False when it cannot (nothing then advances).
    """

    _applied: int
    _checkpoint: int
    _policy: CheckpointPolicy
    checkpoints: int  # checkpoints that made something durable (for tests)

    def _live(self) -> None:
        raise NotImplementedError

    def _make_durable(self, applied: int) -> bool:
        raise NotImplementedError

    def applied_index(self) -> int:
        self._live()
        return self._applied

    def checkpoint_index(self) -> int:
        self._live()
        return self._checkpoint

    def checkpoint(self) -> int:
        self._live()
        applied = self._applied
        if applied != self._checkpoint and self._make_durable(applied):
            self._checkpoint = applied
            self.checkpoints += 1
        self._policy.reset()
        return self._checkpoint

    def maybe_checkpoint(self, now: float) -> bool:
        if self.checkpoint_due(now):
            self.checkpoint()
            return True
        return False

    def checkpoint_due(self, now: float) -> bool:
        """Whether the policy wants a checkpoint now (see ``CheckpointPolicy``)."""
        self._live()
        return self._policy.due(self._applied - self._checkpoint, now)

    def checkpoint_deadline(self) -> float | None:
        """When the policy's timer, started by a ``checkpoint_due`` call that saw
        pending applies, makes a checkpoint due; None if it is not running. Lets a
        caller with many stores wait for that time instead of asking each one often."""
        return self._policy.deadline()

    def background_checkpoint(self) -> Callable[[], int] | None:
        """A checkpoint whose sync may run on another thread while this store goes on
        applying: the returned job makes everything applied *now* durable and returns
        that index, which the store's own thread then hands to ``checkpointed``. None
        when nothing is pending or the store cannot sync off its thread (then call
        ``checkpoint``)."""
        return None

    def checkpointed(self, index: int) -> None:
        """Record what a ``background_checkpoint`` job made durable. A snapshot installed
        meanwhile may have moved the checkpoint further: it never moves back."""
        self._live()
        if index > self._checkpoint:
            self._checkpoint = index
            self.checkpoints += 1
        self._policy.reset()


class MemoryStateStore(Checkpointing):
    """The reference implementation: a dict, for the simulator and in-memory tables.

    It models IGNITE-16907's *buffered* storage. Applies land in memory. ``checkpoint()``
    "flushes", and ``crash()`` loses what a real store would lose: data and applied index
    revert to the last checkpoint. Instead of copying the whole dict at every checkpoint it
    keeps an undo log, holding the checkpoint-time value of every key touched since. So a
    checkpoint is O(1), and a crash is O(keys touched since the checkpoint).
    """

    def __init__(
        self,
        *,
        checkpoint_entries: int = DEFAULT_CHECKPOINT_ENTRIES,
        checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS,
    ) -> None:
        self._data: dict[bytes, bytes] = {}
        self._undo: dict[bytes, bytes | None] = {}
        self._outcomes: dict[int, bool | list[bytes]] = {}  # insertion order: index order
        self._outcomes_from = 1
        self._applied = 0
        self._checkpoint = 0
        self._policy = CheckpointPolicy(checkpoint_entries, checkpoint_seconds)
        self._closed = False
        self.checkpoints = 0  # count of checkpoints that made something durable (for tests)

    def _live(self) -> None:
        if self._closed:
            raise StorageError("memory state store is closed")

    # -- writes --------------------------------------------------------------------------------
    def _put(self, key: bytes, value: bytes) -> None:
        data = self._data
        if key not in self._undo:
            self._undo[key] = data.get(key, _ABSENT)
        data[key] = value

    def _delete(self, key: bytes) -> None:
        data = self._data
        if key not in data:
            return
        if key not in self._undo:
            self._undo[key] = data[key]
        del data[key]

    def apply(self, entries: Sequence[tuple[int, bytes]]) -> list[object]:
        self._live()
        if not entries:
            return []
        last = check_apply(entries, self._applied, self._checkpoint)
        results = apply_commands(entries, self._data.get, self._put, self._delete,
                                 self._keys, self._outcomes.__setitem__)
        self._applied = last
        floor = last - OUTCOME_WINDOW + 1
        if floor > self._outcomes_from:
            self._outcomes_from = floor
            outcomes = self._outcomes
            while outcomes and next(iter(outcomes)) < floor:
                del outcomes[next(iter(outcomes))]
        return results

    def _keys(self, prefix: bytes) -> list[bytes]:
        return sorted(k for k in self._data if k.startswith(prefix))

    def outcome(self, index: int) -> bool | list[bytes] | None:
        self._live()
        return self._outcomes.get(index) if self._outcomes_from <= index <= self._applied \
            else None

    def outcomes_from(self) -> int:
        self._live()
        return self._outcomes_from

    def _make_durable(self, applied: int) -> bool:
        self._undo.clear()  # the durable image is now the current state
        return True

    def crash(self) -> None:
        """Lose everything not checkpointed, as a process or machine crash would."""
        self._live()
        data = self._data
        for key, old in self._undo.items():
            if old is _ABSENT:
                data.pop(key, None)
            else:
                data[key] = old
        self._undo.clear()
        self._applied = self._checkpoint
        self._policy.reset()

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        self._live()
        row = self._data.get(key) if storable_key(key) else None
        return None if row is None else value_of(row)

    def get_meta(self, key: bytes) -> KeyMeta | None:
        self._live()
        row = self._data.get(key) if storable_key(key) else None
        return None if row is None else meta_of(row)

    def _rows(self, lo: bytes | None, hi: bytes | None) -> list[tuple[bytes, bytes]]:
        data = self._data
        return [(k, data[k]) for k in sorted(k for k in data if in_range(k, lo, hi))]

    def scan(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        self._live()
        # materialized now: a consistent view
        return iter([(k, value_of(r)) for k, r in self._rows(lo, hi)])

    def scan_rows(
        self, lo: bytes | None = None, hi: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        self._live()
        return iter(self._rows(lo, hi))

    def digest(
        self,
        lo: bytes | None = None,
        hi: bytes | None = None,
        keys: Callable[[bytes], bool] | None = None,
        revisions: bool = False,
    ) -> Digest:
        self._live()
        b = DigestBuilder()
        for k, r in self._data.items():  # order-independent: no need to sort
            if in_range(k, lo, hi) and (keys is None or keys(k)):
                b.add(k, r if revisions else value_of(r))
        return b.result()

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        self._live()
        check_chunk_bytes(chunk_bytes)
        rows = self._rows(None, None)  # copied now, so later applies do not leak in
        return encode_snapshot(self._applied, len(rows), rows, chunk_bytes, KV_ROWS)

    def install_snapshot(self, chunks: Iterable[bytes]) -> int:
        self._live()
        loader = SnapshotLoader(chunks)
        loader.expect(KV_ROWS, "a KV state store")
        new = dict(loader.rows())
        if not loader.verified:  # rows() raises unless verified; belt and braces
            raise StorageError("snapshot stream was not verified")
        self._data = new
        self._undo.clear()  # an install is durable: it is the new checkpoint image
        self._outcomes.clear()
        self._outcomes_from = loader.applied + 1
        self._applied = self._checkpoint = loader.applied
        self._policy.reset()
        return loader.applied

    def close(self) -> None:
        self._closed = True
