"""Log compaction after a forced checkpoint (IGNITE-16907, "Raft log truncation").

The log may only lose entries the state store has made durable: otherwise a crash would
leave a gap between the store's checkpoint and the log's first entry that only a
snapshot from another node could fill. So compaction first forces a checkpoint (which
*is* the snapshot: the state store's files at that index), records it in the log as the
snapshot point, then drops entries up to it, keeping ``keep`` entries so a follower a
little behind catches up from the log instead of a full snapshot.

The policy triggers on the log's size in entries or bytes, whichever comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from raftkv.storage.errors import SnapshotUnavailable
from raftkv.storage.log_store import LogStorage
from raftkv.storage.records import ConfState
from raftkv.storage.state_store import StateStore


@dataclass(frozen=True)
class CompactionPolicy:
    # 100k entries of ~100 B is ~10 MiB of log and well under a second of replay.
    max_entries: int = 100_000
    max_bytes: int = 256 << 20
    keep: int = 1_000
    # Rough bytes per entry for the size estimate (term/index/type/crc + payload).
    avg_entry_bytes: int = 128

    def due(self, raft_log: LogStorage) -> bool:
        n = raft_log.last_index() - raft_log.first_index() + 1
        return n >= self.max_entries or n * self.avg_entry_bytes >= self.max_bytes


def compact(
    raft_log: LogStorage, state: StateStore,
    conf_at: Callable[[int], ConfState | None], keep: int = 0,
) -> int | None:
    """Force a checkpoint, record it as the snapshot point and drop the log up to it
    (minus ``keep`` entries). Returns the checkpointIndex, or None when nothing was
    compacted.

    The snapshot must record the membership *at the checkpoint index*: a follower that
    installs it, or this node after a restart, takes its voters from there. ``conf_at``
    (``Raft.conf_at``) answers None when the core cannot know it, for instance when a
    snapshot image put the state store ahead of the core's log, and then nothing is
    compacted until the core has caught up."""
    checkpoint = state.checkpoint()
    conf = conf_at(checkpoint)
    if conf is None:
        return None
    try:
        current = raft_log.snapshot().index
    except SnapshotUnavailable:
        current = 0
    if checkpoint > current:
        raft_log.create_snapshot(checkpoint, conf, b"")
    raft_log.compact(max(checkpoint - keep, raft_log.first_index() - 1))
    return checkpoint


def maybe_compact(
    raft_log: LogStorage, state: StateStore,
    conf_at: Callable[[int], ConfState | None], policy: CompactionPolicy,
) -> int | None:
    if not policy.due(raft_log):
        return None
    return compact(raft_log, state, conf_at, policy.keep)
