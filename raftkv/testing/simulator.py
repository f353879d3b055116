"""The seeded, randomized cluster simulator and its safety checker.

Theory of operation
-------------------
Everything runs in one process on a simulated clock (integer milliseconds) driven by an
event heap ordered by (time, sequence number). One ``random.Random(seed)`` makes every
choice, and nothing depends on set iteration order or wall time, so a seed replays the
same schedule exactly, in any process.

Event kinds:

- ``tick``: each live node ticks every ``tick_ms``.
- ``ready``: a node hands its Ready batch to "disk" (the memory store) ``disk_ms`` after
  it was first stepped. A crash in between loses whatever was stepped in but not yet
  persisted, as a real process would.
- ``deliver``: a message arrives. At send time the network may drop it, duplicate it or
  give it a random delay (which reorders); partitions, symmetric or one-way, are checked
  at delivery time.
- ``client``: each client runs one operation at a time (put, get via ReadIndex, or
  compare-and-set) against the node it believes leads, and gives up after a timeout,
  recording the outcome as unknown.
- ``fault``: partitions, crashes/restarts, membership changes (add a learner, promote,
  demote, remove, transfer leadership), log compaction, idle periods (``idle``:
  clients start nothing for a while, so groups quiesce while faults go on), and wipes
  (``wipe``: a crashed node loses its files, so it restarts later with a fresh storage
  and incarnation, a founder bootstrapping the founding configuration again, as a node
  started with its old arguments does). One wiped node at a time is left to be
  readmitted (``Simulation._wipe_pending``): a wipe is a failure, and Raft tolerates a
  minority of them.
- ``survive`` (opt in, ``SURVIVE_FAULTS``; meant for ``--nodes 2``): a voter b of a
  two-voter configuration {a, b} is crashed and wiped, and a runs survivor elections
  (``Raft.campaign_without(b)``, "The lone survivor of two voters") about once per
  election timeout, through the settle phase too, until b is out of the configuration
  or readmitted. Membership changes may then shrink a configuration to two voters
  (never to one, so no configuration removing a exists beyond a's log: the rule's
  assumption B), which brings the shapes the rule covers: changes under way from three
  voters, learners that may have been promoted. The checker also verifies that a
  survivor was granted by every voter since its commit index but b, and by the recorded
  learners of the two-voter ones, and lets its first entry follow one uncommitted
  change.

Quiescence is on (``SimConfig.quiesce``), so the core's liveness input is modelled
too: at each of its ticks a node's view of each peer ("down" when the peer crashed or
its messages are blocked to this node) catches up with the truth with probability
``liveness_catchup``, a random detection delay like a transport's keepalive timeout;
with probability ``liveness_false_down`` per tick a live peer is wrongly reported down
(a flapping connection). The reports reach the core as ``peer_down``/``peer_up``.

- ``lost`` (opt in): the settle phase below keeps one voter of the newest leader's
  configuration down for good (not after a wipe, not with ``survive``), and the others
  must still serve and converge: Raft's promise of progress to any live majority.

The run ends with a settle phase: faults stop, partitions heal, crashed nodes restart,
and the group must serve clients again (they keep calling for a quarter of it,
and at least one operation must complete) and converge. Without the first demand a
schedule that happened to keep a quorum down for the whole run made no progress and
failed no check.

Checks, after every event (each maps to a Raft property):

- election safety: at most one leader per term;
- log matching: every persisted entry extends a hash chain over its log prefix; two
  entries with the same (index, term) anywhere must have the same chain hash;
- leader completeness: a new leader's chain at the highest committed index equals the
  committed chain;
- state machine safety: every node applies the same entry at each index;
- no entry applied twice: each client command is applied at one index only, and each
  node applies contiguous indexes once per incarnation;
- no acknowledged write lost: at the end, every acknowledged write sits at its index in
  every converged node's applied log;
- at most one uncommitted configuration change in a leader's log;
- learners never counted: when a leader's commit index moves, a majority of its
  *voters* must hold the committed entry in their stores, and every new leader must hold
  votes from a majority of its voters, counted independently of the core's quorum code.

Finally the client history goes through the linearizability checker.
"""

from __future__ import annotations

import heapq
import math
import random
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raftkv.core import (
    ConfChange,
    ConfChangeOp,
    Entry,
    EntryType,
    Message,
    MessageType,
    RaftError,
    Role,
    bootstrap,
    decode_conf_entry,
)
from raftkv.server.lease_clocks import RELOAD_SECONDS, TICK_SECONDS, read_leases
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.revisions import KeyMeta
from raftkv.storage.txn import TxnResult
from raftkv.testing.kv_history import KvOp, check_kv_history, lease_liveness
from raftkv.testing.kv_node import KvSimNode, meta
from raftkv.testing.kv_workload import KvWorkload, encode
from raftkv.testing.linearizability import CheckResult, Operation, check_history
from raftkv.testing.node import ReadyOutcome, SimNode, StoreSimNode

ALL_FAULTS = ("drop", "dup", "delay", "partition", "crash", "membership", "compact", "idle",
              "wipe")
# Faults a run takes only when asked (``--faults``): adding one to ALL_FAULTS would change
# the schedule of every seed that ever found a bug. ``survive``: a voter of a two-voter
# configuration loses its state and the other one runs a survivor election.
# ``lost``: the settle phase keeps one voter down for good, and the others must serve.
OPT_IN_FAULTS = ("survive", "lost")
SURVIVE_FAULTS = ("drop", "dup", "delay", "partition", "crash", "membership", "compact",
                  "idle", "survive")


class SafetyViolation(Exception):
    pass


@dataclass
class SimConfig:
    nodes: int = 5
    steps: int = 2000  # ticks of simulated time (tick_ms each) before the settle phase
    faults: tuple[str, ...] = ALL_FAULTS
    clients: int = 4
    keys: int = 2
    tick_ms: int = 10
    election_tick: int = 10
    disk_ms: int = 1
    clock_skew: float = 0.3  # each node's tick period is tick_ms * U(1-skew, 1+skew)
    drop_rate: float = 0.03
    dup_rate: float = 0.02
    fault_every_ms: int = 150
    client_timeout_ms: int = 600
    settle_ms: int = 6000
    max_members: int = 7
    trace_lines: int = 60
    # Run nodes on the real storage path (GroupStorage, MemoryStateStore with
    # checkpoints that a crash rolls back to) instead of the plain dict state machine.
    state_store: bool = False
    # The KV API (implies the real storage path): revisions, transactions and leases,
    # with the leader's lease expiry, checked by ``raftkv.testing.kv_history``.
    kv_api: bool = False
    kv_keys: int = 3
    # Let idle groups quiesce (Config.quiesce) and model the liveness reports it needs.
    quiesce: bool = True
    liveness_catchup: float = 0.3
    liveness_false_down: float = 0.002
    idle_ms: tuple[int, int] = (200, 1500)  # length of an ``idle`` period
    # Give each core its storage's incarnation (Config.incarnation), as the driver does.
    identities: bool = True
    # A restarted voter campaigns on one of its first ticks (Config.early_campaign), as
    # the driver's nodes do.
    early_campaign: bool = True
    busy_ms: tuple[int, int] = (1000, 3000)  # load between two idle periods, at least


@dataclass
class _ClientOp:
    op_id: int
    kind: str
    key: str
    value: Any
    call: int
    node: str
    index: int = 0  # writes: the proposedIndex at ``node``
    term: int = 0
    ctx: Any = None  # reads: the ReadIndex context
    data: bytes = b""  # writes: the proposed command
    read_index: int = -1
    incarnation: int = 0  # ``expire``: the proposing node's, whose clocks hear back
    answer: Any = None  # ``keepalive``: the TTL, answered once the leadership is confirmed


@dataclass
class SimResult:
    seed: int
    violations: list[str] = field(default_factory=list)
    linearizability: CheckResult | None = None
    ops: int = 0
    committed: int = 0
    leaders: int = 0
    ticks: int = 0  # node ticks delivered
    quiet_ticks: int = 0  # of which the node was quiesced (so the tick did nothing)
    liveness_wakes: int = 0  # quiesced nodes woken by a peer_down/peer_up report
    losses: int = 0  # ``survive``: voters of a two-voter configuration lost
    survivor_elections: int = 0  # survivor elections started
    survivor_wins: int = 0  # of which won
    trace: list[str] = field(default_factory=list)

    @property
    def linearizable(self) -> bool:
        return self.linearizability is None or self.linearizability.ok


class Simulation:
    def __init__(self, seed: int, cfg: SimConfig | None = None) -> None:
        self.seed = seed
        self.cfg = cfg or SimConfig()
        self.rng = random.Random(seed)
        self.now = 0
        self._seq = 0
        self._events: list[tuple[int, int, str, Any]] = []
        self.trace: deque[str] = deque(maxlen=self.cfg.trace_lines)
        self.nodes: dict[str, SimNode] = {}
        self.tick_period: dict[str, int] = {}
        self._ready_scheduled: set[str] = set()
        self._next_node = self.cfg.nodes + 1
        self.blocked: set[tuple[str, str]] = set()
        self.faults = set(self.cfg.faults)
        self.settling = False
        self.settle_start = 0
        self.settle_calls_until = 0  # clients start operations until then while settling
        self.settled_ops = 0  # operations called and completed after the faults stopped
        # -- checker state --
        self.leader_of_term: dict[int, str] = {}
        # (node, term) -> (the voter's incarnation, whom it voted for). A wiped node has
        # forgotten its vote, so a new incarnation may vote again in a term.
        self.votes: dict[tuple[str, int], tuple[int, str]] = {}
        self.founders: list[str] = []
        self.wiped: set[str] = set()
        self.wipes = 0
        self.kept_down: str | None = None  # ``lost``: the voter the settle phase leaves down
        # ``survive``: (a, b) while b, lost, is in a's configuration; and per term of a
        # survivor election, (a, the members whose grants it needs, as counted here).
        self.lost: tuple[str, str] | None = None
        self.survivors: dict[tuple[int, str], frozenset[str]] = {}
        # The newest configuration any node applied: a node it does not count as a voter
        # was removed (nodes are never re-added), so it is no survivor (assumption B).
        self.committed_conf: tuple[int, frozenset[str]] = (0, frozenset())
        self.losses = self.survivor_wins = 0
        self._survivor_won: set[int] = set()
        self.chains: dict[str, dict[int, int]] = {}
        self.chain_at: dict[tuple[int, int], int] = {}
        self.committed: dict[int, tuple[int, bytes]] = {}
        self.committed_chain: dict[int, int] = {}
        self.max_committed = 0
        self.op_index: dict[tuple[int, int], int] = {}
        self.acked_writes: list[tuple[int, Any]] = []  # (index, operation identity)
        self.leader_commit: dict[str, int] = {}
        # -- clients --
        self.history: list[Operation] = []
        self.outstanding: dict[int, _ClientOp] = {}
        self.client_hint: dict[int, str | None] = {}
        self._op_seq = 0
        self.quiet_until = 0  # clients start nothing before this time (``idle`` fault)
        self.busy_until = 0  # no new idle period before this time
        # -- liveness: the peers each node has been told are down --
        self.down_view: dict[str, set[str]] = {}
        self.ticks = self.quiet_ticks = self.liveness_wakes = 0
        # -- the KV API (``kv_api``): its history, the leaders' expiries under way --
        self.kv_history: list[KvOp] = []
        self.expiring: list[_ClientOp] = []
        self.kv_workload = KvWorkload(self.rng, self.cfg.kv_keys) if self.cfg.kv_api else None
        self.leader_since = 0  # when the newest leader took over (lease liveness)

        voters = [f"n{i}" for i in range(1, self.cfg.nodes + 1)]
        self.founders = voters
        for nid in voters:
            store = self._new_store()
            bootstrap(store, voters)
            self._add_node(nid, store)
        for nid in voters:
            self._schedule(self.rng.randrange(self.cfg.tick_ms), "tick", nid)
        for c in range(self.cfg.clients):
            self.client_hint[c] = None
            self._schedule(self.rng.randrange(50), "client", c)
        self._schedule(self.cfg.fault_every_ms, "fault", None)
        if "survive" in self.faults:
            self._schedule(self._election_ms(), "survive", None)

    # ================================================================ plumbing ========
    def _new_store(self) -> MemoryLogStore:
        """A fresh store with a seeded incarnation (a seed must replay exactly)."""
        return MemoryLogStore(incarnation=self.rng.getrandbits(63) or 1)

    def _add_node(self, nid: str, store: MemoryLogStore) -> SimNode:
        node: SimNode
        if self.cfg.kv_api:
            node = KvSimNode(nid, store, self.seed, clock=self._seconds,
                             identities=self.cfg.identities,
                             election_tick=self.cfg.election_tick, quiesce=self.cfg.quiesce,
                             early_campaign=self.cfg.early_campaign)
            self._schedule(self.rng.randrange(self._lease_tick_ms()), "lease_tick", nid)
        else:
            kind = StoreSimNode if self.cfg.state_store else SimNode
            node = kind(nid, store, self.seed, identities=self.cfg.identities,
                        election_tick=self.cfg.election_tick, quiesce=self.cfg.quiesce,
                        early_campaign=self.cfg.early_campaign)
        self.nodes[nid] = node
        self.down_view[nid] = set()
        # Clocks drift: each node ticks at its own rate. With identical rates,
        # check-quorum would depose an old leader before anyone else could be elected,
        # hiding every bug that relies on leases being safe.
        skew = self.cfg.clock_skew
        self.tick_period[nid] = max(1, round(self.cfg.tick_ms * self.rng.uniform(1 - skew, 1 + skew)))
        self.chains[nid] = {}
        self._rebuild_chain(node)
        return node

    def _schedule(self, delay: int, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (self.now + delay, self._seq, kind, payload))

    def _log(self, line: str) -> None:
        self.trace.append(f"t={self.now:>6} {line}")

    def _touch(self, nid: str) -> None:
        """The node was stepped: its Ready goes to disk after ``disk_ms``."""
        if nid not in self._ready_scheduled:
            self._ready_scheduled.add(nid)
            self._schedule(self.cfg.disk_ms, "ready", nid)

    def run(self) -> SimResult:
        end = self.cfg.steps * self.cfg.tick_ms
        result = SimResult(self.seed)
        try:
            self._run_until(end)
            self._settle()
            self._run_until(end + self.cfg.settle_ms)
            self._final_checks()
            if self.cfg.kv_api:
                self._final_lease_checks()
        except SafetyViolation as e:
            result.violations.append(str(e))
        except AssertionError as e:  # an internal assertion of the core or SimNode
            result.violations.append(f"assertion: {e}")
        except Exception as e:  # noqa: BLE001 - any crash of a node is a finding
            self._log("".join(traceback.format_exception(e)[-6:]).rstrip())
            result.violations.append(f"unexpected {type(e).__name__}: {e}")
        if self.cfg.kv_api:
            self._unknown_outcomes()
        result.ops = len(self.kv_history if self.cfg.kv_api else self.history)
        result.committed = self.max_committed
        result.leaders = len(self.leader_of_term)
        result.ticks, result.quiet_ticks = self.ticks, self.quiet_ticks
        result.liveness_wakes = self.liveness_wakes
        result.losses, result.survivor_wins = self.losses, self.survivor_wins
        result.survivor_elections = len(self.survivors)
        if not result.violations:
            result.linearizability = (check_kv_history(self.kv_history) if self.cfg.kv_api
                                      else check_history(self.history))
        if result.violations or not result.linearizable:
            result.trace = list(self.trace)
        return result

    def _run_until(self, end: int) -> None:
        while self._events and self._events[0][0] <= end:
            self.now, _, kind, payload = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(payload)

    # ================================================================== events ========
    def _on_tick(self, nid: str) -> None:
        node = self.nodes[nid]
        if node.alive:
            if self.cfg.quiesce:
                self._report_liveness(node)
            self.ticks += 1
            self.quiet_ticks += node.raft.quiesced
            node.raft.tick()
            self._touch(nid)
        self._schedule(self.tick_period[nid], "tick", nid)

    def _report_liveness(self, node: SimNode) -> None:
        """Bring ``node``'s view of its peers a random step closer to the truth (and now
        and then get it wrong), telling the core of each change, as the driver does
        from its transport's connection state."""
        nid, view = node.id, self.down_view[node.id]
        for p in sorted(self.nodes):
            if p == nid:
                continue
            down = not self.nodes[p].alive or (p, nid) in self.blocked
            if down == (p in view):
                if (not down and not self.settling
                        and self.rng.random() < self.cfg.liveness_false_down):
                    view.add(p)  # a flapping connection: wrong, and corrected later
                    self._tell(node, p, False)
                    self._log(f"{nid} wrongly told {p} is down")
                continue
            if self.rng.random() >= self.cfg.liveness_catchup:
                continue  # not detected yet
            if down:
                view.add(p)
            else:
                view.discard(p)
            self._tell(node, p, not down)

    def _peers_down_at_start(self, node: SimNode) -> None:
        """A restarted core hears every peer down, and each up as its liveness report
        catches up (``_report_liveness``): the driver counts a peer down until its
        connection's handshake, and reports the handshake, on which a restarted core
        campaigns ("Campaigning at restart" in raftkv.core.raft). Only with quiescence,
        as there."""
        peers = {p for p in self.nodes if p != node.id} if self.cfg.quiesce else set()
        self.down_view[node.id] = peers
        for p in sorted(peers):
            node.raft.peer_down(p)

    def _tell(self, node: SimNode, peer: str, live: bool) -> None:
        was = node.raft.quiesced
        if live:
            node.raft.peer_up(peer)
        else:
            node.raft.peer_down(peer)
        if was and not node.raft.quiesced:
            self.liveness_wakes += 1
            self._log(f"{node.id} woken: {peer} reported {'up' if live else 'down'}")

    def _on_ready(self, nid: str) -> None:
        self._ready_scheduled.discard(nid)
        node = self.nodes[nid]
        if not node.alive:
            return
        while node.raft.has_ready():
            out = node.handle_ready()
            self._observe(node, out)
            for m in out.messages:
                self._send(m)

    def _on_deliver(self, m: Message) -> None:
        node = self.nodes.get(m.to)
        if node is None or not node.alive or (m.frm, m.to) in self.blocked:
            return
        if not node.accept(m):
            return
        node.raft.step(m)
        self._touch(m.to)

    def _send(self, m: Message) -> None:
        if (m.type in (MessageType.APP, MessageType.COMMIT, MessageType.HEARTBEAT)
                and self.leader_of_term.get(m.term) != m.frm):
            # Leadership seen on the wire too: a node can lead and step down before
            # its Ready ever shows the LEADER role, yet still send AppendEntries (or
            # the quiesce heartbeat that carries a commit index in place of a notice).
            self._check_leadership(m.frm, m.term, self.nodes[m.frm].raft.conf.voters)
        f = self.faults
        if not self.settling and "drop" in f and self.rng.random() < self.cfg.drop_rate:
            return
        copies = 2 if ("dup" in f and self.rng.random() < self.cfg.dup_rate) else 1
        for _ in range(copies):
            if "delay" in f and not self.settling:
                delay = 1 + self.rng.randrange(15)
                if self.rng.random() < 0.02:
                    delay += self.rng.randrange(200)  # a straggler, reordered far behind
            else:
                delay = 1
            self._schedule(delay, "deliver", m)

    # ================================================================== faults ========
    def _on_fault(self, _: Any) -> None:
        if self.settling:
            return
        self._schedule(self.rng.randrange(self.cfg.fault_every_ms) + 1, "fault", None)
        choices = [f for f in ("partition", "crash", "membership", "compact", "idle", "wipe",
                               "survive") if f in self.faults]
        if not choices:
            return
        getattr(self, f"_fault_{self.rng.choice(choices)}")()

    def _members(self) -> list[str]:
        leader = self._leader()
        conf = self.nodes[leader].raft.conf if leader else self.nodes["n1"].raft.conf
        return sorted(conf.members())

    def _fault_partition(self) -> None:
        if self.blocked:
            self.blocked.clear()
            self._log("heal partition")
            return
        ids = sorted(self.nodes)
        if len(ids) < 2:
            return
        leader = self._leader()
        roll = self.rng.random()
        if leader is not None and roll < 0.4:
            # Jepsen's favourite: cut the leader off while clients still talk to it.
            for other in ids:
                if other != leader:
                    self.blocked |= {(leader, other), (other, leader)}
            self._log(f"isolate leader {leader}")
            return
        if roll < 0.6:
            a, b = self.rng.sample(ids, 2)
            self.blocked.add((a, b))
            self._log(f"one-way partition {a} -/-> {b}")
            return
        side = set(self.rng.sample(ids, self.rng.randrange(1, len(ids) // 2 + 1)))
        for a in ids:
            for b in ids:
                if (a in side) != (b in side):
                    self.blocked.add((a, b))
        self._log(f"partition {sorted(side)} | {sorted(set(ids) - side)}")

    def _fault_crash(self) -> None:
        down = sorted(n for n, node in self.nodes.items() if not node.alive)
        if down and (self.rng.random() < 0.6 or len(down) * 2 >= len(self.nodes) - 1):
            nid = self.rng.choice(down)
            self.nodes[nid].restart()
            self._peers_down_at_start(self.nodes[nid])
            self._rebuild_chain(self.nodes[nid])
            self._touch(nid)
            self._log(f"restart {nid} (incarnation {self.nodes[nid].incarnation})")
            return
        up = sorted(n for n, node in self.nodes.items() if node.alive)
        nid = self.rng.choice(up)
        self.nodes[nid].crash()
        self._log(f"crash {nid}")

    def _wipe_pending(self) -> bool:
        """A wiped node the group has not yet readmitted: not recorded under its new
        incarnation by a configuration the newest leader has applied. A record still in
        an uncommitted entry is not enough: until it commits, the group counts on the
        incarnation that was lost, and a second wipe makes two lost disks of one
        configuration, beyond any majority protocol (seed 2750: n4's record, appended in
        term 3, never committed; with n1 wiped too, the voters left could commit
        nothing). One removed before that stays pending for good: it keeps a founding
        configuration at its birth, and so counts as a lost disk of that configuration
        for the rest of the run."""
        leader = self._leader()
        raft = self.nodes[leader].raft if leader else None
        conf = raft.conf_at(raft.log.applied) if raft else None
        for nid in sorted(self.wiped):
            inc = self.nodes[nid].storage.identity().incarnation
            if conf is None or conf.incarnation_of(nid) != inc:
                return True
            self.wiped.discard(nid)
        return False

    def _fault_wipe(self) -> None:
        """Wipe a crashed member. Not a node already removed: started again with its old
        arguments, a removed founder bootstraps the founding configuration, and once a
        majority of the founders have, they form a group of their own (no Raft can tell
        that from a group's birth; the docs say not to do it)."""
        members = set(self._members())
        leader = self._leader()
        voters = self.nodes[leader].raft.conf.voters if leader else frozenset()
        if len(voters) < 3 or len(self.founders) < 3:
            return  # one wiped voter of one or two is the whole group (or half) lost
        down = sorted(n for n, node in self.nodes.items() if not node.alive and n in members)
        if not down or self._wipe_pending():
            return
        nid = self.rng.choice(down)
        store = self._new_store()
        if nid in self.founders:
            bootstrap(store, self.founders)
        self.nodes[nid].replace_storage(store)
        self.wiped.add(nid)
        self.wipes += 1
        self._log(f"wipe {nid}: incarnation {store.identity().incarnation}")

    def _fault_idle(self) -> None:
        """Clients pause (finishing what they have outstanding): the groups go quiet
        while the other faults carry on, which is where quiescence can go wrong."""
        if self.now < self.busy_until:
            return  # keep most of the run under load: that is where the history comes from
        lo, hi = self.cfg.idle_ms
        self.quiet_until = self.now + lo + self.rng.randrange(hi - lo)
        lo, hi = self.cfg.busy_ms
        self.busy_until = self.quiet_until + lo + self.rng.randrange(hi - lo)
        self._log(f"clients idle until t={self.quiet_until}")

    def _fault_compact(self) -> None:
        nid = self.rng.choice(sorted(self.nodes))
        node = self.nodes[nid]
        if node.alive and node.compact(keep=self.rng.randrange(5)):
            self._log(f"compact {nid} to {node.storage.first_index() - 1}")

    def _fault_membership(self) -> None:
        leader = self._leader()
        if leader is None:
            return
        raft = self.nodes[leader].raft
        conf = raft.conf
        voters, learners = sorted(conf.voters), sorted(conf.learners)
        roll = self.rng.random()
        try:
            if roll < 0.3 and len(conf.members()) < self.cfg.max_members:
                nid = f"n{self._next_node}"
                self._next_node += 1
                self._add_node(nid, self._new_store())
                self._schedule(self.rng.randrange(self.cfg.tick_ms), "tick", nid)
                raft.propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, nid))
                self._log(f"{leader}: add learner {nid}")
            elif roll < 0.55 and len(voters) > self._min_voters():
                nid = self.rng.choice(voters + learners)
                raft.propose_conf_change(ConfChange(ConfChangeOp.REMOVE, nid))
                self._log(f"{leader}: remove {nid}")
            elif roll < 0.65 and self._promotable(conf, learners):
                nid = self.rng.choice(self._promotable(conf, learners))
                raft.propose_conf_change(ConfChange(ConfChangeOp.PROMOTE, nid))
                self._log(f"{leader}: promote {nid}")
            elif roll < 0.72 and len(voters) > self._min_voters():
                nid = self.rng.choice(voters)
                raft.propose_conf_change(ConfChange(ConfChangeOp.DEMOTE, nid))
                self._log(f"{leader}: demote {nid}")
            else:
                nid = self.rng.choice(voters)
                raft.transfer_leadership(nid)
                self._log(f"{leader}: transfer to {nid}")
        except RaftError as e:
            self._log(f"{leader}: membership refused: {e}")
        self._touch(leader)

    def _promotable(self, conf: Any, learners: list[str]) -> list[str]:
        """Learners a promotion by hand may pick: any, or with ``survive`` only recorded
        ones, as automatic promotion and the placement layer do (the survivor rule
        relies on it: "The lone survivor of two voters", part 1)."""
        if "survive" not in self.faults:
            return learners
        recorded = {n for n, _ in conf.incarnations}
        return [n for n in learners if n in recorded]

    def _min_voters(self) -> int:
        """Removals and demotions keep more voters than this: 3 (the wipe fault needs
        three), or 2 with ``survive`` (never 1: see assumption B of the survivor rule)."""
        return 2 if "survive" in self.faults else 3

    def _election_ms(self) -> int:
        return self.cfg.election_tick * self.cfg.tick_ms

    def _fault_survive(self) -> None:
        """Lose a voter b of a two-voter configuration {a, b} (crash, then wipe): a is
        the survivor the ``survive`` events then campaign for."""
        if self.lost is not None or self._wipe_pending():
            return
        pairs = []
        for a, node in sorted(self.nodes.items()):
            voters = node.raft.conf.voters
            if node.alive and a not in self.wiped and len(voters) == 2 and a in voters:
                (b,) = voters - {a}
                if b in self.nodes and b not in self.wiped and self._survivable(node, b):
                    pairs.append((a, b))
        if not pairs:
            return
        a, b = self.rng.choice(pairs)
        victim = self.nodes[b]
        if victim.alive:
            # Crash it now, lose its files once its last messages have landed: an
            # acknowledgement still in flight is one the old incarnation did give.
            victim.crash()
            self._log(f"survive: crash {b}, to be lost")
            self._schedule(300, "lose", (a, b))
            return
        self._on_lose((a, b))

    def _on_lose(self, pair: tuple[str, str]) -> None:
        a, b = pair
        victim = self.nodes[b]
        survivor = self.nodes[a]
        if (victim.alive or self.lost is not None or self._wipe_pending()
                or set(survivor.raft.conf.voters) != {a, b}
                or not self._survivable(survivor, b)):
            return  # restarted meanwhile (with its state), or the configuration moved
        # Empty, never the founding configuration, as the placement layer starts a lost
        # replica (two wiped founders would otherwise be a group of their own at birth).
        store = self._new_store()
        victim.replace_storage(store)
        self.wiped.add(b)
        self.lost = (a, b)
        self.losses += 1
        self._log(f"survive: {b} lost (incarnation {store.identity().incarnation}); "
                  f"{a} is the survivor")

    def _on_survive(self, _: Any) -> None:
        """About once per election timeout, while some configuration still counts on the
        lost voter b's old incarnation: every node that is not leader and whose latest
        configuration is {itself, b} campaigns without b (a change made in a branch the
        first survivor lacks may have left another node with b, as placement's stable
        would name it)."""
        self._schedule(self._election_ms(), "survive", None)
        if self.lost is None:
            return
        b = self.lost[1]
        inc = self.nodes[b].storage.identity().incarnation
        counting = [x for x, n in sorted(self.nodes.items())
                    if x != b and b in n.raft.conf.voters
                    and n.raft.conf.incarnation_of(b) != inc]
        if not counting:
            self._log(f"survive: no configuration counts on the lost {b} any more")
            self.lost = None
            self.wiped.discard(b)  # the next loss may come
            return
        for x in counting:
            node = self.nodes[x]
            if (not node.alive or x in self.wiped or node.raft.role == Role.LEADER
                    or set(node.raft.conf.voters) != {x, b}
                    or (self.committed_conf[0] and x not in self.committed_conf[1])):
                continue  # (the last: removed in a branch it lacks, assumption B)
            required = self._survivor_electorate(node, b)
            try:
                node.raft.campaign_without(b)
            except RaftError as e:
                self._log(f"survive: {x} refused: {e}")
                continue
            self._touch(x)
            # With pre-vote the election itself comes in the next term, once every
            # member of the electorate granted the pre-vote.
            term = node.raft.term + (1 if node.raft.role == Role.PRE_CANDIDATE else 0)
            self.survivors[(term, x)] = required
            self._log(f"survive: {x} campaigns without {b} for term {term}, "
                      f"needing {sorted(required)}")

    def _window(self, node: SimNode) -> list[Any]:
        """The configuration at ``node``'s commit index and every later one in its log."""
        raft = node.raft
        at_commit = [c for i, c in raft.confs if i <= raft.log.committed]
        return [*at_commit[-1:], *(c for i, c in raft.confs if i > raft.log.committed)]

    def _survivable(self, node: SimNode, lost: str) -> bool:
        """Whether losing ``lost`` leaves ``node`` a shape the survivor rule covers. The
        others are beyond it: say ``lost`` was the only voter of a configuration ``node``
        cannot know committed, so it may have committed entries nobody else holds. And
        ``node`` must not have been removed in a branch it lacks (assumption B, which
        the placement layer gets from the metastore and the simulator from the newest
        configuration any node applied)."""
        a = node.id
        if self.committed_conf[0] and a not in self.committed_conf[1]:
            return False
        window = self._window(node)
        for conf, after in zip(window, [*window[1:], None], strict=True):
            voters = set(conf.voters)
            others = voters - {a, lost}
            if voters == {a, lost} and any(
                    conf.incarnation_of(y) != window[0].incarnation_of(y)
                    for y in conf.learners if conf.incarnation_of(y)):
                # A learner recorded anew that ``node`` does not know committed: if it
                # is newborn, the Incarnations vote rule has it refuse; the rule waits.
                return False
            if voters == {lost}:
                if a not in conf.learners or after is None or set(after.voters) != {a, lost}:
                    return False
            elif a not in voters or len(others) > 1 or (others and lost not in voters):
                return False
        return True

    def _survivor_electorate(self, node: SimNode, lost: str) -> frozenset[str]:
        """Counted here, from the rule's text rather than the core's code: every voter but
        ``lost`` of the configurations since the commit index, and the recorded learners
        of the two-voter ones."""
        out: set[str] = set()
        for conf in self._window(node):
            out |= set(conf.voters) - {lost}
            if len(conf.voters) == 2 and lost in conf.voters:
                out |= set(conf.learners) & {n for n, _ in conf.incarnations}
        return frozenset(out)

    def _settle(self) -> None:
        self.settling = True
        self.settle_start = self.now
        # Clients sleeping through an idle period wake at its end, as scheduled.
        self.settle_calls_until = max(self.now, self.quiet_until) + self.cfg.settle_ms // 4
        self.blocked.clear()
        self.kept_down = self._choose_kept_down()
        for nid, node in sorted(self.nodes.items()):
            if nid == self.kept_down:
                if node.alive:
                    node.crash()
                self._log(f"settle: {nid} is lost for good")
            elif not node.alive:
                node.restart()
                self._peers_down_at_start(node)
                self._rebuild_chain(node)
                self._touch(nid)
        self._log("settle: faults off, partitions healed, all nodes restarted")

    def _choose_kept_down(self) -> str | None:
        """``lost``: a voter of the newest leader's configuration that stays down through
        the settle phase. Raft promises progress to any live majority (§5.2, §6.2), so
        the others must still elect, commit and serve: a leader that hears a live
        majority yet commits nothing fails this. Not after a wipe (a wiped voter not yet
        readmitted plus a lost one are two of three) nor with ``survive``'s two voters.
        The one wait "Incarnations" documents (a voter recorded on contact whose record
        needs a voter that is gone) is at a group's birth, long before the settle."""
        if "lost" not in self.faults or self.wipes or "survive" in self.faults:
            return None
        leader = self._leader()
        conf = self.nodes[leader].raft.conf if leader else self.nodes["n1"].raft.conf
        if len(conf.voters) < 3:
            return None
        return self.rng.choice(sorted(conf.voters))

    # ================================================================= clients ========
    def _on_client(self, c: int) -> None:
        """Each client is one chain of events: poll the outstanding op, or start one."""
        op = self.outstanding.get(c)
        if op is not None and self.now - op.call >= self.cfg.client_timeout_ms:
            self._finish(c, op, None, timed_out=True)
            op = None
        if op is None:
            if self.settling and self.now >= self.settle_calls_until:
                return
            if self.now < self.quiet_until:
                self._schedule(self.quiet_until - self.now + self.rng.randrange(20), "client", c)
                return
            self._start_op(c)
        self._schedule(1 + self.rng.randrange(20), "client", c)

    def _start_op(self, c: int) -> None:
        self._op_seq += 1
        if self.kv_workload is not None:
            self._start_kv_op(c)
            return
        kind = self.rng.choice(("put", "put", "get", "get", "cas"))
        key = f"k{self.rng.randrange(self.cfg.keys)}"
        value: Any = None
        if kind == "put":
            value = self._op_seq
        elif kind == "cas":
            value = [self.rng.choice([None, *range(max(1, self._op_seq - 10), self._op_seq)]),
                     self._op_seq]
        target = self.client_hint[c] or self.rng.choice(sorted(self.nodes))
        node = self.nodes[target]
        op = _ClientOp(self._op_seq, kind, key, value, self.now, target)
        self._submit(c, op, lambda: node.encode(c, op.op_id, kind, key, value))

    def _submit(self, c: int, op: _ClientOp, encode: Callable[[], bytes]) -> None:
        """Start ``op`` on its node: a get as a ReadIndex round, a write as a proposal of
        ``encode()``; a keepalive (KV API) moves the lease's deadline on the leader and
        waits for a ReadIndex round that confirms the leadership in this term, as the
        server does. Refused before anything entered a log: not part of the history."""
        node = self.nodes[op.node]
        try:
            if not node.alive:
                raise RaftError("node down")
            if op.kind == "keepalive":
                assert isinstance(node, KvSimNode)
                op.answer = node.keepalive(op.value)
                if op.answer is None:  # not found: answered at once
                    self._append_kv(c, op, None, self.now)
                    return
                op.ctx = ("keepalive", c, op.op_id)
                op.term = node.raft.term
                node.raft.read_index(op.ctx)
            elif op.kind == "get":
                op.ctx = ("read", c, op.op_id)
                node.raft.read_index(op.ctx)
            else:
                op.data = encode()
                op.index = node.raft.propose(op.data)
                op.term = node.raft.term
        except RaftError as e:
            leader = getattr(e, "leader", None)
            self.client_hint[c] = leader if leader in self.nodes else None
            return
        self._touch(op.node)
        self.outstanding[c] = op

    def _finish(self, c: int, op: _ClientOp, output: Any, timed_out: bool = False,
                failed: bool = False) -> None:
        del self.outstanding[c]
        if self.settling and op.call >= self.settle_start and not (timed_out or failed):
            self.settled_ops += 1
        if failed or (timed_out and op.kind in ("get", "keepalive")):
            pass  # a definite failure, or a read with no result: no constraint
        elif self.cfg.kv_api:
            self._record_kv(c, op, output, timed_out)
        else:
            value = tuple(op.value) if op.kind == "cas" else op.value
            ret = math.inf if timed_out else float(self.now)
            self.history.append(Operation(
                client=c, call=float(op.call), ret=ret, kind=op.kind, key=op.key,
                value=value, output=output,
            ))
        if timed_out or failed:
            self.client_hint[c] = None

    def _client_progress(self, node: SimNode, out: ReadyOutcome) -> None:
        if self.expiring:
            self._expiry_progress(node, out)
        for c, op in list(self.outstanding.items()):
            if op.node != node.id:
                continue
            if op.kind == "get":
                for rs in out.read_states:
                    if rs.context == op.ctx:
                        op.read_index = rs.index
                if op.read_index >= 0 and node.last_applied >= op.read_index:
                    self._finish(c, op, node.read(op.key))
                continue
            if op.kind == "keepalive":
                for rs in out.read_states:
                    if rs.context == op.ctx:
                        op.read_index = rs.index
                if op.read_index >= 0 and node.last_applied >= op.read_index:
                    assert isinstance(node, KvSimNode)
                    if not node.lease_alive(op.value):  # revoked by the read point
                        op.answer = None
                    self._finish(c, op, op.answer, failed=node.raft.term != op.term)
                continue
            for a in out.applied:
                if a.entry.index == op.index:
                    mine = a.entry.term == op.term
                    if mine and node.op_of(op.data) is not None:
                        self.acked_writes.append((op.index, node.op_of(op.data)))
                    self._finish(c, op, a.result, failed=not mine)
                    break

    # ================================================================== KV API ========
    # ``kv_api``: the clients speak the KV API (``raftkv.testing.kv_workload``), each
    # node keeps the leader's lease clocks (``KvSimNode``) and proposes revokes when they
    # fall due; the history goes to ``raftkv.testing.kv_history``. Times there are
    # seconds, the unit of a lease's TTL.
    def _seconds(self) -> float:
        return self.now / 1000

    def _lease_tick_ms(self) -> int:
        return round(TICK_SECONDS * 1000)

    def _on_lease_tick(self, nid: str) -> None:
        """``LeaseKeeper``'s loop: every ``TICK_SECONDS``, revokes for what fell due."""
        self._schedule(self._lease_tick_ms(), "lease_tick", nid)
        node = self.nodes[nid]
        if not node.alive:
            return
        assert isinstance(node, KvSimNode)
        for lease in node.lease_tick():
            self._propose_expiry(node, lease)

    def _propose_expiry(self, node: KvSimNode, lease: int) -> None:
        self._op_seq += 1
        op = _ClientOp(self._op_seq, "expire", "", lease, self.now, node.id,
                       incarnation=node.incarnation)
        op.data = encode("expire", None, lease)
        try:
            op.index = node.raft.propose(op.data)
        except RaftError:
            node.leases.retry(lease)  # the keeper's _expire: tried again at the next tick
            return
        op.term = node.raft.term
        self._touch(node.id)
        self.expiring.append(op)
        self._log(f"{node.id} expires lease {lease} at {op.index}")

    def _expiry_progress(self, node: SimNode, out: ReadyOutcome) -> None:
        applied = {a.entry.index: a for a in out.applied}
        for op in [op for op in self.expiring if op.node == node.id and op.index in applied]:
            self.expiring.remove(op)
            a = applied[op.index]
            mine = a.entry.term == op.term
            clocks = node.leases if node.incarnation == op.incarnation else None  # type: ignore[attr-defined]
            if mine:
                self._append_kv(-1, op, self._kv_output(a.result), self.now)
                if clocks is not None:
                    clocks.revoked(op.value)
            elif clocks is not None:
                clocks.retry(op.value)  # another entry took the index: a definite failure

    def _start_kv_op(self, c: int) -> None:
        assert self.kv_workload is not None
        kind, key, args = self.kv_workload.next(self._op_seq)
        target = self.client_hint[c] or self.rng.choice(sorted(self.nodes))
        op = _ClientOp(self._op_seq, kind, key or "", args, self.now, target)
        self._submit(c, op, lambda: encode(kind, key, args))

    @staticmethod
    def _kv_output(result: Any) -> Any:
        """An apply's result as ``KvOp.output`` records it."""
        if isinstance(result, TxnResult):
            return (result.succeeded, tuple(meta(r) if isinstance(r, KeyMeta) else r
                                            for r in result.responses))
        if isinstance(result, list):
            return sorted(k.decode() for k in result)
        return result

    def _record_kv(self, c: int, op: _ClientOp, output: Any, timed_out: bool) -> None:
        node = self.nodes[op.node]
        assert isinstance(node, KvSimNode) and self.kv_workload is not None
        if timed_out:
            self._append_kv(c, op, None, math.inf)
            return
        out = output if op.kind == "get" else self._kv_output(output)
        if op.kind == "get":
            self.kv_workload.saw(op.key, out)
        elif op.kind == "grant" and out is True and node.incarnation and node.alive:
            node.leases.granted(*op.value)  # the server tells its keeper once it applied
        elif op.kind == "revoke" and out is not False:
            node.leases.revoked(op.value)
        self._append_kv(c, op, out, self.now)

    def _append_kv(self, c: int, op: _ClientOp, output: Any, ret: float) -> None:
        self.kv_history.append(KvOp(
            client=c, call=op.call / 1000, ret=ret / 1000, kind=op.kind, key=op.key or None,
            args=tuple(op.value) if isinstance(op.value, list) else op.value,
            output=None if ret == math.inf else output, index=op.index))

    def _unknown_outcomes(self) -> None:
        """At the end: writes still waiting for their entry may have taken effect."""
        for c, op in sorted(self.outstanding.items()):
            if op.kind != "get":
                self._append_kv(c, op, None, math.inf)
        self.outstanding.clear()
        for op in self.expiring:
            self._append_kv(-1, op, None, math.inf)
        self.expiring.clear()

    def _final_lease_checks(self) -> None:
        """Once quiet, a lease nobody keeps alive goes within its TTL and a bound: a
        reload that finds a grant the new leader had not applied, two keeper ticks, and
        two election timeouts for the revoke to commit."""
        leader = self._leader()
        assert leader is not None
        node = self.nodes[leader]
        assert isinstance(node, KvSimNode)
        slack = RELOAD_SECONDS + 2 * TICK_SECONDS + 2 * self._election_ms() / 1000
        quiet = max(self.settle_start, self.leader_since) / 1000
        for problem in lease_liveness(self.kv_history, read_leases(node.state_store),
                                      self.now / 1000, quiet, slack):
            self._violation(f"liveness: {problem}")

    # ================================================================= checker ========
    def _violation(self, what: str) -> None:
        self._log(f"VIOLATION: {what}")
        raise SafetyViolation(what)

    def _rebuild_chain(self, node: SimNode) -> None:
        """After (re)start: rebuild the node's chain from its store, re-verifying it."""
        store = node.storage
        base = store.first_index() - 1
        chain: dict[int, int] = {0: 0}
        if base:
            h = self.chain_at.get((base, store.term(base)))
            if h is None:
                self._violation(f"{node.id}: log starts after {base}, a position no log had")
            chain = {base: h}
        self.chains[node.id] = chain
        first, last = store.first_index(), store.last_index()
        if last >= first:
            self._extend_chain(node.id, store.entries(first, last + 1))

    def _extend_chain(self, nid: str, entries: list[Entry]) -> None:
        chain = self.chains[nid]
        first = entries[0].index
        for i in [i for i in chain if i >= first]:
            del chain[i]
        h = chain[first - 1]
        for e in entries:
            h = hash((h, e.term, e.type, e.data))
            chain[e.index] = h
            known = self.chain_at.setdefault((e.index, e.term), h)
            if known != h:
                self._violation(
                    f"log matching: {nid} entry {e.index}/t{e.term} has a different prefix "
                    "from another node's entry with the same index and term"
                )

    def _observe(self, node: SimNode, out: ReadyOutcome) -> None:
        rd = out.ready
        assert rd is not None
        nid, raft = node.id, node.raft
        if rd.snapshot is not None:
            h = self.chain_at.get((rd.snapshot.index, rd.snapshot.term))
            if h is None:
                self._violation(f"{nid}: installed snapshot of unknown log position")
            self.chains[nid] = {rd.snapshot.index: h}
            self._log(f"{nid} installs snapshot {rd.snapshot.index}/{rd.snapshot.term}")
        if rd.entries:
            self._extend_chain(nid, rd.entries)
        if rd.hard_state is not None and rd.hard_state.vote is not None:
            self._record_vote(nid, rd.hard_state.term, rd.hard_state.vote)
        for m in out.messages:
            # A grant can also be implied rather than persisted: a node that votes and
            # then campaigns before its Ready persists only the later (term, vote), which
            # rules out a second vote in the earlier term. The grant on the wire counts.
            if m.type == MessageType.VOTE_RESP and not m.reject:
                self._record_vote(nid, m.term, m.to)
        if rd.soft_state is not None:
            self._log(f"{nid} {rd.soft_state.role.name} term={raft.term} "
                      f"lead={rd.soft_state.lead} {raft.conf.describe()}")
            if rd.soft_state.role == Role.LEADER:
                self._check_new_leader(node)
            self.leader_since = self.now
        for a in out.applied:
            self._check_apply(nid, a.entry)
        if raft.role == Role.LEADER:
            self._check_one_config_change(node)
        if raft.role == Role.LEADER and rd.hard_state is not None:
            if rd.hard_state.commit > self.leader_commit.get(nid, 0):
                self._check_commit_quorum(node, rd.hard_state.commit)
            self.leader_commit[nid] = rd.hard_state.commit
        self._client_progress(node, out)

    def _record_vote(self, nid: str, term: int, vote: str) -> None:
        inc = self.nodes[nid].storage.identity().incarnation
        was = self.votes.get((nid, term))
        if was is not None and was[0] == inc and was[1] != vote:
            self._violation(f"{nid} voted for {was[1]} and then {vote} in term {term}")
        self.votes[(nid, term)] = (inc, vote)

    def _check_leadership(self, nid: str, term: int, voter_set: frozenset[str]) -> None:
        """At most one leader per term, elected by a majority of its voters (counted
        from the votes the stores and the wire recorded, not from the core's tally)."""
        prev = self.leader_of_term.setdefault(term, nid)
        if prev != nid:
            self._violation(f"election safety: {prev} and {nid} both lead term {term}")
        survivor = self.survivors.get((term, nid))
        if survivor is not None and self._won_as_survivor(nid, term):
            if prev is nid and term not in self._survivor_won:
                self._survivor_won.add(term)
                self.survivor_wins += 1
            missing = [v for v in sorted(survivor)
                       if self.votes.get((v, term), (0, ""))[1] != nid]
            if missing:
                self._violation(f"survivor {nid} leads term {term} without the grants of "
                                f"{missing}")
            return
        voters = sorted(voter_set)
        granted = [v for v in voters if self.votes.get((v, term), (0, ""))[1] == nid]
        if len(granted) * 2 <= len(voters):
            self._violation(f"{nid} leads term {term} with votes {granted} of voters {voters}")

    def _won_as_survivor(self, nid: str, term: int) -> bool:
        """Whether ``nid`` won ``term`` by a survivor election: its first entry of the
        term removes a voter (``Raft._become_leader``), where an ordinary win's is a no-op
        or a RECORD. A survivor campaign can be abandoned (the node hears a leader, or
        its election timer starts an ordinary one) and the same term then won the
        ordinary way, which the majority check below covers (seed 30048 of ``survive``:
        n5 asked for term 7 without n3, followed n4's new configuration, then won term 7
        with n3's readmitted vote)."""
        log = self.nodes[nid].raft.log
        i = log.last_index()
        while i > log.first_index() and log.term(i - 1) == term:
            i -= 1
        if (i < log.first_index() or log.term(i) != term
                or (i == log.first_index() and log.term(i - 1) == term)):
            return True  # its first entry is gone or absent: hold it to the survivor rule
        entry = log.entries(i, i + 1)[0]
        if entry.type != EntryType.CONF_CHANGE:
            return False
        cc, _ = decode_conf_entry(entry.data)
        return cc is not None and cc.op == ConfChangeOp.REMOVE

    def _check_new_leader(self, node: SimNode) -> None:
        raft = node.raft
        term = raft.term
        self._check_leadership(node.id, term, raft.conf.voters)
        mc = self.max_committed
        chain = self.chains[node.id]
        if mc and mc >= min(chain) and chain.get(mc) != self.committed_chain.get(mc):
            self._violation(
                f"leader completeness: {node.id} (term {term}) lacks committed entry {mc}"
            )

    def _check_commit_quorum(self, node: SimNode, commit: int) -> None:
        """Recount, from the stores themselves, who holds the newly committed entry.

        The majority must come from the configuration in effect when the commit index
        moved: the latest one if its entry is at or below ``commit`` (it was appended
        first), otherwise the latest or the one before it (a change appended in the same
        step, at most one being uncommitted). Learners count in neither.
        """
        want = self.chains[node.id].get(commit)

        def holds(v: str) -> bool:
            chain = self.chains.get(v)
            # A snapshot at or past ``commit`` holds it too (snapshots hold only
            # committed entries).
            return chain is not None and (chain.get(commit) == want or min(chain) >= commit)

        confs = node.raft.confs
        candidates = [confs[-1]] if confs[-1][0] <= commit else confs[-2:]
        tried = []
        for _, conf in candidates:
            voters = sorted(conf.voters)
            holders = [v for v in voters if holds(v)]
            if len(holders) * 2 > len(voters):
                return
            tried.append(f"{holders} of voters {voters}")
        self._violation(f"{node.id} committed {commit} held only by " + "; ".join(tried))

    def _check_apply(self, nid: str, e: Entry) -> None:
        seen = self.committed.setdefault(e.index, (e.term, e.data))
        if seen != (e.term, e.data):
            self._violation(
                f"state machine safety: {nid} applied {e.index}/t{e.term} but another node "
                f"applied t{seen[0]} there"
            )
        if e.index not in self.committed_chain:
            self.committed_chain[e.index] = self.chains[nid].get(e.index, 0)
        if e.type == EntryType.CONF_CHANGE and e.index > self.committed_conf[0]:
            self.committed_conf = (e.index, decode_conf_entry(e.data)[1].voters)
        self.max_committed = max(self.max_committed, e.index)
        if e.data and e.type == EntryType.NORMAL:
            op_key = self.nodes[nid].op_of(e.data)
            if op_key is None:
                return  # (``kv_api``) a command no value tells apart from another
            first = self.op_index.setdefault(op_key, e.index)
            if first != e.index:
                self._violation(f"command {op_key} applied at {first} and again at {e.index}")

    def _check_one_config_change(self, node: SimNode) -> None:
        """At most one uncommitted change of who votes or learns. Entries that only
        record incarnations (RECORD, a leader's first entry) change no quorum."""
        raft = node.raft
        confs = raft.confs
        pending = [i for (i, c), (_, before) in zip(confs[1:], confs, strict=False)
                   if i > raft.log.committed
                   and (c.voters, c.learners) != (before.voters, before.learners)]
        if (raft.term, node.id) in self.survivors and len(pending) == 2:
            # "The lone survivor of two voters", part 5: its removal of the lost voter
            # may follow one change that was not committed when the voter was lost.
            pending = pending[:1]
        if len(pending) > 1:
            self._violation(
                f"{node.id} has {len(pending)} uncommitted config changes at {pending}"
            )

    def _leader(self) -> str | None:
        best = None
        for nid, node in sorted(self.nodes.items()):
            if node.alive and node.raft.role == Role.LEADER and (
                best is None or node.raft.term > self.nodes[best].raft.term
            ):
                best = nid
        return best

    def _final_checks(self) -> None:
        leader = self._leader()
        if leader is None:
            self._violation("liveness: no leader after the settle phase")
        if self.settled_ops == 0:
            self._violation("liveness: no client operation completed after the faults stopped")
        lr = self.nodes[leader].raft
        members = sorted(lr.conf.members() - {self.kept_down})
        for nid in members:
            node = self.nodes[nid]
            if node.last_applied != lr.log.committed:
                self._violation(
                    f"liveness: {nid} applied {node.last_applied}, leader committed "
                    f"{lr.log.committed} after settling"
                )
        digests = {nid: self.nodes[nid].state() for nid in members}
        ref = digests[leader]
        for nid, data in digests.items():
            if data != ref:
                self._violation(f"replica {nid} state differs from leader {leader}")
        for index, op_key in self.acked_writes:
            if self.op_index.get(op_key) != index:
                self._violation(f"acknowledged write {op_key} at {index} was lost")


def run_seed(seed: int, cfg: SimConfig | None = None) -> SimResult:
    return Simulation(seed, cfg).run()
