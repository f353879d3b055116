"""The leader's view of each follower's log, and how it paces replication.

A follower's progress is in one of three states (etcd-raft's design):

- PROBE: the leader does not know where the follower's log matches. It sends one
  AppendEntries at a time and waits for the answer (or the next heartbeat) before
  sending another, walking ``next`` back using the follower's conflict hint.
- REPLICATE: the logs match up to ``match``. The leader streams entries optimistically,
  advancing ``next`` as soon as it sends, with several messages in flight. ``Inflights``
  caps both their number and their total size, so a slow follower gets backpressure
  instead of an unbounded queue.
- SNAPSHOT: the follower needs entries the leader has compacted. One snapshot is in
  flight; replication resumes in PROBE once the follower reports it installed it, or
  after ``snapshot_timeout`` ticks if the snapshot was lost.
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum


class ProgressState(IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Inflights:
    """In-flight AppendEntries to one follower, as (last index, bytes) in send order."""

    __slots__ = ("_q", "bytes", "max_bytes", "max_count")

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._q: deque[tuple[int, int]] = deque()
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0

    def add(self, last_index: int, size: int) -> None:
        self._q.append((last_index, size))
        self.bytes += size

    def free_le(self, index: int) -> None:
        q = self._q
        while q and q[0][0] <= index:
            self.bytes -= q.popleft()[1]

    def free_first(self) -> None:
        if self._q:
            self.bytes -= self._q.popleft()[1]

    def full(self) -> bool:
        return len(self._q) >= self.max_count or self.bytes >= self.max_bytes

    def reset(self) -> None:
        self._q.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._q)


class Progress:
    __slots__ = (
        "inc",
        "inflights",
        "learner",
        "match",
        "next",
        "pending_snapshot",
        "probe_sent",
        "recent_active",
        "snapshot_elapsed",
        "state",
        "unheard",
    )

    def __init__(self, next_index: int, inflights: Inflights, learner: bool) -> None:
        self.match = 0
        self.next = next_index
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0
        self.snapshot_elapsed = 0
        self.recent_active = False
        # Reported unreachable (``Raft.peer_down``) and silent since: what this progress
        # says of the follower may describe a process that is gone (see "Quiescence").
        self.unheard = False
        self.inflights = inflights
        self.learner = learner
        # The incarnation this progress describes (0: not heard from yet). What the
        # leader knows of a member holds for one incarnation only.
        self.inc = 0

    def _reset_state(self, state: ProgressState) -> None:
        self.state = state
        self.probe_sent = False
        self.pending_snapshot = 0
        self.snapshot_elapsed = 0
        self.inflights.reset()

    def become_probe(self) -> None:
        if self.state == ProgressState.SNAPSHOT:
            # The follower has (or may have) the snapshot: probe just after it.
            pending = self.pending_snapshot
            self._reset_state(ProgressState.PROBE)
            self.next = max(self.match + 1, pending + 1)
        else:
            self._reset_state(ProgressState.PROBE)
            self.next = self.match + 1

    def become_replicate(self) -> None:
        self._reset_state(ProgressState.REPLICATE)
        self.next = self.match + 1

    def become_snapshot(self, snapshot_index: int) -> None:
        self._reset_state(ProgressState.SNAPSHOT)
        self.pending_snapshot = snapshot_index

    def maybe_update(self, n: int) -> bool:
        """Record that the follower's log matches up to ``n``. False if it is stale."""
        updated = False
        if self.match < n:
            self.match = n
            updated = True
            self.probe_sent = False
        self.next = max(self.next, n + 1)
        return updated

    def maybe_decr_to(self, rejected: int, match_hint: int) -> bool:
        """Handle a rejection of the AppendEntries whose prevLogIndex was ``rejected``.

        ``match_hint`` is the highest index at which the logs may still match, from the
        follower's conflict hint (§5.3's optimisation, etcd's findConflictByTerm). Returns
        False when the rejection is stale (it answers an older message), in which case
        nothing changes.

        A probe at ``match`` itself can be rejected. etcd clamps ``next`` at
        ``match + 1`` there and keeps ``match``, because its followers never lose what
        they acknowledged. Ours can: storage truncates a damaged uncommitted tail at
        open (see ``VoteFloor``), and with etcd's clamp the leader re-sent the same
        probe forever. A rejection reordered behind later acknowledgements looks the
        same, though (etcd's staleness check is "a best effort assuming message
        reordering is rare"). So the first such rejection only drops the
        acknowledgement (``match`` = 0: it must not count toward commitment; the next
        accepted append re-establishes it) and probes the same index again. A stale
        rejection then costs one round trip; a follower that really lost the entries
        rejects again, and probing goes on below, down to a snapshot if it must.
        """
        if self.state == ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        nxt = max(min(rejected, match_hint + 1), 1)
        if nxt <= self.match:
            self.match = 0  # and probe the same index again
        else:
            self.next = nxt
        self.probe_sent = False
        return True

    def is_paused(self) -> bool:
        if self.state == ProgressState.PROBE:
            return self.probe_sent
        if self.state == ProgressState.REPLICATE:
            return self.inflights.full()
        return True

    def state_name(self) -> str:
        return self.state.name.lower()
