"""Failure detection for placement, and the *data nodes* partitions are placed on.

Model
-----
Ignite 3 places a distribution zone's partitions on its *data nodes*: the logical
topology, adjusted by two timers (the data nodes auto-adjust of its
DistributionZoneManager). A node that left is dropped from the data nodes once
``dataNodesAutoAdjustScaleDown`` seconds pass without it coming back; a node that joined is
added after ``dataNodesAutoAdjustScaleUp``. The assignments are then recomputed from the
data nodes and move through the ordinary rebalance (stable, pending, planned). raftkv does
the same: ``data_nodes`` is the placement topology (``placement.nodes``, what the operator
asked for) without the nodes declared dead (``placement.dead``), and step (1), IGNITE-16668's
switch and a new table's initial assignment all place partitions on it. A dead node's
partitions then regain their replica count on the live nodes through the existing
protocol, in its order: learners are added and caught up first, and changePeers removes
departed voters before live ones and the leader last, never leaving the voters without a
quorum of live members (``change_peers``, the strict reconfiguration check).

One authority, on its own clock
-------------------------------
As with CockroachDB's node liveness, who is alive is one record per node, decided by one
authority and written down; no replica infers it from its own clock. The authority is the
metastore leader. Every few ticks it looks at whom its transport has heard from within one
*lease* (the election timeout: the silence after which the driver reports a peer down)
and moves each topology node's record (``placement.liveness.<node>``,
``LivenessRecord``):

- ``alive`` to ``suspect``: not heard from for a lease. Nothing acts on suspicion.
- ``suspect`` to ``alive``: heard from again.
- ``suspect`` to ``dead``: silent for ``scale_down_timeout`` seconds more, counted on this
  leader's clock from the later of the first silence it saw and its own election. A new
  leader restarts every timer, since it cannot know how long a node was silent before;
  etcd extends leases by an election timeout on a leader change for the same reason. The
  same invoke adds the node to ``placement.dead``.
- ``dead`` to ``alive``: heard from without a break for ``scale_up_timeout`` seconds; the
  same invoke removes it from ``placement.dead``. A node that comes and goes around the
  timeouts therefore moves its replicas at most once per ``scale_down_timeout +
  scale_up_timeout``, not on every flap.

The record's ``epoch`` counts the node's incarnations (each start of a node writes a new
``placement.incarnation.<node>``): a record written for an earlier incarnation says
nothing about the current one.

Guard rails
-----------
- Nothing is declared dead while the leader hears from fewer than a majority of the
  topology's nodes not already declared dead: it is then more likely to be the one cut
  off. Counting the dead in that majority would stop the healing once failures add up
  (with three founders and three spares, two founders declared dead and healed, a third
  node SIGKILLed stayed ``suspect`` for good: the leader heard 3 of 6).
- The data nodes are never empty: if every node were dead, the topology stands.
- ``scale_down_timeout = 0`` turns automatic removal off: no node is declared dead, and
  the dead ones return to the data nodes.
- Every write is an invoke guarded by the revisions the leader read (the node's record,
  ``placement.dead`` and the topology), so a deposed leader that has not yet noticed cannot
  overwrite its successor's decision.

The metastore follows the cluster
--------------------------------
The metastore's voters start as the founders; every other node hosts a non-voting replica.
The same leader keeps ``metastore_voters`` (3, or 5) of them on nodes that are not dead or
draining, one membership change at a time (``_maintain_metastore``):

1. a voter is *unfit* once it is dead or draining (never on suspicion alone);
2. while fewer than ``metastore_voters`` voters are fit, the first spare in id order (a
   replica that is a data node, heard from within a lease and holding the commit index)
   is promoted: to replace an unfit voter, or to fill up a metastore founded with fewer
   nodes (one, then the others added) or whose setting was raised, up to the largest odd
   count the fit voters and spares reach (never two voters of two nodes);
3. then an unfit voter is demoted to a learner, if the voters left are still
   ``metastore_voters`` and have a quorum of live members. A demoted node keeps its
   replica: if it comes back it reads the metastore again, and is a spare in its turn;
A lowered setting demotes nobody: the extra voters stay until a replacement (step 2)
or a drain takes one. A step that demoted them was tried and left out: demoting the
spare promoted for a voter that came back before it was demoted changed the simulator's
course, and placement seed 5176 (every fault) then left a partition's stable above its
assignment for good, a stuck state of the rebalance that this step only made reachable.

Without a spare (three nodes, one dead) nothing changes: demoting the dead voter would not
make the two left any less dependent on each other, and would leave the metastore one vote
short when it returns. With a spare, losing any founder for good costs nothing once the
spare has been promoted; a second loss then leaves a quorum.

Drain
-----
``PlacementManager.drain`` takes a node out of the topology and adds it to
``placement.draining`` in one invoke. Its partitions move to the other data nodes (the
ordinary rebalance; a leader being removed hands its leadership over first); as a voter it
is unfit, so step 2 and 3 move its metastore vote to a spare. Once no partition names it
and it hosts none (no holds key of its current incarnation) or is dead, the leader removes
its metastore replica and forgets it. A draining node is watched as the topology's nodes
are, and declared dead the same way: one that dies before it has stopped hosting would
otherwise hold its drain open for good, shown alive (found from outside). With
``scale_down_timeout = 0`` nobody is declared dead, so such a drain waits for the node to
come back. ``remove-node`` is a drain without its replica-count refusal (the node may be
lost for good), so a removed node leaves the metastore too. Draining a metastore voter
when there is no spare moves its partitions but leaves its vote (status shows
``"metastore": "voter"``). A drained node that keeps running no longer hears the
metastore: stop it. The default KV group is not touched (``raftkv cluster remove``).

The settings live in ``placement.settings`` (``ClusterSettings``): one value for the whole
cluster, set by ``PUT /v1/cluster/settings`` or ``raftkv cluster settings``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

import msgpack

from raftkv.core import ConfChange, ConfChangeOp, Raft, Role
from raftkv.core.quorum import has_quorum
from raftkv.placement.assignments import decode_nodes, encode_nodes
from raftkv.placement.catalog import (
    DEAD_KEY,
    DRAINING_KEY,
    HOLDS_PREFIX,
    INCARNATION_PREFIX,
    LIVENESS_PREFIX,
    SETTINGS_KEY,
    TOPOLOGY_KEY,
    liveness_key,
)
from raftkv.placement.manager_base import ManagerBase, conf_settled
from raftkv.placement.meta_commands import Cond, InvokeResult, Op, VersionedValue

log = logging.getLogger(__name__)

# How often the metastore leader looks (seconds of its clock).
LIVENESS_PERIOD = 0.5
# The settings' bounds: a timeout above a week is a typo, not a policy.
MAX_TIMEOUT = 7 * 24 * 3600.0
MAX_MOVES = 10_000


class LivenessState(Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass(frozen=True)
class LivenessRecord:
    state: LivenessState
    epoch: int  # the number of incarnations of the node this record has named
    incarnation: bytes  # the one it names now (b"" before the node registered one)
    since: float  # wall-clock time the state began, for people reading status only

    def encode(self) -> bytes:
        return msgpack.packb({"state": self.state.value, "epoch": self.epoch,
                              "incarnation": self.incarnation, "since": self.since},
                             use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> LivenessRecord:
        try:
            d = msgpack.unpackb(raw, raw=False)
            rec = cls(LivenessState(d["state"]), d["epoch"], d["incarnation"], d["since"])
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed liveness record: {e}") from None
        if (type(rec.epoch) is not int or not isinstance(rec.incarnation, bytes)
                or not isinstance(rec.since, (int, float))):
            raise ValueError("malformed liveness record")
        return rec


@dataclass(frozen=True)
class ClusterSettings:
    """Cluster-wide placement settings (see the module docstring; ``max_moves`` and
    ``catch_up_timeout`` are ``change_peers``'s "Moving data at a bounded rate")."""

    scale_down_timeout: float = 30.0  # seconds of silence before a node is dead; 0: never
    scale_up_timeout: float = 5.0  # seconds a dead node must be heard from to count again
    metastore_voters: int = 3  # how many voters the metastore keeps (3 or 5)
    max_moves: int = 8  # partitions a leader adds replicas to at once; 0: no limit
    catch_up_timeout: float = 60.0  # seconds a new replica has to catch up; 0: no limit

    def encode(self) -> bytes:
        return json.dumps({"scale_down_timeout": self.scale_down_timeout,
                           "scale_up_timeout": self.scale_up_timeout,
                           "metastore_voters": self.metastore_voters,
                           "max_moves": self.max_moves,
                           "catch_up_timeout": self.catch_up_timeout}).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> ClusterSettings:
        """The stored settings; the defaults when there are none or they do not parse (a
        node must keep placing partitions whatever a bad write left there). A field an
        older version did not write keeps its default."""
        if not raw:
            return cls()
        try:
            body = json.loads(raw)
            if isinstance(body, dict):
                # A field a newer version wrote is not ours to refuse: the ones we know
                # must keep their values through a rolling upgrade.
                body = {k: v for k, v in body.items() if k in _FIELDS}
            return cls().update(body)
        except ValueError:
            return cls()

    def update(self, body: object) -> ClusterSettings:
        """These settings with ``body``'s fields changed; ``ValueError`` naming the field
        for anything but a known field set to a valid value: a timeout is a finite number
        of seconds in [0, MAX_TIMEOUT], ``metastore_voters`` 3 or 5, ``max_moves`` an
        integer in [0, MAX_MOVES]."""
        if not isinstance(body, dict) or not body:
            raise ValueError('expected a JSON object of settings: "scale_down_timeout", '
                             '"scale_up_timeout", "catch_up_timeout" (seconds), '
                             '"metastore_voters" (3 or 5), "max_moves" (partitions)')
        out = self
        for name, value in body.items():
            if name == "metastore_voters":
                if type(value) is not int or value not in (3, 5):
                    raise ValueError(f"metastore_voters must be 3 or 5, got {value!r}")
                out = replace(out, metastore_voters=value)
                continue
            if name == "max_moves":
                if type(value) is not int or not 0 <= value <= MAX_MOVES:
                    raise ValueError(f"max_moves must be an integer between 0 (no limit) "
                                     f"and {MAX_MOVES}, got {value!r}")
                out = replace(out, max_moves=value)
                continue
            if name not in ("scale_down_timeout", "scale_up_timeout", "catch_up_timeout"):
                raise ValueError(f"unknown setting {name!r}")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or not 0 <= value <= MAX_TIMEOUT):
                raise ValueError(f"{name} must be a number of seconds between 0 and "
                                 f"{MAX_TIMEOUT:.0f}, got {value!r}")
            seconds = float(value)
            if name == "scale_down_timeout":
                out = replace(out, scale_down_timeout=seconds)
            elif name == "scale_up_timeout":
                out = replace(out, scale_up_timeout=seconds)
            else:
                out = replace(out, catch_up_timeout=seconds)
        return out


_FIELDS = frozenset(f.name for f in fields(ClusterSettings))


def data_nodes(topo: VersionedValue | None, dead: VersionedValue | None,
               ) -> tuple[list[str], int]:
    """The nodes partitions are placed on (the topology without the dead, never empty)
    and the revision that decided them (a trigger source for step (1))."""
    nodes = decode_nodes(topo.value) if topo is not None else []
    gone = set(decode_nodes(dead.value)) if dead is not None else set()
    live = [n for n in nodes if n not in gone]
    return (live or nodes), max(topo.mod_revision if topo is not None else 0,
                                dead.mod_revision if dead is not None else 0)


class Liveness(ManagerBase):
    """The metastore leader's failure detector (see the module docstring)."""

    _live_term: int | None
    _silent_since: dict[str, float]
    _heard_since: dict[str, float]
    _liveness_inflight: bool
    _meta_change_inflight: bool

    def _start_liveness(self) -> None:
        self._live_term = None
        self._silent_since, self._heard_since = {}, {}
        self._liveness_inflight = False
        self._meta_change_inflight = False
        self._timer.after(LIVENESS_PERIOD, lambda: self._defer(self._liveness_tick))

    # (revision, settings): every leader's change reads them at each step, and decoding
    # is a JSON parse.
    _settings_at: tuple[int, ClusterSettings] | None = None

    def _settings(self) -> ClusterSettings:
        v = self._kv.get(SETTINGS_KEY)
        rev = v.mod_revision if v is not None else 0
        if self._settings_at is None or self._settings_at[0] != rev:
            self._settings_at = (rev, ClusterSettings.decode(v.value if v is not None else None))
        return self._settings_at[1]

    def _liveness_record(self, node: str) -> LivenessRecord | None:
        v = self._kv.get(liveness_key(node))
        if v is None or not v.value:
            return None
        try:
            return LivenessRecord.decode(v.value)
        except ValueError:
            return None  # rewritten at the next look

    def _liveness_tick(self) -> None:
        self._timer.after(LIVENESS_PERIOD, lambda: self._defer(self._liveness_tick))
        self._sweep_holds()  # every node's own keys, leader or not
        g = self.node.groups.get(self.meta.group)
        if g is None or g.raft.role != Role.LEADER or not self._synced:
            self._live_term = None
            return
        now = self.node.clock()
        if self._live_term != g.raft.term:  # a new leader restarts every timer
            self._live_term = g.raft.term
            self._silent_since, self._heard_since = {}, {}
        topo = self._nodes(TOPOLOGY_KEY)
        draining = set(self._nodes(DRAINING_KEY))
        # A draining node is out of the topology but watched until it leaves: it may die
        # before it has stopped hosting its partitions, and only its death, declared as
        # any node's is, lets its drain finish (found from outside: a node SIGKILLed
        # during its drain was shown alive, and draining, for good).
        watched = sorted(set(topo) | draining)
        lease = self.node.lease_seconds()
        heard = {n: self.node.heard_from(n, lease) for n in watched}
        for n, h in heard.items():
            if h:
                self._silent_since.pop(n, None)
                self._heard_since.setdefault(n, now)
            else:
                self._heard_since.pop(n, None)
                self._silent_since.setdefault(n, now)
        if self._liveness_inflight:
            return
        settings = self._settings()
        dead = set(self._nodes(DEAD_KEY))
        counted = [n for n in topo if n not in dead]
        may_declare = sum(heard[n] for n in counted) >= len(counted) // 2 + 1
        for n in watched:
            rec = self._liveness_record(n)
            state = self._decide(n, rec, heard[n], n in dead, settings, may_declare, now)
            inc_v = self._kv.get(INCARNATION_PREFIX + n.encode())
            inc = inc_v.value if inc_v is not None else b""
            if rec is not None and rec.state == state and rec.incarnation == inc and (
                    (state == LivenessState.DEAD) == (n in dead)):
                continue
            self._write_liveness(n, rec, state, inc, dead)
            return  # one write at a time; the next look continues
        stale = dead - set(watched)  # left the topology (and drained, if it was) while dead
        # Taken out of the topology alive and not draining: no look keeps its record,
        # which would show "alive" for ever.
        gone = {k[len(LIVENESS_PREFIX):].decode(errors="replace")
                for k in self._kv if k.startswith(LIVENESS_PREFIX)} - set(watched) - dead
        if stale or gone:
            self._write_dead(dead - stale,
                             [Op.remove(liveness_key(n)) for n in sorted(stale | gone)])
            return
        self._maintain_metastore(g.raft, settings, dead, lease)

    # ================================================ the metastore follows the cluster ===
    def _maintain_metastore(self, raft: Raft, settings: ClusterSettings, dead: set[str],
                            lease: float) -> None:
        """One step, if one is due (see "The metastore follows the cluster")."""
        if self._meta_change_inflight or not conf_settled(raft):
            return
        conf = raft.conf
        voters, learners = set(conf.voters), set(conf.learners)
        draining = set(self._nodes(DRAINING_KEY))
        committed = raft.log.committed

        def live(n: str) -> bool:
            return n == raft.id or (self.node.heard_from(n, lease) and n in raft.prs
                                    and raft.prs[n].match >= committed)

        unfit = voters & (dead | draining)
        fit = voters - unfit
        data, _ = data_nodes(self._kv.get(TOPOLOGY_KEY), self._kv.get(DEAD_KEY))
        spare = sorted(n for n in learners
                       if n in data and n not in draining and n not in dead and live(n))
        # Also with no voter unfit: a cluster founded with fewer nodes (one node, then
        # the others added), or the setting raised to 5. Step 2 waited for an unfit
        # voter, so such a metastore kept its one voter for good, and losing it stopped
        # placement (found outside-in). Filling up aims at an odd count the spares can
        # reach: two voters of two nodes would stop at either's loss where one stops only
        # at its own, and a fourth voter of four nodes tolerates no more than three do
        # and leaves no spare for a drain (found in review).
        goal = settings.metastore_voters
        if not unfit:
            goal = min(goal, len(fit) + len(spare))
            goal -= 1 - goal % 2
        if len(fit) < goal and spare:
            why = (f"to replace {', '.join(sorted(unfit))}" if unfit else
                   f"to reach {goal} voters")
            self._meta_change(ConfChange(ConfChangeOp.PROMOTE, spare[0]), why)
            return
        for u in sorted(unfit):
            rest = voters - {u}
            if len(rest) >= settings.metastore_voters and has_quorum(
                    rest, {n for n in rest if live(n)}):
                self._meta_change(ConfChange(ConfChangeOp.DEMOTE, u),
                                  "dead" if u in dead else "draining")
                return
        topo = set(self._nodes(TOPOLOGY_KEY))
        for n in sorted(draining):
            if n in voters or self._replicas_on(n) or (
                    n in learners and n not in dead and self._hosting(n)):
                # Not demoted yet, partitions still moving off it, or a live node that has
                # not stopped hosting them yet: out of the metastore it would never see
                # that they moved, and would keep them as stale replicas. Once out of the
                # metastore (removed while a start's holds key was still on its way,
                # placement simulator seed 420) its keys can never be released by it, and
                # waiting on them would hold the drain open for good: it is forgotten.
                continue
            if n in learners:
                self._meta_change(ConfChange(ConfChangeOp.REMOVE, n), "drained")
                return
            if n not in topo:  # done: forget it
                self._write_draining(draining - {n}, [Op.remove(liveness_key(n))])
                return

    def _replicas_on(self, node: str) -> int:
        """How many partitions name ``node`` in stable, pending or planned (the cache)."""
        return sum(1 for p in self._parts.values()
                   if any(node in self._nodes(k)
                          for k in (p.keys.stable, p.keys.pending, p.keys.planned)))

    def _hosting(self, node: str) -> bool:
        """Whether ``node`` hosts a partition in its current incarnation (its holds keys:
        written before it starts a partition's group, removed when it stops it)."""
        inc = self._kv.get(INCARNATION_PREFIX + node.encode())
        suffix = b"." + node.encode()
        return inc is not None and any(
            k.startswith(HOLDS_PREFIX) and k.endswith(suffix)
            and v.value.split(b"/")[0] == inc.value for k, v in self._kv.items())

    def _meta_change(self, cc: ConfChange, why: str) -> None:
        self._meta_change_inflight = True
        log.info("node %s: metastore: %s (%s)", self.id, cc.describe(), why)
        self.metrics[f"metastore.{cc.op.name.lower()}"] += 1

        def done(f: Future[Any]) -> None:
            self._meta_change_inflight = False
            exc = f.exception()
            if exc is not None:  # refused for now (a transfer, an unrecorded learner)
                log.info("node %s: metastore %s: %s", self.id, cc.describe(), exc)
                self.metrics["errors.metastore_change"] += 1

        self._on_loop(self.node.change_membership(self.meta.group, cc), done)

    def _write_draining(self, want: set[str], ops: list[Op]) -> None:
        cur = self._kv.get(DRAINING_KEY)
        self._liveness_inflight = True

        def done(f: Future[Any]) -> None:
            self._liveness_inflight = False
            if f.exception() is not None:
                self.metrics["errors.liveness"] += 1

        self._on_loop(self.meta.invoke(
            [Cond.revision(DRAINING_KEY).eq(cur.mod_revision if cur is not None else 0)],
            ops + [Op.put(DRAINING_KEY, encode_nodes(want))]), done)

    def _decide(self, node: str, rec: LivenessRecord | None, heard: bool, is_dead: bool,
                settings: ClusterSettings, may_declare: bool, now: float) -> LivenessState:
        was_dead = is_dead or (rec is not None and rec.state == LivenessState.DEAD)
        if settings.scale_down_timeout == 0:
            return LivenessState.ALIVE if heard else LivenessState.SUSPECT
        if heard:
            back = now - self._heard_since[node] >= settings.scale_up_timeout
            return LivenessState.DEAD if was_dead and not back else LivenessState.ALIVE
        if was_dead:
            return LivenessState.DEAD
        silent = now - self._silent_since[node]
        if may_declare and silent >= settings.scale_down_timeout:
            return LivenessState.DEAD
        return LivenessState.SUSPECT

    def _write_liveness(self, node: str, rec: LivenessRecord | None, state: LivenessState,
                        inc: bytes, dead: set[str]) -> None:
        epoch = (rec.epoch if rec is not None else 0) + (
            1 if rec is None or (inc and rec.incarnation != inc) else 0)
        since = rec.since if rec is not None and rec.state == state else time.time()
        new = LivenessRecord(state, epoch, inc, since)
        key = liveness_key(node)
        cur = self._kv.get(key)
        conds = [Cond.revision(key).eq(cur.mod_revision if cur is not None else 0)]
        ops = [Op.put(key, new.encode())]
        want = (dead | {node}) if state == LivenessState.DEAD else (dead - {node})
        if rec is None or rec.state != state:
            log.info("node %s: %s is %s (epoch %d)", self.id, node, state.value, epoch)
            self.metrics[f"liveness.{state.value}"] += 1
        self._write_dead(want, ops, conds)

    def _write_dead(self, want: set[str], ops: list[Op],
                    conds: list[Any] | None = None) -> None:
        """One invoke: ``ops``, and ``placement.dead := want`` if that changes it, guarded
        by the revisions this leader read."""
        dead_v, topo_v = self._kv.get(DEAD_KEY), self._kv.get(TOPOLOGY_KEY)
        conds = list(conds or []) + [
            Cond.revision(DEAD_KEY).eq(dead_v.mod_revision if dead_v is not None else 0),
            Cond.revision(TOPOLOGY_KEY).eq(topo_v.mod_revision if topo_v is not None else 0)]
        if want != set(self._nodes(DEAD_KEY)):
            ops = ops + [Op.put(DEAD_KEY, encode_nodes(want))]
        self._liveness_inflight = True

        def done(f: Future[Any]) -> None:
            self._liveness_inflight = False
            exc = f.exception()
            if exc is not None:
                log.info("node %s: liveness write failed: %s", self.id, exc)
                self.metrics["errors.liveness"] += 1
            elif isinstance(f.result(), InvokeResult) and not f.result().succeeded:
                self.metrics["liveness_conflicts"] += 1  # read again at the next look

        self._on_loop(self.meta.invoke(conds, ops), done)

    def _liveness_status(self) -> list[dict[str, Any]]:
        """Every topology node's record, as status() and ``/v1/cluster/nodes`` show it."""
        topo = self._nodes(TOPOLOGY_KEY)
        data, _ = data_nodes(self._kv.get(TOPOLOGY_KEY), self._kv.get(DEAD_KEY))
        draining = set(self._nodes(DRAINING_KEY))
        g = self.node.groups.get(self.meta.group)
        conf = g.raft.conf if g is not None else None
        out = []
        known = sorted(set(topo) | draining | {
            k[len(LIVENESS_PREFIX):].decode(errors="replace")
            for k in self._kv if k.startswith(LIVENESS_PREFIX)})
        for n in known:
            rec = self._liveness_record(n)
            out.append({
                "id": n,
                "state": rec.state.value if rec is not None else "unknown",
                "epoch": rec.epoch if rec is not None else 0,
                "since": rec.since if rec is not None else None,
                "in_topology": n in topo,
                "data_node": n in data,
                "draining": n in draining,
                "replicas": self._replicas_on(n),
                "metastore": (None if conf is None else "voter" if n in conf.voters
                              else "learner" if n in conf.learners else None),
            })
        return out
