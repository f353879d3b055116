"""Local recovery: bring a state store back in line with its Raft log after a restart.

Theory of operation (IGNITE-16907)
----------------------------------
The state store does not sync each apply; it syncs at checkpoints, and the index it
made durable then is its checkpointIndex. The Raft log, which *is* synced per batch, is
the write-ahead log for everything after it. So after a crash:

1. the store reopens at its checkpointIndex (anything applied after it may be lost);
2. the log replays from checkpointIndex + 1 up to the commit index, never further: an
   entry that was not committed may still be overwritten by a new leader, and a state
   machine must never have applied it;
3. if replay ever offers the store an index at or below its checkpointIndex, the store
   answers ``IndexMismatch(checkpoint_index)`` and replay skips ahead to
   checkpoint_index + 1, which is exactly IGNITE-16907's protocol. (It happens when the
   driver does not know the checkpoint, as in that design's worked example, which replays
   from 1; docs/storage-and-recovery.md walks through it.)

Replay reads the log in large batches from one LMDB read transaction per batch and
applies each batch in one state-store transaction, so its speed approaches a plain
batched LMDB write loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from raftkv.storage.errors import IndexMismatch, StorageError
from raftkv.storage.log_store import LogStorage
from raftkv.storage.state_store import StateStore

log = logging.getLogger(__name__)

DEFAULT_BATCH = 10_000
# ... and at most about this many bytes of commands per batch: 10,000 entries of a
# bulk load's 4 MiB batches would be 40 GB in memory at once.
BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class RecoveryReport:
    checkpoint_index: int  # where the state store reopened
    from_index: int  # first index replayed (checkpoint_index + 1 unless nothing to do)
    to_index: int  # last index replayed (the commit index)
    replayed: int
    seconds: float
    skipped: int  # times the store answered IndexMismatch and replay skipped ahead

    @property
    def rate(self) -> float:
        return self.replayed / self.seconds if self.seconds > 0 else float("inf")

    def describe(self) -> str:
        if not self.replayed:
            return f"recovery: state store at checkpoint {self.checkpoint_index}; nothing to replay"
        return (
            f"recovery: replayed entries {self.from_index}..{self.to_index} "
            f"({self.replayed} entries) from checkpoint {self.checkpoint_index} in "
            f"{self.seconds:.3f}s ({self.rate:,.0f} entries/s)"
        )


def replay(
    raft_log: LogStorage,
    state: StateStore,
    *,
    start: int | None = None,
    batch: int = DEFAULT_BATCH,
    clock: Callable[[], float] = time.perf_counter,
) -> RecoveryReport:
    """Apply committed entries after the state store's checkpoint; see the module doc.

    ``start`` defaults to checkpoint_index + 1; passing 1 reproduces IGNITE-16907's "raft
    doesn't know the checkpointIndex" case, resolved by IndexMismatch.
    """
    t0 = clock()
    checkpoint = state.checkpoint_index()
    commit = raft_log.initial_state()[0].commit
    end = min(commit, raft_log.last_index())
    i = checkpoint + 1 if start is None else start
    first_replayed, replayed, skipped = 0, 0, 0
    if i <= end and i < raft_log.first_index():
        # Skip ahead through IndexMismatch only works inside the log; a state store
        # behind the compacted prefix can only be repaired by a snapshot.
        if checkpoint + 1 < raft_log.first_index():
            raise StorageError(
                f"the state store is at {checkpoint} but the log starts at "
                f"{raft_log.first_index()}: the entries in between were compacted away, so "
                "this replica needs a snapshot and cannot be rebuilt from its log. If the "
                "cluster has other members, move this node's data directory away and start "
                "it empty, to be readmitted and sent one (docs/wiped-nodes.md)"
            )
        i = checkpoint + 1
    while i <= end:
        entries = raft_log.payloads(i, min(i + batch, end + 1), BATCH_BYTES)
        try:
            state.apply(entries)
        except IndexMismatch as mismatch:
            skipped += 1
            i = mismatch.checkpoint_index + 1
            continue
        first_replayed = first_replayed or i
        replayed += len(entries)
        i += len(entries)
    report = RecoveryReport(
        checkpoint, first_replayed or checkpoint + 1, state.applied_index(),
        replayed, clock() - t0, skipped,
    )
    log.info("%s", report.describe())
    return report
