"""The driver: one event-loop thread runs every Raft group this process hosts.

Theory of operation
-------------------
The core is pure, so everything with side effects lives here, in one thread that owns
the cores, their stores and the transport (none of them is thread-safe, and none needs
to be). Each loop turn:

1. ``poll`` until the next tick or until woken: socket events step received messages
   into their group's core; the wake-up pipe means other threads queued calls.
2. Run queued calls (proposals, reads, admin) on the loop thread. Proposals queued for
   a group in one turn become one ``propose_batch``: one log append, one fsync.
3. Tick every group when its time has come (``tick_seconds``), checkpoint state stores
   by policy and expire deadlines. Quiesced groups (idle groups whose leader stopped
   heartbeating, see "Quiescence" in ``raftkv.core.raft``) are not ticked and not
   asked for a Ready, which is what keeps a node hosting hundreds of idle groups cheap.
4. Take every group's Ready and persist them all (one commit and fsync per turn for the
   table partitions, whose logs share an LMDB environment, and one per other group, on
   worker threads at once, see ``_handle_readies``); then, per
   group, queue its messages, apply committed entries and resolve their futures, serve
   reads whose read index is now applied, and ``advance``. A leader's AppendEntries
   leave before its own sync, and entries committed earlier are applied before it
   (``_send_first``, ``_applies_first``).
5. Flush the transport: one frame per peer with everything the turn produced, the
   heartbeats of every group included.

Peer liveness (quiescence)
--------------------------
A quiesced follower stops ticking, so it would never notice its leader's death by
missed heartbeats. The transport's connection state stands in, as node liveness does
in CockroachDB: every heartbeat interval the driver pings each known peer (an empty
frame, sent only when nothing else went that way), and a peer is live while it is
connected and was heard from within one election timeout. Each tick the driver
reports changes to every core (``peer_down``/``peer_up``); the core decides what they
mean. A SIGKILLed leader's connection drops at once, so its followers wake and
campaign one randomized election timeout later, as before quiescence. With quiescence
off the cores are not told, but the driver tracks who is down all the same: writes
forwarded to a replaced leader that is down fail early (``_abandon_forwards``), and a
removal that would leave no reachable quorum is refused (``RaftKV.remove``).

Only members of a hosted group's configuration are pinged. A member removed from the
last group it shared with this node is forgotten by the transport (connection closed,
address dropped from the address book), and a restart learns the addresses of current
members only, so nothing dials a removed node again, unless a core sends it a message
(an answer to one it sent: it is alive then).

Callers live on other threads and get ``concurrent.futures.Future`` objects. A write's
future resolves to ``(index, result)`` once applied here, a read's to whatever the read
function returns, evaluated on the loop thread once ``applied >= read index`` (§6.4). A
follower forwards writes to the leader over the peer connection and relays the answer
(a state store with ``encode_result``/``decode_result``, a user's state machine, has its
results travel through them, so they arrive as what the leader's caller would get);
with no leader known, futures fail with ``NotLeader`` carrying the best hint.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgpack
from pysyncobj.monotonic import monotonic

from raftkv.core import (
    ConfChange,
    ConfChangeOp,
    ConfChangeRejected,
    Config,
    EntryType,
    Message,
    MessageType,
    NotAMember,
    NotLeader,
    Raft,
    RaftError,
    Ready,
    Role,
    Snapshot,
    bootstrap,
    decode_conf_entry,
)
from raftkv.node.errors import (
    NodeStopped,
    RemoteError,
    ReplicaEmpty,
    RequestTimeout,
    UnknownGroup,
)
from raftkv.node.group_storage import (
    ALREADY_APPLIED,
    GroupStorage,
    pack_chunks,
    persist_together,
)
from raftkv.node.runtime import Runtime, ThreadRuntime
from raftkv.node.stores import keep_cluster_id
from raftkv.node.user_state import SnapshotFailed
from raftkv.recovery.local import RecoveryReport
from raftkv.storage.durable_fs import write_durable
from raftkv.storage.errors import CheckpointDeferred, StorageError
from raftkv.storage.layout import read_cluster_id
from raftkv.storage.lmdb_log import LogEnv
from raftkv.storage.state_store import KVStateStore, StateStore, VerifiedImage
from raftkv.tls import TlsConfig
from raftkv.transport import codec
from raftkv.transport.handshake import JOINING
from raftkv.transport.tcp import Connection

log = logging.getLogger(__name__)

DEFAULT_TICK = 0.05  # 50 ms: with election_tick=10, elections time out in 0.5-1 s
MIN_TICK = 0.001
DEFAULT_REQUEST_TIMEOUT = 5.0
COMPACT_EVERY = 1.0
SNAPSHOT_TIMEOUT_ELECTIONS = 20

ReadFn = Callable[[StateStore], Any]
# An admin tool's request (``raftkv.admin``): ``handler(command, args)`` runs on the loop
# thread, must not block, and returns a Future of the plain-data answer.
AdminHandler = Callable[[str, list[Any]], "Future[Any]"]


class Metrics(Protocol):
    """What the driver reports; the server plugs Prometheus in, the default drops it."""

    def fsync(self, group: str, seconds: float) -> None: ...

    def proposals(self, group: str, n: int) -> None: ...

    def leader_change(self, group: str) -> None: ...

    def group_removed(self, group: str) -> None:
        """The node stopped hosting ``group``: forget its series."""


class NoMetrics:
    def fsync(self, group: str, seconds: float) -> None:
        pass

    def proposals(self, group: str, n: int) -> None:
        pass

    def leader_change(self, group: str) -> None:
        pass

    def group_removed(self, group: str) -> None:
        pass


@dataclass
class _Read:
    fn: ReadFn
    fut: Future[Any]
    deadline: float
    index: int = -1  # the read index once confirmed


@dataclass
class Group:
    """One hosted Raft group and the requests waiting on it."""

    id: str
    raft: Raft
    storage: GroupStorage
    recovery: RecoveryReport
    # index -> (term proposed in, future): resolved when that index applies.
    pending: dict[int, tuple[int, Future[Any]]] = field(default_factory=dict)
    # (deadline, index) in proposal order, so expiry only looks at the front.
    deadlines: deque[tuple[float, int]] = field(default_factory=deque)
    # (deadline, index): proposals whose own deadline comes before their batch's (a
    # write parked or forwarded before this node led), a heap.
    own_deadlines: list[tuple[float, int]] = field(default_factory=list)
    queued: list[tuple[bytes, Future[Any], float | None]] = field(default_factory=list)
    # Linearizable reads asked this turn: they share one ReadIndex round (``_flush_reads``).
    read_batch: list[_Read] = field(default_factory=list)
    # context -> the reads waiting on that ReadIndex round.
    reads: dict[str, list[_Read]] = field(default_factory=dict)
    ready_reads: deque[_Read] = field(default_factory=deque)
    transfers: list[tuple[str, Future[None], float]] = field(default_factory=list)
    # Requests that arrived while no leader was known: retried once one is.
    parked: list[tuple[Callable[[], None], Future[Any], float]] = field(default_factory=list)
    leader: str | None = None
    # The term this group's log holds durably (``_send_first``).
    durable_term: int = 0
    leader_changes: int = 0
    # Members reported answering as a retired incarnation (``Node._report_retired``).
    retired_reported: dict[str, int] = field(default_factory=dict)
    # When its state store's checkpoint timer runs out, as queued in Node._checkpoint_at.
    checkpoint_at: float | None = None
    # Called on the loop thread after each applied batch (watches, listeners).
    on_applied: list[Callable[[Group], None]] = field(default_factory=list)
    on_tick: list[Callable[[Group], None]] = field(default_factory=list)
    # Called on the loop thread when the known leader changes (``g.leader`` is updated).
    on_leader: list[Callable[[Group], None]] = field(default_factory=list)
    on_close: list[Callable[[Group], None]] = field(default_factory=list)
    # The id its peers' frames carry (``Node.add_group``'s ``wire_id``).
    wire: str = ""
    # Whether its state is one this replica may serve stale reads from (``read_kv``): a
    # state store that opened with history of its own, or one that has since reached the
    # commit index (or the snapshot) the first leader it heard from sent it. A replica
    # that starts empty (in memory, or new) holds a prefix of nothing until then.
    caught_up: bool = True
    catch_up_to: int | None = None

    @property
    def state(self) -> StateStore:
        return self.storage.state


@dataclass
class NodeConfig:
    node_id: str
    raft_addr: str
    secret: bytes
    peers: dict[str, str] = field(default_factory=dict)
    tick_seconds: float = DEFAULT_TICK
    election_tick: int = 10
    heartbeat_tick: int = 2  # 100 ms at the default tick: a fifth of the shortest election timeout
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    data_dir: str | None = None  # None: addresses learned at runtime are not kept
    faults: bool = False  # enable the transport's test fault switch
    # The cluster this node names in its handshakes (raftkv.node.stores, "Cluster ids"):
    # an id, b"" (none), or JOINING (adopt the first peer's). A data directory's own
    # cluster_id file, if it has one, wins.
    cluster_id: bytes = b""
    peer_tls: TlsConfig | None = None  # TLS on the peer port (raftkv.transport.tcp)
    # Let idle groups stop heartbeating and ticking (Config.quiesce); the driver then
    # pings peers and reports their liveness to the cores. RAFTKV_QUIESCE=0 in the
    # environment turns it off (A/B benchmarks, or an operator's escape hatch).
    quiesce: bool = field(default_factory=lambda: os.environ.get("RAFTKV_QUIESCE") != "0")

    def __post_init__(self) -> None:
        # Found from outside, embedded: a tick of 0 spun an idle node's loop (1.2 s of CPU
        # in 2 s), a negative request timeout failed every call at once while its write
        # could still apply, and an address other than the one peers lists for the node
        # was listened on while the others dialled the listed one. ``raftkv serve``'s
        # flags refuse the same values.
        if not (_is_number(self.tick_seconds) and MIN_TICK <= self.tick_seconds < math.inf):
            raise ValueError(f"tick_seconds must be at least {MIN_TICK} (a shorter tick spins "
                             f"the loop), not {self.tick_seconds!r}")
        if not (_is_number(self.request_timeout) and 0 < self.request_timeout < math.inf):
            raise ValueError(f"request_timeout must be a positive number of seconds, not "
                             f"{self.request_timeout!r}")
        listed = self.peers.get(self.node_id)
        if listed is not None and listed != self.raft_addr:
            raise ValueError(f"peers gives {self.node_id} the address {listed}, but its raft "
                             f"address is {self.raft_addr}: the others would dial the first")


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


class Node:
    """Hosts Raft groups on one transport and one loop thread. See the module docstring."""

    def __init__(self, config: NodeConfig, metrics: Metrics | None = None,
                 runtime: Runtime | None = None) -> None:
        """``runtime``: the clock, randomness, transport and threads (``raftkv.node.
        runtime``); production's by default, a simulator's in ``raftkv.testing``."""
        self.cfg = config
        self.id = config.node_id
        self.metrics: Metrics = metrics or NoMetrics()
        self.runtime: Runtime = runtime or ThreadRuntime()
        self.clock = self.runtime.clock
        self.groups: dict[str, Group] = {}
        self._checkpointing: dict[str, tuple[Group, Future[int]]] = {}  # _checkpoint_due
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        # Proposals from other threads (deque appends and pops are atomic).
        self._inbox: deque[tuple[str, bytes, Future[Any]]] = deque()
        self._woken = False
        self._dirty: set[str] = set()  # groups that may have a Ready this turn
        # Groups with proposals queued this turn, groups that applied since the last
        # tick, and when the checkpoint timers of the others with unflushed applies run
        # out (see _checkpoint_due): with hundreds of groups, scanning them all for these
        # on every turn and tick cost a loaded node a tenth of its loop.
        self._proposing: dict[str, Group] = {}
        self._reading: dict[str, Group] = {}
        self._unflushed: dict[str, Group] = {}
        self._checkpoint_at: list[tuple[float, int, Group]] = []
        self._checkpoint_seq = itertools.count()
        # (group, peer) -> None while its image is packed, or the newer request to pack next
        self._imaging: dict[tuple[str, str], Message | None] = {}
        self._checking: set[str] = set()  # groups whose received snapshot is being checked
        self._lock = threading.Lock()
        addresses = dict(self._load_addresses())
        addresses.update(config.peers)
        self.transport = self.runtime.transport(self, addresses)
        self.transport.cluster_id = config.cluster_id
        self.transport.on_cluster_id = self._keep_cluster_id
        # Serves admin tools' requests (raftkv.admin); None: they are refused.
        self.admin_handler: AdminHandler | None = None
        # Random start: a restarted node must not reuse request ids a leader may still answer.
        self._seq = itertools.count(self.runtime.random().getrandbits(62))
        # Writes forwarded to a leader: rid -> (future, deadline, the group object, data,
        # the leader). The object, not the id: a group of the same id hosted later (a
        # table dropped and created again) is another group, and a write for the old one
        # must never be re-sent through it.
        self._forwarded: dict[int, tuple[Future[Any], float, Group, bytes, str]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._next_compact = 0.0
        # Peers whose connection is down or silent, as last reported to the cores. None
        # is connected yet: each is down until its handshake proves it up
        # (``_on_connected``), which a restarted core acts on ("Campaigning at restart").
        self._down: set[str] = {p for p in self.transport.peers if p != self.id}
        # Hosted groups by the id their frames carry (``add_group``'s ``wire_id``).
        self._wire: dict[str, Group] = {}
        self._ticks = 0
        self._next_tick = self.clock() + config.tick_seconds

    # ================================================================ setup ============
    def add_group(
        self, group_id: str, storage: GroupStorage, voters: list[str] | None,
        birth_known: bool = False, auto_handover: bool = True, wire_id: str | None = None,
    ) -> Group:
        """Host a group. ``voters`` bootstraps an empty log with that membership; None
        joins with an empty log and waits for a leader to add this node. Call before
        ``start`` (or through ``call`` once running).

        ``birth_known``: the caller knows from elsewhere that a bootstrap is the group's
        birth, so the core's newborn vote rule (``Config.newborn``, "Incarnations" in
        ``raftkv.core.raft``), which exists because a node alone cannot tell a birth from
        its own loss of state, does not apply. The placement layer decides from the
        metastore (a table's descriptor, IGNITE-16668's holds keys) when a partition is
        bootstrapped fresh; a founder started from the command line cannot know.

        ``auto_handover``: see ``Config.auto_handover`` (off for groups whose owner
        drives membership towards its own target).

        ``wire_id``: the id the group's frames carry between nodes (default: ``group_id``).
        A group whose name can be reused by an unrelated later group (a table partition:
        a table dropped and created again) carries its generation there, so a node that
        lags the change and still hosts the old group can neither reach the new one nor
        be reached by it: its frames name a group nobody hosts and are dropped, as its
        forwarded proposals are refused."""
        if group_id in self.groups:
            raise ValueError(f"group {group_id!r} is already hosted")
        wire = wire_id or group_id
        if wire in self._wire:
            raise ValueError(f"wire id {wire!r} is already hosted")
        if voters is not None:
            bootstrap(storage.log, voters)
        try:
            report = storage.recover()
        except StorageError as e:
            if type(e) is not StorageError:
                raise  # a kind the caller may act on (CorruptLog, Rebuildable)
            # Named: a node hosts many groups, and the message did not say which.
            raise StorageError(f"group {group_id}: {e}") from e
        ident = storage.log.identity()
        raft = Raft(
            Config(
                id=self.id, election_tick=self.cfg.election_tick,
                heartbeat_tick=self.cfg.heartbeat_tick,
                applied=storage.state.applied_index(), vote_floor=storage.vote_floor,
                # An image of a large state takes seconds to pack, send and install:
                # re-sending it after one election timeout only restarts the transfer.
                snapshot_timeout=SNAPSHOT_TIMEOUT_ELECTIONS * self.cfg.election_tick,
                quiesce=self.cfg.quiesce,
                incarnation=ident.incarnation, newborn=ident.newborn and not birth_known,
                auto_handover=auto_handover,
                # A group restarted whole (a power cut, a redeploy) leads again within
                # a tick or two of a majority being up, not an election timeout later.
                early_campaign=True,
            ),
            storage.log, self.runtime.random(),
        )
        if self.cfg.quiesce:  # what the other cores have been told already (_peer_changed)
            for peer in sorted(self._down):
                raft.peer_down(peer)
        g = Group(group_id, raft, storage, report, wire=wire, durable_term=raft.term,
                  # Index 1 is the founders' bootstrap configuration, which an in-memory
                  # founder writes and applies again on every start (found in review).
                  caught_up=storage.state.applied_index() > 1)
        self.groups[group_id] = g
        self._wire[wire] = g
        self._dirty.add(group_id)
        self._unflushed[group_id] = g  # recovery may have replayed past the checkpoint
        self._learn_conf_addresses(g)
        return g

    def remove_group(self, group_id: str) -> None:
        """Stop hosting a group (loop thread, or before ``start``): its pending requests
        fail and its stores close; the files stay (deleting them is the caller's call)."""
        g = self.groups.pop(group_id, None)
        if g is not None:
            del self._wire[g.wire]
            self._close_group(g, NodeStopped(f"group {group_id} is no longer hosted here"))
            self.metrics.group_removed(group_id)

    def _close_group(self, g: Group, err: Exception) -> None:
        for hook in g.on_close:
            hook(g)
        for rid, (fut, _, grp, _, _) in list(self._forwarded.items()):
            if grp is g:
                del self._forwarded[rid]
                _fail(fut, err)
        for _, fut in g.pending.values():
            _fail(fut, err)
        self._fail_reads(g, err)
        for _, fut, _ in g.parked:
            _fail(fut, err)
        for _, fut, _ in g.queued:
            _fail(fut, err)
        for _, fut, _ in g.transfers:
            _fail(fut, err)
        g.storage.state.close()
        close = getattr(g.storage.log, "close", None)
        if close is not None:
            close()

    def start(self) -> None:
        if self.cfg.data_dir is not None:
            # Read now: the directory is claimed (and a new one given its id) after the
            # node is built, which binds the raft address first. Without the file: a node
            # that joins still adopts one; a founder's token named none when its files
            # were made (before ids, or without a token), and it names none.
            kept = read_cluster_id(self.cfg.data_dir)
            self.transport.cluster_id = kept or (
                JOINING if self.cfg.cluster_id == JOINING else b"")
        self.transport.start()
        # Dial every member now, not at the first tick: when a whole cluster restarts,
        # the first election waits for the connections (``_on_connected``). The loop
        # thread does not run yet, so this thread may flush.
        for peer in sorted(self._members() - {self.id}):
            self.transport.ping(peer)
        self.transport.flush()
        self._thread = threading.Thread(target=self._run, name=f"raftkv-{self.id}", daemon=True)
        self._thread.start()

    def _keep_cluster_id(self, cluster_id: bytes) -> None:
        """The transport adopted the first member's cluster id (a node that joins):
        keep it with the data."""
        log.info("node %s: a member of cluster %s", self.id, cluster_id.hex())
        if self.cfg.data_dir is not None:
            keep_cluster_id(self.cfg.data_dir, cluster_id)

    def stop(self) -> None:
        """Stop the loop, fail what is pending, close the transport and the stores."""
        if self._thread is not None and self._thread.is_alive():
            self._stopping = True
            self.runtime.notify()
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log.error("node %s: the loop did not stop; leaving its stores open", self.id)
                return
        self.transport.close()
        self._fail_everything(NodeStopped(f"node {self.id} stopped"))

    def _fail_everything(self, err: Exception) -> None:
        # Popped as closed: a loop failure runs this, and stop() again.
        self._wire.clear()
        while self.groups:
            self._close_group(self.groups.popitem()[1], err)
        for fut, *_ in self._forwarded.values():
            _fail(fut, err)
        with self._lock:
            calls, self._calls = self._calls, deque()
        for _, fut in calls:
            _fail(fut, err)
        while self._inbox:
            _fail(self._inbox.popleft()[2], err)

    # ================================================ thread-safe API (any thread) =====
    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the loop thread; its return value (or exception) lands on the
        future."""
        fut: Future[Any] = Future()
        if self._stopping or self.failure is not None:
            fut.set_exception(self._not_running())
            return fut
        with self._lock:
            self._calls.append((fn, fut))
        self._wake()
        return fut

    def _not_running(self) -> NodeStopped:
        """Why a call fails at once: stopped, or the loop failed (and with what: a bare
        "not running" gave a program that met a damaged log no reason, found from
        outside)."""
        if self.failure is not None:
            return NodeStopped(f"node {self.id} is not running: its loop failed with "
                               f"{self.failure!r}")
        return NodeStopped(f"node {self.id} is not running")

    def _wake(self) -> None:
        # Producers append first, then wake: the loop clears the flag before draining,
        # so an item is either drained by the current pass or followed by a wake-up.
        if not self._woken:
            self._woken = True
            self.runtime.notify()

    def propose(self, group: str, data: bytes,
                shape: Callable[[int, Any], Any] | None = None) -> Future[Any]:
        """Replicate one command; resolves to ``(index, result)`` once applied here, or
        to ``shape(index, result)``. The hot path: no closure, one future, and the loop
        is woken only if it is not already about to drain the inbox."""
        fut = Proposal(shape)
        if self._stopping or self.failure is not None:
            fut.set_exception(self._not_running())
            return fut
        self._inbox.append((group, data, fut))
        self._wake()
        return fut

    def read(self, group: str, fn: ReadFn, linearizable: bool = True) -> Future[Any]:
        """Evaluate ``fn(state_store)`` on the loop thread: after a ReadIndex round
        (linearizable) or at once on the local state (stale)."""
        out: Future[Any] = Future()

        def run() -> None:
            g = self._group(group)
            if not linearizable:
                if g.raft.removed is not None:
                    # Its copy stopped at its removal and will never move again: an
                    # error, not a silently frozen answer (found in review).
                    raise self._no_leader(g)
                out.set_result(fn(g.state))
                return

            def start() -> None:
                g.read_batch.append(_Read(fn, out, self.clock() + self.cfg.request_timeout))
                self._reading[g.id] = g

            self._when_leader(g, start, out)

        self._chain(self.call(run), out)
        return out

    def read_kv(self, group: str, fn: Callable[[KVStateStore], Any],
                linearizable: bool = True) -> Future[Any]:
        """``read`` of a group whose state store is a KV store (the default group, a
        table partition): ``fn`` may use its revisions, rows and outcomes. A stale read
        of a replica that started empty and has not caught up yet (``Group.caught_up``)
        fails with ``ReplicaEmpty``: found from outside, an in-memory partition's
        replica, restarted empty, answered a stale read of 2,000 committed keys with
        "absent" until it rejoined, and the docs send operators to stale reads to save a
        table's rows. A replica that opened with state of its own serves it, stale."""
        if linearizable:
            return self.read(group, cast("ReadFn", fn), True)

        def checked(state: KVStateStore) -> Any:
            g = self.groups[group]
            if not g.caught_up:
                if g.catch_up_to is not None and state.applied_index() >= g.catch_up_to:
                    g.caught_up = True
                else:
                    raise ReplicaEmpty(
                        f"{group}'s replica on {self.id} started empty and has not caught "
                        f"up yet (applied {state.applied_index()}): read without stale, "
                        "or retry")
            return fn(state)

        return self.read(group, cast("ReadFn", checked), False)

    def change_membership(self, group: str, cc: ConfChange,
                          learner_only: bool = False) -> Future[Any]:
        """Propose one membership change on the leader; resolves to ``(index, None)``
        once applied here. ``LeaderStepping`` means a transfer started instead.
        ``learner_only``: a removal meant for a learner, refused with
        ``ConfChangeRejected`` if the core has promoted it since the caller looked (the
        proposal runs on a later loop call; removing a voter needs the caller's quorum
        checks)."""
        out: Future[Any] = Future()

        def run() -> None:
            g = self._group(group)
            if learner_only and cc.node not in g.raft.conf.learners:
                raise ConfChangeRejected(f"{cc.node} is no longer a learner of {group}")
            index = g.raft.propose_conf_change(cc)
            g.pending[index] = (g.raft.term, out)
            g.deadlines.append((self.clock() + self.cfg.request_timeout, index))

        self._chain(self.call(run), out)
        return out

    def transfer_leadership(self, group: str, to: str) -> Future[None]:
        """Resolves once ``to`` leads, or fails with RequestTimeout."""
        out: Future[None] = Future()

        def run() -> None:
            g = self._group(group)
            if g.leader == to:
                out.set_result(None)
                return
            g.raft.transfer_leadership(to)
            g.transfers.append((to, out, self.clock() + 2 * self._election_seconds()))

        self._chain(self.call(run), out)
        return out

    def campaign_without(self, group: str, lost: str) -> Future[None]:
        """Start a survivor election in ``group`` without ``lost``'s vote
        (``Raft.campaign_without``; the caller vouches that ``lost`` lost its state).
        Resolves once the election started; fails with ``CampaignRejected`` when the
        configuration is not one the rule covers. Whether it won shows as leadership."""
        def run() -> None:
            self._group(group).raft.campaign_without(lost)

        return self.call(run)

    def reachable(self, peer: str) -> bool:
        """Whether ``peer`` is this node itself or was reachable at the last liveness
        check (loop thread; see "Peer liveness")."""
        return peer == self.id or peer not in self._down

    def heard_from(self, peer: str, within: float) -> bool:
        """Whether this node's transport heard from ``peer`` in the last ``within``
        seconds of its clock (this node itself: always). Loop thread."""
        return peer == self.id or self.transport.is_live(peer, self.clock(), within)

    def lease_seconds(self) -> float:
        """The silence after which a peer counts as down (one election timeout)."""
        return self._election_seconds()

    def status(self) -> Future[dict[str, Any]]:
        return self.call(self._status)

    # ============================================================ the loop =============
    def _run(self) -> None:
        try:
            while not self._stopping:
                self.runtime.poll(max(0.0, self._next_tick - self.clock()))
                self.turn()
        except BaseException as e:  # the loop must not die silently
            log.critical("node %s: driver loop failed", self.id, exc_info=True)
            self.failure = e
            # A persist job that failed leaves the others of its turn running: wait for
            # them before closing the stores they write.
            self.runtime.shutdown()
            self._fail_everything(NodeStopped(f"node {self.id}: driver loop failed: {e!r}"))
            raise
        finally:
            self.runtime.shutdown()

    def turn(self) -> None:
        """One loop turn (steps 2-5 of the module docstring), after the runtime's poll
        delivered what arrived. The loop thread calls it; a simulator calls it directly
        when a node's tick is due or something woke it."""
        self._run_calls()
        now = self.clock()
        if now >= self._next_tick:
            self._next_tick = max(self._next_tick + self.cfg.tick_seconds, now)
            self._tick(now)
        self._flush_proposals()
        self._flush_reads()
        # Only groups something happened to can have a Ready: with hundreds of
        # groups, asking each one after every frame dominates an idle node.
        dirty, self._dirty = self._dirty, set()
        ready = [g for gid in dirty
                 if (g := self.groups.get(gid)) is not None and g.raft.has_ready()]
        if ready:
            self._handle_readies(ready)
        self.transport.flush()

    @property
    def next_tick(self) -> float:
        """When the loop's next tick is due (``clock()`` time)."""
        return self._next_tick

    def _run_calls(self) -> None:
        self._woken = False
        inbox = self._inbox
        # Only the proposals queued before this turn, as for the calls below: a failed
        # proposal's callback may propose again at once (the PySyncObj layer does), and
        # an unbounded drain would then never end the turn that could change the answer.
        for _ in range(len(inbox)):
            group, data, fut = inbox.popleft()
            g = self.groups.get(group)
            if g is None:
                _fail(fut, UnknownGroup(f"node {self.id} does not host group {group!r}"))
            else:
                self._propose_or_forward(g, data, fut)
        marked = False
        # The calls queued before this turn: one a call queues runs next turn, after the
        # network, so a chain of calls that keep queueing themselves cannot hold the loop
        # (and a livelock among them shows as turns, not as one endless one).
        with self._lock:
            todo = len(self._calls)
        for _ in range(todo):
            with self._lock:
                fn, fut = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            if not marked:  # a call may touch any group: once per drain is enough
                self._dirty.update(self.groups)
                marked = True
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001  # a request's failure is its caller's
                fut.set_exception(e)

    def _tick(self, now: float) -> None:
        self.transport.maintain()
        self._liveness(now)
        compact = now >= self._next_compact
        if compact:
            self._next_compact = now + COMPACT_EVERY
        dirty = self._dirty
        self._checkpoint_due(now)
        for g in list(self.groups.values()):  # hooks may add or remove groups
            raft = g.raft
            quiet = raft.quiesced
            if not quiet:
                raft.tick()
            if compact:
                try:
                    g.storage.maybe_compact(raft.conf_at)
                except SnapshotFailed as e:
                    log_snapshot_failed(self.id, g, "compacting its log", e)
            self._expire(g, now)
            for hook in g.on_tick:
                hook(g)
            # A group that was quiet and still is has nothing to hand over (anything
            # that touched its core, a retried read say, woke it), unless a hook ran.
            if not (quiet and raft.quiesced and not g.on_tick):
                dirty.add(g.id)
        for rid, (fut, deadline, *_) in list(self._forwarded.items()):
            if now > deadline:
                del self._forwarded[rid]
                _fail(fut, RequestTimeout("the leader did not answer the forwarded write"))

    def _checkpoint_due(self, now: float) -> None:
        """Give each state store with unflushed applies its checkpoint policy's chance.

        A checkpoint is an fsync of the store's LMDB file. Waited for, even several at
        once on the persist threads, they held the loop for a quarter of its time under
        table load. So an LMDB store's sync runs on a checkpoint thread while the loop goes
        on applying (``StateStore.background_checkpoint``), and a later tick records what
        it made durable. A failed sync raises here, on the loop, as an inline one would.
        Stores without background checkpoints checkpoint inline. One failure is not
        fatal: a user state machine whose snapshot fails (``SnapshotFailed``) wrote
        nothing and lost nothing, so it is logged as an error and the loop goes on; the
        store's policy says when to try again, and until then the log is kept.

        Only two kinds of store are asked: those that applied since the last tick (their
        entry count may have crossed the policy's, and the first ask starts its timer),
        and those whose timer has run out, kept in a heap by deadline. Asking every store
        with unflushed applies on every tick was a fifth of a loaded node's loop with
        256 partitions, whose timers run for 10 s."""
        running = self._checkpointing
        for gid, (g, job) in list(running.items()):
            if job.done():
                del running[gid]
                try:
                    index = job.result()
                except CheckpointDeferred as e:
                    log_snapshot_failed(self.id, g, "checkpoint", e)
                    index = 0  # records nothing; the policy tries again later
                if self.groups.get(gid) is g:
                    g.state.checkpointed(index)
        fresh, self._unflushed = self._unflushed, {}
        for g in fresh.values():
            self._consider_checkpoint(g, now)
        timers = self._checkpoint_at
        while timers and timers[0][0] <= now:
            at, _, g = heapq.heappop(timers)
            if g.checkpoint_at == at:  # else superseded by a later deadline
                g.checkpoint_at = None
                self._consider_checkpoint(g, now)

    def _consider_checkpoint(self, g: Group, now: float) -> None:
        if self.groups.get(g.id) is not g:
            return
        if g.id in self._checkpointing:
            self._unflushed[g.id] = g  # again next tick, once its sync has finished
            return
        st = g.state
        if st.applied_index() == st.checkpoint_index():
            return
        if st.checkpoint_due(now):
            try:
                sync = st.background_checkpoint()
            except CheckpointDeferred as e:
                log_snapshot_failed(self.id, g, "checkpoint", e)
                st.checkpointed(0)  # records nothing; the policy tries again later
                return
            if sync is None:
                try:
                    st.checkpoint()
                except (SnapshotFailed, CheckpointDeferred) as e:  # nothing written or lost
                    log_snapshot_failed(self.id, g, "checkpoint", e)
            else:
                pool = self.runtime.executor("checkpoint", self.id)
                self._checkpointing[g.id] = (g, pool.submit(sync))
            return
        at = st.checkpoint_deadline()
        if at is not None and at != g.checkpoint_at:
            g.checkpoint_at = at
            heapq.heappush(self._checkpoint_at, (at, next(self._checkpoint_seq), g))

    def _liveness(self, now: float) -> None:
        """Ping every known peer once per heartbeat interval and tell the cores which
        peers went down or came back (see "Peer liveness" in the module docstring).
        Without quiescence the cores are not told, but the driver still tracks who is
        down: a write forwarded to a replaced leader and the strict removal check
        (``RaftKV.remove``) depend on it."""
        self._ticks += 1
        transport = self.transport
        members = self._members()
        peers = sorted(p for p in transport.peers if p in members)
        if self._ticks % max(1, self.cfg.heartbeat_tick) == 0:
            for peer in peers:
                transport.ping(peer)
        timeout = self._election_seconds()
        for peer in peers:
            live = transport.is_live(peer, now, timeout)
            if live != (peer not in self._down):
                self._peer_changed(peer, live)

    def _on_connected(self, peer: str) -> None:
        """A connection's handshake completed: a peer reported down (every peer is, at
        start) is told up now, not at the next tick, since a restarted voter campaigns on
        it ("Campaigning at restart" in ``raftkv.core.raft``): in a whole-cluster restart
        that is when the second node of a majority comes up. A connection that replaced
        another (both nodes dialed; the transport keeps one) is reported to the cores
        again: a campaign that went out on the closed one may be lost with it."""
        if peer in self._members() and self.transport.is_live(
                peer, self.clock(), self._election_seconds()):
            self._peer_changed(peer, True)

    def _peer_changed(self, peer: str, live: bool) -> None:
        """Record ``peer``'s liveness and tell the cores (told up again, for a connection
        that replaced another: see ``_on_connected``)."""
        if live != (peer not in self._down):
            if live:
                self._down.discard(peer)
                log.info("peer %s is reachable", peer)
            else:
                self._down.add(peer)
                log.info("peer %s is unreachable", peer)
        for g in self.groups.values():
            # Without quiescence the cores are never told a peer is down, so not that
            # it is up either (they then campaign on their election timers alone).
            if self.cfg.quiesce:
                if live:
                    g.raft.peer_up(peer)
                else:
                    g.raft.peer_down(peer)
            if not live and g.leader != peer:
                self._abandon_forwards(g, peer)
        self._dirty.update(self.groups)

    def _when_leader(self, g: Group, fn: Callable[[], None], fut: Future[Any]) -> None:
        """Run ``fn`` now if a leader is known, else when one is elected (within the
        request timeout): right after a start or an election there is briefly none."""
        if g.raft.removed is not None:
            _fail(fut, self._no_leader(g))
        elif g.leader is not None:
            fn()
        else:
            g.parked.append((fn, fut, self.clock() + self.cfg.request_timeout))

    def _no_leader(self, g: Group) -> NotLeader:
        """The error for a request no leader will take: ``NotAMember`` once a member told
        this node it was removed (it would wait in vain), else ``NotLeader``."""
        if g.raft.removed is not None:
            return NotAMember(self.id, *g.raft.removed, group=g.id)
        return NotLeader(self.id, g.leader)

    def _expire(self, g: Group, now: float) -> None:
        # Every tick, every group: most wait for nothing, so say so first. Proposal
        # deadlines stay queued after their proposals apply; with none pending they are
        # spent.
        if not (g.pending or g.reads or g.ready_reads or g.parked or g.transfers):
            g.deadlines.clear()
            return
        if g.ready_reads and g.ready_reads[0].deadline < now:
            # Confirmed read points this replica has not reached in time (cut off?).
            unexpired: deque[_Read] = deque()
            for r in g.ready_reads:
                if r.deadline < now:
                    _fail(r.fut, RequestTimeout(f"this replica did not reach index {r.index}"))
                else:
                    unexpired.append(r)
            g.ready_reads = unexpired
        # A proposal not applied in time (say this leader was cut off) has an unknown
        # outcome: a new leader may still commit it. The caller hears so, and the entry's
        # eventual application resolves nothing.
        while g.deadlines and g.deadlines[0][0] < now:
            _, last = g.deadlines.popleft()
            for index in [i for i in g.pending if i <= last]:
                _fail(g.pending.pop(index)[1], RequestTimeout(
                    f"entry {index} was not applied within {self.cfg.request_timeout}s; "
                    "its outcome is unknown"))
        while g.own_deadlines and g.own_deadlines[0][0] < now:
            _, index = heapq.heappop(g.own_deadlines)
            waiter = g.pending.pop(index, None)
            if waiter is not None:
                _fail(waiter[1], RequestTimeout(
                    f"entry {index} was not applied by its deadline; its outcome is unknown"))
        if g.parked:
            parked, g.parked = g.parked, []
            for fn, fut, deadline in parked:
                if now > deadline or g.raft.removed is not None:
                    _fail(fut, self._no_leader(g))
                elif g.leader is not None:
                    self._retry(fn, fut)
                else:
                    g.parked.append((fn, fut, deadline))
        for ctx, batch in list(g.reads.items()):
            if now > batch[0].deadline:  # the batch's first read was asked first
                del g.reads[ctx]
                for r in batch:
                    _fail(r.fut, RequestTimeout("no read index confirmed in time (no quorum?)"))
        if g.transfers:
            keep = []
            for to, fut, deadline in g.transfers:
                if now > deadline:
                    _fail(fut, RequestTimeout(f"{to} did not take over in time"))
                else:
                    keep.append((to, fut, deadline))
            g.transfers = keep

    def _queue(self, g: Group, data: bytes, fut: Future[Any],
               deadline: float | None = None) -> None:
        """Queue a proposal on this leader: the turn proposes each group's as one batch.
        ``deadline``: the write's own (it was parked or forwarded before this node led),
        kept rather than given a fresh request timeout (twice its timeout, found in
        review)."""
        g.queued.append((data, fut, deadline))
        self._proposing[g.id] = g

    def _flush_proposals(self) -> None:
        proposing, self._proposing = self._proposing, {}
        for g in proposing.values():
            if not g.queued or self.groups.get(g.id) is not g:
                continue
            queued, g.queued = g.queued, []
            self._dirty.add(g.id)
            try:
                last = g.raft.propose_batch(d for d, _, _ in queued)
            except RaftError as e:
                for _, fut, _ in queued:
                    _fail(fut, e)
                continue
            term = g.raft.term
            first = last - len(queued) + 1
            deadline = self.clock() + self.cfg.request_timeout
            for i, (_, fut, own) in enumerate(queued):
                old = g.pending.get(first + i)
                if old is not None:  # an earlier term's proposal here was truncated away
                    _fail(old[1], NotLeader(self.id, g.leader))
                g.pending[first + i] = (term, fut)
                if own is not None and own < deadline:
                    heapq.heappush(g.own_deadlines, (own, first + i))
            g.deadlines.append((deadline, last))
            self.metrics.proposals(g.id, len(queued))

    def _flush_reads(self) -> None:
        """Ask one read point per group for the linearizable reads queued this turn.
        Each ReadIndex round costs the leader a heartbeat to every follower and their
        answers (§6.4); a confirmed round proves leadership as of the moment it was
        asked, after every read in the batch arrived, so one round serves them all
        linearizably (etcd batches its ReadIndex requests the same way)."""
        reading, self._reading = self._reading, {}
        for g in reading.values():
            batch, g.read_batch = g.read_batch, []
            if not batch:
                continue
            if self.groups.get(g.id) is not g:
                for r in batch:
                    _fail(r.fut, UnknownGroup(f"node {self.id} does not host group {g.id!r}"))
                continue
            ctx = f"{self.id}/{next(self._seq)}"
            try:
                g.raft.read_index(ctx)
            except NotLeader as e:
                if g.leader is None:
                    for r in batch:
                        _fail(r.fut, e)
                    continue
                # The core lost its leader in this very turn (its tick started an
                # election, or a higher term arrived) and its Ready will say so: the
                # batch waits, and ``_on_soft_state`` asks the next leader (found in
                # review: these reads failed with NotLeader where one at a time they
                # had waited for the next leader).
            except RaftError as e:
                for r in batch:
                    _fail(r.fut, e)
                continue
            g.reads[ctx] = batch
            self._dirty.add(g.id)

    def _handle_readies(self, groups: list[Group]) -> None:
        """One turn's Readies: every group's is persisted before any group sends what
        reports on it or applies what it alone holds, so no message leaves before what
        it reports is durable (a leader's AppendEntries report nothing of its own log:
        ``_send_first`` sends them first).

        An LMDB commit costs two fdatasyncs. Groups whose logs share an environment
        (a node's table partitions, ``GroupStorage.log_env``) are written in one
        transaction: a turn that writes into sixteen partitions pays one commit, not
        sixteen. Every other group's log is an environment of its own, and when several
        units have something to write they run on worker threads (py-lmdb releases the
        GIL while LMDB commits and syncs), so the syncs overlap. Each store is still
        written by one thread at a time, and the loop thread uses it again only after
        the join. A Ready that need not sync (only the commit index moved) costs the log
        store no I/O (``LogStorage.save``'s ``sync``), so it is handed over here.

        Committed entries that were durable before this Ready (``_applies_first``) are
        applied before the sync, not after: their callers are answered while the log
        syncs the new entries (the HTTP thread runs while py-lmdb waits on the disk),
        instead of one fsync later. Applying them depends on nothing this Ready writes,
        and no message leaves any earlier; an answer to a caller is not a Raft message
        and claims nothing about this node's log."""
        readies = [(g, g.raft.ready()) for g in groups]
        units: dict[LogEnv | str, list[tuple[Group, Ready]]] = {}
        sent = False
        for g, rd in readies:
            if rd.must_sync:
                units.setdefault(g.storage.log_env or g.id, []).append((g, rd))
                sent |= self._send_first(g, rd)
            else:
                g.storage.persist(rd)
        if sent:
            self.transport.flush()
        applied: set[str] = set()
        for g, rd in readies:
            if rd.must_sync and _applies_first(rd):
                self._apply(g, rd)
                applied.add(g.id)
        jobs = list(units.values())
        if len(jobs) > 1:
            timed = list(self.runtime.executor("persist", self.id).map(_timed_persist, jobs))
        else:
            timed = [_timed_persist(j) for j in jobs]
        for (key, unit), seconds in zip(units.items(), timed, strict=True):
            # One fsync per unit: a shared environment's is reported once, under its
            # directory's name, not once for each of its groups.
            self.metrics.fsync(key if isinstance(key, str) else os.path.basename(key.path),
                               seconds)
        for g, rd in readies:
            if rd.hard_state is not None:
                g.durable_term = rd.hard_state.term
            if self.groups.get(g.id) is not g:
                continue  # a hook of an earlier group in this turn removed it
            self._finish_ready(g, rd, g.id in applied)
            if g.raft.has_ready():  # more to apply than one Ready carries
                self._dirty.add(g.id)

    def _send_first(self, g: Group, rd: Ready) -> bool:
        """Queue the messages of a leader's Ready that may leave before the Ready is
        durable, and keep the rest in it; whether any were queued.

        A leader may write its log in parallel with replicating it (dissertation
        §10.2.1; etcd's server sends a leader's messages before it saves): its
        AppendEntries, commit notices and heartbeats promise nothing about its own
        log. If it dies before its sync, followers hold entries it lost, uncommitted,
        as after any leader crash. Its own acknowledgement still waits for its sync: an
        answer to these messages is handled on a later turn, after this one's sync, and
        until then no quorum can count entries only this Ready holds. Three things they
        do carry must be durable already, so only these messages go first:

        - the term: the Ready does not change it (a node that just won, or a single
          voter that campaigned in this very turn, waits for its sync). A leader's vote
          is itself, made durable with its term, so checking the term is enough;
        - the commit index: below this Ready's first new entry. A single voter commits
          an entry the moment it appends it, and a learner must not apply an entry
          its leader may lose;
        - no snapshot (its image is installed first)."""
        if (g.raft.role != Role.LEADER or rd.snapshot is not None
                or (rd.hard_state is not None and rd.hard_state.term != g.durable_term)):
            return False
        bound = rd.entries[0].index if rd.entries else None
        late = []
        for m in rd.messages:
            if (m.type in _SENT_FIRST and m.term == g.durable_term
                    and (bound is None or m.commit < bound)):
                self.transport.send(m.to, codec.encode_message(g.wire, m))
            else:
                late.append(m)
        sent = len(late) < len(rd.messages)
        rd.messages = late
        return sent

    def _finish_ready(self, g: Group, rd: Ready, applied: bool = False) -> None:
        """Everything after persisting: send, apply (unless ``applied`` already), serve
        reads, advance."""
        for m in rd.messages:
            if m.type == MessageType.SNAPSHOT and m.snapshot is not None:
                self._send_snapshot(g, m)
            else:
                self.transport.send(m.to, codec.encode_message(g.wire, m))
        if rd.committed_entries or rd.snapshot is not None:
            self._unflushed[g.id] = g
        if rd.committed_entries:
            if not applied:
                self._apply(g, rd)
            for hook in g.on_applied:
                hook(g)
        for rs in rd.read_states:
            for r in g.reads.pop(rs.context, ()):
                r.index = rs.index
                g.ready_reads.append(r)
        self._serve_reads(g)
        g.raft.advance(rd)
        if rd.soft_state is not None:
            # After advance: reacting to a new leader may step the core (parked reads,
            # re-forwarded writes, hooks), which is not allowed between ready and advance.
            self._on_soft_state(g, rd.soft_state.lead)

    def _send_snapshot(self, g: Group, m: Message) -> None:
        """Attach the state image and send, packing it on a worker thread: the read view
        is taken here (consistent, and cheap), the seconds of copying happen there, and
        the loop keeps heartbeating meanwhile. One image per (group, peer) is packed at a
        time; a newer request arriving meanwhile is kept (the latest only) and packed
        next, because the core now waits for an acknowledgement of *that* snapshot."""
        key = (g.id, m.to)
        if key in self._imaging:
            self._imaging[key] = m
            return
        self._imaging[key] = None
        try:
            chunks = g.state.snapshot_chunks()
        except SnapshotFailed as e:
            del self._imaging[key]
            log_snapshot_failed(self.id, g, f"imaging a snapshot for {m.to}", e)
            return
        assert m.snapshot is not None
        meta = m.snapshot.meta

        def done() -> None:
            newer = self._imaging.pop(key, None)
            if newer is not None and self.groups.get(g.id) is g:
                self._send_snapshot(g, newer)

        def pack() -> None:
            started = self.clock()
            try:
                data = pack_chunks(chunks)
                packed = self.clock() - started
            except Exception:  # a failed image is dropped (and logged), never fatal
                log.warning("group %s: packing a snapshot for %s failed", g.id, m.to,
                            exc_info=True)
                self.call(done)
                return

            def send() -> None:
                if len(data) > self.transport.max_message - (1 << 20):
                    log.error("group %s: a %d-byte snapshot image exceeds the %d-byte message "
                              "limit; %s cannot be sent one", g.id, len(data),
                              self.transport.max_message, m.to)
                elif self.groups.get(g.id) is g:
                    log.info("group %s: sending %s a snapshot image of %d bytes (snapshot "
                             "%d, term %d), packed in %.2f s", g.id, m.to, len(data),
                             meta.index, meta.term, packed)
                    m.snapshot = Snapshot(meta, data)
                    self.transport.send(m.to, codec.encode_message(g.wire, m))
                done()

            self.call(send)

        self.runtime.spawn(pack, f"image-{g.id}-{m.to}")

    def _apply(self, g: Group, rd: Ready) -> None:
        entries = rd.committed_entries
        results = g.storage.apply(entries)
        pending = g.pending
        for e, result in zip(entries, results):
            if e.type == EntryType.CONF_CHANGE:
                self._on_conf_entry(g, e.data)
            waiter = pending.pop(e.index, None) if pending else None
            if waiter is None:
                continue
            term, fut = waiter
            if term != e.term:
                # Another leader's entry took this index: ours was never committed.
                _fail(fut, NotLeader(self.id, g.leader))
            elif isinstance(result, Exception) and type(fut) is not _Answer:
                _fail(fut, result)
            elif result is ALREADY_APPLIED:
                # It arrived inside a snapshot image: applied, but its result is unknown.
                _fail(fut, RequestTimeout(f"entry {e.index} was applied through a snapshot; "
                                          "its outcome is unknown"))
            else:
                _resolve(fut, e.index, result)

    def _serve_reads(self, g: Group) -> None:
        applied = g.state.applied_index()
        while g.ready_reads and g.ready_reads[0].index <= applied:
            r = g.ready_reads.popleft()
            try:
                r.fut.set_result(r.fn(g.state))
            except Exception as e:  # noqa: BLE001  # the read function's error is its caller's
                _fail(r.fut, e)

    def _on_soft_state(self, g: Group, lead: str | None) -> None:
        changed = lead != g.leader
        if changed:
            self._abandon_forwards(g, g.leader)
            g.leader = lead
            if lead == self.id:
                # Elected, its log holds every committed entry (§5.4.3): its state may
                # serve stale reads from now on, also once it no longer leads (found in a
                # fresh-clone run: the survivor of an in-memory partition's lost majority,
                # its leader before, had never heard from one, and refused them).
                g.caught_up = True
            if lead is not None:
                g.leader_changes += 1
                self.metrics.leader_change(g.id)
                log.info("group %s: leader is now %s (term %d)", g.id, lead, g.raft.term)
            for hook in g.on_leader:
                hook(g)
            keep = []
            for to, fut, deadline in g.transfers:
                if lead == to:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((to, fut, deadline))
            g.transfers = keep
        self._dirty.add(g.id)  # the reactions below may step the core
        if changed and lead is not None and g.reads:
            # Read points asked of the old leader: if it died, no answer comes, and the
            # reads would wait out the request timeout (5 s, measured from outside during
            # a failover: tests/test_heal_procs.py). Ask the new one too. Its answer is
            # a commit index it confirmed after this moment, so the read stays
            # linearizable; whichever answer comes first is used (``_handle_readies``
            # pops the context), and a later one finds nothing to resolve.
            for ctx in list(g.reads):
                try:
                    g.raft.read_index(ctx)
                except NotLeader:
                    break  # the leader went again: the next change asks the next one
        if lead is not None and g.parked:
            parked, g.parked = g.parked, []
            now = self.clock()
            for fn, fut, deadline in parked:
                if now > deadline:  # not retried past it: it was not applied, say so
                    _fail(fut, NotLeader(self.id, g.leader))
                else:
                    self._retry(fn, fut)
        if g.raft.role != Role.LEADER and g.queued:
            queued, g.queued = g.queued, []
            for data, fut, own in queued:
                self._propose_or_forward(g, data, fut, own)

    # ====================================================== forwarding writes ========
    def _propose_or_forward(self, g: Group, data: bytes, fut: Future[Any],
                            deadline: float | None = None) -> None:
        """Propose on this leader, forward to the leader known, or park until one is
        known (until ``deadline``, by default a request timeout from now)."""
        if g.raft.role == Role.LEADER:
            self._queue(g, data, fut, deadline)
            return
        lead = g.leader
        if deadline is None:
            deadline = self.clock() + self.cfg.request_timeout
        if g.raft.removed is not None:
            _fail(fut, self._no_leader(g))
            return
        if lead is None or lead == self.id:
            # No leader known, or the one known is this node, which has just stepped
            # down (a vote request stepped in this turn's poll, say) and whose new soft
            # state the turn has yet to hand over: wait for the next leader. Failing it
            # with NotLeader here looped for ever under a caller that proposes again at
            # once, since the turn that would hand the soft state over never ended
            # (found from outside: a PySyncObj program transferring its leadership
            # under load).
            g.parked.append((self._forward_later(g, data, fut, deadline), fut, deadline))
            return
        # The write's own deadline, however often it is parked and forwarded again (a
        # fresh one at each forward let a write wait about twice its request timeout:
        # found in review).
        rid = next(self._seq)
        self._forwarded[rid] = (fut, deadline, g, data, lead)
        self.transport.send(lead, codec.encode_forward(rid, g.wire, data))

    @staticmethod
    def _retry(fn: Callable[[], None], fut: Future[Any]) -> None:
        try:
            fn()
        except RaftError as e:
            _fail(fut, e)

    def _on_undelivered(self, peer: str, items: list[Any]) -> None:
        """Forwarded writes that never left (no connection to the leader we knew): park
        them until a leader is reachable; they cannot have been applied."""
        for item in items:
            if item[0] != codec.FORWARD:
                continue
            waiter = self._forwarded.pop(item[1], None)
            if waiter is None:
                continue
            fut, deadline, g, data, _ = waiter
            self._park_forward(g, data, fut, deadline)

    def _park_forward(self, g: Group, data: bytes, fut: Future[Any], deadline: float) -> None:
        """A forwarded write that was not applied: retry it with the next leader, unless
        its group is no longer the one hosted under its id."""
        if self.groups.get(g.id) is not g:
            _fail(fut, UnknownGroup(f"group {g.id!r} is no longer hosted here"))
        else:
            g.parked.append((self._forward_later(g, data, fut, deadline), fut, deadline))

    def _abandon_forwards(self, g: Group, old: str | None) -> None:
        """Writes forwarded to a leader that is no longer leader will get no answer if it
        died: fail them now (outcome unknown) rather than at the request deadline.

        Only if it is down, though. A replaced leader that is still reachable answers
        every forward it took: with the result if its entry committed, with NotLeader
        (retried here) if another leader's entry took the index. Failing those at once
        turned a write at a cluster's birth, when the first leader is often replaced,
        into an unknown outcome (a CI failure). If it goes down later, ``_liveness``
        abandons them then."""
        if old is None or old not in self._down or not self._forwarded:
            return
        for rid, (fut, _, grp, _, target) in list(self._forwarded.items()):
            if grp is g and target == old:
                del self._forwarded[rid]
                _fail(fut, RequestTimeout(
                    f"leader {old} was replaced before answering; the outcome is unknown"))

    def _forward_later(self, g: Group, data: bytes, fut: Future[Any],
                       deadline: float) -> Callable[[], None]:
        return lambda: self._propose_or_forward(g, data, fut, deadline)

    def _answer_forward(self, peer: str, rid: int, group: str, data: bytes) -> None:
        g = self._wire.get(group)
        # A state store that knows its results' codec (UserStateStore) encodes them to
        # bytes for the follower, which decodes them with its own store (_on_reply).
        encode = getattr(g.state, "encode_result", None) if g is not None else None

        def reply(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                index, value = f.result()
                if encode is not None:
                    value = encode(value)  # an exception the state machine returned too
                elif isinstance(value, Exception):
                    exc = value
            if exc is None:
                try:
                    msgpack.packb(value)
                except (TypeError, ValueError, OverflowError):
                    exc = TypeError(f"result of type {type(value).__name__} is not msgpack")
                else:
                    self.transport.send(peer, codec.encode_reply(rid, True, [index, value]))
                    return
            # The leader's id for NotLeader; the index of the configuration that left
            # the sender out for NotAMember.
            hint = exc.index if isinstance(exc, NotAMember) else getattr(exc, "leader", None)
            self.transport.send(peer, codec.encode_reply(
                rid, False, [type(exc).__name__, str(exc),
                             hint if isinstance(hint, str | int) else None]))

        fut: Future[Any] = _Answer()
        fut.add_done_callback(reply)
        if g is None:
            _fail(fut, UnknownGroup(f"{self.id} does not host group {group!r}"))
        elif g.raft.tell_if_removed(peer):
            # A node outside every configuration we know forwards a write: it missed its
            # removal (a learner removed while idle hears nothing else; its writes waited
            # out their timeout). The write is refused, and the notice makes it stop. By
            # any member it asks, not only the leader: one that still takes the member it
            # asks for the leader, since replaced, was sent NotLeader and retried until
            # its deadline (found from outside).
            self._dirty.add(g.id)
            _fail(fut, NotAMember(peer, self.id, g.raft.log.applied, group=g.id))
        elif g.raft.role != Role.LEADER:
            _fail(fut, NotLeader(self.id, g.leader))  # one hop only: no forwarding loops
        else:
            self._queue(g, data, fut)

    def _on_reply(self, peer: str, rid: int, ok: bool, result: list[Any]) -> None:
        waiter = self._forwarded.get(rid)
        if waiter is None or waiter[4] != peer:
            return  # timed out already, or not from the leader it was sent to
        del self._forwarded[rid]
        fut, deadline, g, data, _ = waiter
        if ok and len(result) == 2 and type(result[0]) is int:
            decode = getattr(g.state, "decode_result", None)
            if decode is None:
                _resolve(fut, result[0], result[1])
                return
            try:
                value = decode(result[1])
            except ValueError as e:
                _fail(fut, RemoteError("WireError", f"applied at index {result[0]}, but the "
                                       f"leader's result does not decode: {e}"))
                return
            _resolve(fut, result[0], value)
        elif not ok and len(result) == 3:
            kind, message, hint = result
            if kind == "NotAMember" and type(hint) is int:
                # a member says we were removed
                _fail(fut, NotAMember(self.id, peer, hint, group=g.id))
            elif kind in ("NotLeader", "ProposalDropped"):
                # Refused before proposing (the peer no longer leads, or is handing its
                # leadership over): retry with the next leader until the deadline, as
                # for a write that never left. A follower forwarding through a leader
                # that was transferring had all 300 of its writes refused (a test).
                self._park_forward(g, data, fut, deadline)
            else:
                _fail(fut, RemoteError(str(kind), str(message)))
        else:
            _fail(fut, RemoteError("WireError", "malformed reply from the leader"))

    # ========================================================== admin tools ==========
    def _on_admin(self, conn: Connection, items: list[Any]) -> None:
        """An admin tool's requests (loop thread): each goes to ``admin_handler``, and
        its future's outcome goes back on the tool's connection."""
        for item in items:
            if codec.item_kind(item) != codec.ADMIN:
                raise codec.WireError("an admin connection sent something else")
            rid, command, args = codec.decode_admin(item)
            handler = self.admin_handler
            if handler is None:
                fut: Future[Any] = Future()
                fut.set_exception(UnknownGroup(f"node {self.id} serves no admin requests"))
            else:
                try:
                    fut = handler(command, args)
                except Exception as e:  # noqa: BLE001 - the tool's error, not the loop's
                    fut = Future()
                    fut.set_exception(e)
            fut.add_done_callback(functools.partial(self._admin_done, conn, rid))

    def _admin_done(self, conn: Connection, rid: int, f: Future[Any]) -> None:
        """Any thread: send the outcome from the loop thread."""
        exc = f.exception()
        value = None if exc is not None else f.result()

        def send() -> None:
            err = exc
            if err is None:
                try:
                    msgpack.packb(value)
                except (TypeError, ValueError, OverflowError):
                    err = TypeError(f"the answer, a {type(value).__name__}, is not msgpack")
                else:
                    conn.send_items([codec.encode_admin_reply(rid, True, value)])
                    return
            lead = getattr(err, "leader", None)
            lead = lead if isinstance(lead, str) else None
            peer = self.transport.peers.get(lead) if lead is not None else None
            conn.send_items([codec.encode_admin_reply(
                rid, False, [type(err).__name__, str(err), lead,
                             peer.addr if peer is not None else None])])

        self.call(send)

    # ========================================================== network input ========
    def _on_items(self, peer: str, items: list[Any]) -> None:
        """Called by the transport (loop thread) with one authenticated frame's items."""
        for item in items:
            kind = codec.item_kind(item)
            if kind == codec.RAFT:
                group, msg = codec.decode_message(item)
                self._step(peer, group, msg)
            elif kind == codec.FORWARD:
                self._answer_forward(peer, *codec.decode_forward(item))
            elif kind == codec.FORWARD_REPLY:
                self._on_reply(peer, *codec.decode_reply(item))
            else:
                raise codec.WireError(f"unknown item kind {kind}")

    def _step(self, peer: str, group: str, msg: Message) -> None:
        if msg.frm != peer or msg.to != self.id:
            # The authenticated identity is the only sender a message may claim.
            raise codec.WireError(f"{peer} sent a message from {msg.frm} to {msg.to}")
        g = self._wire.get(group)
        if g is None:
            log.debug("message for unhosted group %s from %s dropped", group, peer)
            return
        if not g.caught_up and g.catch_up_to is None and msg.term >= g.raft.term:
            # The first word from a leader: how far this replica must apply before its
            # stale reads are served (``read_kv``). A heartbeat's commit is bounded by
            # what the follower holds, so only appends and images count.
            if msg.type in (MessageType.APP, MessageType.COMMIT):
                g.catch_up_to = msg.commit
            elif msg.type == MessageType.SNAPSHOT and msg.snapshot is not None:
                g.catch_up_to = msg.snapshot.meta.index
        if msg.type == MessageType.SNAPSHOT and msg.snapshot is not None:
            self._check_snapshot(peer, g, msg)
            return
        self._dirty.add(g.id)
        try:
            g.raft.step(msg)
        except ValueError as e:  # the core's strict decoding of peer-supplied records
            raise codec.WireError(f"bad message from {peer}: {e}") from None
        if g.raft.retired_heard:
            self._report_retired(g)
        if g.raft.removed is not None and (g.read_batch or g.reads or g.ready_reads):
            self._fail_reads(g, self._no_leader(g))

    def _fail_reads(self, g: Group, err: BaseException) -> None:
        """Fail every read waiting on ``g`` (told it is not a member: they would wait in
        vain for an index it will never receive)."""
        reads = [*g.read_batch, *(r for b in g.reads.values() for r in b), *g.ready_reads]
        g.read_batch, g.reads, g.ready_reads = [], {}, deque()
        for r in reads:
            _fail(r.fut, err)

    def _report_retired(self, g: Group) -> None:
        """Say once per incarnation that a member answers as one the group replaced."""
        for node, inc in g.raft.retired_heard.items():
            if g.retired_reported.get(node) != inc:
                g.retired_reported[node] = inc
                log.warning(
                    "group %s: %s answers as incarnation %d, which the group replaced with "
                    "a newer one: its files are an older copy (restored from a backup?), "
                    "and it is ignored for good; stop it, remove its data directory and "
                    "start it again to have it readmitted (docs/wiped-nodes.md)",
                    g.id, node, inc)

    def _check_snapshot(self, peer: str, g: Group, msg: Message) -> None:
        """Check a snapshot's image on a worker thread, then step the message here.

        The image must be checked before the core adopts the snapshot
        (``GroupStorage.accept``), and a large one takes seconds: 2-3 s at 1M keys, during
        which a check on the loop thread stopped every group's heartbeats on this node
        and had its peers mark it unreachable. Stepping the message later is safe, as
        Raft tolerates any message delay; what the leader sends meanwhile is stepped
        first (heartbeats are answered; appends past this log are refused, as they were
        before the snapshot came). One image per group is checked at a time: another
        that arrives meanwhile is dropped, and the leader sends one again after its
        snapshot timeout if this one comes to nothing."""
        assert msg.snapshot is not None
        if g.id in self._checking:
            log.info("group %s: a snapshot image from %s dropped: one is being checked",
                     g.id, peer)
            return
        self._checking.add(g.id)
        snap = msg.snapshot

        def check() -> None:
            try:
                image = g.storage.check(msg)
            except Exception:  # a bug here must not leave the group refusing snapshots
                log.warning("group %s: checking a snapshot from %s failed", g.id, peer,
                            exc_info=True)
                image = None
            self.call(lambda: stepped(image)).add_done_callback(failed)

        def failed(f: Future[None]) -> None:
            if f.exception() is not None:  # on a future nobody waits for: say it here
                log.error("group %s: stepping a checked snapshot from %s failed", g.id,
                          peer, exc_info=f.exception())

        def stepped(image: VerifiedImage | None) -> None:
            self._checking.discard(g.id)
            if image is None or self._wire.get(g.wire) is not g:
                return
            g.storage.adopt(msg, image)
            log.info("group %s: received a snapshot image of %d bytes from %s (snapshot %d, "
                     "term %d), checked", g.id, len(snap.data), peer, snap.index, snap.term)
            self._dirty.add(g.id)
            try:
                g.raft.step(msg)
            except ValueError as e:  # its connection has moved on: drop the message
                log.warning("group %s: bad snapshot message from %s: %s", g.id, peer, e)

        self.runtime.spawn(check, f"check-{g.id}")

    # ============================================================ addresses ==========
    def _addresses_file(self) -> str | None:
        d = self.cfg.data_dir
        return os.path.join(d, "peers.json") if d else None

    def _load_addresses(self) -> dict[str, str]:
        path = self._addresses_file()
        if path is None or not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                data = json.load(f)
            return {str(k): str(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring unreadable address book %s: %s", path, e)
            return {}

    def _members(self) -> set[str]:
        """Every member of every hosted group's configuration (this node included)."""
        out: set[str] = set()
        for g in list(self.groups.values()):  # hooks may add or remove groups
            out |= g.raft.conf.members()
        return out

    def _on_address(self, peer: str, addr: str) -> None:
        self._save_addresses()

    def _save_addresses(self) -> None:
        """Keep the addresses of members (any hosted group's) and configured peers, so a
        restart can reach them; a peer that merely connected is not written down."""
        path = self._addresses_file()
        if path is None:
            return
        known = set(self.cfg.peers) | self._members()
        book = {pid: p.addr for pid, p in self.transport.peers.items()
                if p.addr and pid in known}
        write_durable(path, json.dumps(book, sort_keys=True).encode())

    def _learn_conf_addresses(self, g: Group) -> None:
        """At start: the addresses the log's membership changes carry, of current members
        only (a member added and removed since must not be dialed again)."""
        members = g.raft.conf.members()
        for e in g.storage.log.conf_entries(g.storage.log.first_index()):
            cc, _ = decode_conf_entry(e.data)
            if cc is not None and cc.node in members:
                self._learn_address(g, cc)

    def _learn_address(self, g: Group, cc: ConfChange) -> None:
        if cc.op == ConfChangeOp.ADD_LEARNER and cc.context and cc.node != self.id:
            try:
                self.transport.learn_address(cc.node, cc.context.decode())
            except UnicodeDecodeError:
                log.warning("group %s: address of %s is not UTF-8", g.id, cc.node)

    def _on_conf_entry(self, g: Group, data: bytes) -> None:
        cc, conf = decode_conf_entry(data)
        if cc is None:
            return
        self._learn_address(g, cc)
        log.info("group %s: %s applied; now %s", g.id, cc.describe(), conf.describe())
        if (cc.op == ConfChangeOp.REMOVE and cc.node != self.id
                and cc.node in self.transport.peers and cc.node not in self._members()):
            # Removed from the last group it shared with this node: stop dialing it.
            self.transport.forget(cc.node)
            self._save_addresses()
            log.info("forgot %s: no longer a member of any group hosted here", cc.node)

    # ============================================================ helpers ============
    def _group(self, group: str) -> Group:
        g = self.groups.get(group)
        if g is None:
            raise UnknownGroup(f"node {self.id} does not host group {group!r}")
        return g

    def _election_seconds(self) -> float:
        return self.cfg.election_tick * self.cfg.tick_seconds

    @staticmethod
    def _chain(inner: Future[Any], outer: Future[Any]) -> None:
        """Fail ``outer`` if the loop call that was to fill it raised."""
        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                _fail(outer, exc)

        inner.add_done_callback(done)

    def _status(self) -> dict[str, Any]:
        groups = {}
        for g in list(self.groups.values()):  # hooks may add or remove groups
            st = g.raft.status()
            members = {n: "voter" for n in st.conf.voters}
            members.update({n: "pre-follower" for n in st.conf.learners})
            groups[g.id] = {
                "role": st.role.name.lower(), "term": st.term, "leader": st.leader,
                "commit": st.commit, "applied": g.state.applied_index(),
                "checkpoint": g.state.checkpoint_index(), "last_index": st.last_index,
                "first_index": g.storage.log.first_index(),
                "members": members,
                # Incarnations as decimal strings: JSON clients lose 63-bit integers.
                "incarnation": str(g.storage.log.identity().incarnation),
                "incarnations": {n: str(i) for n, i in sorted(st.conf.incarnations)},
                "peers": {
                    n: {"match": p.match, "next": p.next, "state": p.state,
                        "learner": p.learner, "active": p.recent_active}
                    for n, p in st.peers.items() if n != self.id
                },
                # Members last heard answering as an incarnation the group replaced:
                # ignored for good until stopped and readmitted (found from outside:
                # status showed such a voter as an ordinary follower a little behind).
                "retired": {n: str(i) for n, i in sorted(g.raft.retired_heard.items())},
                "removed": (None if g.raft.removed is None else
                            {"by": g.raft.removed[0], "index": g.raft.removed[1]}),
                "leader_changes": g.leader_changes,
                "quiesced": g.raft.quiesced,
                "recovery": g.recovery.describe(),
            }
        return {
            "id": self.id, "raft_addr": self.cfg.raft_addr, "groups": groups,
            # The cluster it names in handshakes (hex; "" none, "3f" joining): status
            # tells another cluster's node from a member by it.
            "cluster": self.transport.cluster_id.hex(),
            "addresses": {pid: p.addr for pid, p in self.transport.peers.items() if p.addr},
            "connected": self.transport.connected_peers(),
            "transport": dict(self.transport.stats),
        }


class Proposal(Future[Any]):
    """A write's future; ``shape(index, result)``, if given, is what the caller gets."""

    def __init__(self, shape: Callable[[int, Any], Any] | None = None) -> None:
        super().__init__()
        self.shape = shape


class _Answer(Future[Any]):
    """A write a follower forwarded, on the leader: it resolves to ``(index, result)``
    even when the result is an exception, which ``_answer_forward`` then sends back."""


def _resolve(fut: Future[Any], index: int, result: Any) -> None:
    if fut.done():  # cancelled by its caller: nobody is waiting
        return
    shape = getattr(fut, "shape", None)
    if shape is None:
        fut.set_result((index, result))
        return
    try:
        value = shape(index, result)
    except Exception as e:  # noqa: BLE001 (any failure of the caller's shaping is its own)
        fut.set_exception(e)
        return
    fut.set_result(value)


_SENT_FIRST = frozenset({MessageType.APP, MessageType.COMMIT, MessageType.HEARTBEAT})


def _applies_first(rd: Ready) -> bool:
    """Whether ``rd``'s committed entries may be applied before it is persisted: all of
    them durable already (below its new entries), no snapshot image to install first,
    and no configuration change (whose application reconfigures the transport and the
    hooks, which stay after the sync as before)."""
    ents = rd.committed_entries
    if not ents or rd.snapshot is not None:
        return False
    if rd.entries and ents[-1].index >= rd.entries[0].index:
        return False
    return all(e.type != EntryType.CONF_CHANGE for e in ents)


def _timed_persist(unit: list[tuple[Group, Ready]]) -> float:
    t0 = monotonic()
    persist_together([(g.storage, rd) for g, rd in unit])
    return monotonic() - t0


def _fail(fut: Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def log_snapshot_failed(node: str, g: Group, doing: str,
                        e: SnapshotFailed | CheckpointDeferred) -> None:
    """A state machine could not snapshot its state: nothing was written, the checkpoint
    did not advance, and the log after it is kept. Loud, but not fatal to the loop."""
    log.error("node %s group %s: %s failed, so the log after index %d is kept: %s", node,
              g.id, doing, g.state.checkpoint_index(), e)


def conf_change(op: ConfChangeOp, node: str, addr: str | None = None) -> ConfChange:
    """A membership change carrying the member's raft address (learned by every node)."""
    return ConfChange(op, node, (addr or "").encode())
