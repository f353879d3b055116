"""IGNITE-16668's safe restart of in-memory partitions (and of persistent ones whose
files were wiped), and the survivor rule for the lone holder of a two-voter
configuration.

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
- The replica's own progress on this path is ``PartitionState.start``, a
  ``partition_state.StartPhase``: ``UNDECIDED`` until the first look, then ``NORMAL``
  (start), or ``LOST`` (a stable member: record the loss in switch.reduce, or take part in
  a full restart), ``LEAVING`` then ``LEFT`` (a pending-only member), ``RECORDED`` (in
  switch.reduce, waiting for the leader's removal), and back to ``NORMAL`` when re-added
  or fully restarted. ``START_TRANSITIONS`` lists the moves.
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
*Full-partition restart*: nobody holds the state (and, for a persistent table, every
member that restarted has recorded the loss of its log in switch.reduce: until then its
log may hold everything), decided on a linearizable read of the ``placement.`` keys and committed by writing our holds key in an invoke guarded by the
revision of every known node's holds key (no node can start holding the state in
between). Such a holds key is ``<incarnation>/<epoch>``: the fresh history's id (the
first restarter's incarnation). A node that joins the partition later (a learner the
leader adds) writes the epoch of the history it joins in its key too
(``_history_epoch``), since it acknowledges and votes in that history. The partition's
*epoch key* (``<table>.<p>.assignments.epoch``) names the current history's epoch; only a
full restart that begins a history writes it, and every holds-key write is guarded by its
revision as read, so no key names the history before a full restart that committed after
the read (found in review: a joiner's, and a founder's first start, could). A joiner
without state (named by pending only) waits, instead of writing, until a live member of
stable holds the state. While fewer than a majority hold the state and every
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
  switch.reduce, is in stable, and pending is empty, names a, or names a node that is a
  voter of no configuration of a's log from its commit index on
  (``Raft.voters_since_commit``). Then a runs a survivor
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
(B) *No configuration that removes or demotes a was made from a configuration of W*
    (a's log from its commit index on; that is all the core needs: a removal further
    down follows another change beyond a's log, which committed with a member of the
    electorate, and that member refuses a). The placement layer never demotes, and the
    core READMITs a only if a's storage incarnation changed, which a holder's has not.
    It removes a voter only in changePeers' removal phase, towards a pending P without
    it, once every member of P is a voter (``_advance``), and only after its *removal
    fence* committed (``rebalance_steps.fence_removals``). From the fence on, pending
    changes only by onRebalanceDone, which writes stable = that pending (without a) and
    clears the fence, or by dropping members of switch.reduce or pending-only members
    that leave, which only shrinks it (a leading lone holder that keeps itself,
    ``ChangePeers._lone_holder``, is a voter already and is not removed). A cancel is
    refused while the fence is set, checked when the cancel applies: deciding it on the
    leader's view was not enough, since a cancel sent by a leader that then lost its
    term could apply after its successor began removing (found by a review of this
    rule). So while a is in stable, every pending since a removal of a began is a subset
    of P, whose members were voters of the configuration the removal was made from. So
    a in stable, with pending empty, naming a, or naming a node that is a voter of no
    configuration of W (``Raft.voters_since_commit``), means no such removal was made.
    (The pending that names a is the case of placement simulator seed 785, kept by
    ``_lone_holder``; the other is seed 1076: stable [n1, n3], the leader n3 cancelled
    towards [n2, n4, n5] before n1 recorded the loss of its files, and lost its term
    before it could name itself.) (A direct ``change_peers`` call by an operator is
    outside this argument: it sets no fence.)

(A) is about the past, and a removal of a appended after the read could commit only
under {b} or {b, z}, which needs b. Only one side of a pair is ever a survivor: b runs
the election against a only if a is in switch.reduce, which only a new, state-less a
writes. If a lost its state too it does not hold the partition: neither member holds
it, and the full-partition restart applies.
Before it campaigns, a adopts the commit index the metastore records for the partition's
last change (``PartitionKeys.applied``: the (index, term) of the configuration entry that
change ended with, written by its onRebalanceDone after its leader saw the entry commit;
``Raft.learn_commit`` takes it only if a's log holds that very entry). Otherwise a lost
commit notice leaves the removed z in a's electorate for good once z deleted its replica
(placement simulator seed 1187). A full-partition restart removes the record with its
first holds key, so it never names an entry of the new history.
A member of the electorate (a learner that may have been promoted, or z) that is down
or lost its own state makes the election wait: it may hold the only copy of what b
committed with it, and two losses are beyond this rule.

Two replicas still cannot survive one failure: while b is down (not yet restarted) {a,
b} has no quorum, and while a is alone one more loss loses acknowledged writes. So the
HTTP API refuses two replicas for an in-memory table unless ``allow_unsafe`` is given
(``raftkv.server.tables``).

"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

from raftkv.core import (
    CampaignRejected,
    Role,
)
from raftkv.node.driver import Group
from raftkv.placement import rebalance_steps as steps
from raftkv.placement.assignments import (
    decode_applied,
    decode_nodes,
)
from raftkv.placement.catalog import (
    INCARNATION_PREFIX,
    MEMORY,
    TableDescriptor,
    holds_key,
    holds_prefix,
    incarnation_key,
    table_key,
)
from raftkv.placement.key_cache import KeyCache
from raftkv.placement.manager_base import (
    DROPPED,
    EMPTY,
    ManagerBase,
)
from raftkv.placement.meta_commands import (
    Cond,
    InvokeResult,
    Op,
    VersionedValue,
)
from raftkv.placement.partition_state import (
    PartitionState,
    StartPhase,
)
from raftkv.storage.layout import group_paths
from raftkv.transport import codec

log = logging.getLogger(__name__)


class SafeRestart(ManagerBase):
    """onPartitionStart, switch.reduce and the survivor rule (see the module docstring)."""

    # ============================================ loop thread: IGNITE-16668 restart ====
    def _in_memory(self, desc: TableDescriptor) -> bool:
        return desc.storage == MEMORY or self.data_dir is None

    def _has_log(self, part: PartitionState) -> bool:
        """The local storage self-check: does the partition have a log here (in the
        shared environment, or still in a directory of its own from before)?"""
        return self._logs is not None and (
            self._logs.has(part.group)
            or os.path.isdir(group_paths(self.data_dir or "", part.group)[0]))

    def _holds(self, part: PartitionState, node: str,
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

    def _majority_available(self, part: PartitionState, stable: list[str],
                            reduce: list[str]) -> bool:
        """A majority of stable is alive, holds its state, and is not being switched out;
        or stable is two nodes and the other one is such a holder: it can continue alone
        ("The lone holder of a two-voter configuration")."""
        holders = [n for n in stable if n != self.id and n not in reduce
                   and self._holds(part, n) and self._alive(n)]
        if len(stable) == 2 and self.id in stable and len(holders) == 1:
            return True
        return len(holders) >= len(stable) // 2 + 1

    def _restart_epoch(self, part: PartitionState, kv: KeyCache) -> bytes | None:
        """The full-partition restart we may take part in, or None. Nobody holds the
        state (every holds key is of an earlier incarnation): a new one, named by our
        incarnation. Every holder holds it from one full restart E (holds value
        ``<incarnation>/E``) and our own (void) holds key is not of E: join E, as a late
        founder of that fresh history (we never voted in it). Anything else: None."""
        prefix = holds_prefix(part.table, part.index)
        desc = self._tables.get(part.table)
        persistent = desc is not None and not self._in_memory(desc)
        reduce = kv.get(part.sw.reduce)
        declared = set(decode_nodes(reduce.value) if reduce is not None and reduce.value
                       else [])
        epochs = set()
        for k, v in kv.holds_of(prefix).items():
            if v.value:
                node = k[len(prefix):].decode(errors="replace")
                inc = kv.get(INCARNATION_PREFIX + k[len(prefix):])
                inc_id, _, epoch = v.value.partition(b"/")
                if inc is not None and inc.value == inc_id:
                    if not epoch:
                        return None  # a holder of the history before any full restart
                    epochs.add(epoch)
                elif persistent and node != self.id and node not in declared:
                    # A persistent replica that restarted keeps its log unless it says
                    # otherwise (a restart without its log records itself in
                    # switch.reduce): until it has, it may hold everything, and a fresh
                    # history would lose it (placement simulator, seed 1195: a holder
                    # restarting while the other member's files were wiped).
                    return None
        if not epochs:
            return self.incarnation
        if len(epochs) > 1:
            return None
        (epoch,) = epochs
        mine = kv.get(holds_key(part.table, part.index, self.id))
        if mine is not None and mine.value.partition(b"/")[2] == epoch:
            return None  # we took part in E and lost our state (and vote) since
        return epoch

    def _on_partition_start(self, part: PartitionState, desc: TableDescriptor,
                            stable: list[str], pending: list[str]) -> None:
        """The seed's onPartitionStart (see the module docstring)."""
        if part.start_inflight or part.reduce_inflight:
            return
        if part.start is StartPhase.UNDECIDED:
            self._clear_stale_files(part)
            # Nothing to have lost on a founder's first start: its manager registered
            # after the table was created (placement simulator seed 63: two of three
            # founders took the restart path at creation and waited for ever).
            first = self._first_start(part, desc, stable, pending)
            lost = part.preexisting and not first and (
                self._in_memory(desc) or not self._has_log(part))
            if lost and self.id in stable:
                part.move(StartPhase.LOST)
            elif (lost and self.id in pending and len(set(pending) - {self.id}) > 0
                    and self._held_before(part)):
                # A member of pending only (learner, or promoted voter) that lost its
                # state: the same rule as for stable; leave pending, be re-added fresh.
                part.move(StartPhase.LEAVING)
            else:
                part.move(StartPhase.NORMAL)
            if part.start.restarting:
                self.metrics["restarts_detected"] += 1
                log.info("node %s: %s lost its state (%s): safe restart", self.id, part.group,
                         "in-memory" if self._in_memory(desc) else "no local log")
        if part.start is StartPhase.NORMAL:
            founders = desc.initial[part.index]
            # Founders bootstrap the founding configuration only on their first start
            # (a founder removed and re-added in the same incarnation bootstrapped it
            # again and, with another stale member, won a term: placement simulator,
            # seed 646). Over a log of its own a bootstrap was taken for a no-op, but a
            # log that exists and is empty (a re-added founder removed before it received
            # an entry) took the founding configuration, and with an empty joiner's vote
            # the founder led a second history: seed 2807, two different entries
            # committed at one index. Any other start joins (over its log, if it has one).
            first = self._first_start(part, desc, stable, pending)
            self._start_with_holds(part, desc, list(founders)
                                   if self.id in founders and first else None)
            return
        reduce = self._nodes(part.sw.reduce)
        if self.id not in stable:
            if part.start is StartPhase.LEAVING:
                self._leave_pending(part)
                return
            if self.id in reduce or self._revision < part.left_at:
                # stable without us is written together with reduce (or our own
                # leave-pending invoke has not reached our cache yet)
                self._wait(part)
                return
            # Removed from the configuration (stable excludes us only once a configuration
            # without us applied), and now in pending: come back as a fresh learner.
            part.move(StartPhase.NORMAL)
            self.metrics["partitions_rejoined"] += 1
            log.info("node %s: %s re-added after its removal: joining empty", self.id,
                     part.group)
            self._start_with_holds(part, desc, None)
            return
        majority = self._majority_available(part, stable, reduce)
        if not majority and self._restart_epoch(part, self._kv) is not None:
            self._full_restart(part, desc)
        elif self.id in reduce or part.start is StartPhase.RECORDED:
            self._wait(part)  # the leader removes us
        elif majority:
            self._add_to_switch_reduce(part)
        else:
            self._wait(part)  # neither: retry later

    def _first_start(self, part: PartitionState, desc: TableDescriptor, stable: list[str],
                     pending: list[str]) -> bool:
        """A founder's first start of the partition: stable is still the founding
        assignment, nothing is pending, no holds key names us and none carries a full
        restart's epoch. A node writes its holds key before it first hosts a group and
        removes it only when it stops hosting, once a configuration without it applied;
        to be in stable again it must be re-added, as an empty joiner that writes its key
        again. So a founder in the founding stable with no key never started the group:
        it voted and acknowledged nothing, and may bootstrap the founding configuration
        every founder's log begins with.

        Without "the founding stable, nothing pending" this is not so: a founder that was
        removed (its key deleted) and is named by pending again bootstrapped the founding
        configuration, and with another such founder elected a second leader in a term
        (placement simulator, seed 917)."""
        if sorted(stable) != sorted(desc.initial[part.index]) or pending:
            return False
        h = self._kv.get(holds_key(part.table, part.index, self.id))
        if h is not None and h.value and h.value.split(b"/")[0] != self.incarnation:
            return False  # (a key of this incarnation is this start's own)
        if self._kv.get(part.keys.epoch) is not None:
            return False  # a full restart began another history
        prefix = holds_prefix(part.table, part.index)
        return not any(b"/" in v.value for v in self._kv.holds_of(prefix).values())

    def _held_before(self, part: PartitionState) -> bool:
        """Our holds key names an earlier incarnation: we hosted the partition before
        this start and never stopped hosting it (a stop removes the key)."""
        h = self._kv.get(holds_key(part.table, part.index, self.id))
        return (h is not None and bool(h.value)
                and h.value.split(b"/")[0] != self.incarnation)

    def _leave_pending(self, part: PartitionState) -> None:
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
            if res.tag == DROPPED or not self._current(part):
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
            part.move(StartPhase.LEFT)
            part.left_at = revision
            self._backoff(part, "reduce").succeeded()
            self._kick(part.group)

        def fail(exc: BaseException | None) -> None:
            part.reduce_inflight = False
            self._failed(part, "reduce", exc or RuntimeError("?"))

        attempt()

    def _add_to_switch_reduce(self, part: PartitionState) -> None:
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
            if f.result().tag == DROPPED or not self._current(part):
                part.reduce_inflight = False
                return
            if f.result().tag != 1:
                self.metrics["switch_reduce_retries"] += 1
                attempt()  # switch.reduce moved since our read
                return
            part.reduce_inflight = False
            if part.start.restarting:  # (a full restart may have finished meanwhile)
                part.move(StartPhase.RECORDED)
            self._backoff(part, "reduce").succeeded()
            self.metrics["switch_reduce_added"] += 1
            log.info("node %s: %s recorded in switch.reduce; not starting it", self.id,
                     part.group)
            self._kick(part.group)

        def fail(exc: BaseException | None) -> None:
            part.reduce_inflight = False
            self._failed(part, "reduce", exc or RuntimeError("?"))

        attempt()

    def _declare_lost(self, part: PartitionState) -> None:
        """Bug C's in-memory case (``_reconcile``): record our loss in switch.reduce once
        per incarnation, and take the restart path from then on, so that when pending
        names us again we join as a fresh learner (never leave pending as a lost
        pending-only member)."""
        if (part.start in (StartPhase.LOST, StartPhase.RECORDED) or part.reduce_inflight or self.id in self._nodes(part.sw.reduce)):
            return
        part.move(StartPhase.LOST)
        self.metrics["restarts_detected"] += 1
        log.info("node %s: %s lost its state while the configuration may count on it "
                 "(hosted before this start, in neither stable nor pending)", self.id,
                 part.group)
        self._add_to_switch_reduce(part)

    # ======================= loop thread: the lone holder of a two-voter configuration ==
    def _survivor_case(self, part: PartitionState, g: Group, lost: str,
                       kv: dict[bytes, VersionedValue]) -> bool:
        """The metastore side of the rule (module docstring): ``lost`` declared the loss
        of its state and does not hold it, we hold ours and no removal of us can have
        been made from a configuration of our log (B)."""
        def nodes(key: bytes) -> list[str]:
            v = kv.get(key)
            return decode_nodes(v.value) if v is not None else []

        reduce, stable, pending = (nodes(part.sw.reduce), nodes(part.keys.stable),
                                   nodes(part.keys.pending))
        return (lost in reduce and self.id not in reduce and self.id in stable
                and (not pending or self.id in pending
                     or not set(pending) <= g.raft.voters_since_commit())
                and not self._holds(part, lost, kv) and self._holds(part, self.id, kv))

    def _maybe_survive(self, part: PartitionState, g: Group) -> None:
        """Not the leader of a two-voter configuration {us, lost} whose other voter
        declared the loss of its state: confirm on a linearizable read, then run a
        survivor election (``Raft.campaign_without``), at most once per two election
        timeouts."""
        voters = g.raft.conf.voters
        if part.survive_inflight or len(voters) != 2 or self.id not in voters:
            return
        (lost,) = voters - {self.id}
        if not self._survivor_case(part, g, lost, self._kv):
            return
        if self.node.clock() < part.survive_after:
            self._wait(part)
            return
        part.survive_inflight = True
        keys = [part.sw.reduce, part.keys.stable, part.keys.pending,
                holds_key(part.table, part.index, lost), incarnation_key(lost),
                holds_key(part.table, part.index, self.id), incarnation_key(self.id),
                part.keys.applied]

        def read(f: Future[Any]) -> None:
            part.survive_inflight = False
            exc = f.exception()
            if exc is not None:
                self._failed(part, "survive", exc)
                return
            kv = {k: v for k, v in zip(keys, f.result(), strict=True) if v is not None}
            now_g = self.node.groups.get(part.group) if part.group in self._hosted else None
            if (not self._current(part) or now_g is not g or g.raft.role == Role.LEADER
                    or g.raft.conf.voters != voters or not self._survivor_case(part, g, lost, kv)):
                self._kick(part.group)
                return
            part.survive_after = self.node.clock() + 2 * self.node.cfg.election_tick * \
                self.node.cfg.tick_seconds
            applied = kv.get(part.keys.applied)
            learned = decode_applied(applied.value) if applied is not None else None
            if learned is not None and g.raft.learn_commit(*learned):
                # The last change's leader saw this configuration entry commit; a lost
                # notice (or that leader's crash) left our commit index below it, and
                # with it a removed member in our electorate (placement simulator seed
                # 1187: {n2, n3, n4} -> {n2, n4} committed, n4 wiped, n3 gone).
                self.metrics["commits_learned"] += 1
                log.info("node %s: %s: commit index %d learned from the metastore",
                         self.id, part.group, learned[0])
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

    def _full_restart(self, part: PartitionState, desc: TableDescriptor) -> None:
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
            kv = KeyCache(f.result().items)
            st = self._kv.get(part.keys.stable)
            epoch = self._restart_epoch(part, kv)
            if epoch is None or st is None:
                part.start_inflight = False
                self._kick(part.group)
                return
            # Every node's holds key as read, and those of the members named by stable and
            # pending even if their incarnation key came after the read (a joiner that
            # registered since: found in review), and the epoch key.
            nodes = {k[len(INCARNATION_PREFIX):].decode() for k in kv
                     if k.startswith(INCARNATION_PREFIX)}
            nodes |= set(self._nodes(part.keys.stable) + self._nodes(part.keys.pending))
            ev = self._kv.get(part.keys.epoch)
            conds = [Cond.revision(part.keys.stable).eq(st.mod_revision),
                     Cond.value(incarnation_key(self.id)).eq(self.incarnation),
                     Cond.exists(table_key(part.table)),
                     Cond.revision(part.keys.epoch).eq(ev.mod_revision if ev else 0)]
            for n in sorted(nodes):
                hk = holds_key(part.table, part.index, n)
                conds.append(Cond.revision(hk).eq(kv[hk].mod_revision if hk in kv else 0))
            voters = decode_nodes(st.value)
            # The old history's last commit record must not name an entry of the new one.
            ops = [Op.put(holds_key(part.table, part.index, self.id),
                          self.incarnation + b"/" + epoch), Op.remove(part.keys.applied)]
            if epoch == self.incarnation:  # a new history (not a late founder's of one)
                ops.append(Op.put(part.keys.epoch, epoch))
            self._on_loop(self.meta.invoke(conds, ops), lambda r: written(r, voters))

        def written(f: Future[Any], voters: list[str]) -> None:
            if self._past_budget(part, f):
                # Kicked, the next reconcile would rewrite our holds key without the
                # restart's epoch and join instead of bootstrapping (found in review).
                self._queue_start(lambda: written(f, voters))
                return
            part.start_inflight = False
            exc = f.exception()
            if exc is not None:
                fail(exc)
                return
            if not f.result().succeeded or not self._current(part):
                self._kick(part.group)  # something moved: decide again
                return
            part.move(StartPhase.NORMAL)
            self.metrics["full_restarts"] += 1
            log.warning("node %s: %s full-partition restart: no replica holds its state, so "
                        "it starts empty (what it held is lost); bootstrapping %s", self.id,
                        part.group, voters)
            self._start_partition(part, desc, voters)

        def fail(exc: BaseException) -> None:
            part.start_inflight = False
            self._failed(part, "start", exc)

        self._on_loop(self.meta.range(b"placement."), read)

    def _start_with_holds(self, part: PartitionState, desc: TableDescriptor,
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
            if self._past_budget(part, f):
                self._queue_start(lambda: done(f))  # still in flight: nothing else acts
                return
            part.start_inflight = False
            if not self._current(part):
                return  # the table was dropped meanwhile
            exc = f.exception()
            if exc is not None:
                self._failed(part, "start", exc)
                return
            if isinstance(f.result(), InvokeResult) and not f.result().succeeded:
                # The table is gone (the drop's event is on its way), or a full restart
                # began another history since the epoch was read: look again in a while.
                self._wait(part)
                return
            stable, pending = self._nodes(part.keys.stable), self._nodes(part.keys.pending)
            still = self.id in stable or self.id in pending or (not named and bool(pending))
            if part.group not in self._hosted and still:
                self._start_partition(part, desc, voters)
                if part.group not in self._hosted:
                    # Not started (a storage error, or its back-off): its retry timer kicks
                    # again. Kicked now, an immediate look would come straight back here
                    # and spin, without time passing (placement simulator, seed 35).
                    return
            self._kick(part.group)

        if (self._kv.get(key, EMPTY).value.split(b"/")[0] == self.incarnation
                and key not in self._releasing):
            done_f: Future[Any] = Future()
            done_f.set_result(None)
            done(done_f)
            return
        # A joiner's key names the history it joins (its epoch, if a full restart began
        # it), as a full restart's founders' keys do: restarted without its state later,
        # it then knows it took part in that history, acknowledged and voted in it, and
        # never joins it again as a late founder. Without the epoch it did, and with
        # another empty member bootstrapped a second history over acknowledged writes
        # (found from outside: an in-memory table restarted whole, a node added, two
        # members restarted).
        #
        # Guarded by the revision of the partition's epoch key as read (``PartitionKeys.
        # epoch``), which only a full restart writes: one committed between this read and
        # the write begins another history, and the key must not name the one before it
        # (found in review, for a joiner and for a founder's first start alike). Not by
        # the other nodes' holds keys: guarded by those, the founders' and restarted
        # members' concurrent writes (at a table's creation, at a whole restart) failed
        # one another, and each waited an election timeout.
        epoch_v = self._kv.get(part.keys.epoch)
        stable = self._nodes(part.keys.stable)
        if (voters is None and self.id not in stable
                and not any(self._holds(part, n) and self._alive(n) for n in stable)
                and (self._in_memory(desc) or not self._has_log(part))):
            # A joiner without state (named by pending only), and no live member of
            # stable holds what it would catch up from: it waits for one (a full
            # restart's founders, or a holder back up). Written now, its key made it a
            # holder of the history before any restart, and no founder could begin one:
            # the partition waited for good (found in review, also for a table created
            # after the joiner started, and for a holder that was down). (A founder that
            # has not started yet is a member of stable: it never waits here.)
            part.start_inflight = False
            self._wait(part)
            return
        epoch = self._history_epoch(part)
        value = self.incarnation + b"/" + epoch if epoch else self.incarnation
        conds = [Cond.exists(table_key(part.table)),
                 Cond.revision(part.keys.epoch).eq(epoch_v.mod_revision if epoch_v else 0)]
        self._on_loop(self.meta.invoke(conds, [Op.put(key, value)]), done)

    def _history_epoch(self, part: PartitionState) -> bytes:
        """The epoch of the partition's current history (b"" for the history before any
        full restart): its epoch key's, or (a full restart recorded before epoch keys)
        the one its holders' keys carry. Every holder is of one history, since a full
        restart begins only when nobody holds the state."""
        got = self._kv.get(part.keys.epoch)
        if got is not None:
            return got.value
        prefix = holds_prefix(part.table, part.index)
        for k, v in self._kv.holds_of(prefix).items():
            inc = self._kv.get(INCARNATION_PREFIX + k[len(prefix):])
            inc_id, _, epoch = v.value.partition(b"/")
            if epoch and inc is not None and inc.value == inc_id:
                return epoch
        return b""

