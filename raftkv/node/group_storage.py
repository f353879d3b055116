"""One Raft group's durable storage, as the driver uses it around each Ready.

``GroupStorage`` pairs a log store with a state store and carries out the storage half
of the Ready contract:

- ``persist(rd)``: hard state, entries and the snapshot's metadata in one log
  transaction (one fsync), after, for a received snapshot, the state store image. A
  Ready that need not sync (only the commit index moved) is left to the log store to
  write with its next batch. ``persist_together`` does the same for several groups
  whose logs share an LMDB environment (``raftkv.storage.lmdb_log.LogEnv``): one transaction.
- ``apply(entries)``: committed entries go to the state store with their
  proposedIndex, in one transaction. An entry at or below the store's checkpoint is
  refused with ``IndexMismatch`` and skipped (IGNITE-16907): this happens after a
  snapshot install, whose image is newer than the snapshot index the core knows.
- ``outgoing(msg)``: a SNAPSHOT message leaves with the state store's image attached.

Why the image may be newer than the snapshot's index: the log records the snapshot
point when it compacts (the checkpoint at that moment), but the state store keeps
applying. Exporting the *current* state is both cheaper (no historical copy is kept)
and safe: the follower installs state at some index Y >= X, the core then replays
X+1.. from the log, and IndexMismatch(Y) turns the overlap into no-ops.

The image travels as a msgpack array of the state store's own chunks, so the
store's integrity checks (header, ordering, trailing digest) apply on install.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import msgpack

from raftkv.core import Entry, Message, MessageType, Ready, Snapshot
from raftkv.recovery.compaction import CompactionPolicy, maybe_compact
from raftkv.recovery.local import RecoveryReport, replay
from raftkv.storage.errors import IndexMismatch, StorageError
from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
from raftkv.storage.log_store import LogStorage, payloads_of
from raftkv.storage.records import ConfState, VoteFloor
from raftkv.storage.state_store import StateStore, VerifiedImage, verify_image

log = logging.getLogger(__name__)

class _AlreadyApplied:
    def __repr__(self) -> str:
        return "ALREADY_APPLIED"


ALREADY_APPLIED = _AlreadyApplied()

# A snapshot image may hold the whole state: allow large ones, but not unbounded.
MAX_IMAGE_BYTES = 1 << 31


class GroupStorage:
    def __init__(
        self, raft_log: LogStorage, state: StateStore,
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.log = raft_log
        self.state = state
        self.compaction = compaction or CompactionPolicy()
        self._accepted: tuple[bytes, VerifiedImage] | None = None

    def recover(self) -> RecoveryReport:
        """Replay the committed log after the state store's checkpoint. Afterwards pass
        ``state.applied_index()`` as ``Config.applied`` so the core does not redeliver."""
        return replay(self.log, self.state)

    def persist(self, rd: Ready) -> None:
        self._install_image(rd)
        if rd.hard_state is not None or rd.entries or rd.snapshot is not None:
            self.log.save(rd.hard_state, rd.entries, rd.snapshot, sync=rd.must_sync)

    def _install_image(self, rd: Ready) -> None:
        accepted, self._accepted = self._accepted, None
        if rd.snapshot is not None:
            # State first: a crash before the log records the snapshot leaves a state
            # store ahead of its log, which replay and IndexMismatch handle. The other
            # order would leave a log claiming a snapshot the state store never got.
            if accepted is not None and accepted[0] is rd.snapshot.data:
                image: Iterable[bytes] = accepted[1]  # checked by accept, moments ago
            else:
                image = unpack_image(rd.snapshot.data)
            self.state.install_snapshot(image)

    @property
    def log_env(self) -> LogEnv | None:
        """The shared LMDB environment of this group's log, if it shares one: groups
        with the same one are persisted together (``persist_together``)."""
        log = self.log
        return log.env if isinstance(log, LmdbLogStore) and log.env.shared else None

    def apply(self, entries: Sequence[Entry]) -> list[object]:
        """Apply committed entries; returns one result per entry, ``ALREADY_APPLIED``
        for entries the store held already (they came with a snapshot image, so their
        result is not known here)."""
        batch = payloads_of(entries)
        try:
            return self.state.apply(batch)
        except IndexMismatch as mismatch:
            keep = [b for b in batch if b[0] > mismatch.checkpoint_index]
            skipped = len(batch) - len(keep)
            return [ALREADY_APPLIED] * skipped + (self.state.apply(keep) if keep else [])

    def outgoing(self, msg: Message) -> Message:
        if msg.type == MessageType.SNAPSHOT and msg.snapshot is not None:
            msg.snapshot = Snapshot(msg.snapshot.meta, pack_image(self.state))
        return msg

    def maybe_compact(self, conf_at: Callable[[int], ConfState | None]) -> int | None:
        """Compact when the policy says so; ``conf_at`` is ``Raft.conf_at``."""
        return maybe_compact(self.log, self.state, conf_at, self.compaction)

    @property
    def vote_floor(self) -> VoteFloor | None:
        """``Config.vote_floor``, kept durably by the log store (see VoteFloor)."""
        return self.log.vote_floor()

    def accept(self, msg: Message) -> bool:
        """Check what the core cannot: a snapshot image must be whole and valid (every
        chunk, the ordering, the trailing digest) and reach the snapshot's index before
        the core adopts the snapshot, because a failed install after that cannot be
        undone. ``check`` then ``adopt``; the node runs the check on a worker thread."""
        if msg.type == MessageType.SNAPSHOT and msg.snapshot is not None:
            image = self.check(msg)
            if image is None:
                return False
            self.adopt(msg, image)
        return True

    @staticmethod
    def check(msg: Message) -> VerifiedImage | None:
        """The checked image of a snapshot message, or None (logged) if it is bad. Reads
        nothing of this store, so any thread may run it."""
        assert msg.snapshot is not None
        try:
            image = verify_image(unpack_image(msg.snapshot.data))
            if image.applied < msg.snapshot.index:
                raise StorageError(
                    f"image at {image.applied} does not cover snapshot {msg.snapshot.index}"
                )
        except StorageError as e:
            log.warning("dropping a snapshot from %s: %s", msg.frm, e)
            return None
        return image

    def adopt(self, msg: Message, image: VerifiedImage) -> None:
        """Keep ``check``'s image for the install that the core's next Ready asks for
        (``_install_image``), which then only decodes it. The next persist drops it
        whichever way, so an image the core ignored is not held."""
        assert msg.snapshot is not None
        self._accepted = (msg.snapshot.data, image)


def persist_together(jobs: Sequence[tuple[GroupStorage, Ready]]) -> None:
    """``persist`` for several groups whose logs share one LMDB environment (the same
    ``log_env``): their state images first, as ``persist`` does, then every log batch
    in one transaction, so one commit and one fsync for all of them."""
    if len(jobs) == 1:
        jobs[0][0].persist(jobs[0][1])
        return
    env = jobs[0][0].log_env
    assert env is not None and all(gs.log_env is env for gs, _ in jobs)
    batches = []
    for gs, rd in jobs:
        gs._install_image(rd)
        assert isinstance(gs.log, LmdbLogStore)
        batches.append((gs.log, rd.hard_state, rd.entries, rd.snapshot))
    env.save_many(batches)


def pack_image(state: StateStore) -> bytes:
    return pack_chunks(state.snapshot_chunks())


def pack_chunks(chunks: Iterable[bytes]) -> bytes:
    """The image of a chunk stream. The stream is one read view taken when it was made,
    so the driver makes it on its loop thread and packs it on another (large states take
    seconds, longer than an election timeout)."""
    return msgpack.packb(list(chunks), use_bin_type=True)


def unpack_image(data: bytes) -> list[bytes]:
    try:
        chunks = msgpack.unpackb(data, raw=False, max_bin_len=MAX_IMAGE_BYTES,
                                 max_array_len=1 << 24)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise StorageError(f"malformed snapshot image: {e}") from e
    if not isinstance(chunks, list) or not all(isinstance(c, bytes) for c in chunks):
        raise StorageError("malformed snapshot image: expected a list of byte chunks")
    return chunks
