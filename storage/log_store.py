"""The Raft log store contract, and its in-memory reference implementation.

Contract (every implementation, in memory or LMDB, keeps it):

- The log holds a contiguous run of entries ``[first_index, last_index]``. Everything
  below ``first_index`` has been folded into the latest snapshot, whose index is
  ``first_index - 1``; ``term(first_index - 1)`` still answers (the snapshot's term), so
  the leader can always build an AppendEntries for the first retained entry.
- Ranges are half-open: ``entries(lo, hi)`` returns indexes ``lo .. hi-1``.
- ``term(i)`` / ``entries(lo, hi)`` raise ``Compacted`` below the snapshot and
  ``Unavailable`` above ``last_index``. Neither error changes state.
- ``save(hard_state, entries, snapshot)`` is one Ready batch: it is applied atomically
  and made durable with one sync (group commit). With ``sync=False`` (the Ready's
  ``must_sync`` is false: only the commit index moved, etcd's ``MustSync``) the store
  may keep the hard state in memory and write it with the next synced batch: the
  commit index is volatile in Raft (§5.3, Figure 2), and what a crash loses of it
  only makes replay stop earlier; the rest is committed again by the leader and
  re-delivered (entries the state store already holds come back ``IndexMismatch``).
  Every other write (snapshot, compaction, close) takes the latest hard state with it,
  so the persisted commit never lags the snapshot. ``entries[0].index`` may be at or below
  ``last_index``; the existing suffix from there is replaced (Raft §5.3 conflict handling
  happens in the core; by the time entries reach the store the core has decided to
  overwrite).
- ``payloads(lo, hi)`` is ``entries`` as a state store applies them: (index, command),
  CONF_CHANGE entries as b"".
- ``vote_floor()`` is set while this node may lack entries it acknowledged, after a
  damaged tail was truncated at open (see records.VoteFloor).
- ``identity()`` is the store's ``Identity``: an incarnation made (durably) when the store
  is created and never changed while its files last, and whether it was created empty.
- ``conf_entries(lo)`` returns the CONF_CHANGE entries from ``lo`` on, so a restarting
  node rebuilds its membership without scanning the whole log.
- ``compact(index)`` drops entries up to ``index``; it is only legal up to the latest
  snapshot's index, so a lagging follower can always be served by that snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from raftkv.storage.errors import Compacted, SnapshotUnavailable, StorageError, Unavailable
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


class LogStorage(Protocol):
    def initial_state(self) -> tuple[HardState, ConfState]: ...

    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def term(self, index: int) -> int: ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]: ...

    def conf_entries(self, lo: int) -> list[Entry]: ...

    def payloads(self, lo: int, hi: int, max_bytes: int | None = None
                 ) -> list[tuple[int, bytes]]:
        """(index, command) of ``[lo, hi)`` (``payloads_of``); with ``max_bytes``, a
        prefix of at least one entry, ending about where the commands pass that budget."""
        ...

    def vote_floor(self) -> VoteFloor | None: ...

    def identity(self) -> Identity: ...

    def snapshot(self) -> Snapshot: ...

    def save(
        self,
        hard_state: HardState | None,
        entries: list[Entry],
        snapshot: Snapshot | None = None,
        sync: bool = True,
    ) -> None: ...

    def create_snapshot(self, index: int, conf: ConfState, data: bytes) -> Snapshot: ...

    def compact(self, index: int) -> None: ...


def limit_size(entries: list[Entry], max_bytes: int | None) -> list[Entry]:
    """Trim ``entries`` to ``max_bytes``, always keeping at least one entry (etcd's rule,
    so an oversized entry can still make progress)."""
    if max_bytes is None or not entries:
        return entries
    # Fast path: a whole batch usually fits, and one C-level pass decides it.
    if payload_bytes(entries) + ENTRY_OVERHEAD * len(entries) <= max_bytes:
        return entries
    total = 0
    for i, e in enumerate(entries):
        total += len(e[3]) + ENTRY_OVERHEAD
        if total > max_bytes and i > 0:
            return entries[:i]
    return entries




def payloads_of(entries: Sequence[Entry]) -> list[tuple[int, bytes]]:
    """What a state store applies: (index, command), with CONF_CHANGE entries as b""
    (they still take an index, so the applied index stays contiguous)."""
    return [(e[1], e[3] if e[2] == EntryType.NORMAL else b"") for e in entries]


class MemoryLogStore:
    """The reference implementation, used by the simulator and by in-memory tables.

    ``_ents[0]`` is a dummy entry standing for the snapshot (its index and term), so
    ``_ents[i - offset]`` is entry ``i`` with ``offset = _ents[0].index``.
    """

    def __init__(self, incarnation: int = 0) -> None:
        """``incarnation``: made by the caller (``raftkv.storage.identity.new_incarnation``, or
        seeded in simulations; this module is part of the pure core's import graph and
        draws no randomness). 0 leaves the store without one, and the core then runs
        without identity checks. Memory holds nothing across a process, so every store
        is newborn."""
        self._identity = Identity(incarnation, True)
        self._hard = HardState()
        # What a crash keeps: ``_hard`` minus a commit index saved with ``sync=False``.
        self._durable_hard = self._hard
        self._snap = Snapshot()
        self._ents: list[Entry] = [Entry(0, 0)]
        self.syncs = 0  # one per synced save(): lets tests assert group commit

    # -- reads -------------------------------------------------------------------------
    def initial_state(self) -> tuple[HardState, ConfState]:
        return self._hard, self._snap.meta.conf

    def first_index(self) -> int:
        return self._ents[0].index + 1

    def last_index(self) -> int:
        return self._ents[0].index + len(self._ents) - 1

    def term(self, index: int) -> int:
        offset = self._ents[0].index
        if index < offset:
            raise Compacted(index, offset + 1)
        if index - offset >= len(self._ents):
            raise Unavailable(index, self.last_index())
        return self._ents[index - offset].term

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        offset = self._ents[0].index
        if lo <= offset:
            raise Compacted(lo, offset + 1)
        if hi > self.last_index() + 1:
            raise Unavailable(hi - 1, self.last_index())
        return limit_size(self._ents[lo - offset : hi - offset], max_bytes)

    def payloads(self, lo: int, hi: int, max_bytes: int | None = None
                 ) -> list[tuple[int, bytes]]:
        return payloads_of(self.entries(lo, hi, max_bytes))

    def vote_floor(self) -> VoteFloor | None:
        return None  # nothing here can be damaged from outside and truncated

    def identity(self) -> Identity:
        return self._identity

    def conf_entries(self, lo: int) -> list[Entry]:
        offset = self._ents[0].index
        start = max(lo - offset, 1)
        return [e for e in self._ents[start:] if e.type == EntryType.CONF_CHANGE]

    def snapshot(self) -> Snapshot:
        return self._snap

    # -- writes ------------------------------------------------------------------------
    def save(
        self,
        hard_state: HardState | None,
        entries: list[Entry],
        snapshot: Snapshot | None = None,
        sync: bool = True,
    ) -> None:
        if snapshot is not None:
            self._install(snapshot)
        if entries:
            self._append(entries)
        if hard_state is not None:
            self._hard = hard_state
        if sync or entries or snapshot is not None:
            self._durable_hard = self._hard
            self.syncs += 1

    def crash(self) -> None:
        """Forget what a process crash would (the simulator's crash): a commit index
        saved without a sync. Entries and snapshots here are always durable."""
        self._hard = self._durable_hard

    def _install(self, snap: Snapshot) -> None:
        if snap.index <= self._snap.index:
            raise StorageError(
                f"snapshot {snap.index} is not newer than the current one ({self._snap.index})"
            )
        self._snap = snap
        self._ents = [Entry(snap.term, snap.index)]

    def _append(self, entries: list[Entry]) -> None:
        offset = self._ents[0].index
        first = entries[0].index
        if first <= offset:
            raise StorageError(f"append at {first} overlaps the snapshot at {offset}")
        if first > self.last_index() + 1:
            raise StorageError(f"append at {first} leaves a gap after {self.last_index()}")
        del self._ents[first - offset :]
        self._ents.extend(entries)

    def create_snapshot(self, index: int, conf: ConfState, data: bytes) -> Snapshot:
        if index <= self._snap.index:
            raise SnapshotUnavailable(f"snapshot at {index} is older than {self._snap.index}")
        snap = Snapshot(SnapshotMeta(index, self.term(index), conf), data)
        self._snap = snap
        self._durable_hard = self._hard
        return snap

    def compact(self, index: int) -> None:
        offset = self._ents[0].index
        if index <= offset:
            return
        if index > self._snap.index:
            raise StorageError(
                f"cannot compact to {index}: the latest snapshot is at {self._snap.index}"
            )
        self._ents = self._ents[index - offset :]
        self._durable_hard = self._hard
        first = self._ents[0]
        self._ents[0] = Entry(first.term, first.index)
