"""The core's view of the log: durable storage plus an unstable tail not yet persisted.

``RaftLog`` reads stable entries through the ``LogStorage`` contract (in memory or
LMDB) and keeps the entries appended since the last ``advance()`` in ``unstable``.
The unstable tail shadows storage: once the core decides to overwrite a conflicting
suffix, lookups at or after ``unstable_offset`` answer from the new entries even before
the driver has persisted them. A pending snapshot (received, not yet installed) shadows
everything up to its index.

Invariants: ``applied <= committed <= last_index()``; ``committed`` never moves back.
"""

from __future__ import annotations

from raftkv.storage.errors import Compacted, Unavailable
from raftkv.storage.log_store import LogStorage, limit_size
from raftkv.storage.records import Entry, Snapshot


class RaftLog:
    __slots__ = (
        "applied",
        "committed",
        "pending_snapshot",
        "storage",
        "unstable",
        "unstable_offset",
    )

    def __init__(self, storage: LogStorage) -> None:
        self.storage = storage
        self.unstable: list[Entry] = []
        self.unstable_offset = storage.last_index() + 1
        self.pending_snapshot: Snapshot | None = None
        first = storage.first_index()
        hard, _ = storage.initial_state()
        self.committed = max(hard.commit, first - 1)
        # A restarting node re-applies from its snapshot: the state machine is rebuilt
        # from the snapshot and the committed entries after it.
        self.applied = first - 1

    # -- queries -----------------------------------------------------------------------
    def first_index(self) -> int:
        if self.pending_snapshot is not None:
            return self.pending_snapshot.index + 1
        return self.storage.first_index()

    def last_index(self) -> int:
        if self.unstable:
            return self.unstable_offset + len(self.unstable) - 1
        if self.pending_snapshot is not None:
            return self.pending_snapshot.index
        return self.storage.last_index()

    def term(self, index: int) -> int:
        """Term of ``index``; raises ``Compacted``/``Unavailable`` like storage does."""
        off = self.unstable_offset
        if index >= off:
            i = index - off
            if i < len(self.unstable):
                return self.unstable[i].term
            raise Unavailable(index, self.last_index())
        snap = self.pending_snapshot
        if snap is not None:
            if index == snap.index:
                return snap.term
            if index < snap.index:
                raise Compacted(index, snap.index + 1)
        return self.storage.term(index)

    def term_or_zero(self, index: int) -> int:
        try:
            return self.term(index)
        except (Compacted, Unavailable):
            return 0

    def last_term(self) -> int:
        return self.term(self.last_index())

    def match_term(self, index: int, term: int) -> bool:
        try:
            return self.term(index) == term
        except (Compacted, Unavailable):
            return False

    def is_up_to_date(self, last_index: int, term: int) -> bool:
        """§5.4.1: is a candidate's log at least as up to date as ours?"""
        our_term = self.last_term()
        return term > our_term or (term == our_term and last_index >= self.last_index())

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries ``[lo, hi)``, at least one if any, trimmed to ``max_bytes``."""
        if lo >= hi:
            return []
        if lo < self.first_index():
            raise Compacted(lo, self.first_index())
        off = self.unstable_offset
        if lo >= off:
            return limit_size(self.unstable[lo - off : hi - off], max_bytes)
        stable = self.storage.entries(lo, min(hi, off), max_bytes)
        if hi <= off or len(stable) < min(hi, off) - lo:
            return stable
        # The range spans storage and the unstable tail.
        return limit_size(stable + self.unstable[: hi - off], max_bytes)

    def find_conflict(self, ents: list[Entry]) -> int:
        """Index of the first entry whose term differs from ours, or that we lack; 0 if
        every entry already matches (then nothing may be truncated: §5.3)."""
        if not ents:
            return 0
        last = self.last_index()
        # Fast path: the common case appends strictly after our tail.
        if ents[0].index > last:
            return ents[0].index
        for e in ents:
            if e.index > last or not self.match_term(e.index, e.term):
                return e.index
        return 0

    def find_conflict_by_term(self, index: int, term: int) -> int:
        """The largest index <= ``index`` whose term is <= ``term`` (the fast back-off
        hint: entries above it cannot match a log whose entry at ``index`` has ``term``)."""
        while index > 0:
            try:
                if self.term(index) <= term:
                    return index
            except Compacted:
                return index
            except Unavailable:
                index = self.last_index()
                continue
            index -= 1
        return 0

    # -- mutations ---------------------------------------------------------------------
    def append(self, ents: list[Entry]) -> None:
        """Append ``ents``, replacing any existing suffix from ``ents[0].index``."""
        if not ents:
            return
        after = ents[0].index
        off = self.unstable_offset
        n = len(self.unstable)
        if after == off + n:
            self.unstable.extend(ents)
        elif after <= off:
            # Overwrites stable entries: storage truncates them when this tail is saved.
            self.unstable_offset = after
            self.unstable = list(ents)
        else:
            self.unstable = self.unstable[: after - off] + list(ents)

    def commit_to(self, index: int) -> bool:
        if index <= self.committed:
            return False
        if index > self.last_index():
            raise AssertionError(f"commit {index} is beyond the last index {self.last_index()}")
        self.committed = index
        return True

    def maybe_commit(self, index: int, term: int) -> bool:
        """§5.4.2: only an entry of the current term is committed by counting replicas."""
        if index > self.committed and self.term_or_zero(index) == term:
            return self.commit_to(index)
        return False

    def restore(self, snap: Snapshot) -> None:
        self.pending_snapshot = snap
        self.unstable = []
        self.unstable_offset = snap.index + 1
        self.committed = snap.index

    # -- the Ready cycle ---------------------------------------------------------------
    def has_next_committed(self) -> bool:
        return self.committed > self.applied and self.pending_snapshot is None

    def next_committed(self, max_bytes: int | None) -> list[Entry]:
        if not self.has_next_committed():
            return []
        return self.entries(self.applied + 1, self.committed + 1, max_bytes)

    def stable_to(self, n_entries: int, snapshot: Snapshot | None) -> None:
        """The driver persisted the snapshot and the first ``n_entries`` unstable ones."""
        if snapshot is not None and snapshot is self.pending_snapshot:
            self.pending_snapshot = None
            self.applied = max(self.applied, snapshot.index)
        if n_entries:
            del self.unstable[:n_entries]
            self.unstable_offset += n_entries

    def applied_to(self, index: int) -> None:
        if index > self.committed or index < self.applied:
            raise AssertionError(
                f"applied {index} outside [{self.applied}, {self.committed}]"
            )
        self.applied = index
