"""The records that the Raft log persists: entries, hard state, membership, snapshots.

These live in ``storage`` (the bottom layer) rather than in the core because they are
the on-disk format: the core produces them, the stores persist them, recovery reads
them back. Nothing here knows about roles, elections or networking.

Enum values are written to disk and onto the wire. Never renumber them; only append.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from operator import itemgetter
from typing import NamedTuple


class EntryType(IntEnum):
    # Written into the log: never renumber, only append.
    NORMAL = 0
    CONF_CHANGE = 1


class Entry(NamedTuple):
    """One log entry. ``index`` is the proposedIndex handed to the state machine."""

    term: int
    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: the Raft name
    type: int = EntryType.NORMAL
    data: bytes = b""


# Fixed per-entry overhead counted by byte budgets (message size, in-flight caps).
ENTRY_OVERHEAD = 16

_data = itemgetter(3)  # Entry.data without a per-entry attribute lookup (hot paths)


def payload_bytes(entries: Iterable[Entry]) -> int:
    """The entries' data bytes, summed in one C-level pass."""
    return sum(map(len, map(_data, entries)))


class HardState(NamedTuple):
    """What must be durable before any message that depends on it is sent (Raft fig. 2)."""

    term: int = 0
    vote: str | None = None
    commit: int = 0


class ConfState(NamedTuple):
    """A group's membership.

    ``voters`` count toward quorums. ``learners`` are PRE_FOLLOWERs (Kudu design): they
    receive the log but never vote and are never counted. ``auto_promote`` is the subset of
    learners the leader promotes by itself once they have caught up; a demoted voter is a
    learner that is *not* in it, so it stays a learner until promoted explicitly.
    """

    voters: frozenset[str] = frozenset()
    learners: frozenset[str] = frozenset()
    auto_promote: frozenset[str] = frozenset()
    # (member, incarnation) pairs: which incarnation of a member's storage the group
    # counts on (``raftkv.core.raft``, "Incarnations"). A member absent here is not yet
    # recorded.
    incarnations: frozenset[tuple[str, int]] = frozenset()

    def members(self) -> frozenset[str]:
        return self.voters | self.learners

    def incarnation_of(self, node: str) -> int | None:
        for n, inc in self.incarnations:
            if n == node:
                return inc
        return None

    def describe(self) -> str:
        learners = ",".join(
            f"{n}{'*' if n in self.auto_promote else ''}" for n in sorted(self.learners)
        )
        return f"voters=({','.join(sorted(self.voters))}) learners=({learners})"


class VoteFloor(NamedTuple):
    """Set when storage truncated a damaged log tail at open. This node may have
    acknowledged entries up to ``index`` (its old last index) in terms up to ``term``, so
    it must neither vote nor campaign until it cannot be missing a committed one:

    - its log reaches ``index`` again, with entries accepted from a leader; or
    - it commits an entry of a term after ``term``: that leader was elected without this
      node's vote, so (Raft's overlap argument) its log holds every committed entry, and
      committing one of its entries means this log matches it up to there.
    """

    index: int  # type: ignore[assignment]  # as in Entry
    term: int

    def cleared(self, last_index: int, commit_term: int) -> bool:
        return last_index >= self.index or commit_term > self.term


class Identity(NamedTuple):
    """The identity of one replica's storage: ``incarnation``, a random positive number
    made when the storage is created and kept as long as its files are; ``newborn``,
    whether they were created empty (a fresh node, or one whose files were wiped: it
    cannot tell which) rather than adopted from a log that predates incarnations."""

    incarnation: int
    newborn: bool


class SnapshotMeta(NamedTuple):
    index: int = 0  # type: ignore[assignment]  # as in Entry
    term: int = 0
    conf: ConfState = ConfState()


class Snapshot(NamedTuple):
    """A state-machine image at ``meta.index``. ``data`` is opaque to Raft."""

    meta: SnapshotMeta = SnapshotMeta()
    data: bytes = b""

    @property
    def index(self) -> int:  # type: ignore[override]  # as in Entry
        return self.meta.index

    @property
    def term(self) -> int:
        return self.meta.term
