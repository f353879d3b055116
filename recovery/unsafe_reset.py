"""Catastrophic recovery: force a new membership onto the survivors of a lost majority.

Theory of operation
-------------------
Raft's guarantees rest on majorities overlapping. A committed entry is stored on a
majority, every leader is elected by a majority, so some voter of every future leader
holds every committed entry (§5.4). When a majority of a group's voters is *permanently*
lost, no quorum can ever form again: the survivors can neither elect a leader nor commit,
however long they wait. Kudu's Raft configuration-change design document ("Restoring
availability after catastrophic data loss") is blunt about it: all durability and
consistency guarantees are then lost, and the only way back is a manual process: find the
most up-to-date remaining replica, rewrite the membership by force, bring the replicas back
online ("6. Pray?"). Kudu calls the rewrite an *unsafe config change*. This module is that
tool for one raftkv group, run against the survivors' data directories while they are
stopped.

What it does: on the chosen survivor S it appends ONE ``CONF_CHANGE`` entry, at
``S.last_index + 1``, in a brand-new term, whose configuration is exactly the survivors
as voters; and it saves a hard state (that term, vote = S, commit = that entry's index).
Kudu's step 4 rewrites a metadata file and notes "Violates Raft not to append to the log,
do we also need to do that?". Here the answer is yes: raftkv's membership lives in the log,
so an entry is how the other survivors learn it, through ordinary replication, and its
index orders it after everything S holds.

Why it is unsafe
~~~~~~~~~~~~~~~~
1. The lost majority may have committed, and acknowledged to clients, entries no survivor
   holds. Nothing left records them, so the tool cannot even count them. The most it can
   say is X, the highest commit index any survivor knows: any write acknowledged after X
   may be gone.
2. The new entry is **committed by fiat**. Nobody replicated it; the tool simply declares
   it committed. This is the only place in raftkv where commitment does not come from a
   quorum. Committing it commits everything before it in S's log, including entries that
   were never known to be committed, whose clients may have been told the write failed
   or timed out. Those writes now take effect.
3. The other survivors' entries that S's log does not hold are overwritten when they
   rejoin (they were never known to be committed, but the lost majority may have
   committed them).

Why the most up-to-date survivor
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Kudu's step 1 is "determine the most up-to-date remaining replica". Up to date is Raft's
§5.4.1 order: the later last term wins, then the longer log. That log carries the most
recent leader's decisions, so it loses the least. One refinement: S must also hold every
entry any survivor *knows* is committed. A survivor T knows its log is committed up to its
commit index; if S's log contradicted that, the lost majority's acknowledged writes would be
dropped although a survivor still holds them, and T could not even rejoin: it never lets a
leader overwrite its committed entries, so the two would probe each other forever (the
tests show it). Normally the §5.4.1 maximum
holds them all. The two differ only when the §5.4.1 winner's newest entries were never
committed and a later leader committed different ones elsewhere. Example: S holds 6@3 from
a leader that died at once; a term-4 leader then committed 6@2 on the lost nodes and on T,
and T learned commit = 6. S's log is §5.4.1-newer, but 6@3 is provably uncommitted and
6@2 provably committed. So the tool picks the §5.4.1 maximum among the survivors whose log
holds the entry at X (the same term as the survivor that knows X is committed), and the
report names any survivor it passed over.

Why a new term
~~~~~~~~~~~~~~
The entry's term is one more than the highest hard-state term of any survivor:

- It makes S's log strictly more up to date (§5.4.1) than every other survivor's, so
  each grants S its pre-vote and vote. After a restart no survivor knows a leader (the
  old one is dead), so leader stickiness does not hold them back. And S campaigns in a
  term above all of theirs, so no vote they cast earlier stands in the way.
- No leader of that term ever existed, so no other log can hold a different entry at
  the same (index, term): Log Matching holds for the forced entry. Recording vote = S
  says S is the only node that was ever in that term.

The other survivors
~~~~~~~~~~~~~~~~~~~
They keep their logs and hard states. Until S's entry reaches them they still hold the old
configuration, and that is enough: S campaigns under its new configuration (only survivors
vote) and asks only them, and they grant it for the reasons above. Once elected, S's entries
replace their divergent suffixes. That replacement never reaches below their commit index,
because S holds everything known to be committed. Verified by tests/test_unsafe_reset.py.
The one exception is a **vote floor** (``raftkv.storage.records.VoteFloor``). It is left when a
survivor's damaged tail was truncated at open, and until it clears that survivor refuses
every vote. Clearing it needs a leader, and with few survivors the leader needs that very
vote, so the group would deadlock. The tool clears the floor. The loss it guards against
(entries that survivor acknowledged and then lost) is exactly the loss the operator
accepts here; the report lists it.

Checks before anything is written
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every data directory, the group in it, its log and state stores must exist and open
cleanly. No other process may have them open (LMDB holds a shared lock on ``lock.mdb`` in
every process that has the environment open, so an exclusive lock attempt tells a running
node apart from a stopped one). ``members`` must be exactly the survivors' ids. What a
survivor knows is committed is its log's commit index or, when higher, its state store's
applied index (only committed entries are applied; a SIGKILLed node's log usually records
an older commit index than it applied, since a Ready that only moves the commit index is
not written). The applied index counts only while the survivor's own log reaches it and
the store's last installed image is one the log recorded (``image_index`` at or below the
log's snapshot base): otherwise the store may hold a newer leader's history at indexes
where the log holds a divergent suffix. A state store that applied entries beyond X
installed a snapshot image its log never recorded. Nothing on the survivors then says
whether S's entries match what it applied, so the tool refuses and asks the operator to
leave it out. The dry run (``dry_run=True``, and the
CLI without its confirmation flag) opens the stores the same way and writes nothing. Opening
a log does truncate a damaged *uncommitted* tail, exactly as the node's own start would.

Afterwards: start the survivors; one elects S; add replacement members as learners
(Kudu's step 2, tablet copy, is here the leader's ordinary catch-up by log or snapshot).
Re-running the tool after an interruption is safe: it appends another configuration in a
newer term.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NoReturn

import lmdb
from raftkv.storage.dir_lock import lock_data_dir, release_data_dir
from raftkv.storage.durable_fs import write_durable
from raftkv.storage.errors import StorageError
from raftkv.storage.layout import (
    DEFAULT_GROUP,
    META_GROUP,
    NODE_ID_FILE,
    group_paths,
    partition_logs_path,
    read_node_id,
)
from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.records import ConfState, Entry, EntryType, HardState, VoteFloor

from raftkv.core.membership import decode_conf_entry, encode_conf_entry

if TYPE_CHECKING:
    from raftkv.placement.metastore import MetaStore

__all__ = [
    "ResetReport",
    "SurvivorState",
    "UnsafeResetError",
    "group_paths",
    "main",
    "unsafe_reset",
]

CONFIRM_FLAG = "--yes-i-understand-data-may-be-lost"
PROG = "raftkv recover unsafe-reset"


class UnsafeResetError(Exception):
    """The reset was refused; nothing was written. The message is one line for operators."""


@dataclass(frozen=True)
class SurvivorState:
    """One survivor as the tool found it (before the reset)."""

    node_id: str
    data_dir: str
    first_index: int
    last_index: int
    last_term: int
    term: int  # hard-state term
    commit: int  # what it knows is committed: its hard state's, or its applied index
    applied: int  # the state store's applied index
    conf: ConfState  # the configuration its log ends with
    vote_floor: VoteFloor | None
    # The first of its entries that the chosen survivor's log replaces when it rejoins
    # (None: its log is a prefix of the chosen one's). Conservative where the chosen
    # survivor compacted the range and the terms cannot be compared.
    replaced_from: int | None = None


@dataclass(frozen=True)
class ResetReport:
    group: str
    members: tuple[str, ...]
    chosen: str
    chosen_last_index: int
    chosen_last_term: int
    new_term: int
    config_index: int
    known_committed: int  # X: the highest commit index any survivor knows
    old_conf: ConfState  # the configuration the chosen survivor held
    survivors: tuple[SurvivorState, ...]
    # Survivors whose log is newer by §5.4.1 but lacks the committed entry at X.
    passed_over: tuple[str, ...] = ()
    floors_cleared: tuple[str, ...] = ()
    performed: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def lost_voters(self) -> frozenset[str]:
        return self.old_conf.voters - frozenset(self.members)

    @property
    def by_fiat(self) -> tuple[int, int] | None:
        """(first, last) of the chosen log's entries that were never known committed and
        become committed with the new configuration, or None."""
        lo = max(self._chosen().commit, self.known_committed) + 1
        return (lo, self.chosen_last_index) if lo <= self.chosen_last_index else None

    def _chosen(self) -> SurvivorState:
        return next(s for s in self.survivors if s.node_id == self.chosen)

    def describe(self) -> str:
        done = "PERFORMED" if self.performed else "DRY RUN: nothing was written"
        lost = ", ".join(sorted(self.lost_voters)) or "none"
        lines = [
            f"unsafe reset of group {self.group!r} ({done})",
            f"  configuration held by {self.chosen}: {self.old_conf.describe()}",
            f"  voters lost: {lost}",
            f"  chosen survivor: {self.chosen} (last index {self.chosen_last_index}, last term"
            + f" {self.chosen_last_term})",
            f"  new configuration: voters=({','.join(sorted(self.members))}) at index"
            + f" {self.config_index}, term {self.new_term}, committed by fiat",
        ]
        for nid in self.passed_over:
            s = next(s for s in self.survivors if s.node_id == nid)
            lines.append(
                f"  passed over: {nid} (last index {s.last_index}, last term {s.last_term}) "
                f"is newer by Raft §5.4.1 but does not hold entry {self.known_committed}, "
                "which a survivor knows is committed; its extra entries were never committed"
            )
        lines += ["", "  survivor   last index  last term   commit  applied  term  note"]
        for s in self.survivors:
            note = self._note(s)
            lines.append(
                f"  {s.node_id:<10} {s.last_index:>10} {s.last_term:>10} {s.commit:>8} "
                f"{s.applied:>8} {s.term:>5}  {note}".rstrip()
            )
        lines += ["", "What may be lost:"]
        x = self.known_committed
        lines.append(
            f"  - No survivor knows of a commit beyond index {x}. Any write the lost voters "
            f"({lost}) acknowledged after index {x} may be lost: the survivors cannot tell "
            "whether there were any, or how many."
        )
        fiat = self.by_fiat
        if fiat is not None:
            lines.append(
                f"  - {_span(*fiat).capitalize()} on {self.chosen}: never known to be "
                "committed, now committed by fiat. Writes whose clients were told they "
                "failed or timed out may take effect."
            )
        for s in self.survivors:
            if s.replaced_from is not None:
                lines.append(
                    f"  - {s.node_id}: {_span(s.replaced_from, s.last_index)}, not in "
                    f"{self.chosen}'s log, will be replaced when it rejoins."
                )
            if s.vote_floor is not None:
                lines.append(
                    f"  - {s.node_id} had truncated a damaged log tail: it may have "
                    f"acknowledged entries up to {s.vote_floor.index} (terms up to "
                    f"{s.vote_floor.term}) that it no longer holds."
                )
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def _note(self, s: SurvivorState) -> str:
        parts = []
        if s.node_id == self.chosen:
            parts.append("chosen")
        if s.node_id in self.passed_over:
            parts.append("passed over")
        if s.replaced_from is not None:
            parts.append(f"entries from {s.replaced_from} replaced")
        if s.vote_floor is not None:
            parts.append(
                "vote floor cleared" if s.node_id in self.floors_cleared else "vote floor"
            )
        return ", ".join(parts)


def _span(lo: int, hi: int) -> str:
    return f"entry {lo}" if lo == hi else f"entries {lo}..{hi} ({hi - lo + 1})"


# ===================================================================== checks =========
def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _check_not_in_use(env_path: str, what: str) -> None:
    """Refuse an LMDB environment another process has open (a running node).

    Every process that opens an LMDB environment holds a shared fcntl lock on byte 0 of
    ``lock.mdb`` for as long as it has it open (lmdb's mdb_env_excl_lock), so an
    exclusive, non-blocking lock attempt fails exactly when someone else has it open.
    fcntl locks are per process: call this before opening the environment here.
    """
    lock = os.path.join(env_path, "lock.mdb")
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return  # never opened with locking: nobody can hold it
    except OSError as e:
        raise UnsafeResetError(f"cannot check whether {what} is in use: {_one_line(e)}") from e
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise UnsafeResetError(
                    f"{what} is open in another process: stop that node first "
                    "(the reset must run on stopped nodes)"
                ) from e
            raise UnsafeResetError(
                f"cannot check whether {what} is in use: {_one_line(e)}"
            ) from e
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
    finally:
        os.close(fd)


def _require_env(path: str, what: str) -> None:
    """The stores create a missing environment on open: check it is there first."""
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        raise UnsafeResetError(f"{what} is missing: no {os.path.join(path, 'data.mdb')}")


def _node_ids(data_dirs: Sequence[str], node_ids: Sequence[str] | None) -> list[str]:
    if node_ids is not None and len(node_ids) != len(data_dirs):
        raise UnsafeResetError(
            f"{len(node_ids)} node ids given for {len(data_dirs)} data directories; "
            "give one per data directory, in the same order"
        )
    out = []
    for i, d in enumerate(data_dirs):
        try:
            stored = read_node_id(d)
        except (OSError, ValueError) as e:
            raise UnsafeResetError(f"{d}: cannot read its node_id file: {_one_line(e)}") from e
        given = node_ids[i].strip() if node_ids is not None else None
        if given is not None and stored is not None and given != stored:
            raise UnsafeResetError(
                f"{d} belongs to node {stored!r} (its node_id file), not {given!r}"
            )
        nid = given or stored
        if not nid:
            raise UnsafeResetError(
                f"cannot tell which node {d} belongs to: it has no node_id file; "
                "give the node ids explicitly (--node-id, one per --data-dir)"
            )
        out.append(nid)
    return out


def _check_members(members: Sequence[str], ids: Sequence[str], dirs: Sequence[str]) -> None:
    if not members or any(not m for m in members):
        raise UnsafeResetError(
            "--members must list the survivors' ids (none, or an empty id, given)"
        )
    if len(set(members)) != len(members):
        raise UnsafeResetError(f"--members lists a node twice: {','.join(members)}")
    missing = [f"{nid} (at {d})" for nid, d in zip(ids, dirs) if nid not in members]
    unknown = sorted(set(members) - set(ids))
    if missing or unknown:
        why = []
        if missing:
            why.append(f"survivors not in --members: {', '.join(missing)}")
        if unknown:
            why.append(f"members with no data directory: {', '.join(unknown)}")
        raise UnsafeResetError(
            "--members must be exactly the survivors' ids: " + "; ".join(why)
        )


# ===================================================================== reading ========
@dataclass
class _Open:
    node_id: str
    data_dir: str
    log: LmdbLogStore
    applied: int
    image: int | None  # the state store's last installed image (LmdbBacked.image_index)


def _open_survivor(stack: ExitStack, node_id: str, data_dir: str, group: str) -> _Open:
    if not os.path.isdir(data_dir):
        raise UnsafeResetError(f"{data_dir}: no such data directory")
    group_dir = os.path.join(data_dir, "groups", group)
    if not os.path.isdir(group_dir):
        try:
            present = sorted(os.listdir(os.path.join(data_dir, "groups")))
        except OSError:
            present = []
        raise UnsafeResetError(
            f"unknown group {group!r} in {data_dir} (groups present: "
            f"{', '.join(present) or 'none'})"
        )
    log_path, state_path = group_paths(data_dir, group)
    shared = partition_logs_path(data_dir)
    if not os.path.isdir(log_path) and os.path.isfile(os.path.join(shared, "data.mdb")):
        # A table partition: its log is in the node's shared environment.
        log_path = shared
    _require_env(log_path, f"the Raft log of {node_id} ({log_path})")
    _require_env(state_path, f"the state store of {node_id} ({state_path})")
    # The node's own lock, held for the whole reset, so that no node starts on the
    # directory while the tool writes it; then LMDB's, for a node of an older release.
    try:
        lock_data_dir(data_dir)
    except StorageError as e:
        raise UnsafeResetError(f"{e} (the reset must run on stopped nodes)") from None
    stack.callback(release_data_dir, data_dir)
    _check_not_in_use(log_path, f"the Raft log of {node_id} ({log_path})")
    _check_not_in_use(state_path, f"the state store of {node_id} ({state_path})")
    try:
        if log_path == shared:
            env = LogEnv(shared, shared=True)
            stack.callback(env.close)
            if not env.has(group):
                raise UnsafeResetError(
                    f"the Raft log of {node_id} is missing: {shared} holds no log of {group}")
            raft_log = env.store(group)
        else:
            raft_log = LmdbLogStore(log_path)
    except (StorageError, lmdb.Error, OSError) as e:
        raise UnsafeResetError(
            f"cannot open the Raft log of {node_id} at {log_path}: {_one_line(e)}"
        ) from e
    stack.callback(raft_log.close)
    try:
        state = _open_state(group, state_path)
    except (StorageError, lmdb.Error, OSError) as e:
        raise UnsafeResetError(
            f"cannot open the state store of {node_id} at {state_path}: {_one_line(e)}"
        ) from e
    try:
        applied, image = state.applied_index(), state.image_index()
    finally:
        state.close()
    return _Open(node_id, data_dir, raft_log, applied, image)


def _open_state(group: str, path: str) -> LmdbStateStore | MetaStore:
    """The group's state store, only to read its applied index: the metastore's is a
    MetaStore, every other group's a KV store."""
    if group == META_GROUP:
        from raftkv.placement.metastore import MetaStore  # the placement layer, only here

        return MetaStore(path)
    return LmdbStateStore(path)


def _latest_conf(raft_log: LmdbLogStore) -> ConfState:
    confs = raft_log.conf_entries(raft_log.first_index())
    if confs:
        return decode_conf_entry(confs[-1].data)[1]
    return raft_log.initial_state()[1]


def _describe(o: _Open) -> SurvivorState:
    hard, _ = o.log.initial_state()
    last = o.log.last_index()
    # A state store applies only committed entries, so its applied index is a commit this
    # survivor knows, and after a SIGKILL usually a later one than its log's hard state
    # records: a Ready that only moves the commit index is not written to the log, while
    # the state store checkpoints every second. It says which entries of *this* log were
    # committed only if they are what the store applied: the store's last image must be
    # one the log recorded (at or below its snapshot base). An image installed just before
    # a crash, its snapshot not yet in the log, came from a newer leader, and the log may
    # still hold a divergent suffix at those indexes (found by a review: the reset then
    # committed it over the image's history). Such a store, or one too old to say, counts
    # only its log's commit record, and _reset refuses it if it applied beyond that.
    recorded = o.image is not None and o.image <= o.log.first_index() - 1
    commit = max(hard.commit, o.applied) if recorded and o.applied <= last else hard.commit
    return SurvivorState(
        node_id=o.node_id, data_dir=o.data_dir, first_index=o.log.first_index(),
        last_index=last, last_term=o.log.term(last), term=hard.term, commit=commit,
        applied=o.applied, conf=_latest_conf(o.log), vote_floor=o.log.vote_floor(),
    )


def _replaced_from(t: SurvivorState, t_log: LmdbLogStore, s_log: LmdbLogStore) -> int | None:
    """The first entry of ``t``'s log that the chosen log (``s_log``, before the reset)
    contradicts, or None when ``t``'s log is a prefix of it. ``t`` agrees with it through
    ``t.commit`` (the chosen log holds everything known committed), and by Log Matching
    the indexes where two logs agree form a prefix, so a binary search finds the end."""
    s_last = s_log.last_index()
    hi = min(t.last_index, s_last)
    lo = t.commit + 1
    # Below the chosen log's compaction base the terms are gone; its base is comparable.
    start = max(lo, s_log.first_index() - 1)
    if lo <= hi:
        if start > hi or t_log.term(start) != s_log.term(start):
            return lo  # conservative when start > lo: somewhere in lo..start
        good, bad = start, hi + 1  # agree at good; bad is the first candidate mismatch
        while bad - good > 1:
            mid = (good + bad) // 2
            if t_log.term(mid) == s_log.term(mid):
                good = mid
            else:
                bad = mid
        if bad <= hi:
            return bad
    # Entry s_last + 1 becomes the new configuration, in a term no one else has.
    return s_last + 1 if t.last_index > s_last else None


def _choose(opened: list[_Open], states: list[SurvivorState]) -> tuple[int, list[int], int]:
    """(index of the chosen survivor, indexes passed over, X)."""
    x = max(s.commit for s in states)
    knower = next(i for i, s in enumerate(states) if s.commit == x)
    term_at_x = opened[knower].log.term(x) if x else 0

    def holds_committed(i: int) -> bool:
        s = states[i]
        if s.commit >= x:
            return True  # committed prefixes of one group never disagree
        return s.last_index >= x and opened[i].log.term(x) == term_at_x

    def rank(i: int) -> tuple[int, int, int]:
        s = states[i]
        return (s.last_term, s.last_index, s.commit)

    candidates = [i for i in range(len(states)) if holds_committed(i)]
    # Ties (same last term and index) are identical logs: prefer the first named.
    chosen = max(candidates, key=lambda i: (rank(i), -i))
    passed = [i for i in range(len(states)) if rank(i)[:2] > rank(chosen)[:2]]
    return chosen, passed, x


def _clear_vote_floor(raft_log: LmdbLogStore) -> None:
    """Drop a survivor's vote floor (see the module docstring).

    LmdbLogStore has no public call for this: it clears the floor itself only once the
    log has caught up, which here would need the very election the floor blocks. So this
    reaches into the store's meta database, where ``save()`` itself deletes the floor.
    """
    raft_log._write(
        lambda txn: txn.delete(raft_log._mkey(b"floor"), db=raft_log._meta),
        "clear the vote floor",
    )
    raft_log._floor = None


# ===================================================================== the reset ======
def unsafe_reset(
    data_dirs: list[str],
    members: list[str],
    group: str = DEFAULT_GROUP,
    node_ids: list[str] | None = None,
    *,
    dry_run: bool = False,
) -> ResetReport:
    """Force ``members`` (exactly the survivors) as the group's voters; see the module
    docstring. ``data_dirs`` are the stopped survivors' data directories; their node ids
    come from ``node_ids`` (same order) or from each directory's ``node_id`` file.
    ``dry_run`` plans and reports without writing. Raises ``UnsafeResetError`` when a
    check fails (nothing written) or a write fails (the message says what was written)."""
    if not data_dirs:
        raise UnsafeResetError("no data directories given: name each survivor's --data-dir")
    real = [os.path.realpath(d) for d in data_dirs]
    if len(set(real)) != len(real):
        raise UnsafeResetError("the same data directory is given twice")
    ids = _node_ids(data_dirs, node_ids)
    if len(set(ids)) != len(ids):
        raise UnsafeResetError(f"two data directories belong to the same node: {', '.join(ids)}")
    _check_members(members, ids, data_dirs)

    with ExitStack() as stack:
        opened = [_open_survivor(stack, nid, d, group) for nid, d in zip(ids, data_dirs)]
        try:
            return _reset(opened, members, group, dry_run)
        except (StorageError, lmdb.Error, OSError) as e:  # the writes wrap their own
            raise UnsafeResetError(
                f"reading the survivors' logs failed, nothing was written: {_one_line(e)}"
            ) from e
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow


def _reset(opened: list[_Open], members: list[str], group: str, dry_run: bool) -> ResetReport:
    states = [_describe(o) for o in opened]
    if all(s.last_index == 0 for s in states):
        raise UnsafeResetError(
            f"no survivor holds any log for group {group!r}: there is nothing to recover "
            "(start a new group instead)"
        )
    chosen, passed, x = _choose(opened, states)
    for s in states:
        if s.applied > x:
            raise UnsafeResetError(
                f"{s.node_id}'s state store has applied entries up to {s.applied}, beyond "
                f"every commit index the survivors' logs know ({x}): it installed a snapshot "
                "image newer than its log, so nothing shows whether the new log agrees with "
                "it; leave it out of the survivors (wipe it and add it back as a new member)"
            )
    s_open, s = opened[chosen], states[chosen]
    states = [
        st if i == chosen
        else replace(st, replaced_from=_replaced_from(st, opened[i].log, s_open.log))
        for i, st in enumerate(states)
    ]
    new_term = max(max(st.term, st.last_term) for st in states) + 1
    index = s.last_index + 1
    notes = []
    old = s.conf
    if len(old.voters & frozenset(members)) * 2 > len(old.voters):
        notes.append(
            f"the survivors are a majority of the voters {s.node_id} knows "
            f"({','.join(sorted(old.voters))}): the group could elect a leader on its own; "
            "removing the lost members one by one would have been safe"
        )
    for st in states:
        if st.node_id not in old.members():
            notes.append(f"{st.node_id} is not a member of the configuration {s.node_id} holds; "
                         "it becomes a voter")
    floors = tuple(st.node_id for st in states if st.vote_floor is not None)
    if not dry_run:
        # The survivors are recorded as the incarnations they are: their votes then
        # count at once, even for a survivor whose files were re-created at some time
        # (newborn, see "Incarnations" in raftkv.core.raft), which would otherwise grant
        # no vote until a leader recorded it, and with every survivor so, none would.
        records = frozenset((o.node_id, o.log.identity().incarnation) for o in opened)
        conf = ConfState(voters=frozenset(members), incarnations=records)
        # cc=None, as in the bootstrap entry: this is not one of the four one-by-one
        # changes but a wholesale replacement of the voter set.
        entry = Entry(new_term, index, EntryType.CONF_CHANGE, encode_conf_entry(None, conf))
        try:
            s_open.log.save(HardState(term=new_term, vote=s.node_id, commit=index), [entry])
        except (StorageError, lmdb.Error, OSError) as e:
            raise UnsafeResetError(
                f"writing the new configuration to {s.node_id} failed, nothing was written: "
                f"{_one_line(e)}"
            ) from e
        # A survivor named by --node-id because its node_id file was lost gets one now:
        # a node refuses to start on data without it (raftkv.node.stores.claim_data_dir).
        for o in opened:
            try:
                if read_node_id(o.data_dir) is None:
                    write_durable(os.path.join(o.data_dir, NODE_ID_FILE),
                                  (o.node_id + "\n").encode())
            except (OSError, ValueError) as e:
                raise UnsafeResetError(
                    f"the new configuration is written to {s.node_id}, but writing "
                    f"{o.node_id}'s node_id file failed ({_one_line(e)}); write it by hand "
                    f"into {o.data_dir}/{NODE_ID_FILE}"
                ) from e
        # save() clears the chosen survivor's own floor: it now commits an entry of a term
        # newer than the floor's. The others need it done for them.
        for o in opened:
            if o.log.vote_floor() is None:
                continue
            try:
                _clear_vote_floor(o.log)
            except (StorageError, lmdb.Error, OSError) as e:
                raise UnsafeResetError(
                    f"the new configuration is written to {s.node_id}, but clearing "
                    f"{o.node_id}'s vote floor failed ({_one_line(e)}); fix that and run "
                    "the reset again (a second run is safe)"
                ) from e
    return ResetReport(
        group=group, members=tuple(members), chosen=s.node_id,
        chosen_last_index=s.last_index, chosen_last_term=s.last_term,
        new_term=new_term, config_index=index, known_committed=x, old_conf=old,
        survivors=tuple(states), passed_over=tuple(states[i].node_id for i in passed),
        floors_cleared=() if dry_run else floors, performed=not dry_run, notes=tuple(notes),
    )


# ===================================================================== CLI ============
class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=(
            "Catastrophic recovery after a group permanently lost a majority of its voters "
            "(Kudu's unsafe config change): force the stopped survivors to become the "
            "group's only voters. Acknowledged writes may be lost. Without "
            f"{CONFIRM_FLAG} it only prints what it would do."
        ),
    )
    p.add_argument("--data-dir", action="append", required=True, dest="data_dirs",
                   metavar="DIR", help="a surviving node's data directory (repeat for each)")
    p.add_argument("--members", required=True,
                   help="comma-separated ids of the new voters: exactly the survivors")
    p.add_argument("--group", default=DEFAULT_GROUP, help="the Raft group (default: %(default)s)")
    p.add_argument("--node-id", action="append", dest="node_ids", metavar="ID",
                   help="each --data-dir's node id, in the same order "
                        "(default: read DIR/node_id)")
    p.add_argument(CONFIRM_FLAG, action="store_true", dest="confirmed",
                   help="perform the reset (otherwise: dry run, exit status 2)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``raftkv recover unsafe-reset ...``. ``argv`` is the arguments after those words
    (a leading ``recover unsafe-reset`` or ``unsafe-reset`` is skipped). Returns the exit
    status: 0 done, 2 refused for want of the confirmation flag (a dry run), 1 error."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:2] == ["recover", "unsafe-reset"]:
        args_list = args_list[2:]
    elif args_list[:1] == ["unsafe-reset"]:
        args_list = args_list[1:]
    try:
        args = build_parser().parse_args(args_list)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    members = [m.strip() for m in args.members.split(",")]
    try:
        report = unsafe_reset(args.data_dirs, members, args.group, args.node_ids,
                              dry_run=not args.confirmed)
    except UnsafeResetError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(report.describe())
    if not args.confirmed:
        print(
            f"{PROG}: refused: this is what the reset WOULD do; nothing was written. It may "
            f"lose acknowledged writes: rerun with {CONFIRM_FLAG} to perform it",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
