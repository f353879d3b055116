"""``PlacementManager``: tables, partitions, Ignite 3's rebalance design and the safe
restart of in-memory partitions (IGNITE-16668) on one node.

Theory of operation
-------------------
Every node runs one manager next to its ``MetaService`` (the metastore replica: a voter on
the metastore's founding nodes, a non-voting learner elsewhere, see "choices" below).
Everything the manager does happens on the node's loop thread, where the Raft cores and
stores live; admin calls from other threads (``create_table``, ``set_replicas``,
``set_nodes``, ``status``) only write the metastore or ask the loop, and blocking waits
never run on the loop thread (callbacks hop back onto it with ``Node.call``).


The manager is one class per concern (``raftkv.placement.manager_base`` lists them):
this module has the admin calls, the queries, reconcile (steps (1) and (3) below) and
the starting and stopping of partition groups; ``metastore_view`` the cache and watch;
``change_peers`` step (2) on the leader, failover and Approach 2; ``safe_restart``
IGNITE-16668's restart path and the lone-holder rule; ``partition_files`` the files.

**Step (1), writing the intent.** A trigger is a write of ``<tableScope>.replicas`` (the
table descriptor, ``set_replicas``) or of the logical topology (``set_nodes``). Its
``event.revision`` is that write's revision, i.e. the key's ``mod_revision``. A partition
whose ``change.trigger.revision`` is below ``max(topology rev, descriptor rev)`` runs the
step-(1) invoke (``rebalance_steps.plan_rebalance``) with that revision and the
assignment calculated from the cached topology and replica count: those keys have not
changed since that revision, so every node computes the same value. Each node that sees
the trigger runs it; the trigger revision makes all but the first a no-op (SKIPPED).


**Step (3), stable.** When stable changes, the node stops (``Node.remove_group``) the
partitions it hosts but is in neither stable nor pending, and refreshes its routing table
(partition -> stable nodes and a leader hint). While a change is under way and the node is
a member of the configuration it knows, the stop waits until pending is empty: a cancel
may have dropped it from pending after its promotion, and the configuration may still
need it for a quorum. It also waits while its log's latest configuration names it and
comes after the entry that stable ended with (``PartitionKeys.applied``): a later change
re-added it, perhaps promoted it, and its cache has not seen that change's pending yet.


Choices where the seed is ambiguous or does not fit raftkv
----------------------------------------------------------
- IGNITE-16668, where the seed is silent or does not fit:
  - "Restarted" means: the table's descriptor was created before this start's incarnation
    key was written, and the node has hosted the partition (it has a holds key; see
    ``safe_restart.SafeRestart._first_start``). A founder that first starts after the
    table's creation, without having hosted it, bootstraps the founding configuration as
    any founder does (it voted and acknowledged nothing). A node assigned only in
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
    with step (1) of Ignite's rebalance design, which can move it past the reduce event without
    acting on it.
  - onRebalanceDone: the planned revision joins the four preconditions (the common branch
    copies planned); it writes nothing unless pending still names the new peers; append'
    also drops nodes already in resolvedStable (else a no-op addition repeats forever);
    a reduction that would empty pending falls to the common branch.
  - A restarted node in switch.reduce waits for the removal; while the leader adds it
    back it starts the group as a joiner, never bootstrapping ``TableDescriptor.initial``
    (only fresh tables, founders that never hosted the partition and persistent
    partitions with their log do).
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
- A partition this node stops hosting in step (3) has its files deleted: its log may
  still name it a voter of a configuration it has been removed from (the leader stops
  replicating to a removed member), and reopened when pending names it again it could
  campaign under that configuration (placement simulator, seed 646). A re-added member
  joins empty and is caught up by a snapshot.
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
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from raftkv.core import (
    ConfChange,
    ConfChangeOp,
    Raft,
    Role,
)
from raftkv.node.driver import Group, Node
from raftkv.node.errors import UnknownGroup
from raftkv.node.stores import open_group_storage
from raftkv.placement import rebalance_steps as steps
from raftkv.placement.assignments import (
    PENDING_WRITTEN,
    PLANNED_WRITTEN,
    calc_assignments,
    decode_applied,
    decode_nodes,
    encode_nodes,
    partition_keys,
    partition_of,
)
from raftkv.placement.catalog import (
    DEAD_KEY,
    DRAINING_KEY,
    HOLDS_PREFIX,
    PERSISTENT,
    SETTINGS_KEY,
    TOPOLOGY_KEY,
    TableDescriptor,
    check_node_id,
    check_table_name,
    holds_key,
    partition_group,
    partition_wire_id,
    table_key,
)
from raftkv.placement.change_peers import ChangePeers
from raftkv.placement.key_cache import KeyCache
from raftkv.placement.liveness import ClusterSettings, Liveness, data_nodes
from raftkv.placement.manager_base import (
    ADMIN_ATTEMPTS,
    EMPTY,
    PARTITION_CHECKPOINT_SECONDS,
    START_BUDGET,
)
from raftkv.placement.meta_commands import (
    BranchResult,
    Cond,
    Condition,
    InvokeResult,
    Op,
    VersionedValue,
    decode_revision,
)
from raftkv.placement.metastore_view import MetastoreView
from raftkv.placement.partition_files import PartitionFiles
from raftkv.placement.partition_state import (
    PartitionState,
    Route,
    StaleTerm,
    TableExists,
    UnknownNode,
    UnknownTable,
)
from raftkv.placement.retry import Backoff, RetryPolicy, TickTimer
from raftkv.placement.safe_restart import SafeRestart
from raftkv.placement.service import MetaService
from raftkv.storage.layout import partition_logs_path
from raftkv.storage.lmdb_log import LogEnv

log = logging.getLogger(__name__)

# Retries of a holds key's delete (``_release_holds``): doubling, capped.
RELEASE_RETRY_FIRST = 0.1
RELEASE_RETRY_MAX = 5.0



class PlacementManager(MetastoreView, PartitionFiles, SafeRestart, ChangePeers, Liveness):
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
        self._kv = KeyCache()
        self._tables: dict[str, TableDescriptor] = {}
        self._parts: dict[str, PartitionState] = {}
        self._hosted: set[str] = set()
        self._releasing: set[bytes] = set()  # our holds keys being deleted (_release_holds)
        self._routes: dict[str, Route] = {}
        self._dirty: set[str] = set()
        self._move_waiters: set[str] = set()
        self._drain_queued = False
        self._start_budget = START_BUDGET
        self._start_queue: list[Callable[[], None]] = []
        self._revision = 0
        self._synced = False
        self._stopped = False
        self._loop_thread: threading.Thread | None = None
        self._backoffs = {"watch": Backoff(self.retry), "address": Backoff(self.retry),
                          "incarnation": Backoff(self.retry)}
        self.incarnation = b"%016x" % self.node.runtime.random().getrandbits(64)
        self._incarnation_rev = 0  # the revision our incarnation key was written at

    # ================================================================ lifecycle =========
    def start(self) -> None:
        def install() -> None:
            self._loop_thread = threading.current_thread()
            self.node.groups[self.meta.group].on_tick.append(self._timer.on_tick)
            self._start_liveness()
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
        for _ in range(ADMIN_ATTEMPTS):
            topo, dead = self.meta.get_many([TOPOLOGY_KEY, DEAD_KEY]).result(
                self.admin_timeout)
            nodes, _ = data_nodes(topo, dead)
            desc = TableDescriptor.new(name, partitions, replicas, storage, nodes)
            res = self.meta.invoke(*create_table_invoke(desc, topo, dead)).result(
                self.admin_timeout)
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
        for _ in range(ADMIN_ATTEMPTS):
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
        for _ in range(ADMIN_ATTEMPTS):
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
        """Move ``group``'s configuration to ``peers`` (see ``change_peers``). Runs on
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
        return self.partition_route(table, partition_of(key, desc.partitions))

    def partition_route(self, table: str, p: int) -> Route:
        """Partition ``p`` of ``table``'s stable nodes (and leader hint)."""
        if table not in self._tables:
            raise UnknownTable(table)
        r = self._routes.get(partition_group(table, p))
        return r if r is not None else Route(partition_group(table, p), table, p, (), None)

    def routes(self, timeout: float = 5.0) -> dict[str, Route]:
        """The routing table: partition group -> stable nodes and leader hint."""
        self._not_on_loop()
        result: dict[str, Route] = self.node.call(lambda: dict(self._routes)).result(timeout)
        return result

    def table(self, name: str) -> TableDescriptor | None:
        return self._tables.get(name)

    def generation(self, name: str) -> int | None:
        """The cached table's generation (its descriptor's create revision: a table
        dropped and created again under the name has another), or None."""
        v = self._kv.get(table_key(name)) if name in self._tables else None
        return v.create_revision if v is not None else None

    def cluster_nodes(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Each placement node's liveness as this node's metastore replica last saw it
        (``raftkv.placement.liveness``): state, epoch, since (wall clock), whether it is
        in the topology and a data node."""
        self._not_on_loop()
        result: list[dict[str, Any]] = self.node.call(self._liveness_status).result(timeout)
        return result

    def drain(self, node: str, check_replicas: bool = True) -> list[str]:
        """Decommission ``node``: take it out of the placement topology and mark it
        draining, in one invoke. Its partitions move to the other data nodes; the
        metastore leader then demotes it (a metastore voter, once a spare node has been
        promoted in its place) and removes it from the metastore once nothing is placed
        on it and it hosts nothing or is dead (``raftkv.placement.liveness``). Returns the
        topology left. ``UnknownNode`` if it is in neither the topology nor draining
        already; ``ValueError`` for the last node, or (``check_replicas``, as ``raftkv
        cluster drain`` asks; ``remove-node`` does not) if fewer live data nodes would be
        left than a table has replicas (its partitions would drop below their count)."""
        check_node_id(node)
        self._not_on_loop()
        for _ in range(ADMIN_ATTEMPTS):
            topo, dr, dead = self.meta.get_many([TOPOLOGY_KEY, DRAINING_KEY, DEAD_KEY]).result(
                self.admin_timeout)
            inv = drain_invoke(node, topo, dr, dead, list(self._tables.values()),
                               check_replicas)
            rest = [n for n in (decode_nodes(topo.value) if topo is not None else [])
                    if n != node]
            if inv is None:
                return rest  # already draining
            res = self.meta.invoke(*inv).result(self.admin_timeout)
            if res.succeeded:
                return rest
        raise RuntimeError("the topology kept changing while draining")

    def settings(self) -> ClusterSettings:
        """The cluster's placement settings (a linearizable read)."""
        self._not_on_loop()
        v = self.meta.get(SETTINGS_KEY).result(self.admin_timeout)
        return ClusterSettings.decode(v.value if v is not None else None)

    def update_settings(self, body: object) -> ClusterSettings:
        """Change some settings (``ClusterSettings.update``: ``ValueError`` for a bad
        field, and nothing is written); guarded by the key's revision, retried."""
        self._not_on_loop()
        for _ in range(ADMIN_ATTEMPTS):
            cur = self.meta.get(SETTINGS_KEY).result(self.admin_timeout)
            new = ClusterSettings.decode(cur.value if cur is not None else None).update(body)
            res = self.meta.invoke(
                [Cond.revision(SETTINGS_KEY).eq(cur.mod_revision if cur is not None else 0)],
                [Op.put(SETTINGS_KEY, new.encode())]).result(self.admin_timeout)
            if res.succeeded:
                return new
        raise RuntimeError("the settings kept changing while updating them")

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        self._not_on_loop()
        result: dict[str, Any] = self.node.call(self._status).result(timeout)
        return result

    # ==================================================== loop thread: reconcile ========
    def _reconcile_group(self, gid: str) -> None:
        part = self._parts.get(gid)
        if part is not None:
            self._reconcile(part)

    def _reconcile(self, part: PartitionState) -> None:
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
            raft = self.node.groups[part.group].raft
            if self.id in raft.conf.members() and (
                    pending or self._log_past_stable(part, raft, stable_rev)):
                # Step (3) waits while a change is under way and we are a member of the
                # configuration we know: a cancel dropped us from pending after our
                # promotion (or one on its way to us), and the configuration may need us
                # for a quorum until the leader removes us (placement simulator seed 6:
                # {us, leader} left alone). Once pending is empty, stable is the applied
                # configuration, unless our log holds a configuration naming us that is
                # newer than the one this stable ended with: a later change re-added us
                # (and may have promoted us) and our cache has not seen its pending yet
                # (placement simulator seed 2255: the voter this stopped came back empty
                # as a fresh joiner, and the leader's next removal left {it, leader}).
                stable_rev = part.cleanup_rev
            else:
                self._stop_partition(part)  # step (3): on stable updates only
                # A configuration without us applied, and the leader no longer sends us
                # anything, so our log may still name us a voter of an older
                # configuration. Kept and reopened when pending named us again, it let
                # us campaign under that configuration and win a term with another
                # stale member (placement simulator, seed 646). Re-added, we join empty.
                self._delete_files(part.group)
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

    def _log_past_stable(self, part: PartitionState, raft: Raft, stable_rev: int) -> bool:
        """Whether our log's latest configuration entry comes after the one the stable we
        see ended with (``PartitionKeys.applied``, written with that stable, so its
        revision is stable's). Only a later change appends one after it: if it committed,
        that change is newer than our cache; if it did not, a later leader's change
        records a later term and the wait ends with its stable. Without the record (a
        founding stable, a full restart, a leader that could not read the entry's term)
        we cannot tell, and stop as before."""
        rec = self._kv.get(part.keys.applied)
        if rec is None or rec.mod_revision != stable_rev:
            return False
        done = decode_applied(rec.value)
        if done is None:
            return False
        index = raft.confs[-1][0]
        term = raft.log.term_or_zero(index)
        return (term, index) > (done[1], done[0])

    def _maybe_plan(self, part: PartitionState, desc: TableDescriptor) -> None:
        """Step (1) for one partition, if a trigger newer than its trigger revision exists."""
        topo, dkv = self._kv.get(TOPOLOGY_KEY), self._kv.get(table_key(desc.name))
        if topo is None or dkv is None or part.plan_inflight:
            return
        nodes, nodes_rev = data_nodes(topo, self._kv.get(DEAD_KEY))
        source = max(nodes_rev, dkv.mod_revision)
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

    def _start_partition(self, part: PartitionState, desc: TableDescriptor,
                         voters: list[str] | None) -> None:
        bo = self._backoff(part, "start")
        if not self._current(part) or not bo.ready("start", self.node.clock()):
            return
        if self._start_budget <= 0:
            self._kick(part.group)  # next loop turn (START_BUDGET)
            return
        self._start_budget -= 1
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
                                    birth_known=voters is not None, auto_handover=False,
                                    wire_id=partition_wire_id(part.group, part.gen))
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

    def _stop_partition(self, part: PartitionState) -> None:
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
            self._release_holds(hk, mine.mod_revision)
            self._kv.pop(hk, None)
        self.metrics["partitions_stopped"] += 1
        log.info("node %s: stopped hosting %s", self.id, part.group)

    def _release_holds(self, hk: bytes, revision: int, attempt: int = 0) -> None:
        """Delete our holds key ``hk`` as written at ``revision``, again until the
        metastore has answered (deleted, or the guard failed: a later start rewrote it, or
        it is gone). The guard makes a late retry harmless, and while the key is in
        ``_releasing`` a start writes it again rather than trusting it. Sent once, the
        delete was lost when it reached a metastore leader transferring its leadership
        (the proposal is dropped), and the key of a live node's current incarnation then
        read as hosting for good: its drain never finished (found from outside)."""
        self._releasing.add(hk)

        def done(f: Future[Any]) -> None:
            if f.exception() is None:
                self._releasing.discard(hk)
                return
            self.metrics["errors.release_holds"] += 1
            delay = min(RELEASE_RETRY_MAX, RELEASE_RETRY_FIRST * 2 ** attempt)
            self._timer.after(delay, lambda: self._defer(
                lambda: self._release_holds(hk, revision, attempt + 1)))

        self._on_loop(self.meta.invoke([Cond.revision(hk).eq(revision)], [Op.remove(hk)]),
                      done)

    def _sweep_holds(self) -> None:
        """Release our holds keys of this incarnation for partitions we neither host nor
        are starting. ``_stop_partition`` releases the key of a group it stops; this
        catches the key of a start abandoned once the key was written (the node no longer
        named when the write came back, so the group never started and never stops),
        which otherwise read as hosting for good: the placement simulator's drains (seed
        153) waited on one. Every node, every LIVENESS_PERIOD (``_liveness_tick``)."""
        for part in self._parts.values():
            if part.group in self._hosted or part.start_inflight or part.reduce_inflight:
                continue
            k = holds_key(part.table, part.index, self.id)
            v = self._kv.get(k)
            if v is None or k in self._releasing or v.value.split(b"/")[0] != self.incarnation:
                continue
            log.info("node %s: releasing %s (not hosted)", self.id, k.decode())
            self._release_holds(k, v.mod_revision)
            # Out of the cache now, as _stop_partition does: the delete can be answered
            # before its watch event arrives, and a start meanwhile must write the key
            # again rather than trust one that is gone (found by a review: the node then
            # hosted the partition with no holds key, chaos seed 11's hazard).
            self._kv.pop(k, None)

    def _on_group_applied(self, part: PartitionState, g: Group) -> None:
        """Hook (inside the driver's loop over groups): only queue a reconcile."""
        if g.raft.role == Role.LEADER and (
            part.change is not None or self._kv.get(part.keys.pending, EMPTY).value
        ):
            self._kick(part.group)

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
                "start": part.start.value,
                "hosted": g is not None,
                # Hosted before this start and not since: a replica that restarted empty
                # (in memory) or wiped, waiting for the safe restart protocol.
                "lost": g is None and self._held_before(part),
                # Its history began with a full-partition restart: what it held before
                # was lost (every replica of an in-memory partition restarted at once).
                "restarted_empty": bool(self._history_epoch(part)),
            }
            if g is not None:
                conf = g.raft.conf
                entry.update(role=g.raft.role.name.lower(), term=g.raft.term, leader=g.leader,
                             voters=sorted(conf.voters), learners=sorted(conf.learners))
            ch = part.change
            entry["change"] = None if ch is None else {
                "term": ch.term, "target": sorted(ch.target), "origin": ch.origin,
                "inflight": ch.inflight, "phase": ch.phase.value, "handovers": ch.handovers,
                "seconds": round(self.node.clock() - ch.started, 3),
            }
            entry["retries"] = {k: b.describe() for k, b in part.backoffs.items() if b.failures}
            parts[gid] = entry
        return {
            "node": self.id, "revision": self._revision, "synced": self._synced,
            "tables": {n: {"partitions": d.partitions, "replicas": d.replicas,
                           "storage": d.storage} for n, d in sorted(self._tables.items())},
            "partitions": parts,
            "nodes": self._liveness_status(),
            "errors": list(self.errors),
            "metrics": dict(self.metrics),
        }


def create_table_invoke(desc: TableDescriptor, topo: VersionedValue | None,
                        dead: VersionedValue | None = None,
                        ) -> tuple[list[Condition], list[Op]]:
    """The invoke that creates ``desc`` (computed from the data nodes: the topology
    ``topo`` without ``dead``): the descriptor and each partition's initial stable
    assignment, if no table of that name exists and neither key has moved since it was
    read."""
    key = table_key(desc.name)
    ops = [Op.put(key, desc.encode())]
    for p in range(desc.partitions):
        pk, sw = partition_keys(desc.name, p), steps.switch_keys(desc.name, p)
        ops.append(Op.put(pk.stable, encode_nodes(desc.initial[p])))
        # Leftovers of a dropped table of this name (a late invoke of a node that had
        # not seen the drop yet) must not steer the new one.
        ops += [Op.remove(k) for k in (pk.pending, pk.planned, pk.trigger,
                                       sw.reduce, sw.append)]
    guards = [Cond.revision(k).eq(v.mod_revision if v else 0)
              for k, v in ((TOPOLOGY_KEY, topo), (DEAD_KEY, dead))]
    return [Cond.not_exists(key), *guards], ops


def drain_invoke(node: str, topo: VersionedValue | None, draining: VersionedValue | None,
                 dead: VersionedValue | None, tables: list[TableDescriptor],
                 check_replicas: bool = True) -> tuple[list[Condition], list[Op]] | None:
    """The invoke that drains ``node`` (``PlacementManager.drain``) from the topology,
    draining and dead keys as read: the topology without it and it added to draining,
    guarded by both revisions. None if it is draining already; ``UnknownNode`` or
    ``ValueError`` as ``drain`` says."""
    nodes = decode_nodes(topo.value) if topo is not None else []
    now_draining = set(decode_nodes(draining.value)) if draining is not None else set()
    if node not in nodes:
        if node in now_draining:
            return None
        raise UnknownNode(f"{node} is not in the placement topology "
                          f"({', '.join(nodes) or 'empty'})")
    rest = [n for n in nodes if n != node]
    if not rest:
        raise ValueError(f"{node} is the last node of the placement topology: "
                         "there is nowhere to move its partitions")
    gone = set(decode_nodes(dead.value)) if dead is not None else set()
    live = [n for n in rest if n not in gone]
    # Only a live node's drain lowers the count (a dead one's replicas are already being
    # placed elsewhere).
    short = [] if node in gone or not check_replicas else sorted(
        (d.name, d.replicas) for d in tables if d.replicas > len(live))
    if short:
        name, replicas = short[0]
        raise ValueError(
            f"draining {node} would leave {len(live)} live data node(s) for table "
            f"{name}'s {replicas} replicas: add a node first, or lower its replica "
            f"count (raftkv table set-replicas)")
    return ([Cond.revision(k).eq(v.mod_revision if v is not None else 0)
             for k, v in ((TOPOLOGY_KEY, topo), (DRAINING_KEY, draining))],
            [Op.put(TOPOLOGY_KEY, encode_nodes(rest)),
             Op.put(DRAINING_KEY, encode_nodes(now_draining | {node}))])


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







