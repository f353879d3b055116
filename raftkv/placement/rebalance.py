"""``PlacementManager``: tables, partitions, Ignite 3's rebalance (seed 004) and the safe
restart of in-memory partitions (IGNITE-16668) on one node.

Theory of operation
-------------------
Every node runs one manager next to its ``MetaService`` (the metastore replica: a voter on
the metastore's founding nodes, a non-voting learner elsewhere, see "choices" below).
Everything the manager does happens on the node's loop thread, where the Raft cores and
stores live; admin calls from other threads (``create_table``, ``set_replicas``,
``set_nodes``, ``status``) only write the metastore or ask the loop, and blocking waits
never run on the loop thread (callbacks hop back onto it with ``Node.call``).

**Cache and watch.** The manager reads the whole metastore once (``range``), keeps a cache
of the placement keys (``catalog``: table descriptors, the logical topology, node
addresses, and every partition's ``assignments.*`` / ``change.trigger.revision``), and
then long-polls ``watch(b"", revision + 1)``, applying events in revision order. After
each batch it *reconciles* every partition the batch touched. Reconciling is level-
triggered: it compares what the metastore says with what the local Raft group is, and
takes the next step; so a missed edge (a crash between two steps, a leader change, an
error) is repaired by the next reconcile rather than lost. Reconciles are also kicked by
the partition groups' hooks (``on_leader``, ``on_applied`` while a change is under way)
and by the retry timer.

**Step (1), writing the intent.** A trigger is a write of ``<tableScope>.replicas`` (the
table descriptor, ``set_replicas``) or of the logical topology (``set_nodes``). Its
``event.revision`` is that write's revision, i.e. the key's ``mod_revision``. A partition
whose ``change.trigger.revision`` is below ``max(topology rev, descriptor rev)`` runs the
step-(1) invoke (``rebalance_steps.plan_rebalance``) with that revision and the
assignment calculated from the cached topology and replica count: those keys have not
changed since that revision, so every node computes the same value. Each node that sees
the trigger runs it; the trigger revision makes all but the first a no-op (SKIPPED).

**Step (2), pending.** A node in ``pending ∪ stable`` hosts the partition's group: a
founding member (``TableDescriptor.initial``) bootstraps the founding configuration, any
other node joins empty (``voters=None``) and waits for the leader to add it. On the
group's leader only, ``change_peers(term, pending)`` moves the Raft configuration to
pending, one membership change at a time (Kudu's one-by-one design):

1. remove learners that are not in the target (left over from a cancelled change);
2. add each missing member as a PRE_FOLLOWER learner (several may catch up at once; the
   core promotes each one to voter when it is within ``promote_lag``);
3. once every target member is a voter, remove the departing voters one by one, the
   leader last: removing itself raises ``LeaderStepping`` (the core transfers
   leadership), and the transferee, once elected, resumes the change from the pending
   it reads then, which removes the old leader if pending still excludes it (partition
   groups run with ``Config.auto_handover`` off, so the core does not propose that
   removal on its own);
4. when the voters equal the target, no learner is left and the configuration entry is
   committed, ``onNewPeersConfigurationApplied`` runs onRebalanceDone (stable :=
   applied peers, pending := planned or empty; retried on DONE_RETRY).

A change belongs to the term it started in. Every step checks that this node still leads
in that term, and ``change_peers`` with another term is refused with ``StaleTerm`` (seed:
"changePeersAsync from old terms must be skipped").

**Step (3), stable.** When stable changes, the node stops (``Node.remove_group``) the
partitions it hosts but is in neither stable nor pending, and refreshes its routing table
(partition -> stable nodes and a leader hint).

**Failover.** A newly elected leader reconciles through ``on_leader`` and resumes the
pending change (a fresh change of its own term). A membership change that fails
(``ConfChangeRejected``, ``ProposalDropped`` during a transfer, ``RequestTimeout``) or a
metastore invoke that fails is retried with exponential back-off (``retry.Backoff``),
timed by ``retry.TickTimer`` on the metastore group's ``on_tick`` hook: no extra thread.
After ``RetryPolicy.max_attempts`` failures in one context (leader term + target), the
action stops until the context changes, and the error is recorded in ``status()["errors"]``
and counted in ``status()["metrics"]`` (seed: "notify node's failure handler").

**Adjustable changePeers (Approach 2).** When planned is set while the leader is still
*catching up* (some member of pending is not yet a voter), the leader cancels: one
invoke guarded by the revisions of pending and planned moves planned into pending
(``move_planned_to_pending``). The next reconcile retargets the change, and its first
action removes the learners that are not in the new target. Once every pending member is
a voter (the removal phase), planned waits for ``onNewPeersConfigurationApplied``.

**Safe restart of in-memory partitions (IGNITE-16668).** A replica of a table with
``storage="memory"`` loses its Raft log *and its vote* with its process: rejoining as the
voter it was could let it vote twice in one term (two leaders). A persistent partition
whose files were wiped ("cleaned-up PDS") is the same. So such a replica is removed from
its group and re-added fresh, and its Raft node is not started before the removal:

- *onPartitionStart* (``_on_partition_start``), for a partition this node is assigned in
  stable, of a table that existed before this start, and either in memory or without a
  local log directory (the storage self-check): if a majority of stable is *available*,
  add this node to ``<table>.<p>.assignments.switch.reduce`` (the seed's retry loop:
  invoke guarded by ``empty`` or by the key's revision, re-read and retried when it
  moved) and do NOT start the group; if it is a *full-partition restart*, start normally,
  bootstrapping the stable configuration fresh; otherwise wait (retried on a timer and on
  every change of the keys involved). Once stable no longer names the node (written only
  after a configuration without it applied) and pending does, it starts the group empty
  (``voters=None``): a learner the leader adds, catches up and promotes.
- *The leader's watch on switch.reduce* (``_trigger_switch_reduce``): with pending empty,
  ``pending = calcPartAssignments() - switch.reduce; trigger = event.revision`` under the
  seed's trigger guard (``rebalance_steps.trigger_switch_reduce``).
- *onRebalanceDone* (``_on_new_peers_configuration_applied`` ->
  ``rebalance_steps.rebalance_done_switch``): the seed's reduced/added/switch.reduce'/
  switch.append'/pendingReduction/pendingAddition, three branches (re-add, reduce,
  common done moving planned to pending), each invoke guarded by the revisions of stable,
  pending, switch.reduce, switch.append and planned, re-read and retried on DONE_RETRY.

*Available* and *full restart* use two kinds of metastore keys: ``placement.incarnation.
<node>`` (a random id each manager writes when it starts, before it hosts anything) and
``placement.holds.<table>.<p>.<node>`` (the incarnation in which the node started hosting
the partition, written *before* it starts the group). A node holds a partition's state iff
its holds key names its current incarnation (a restart voids all its holds keys at once;
a node that stops hosting removes its own). A stable member is *available* if it holds the
state, is not in switch.reduce, and is alive: connected to this node (the transport dials
on demand, so an unconnected peer is probed and counted as down until it connects).
*Full-partition restart*: nobody holds the state, decided on a linearizable read of the
``placement.`` keys and committed by writing our holds key in an invoke guarded by the
revision of every known node's holds key (no node can start holding the state in
between). Such a holds key is ``<incarnation>/<epoch>``: the fresh history's id (the
first restarter's incarnation). While fewer than a majority hold the state and every
holder is of one epoch E, another restarted member joins E as a late founder, unless its
own (void) holds key is of E: it voted in E already, and lost that vote.

The lone holder of a two-voter configuration (issue 14, "no reachable state waits for ever")
--------------------------------------------------------------------------------------------
IGNITE-16668's onPartitionStart waits ("otherwise: do nothing") when fewer than a majority
of stable hold the state and someone does. With stable [a, b] and b restarted without its
state that is for ever: the majority rule needs two holders besides b, the full-restart
rule does not apply because a holds the state, and the Raft group {a, b} can never again
elect a leader. Tables with two replicas reach it on any restart; three-replica tables
reach it whenever a switch.reduce leaves two voters and one of them is lost before the
re-add completes (chaos seed 102: stable [n1, n3], pending [n1, n3, n4] re-adding n4,
then n1 restarted). The rule:

- *b, restarted:* a two-member stable whose other member a is alive, holds the state and
  is not in switch.reduce counts as available (``_majority_available``): b records itself
  in switch.reduce and does not start, as it would with a majority.
- *a, the holder* (``_maybe_survive``): hosting the group, not its leader, whose Raft
  voters are {a, b}; on a linearizable read, b is in switch.reduce and does not hold the
  partition (its holds key does not name its current incarnation), a holds it, is not in
  switch.reduce, is in stable, and pending is empty or names a. Then a runs a survivor
  election, ``Raft.campaign_without(b)`` (at most once per two election timeouts): it
  wins with its own vote and the grants of the learners that may have been promoted
  and, if the change to {a, b} removed a third voter z and a does not know it
  committed, z's (chaos seed 102 reached that too). Its first entry as leader removes
  b. As leader it then follows the switch path: the reduce trigger writes pending =
  calc - switch.reduce, onRebalanceDone moves b to switch.append, and b joins as a
  fresh learner once stable no longer names it.
- *Bug C's in-memory case* (``_declare_lost``): a node that hosted the partition before
  this start (holds key of an earlier incarnation), lost its state, and is named by
  neither stable nor pending while pending is non-empty may be a voter the change under
  way still counts on (chaos seeds 13 and 25: a cancel dropped it from pending after its
  promotion). A persistent one rejoins with its log; one without state records itself in
  switch.reduce (once per incarnation) and takes the restart path: the leader removes
  it, or, if the configuration is just it and one holder, the holder continues alone.
  If pending names it again later it joins empty, as any re-added member.

Why this is safe. The core's rule ("The lone survivor of two voters" in
``raftkv.core.raft``) proves the election safe for the configurations it accepts (it
refuses the others) given two facts it cannot see; the metastore read establishes them:

(A) *b's state is lost.* Only b itself writes b into switch.reduce, when its storage
    self-check finds the state gone (in memory, or no log); the leader's unblock invoke
    only moves nodes already there. b's holds key does not name b's current incarnation,
    and a node writes its holds key before it starts a group, so b has not started the
    group since. A node runs one incarnation at a time (each start writes a new
    ``placement.incarnation`` key before it hosts anything), so the b the configuration
    counts on is gone, and the new b starts the group only as an empty joiner, after a
    configuration without b applied. A new b re-added and promoted would have written
    its holds key, and the read would fail.
(B) *No configuration that removes or demotes a exists beyond a's log.* The placement
    layer never demotes, and the core READMITs a only if a's storage incarnation
    changed, which a holder's has not. The placement layer removes a voter only in
    changePeers' removal phase, towards a pending without it. After that, pending
    changes only by onRebalanceDone, which writes stable = that pending (without a), or
    by a cancel, which happens only while some pending member is not yet a voter, never
    once the removal phase began. So a in stable and pending empty or naming a means no
    such removal was made. (A direct ``change_peers`` call by an operator is outside
    this argument.)

(A) is about the past, and a removal of a appended after the read could commit only
under {b} or {b, z}, which needs b. Only one side of a pair is ever a survivor: b runs
the election against a only if a is in switch.reduce, which only a new, state-less a
writes. If a lost its state too it does not hold the partition: neither member holds
it, and the full-partition restart applies.
A member of the electorate (a learner that may have been promoted, or z) that is down
or lost its own state makes the election wait: it may hold the only copy of what b
committed with it, and two losses are beyond this rule.

Two replicas still cannot survive one failure: while b is down (not yet restarted) {a,
b} has no quorum, and while a is alone one more loss loses acknowledged writes. So the
HTTP API refuses two replicas for an in-memory table unless ``allow_unsafe`` is given
(``raftkv.server.tables``).

Choices where the seed is ambiguous or does not fit raftkv
----------------------------------------------------------
- IGNITE-16668, where the seed is silent or does not fit:
  - "Restarted" means: the table's descriptor was created before this start's incarnation
    key was written. A founder that first starts after the table's creation therefore
    also takes the switch path (safe, one extra remove/add). A node assigned only in
    pending (a learner, or a voter promoted before onRebalanceDone named it in stable)
    that lost its state *and* hosted the partition before this start (its holds key
    names an earlier incarnation) leaves pending instead: one invoke, guarded by the
    revisions of pending and switch.reduce, writes ``pending - {node}`` and adds it to
    switch.reduce (``rebalance_steps.leave_pending_for_switch_reduce``). The leader's
    retargeted change removes it from the configuration, onRebalanceDone finds it in
    ``reduced`` and re-adds it through switch.append, and it starts empty as a joiner
    once stable (without it) is written. Without this it came back as the voter it was,
    empty (found by tests/test_placement_chaos.py, seed 11). A pending-only node that
    never hosted the partition is an ordinary joiner.
  - Step (2) on a restart: a persistent partition this node hosted before the restart
    (holds key of an earlier incarnation, log present) is started again while pending
    is non-empty even if neither stable nor pending names it: a cancel may have dropped
    it from pending after it was promoted, and the configuration may need it for a
    quorum (chaos seed 13: the new leader's handover removal of the old leader left
    a configuration of itself and that node). Step (3) stops it at the next stable
    update.
  - A node of switch.reduce waits, not started, to be removed. If pending names it
    while it is not a voter (a cancel moved into pending a planned assignment naming it
    after the configuration dropped it), the change would wait for it to catch up as a
    learner forever: the leader drops such nodes from pending with the same invoke, and
    onRebalanceDone re-adds them through switch.append (chaos seed 68).
  - "No log" for a persistent partition is: the node's shared partition log environment
    holds no record of it, and there is no ``groups/<gid>/log`` directory either (a log
    written before logs were shared, moved in when the partition starts).
  - Majority is over stable (the seed's assignments), not over the Raft configuration,
    which during a rebalance may also contain pending members.
  - The leader's trigger guard adds ``revision(switch.reduce) == seen && revision(stable)
    == seen`` as an alternative to ``trigger < event.revision``: the trigger key is shared
    with seed 004 step (1), which can move it past the reduce event without acting on it.
  - onRebalanceDone: the planned revision joins the four preconditions (the common branch
    copies planned); it writes nothing unless pending still names the new peers; append'
    also drops nodes already in resolvedStable (else a no-op addition repeats forever);
    a reduction that would empty pending falls to the common branch.
  - A restarted node in switch.reduce waits for the removal; while the leader adds it
    back it starts the group as a joiner, never bootstrapping ``TableDescriptor.initial``
    (only fresh tables and persistent partitions with their log do).
  - The onDisappeared() optimisation and onCommonRebalance's switch handling (both
    "only an optimization" in the seed) are not implemented.
- Step (1)'s invoke is ``rebalance_steps.plan_rebalance``, not the literal pseudocode
  (``assignments.write_pending_assignments``): the literal text can lose the latest
  intent in two ways (see ``rebalance_steps``). onNewPeersConfigurationApplied is guarded
  by ``pending == applied peers`` so a late duplicate cannot undo a newer pending.
- "Effectively from 1 node": every node that sees a trigger runs step (1); the trigger
  revision dedupes. It is level-triggered (trigger < source revision), so a trigger whose
  writer crashed before step (1) ran is still handled by whichever node looks next.
- Table creation writes the initial ``stable`` assignments (and the descriptor) in one
  invoke guarded by the topology's revision; it does not go through pending. The initial
  assignments stay in the descriptor: they are the founding configuration of the group.
- ``partitions`` changes are out of scope, as in the seed.
- Dropping a table (``drop_table``; not in the seed): one invoke guarded by the
  descriptor's revision removes the descriptor, every partition's assignment and switch
  keys and the table's holds keys. Each node reacts to the descriptor's removal in its
  watch (or, after a compaction, to its absence in the full read): it aborts the
  partitions' changes, stops their groups (``Node.remove_group``: pending requests fail
  with ``NodeStopped``), deletes their directories and forgets them. Invokes that write a
  partition's keys (step (1), switch.reduce, the leader's reduce trigger, holds keys) are
  guarded by the descriptor's existence, so a node that has not seen the drop yet cannot
  write the keys back; ``create_table`` also removes any such leftovers. A persistent
  partition's directory carries ``table.gen`` (the descriptor's create revision): a node
  that was down while the table was dropped and re-created deletes the old files before
  its storage self-check, and a full read deletes ``t.*`` directories of tables that no
  longer exist. Not covered: a node that lags the drop *and* still runs the old group
  while the table is re-created can reach the new group of the same id with old-term
  messages; re-create only once every node has seen the drop (``status()``).
- "STAGE_CATCHING_UP" (JRaft's joint consensus) becomes: some pending member is not yet a
  voter. With one-by-one promotions a cancelled change may already have promoted some of
  its new members; those are voters outside the new target and are removed in its
  removal phase, which is safe (each step is an ordinary one-by-one change).
- Step (3) stops groups on *stable* updates only (and on the manager's first read), as the
  seed says, not when a cancel drops a node from pending: that node may already be a
  promoted voter, and stopping it before the leader removes it would cost availability.
- The catch-up of a learner has no timeout: a learner on a node that is down waits until
  planned cancels the change or the node comes back. ``status()`` shows the learners.
- A stopped persistent partition keeps its files; if the node is assigned the partition
  again, the group reopens its old log and the leader brings it up to date.
- The "failover thread" is the retry timer on the loop thread's ticks.
- A node that is not a metastore voter hosts a MetaService replica that joins the
  metastore as a learner *without* auto-promotion (``join_metastore_as_learner`` on the
  metastore leader): reads, watches and forwarded invokes then work on every node, while
  the metastore's quorum stays on its founding nodes.
- "Leader response must be updated by current term" / "maybe check a lease": the local
  core's role and term are the authority (check-quorum makes a cut-off leader step down);
  a stale leader's membership change cannot commit anyway.
- The table creation trigger: a partition whose stable was written by ``create_table``
  from the current topology skips step (1) (it would only record the trigger).
- One watch covers the whole metastore (prefix ``b""``): the seed's keys have a per-table
  prefix, and one ordered stream keeps the cache consistent across tables and topology.
- ADD_LEARNER carries the new member's raft address from ``placement.address.<node>``
  (each manager registers its own on start), else the transport's address book.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from raftkv.core import (
    CampaignRejected,
    ConfChange,
    ConfChangeOp,
    LeaderStepping,
    NotLeader,
    Raft,
    RaftError,
    Role,
)
from raftkv.node.driver import Group, Node
from raftkv.node.errors import NodeStopped, UnknownGroup
from raftkv.node.stores import open_group_storage
from raftkv.placement import rebalance_steps as steps
from raftkv.placement.assignments import (
    DONE_CLEARED,
    DONE_PLANNED_MOVED,
    DONE_RETRY,
    PENDING_WRITTEN,
    PLANNED_WRITTEN,
    PartitionKeys,
    calc_assignments,
    decode_nodes,
    encode_nodes,
    partition_keys,
    partition_of,
)
from raftkv.placement.catalog import (
    ADDRESS_PREFIX,
    HOLDS_PREFIX,
    INCARNATION_PREFIX,
    MEMORY,
    PERSISTENT,
    TABLES_PREFIX,
    TOPOLOGY_KEY,
    TableDescriptor,
    address_key,
    check_node_id,
    check_table_name,
    holds_key,
    holds_prefix,
    incarnation_key,
    parse_partition_key,
    partition_group,
    table_key,
)
from raftkv.placement.meta_commands import (
    BranchResult,
    Cond,
    Condition,
    Do,
    If,
    InvokeResult,
    Op,
    VersionedValue,
    decode_revision,
)
from raftkv.placement.metastore import EventBatch, HistoryCompacted, RangeResult
from raftkv.placement.retry import Backoff, RetryPolicy, TickTimer
from raftkv.placement.service import MetaService
from raftkv.storage.errors import StorageError
from raftkv.storage.layout import group_paths, partition_logs_path
from raftkv.storage.lmdb_log import LogEnv
from raftkv.transport import codec

log = logging.getLogger(__name__)

_PLACEMENT_PREFIX = b"placement."
_NO_SWITCH = steps.SwitchKeys(b"", b"")
_ADMIN_ATTEMPTS = 5
_DROPPED = 0xD0D  # the tag of an invoke that found its table gone (``_if_table``)
_GEN_FILE = "table.gen"  # in groups/<gid>/: the descriptor's create revision (generation)
# How often a persistent partition's state store checkpoints (CheckpointPolicy). Each
# checkpoint is an fsync of that partition's own file: at the one second the default
# group uses, a node with 256 partitions under write load ran 256 of them a second,
# and table writes were about a tenth slower for it (steady state, 2 cores). Ten
# seconds bounds what a crash replays from a partition's log to ten seconds of its
# writes (Ignite checkpoints every three minutes by default).
PARTITION_CHECKPOINT_SECONDS = 10.0


class StaleTerm(RaftError):
    """``change_peers`` named a term this node does not lead in (seed 004: a changePeers
    from an old term is skipped). The leader of the current term carries on."""


class ChangeSuperseded(RaftError):
    """A newer ``change_peers`` replaced this one's target before it finished."""


class TableExists(ValueError):
    pass


class UnknownTable(KeyError):
    pass


class TableDropped(RaftError):
    """The table was dropped while this operation on one of its partitions was under way."""


class Route(NamedTuple):
    group: str
    table: str
    partition: int
    nodes: tuple[str, ...]  # stable
    leader: str | None  # a hint: the leader this node last knew, if it hosts the group


@dataclass
class _Change:
    """One changePeers on the leader: valid only in ``term``."""

    term: int
    target: frozenset[str]
    origin: str  # "pending" (the listener) or "api" (a direct change_peers call)
    started: float  # node clock
    waiters: list[Future[None]] = field(default_factory=list)
    inflight: str | None = None  # the membership change proposed and not yet answered
    handed_over: bool = False  # removing ourselves: leadership is being transferred


@dataclass
class _Partition:
    table: str
    index: int
    group: str
    keys: PartitionKeys
    change: _Change | None = None
    plan_done: int = 0  # the trigger source revision whose step (1) finished here
    plan_inflight: bool = False
    finishing: tuple[int, int] | None = None  # (term, pending rev) done was issued for
    cancel_key: tuple[int, int] | None = None  # (pending rev, planned rev) cancel issued for
    cleanup_rev: int = -1  # stable's mod revision when step (3) last looked
    backoffs: dict[str, Backoff] = field(default_factory=dict)
    # IGNITE-16668 (see "Safe restart" in the module docstring).
    sw: steps.SwitchKeys = _NO_SWITCH
    preexisting: bool = False  # the table existed before this incarnation registered
    rejoin: bool | None = None  # None: not decided; True: on the restart path
    start_inflight: bool = False  # our holds key is being written before the start
    reduce_inflight: bool = False  # the switch.reduce retry loop is running
    reduce_added: bool = False  # we are in switch.reduce (our cache may not show it yet)
    leave_pending: bool = False  # lost our state while only in pending: leave it first
    left_at: int = 0  # the revision of our leave-pending invoke (wait for the cache)
    unblock_key: tuple[int, int] | None = None  # (pending rev, reduce rev) unblocked for
    wait_scheduled: bool = False
    switch_key: tuple[int, int] | None = None  # (reduce rev, stable rev) triggered for
    declared: bool = False  # bug C's in-memory case: we recorded our loss in switch.reduce
    tidy_inflight: bool = False  # removing a stray learner (_drop_stray_learners)
    pending_read: tuple[int, int] = (0, -1)  # (term, pending rev) confirmed by a read
    pending_reading: bool = False  # that read is under way
    survive_inflight: bool = False  # the survivor check's linearizable read is under way
    survive_after: float = 0.0  # no survivor election before this (monotonic) time
    survive_refused: str = ""  # the core's last reason to refuse one (logged once)
    gen: int = 0  # the descriptor's create revision: which incarnation of the table


class PlacementManager:
    """Tables and rebalance on one node (see the module docstring).

    ``status()["metrics"]`` counts: ``plan.pending_written`` / ``plan.planned_written`` /
    ``plan.other`` (step (1) outcomes), ``conf_changes`` proposed, ``leader_handovers``,
    ``changes_cancelled`` (Approach 2), ``rebalances_done``, ``done_stale``,
    ``partitions_started`` / ``partitions_stopped``, ``errors.<kind>`` (kind: plan,
    change, done, cancel, start, watch), ``retries``, ``retries_exhausted`` and
    ``internal_errors``. ``status()["errors"]`` lists the exhausted (and internal) errors.
    """

    def __init__(
        self, meta: MetaService, data_dir: str | None, *, durable: bool = True,
        retry: RetryPolicy | None = None, watch_timeout: float = 5.0,
        admin_timeout: float = 10.0, checkpoint_seconds: float = PARTITION_CHECKPOINT_SECONDS,
    ) -> None:
        """``data_dir`` holds persistent partitions (state stores in ``groups/t.<table>.<p>``,
        logs in ``partition-logs``, see ``raftkv.storage.layout``); None keeps
        every partition in memory. ``checkpoint_seconds``: see PARTITION_CHECKPOINT_SECONDS.
        Call ``start`` once the node runs (or before)."""
        self.meta = meta
        self.node: Node = meta.node
        self.id = self.node.id
        self.data_dir = data_dir
        self.durable = durable
        self.checkpoint_seconds = checkpoint_seconds
        # The logs of the persistent partitions hosted here, in one LMDB environment, so
        # a driver turn writing into many partitions pays one fsync (raftkv.storage.lmdb_log).
        self._logs = (LogEnv(partition_logs_path(data_dir), durable=durable, shared=True)
                      if data_dir is not None else None)
        self.retry = retry or RetryPolicy()
        self.watch_timeout = watch_timeout
        self.admin_timeout = admin_timeout
        self.metrics: Counter[str] = Counter()
        self.errors: list[dict[str, Any]] = []
        self._timer = TickTimer(self.node.clock)
        self._kv: dict[bytes, VersionedValue] = {}
        self._tables: dict[str, TableDescriptor] = {}
        self._parts: dict[str, _Partition] = {}
        self._hosted: set[str] = set()
        self._routes: dict[str, Route] = {}
        self._dirty: set[str] = set()
        self._drain_queued = False
        self._revision = 0
        self._synced = False
        self._stopped = False
        self._loop_ident: int | None = None
        self._backoffs = {"watch": Backoff(self.retry), "address": Backoff(self.retry),
                          "incarnation": Backoff(self.retry)}
        self.incarnation = b"%016x" % self.node.runtime.random().getrandbits(64)
        self._incarnation_rev = 0  # the revision our incarnation key was written at

    # ================================================================ lifecycle =========
    def start(self) -> None:
        def install() -> None:
            self._loop_ident = threading.get_ident()
            self.node.groups[self.meta.group].on_tick.append(self._timer.on_tick)
            self._register_address()
            self._register_incarnation()

        self._defer(install)

    def stop(self) -> None:
        """Stop reacting (the node and its groups keep running; stopping them is the
        node owner's call). The partitions' log environment closes with the last of
        their stores."""
        if not self._stopped and self._logs is not None:
            self._logs.close()
        self._stopped = True

    # ======================================================== admin (any thread) ========
    def set_nodes(self, nodes: Iterable[str]) -> int:
        """Write the logical topology; returns the revision of the write (the trigger's
        ``event.revision``)."""
        ids = sorted({check_node_id(n) for n in nodes})
        if not ids:
            raise ValueError("the logical topology needs at least one node")
        self._not_on_loop()
        return int(self.meta.put(TOPOLOGY_KEY, encode_nodes(ids)).result(self.admin_timeout)
                   .revision)

    def create_table(self, name: str, partitions: int, replicas: int,
                     storage: str = PERSISTENT) -> TableDescriptor:
        """Write the descriptor and each partition's initial stable assignment in one
        invoke, guarded by the topology's revision (retried if the topology moves)."""
        check_table_name(name)
        self._not_on_loop()
        key = table_key(name)
        for _ in range(_ADMIN_ATTEMPTS):
            topo = self.meta.get(TOPOLOGY_KEY).result(self.admin_timeout)
            nodes = decode_nodes(topo.value) if topo is not None else []
            desc = TableDescriptor.new(name, partitions, replicas, storage, nodes)
            res = self.meta.invoke(*create_table_invoke(desc, topo)).result(self.admin_timeout)
            assert isinstance(res, InvokeResult)
            if res.succeeded:
                return desc
            if self.meta.get(key).result(self.admin_timeout) is not None:
                raise TableExists(name)
        raise RuntimeError(f"the topology kept changing while creating table {name!r}")

    def set_replicas(self, name: str, replicas: int) -> int:
        """Change a table's replica count (the seed's trigger); returns the revision."""
        self._not_on_loop()
        key = table_key(name)
        for _ in range(_ADMIN_ATTEMPTS):
            cur = self.meta.get(key).result(self.admin_timeout)
            if cur is None:
                raise UnknownTable(name)
            res = self.meta.invoke(*set_replicas_invoke(key, cur, replicas)).result(
                self.admin_timeout)
            assert isinstance(res, InvokeResult)
            if res.succeeded:
                return res.revision
        raise RuntimeError(f"table {name!r} kept changing while setting its replicas")

    def drop_table(self, name: str) -> int:
        """Drop a table; returns the revision of the drop. One invoke, guarded by the
        descriptor's revision, removes the descriptor, every partition's assignment keys
        and the table's holds keys. Every node sees it in its watch (or its next full
        read), stops the table's partition groups (their pending requests fail with
        ``NodeStopped``) and deletes their files, so a table re-created under the same
        name starts empty. ``UnknownTable`` if there is no such table."""
        check_table_name(name)
        self._not_on_loop()
        key = table_key(name)
        for _ in range(_ADMIN_ATTEMPTS):
            cur = self.meta.get(key).result(self.admin_timeout)
            if cur is None:
                raise UnknownTable(name)
            parts = TableDescriptor.decode(cur.value).partitions
            holds = self.meta.range(HOLDS_PREFIX + name.encode() + b".").result(
                self.admin_timeout)
            ops = [Op.remove(key)]
            for p in range(parts):
                ops += [Op.remove(k) for k in partition_keys(name, p)]
                ops += [Op.remove(k) for k in steps.switch_keys(name, p)]
            ops += [Op.remove(k) for k, _ in holds.items]
            res = self.meta.invoke([Cond.revision(key).eq(cur.mod_revision)], ops).result(
                self.admin_timeout)
            assert isinstance(res, InvokeResult)
            if res.succeeded:
                return res.revision
        raise RuntimeError(f"table {name!r} kept changing while dropping it")

    def change_peers(self, group: str, term: int, peers: Iterable[str]) -> Future[None]:
        """Move ``group``'s configuration to ``peers`` (see the module docstring). Runs on
        its leader in ``term`` only, else fails with ``StaleTerm``. Resolves once the
        voters equal ``peers``. The pending listener calls this with pending; a target
        other than pending is replaced the next time pending changes."""
        out: Future[None] = Future()
        target = frozenset(check_node_id(p) for p in peers)
        if not target:
            raise ValueError("a configuration needs at least one voter")

        def run() -> None:
            part = self._parts.get(group)
            g = self.node.groups.get(group) if group in self._hosted else None
            if part is None or g is None:
                raise UnknownGroup(f"{self.id} hosts no partition group {group!r}")
            self._check_term(g, term)
            self._begin_change(part, term, target, "api").waiters.append(out)
            self._advance(part, g)

        def failed(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None and not out.done():
                out.set_exception(exc)

        self.node.call(run).add_done_callback(failed)
        return out

    # ======================================================= queries (any thread) ======
    def route(self, table: str, key: bytes) -> Route:
        """The partition holding ``key`` and its stable nodes (and leader hint)."""
        desc = self._tables.get(table)
        if desc is None:
            raise UnknownTable(table)
        p = partition_of(key, desc.partitions)
        r = self._routes.get(partition_group(table, p))
        return r if r is not None else Route(partition_group(table, p), table, p, (), None)

    def routes(self, timeout: float = 5.0) -> dict[str, Route]:
        """The routing table: partition group -> stable nodes and leader hint."""
        self._not_on_loop()
        result: dict[str, Route] = self.node.call(lambda: dict(self._routes)).result(timeout)
        return result

    def table(self, name: str) -> TableDescriptor | None:
        return self._tables.get(name)

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        self._not_on_loop()
        result: dict[str, Any] = self.node.call(self._status).result(timeout)
        return result

    # ================================================= loop thread: plumbing ============
    def _not_on_loop(self) -> None:
        if self._loop_ident is not None and threading.get_ident() == self._loop_ident:
            raise RuntimeError("a blocking PlacementManager call on the node's loop thread")

    def _defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread in a call of its own: never inside the driver's
        iteration over its groups (hooks), so it may add and remove groups."""
        self.node.call(lambda: self._guard(fn))

    def _guard(self, fn: Callable[[], None]) -> None:
        if self._stopped:
            return
        try:
            fn()
        except Exception as e:  # a bug must not go unseen, nor kill the loop
            log.exception("node %s: placement manager error", self.id)
            self.metrics["internal_errors"] += 1
            self._record("-", "internal", e, 0)

    def _on_loop(self, fut: Future[Any], fn: Callable[[Future[Any]], None]) -> None:
        fut.add_done_callback(lambda f: self._defer(lambda: fn(f)))

    def _kick(self, group: str) -> None:
        """Reconcile ``group`` soon (coalesced; safe from hooks)."""
        self._dirty.add(group)
        if not self._drain_queued:
            self._drain_queued = True
            self._defer(self._drain)

    def _drain(self) -> None:
        self._drain_queued = False
        dirty, self._dirty = self._dirty, set()
        for gid in sorted(dirty):
            self._guard(partial(self._reconcile_group, gid))

    def _backoff(self, part: _Partition, kind: str) -> Backoff:
        bo = part.backoffs.get(kind)
        if bo is None:
            bo = part.backoffs[kind] = Backoff(self.retry)
        return bo

    def _failed(self, part: _Partition, kind: str, exc: BaseException) -> None:
        """onReconfigurationError: back off and retry, or record exhaustion."""
        bo = self._backoff(part, kind)
        delay = bo.failed(exc, self.node.clock())
        self.metrics[f"errors.{kind}"] += 1
        if delay is None:
            self.metrics["retries_exhausted"] += 1
            self._record(part.group, kind, exc, bo.failures)
            log.error("node %s: %s of %s failed %d times, giving up until the leader or the "
                      "target changes: %s", self.id, kind, part.group, bo.failures, exc)
        else:
            self.metrics["retries"] += 1
            log.info("node %s: %s of %s failed (%s); retry in %.2fs",
                     self.id, kind, part.group, exc, delay)
            self._timer.after(delay, lambda: self._kick(part.group))

    def _record(self, group: str, kind: str, exc: BaseException, attempts: int) -> None:
        self.errors.append({"partition": group, "kind": kind, "attempts": attempts,
                            "error": f"{type(exc).__name__}: {exc}", "at": time.time()})
        del self.errors[:-100]

    # ================================================ loop thread: metastore view =======
    def _register_address(self) -> None:
        key, addr = address_key(self.id), self.node.cfg.raft_addr.encode()
        bo = self._backoffs["address"]
        bo.ready("address", self.node.clock())

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                bo.succeeded()
            elif not isinstance(exc, NodeStopped):
                delay = bo.failed(exc, self.node.clock())
                if delay is not None:
                    self._timer.after(delay, lambda: self._defer(self._register_address))

        self._on_loop(self.meta.invoke([Cond.value(key).eq(addr)], [], [Op.put(key, addr)]),
                      done)

    def _register_incarnation(self) -> None:
        """IGNITE-16668: a fresh random id per start, written before anything is hosted
        (every holds key of an earlier incarnation is void from now on), then the first
        read of the metastore."""
        bo = self._backoffs["incarnation"]
        bo.ready("incarnation", self.node.clock())

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                bo.succeeded()
                self._incarnation_rev = int(f.result().revision)
                self._resync()
            elif not isinstance(exc, NodeStopped):
                delay = bo.failed(exc, self.node.clock())
                if delay is None:
                    bo.succeeded()
                    delay = self.retry.cap
                self._timer.after(delay, lambda: self._defer(self._register_incarnation))

        self._on_loop(self.meta.put(incarnation_key(self.id), self.incarnation), done)

    def _resync(self) -> None:
        """Read every key, rebuild the cache, reconcile everything, then watch."""
        self._on_loop(self.meta.range(b""), self._on_range)

    def _on_range(self, f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            self._watch_failed(exc, self._resync)
            return
        result: RangeResult = f.result()
        self._backoffs["watch"].succeeded()
        self._kv = {k: v for k, v in result.items if _tracked(k)}
        old, self._tables = self._tables, {}
        for k, v in self._kv.items():
            if k.startswith(TABLES_PREFIX):
                self._learn_table(k, v.value)
        for name in set(old) - set(self._tables):  # dropped while we were not watching
            self._forget_table(name)
        self._revision = result.revision
        self._sweep_orphan_files()
        self._synced = True
        for part in self._parts.values():
            part.cleanup_rev = -1  # step (3) looks again after a full read
            self._kick(part.group)
        self._watch(result.revision + 1)

    def _watch(self, from_revision: int) -> None:
        self._on_loop(self.meta.watch(b"", from_revision, self.watch_timeout),
                      lambda f: self._on_watch(f, from_revision))

    def _watch_failed(self, exc: BaseException, again: Callable[[], None]) -> None:
        if isinstance(exc, NodeStopped):
            return
        bo = self._backoffs["watch"]
        bo.ready("watch", self.node.clock())
        delay = bo.failed(exc, self.node.clock())
        self.metrics["errors.watch"] += 1
        if delay is None:  # never give up on the metastore: keep polling at the cap
            bo.succeeded()
            delay = self.retry.cap
        self._timer.after(delay, lambda: self._defer(again))

    def _on_watch(self, f: Future[Any], from_revision: int) -> None:
        exc = f.exception()
        if isinstance(exc, HistoryCompacted):
            self._resync()
            return
        if exc is not None:
            self._watch_failed(exc, lambda: self._watch(from_revision))
            return
        batch: EventBatch = f.result()
        self._backoffs["watch"].succeeded()
        for ev in batch.events:
            self._apply_event(ev.revision, ev.key, ev.value)
        self._revision = max(self._revision, batch.next_revision - 1)
        self._watch(max(batch.next_revision, from_revision))

    def _apply_event(self, revision: int, key: bytes, value: bytes | None) -> None:
        if not _tracked(key):
            return
        if value is None:
            self._kv.pop(key, None)
        else:
            old = self._kv.get(key)
            self._kv[key] = VersionedValue(value, revision, old.create_revision if old else revision)
        if key.startswith(TABLES_PREFIX):
            if value is not None:
                self._learn_table(key, value)
            else:
                self._forget_table(key[len(TABLES_PREFIX):].decode(errors="replace"))
        elif key.startswith((HOLDS_PREFIX, INCARNATION_PREFIX)):
            for gid, part in self._parts.items():
                if part.rejoin:
                    self._kick(gid)
        elif key == TOPOLOGY_KEY:
            for gid in self._parts:
                self._kick(gid)
        elif not key.startswith(ADDRESS_PREFIX):
            pk = parse_partition_key(key)
            if pk is not None:
                self._kick(partition_group(pk.table, pk.partition))

    def _learn_table(self, key: bytes, raw: bytes) -> None:
        try:
            desc = TableDescriptor.decode(raw)
        except ValueError as e:
            log.warning("node %s: ignoring %r: %s", self.id, key, e)
            return
        dkv = self._kv.get(key)
        gen = dkv.create_revision if dkv is not None else 0
        if any(p.table == desc.name and p.gen != gen for p in self._parts.values()):
            self._forget_table(desc.name)  # dropped and re-created while we did not watch
        self._tables[desc.name] = desc
        # Created before this incarnation registered: we may have held (and lost) its state.
        preexisting = dkv is not None and dkv.create_revision < self._incarnation_rev
        for p in range(desc.partitions):
            gid = partition_group(desc.name, p)
            if gid not in self._parts:
                self._parts[gid] = _Partition(desc.name, p, gid, partition_keys(desc.name, p),
                                              sw=steps.switch_keys(desc.name, p),
                                              preexisting=preexisting, gen=gen)
            self._kick(gid)

    # ============================================= loop thread: dropping a table ========
    def _forget_table(self, name: str) -> None:
        """The table's descriptor is gone: stop its partitions, delete their files, and
        forget them (a table re-created under this name is a new one)."""
        self._tables.pop(name, None)
        for part in [p for p in self._parts.values() if p.table == name]:
            self._parts.pop(part.group, None)
            self._routes.pop(part.group, None)
            self._dirty.discard(part.group)
            self._abort_change(part, TableDropped(f"table {name} was dropped"))
            if part.group in self._hosted:
                self._hosted.discard(part.group)
                self.node.remove_group(part.group)  # its pending requests fail: NodeStopped
                self.metrics["partitions_dropped"] += 1
            self._delete_files(part.group)
        log.info("node %s: table %s dropped", self.id, name)

    def _group_dir(self, gid: str) -> str | None:
        if self.data_dir is None:
            return None
        return os.path.dirname(group_paths(self.data_dir, gid)[0])

    def _delete_files(self, gid: str) -> None:
        """Delete a partition's log, then its directory: a crash in between leaves a
        state store without a log, which the restart self-check (``_has_log``) takes for
        wiped storage. The other order would leave a log without its state store."""
        base = self._group_dir(gid)
        if self._logs is None or base is None:
            return
        try:
            if self._logs.has(gid):
                self._logs.drop(gid)
            if os.path.exists(base):
                shutil.rmtree(base)
        except (OSError, StorageError) as e:
            log.error("node %s: cannot delete %s's files: %s", self.id, gid, e)
            self._record(gid, "drop", e, 1)

    def _sweep_orphan_files(self) -> None:
        """Delete the partition directories of tables that no longer exist (dropped while
        this node was down). Only ``t.<table>.<p>`` directories are touched."""
        if self.data_dir is None or self._logs is None:
            return
        root = os.path.join(self.data_dir, "groups")
        try:
            names = set(os.listdir(root)) | self._logs.groups()
        except (OSError, StorageError):
            return
        for gid in sorted(names):
            if gid.startswith("t.") and gid not in self._parts and gid not in self._hosted:
                log.info("node %s: deleting %s (its table no longer exists)", self.id, gid)
                self._delete_files(gid)

    def _clear_stale_files(self, part: _Partition) -> None:
        """Files of an earlier table of the same name (dropped and re-created while this
        node was down) are not this table's: delete them before the storage self-check."""
        base = self._group_dir(part.group)
        if base is None:
            return
        try:
            with open(os.path.join(base, _GEN_FILE)) as f:
                gen = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return  # no marker: no files, or files written before markers existed
        if gen != part.gen:
            log.info("node %s: %s holds files of an earlier table %s (generation %d, now "
                     "%d): deleting them", self.id, part.group, part.table, gen, part.gen)
            self._delete_files(part.group)

    def _write_gen(self, part: _Partition) -> None:
        base = self._group_dir(part.group)
        if base is None:
            return
        os.makedirs(base, exist_ok=True)
        path = os.path.join(base, _GEN_FILE)
        with open(path + ".tmp", "w") as f:
            f.write(f"{part.gen}\n")
        os.replace(path + ".tmp", path)

    def _current(self, part: _Partition) -> bool:
        """``part`` is still the manager's partition (its table was not dropped since)."""
        return self._parts.get(part.group) is part

    def _if_table(self, part: _Partition, tree: If | Do) -> If:
        """Run ``tree`` only while the table exists (else tag ``_DROPPED``): a node that
        has not seen a drop yet must not write the dropped table's keys back."""
        return If(Cond.exists(table_key(part.table)), tree, Do(_DROPPED))

    def _nodes(self, key: bytes) -> list[str]:
        v = self._kv.get(key)
        return decode_nodes(v.value) if v is not None else []

    # ==================================================== loop thread: reconcile ========
    def _reconcile_group(self, gid: str) -> None:
        part = self._parts.get(gid)
        if part is not None:
            self._reconcile(part)

    def _reconcile(self, part: _Partition) -> None:
        desc = self._tables.get(part.table)
        if desc is None or not self._synced:
            return
        keys = part.keys
        stable, pending = self._nodes(keys.stable), self._nodes(keys.pending)
        self._maybe_plan(part, desc)
        wanted = self.id in stable or self.id in pending
        hosted = part.group in self._hosted
        if (not wanted and not hosted and pending and self._held_before(part)
                and not self._in_memory(desc) and self._has_log(part)):
            # We hosted it before this start and a change is under way: we may be a
            # voter the change still counts on (promoted, then dropped from pending by
            # a cancel; chaos seed 13). Rejoin with our log; the leader removes us if
            # the target excludes us, and step (3) stops the group once stable moves.
            wanted = True
        elif (not wanted and not hosted and pending and self._held_before(part)
              and (self._in_memory(desc) or not self._has_log(part))):
            # Bug C's in-memory case: the same position, but our state is gone, so we
            # cannot be the voter the change counts on. Record the loss in switch.reduce
            # (not started): the leader removes us, or, if the configuration is just us
            # and one holder, that holder continues alone ("The lone holder of a
            # two-voter configuration").
            self._declare_lost(part)
        stable_rev = self._kv[keys.stable].mod_revision if keys.stable in self._kv else 0
        if wanted and not hosted:
            self._on_partition_start(part, desc, stable, pending)
        elif hosted and not wanted and part.cleanup_rev != stable_rev:
            if pending and self.id in self.node.groups[part.group].raft.conf.voters:
                # Step (3) waits while a change is under way and we are a voter of the
                # configuration we know: a cancel dropped us from pending after our
                # promotion, and the configuration may need us for a quorum until the
                # leader removes us (placement simulator seed 6: {us, leader} left
                # alone). Once pending is empty, stable is the applied configuration.
                stable_rev = part.cleanup_rev
            else:
                self._stop_partition(part)  # step (3): on stable updates only
        part.cleanup_rev = stable_rev
        g = self.node.groups.get(part.group) if part.group in self._hosted else None
        self._routes[part.group] = Route(part.group, part.table, part.index, tuple(stable),
                                         g.leader if g is not None else None)
        if g is None or g.raft.role != Role.LEADER:
            if part.change is not None:
                self._abort_change(part, StaleTerm(f"{self.id} no longer leads {part.group}"))
            if g is not None:
                self._maybe_survive(part, g)
            return
        self._lead(part, g, pending)

    def _maybe_plan(self, part: _Partition, desc: TableDescriptor) -> None:
        """Step (1) for one partition, if a trigger newer than its trigger revision exists."""
        topo, dkv = self._kv.get(TOPOLOGY_KEY), self._kv.get(table_key(desc.name))
        if topo is None or dkv is None or part.plan_inflight:
            return
        nodes = decode_nodes(topo.value)
        source = max(topo.mod_revision, dkv.mod_revision)
        trig = self._kv.get(part.keys.trigger)
        seen = decode_revision(trig.value) if trig is not None and trig.value else 0
        if not nodes or seen >= source or part.plan_done >= source:
            return
        stable = self._kv.get(part.keys.stable)
        if (trig is None and source == dkv.mod_revision == dkv.create_revision
                and stable is not None and stable.mod_revision == source
                and not self._nodes(part.keys.pending)):
            # create_table placed it at `source` from this very topology: step (1) would
            # only record the trigger (ALREADY_PLACED). Nothing older can race it: no node
            # knows the table before `source`.
            return
        bo = self._backoff(part, "plan")
        if not bo.ready(source, self.node.clock()):
            return
        calc = encode_nodes(calc_assignments(desc.name, part.index, nodes, desc.replicas))
        part.plan_inflight = True

        def done(f: Future[Any]) -> None:
            part.plan_inflight = False
            exc = f.exception()
            if exc is not None:
                self._failed(part, "plan", exc)
                return
            bo.succeeded()
            part.plan_done = max(part.plan_done, source)
            res = f.result()
            if isinstance(res, BranchResult):
                self.metrics[{PENDING_WRITTEN: "plan.pending_written",
                              PLANNED_WRITTEN: "plan.planned_written"}.get(
                                  res.tag, "plan.other")] += 1

        self._on_loop(self.meta.iif(self._if_table(
            part, steps.plan_rebalance(part.keys, source, calc))), done)

    # ============================================ loop thread: IGNITE-16668 restart ====
    def _in_memory(self, desc: TableDescriptor) -> bool:
        return desc.storage == MEMORY or self.data_dir is None

    def _has_log(self, part: _Partition) -> bool:
        """The local storage self-check: does the partition have a log here (in the
        shared environment, or still in a directory of its own from before)?"""
        return self._logs is not None and (
            self._logs.has(part.group)
            or os.path.isdir(group_paths(self.data_dir or "", part.group)[0]))

    def _holds(self, part: _Partition, node: str,
               kv: dict[bytes, VersionedValue] | None = None) -> bool:
        """``node`` started hosting the partition in its current incarnation (in ``kv``,
        by default the cache)."""
        kv = self._kv if kv is None else kv
        h = kv.get(holds_key(part.table, part.index, node))
        inc = kv.get(incarnation_key(node))
        return (h is not None and inc is not None and bool(h.value)
                and h.value.split(b"/")[0] == inc.value)

    def _alive(self, node: str) -> bool:
        if node == self.id:
            return True
        peer = self.node.transport.peers.get(node)
        if peer is not None and peer.conn is not None:
            return True
        # Not connected (connections are made on demand): probe with an item the peer
        # ignores (a reply to no request) so the transport dials; ask again later.
        self.node.transport.send(node, codec.encode_reply(0, False, []))
        return False

    def _majority_available(self, part: _Partition, stable: list[str],
                            reduce: list[str]) -> bool:
        """A majority of stable is alive, holds its state, and is not being switched out;
        or stable is two nodes and the other one is such a holder: it can continue alone
        ("The lone holder of a two-voter configuration")."""
        holders = [n for n in stable if n != self.id and n not in reduce
                   and self._holds(part, n) and self._alive(n)]
        if len(stable) == 2 and self.id in stable and len(holders) == 1:
            return True
        return len(holders) >= len(stable) // 2 + 1

    def _restart_epoch(self, part: _Partition, kv: dict[bytes, VersionedValue]) -> bytes | None:
        """The full-partition restart we may take part in, or None. Nobody holds the
        state (every holds key is of an earlier incarnation): a new one, named by our
        incarnation. Every holder holds it from one full restart E (holds value
        ``<incarnation>/E``) and our own (void) holds key is not of E: join E, as a late
        founder of that fresh history (we never voted in it). Anything else: None."""
        prefix = holds_prefix(part.table, part.index)
        epochs = set()
        for k, v in kv.items():
            if k.startswith(prefix) and v.value:
                inc = kv.get(INCARNATION_PREFIX + k[len(prefix):])
                inc_id, _, epoch = v.value.partition(b"/")
                if inc is not None and inc.value == inc_id:
                    if not epoch:
                        return None  # a holder of the history before any full restart
                    epochs.add(epoch)
        if not epochs:
            return self.incarnation
        if len(epochs) > 1:
            return None
        (epoch,) = epochs
        mine = kv.get(holds_key(part.table, part.index, self.id))
        if mine is not None and mine.value.partition(b"/")[2] == epoch:
            return None  # we took part in E and lost our state (and vote) since
        return epoch

    def _on_partition_start(self, part: _Partition, desc: TableDescriptor,
                            stable: list[str], pending: list[str]) -> None:
        """The seed's onPartitionStart (see the module docstring)."""
        if part.start_inflight or part.reduce_inflight:
            return
        if part.rejoin is None:
            self._clear_stale_files(part)
            lost = self._in_memory(desc) or not self._has_log(part)
            part.rejoin = part.preexisting and self.id in stable and lost
            if (not part.rejoin and part.preexisting and lost and self.id in pending
                    and len(set(pending) - {self.id}) > 0 and self._held_before(part)):
                # A member of pending only (learner, or promoted voter) that lost its
                # state: the same rule as for stable; leave pending, be re-added fresh.
                part.rejoin = part.leave_pending = True
            if part.rejoin:
                self.metrics["restarts_detected"] += 1
                log.info("node %s: %s lost its state (%s): safe restart", self.id, part.group,
                         "in-memory" if self._in_memory(desc) else "no local log")
        if not part.rejoin:
            founders = desc.initial[part.index]
            fresh = not part.preexisting or (not self._in_memory(desc) and self._has_log(part))
            self._start_with_holds(part, desc, list(founders)
                                   if self.id in founders and fresh else None)
            return
        reduce = self._nodes(part.sw.reduce)
        if self.id not in stable:
            if part.leave_pending:
                self._leave_pending(part)
                return
            if self.id in reduce or self._revision < part.left_at:
                # stable without us is written together with reduce (or our own
                # leave-pending invoke has not reached our cache yet)
                self._wait(part)
                return
            # Removed from the configuration (stable excludes us only once a configuration
            # without us applied), and now in pending: come back as a fresh learner.
            part.rejoin = False
            self.metrics["partitions_rejoined"] += 1
            log.info("node %s: %s re-added after its removal: joining empty", self.id,
                     part.group)
            self._start_with_holds(part, desc, None)
            return
        majority = self._majority_available(part, stable, reduce)
        if not majority and self._restart_epoch(part, self._kv) is not None:
            self._full_restart(part, desc)
        elif self.id in reduce or part.reduce_added:
            self._wait(part)  # the leader removes us
        elif majority:
            self._add_to_switch_reduce(part)
        else:
            self._wait(part)  # neither: retry later

    def _held_before(self, part: _Partition) -> bool:
        """Our holds key names an earlier incarnation: we hosted the partition before
        this start and never stopped hosting it (a stop removes the key)."""
        h = self._kv.get(holds_key(part.table, part.index, self.id))
        return (h is not None and bool(h.value)
                and h.value.split(b"/")[0] != self.incarnation)

    def _leave_pending(self, part: _Partition) -> None:
        """``rebalance_steps.leave_pending_for_switch_reduce``, retried while the keys
        move; then wait (not started) until the leader has removed us and re-adds us."""
        part.reduce_inflight = True

        def attempt() -> None:
            self._on_loop(self.meta.get_many([part.keys.pending, part.sw.reduce]), read)

        def read(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            pending, reduce = f.result()
            if pending is None or self.id not in decode_nodes(pending.value) or len(
                    set(decode_nodes(pending.value)) - {self.id}) == 0:
                done_leaving(0)  # no longer in pending (or alone in it): nothing to leave
                return
            tree = steps.leave_pending_for_switch_reduce(part.keys, part.sw, [self.id],
                                                         pending, reduce)
            self._on_loop(self.meta.iif(self._if_table(part, tree)), result)

        def result(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            res = f.result()
            if res.tag == _DROPPED or not self._current(part):
                part.reduce_inflight = False
                return
            if res.tag != 1:
                self.metrics["switch_reduce_retries"] += 1
                attempt()
                return
            self.metrics["pending_left"] += 1
            log.info("node %s: %s lost its state while only in pending: left pending, "
                     "recorded in switch.reduce", self.id, part.group)
            done_leaving(res.revision)

        def done_leaving(revision: int) -> None:
            part.reduce_inflight = False
            part.leave_pending = False
            part.left_at = revision
            self._backoff(part, "reduce").succeeded()
            self._kick(part.group)

        def fail(exc: BaseException | None) -> None:
            part.reduce_inflight = False
            self._failed(part, "reduce", exc or RuntimeError("?"))

        attempt()

    def _wait(self, part: _Partition) -> None:
        if part.wait_scheduled:
            return
        part.wait_scheduled = True

        def again() -> None:
            part.wait_scheduled = False
            self._kick(part.group)

        self._timer.after(max(0.1, self.node.cfg.election_tick * self.node.cfg.tick_seconds),
                          again)

    def _add_to_switch_reduce(self, part: _Partition) -> None:
        """The seed's retry loop: switch.reduce ∪= {us}, guarded by its revision."""
        part.reduce_inflight = True

        def attempt() -> None:
            self._on_loop(self.meta.get(part.sw.reduce), read)

        def read(f: Future[Any]) -> None:
            if f.exception() is not None:
                fail(f.exception())
                return
            tree = steps.add_to_switch_reduce(part.sw, self.id, f.result())
            self._on_loop(self.meta.iif(self._if_table(part, tree)), result)

        def result(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            if f.result().tag == _DROPPED or not self._current(part):
                part.reduce_inflight = False
                return
            if f.result().tag != 1:
                self.metrics["switch_reduce_retries"] += 1
                attempt()  # switch.reduce moved since our read
                return
            part.reduce_inflight = False
            part.reduce_added = True
            self._backoff(part, "reduce").succeeded()
            self.metrics["switch_reduce_added"] += 1
            log.info("node %s: %s recorded in switch.reduce; not starting it", self.id,
                     part.group)
            self._kick(part.group)

        def fail(exc: BaseException | None) -> None:
            part.reduce_inflight = False
            self._failed(part, "reduce", exc or RuntimeError("?"))

        attempt()

    def _declare_lost(self, part: _Partition) -> None:
        """Bug C's in-memory case (``_reconcile``): record our loss in switch.reduce once
        per incarnation, and take the restart path from then on, so that when pending
        names us again we join as a fresh learner (never leave pending as a lost
        pending-only member)."""
        if part.declared or part.reduce_inflight or self.id in self._nodes(part.sw.reduce):
            return
        part.declared = True
        part.rejoin = True
        part.reduce_added = False
        self.metrics["restarts_detected"] += 1
        log.info("node %s: %s lost its state while the configuration may count on it "
                 "(hosted before this start, in neither stable nor pending)", self.id,
                 part.group)
        self._add_to_switch_reduce(part)

    # ======================= loop thread: the lone holder of a two-voter configuration ==
    def _survivor_case(self, part: _Partition, lost: str,
                       kv: dict[bytes, VersionedValue]) -> bool:
        """The metastore side of the rule (module docstring): ``lost`` declared the loss
        of its state and does not hold it, we hold ours and nobody asked to remove us."""
        def nodes(key: bytes) -> list[str]:
            v = kv.get(key)
            return decode_nodes(v.value) if v is not None else []

        reduce, stable, pending = (nodes(part.sw.reduce), nodes(part.keys.stable),
                                   nodes(part.keys.pending))
        return (lost in reduce and self.id not in reduce and self.id in stable
                and (not pending or self.id in pending)
                and not self._holds(part, lost, kv) and self._holds(part, self.id, kv))

    def _maybe_survive(self, part: _Partition, g: Group) -> None:
        """Not the leader of a two-voter configuration {us, lost} whose other voter
        declared the loss of its state: confirm on a linearizable read, then run a
        survivor election (``Raft.campaign_without``), at most once per two election
        timeouts."""
        voters = g.raft.conf.voters
        if part.survive_inflight or len(voters) != 2 or self.id not in voters:
            return
        (lost,) = voters - {self.id}
        if not self._survivor_case(part, lost, self._kv):
            return
        if self.node.clock() < part.survive_after:
            self._wait(part)
            return
        part.survive_inflight = True
        keys = [part.sw.reduce, part.keys.stable, part.keys.pending,
                holds_key(part.table, part.index, lost), incarnation_key(lost),
                holds_key(part.table, part.index, self.id), incarnation_key(self.id)]

        def read(f: Future[Any]) -> None:
            part.survive_inflight = False
            exc = f.exception()
            if exc is not None:
                self._failed(part, "survive", exc)
                return
            kv = {k: v for k, v in zip(keys, f.result(), strict=True) if v is not None}
            now_g = self.node.groups.get(part.group) if part.group in self._hosted else None
            if (not self._current(part) or now_g is not g or g.raft.role == Role.LEADER
                    or g.raft.conf.voters != voters or not self._survivor_case(part, lost, kv)):
                self._kick(part.group)
                return
            part.survive_after = self.node.clock() + 2 * self.node.cfg.election_tick * \
                self.node.cfg.tick_seconds
            try:
                g.raft.campaign_without(lost)
            except CampaignRejected as e:
                self.metrics["survivor_refused"] += 1
                if str(e) != part.survive_refused:  # once per reason, not every retry
                    part.survive_refused = str(e)
                    log.info("node %s: %s survivor election refused: %s", self.id,
                             part.group, e)
                self._wait(part)
                return
            part.survive_refused = ""
            self.metrics["survivor_elections"] += 1
            log.info("node %s: %s: %s lost its state; the lone holder campaigns without it",
                     self.id, part.group, lost)
            self._wait(part)  # look again if it did not win

        self._on_loop(self.meta.get_many(keys), read)

    def _full_restart(self, part: _Partition, desc: TableDescriptor) -> None:
        """Nobody holds the partition's state: bootstrap the stable configuration fresh.
        Decided on a linearizable read, and our holds key is written guarded by the
        revision of every known node's holds key, so no node can have started holding
        the state in between (each one writes its holds key before it starts)."""
        part.start_inflight = True

        def read(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            kv = {k: v for k, v in f.result().items}
            st = self._kv.get(part.keys.stable)
            epoch = self._restart_epoch(part, kv)
            if epoch is None or st is None:
                part.start_inflight = False
                self._kick(part.group)
                return
            nodes = [k[len(INCARNATION_PREFIX):].decode() for k in kv
                     if k.startswith(INCARNATION_PREFIX)]
            conds = [Cond.revision(part.keys.stable).eq(st.mod_revision),
                     Cond.value(incarnation_key(self.id)).eq(self.incarnation),
                     Cond.exists(table_key(part.table))]
            for n in nodes:
                hk = holds_key(part.table, part.index, n)
                conds.append(Cond.revision(hk).eq(kv[hk].mod_revision if hk in kv else 0))
            voters = decode_nodes(st.value)
            ops = [Op.put(holds_key(part.table, part.index, self.id),
                          self.incarnation + b"/" + epoch)]
            self._on_loop(self.meta.invoke(conds, ops), lambda r: written(r, voters))

        def written(f: Future[Any], voters: list[str]) -> None:
            part.start_inflight = False
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            if not f.result().succeeded or not self._current(part):
                self._kick(part.group)  # something moved: decide again
                return
            part.rejoin = False
            self.metrics["full_restarts"] += 1
            log.info("node %s: %s full-partition restart: bootstrapping %s", self.id,
                     part.group, voters)
            self._start_partition(part, desc, voters)

        def fail(exc: BaseException) -> None:
            part.start_inflight = False
            self._failed(part, "start", exc)

        self._on_loop(self.meta.range(b"placement."), read)

    def _start_with_holds(self, part: _Partition, desc: TableDescriptor,
                          voters: list[str] | None) -> None:
        """Write our holds key (this incarnation), then start the group.

        Started as a member of stable or pending, or (``_reconcile``'s rule for a node
        that hosted the partition before this start) not named by either while pending
        is non-empty: that is checked again once the key is written. Writing the key
        voids the rule's own test (the key no longer names an earlier incarnation), so
        the check after it must not require a name: it did, and the node that the
        configuration counted on never started (chaos seed 25: a voter that a cancel had
        dropped from pending, needed to commit the removal under way)."""
        part.start_inflight = True
        key = holds_key(part.table, part.index, self.id)
        named = self.id in self._nodes(part.keys.stable) or self.id in self._nodes(
            part.keys.pending)

        def done(f: Future[Any]) -> None:
            part.start_inflight = False
            if not self._current(part):
                return  # the table was dropped meanwhile
            exc = f.exception()
            if exc is not None:
                self._failed(part, "start", exc)
                return
            if isinstance(f.result(), InvokeResult) and not f.result().succeeded:
                return  # the table is gone (the drop's event is on its way)
            stable, pending = self._nodes(part.keys.stable), self._nodes(part.keys.pending)
            still = self.id in stable or self.id in pending or (not named and bool(pending))
            if part.group not in self._hosted and still:
                self._start_partition(part, desc, voters)
            self._kick(part.group)

        if self._kv.get(key, _EMPTY).value == self.incarnation:
            done_f: Future[Any] = Future()
            done_f.set_result(None)
            done(done_f)
            return
        self._on_loop(self.meta.invoke([Cond.exists(table_key(part.table))],
                                       [Op.put(key, self.incarnation)]), done)

    def _start_partition(self, part: _Partition, desc: TableDescriptor,
                         voters: list[str] | None) -> None:
        bo = self._backoff(part, "start")
        if not self._current(part) or not bo.ready("start", self.node.clock()):
            return
        try:
            if desc.storage == PERSISTENT:
                self._write_gen(part)
            persistent = desc.storage == PERSISTENT
            storage = open_group_storage(
                self.data_dir if persistent else None, part.group, self.durable,
                shared_log=self._logs if persistent else None,
                checkpoint_seconds=self.checkpoint_seconds)
            # Placement bootstraps a partition only at its birth by the metastore's own
            # record (a new table, or IGNITE-16668's full restart: no node holds the
            # state); a replica that lost its state joins empty instead. So the core's
            # newborn vote rule, which would wait for every founder, does not apply.
            # The removal of a leader that stepped down for its change is made by the
            # next leader's own changePeers step, towards the pending it reads then
            # (Config.auto_handover): not the core's handover, which would remove it
            # even if pending has since moved to keep it.
            g = self.node.add_group(part.group, storage, voters,
                                    birth_known=voters is not None, auto_handover=False)
        except Exception as e:  # noqa: BLE001  # storage errors: retried, then recorded
            self._failed(part, "start", e)
            return
        bo.succeeded()
        gid = part.group
        g.on_leader.append(lambda _g: self._kick(gid))
        g.on_applied.append(lambda grp: self._on_group_applied(part, grp))
        self._hosted.add(gid)
        self.metrics["partitions_started"] += 1
        log.info("node %s: hosting %s (%s)", self.id, gid,
                 f"bootstrapping {voters}" if voters else "joining")

    def _stop_partition(self, part: _Partition) -> None:
        if part.change is not None:
            self._abort_change(part, StaleTerm(f"{self.id} stopped hosting {part.group}"))
        self._hosted.discard(part.group)
        self.node.remove_group(part.group)
        hk = holds_key(part.table, part.index, self.id)  # best effort: we hold it no more
        mine = self._kv.get(hk)
        if mine is not None and mine.value.split(b"/")[0] == self.incarnation:
            # Guarded by the revision, not the value: if we host the partition again in
            # this incarnation, the new holds key has the same value, and a removal that
            # lands after it must not delete it. Dropped from the cache now, so that
            # restart writes the key instead of trusting this one (chaos seed 11: a
            # node hosted a partition without a holds key and, restarted, rejoined as
            # the voter it was, empty).
            self.meta.invoke([Cond.revision(hk).eq(mine.mod_revision)], [Op.remove(hk)])
            self._kv.pop(hk, None)
        self.metrics["partitions_stopped"] += 1
        log.info("node %s: stopped hosting %s", self.id, part.group)

    def _on_group_applied(self, part: _Partition, g: Group) -> None:
        """Hook (inside the driver's loop over groups): only queue a reconcile."""
        if g.raft.role == Role.LEADER and (
            part.change is not None or self._kv.get(part.keys.pending, _EMPTY).value
        ):
            self._kick(part.group)

    # ================================================= loop thread: the leader =========
    def _lead(self, part: _Partition, g: Group, pending: list[str]) -> None:
        term = g.raft.term
        ch = part.change
        if ch is not None and ch.term != term:
            self._abort_change(part, StaleTerm(f"term {ch.term} is over (now {term})"))
        reduce = self._kv.get(part.sw.reduce)
        if not pending and reduce is not None and reduce.value:
            self._trigger_switch_reduce(part, reduce)
        if pending:
            blocked = (set(pending) & set(self._nodes(part.sw.reduce))) - g.raft.conf.voters
            if blocked and set(pending) - blocked:
                self._unblock_pending(part, blocked)
                return  # the change resumes once pending is rewritten
            target = frozenset(pending)
            ch = part.change
            if ch is None or ch.target != target:
                if not self._pending_confirmed(part, term):
                    return
                self._begin_change(part, term, target, "pending")
            planned = self._kv.get(part.keys.planned)
            if planned is not None and planned.value:
                self._maybe_cancel(part, g, target, planned)
        elif part.change is not None and part.change.origin == "pending":
            part.change = None  # someone finished it (pending is empty)
        if part.change is not None:
            self._advance(part, g)
        elif not pending:
            self._drop_stray_learners(part, g)

    def _drop_stray_learners(self, part: _Partition, g: Group) -> None:
        """With nothing pending, stable is final, so a learner outside it is a leftover:
        a leader whose metastore replica lagged began a change towards a pending that
        had already moved on, and the change was dropped when its view caught up with
        pending empty, with the learner it had added still there (placement simulator,
        seed 30; it waited for ever). Remove such learners one at a time. A learner never
        counts toward a quorum, so removing one is always safe; should pending name it
        again, that change adds it back."""
        stray = sorted(g.raft.conf.learners - set(self._nodes(part.keys.stable)))
        if not stray or part.tidy_inflight:
            return
        if not _conf_settled(g.raft):
            self._timer.after(self.node.cfg.tick_seconds * self.node.cfg.election_tick,
                              lambda: self._kick(part.group))
            return
        part.tidy_inflight = True
        log.info("node %s: %s removes learner %s (not in stable, nothing pending)",
                 self.id, part.group, stray[0])

        def done(f: Future[Any]) -> None:
            part.tidy_inflight = False
            exc = f.exception()
            if exc is None or isinstance(exc, (NotLeader, NodeStopped, UnknownGroup)):
                self._kick(part.group)
            else:
                self._failed(part, "change", exc)

        self.metrics["conf_changes"] += 1
        self._on_loop(self.node.change_membership(
            part.group, ConfChange(ConfChangeOp.REMOVE, stray[0])), done)

    def _pending_confirmed(self, part: _Partition, term: int) -> bool:
        """Whether the cached pending is the metastore's, as of a linearizable read made
        while leading in ``term``; if not, start that read (the reconcile it kicks
        begins the change).

        onLeaderElected "starts changePeersAsync from the pending key" (seed 004,
        failover): a read of the key, not the cache. This node's metastore replica may
        lag (a learner, or a voter cut off for a while), and the cache can hold a
        pending that onRebalanceDone has since replaced. A change begun from it moved
        the configuration away from a stable written after it, and nothing moved it
        back: placement simulator seed 88 ended with two voters for a stable of three
        (the handover removed the new leader itself), seed 30 with a stray learner."""
        cached = self._kv.get(part.keys.pending)
        rev = cached.mod_revision if cached is not None else 0
        if part.pending_read == (term, rev):
            return True
        if part.pending_reading:
            return False
        part.pending_reading = True

        def read(f: Future[Any]) -> None:
            part.pending_reading = False
            exc = f.exception()
            if exc is not None:
                self._failed(part, "change", exc)
                return
            got = f.result()
            if (got.mod_revision if got is not None else 0) == rev:
                part.pending_read = (term, rev)
            # else the watch brings the newer pending (and a reconcile) soon
            self._kick(part.group)

        self._on_loop(self.meta.get(part.keys.pending), read)
        return False

    def _unblock_pending(self, part: _Partition, blocked: set[str]) -> None:
        """Pending names nodes of switch.reduce that are not voters: they wait, not
        started, to be removed, so they would never catch up as learners. Drop them from
        pending (``rebalance_steps.leave_pending_for_switch_reduce``); onRebalanceDone
        re-adds them through switch.append."""
        pending, reduce = self._kv.get(part.keys.pending), self._kv.get(part.sw.reduce)
        assert pending is not None
        key = (pending.mod_revision, reduce.mod_revision if reduce is not None else 0)
        if part.unblock_key == key:
            return
        part.unblock_key = key

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                part.unblock_key = None
                self._failed(part, "switch", exc)
                return
            if f.result().tag == 1:
                self.metrics["pending_unblocked"] += 1
                log.info("node %s: %s pending named %s of switch.reduce, not voters: "
                         "dropped from pending", self.id, part.group, sorted(blocked))
            self._kick(part.group)

        self._on_loop(self.meta.iif(self._if_table(part, steps.leave_pending_for_switch_reduce(
            part.keys, part.sw, blocked, pending, reduce))), done)

    def _calc(self, part: _Partition, topo: VersionedValue | None,
              dkv: VersionedValue | None) -> list[str]:
        """calcPartAssignments() from a topology and a descriptor (stable without them)."""
        if topo is None or dkv is None:
            return self._nodes(part.keys.stable)
        try:
            desc = TableDescriptor.decode(dkv.value)
        except ValueError:
            return self._nodes(part.keys.stable)
        return calc_assignments(desc.name, part.index, decode_nodes(topo.value), desc.replicas)

    def _trigger_switch_reduce(self, part: _Partition, reduce: VersionedValue) -> None:
        """IGNITE-16668: the leader's watch on switch.reduce (pending is empty)."""
        stable = self._kv.get(part.keys.stable)
        key = (reduce.mod_revision, stable.mod_revision if stable is not None else 0)
        if part.switch_key == key:
            return
        bo = self._backoff(part, "switch")
        if not bo.ready(key, self.node.clock()):
            return
        part.switch_key = key
        calc = self._calc(part, self._kv.get(TOPOLOGY_KEY), self._kv.get(table_key(part.table)))
        tree = self._if_table(
            part, steps.trigger_switch_reduce(part.keys, part.sw, reduce, calc, stable))

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                part.switch_key = None
                self._failed(part, "switch", exc)
                return
            bo.succeeded()
            if f.result().tag == steps.SWITCH_PENDING_WRITTEN:
                self.metrics["switch_reduce_triggered"] += 1
                log.info("node %s: %s switch.reduce %s: pending := %s - reduce", self.id,
                         part.group, decode_nodes(reduce.value), calc)

        self._on_loop(self.meta.iif(tree), done)

    def _check_term(self, g: Group, term: int) -> None:
        if g.raft.role != Role.LEADER or g.raft.term != term:
            raise StaleTerm(
                f"changePeers for term {term} refused: {self.id} is "
                f"{g.raft.role.name.lower()} in term {g.raft.term} of {g.id}")

    def _begin_change(self, part: _Partition, term: int, target: frozenset[str],
                      origin: str) -> _Change:
        ch = part.change
        if ch is not None and ch.term == term:
            if ch.target != target:
                for w in ch.waiters:
                    _fail(w, ChangeSuperseded(f"{part.group}: target is now {sorted(target)}"))
                ch.waiters = []
                ch.target, ch.origin = target, origin
            return ch
        if ch is not None:
            self._abort_change(part, StaleTerm(f"term {ch.term} is over (now {term})"))
        part.change = _Change(term, target, origin, self.node.clock())
        log.info("node %s: %s changePeers(term %d, %s)", self.id, part.group, term,
                 sorted(target))
        return part.change

    def _abort_change(self, part: _Partition, err: Exception) -> None:
        ch, part.change = part.change, None
        if ch is not None:
            for w in ch.waiters:
                _fail(w, err)

    def _advance(self, part: _Partition, g: Group) -> None:
        """Take the next one-by-one step towards the change's target, if one is due."""
        ch = part.change
        assert ch is not None
        raft = g.raft
        if raft.role != Role.LEADER or raft.term != ch.term:
            self._abort_change(part, StaleTerm(f"{self.id} no longer leads term {ch.term}"))
            return
        if ch.inflight is not None or not _conf_settled(raft):
            return
        conf = raft.conf
        target = ch.target
        stale = sorted(conf.learners - target)
        missing = sorted(target - conf.voters - conf.learners)
        if stale:
            cc = ConfChange(ConfChangeOp.REMOVE, stale[0])
        elif missing:
            cc = ConfChange(ConfChangeOp.ADD_LEARNER, missing[0],
                            self._address(missing[0]).encode())
        elif conf.learners:
            return  # catching up: the core promotes each learner once it is close enough
        else:
            extra = conf.voters - target
            if not extra:
                self._configuration_applied(part, ch, frozenset(conf.voters))
                return
            others = sorted(extra - {self.id})
            cc = ConfChange(ConfChangeOp.REMOVE, others[0] if others else self.id)
        if not self._backoff(part, "change").ready((ch.term, target), self.node.clock()):
            return
        ch.inflight = cc.describe()
        self.metrics["conf_changes"] += 1
        self._on_loop(self.node.change_membership(part.group, cc),
                      lambda f: self._conf_change_done(part, ch, f))

    def _conf_change_done(self, part: _Partition, ch: _Change, f: Future[Any]) -> None:
        ch.inflight = None
        exc = f.exception()
        if part.change is not ch:
            self._kick(part.group)
            return
        if exc is None:
            self._backoff(part, "change").succeeded()
        elif isinstance(exc, LeaderStepping):
            # Removing ourselves: the transferee performs it once elected and resumes the
            # change in its own term. If the transfer fails we are still leader: try again
            # after the core abandons it (an election timeout), counting it as a failure.
            if ch.handed_over:
                self._failed(part, "change", exc)
            ch.handed_over = True
            self.metrics["leader_handovers"] += 1
            wait = 2 * self.node.cfg.election_tick * self.node.cfg.tick_seconds
            self._timer.after(wait, lambda: self._kick(part.group))
            return
        elif isinstance(exc, (NotLeader, NodeStopped, UnknownGroup)):
            self._abort_change(part, StaleTerm(f"{part.group}: {exc}"))
        else:
            self._failed(part, "change", exc)
            return
        self._kick(part.group)

    def _configuration_applied(self, part: _Partition, ch: _Change,
                               voters: frozenset[str]) -> None:
        """The voters equal the target (committed, no learners left)."""
        for w in ch.waiters:
            if not w.done():
                w.set_result(None)
        ch.waiters = []
        pending = self._kv.get(part.keys.pending)
        if pending is None or frozenset(decode_nodes(pending.value)) != voters:
            if ch.origin == "api":
                part.change = None
            return
        self._on_new_peers_configuration_applied(part, ch.term, voters, pending)

    def _on_new_peers_configuration_applied(
        self, part: _Partition, term: int, voters: frozenset[str], pending: VersionedValue,
    ) -> None:
        """Seed 004: stable = applied peers; pending = planned (or empty); guarded."""
        key = (term, pending.mod_revision)
        if part.finishing == key:
            return
        bo = self._backoff(part, "done")
        if not bo.ready(key, self.node.clock()):
            return
        part.finishing = key

        keys = [part.keys.stable, part.keys.pending, part.keys.planned, part.sw.reduce,
                part.sw.append, TOPOLOGY_KEY, table_key(part.table)]

        def attempt(retries: int) -> None:
            def read(f: Future[Any]) -> None:
                exc = f.exception()
                if exc is not None:
                    fail(exc)
                    return
                st, pe, pl, red, app, topo, dkv = f.result()
                done = steps.rebalance_done_switch(
                    part.keys, part.sw, voters, st, pe, pl, red, app,
                    self._calc(part, topo, dkv))
                if done.tree is None:
                    bo.succeeded()
                    self.metrics["done_stale"] += 1
                    return
                log.info("node %s: %s onRebalanceDone(%s): reduce %s append %s -> pending %s",
                         self.id, part.group, done.resolved_stable, done.reduce, done.append,
                         done.pending)
                self._on_loop(self.meta.iif(done.tree), lambda r: result(r, retries))

            self._on_loop(self.meta.get_many(keys), read)

        def fail(exc: BaseException) -> None:
            part.finishing = None
            self._failed(part, "done", exc)

        def result(f: Future[Any], retries: int) -> None:
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            res = f.result()
            tag = res.tag if isinstance(res, BranchResult) else None
            if tag == DONE_RETRY:  # planned moved between our read and the invoke
                if retries < self.retry.max_attempts:
                    attempt(retries + 1)
                else:
                    fail(RuntimeError("planned kept changing"))
                return
            bo.succeeded()
            if tag in (steps.DONE_SWITCH_APPEND, steps.DONE_SWITCH_REDUCE):
                self.metrics["switch_append" if tag == steps.DONE_SWITCH_APPEND
                             else "switch_reduce"] += 1
            if tag in (DONE_CLEARED, DONE_PLANNED_MOVED, steps.DONE_SWITCH_APPEND,
                       steps.DONE_SWITCH_REDUCE):
                self.metrics["rebalances_done"] += 1
                log.info("node %s: %s rebalanced to %s", self.id, part.group, sorted(voters))
            else:
                self.metrics["done_stale"] += 1

        attempt(0)

    def _maybe_cancel(self, part: _Partition, g: Group, target: frozenset[str],
                      planned: VersionedValue) -> None:
        """Approach 2: a change still catching up gives way to planned."""
        if not target - g.raft.conf.voters:
            return  # every pending member is a voter: too late, planned waits for done
        pending = self._kv[part.keys.pending]
        key = (pending.mod_revision, planned.mod_revision)
        if part.cancel_key == key:
            return
        bo = self._backoff(part, "cancel")
        if not bo.ready(key, self.node.clock()):
            return
        part.cancel_key = key

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                part.cancel_key = None
                self._failed(part, "cancel", exc)
                return
            bo.succeeded()
            res = f.result()
            if isinstance(res, BranchResult) and res.tag == steps.MOVED:
                self.metrics["changes_cancelled"] += 1
                log.info("node %s: %s cancelled changePeers(%s) for planned %s", self.id,
                         part.group, sorted(target), decode_nodes(planned.value))

        self._on_loop(self.meta.iif(steps.move_planned_to_pending(part.keys, pending, planned)),
                      done)

    def _address(self, node: str) -> str:
        v = self._kv.get(ADDRESS_PREFIX + node.encode())
        if v is not None:
            return v.value.decode(errors="replace")
        peer = self.node.transport.peers.get(node)
        return peer.addr if peer is not None and peer.addr else ""

    # ================================================================ status ===========
    def _status(self) -> dict[str, Any]:
        parts = {}
        for gid, part in sorted(self._parts.items()):
            g = self.node.groups.get(gid) if gid in self._hosted else None
            planned = self._nodes(part.keys.planned)
            entry: dict[str, Any] = {
                "stable": self._nodes(part.keys.stable),
                "pending": self._nodes(part.keys.pending),
                "planned": planned or None,
                "switch_reduce": self._nodes(part.sw.reduce),
                "switch_append": self._nodes(part.sw.append),
                "rejoin": part.rejoin,
                "hosted": g is not None,
            }
            if g is not None:
                conf = g.raft.conf
                entry.update(role=g.raft.role.name.lower(), term=g.raft.term, leader=g.leader,
                             voters=sorted(conf.voters), learners=sorted(conf.learners))
            ch = part.change
            entry["change"] = None if ch is None else {
                "term": ch.term, "target": sorted(ch.target), "origin": ch.origin,
                "inflight": ch.inflight, "handed_over": ch.handed_over,
                "seconds": round(self.node.clock() - ch.started, 3),
            }
            entry["retries"] = {k: b.describe() for k, b in part.backoffs.items() if b.failures}
            parts[gid] = entry
        return {
            "node": self.id, "revision": self._revision, "synced": self._synced,
            "tables": {n: {"partitions": d.partitions, "replicas": d.replicas,
                           "storage": d.storage} for n, d in sorted(self._tables.items())},
            "partitions": parts,
            "errors": list(self.errors),
            "metrics": dict(self.metrics),
        }


def create_table_invoke(desc: TableDescriptor, topo: VersionedValue | None,
                        ) -> tuple[list[Condition], list[Op]]:
    """The invoke that creates ``desc`` (computed from the topology ``topo``): the
    descriptor and each partition's initial stable assignment, if no table of that name
    exists and the topology has not moved since it was read."""
    key = table_key(desc.name)
    ops = [Op.put(key, desc.encode())]
    for p in range(desc.partitions):
        pk, sw = partition_keys(desc.name, p), steps.switch_keys(desc.name, p)
        ops.append(Op.put(pk.stable, encode_nodes(desc.initial[p])))
        # Leftovers of a dropped table of this name (a late invoke of a node that had
        # not seen the drop yet) must not steer the new one.
        ops += [Op.remove(k) for k in (pk.pending, pk.planned, pk.trigger,
                                       sw.reduce, sw.append)]
    guard = Cond.revision(TOPOLOGY_KEY).eq(topo.mod_revision if topo else 0)
    return [Cond.not_exists(key), guard], ops


def set_replicas_invoke(key: bytes, cur: VersionedValue, replicas: int,
                        ) -> tuple[list[Condition], list[Op]]:
    """The invoke that sets the replica count of the table whose descriptor ``key`` was
    read as ``cur``, if it has not changed since (the seed's trigger)."""
    new = TableDescriptor.decode(cur.value).with_replicas(replicas)
    return [Cond.revision(key).eq(cur.mod_revision)], [Op.put(key, new.encode())]


def join_metastore_as_learner(meta: MetaService, node_id: str, raft_addr: str) -> Future[Any]:
    """Admit ``node_id`` (whose MetaService started with ``voters=None``) as a metastore
    learner that is never promoted: it gets a replica to read and watch, while the
    metastore's quorum stays on its founders. Call on the metastore leader's MetaService
    (elsewhere the future fails with ``NotLeader`` and its hint); resolves once applied."""
    cc = ConfChange(ConfChangeOp.ADD_LEARNER, check_node_id(node_id), raft_addr.encode(),
                    auto_promote=False)
    return meta.node.change_membership(meta.group, cc)


_EMPTY = VersionedValue(b"", 0, 0)


def _conf_settled(raft: Raft) -> bool:
    """Whether the leader may propose a membership change now: no transfer under way,
    the last configuration committed, and an entry of its own term committed (the
    known fix for single-server changes)."""
    log_ = raft.log
    return (raft.lead_transferee is None and raft.confs[-1][0] <= log_.committed
            and log_.term_or_zero(log_.committed) == raft.term)


def _tracked(key: bytes) -> bool:
    return key.startswith(_PLACEMENT_PREFIX) or parse_partition_key(key) is not None


def _fail(fut: Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
