"""Placement under the deterministic simulator: ``python -m raftkv.sim --placement``.

Theory of operation
-------------------
The core's simulator (``raftkv.testing.simulator``) proves the pure Raft core; this one
runs everything above it that decides where data lives: every node's ``Node`` driver,
its metastore replica (``MetaService``), its ``PlacementManager`` (Ignite 3's rebalance,
IGNITE-16668's restart protocol, the survivor rule) and the table's partition groups,
on real LMDB files. It is the same code that ``raftkv serve`` runs; only the
``raftkv.node.runtime.Runtime`` differs (``SimRuntime``):

- **Time** is a virtual clock (``World.now``, seconds) advanced by an event heap ordered
  by (time, sequence number). A node's loop turn (``Node.turn``) is an event: at its next
  tick, or at once when something woke it (a queued call, a delivered frame).
- **Randomness**: generators seeded from the seed make every choice (the scenario, the
  network's fates, every core's election timeouts, request ids, incarnations), and no
  decision depends on wall time, so a seed replays the same schedule exactly. String
  hashing is fixed too (``python -m raftkv.sim`` runs with ``PYTHONHASHSEED=0``), because
  the driver iterates sets of group ids.
- **Network** (``SimTransport``, a ``Transport`` without sockets): a connection exists
  while both ends run; it is "dialed" on demand (the turn's items are undelivered, as
  over TCP, and the link is up a moment later) and drops at once when either end
  crashes. Each frame is msgpack-encoded and decoded, so nothing is shared by
  reference, and frames on one link arrive in order, as over one TCP connection.
  Faults: frames dropped, links stalled (a frame and those behind it delayed) and, for
  Raft messages only, frames duplicated (TCP never duplicates a forwarded write, and a
  duplicated one would be a second client request, not a fault); partitions that cut a
  node off in both directions silently, as the real transport's fault switch does.
- **Worker threads** run inline; an image is packed a moment later on the loop.
- **Crashes**: a crashed node's stores are closed and its objects dropped; its LMDB
  files stay as a SIGKILL leaves them (the page cache keeps what was written). A *wipe*
  deletes its data directory too, so it restarts as a new incarnation with its old
  arguments, which is how a replaced disk looks.

The scenario (``plan_scenario`` of the real-process chaos test, plus the network and
node faults above) is a pure function of the seed. Clients (``Clients``) run put, get
and compare-and-set on every partition, once each, against the leader the routing table
hints at; an operation that fails after it was handed to a node is recorded with an
unknown outcome.

Checks
------
After every loop turn (``Invariants.observe``), for every group (the metastore and
every partition):

- at most one leader per term;
- committed entries agree: the entry a node has committed at an index has the term
  and the bytes every other node committed there (log matching, state machine safety;
  a wiped node or an in-memory replica that voted with a vote it lost would be how two
  leaders of one term, or two different committed entries, come about).

Once the scenario's faults stop, every node that is down is started again and the
network heals; within
``SETTLE_SECONDS`` of simulated time every partition's stable assignment must equal
``calc_assignments`` with pending, planned and the switch keys empty, hosted by exactly
its stable nodes with one leader whose voters are stable, and every replica at the same
applied index with the same digest (``stuck`` otherwise). Then the clients' history,
with a final read of every key, must be linearizable per key (``raftkv.testing.
linearizability``) and no acknowledged write may be lost.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import random
import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from hashlib import blake2b
from typing import Any

import msgpack

from raftkv.core import Role
from raftkv.node.driver import Node, NodeConfig
from raftkv.node.errors import NodeStopped
from raftkv.placement.assignments import (
    calc_assignments,
    decode_nodes,
    encode_nodes,
    partition_keys,
    partition_of,
)
from raftkv.placement.catalog import (
    DEAD_KEY,
    DRAINING_KEY,
    MEMORY,
    SETTINGS_KEY,
    TOPOLOGY_KEY,
    TableDescriptor,
    partition_group,
    table_key,
)
from raftkv.placement.liveness import ClusterSettings
from raftkv.placement.meta_commands import InvokeResult, decode_revision
from raftkv.placement.partition_state import UnknownNode
from raftkv.placement.rebalance import (
    PlacementManager,
    create_table_invoke,
    drain_invoke,
    join_metastore_as_learner,
    set_replicas_invoke,
)
from raftkv.placement.rebalance_steps import switch_keys
from raftkv.placement.retry import RetryPolicy
from raftkv.placement.service import META_GROUP, MetaService
from raftkv.storage.commands import encode_cas, encode_put
from raftkv.storage.identity import seeded
from raftkv.testing.linearizability import CheckResult, Operation, check_history
from raftkv.testing.placement_chaos import (
    META,
    TABLE,
    Action,
    Scenario,
    acknowledged_lost,
    plan_scenario,
    read_key,
    table_keys,
)
from raftkv.transport import codec
from raftkv.transport.tcp import Transport

TICK = 0.05
ELECTION_TICK = 10
REQUEST_TIMEOUT = 2.0
OP_WAIT = 6.0  # a client gives up on a request after this long (outcome unknown)
SETTLE_SECONDS = 240.0  # the liveness bound: converged within this, once faults stop
# A livelock: this many events within this much simulated time (a busy run has a few
# thousand per simulated second).
LIVELOCK_EVENTS = 500_000
LIVELOCK_WINDOW = 0.01
NETWORK_FAULTS = ("drop", "delay", "dup", "partition")
NODE_FAULTS = ("crash", "wipe")
ALL_FAULTS = NETWORK_FAULTS + NODE_FAULTS
# Opt-in (``--faults ...,outage,flap``): failure detection and re-replication
# (``raftkv.placement.liveness``). A node down past the scale-down timeout is declared
# dead and its partitions move to the live nodes; one that flaps around the timeout must
# not keep them moving. The run shortens the timeouts to these.
LIVENESS_FAULTS = ("outage", "flap")
# Opt-in (``--faults ...,drain``): ``raftkv cluster drain`` of a node beyond the
# founders, half the time SIGKILLed during its drain (a persistent table), or
# ``remove-node`` of one killed first; the node must leave the topology, the
# metastore and the draining list within DRAIN_SECONDS. Kept apart from
# LIVENESS_FAULTS so that the seeds kept as regressions replay as they were found.
DRAIN_FAULTS = ("drain",)
DRAIN_SECONDS = 60.0
SCALE_DOWN = 3.0
SCALE_UP = 2.0
MAX_MOVES = 2  # per leader; a table has up to 8 partitions here
CATCH_UP = 1.5  # seconds of a learner's silence (shorter than most outages)
DEFAULT_STEPS = 6  # scenario actions per seed (plan_scenario)


# ================================================================ the world ============
class World:
    """The virtual clock and its event heap."""

    def __init__(self, seed: int) -> None:
        self.now = 0.0
        # One stream per concern, so that a change in how many draws one makes (a code
        # change that adds an election, say) does not reshuffle the others: a kept seed
        # then still plans the same faults at the same points.
        self.rng = random.Random(f"{seed}/nodes")
        self.net_rng = random.Random(f"{seed}/network")
        self.client_rng = random.Random(f"{seed}/clients")
        self.fault_rng = random.Random(f"{seed}/faults")
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._moved_at = 0.0  # the livelock guard's window (run_until)
        self._events = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run_until(self, end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= end:
            when, _, fn = heapq.heappop(heap)
            if when - self._moved_at >= LIVELOCK_WINDOW:
                self._moved_at, self._events = when, 0
            self._events += 1
            if self._events > LIVELOCK_EVENTS:
                # Without this a livelock (work that re-queues itself at once) would hang
                # the run for ever instead of failing the seed (seed 35 did).
                raise Timeout(f"livelock: {LIVELOCK_EVENTS} events within "
                              f"{LIVELOCK_WINDOW}s of simulated time at {when:.3f}s")
            self.now = when
            fn()
        self.now = max(self.now, end)


class _Inline(Executor):
    """Worker threads, simulated: the job runs at once, on the loop."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001  # the job's failure is its future's
            fut.set_exception(e)
        return fut


_INLINE = _Inline()


class SimRuntime:
    """``raftkv.node.runtime.Runtime`` on the virtual clock (see the module docstring)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.world = host.sim.world

    def clock(self) -> float:
        return self.world.now

    def random(self) -> random.Random:
        return random.Random(self.world.rng.getrandbits(64))

    def transport(self, node: Node, addresses: dict[str, str]) -> Transport:
        return SimTransport(self.host, node, addresses)

    def notify(self) -> None:
        self.host.wake()

    def poll(self, timeout: float) -> None:
        raise RuntimeError("a simulated node has no loop thread")

    def executor(self, job: str, node_id: str) -> Executor:
        return _INLINE

    def spawn(self, fn: Callable[[], None], name: str) -> None:
        host, gen = self.host, self.host.gen
        self.world.after(0.01, lambda: fn() if host.gen == gen and host.up else None)

    def shutdown(self) -> None:
        pass


class _Link:
    """A simulated connection: it only needs to exist (``_Peer.conn``) and to close."""

    def close(self, why: str, quiet: bool = False) -> None:
        pass


class SimTransport(Transport):
    """The peer table, outboxes and liveness of ``Transport``; frames travel through
    ``Network`` instead of sockets (see the module docstring)."""

    def __init__(self, host: Host, node: Node, addresses: dict[str, str]) -> None:
        super().__init__(node.id, node.cfg.raft_addr, b"sim", None,  # type: ignore[arg-type]
                         node._on_items, addresses=addresses, on_address=node._on_address,
                         on_undelivered=node._on_undelivered,
                         on_connected=node._on_connected)
        self.host = host

    def start(self) -> None:
        pass

    def close(self) -> None:
        for p in self.peers.values():
            p.conn = None

    def maintain(self) -> None:
        pass

    def heard(self, peer_id: str) -> None:
        p = self.peers.get(peer_id)
        if p is not None:
            p.last_heard = self.host.sim.world.now

    def link_down(self, peer_id: str) -> None:
        p = self.peers.get(peer_id)
        if p is not None:
            p.conn = None

    def link_up(self, peer_id: str) -> None:
        p = self.peer(peer_id)
        if p.conn is None:
            p.conn = _Link()  # type: ignore[assignment]
            p.last_heard = self.host.sim.world.now  # the handshake proved it alive
            if self.on_connected is None:
                return
            sim = self.host.sim
            sim.current = self.host.id
            try:
                self.on_connected(peer_id)
            except Exception as e:  # noqa: BLE001  # in the real loop: the driver dies
                sim.violation(f"{self.host.id}: the driver loop failed on the handshake "
                              f"of {peer_id}: {e!r}")
                self.host.crash()
                return
            self.host.wake()  # the cores may have campaigned: their messages go now

    def flush(self) -> None:
        sim = self.host.sim
        for pid, p in self.peers.items():
            if not p.outbox and not p.ping:
                continue
            items, p.outbox = p.outbox, []
            p.ping = False
            if p.conn is None:
                self.stats["dropped"] += len(items)
                sim.dial(self.host, pid)
                if self.on_undelivered is not None and items:
                    self.on_undelivered(pid, items)
                continue
            sim.net.send(self.host, pid, items)


# ================================================================ the network ==========
@dataclass
class NetFaults:
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0  # the chance of a long delay (which reorders)


class Network:
    def __init__(self, sim: PlacementSim, faults: NetFaults) -> None:
        self.sim = sim
        self.faults = faults
        self.cut: set[str] = set()  # nodes partitioned from every other node
        self._last: dict[tuple[str, str], float] = {}  # each link's last delivery time

    def severed(self, a: str, b: str) -> bool:
        return a in self.cut or b in self.cut

    def send(self, src: Host, dst: str, items: list[Any]) -> None:
        sim, f, rng = self.sim, self.faults, self.sim.world.net_rng
        if self.severed(src.id, dst) or rng.random() < f.drop:
            return
        frame = msgpack.packb(items, use_bin_type=True)
        delay = 0.001 + rng.random() * 0.004
        if rng.random() < f.delay:
            delay += rng.random() * 0.3  # a stall: the frames behind it wait too
        target = sim.hosts.get(dst)
        if target is None:
            return
        gen = target.gen
        # In order on each link, as over one TCP connection: the real transport never
        # reorders frames, and the core's quiescence counts on it (a stale quiesce
        # heartbeat overtaking a newer one would quiet a follower below the commit
        # index until the next write).
        link = (src.id, dst)
        at = max(sim.world.now + delay, self._last.get(link, 0.0) + 1e-6)
        self._last[link] = at
        sim.world.at(at, lambda: self._deliver(src.id, target, gen, frame))
        if rng.random() < f.dup:
            raft = [i for i in items if codec.item_kind(i) == codec.RAFT]
            if raft:
                again = msgpack.packb(raft, use_bin_type=True)
                self._last[link] = at + 1e-6
                sim.world.at(at + 1e-6, lambda: self._deliver(src.id, target, gen, again))

    def _deliver(self, src: str, target: Host, gen: int, frame: bytes) -> None:
        if target.gen != gen or not target.up or self.severed(src, target.id):
            return
        node = target.node
        assert node is not None
        items = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        node.transport.heard(src)
        self.sim.current = target.id
        try:
            node._on_items(src, items)
        except codec.WireError as e:
            self.sim.violation(f"{target.id} refused a frame from {src}: {e}")
        except Exception as e:  # noqa: BLE001  # in the real loop: the driver dies
            self.sim.violation(f"{target.id}: the driver loop failed on a frame from {src}: "
                               f"{e!r}")
            target.crash()
            return
        target.wake()


# ================================================================ the nodes ============
class Host:
    """One simulated machine: its data directory and, while up, its node, metastore
    replica and placement manager."""

    def __init__(self, sim: PlacementSim, nid: str) -> None:
        self.sim = sim
        self.id = nid
        self.dir = os.path.join(sim.root, nid)
        self.gen = 0  # bumped by every start and crash: stale events check it
        self.up = False
        self.node: Node | None = None
        self.meta: MetaService | None = None
        self.mgr: PlacementManager | None = None
        self._turn_at = math.inf

    def start(self) -> None:
        assert not self.up
        self.gen += 1
        self.up = True
        self._turn_at = math.inf
        sim = self.sim
        peers = {n: f"{n}:1" for n in META}
        peers[self.id] = f"{self.id}:1"
        node = Node(NodeConfig(self.id, f"{self.id}:1", b"sim", peers=peers,
                               data_dir=self.dir, tick_seconds=TICK,
                               election_tick=ELECTION_TICK, request_timeout=REQUEST_TIMEOUT),
                    runtime=SimRuntime(self))
        self.node = node
        self.meta = MetaService(node, self.dir, META if self.id in META else None,
                                durable=False)
        self.mgr = PlacementManager(self.meta, self.dir, durable=False,
                                    retry=RetryPolicy(base=0.05, cap=1.0, max_attempts=30),
                                    watch_timeout=2.0, admin_timeout=REQUEST_TIMEOUT)
        self.mgr.start()
        self.wake()
        sim.log(f"start {self.id}")

    def crash(self, wipe: bool = False) -> None:
        if not self.up:
            return
        self.up = False
        self.gen += 1
        node, mgr = self.node, self.mgr
        assert node is not None and mgr is not None
        if mgr.metrics["internal_errors"]:
            self.sim.violation(f"{self.id}: the placement manager failed internally: "
                               f"{[e for e in mgr.errors if e['kind'] == 'internal']}")
        mgr.stop()
        node._stopping = True
        node._fail_everything(NodeStopped(f"node {self.id} crashed"))
        self.node = self.meta = self.mgr = None
        for h in self.sim.hosts.values():
            if h.up and h.node is not None:
                h.node.transport.link_down(self.id)  # type: ignore[attr-defined]
        if wipe:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.sim.log(f"{'wipe' if wipe else 'crash'} {self.id}")

    def wake(self, when: float | None = None) -> None:
        """A loop turn at ``when`` (now by default), unless one comes sooner."""
        world = self.sim.world
        when = world.now if when is None else max(when, world.now)
        if self.up and when < self._turn_at:
            self._turn_at = when
            gen = self.gen
            world.at(when, lambda: self._turn(gen, when))

    def _turn(self, gen: int, when: float) -> None:
        if gen != self.gen or not self.up or when != self._turn_at:
            return
        self._turn_at = math.inf
        node = self.node
        assert node is not None
        self.sim.current = self.id
        try:
            node.turn()
        except Exception as e:  # noqa: BLE001  # the driver loop died: a finding
            self.sim.violation(f"{self.id}: the driver loop failed: {e!r}")
            self.crash()
            return
        self.sim.inv.observe(self)
        self.wake(node.next_tick)


# ================================================================ the checks ===========
class Invariants:
    """Safety after every loop turn, for every group (see the module docstring)."""

    def __init__(self, sim: PlacementSim) -> None:
        self.sim = sim
        self.leaders: dict[tuple[str, int], str] = {}
        self.committed: dict[tuple[str, int], tuple[int, bytes]] = {}
        self.checked: dict[tuple[str, int, str], int] = {}

    def observe(self, host: Host) -> None:
        node = host.node
        if node is None:
            return
        self._moves_bounded(host)
        for gid, g in list(node.groups.items()):
            raft = g.raft
            if raft.role == Role.LEADER:
                key = (gid, raft.term)
                other = self.leaders.setdefault(key, host.id)
                if other != host.id:
                    self.sim.violation(f"{gid}: two leaders in term {raft.term}: "
                                       f"{other} and {host.id}")
            ck = (host.id, host.gen, gid)
            done = self.checked.get(ck, 0)
            log = g.storage.log
            commit = min(raft.log.committed, log.last_index())
            if commit <= done:
                continue
            lo = max(done + 1, log.first_index())
            if lo <= commit:
                for e in log.entries(lo, commit + 1):
                    digest = blake2b(e.data, digest_size=16).digest()
                    seen = self.committed.setdefault((gid, e.index), (e.term, digest))
                    if seen != (e.term, digest):
                        self.sim.violation(
                            f"{gid}: {host.id} committed a different entry at {e.index} "
                            f"(term {e.term}, first seen term {seen[0]})")
            self.checked[ck] = commit


    def _moves_bounded(self, host: Host) -> None:
        """No leader's changes hold more move slots than ``max_moves``
        (``ChangePeers._move_slot``)."""
        mgr = host.mgr
        if mgr is None:
            return
        limit = mgr._settings().max_moves
        held = mgr.moves_held()
        if limit and held > limit:
            self.sim.violation(f"{host.id} holds {held} move slots (max_moves {limit})")


# ================================================================ the clients ==========
class Clients:
    """Clients doing one put/get/cas at a time on ``keys``, as the chaos test's do."""

    def __init__(self, sim: PlacementSim, partitions: int, keys: list[str], n: int) -> None:
        self.sim = sim
        self.partitions = partitions
        self.keys = keys
        self.history: list[Operation] = []
        self.counts: dict[str, int] = {}
        self.running = False
        self.busy = [False] * n
        self._seen: dict[str, str | None] = dict.fromkeys(keys)
        self._n = [0] * n

    def start(self) -> None:
        self.running = True
        for c in range(len(self.busy)):
            if not self.busy[c]:
                # Busy from now: a pause and start before this call runs (a settle that
                # finds everything converged at once) must not start a second chain of
                # requests for the same client (it did: seeds 274, 367, 389 showed one
                # client with two operations in flight, and a get answered with the
                # other's write).
                self.busy[c] = True
                self.sim.world.after(0.01 * c, partial(self._next, c))

    def pause(self) -> None:
        self.running = False

    @property
    def idle(self) -> bool:
        return not any(self.busy)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _target(self, key: bytes) -> Node | None:
        sim, rng = self.sim, self.sim.world.client_rng
        live = [h for h in sim.hosts.values() if h.up]
        if not live:
            return None
        mgr = rng.choice(live).mgr
        assert mgr is not None
        hint: str | None = None
        members: list[str] = []
        try:
            route = mgr.route(TABLE, key)
            hint = route.leader
            members = [n for n in route.nodes if sim.hosts[n].up]
        except KeyError:  # this node has not seen the table yet
            pass
        if hint is not None and sim.hosts[hint].up and rng.random() < 0.9:
            return sim.hosts[hint].node
        pick = rng.choice(members) if members else rng.choice(live).id
        return sim.hosts[pick].node

    def _next(self, c: int) -> None:
        if not self.running:
            self.busy[c] = False
            return
        sim, rng = self.sim, self.sim.world.client_rng
        key = rng.choice(self.keys)
        kb = key.encode()
        node = self._target(kb)
        if node is None:
            sim.world.after(0.1, lambda: self._next(c))
            return
        self.busy[c] = True
        gid = partition_group(TABLE, partition_of(kb, self.partitions))
        self._n[c] += 1
        value = f"c{c}-{self._n[c]}"
        call = sim.world.now
        r = rng.random()
        arg: object
        if r < 0.4:
            kind, arg, fut = "get", None, node.read(gid, read_key(kb))
        elif r < 0.75:
            kind, arg = "put", value
            fut = node.propose(gid, encode_put(kb, value.encode()))
        else:
            expected = self._seen[key] if rng.random() < 0.8 else None
            kind, arg = "cas", (expected, value)
            exp = None if expected is None else expected.encode()
            fut = node.propose(gid, encode_cas(kb, exp, value.encode()))
        settled = [False]

        def finish(f: Future[Any] | None) -> None:
            if settled[0]:
                return
            settled[0] = True
            now = sim.world.now
            exc = None if f is None else f.exception()
            if f is None or exc is not None:
                if kind == "get":
                    self._count("get-failed")  # a failed read constrains nothing
                else:
                    self.history.append(Operation(c, call, math.inf, kind, key, arg, None))
                    self._count(f"{kind}-unknown")
            elif kind == "get":
                got = f.result()
                out = None if got is None else bytes(got).decode()
                self.history.append(Operation(c, call, now, kind, key, None, out))
                self._seen[key] = out
                self._count("get-ok")
            elif kind == "put":
                self.history.append(Operation(c, call, now, kind, key, arg, None))
                self._seen[key] = value
                self._count("put-ok")
            else:
                swapped = bool(f.result()[1])
                self.history.append(Operation(c, call, now, kind, key, arg, swapped))
                if swapped:
                    self._seen[key] = value
                self._count("cas-ok" if swapped else "cas-refused")
            sim.world.after(0.005 + rng.random() * 0.02, lambda: self._next(c))

        fut.add_done_callback(lambda f: sim.world.after(0, lambda: finish(f)))
        sim.world.after(OP_WAIT, lambda: finish(None))


# ================================================================ the run ==============
@dataclass
class PlacementResult:
    seed: int
    violations: list[str]
    stuck: str | None
    check: CheckResult | None
    lost: list[str]
    trace: list[str]
    counts: dict[str, int] = field(default_factory=dict)
    sim_seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)

    @property
    def linearizable(self) -> bool:
        return self.check is None or self.check.ok

    @property
    def ok(self) -> bool:
        return not self.violations and self.stuck is None and self.linearizable \
            and not self.lost


class Timeout(Exception):
    pass


class PlacementSim:
    """One seed's run (see the module docstring)."""

    def __init__(self, seed: int, *, nodes: int = 5, steps: int = DEFAULT_STEPS,
                 faults: tuple[str, ...] = ALL_FAULTS, clients: int = 3,
                 root: str | None = None, verbose: bool = False,
                 scenario: Scenario | None = None) -> None:
        """``nodes``: the pool (n1..nN, at least 4; n1..n3 found the metastore).
        ``verbose``: the trace holds the nodes' log lines too (a replay's detail).
        ``scenario``: the table and actions (default: ``plan_scenario`` of the seed)."""
        if nodes < 4:
            raise ValueError("the placement simulator needs at least 4 nodes")
        self.seed = seed
        self.verbose = verbose
        self.world = World(seed)
        pool = [f"n{i}" for i in range(1, nodes + 1)]
        self.scenario: Scenario = scenario or plan_scenario(seed, steps, pool=pool)
        self.faults = faults
        rng = self.world.fault_rng
        self.net = Network(self, NetFaults(
            drop=rng.choice([0.0, 0.01, 0.03]) if "drop" in faults else 0.0,
            dup=rng.choice([0.0, 0.02]) if "dup" in faults else 0.0,
            delay=rng.choice([0.0, 0.05]) if "delay" in faults else 0.0))
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix=f"placement-sim-{seed}-",
                                             dir=_scratch())
        self.hosts = {n: Host(self, n) for n in pool}
        self.inv = Invariants(self)
        self.violations: list[str] = []
        self.trace: deque[str] = deque(maxlen=5000 if verbose else 200)
        self.admitted: set[str] = set()
        self.topology = list(self.scenario.topology)
        self.replicas = self.scenario.replicas
        self.fault_counts: dict[str, int] = {}
        self.clients: Clients | None = None
        self.current = "-"  # whose loop turn runs: the log lines' node

    def _capture(self) -> logging.Handler:
        """The nodes' log lines, stamped with the simulated time and the node whose turn
        wrote them, go into the trace (what a failing seed prints): from INFO with
        ``verbose``, else errors only (they go nowhere else: the nodes' warnings about
        durability being off, say, are expected here)."""
        sim = self

        class Capture(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                text = record.getMessage().replace(sim.root, "<root>")
                sim.trace.append(f"{sim.world.now:8.3f} [{sim.current}] "
                                 f"{record.levelname} {text}")

        level = logging.INFO if self.verbose else logging.ERROR
        handler = Capture(level)
        root = logging.getLogger("raftkv")
        root.addHandler(handler)
        self._log_state = (root.level, root.propagate)
        root.setLevel(level)
        root.propagate = False
        return handler

    # ------------------------------------------------------------------ plumbing ------
    def log(self, line: str) -> None:
        self.trace.append(f"{self.world.now:8.3f} {line}")

    def violation(self, what: str) -> None:
        self.log(f"VIOLATION {what}")
        self.violations.append(f"t={self.world.now:.3f} {what}")

    def dial(self, src: Host, dst: str) -> None:
        """A connection from ``src`` to ``dst`` comes up a moment later if both run."""
        target = self.hosts.get(dst)
        if target is None:
            return
        sg, tg = src.gen, target.gen

        def connected() -> None:
            if src.gen == sg and target.gen == tg and src.up and target.up:
                assert src.node is not None and target.node is not None
                src.node.transport.link_up(dst)  # type: ignore[attr-defined]
                target.node.transport.link_up(src.id)  # type: ignore[attr-defined]

        self.world.after(0.002, connected)

    def sleep(self, seconds: float) -> None:
        self.world.run_until(self.world.now + seconds)

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        """Run the world until ``pred()`` is truthy (checked every 50 ms)."""
        end = self.world.now + timeout
        while True:
            got = pred()
            if got:
                return got
            if self.world.now >= end:
                raise Timeout(f"{what} within {timeout:.0f}s")
            self.sleep(0.05)

    def live(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.up]

    def count(self, what: str) -> None:
        self.fault_counts[what] = self.fault_counts.get(what, 0) + 1

    # ------------------------------------------------------------------ admin ---------
    def admin(self, what: str, begin: Callable[[MetaService, Callable[[bool], None]], None],
              timeout: float = 60.0) -> None:
        """Run an admin request on a random live node's metastore replica, again on
        another after a failure, until it is done (each is idempotent)."""
        done = [False]

        def attempt() -> None:
            if done[0]:
                return
            live = self.live()
            if not live:
                self.world.after(0.2, attempt)
                return
            meta = self.world.fault_rng.choice(live).meta
            assert meta is not None
            retried = [False]

            def finished(ok: bool) -> None:
                if ok:
                    done[0] = True
                elif not retried[0]:
                    retried[0] = True
                    self.world.after(0.2, attempt)

            try:
                begin(meta, finished)
            except Exception:  # noqa: BLE001  # a stopped node: try another
                finished(False)

        attempt()
        self.wait(lambda: done[0], timeout, what)
        self.log(what)

    def set_nodes(self, nodes: list[str]) -> None:
        def begin(meta: MetaService, finished: Callable[[bool], None]) -> None:
            meta.put(TOPOLOGY_KEY, encode_nodes(sorted(nodes))).add_done_callback(
                lambda f: finished(f.exception() is None))

        self.admin(f"set_nodes {nodes}", begin)
        self.topology = list(nodes)

    def set_settings(self, settings: ClusterSettings) -> None:
        def begin(meta: MetaService, finished: Callable[[bool], None]) -> None:
            meta.put(SETTINGS_KEY, settings.encode()).add_done_callback(
                lambda f: finished(f.exception() is None))

        self.admin(f"settings {settings}", begin)

    def create_table(self, partitions: int, replicas: int, storage: str) -> None:
        def begin(meta: MetaService, finished: Callable[[bool], None]) -> None:
            def got_topology(f: Future[Any]) -> None:
                if f.exception() is not None:
                    finished(False)
                    return
                topo = f.result()
                nodes = decode_nodes(topo.value) if topo is not None else []
                desc = TableDescriptor.new(TABLE, partitions, replicas, storage, nodes)
                meta.invoke(*create_table_invoke(desc, topo)).add_done_callback(created)

            def created(f: Future[Any]) -> None:
                if f.exception() is not None:
                    finished(False)
                    return
                res = f.result()
                assert isinstance(res, InvokeResult)
                # Refused: the topology moved, or an earlier attempt created it.
                finished(res.succeeded or self._table_exists())

            meta.get(TOPOLOGY_KEY).add_done_callback(got_topology)

        self.admin(f"create_table {partitions}x{replicas} {storage}", begin)

    def _table_exists(self) -> bool:
        return any(h.mgr is not None and h.mgr.table(TABLE) is not None for h in self.live())

    def set_replicas(self, replicas: int) -> None:
        key = table_key(TABLE)

        def begin(meta: MetaService, finished: Callable[[bool], None]) -> None:
            def got(f: Future[Any]) -> None:
                cur = f.result() if f.exception() is None else None
                if cur is None:
                    finished(False)
                    return
                if TableDescriptor.decode(cur.value).replicas == replicas:
                    finished(True)
                    return
                meta.invoke(*set_replicas_invoke(key, cur, replicas)).add_done_callback(
                    lambda f: finished(f.exception() is None and f.result().succeeded))

            meta.get(key).add_done_callback(got)

        self.admin(f"set_replicas {replicas}", begin)
        self.replicas = replicas

    def admit(self, nid: str) -> None:
        """A node beyond the founders joins the metastore as a learner (once)."""
        if nid in META or nid in self.admitted:
            return

        def begin(meta: MetaService, finished: Callable[[bool], None]) -> None:
            leader = self.meta_leader()
            if leader is None:
                finished(False)
                return
            lm = self.hosts[leader].meta
            assert lm is not None
            join_metastore_as_learner(lm, nid, f"{nid}:1").add_done_callback(
                lambda f: finished(f.exception() is None))

        self.admin(f"admit {nid} to the metastore", begin)
        self.admitted.add(nid)

    # ------------------------------------------------------------------ views ---------
    def leader_of(self, gid: str) -> str | None:
        for h in self.live():
            assert h.node is not None
            g = h.node.groups.get(gid)
            if g is not None and g.raft.role == Role.LEADER:
                return h.id
        return None

    def meta_leader(self) -> str | None:
        return self.leader_of(META_GROUP)

    def _meta_view(self) -> MetaService | None:
        """The metastore replica that has applied the most."""
        best = None
        for h in self.live():
            assert h.node is not None and h.meta is not None
            g = h.node.groups.get(META_GROUP)
            if g is not None and (best is None or g.state.applied_index() >
                                  best[0]):
                best = (g.state.applied_index(), h.meta)
        return None if best is None else best[1]

    def _nodes_at(self, meta: MetaService, key: bytes) -> list[str]:
        v = meta.store.get_entry(key)
        return decode_nodes(v.value) if v is not None and v.value else []

    def assignment(self, p: int) -> tuple[list[str], list[str], list[str]]:
        """Partition ``p``'s (stable, pending, planned), as the most advanced metastore
        replica has them."""
        meta = self._meta_view()
        if meta is None:
            return [], [], []
        pk = partition_keys(TABLE, p)
        return (self._nodes_at(meta, pk.stable), self._nodes_at(meta, pk.pending),
                self._nodes_at(meta, pk.planned))

    def moving(self) -> list[int]:
        meta = self._meta_view()
        if meta is None:
            return []
        return [p for p in range(self.scenario.partitions)
                if self._nodes_at(meta, partition_keys(TABLE, p).pending)]

    def converged(self) -> bool | str:
        """Every partition at its calculated assignment, nothing pending, planned or
        switched, hosted by exactly its stable nodes, one leader with those voters and
        no learner, every replica at the same applied index and digest."""
        meta = self._meta_view()
        if meta is None:
            return "no metastore replica"
        for p in range(self.scenario.partitions):
            gid = partition_group(TABLE, p)
            want = calc_assignments(TABLE, p, self.topology, self.replicas)
            pk = partition_keys(TABLE, p)
            got = (self._nodes_at(meta, pk.stable), self._nodes_at(meta, pk.pending),
                   self._nodes_at(meta, pk.planned))
            if got != (want, [], []):
                return f"{gid}: metastore {got} != {want}"
            for k in switch_keys(TABLE, p):
                if self._nodes_at(meta, k):
                    return f"{gid}: {k.decode()} is set"
            groups = {h.id: h.node.groups.get(gid) for h in self.live()
                      if h.node is not None}
            hosts = sorted(n for n, g in groups.items() if g is not None)
            if hosts != want:
                return f"{gid}: hosted on {hosts}, want {want}"
            leaders = [g for g in groups.values()
                       if g is not None and g.raft.role == Role.LEADER]
            if len(leaders) != 1:
                return f"{gid}: {len(leaders)} leaders"
            conf = leaders[0].raft.conf
            if sorted(conf.voters) != want or conf.learners:
                return f"{gid}: voters {sorted(conf.voters)} learners {sorted(conf.learners)}"
            figures = {(g.state.applied_index(), g.state.digest())
                       for g in groups.values() if g is not None}
            if len(figures) != 1:
                return f"{gid}: replicas differ {sorted(figures)}"
        return True

    # ------------------------------------------------------------------ faults --------
    def restart_later(self, h: Host, down: float, wipe: bool = False) -> None:
        h.crash(wipe=wipe)
        self.sleep(down)
        h.start()

    def random_fault(self) -> None:
        """One node or network fault between the scenario's actions (at most one node
        down or cut off at a time: the scenarios' topologies tolerate one failure)."""
        rng = self.world.fault_rng
        kinds = [f for f in ("crash", "wipe", "partition") + LIVENESS_FAULTS + DRAIN_FAULTS
                 if f in self.faults]
        if not kinds or rng.random() < 0.4:
            return
        kind = rng.choice(kinds)
        up = [h for h in self.live() if h.id in self.topology or h.id in META]
        if not up:
            return
        victim = rng.choice(up)
        if kind == "drain":
            self.drain(rng)
            return
        if kind == "partition":
            self.net.cut.add(victim.id)
            self.log(f"partition {victim.id} away")
            self.count("partition")
            self.sleep(rng.uniform(0.2, 3.0))
            self.net.cut.discard(victim.id)
            self.log(f"heal {victim.id}")
            return
        # A loss of state (a wipe, or any crash of an in-memory table's node) only where
        # the partitions can survive it (``_survivable_loss``); a crash keeps the files.
        memory = self.scenario.storage == MEMORY
        loses = kind == "wipe" or memory
        if loses and not self._survivable_loss(victim):
            if memory:
                return
            kind = "crash"
        self.count(kind)
        if kind == "outage":  # declared dead, its partitions re-replicated, then back
            self.restart_later(victim, SCALE_DOWN + rng.uniform(1.0, 6.0))
        elif kind == "flap":  # down and up around the scale-down timeout, three times
            for i in range(3):
                if i and loses and not self._survivable_loss(victim):
                    break
                self.restart_later(victim, SCALE_DOWN * rng.uniform(0.6, 1.4))
                self.sleep(SCALE_UP * rng.uniform(0.3, 1.5))
                if loses:
                    self.settle(f"after a flap of {victim.id}")
        else:
            self.restart_later(victim, rng.uniform(0.1, 2.0), wipe=kind == "wipe")
        if loses:
            # IGNITE-16668's re-add must finish before another loss: a second one
            # first could leave a minority holding the state.
            self.settle(f"after the {kind} of {victim.id}")

    def drain(self, rng: random.Random) -> None:
        """Drain a live node beyond the founders (their restart at the end takes the
        founding path): with the node SIGKILLed during its drain, or, as ``remove-node``
        of a node lost for good, killed first and removed without the replica check.
        Then wait until it has left the topology, the metastore and the draining list,
        and stop it: a drained node no longer hears the metastore. A later intent that
        names it again restarts it and admits it again, as ``add-node`` does."""
        lead = self.meta_leader()
        if lead is None:
            return
        lead_node = self.hosts[lead].node
        assert lead_node is not None
        # A metastore voter (a spare promoted after an outage) keeps its vote while no
        # other spare can take it, and its drain waits for one: not a fault to finish.
        voters = lead_node.groups[META_GROUP].raft.conf.voters
        spare = sorted(h.id for h in self.live()
                       if h.id in self.topology and h.id not in META and h.id not in voters)
        if not spare:
            return
        nid = rng.choice(spare)
        victim = self.hosts[nid]
        how = rng.choice(["live", "killed", "removed"])
        # Lost for good only where every group it is in keeps a majority without it, and
        # with three replicas: a partition may move onto a 2-member configuration that
        # names it while it is dead but not yet declared so (nothing acts on suspicion),
        # and two replicas never survive losing one for good (seed 104).
        if how != "live" and (self.scenario.storage == MEMORY or self.replicas < 3
                              or not self._survivable_loss(victim, for_good=True)):
            how = "live"
        if how == "removed":
            victim.crash()
            self.wait(lambda: nid in self._nodes_at_meta(DEAD_KEY), SETTLE_SECONDS,
                      f"{nid} declared dead")
        refused: list[str] = []
        sent = [False]

        def begin(meta: MetaService, finished: Callable[[bool], None]) -> None:
            def got(f: Future[Any]) -> None:
                if f.exception() is not None:
                    finished(False)
                    return
                topo, dr, dead, desc = f.result()
                tables = [TableDescriptor.decode(desc.value)] if desc is not None else []
                try:
                    inv = drain_invoke(nid, topo, dr, dead, tables,
                                       check_replicas=how != "removed")
                except UnknownNode as e:
                    # Not in the topology, where this sim put it: an earlier attempt whose
                    # answer was lost drained it, and the drain may even have finished
                    # and been forgotten (seed 2808: taken for a refusal, the node was
                    # never stopped, then named again while up, never readmitted to the
                    # metastore it had left, and nothing converged).
                    if not sent[0]:
                        refused.append(str(e))
                    finished(True)
                    return
                except ValueError as e:
                    refused.append(str(e))
                    finished(True)
                    return
                if inv is None:  # an earlier attempt drained it
                    finished(True)
                    return
                sent[0] = True
                meta.invoke(*inv).add_done_callback(
                    lambda f: finished(f.exception() is None and f.result().succeeded))

            meta.get_many([TOPOLOGY_KEY, DRAINING_KEY, DEAD_KEY, table_key(TABLE)]
                          ).add_done_callback(got)

        self.admin(f"drain {nid} ({how})", begin)
        if refused:
            self.log(f"drain {nid} refused: {refused[0]}")
            if how == "removed":
                victim.start()
            return
        self.count("drain" if how == "live" else f"drain_{how}")
        self.topology = [n for n in self.topology if n != nid]
        if how == "killed":
            self.sleep(rng.uniform(0.0, 1.5))
            victim.crash()
        self.wait(lambda: self._drained(nid), DRAIN_SECONDS, f"{nid}'s drain to finish")
        self.log(f"{nid} drained")
        if victim.up:
            victim.crash()
        self.admitted.discard(nid)

    def _nodes_at_meta(self, key: bytes) -> list[str]:
        meta = self._meta_view()
        return [] if meta is None else self._nodes_at(meta, key)

    def _drained(self, nid: str) -> bool:
        """Out of the topology and the draining list, and in no metastore configuration
        its leader knows."""
        lead = self.meta_leader()
        if lead is None or nid in self._nodes_at_meta(DRAINING_KEY) \
                or nid in self._nodes_at_meta(TOPOLOGY_KEY):
            return False
        node = self.hosts[lead].node
        assert node is not None
        return nid not in node.groups[META_GROUP].raft.conf.members()

    def _survivable_loss(self, victim: Host, for_good: bool = False) -> bool:
        """Whether every partition can lose ``victim``'s state and still make progress:
        where it is involved (in stable, in pending, or a voter of the configuration
        it knows), each of those has at least three members, so a majority remains;
        or (unless ``victim`` is lost ``for_good``) the partition is the lone-holder
        case the survivor rule covers ("The lone holder of a two-voter configuration" in
        ``raftkv.placement.safe_restart``: stable and voters are {victim, a} with no
        learner, a is up, pending is empty or names a).
        Anything else is two losses for some group: unsafe-reset territory, not a
        fault to recover from."""
        meta = self._meta_view()
        if meta is None or victim.node is None or not self._metastore_survives(victim):
            return False
        for p in range(self.scenario.partitions):
            pk = partition_keys(TABLE, p)
            if not self._planned(meta, pk):
                return False  # pending is about to change under the check (seed 581)
            stable = self._nodes_at(meta, pk.stable)
            pending = self._nodes_at(meta, pk.pending)
            g = victim.node.groups.get(partition_group(TABLE, p))
            voters = sorted(g.raft.conf.voters) if g is not None else []
            learners = bool(g.raft.conf.learners) if g is not None else False
            groups = [m for m in (stable, pending, voters) if victim.id in m]
            if all(len(m) >= 3 for m in groups):
                continue
            if for_good:
                return False
            others = [n for n in stable if n != victim.id]
            # No learner: a survivor election needs the grant of every learner that may
            # have been promoted, and a learner whose incarnation record is not yet
            # committed cannot give it (it cannot prove it is not a wiped voter): that
            # case waits for an operator (seed 18; docs/placement-simulator.md).
            lone = (len(stable) == 2 and voters == stable and not learners
                    and len(others) == 1 and self.hosts[others[0]].up
                    and (not pending or others[0] in pending))
            if not lone:
                return False
        return True

    def _metastore_survives(self, victim: Host) -> bool:
        """The metastore group can lose ``victim``'s state: its leader counts every other
        voter as caught up (a wiped voter readmitted as a learner, not yet promoted back,
        is one loss already; a second one would leave no majority: seeds 1704 and 1829)."""
        lead = self.meta_leader()
        if lead is None:
            return False
        node = self.hosts[lead].node
        assert node is not None
        raft = node.groups[META_GROUP].raft
        if raft.conf.learners & set(META):
            return False
        for n in raft.conf.voters - {victim.id}:
            other = self.hosts[n].node
            g = other.groups.get(META_GROUP) if other is not None else None
            if g is None:
                return False
            # Recorded as the incarnation it runs now (a match index can be the old
            # incarnation's), the record committed, and caught up.
            if (raft._incs.get(n, g.raft.cfg.incarnation) != g.raft.cfg.incarnation
                    or not raft._countable(n)):
                return False
            if n != lead and (n not in raft.prs or raft.prs[n].match < raft.log.committed):
                return False
        return True

    @staticmethod
    def _planned(meta: MetaService, pk: Any) -> bool:
        """Whether step (1) has run for the latest intent (the topology's and the
        descriptor's revisions), so pending is not about to change under the check."""
        trig = meta.store.get_entry(pk.trigger)
        seen = decode_revision(trig.value) if trig is not None and trig.value else 0
        topo, desc = (meta.store.get_entry(k) for k in (TOPOLOGY_KEY, table_key(TABLE)))
        if desc is not None and desc.mod_revision == desc.create_revision and (
                topo is None or topo.mod_revision < desc.create_revision):
            return True  # the creation's assignment is current (step (1) skips it)
        return all(v is None or v.mod_revision <= seen for v in (topo, desc))

    def crash_mid_rebalance(self, action: Action, meta: bool) -> None:
        """The chaos test's crash_meta/crash_leader: write the intent, stop a leader once
        some partition is pending, restart it."""
        late = self.apply(action.intents[0], start=False)
        try:
            moving = self.wait(self.moving, 5, "a pending assignment")
        except Timeout:
            moving = []
        self.sleep(action.delay)
        still = self.moving()
        if meta:
            victim = self.wait(self.meta_leader, 20, "a metastore leader")
            gid = META_GROUP
        else:
            pick = still or moving
            p = (self.world.fault_rng.choice(pick) if pick
                 else self.world.fault_rng.randrange(self.scenario.partitions))
            gid = partition_group(TABLE, p)
            victim = self.wait(lambda: self.leader_of(gid), 20, f"a leader of {gid}")
        if self.scenario.storage == MEMORY and not self._survivable_loss(self.hosts[victim]):
            self.log(f"not stopping {victim}: in memory, its loss is not survivable now")
            for n in late:
                self.start(n)
            return
        self.count("crash_mid_rebalance" if still else "crash_leader")
        self.log(f"stop {victim}, leader of {gid} (pending on {still})")
        self.restart_later(self.hosts[victim], action.down)
        for n in late:
            self.start(n)
        if self.scenario.storage == MEMORY:
            self.settle("after an in-memory restart")

    # ------------------------------------------------------------------ actions -------
    def start(self, nid: str) -> None:
        h = self.hosts[nid]
        if not h.up:
            h.start()
        self.admit(nid)

    def apply(self, intent: tuple[str, Any], start: bool = True) -> list[str]:
        kind, arg = intent
        late: list[str] = []
        if kind == "nodes":
            for n in arg:
                if not self.hosts[n].up and start:
                    self.start(n)
                elif not self.hosts[n].up:
                    late.append(n)
            self.set_nodes(list(arg))
        else:
            self.set_replicas(arg)
        return late

    def settle(self, why: str) -> None:
        clients = self.clients
        if clients is not None:
            clients.pause()
        try:
            self.wait(lambda: self.converged() is True, SETTLE_SECONDS, f"convergence ({why})")
        except Timeout as e:
            raise Timeout(f"{e}; last: {self.converged()}") from None
        self.log(f"{why}: converged on {self.topology} x{self.replicas}")
        if clients is not None:
            clients.start()

    def run_action(self, action: Action) -> None:
        self.log(f"action {action}")
        if action.kind == "settle":
            self.settle("settle")
        elif action.kind in ("join", "leave", "replicas", "burst"):
            for intent in action.intents:
                self.apply(intent)
        elif action.kind in ("crash_meta", "crash_leader"):
            if "crash" in self.faults:
                self.crash_mid_rebalance(action, meta=action.kind == "crash_meta")
            else:
                self.apply(action.intents[0])
        else:
            raise ValueError(action.kind)

    def run(self, script: Callable[[PlacementSim], None] | None = None) -> PlacementResult:
        """The seed's run: the table is created, the clients start, then ``script``
        runs (default: the scenario's actions, each followed by a random fault), then
        the faults stop and the final checks run. A scripted test drives a sequence of
        its own through ``script`` with the same checks around it."""
        s = self.scenario
        stuck: str | None = None
        check: CheckResult | None = None
        lost: list[str] = []
        keys = table_keys(s.partitions)
        handler = self._capture()
        incarnations = seeded(random.Random(f"{self.seed}/incarnations"))
        incarnations.__enter__()
        try:
            self.log(s.describe().replace("\n", " |"))
            for nid in META:
                self.hosts[nid].start()
            self.set_nodes(self.topology)
            # Every run bounds its moves tighter than the defaults, so that the slots
            # and the catch-up timeout (change_peers, "Moving data at a bounded rate")
            # are exercised under every fault; the liveness faults shorten the timeouts.
            live = bool(set(LIVENESS_FAULTS + DRAIN_FAULTS) & set(self.faults))
            self.set_settings(ClusterSettings(
                SCALE_DOWN if live else ClusterSettings.scale_down_timeout,
                SCALE_UP if live else ClusterSettings.scale_up_timeout,
                max_moves=MAX_MOVES, catch_up_timeout=CATCH_UP))
            self.create_table(s.partitions, s.replicas, s.storage)
            self.settle("created")
            self.clients = Clients(self, s.partitions, keys, 3)
            self.clients.start()
            self.sleep(1.0)
            if script is not None:
                script(self)
            for action in s.actions:
                self.run_action(action)
                self.random_fault()
            # Faults stop: heal, restart everyone, and converge.
            self.net.cut.clear()
            self.net.faults = NetFaults()
            for nid in sorted(set(self.topology) | set(META)):
                self.start(nid)
            self.clients.pause()
            self.wait(lambda: self.clients is not None and self.clients.idle,
                      OP_WAIT + 1, "the clients to finish")
            self.settle("final")
            final = self.final_values(keys)
            history = list(self.clients.history)
            now = self.world.now
            history += [Operation(99, now, now, "get", k, None, v) for k, v in final.items()]
            check = check_history(history)
            lost = acknowledged_lost(history, final)
        except Timeout as e:
            stuck = str(e)
            self.log(f"STUCK {stuck}")
        finally:
            incarnations.__exit__(None, None, None)
            root = logging.getLogger("raftkv")
            root.removeHandler(handler)
            root.setLevel(self._log_state[0])
            root.propagate = self._log_state[1]
            for h in self.hosts.values():
                if h.up:
                    h.crash()
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)
        return PlacementResult(s.seed, self.violations, stuck, check, lost, list(self.trace),
                               dict(self.clients.counts) if self.clients else {},
                               self.world.now, dict(self.fault_counts))

    def final_values(self, keys: list[str]) -> dict[str, str | None]:
        """Each key's value on its partition's leader (converged: every replica agrees)."""
        out: dict[str, str | None] = {}
        for key in keys:
            gid = partition_group(TABLE, partition_of(key.encode(), self.scenario.partitions))
            lead = self.leader_of(gid)
            assert lead is not None
            node = self.hosts[lead].node
            assert node is not None
            got = node.groups[gid].state.get(key.encode())
            out[key] = None if got is None else bytes(got).decode()
        return out


def _scratch() -> str | None:
    """LMDB files in memory where the machine has a tmpfs: the simulator's disk need not
    be durable (a crash closes the files, as SIGKILL leaves them in the page cache)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def run_placement_seed(seed: int, nodes: int = 5, steps: int = DEFAULT_STEPS,
                       faults: tuple[str, ...] = ALL_FAULTS,
                       verbose: bool = False) -> PlacementResult:
    return PlacementSim(seed, nodes=nodes, steps=steps, faults=faults, verbose=verbose).run()

