"""What every embedded node offers, whatever it replicates: setup, membership, status.

``EmbeddedNode`` starts a ``raftkv.node.driver.Node`` hosting one group, and wraps its
futures in synchronous calls bounded by ``request_timeout``. Its raft port also serves
``raftkv admin`` (``raftkv.admin``), PySyncObj's ``syncobj_admin`` for embedded nodes. ``RaftKV`` (``raftkv.kv``)
adds the key-value operations; ``ReplicatedNode`` hosts a user's ``ReplicatedObject``,
the way a PySyncObj ``SyncObj`` does.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Self

from pysyncobj.monotonic import monotonic

from raftkv.admin import NodeAdmin
from raftkv.core import ConfChangeOp, ConfChangeRejected, LeaderStepping, RaftError, Role
from raftkv.node.driver import (
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_TICK,
    AdminHandler,
    Metrics,
    Node,
    NodeConfig,
    conf_change,
)
from raftkv.node.errors import NodeStopped, RequestTimeout
from raftkv.node.stores import claim_data_dir, founding_cluster_id, open_group_storage
from raftkv.node.user_state import UserStateStore
from raftkv.recovery.compaction import CompactionPolicy
from raftkv.statemachine import ReplicatedObject
from raftkv.storage.dir_lock import release_data_dir
from raftkv.storage.layout import DEFAULT_GROUP, group_paths
from raftkv.storage.state_store import StateStore
from raftkv.tls import TlsConfig
from raftkv.transport.handshake import JOINING
from raftkv.transport.tcp import check_peer_addresses, listen_on, parse_addr

log = logging.getLogger(__name__)

# What ``--peers id=host:port,...`` can name.
_NODE_ID = re.compile(r"[^\s,=]{1,128}")


def _encodable(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (a lone surrogate from JSON has none)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def secret_bytes(secret: object) -> bytes:
    """The cluster secret as bytes (``str`` is UTF-8), or ``TypeError``: any other type
    was taken, and the node's loop then died at its first handshake (found from
    outside, with an int)."""
    if isinstance(secret, str):
        return secret.encode()
    if isinstance(secret, (bytes, bytearray, memoryview)):
        return bytes(secret)
    raise TypeError(f"the cluster secret is bytes or str, not {type(secret).__name__}")


class EmbeddedNode:
    def __init__(
        self,
        node_id: str,
        raft_addr: str,
        peers: dict[str, str],
        secret: bytes | str,
        *,
        data_dir: str | None = None,
        durable: bool = True,
        join: bool = False,
        tick_seconds: float = DEFAULT_TICK,
        election_tick: int = 10,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        metrics: Metrics | None = None,
        faults: bool = False,
        group: str = DEFAULT_GROUP,
        compaction: CompactionPolicy | None = None,
        state: StateStore | None = None,
        peer_tls: TlsConfig | None = None,
        admin: Callable[[EmbeddedNode], AdminHandler] = NodeAdmin,
        cluster_token: str = "",
        claimed: bool = False,
    ) -> None:
        """``data_dir=None`` keeps everything in memory (storage "memory"); otherwise the
        group lives in LMDB files there. ``durable=False`` skips the log's fsync (faster;
        a machine crash may then lose acknowledged writes on this replica). ``join``
        starts with an empty log and waits to be added with ``add_learner``; otherwise
        the voters in ``peers`` bootstrap the group on first start. ``state`` replaces
        the KV state store (a custom state machine, see ``ReplicatedNode``). ``peer_tls``
        runs the peer port under TLS (``raftkv.tls.TlsConfig``: this node's certificate,
        its key, the CA that signs every peer's, and whether to require one from peers
        that dial in); without it frames are authenticated but not encrypted
        (docs/security.md). ``admin(self)`` answers ``raftkv admin`` on the raft port
        (default: ``raftkv.admin.NodeAdmin``). ``cluster_token``: a founder derives the
        cluster's id from it (``raftkv.node.stores``, "Cluster ids"; none without one).
        ``claimed``: the caller already holds ``data_dir`` (``claim_data_dir``: one that
        reads the directory before the node is built) and hands it to this node, which
        lets it go on close; a directory is otherwise refused while any node holds it."""
        secret = secret_bytes(secret)
        if node_id not in peers and not join:
            raise ValueError(f"{node_id} is not in peers; pass join=True to join a cluster")
        check_peer_addresses(peers)
        self.node_id = node_id
        self.group = group
        self.timeout = request_timeout
        self.data_dir = data_dir
        # The node binds its raft address as it is built: one in use fails here, before
        # the data directory is claimed or anything written (found from outside).
        # A founder's cluster id comes from its token (none without one); a joiner adopts
        # the cluster's (raftkv.node.stores, "Cluster ids").
        cluster_id = JOINING if join else founding_cluster_id(cluster_token)
        self.node = Node(NodeConfig(
            node_id=node_id, raft_addr=raft_addr,
            secret=secret,
            peers=dict(peers), tick_seconds=tick_seconds, election_tick=election_tick,
            request_timeout=request_timeout, data_dir=data_dir, faults=faults,
            peer_tls=peer_tls, cluster_id=cluster_id,
        ), metrics)
        if data_dir is not None and not claimed:
            try:
                claim_data_dir(data_dir, node_id, cluster_id)
            except BaseException:
                self.node.transport.close()
                raise
        self.node.admin_handler = admin(self)
        storage = None
        try:
            storage = open_group_storage(data_dir, group, durable, compaction, state)
            self.node.add_group(group, storage, None if join else sorted(peers))
            self.node.start()
        except BaseException:
            self.node.stop()  # closes the hosted stores, so a retry can reopen them
            if storage is not None and group not in self.node.groups:
                storage.state.close()
                close = getattr(storage.log, "close", None)
                if close is not None:
                    close()
            self._release_data_dir()
            raise

    def _release_data_dir(self) -> None:
        """Let another process have the data directory (``claim_data_dir``), unless the
        loop is still running with its stores open: ``Node.stop`` gives up on a loop
        that does not stop within its timeout, and leaves them so."""
        if self.data_dir is None:
            return
        node = getattr(self, "node", None)
        loop = node._thread if node is not None else None
        if loop is not None and loop.is_alive():
            log.error("node %s: its loop is still running; %s stays locked", self.node_id,
                      self.data_dir)
            return
        release_data_dir(self.data_dir)

    # -- membership and leadership --------------------------------------------------------
    def add_learner(self, node_id: str, raft_addr: str) -> int:
        """Add a PRE_FOLLOWER; the leader promotes it once it has caught up. ``ValueError``
        before anything is proposed for an id ``--peers`` could not name (empty,
        whitespace, ``,`` or ``=``), an address another member has (two ids at one
        address answer as one node, and the new one never catches up), or a member given
        another address than its own."""
        if (not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id)
                or not node_id.isprintable() or not _encodable(node_id)):
            raise ValueError(f"a node id is 1-128 printable characters without spaces, "
                             f"',' or '=', got {node_id!r}")
        parse_addr(raft_addr)
        members = self._member_addresses()
        owner = next((n for n, a in sorted(members.items()) if a == raft_addr), None)
        if owner is not None and owner != node_id:
            raise ValueError(f"raft address {raft_addr} is {owner}'s")
        # A member's address is its own (found outside-in: add-learner of a member with
        # another port was accepted and rewrote the address every node dials it at).
        if members.get(node_id) not in (None, raft_addr):
            raise ValueError(f"{node_id} is already a member at {members[node_id]}; "
                             f"remove it first to move it to {raft_addr}")
        cc = conf_change(ConfChangeOp.ADD_LEARNER, node_id, raft_addr)
        return self._wait(self.node.change_membership(self.group, cc))[0]

    def _member_addresses(self) -> dict[str, str | None]:
        """Each member of the group (voter or learner) and its raft address as this
        node's transport knows it (None: not known here)."""
        def look() -> dict[str, str | None]:
            conf = self.node.groups[self.group].raft.conf
            out: dict[str, str | None] = {}
            for n in conf.voters | conf.learners:
                if n == self.node_id:
                    out[n] = self.node.cfg.raft_addr
                else:
                    peer = self.node.transport.peers.get(n)
                    out[n] = peer.addr if peer is not None else None
            return out

        found: dict[str, str | None] = self.node.call(look).result(self.timeout)
        return found

    def promote(self, node_id: str) -> int:
        cc = conf_change(ConfChangeOp.PROMOTE, node_id)
        return self._wait(self.node.change_membership(self.group, cc))[0]

    def remove(self, node_id: str) -> str | None:
        """Remove a member. Removing the leader itself hands leadership to the most
        up-to-date voter, which then performs the removal (the removed node never hears
        of it: the new configuration stops replicating to it). That case returns the
        new leader's id once it has taken over; otherwise None once applied here.

        Refused (``ConfChangeRejected``) when the voters left would not have a reachable
        quorum, as etcd's strict reconfiguration check refuses it: removing a live voter
        of three while another is down was accepted and stopped the group until the
        down one came back (found from outside). Removing the down one is allowed."""
        self.node.call(lambda: self._check_removal(node_id)).result(self.timeout)
        cc = conf_change(ConfChangeOp.REMOVE, node_id)
        try:
            self._wait(self.node.change_membership(self.group, cc))
        except LeaderStepping as stepping:
            deadline = monotonic() + self.timeout
            while self.leader() in (self.node_id, None):
                if monotonic() > deadline:
                    raise RequestTimeout(
                        f"{stepping.transferee} did not take over from {node_id}"
                    ) from None
                self._sleep()
            return self.leader()
        return None

    def _check_removal(self, node_id: str) -> None:
        """On the leader (loop thread): would the voters left after removing
        ``node_id`` have a quorum among the peers this node reaches? A follower leaves
        it to the leader, which it names when it refuses the change."""
        raft = self.node.groups[self.group].raft
        if raft.role != Role.LEADER or node_id not in raft.conf.voters:
            return
        rest = sorted(raft.conf.voters - {node_id})
        # Connected and heard from within an election timeout now, not only as of the
        # last liveness check: a removal sent right after a voter was SIGKILLed was let
        # through by that check's tick-old view (found from outside).
        within = self.node.lease_seconds()
        down = [v for v in rest
                if not (self.node.reachable(v) and self.node.heard_from(v, within))]
        need = len(rest) // 2 + 1
        if rest and len(rest) - len(down) < need:
            raise ConfChangeRejected(
                f"removing {node_id} would leave {len(rest) - len(down)} of the "
                f"{len(rest)} remaining voters reachable, and a quorum needs {need}: the "
                f"group could commit nothing until {', '.join(down)} came back. Bring it "
                "back first, or remove a voter that is down")

    def transfer_leadership(self, to: str) -> None:
        self._wait(self.node.transfer_leadership(self.group, to))

    def members(self) -> dict[str, str]:
        return dict(self.status()["groups"][self.group]["members"])

    def status(self) -> dict[str, Any]:
        return self._wait(self.node.status())

    def leader(self) -> str | None:
        return self.status()["groups"][self.group]["leader"]

    def wait_for_leader(self, timeout: float = 10.0) -> str:
        deadline = monotonic() + timeout
        while True:
            lead = self.leader()
            if lead is not None:
                return lead
            if monotonic() > deadline:
                raise RequestTimeout(f"no leader elected within {timeout}s")
            self._sleep()

    def close(self, handover: bool = True) -> None:
        """Stop the node. A leader first hands leadership to its most up-to-date voter
        (``handover``), as etcd does on a graceful stop, so the group does not sit out an
        election timeout; a crash (SIGKILL) cannot, and the election covers it."""
        if handover and self.node.failure is None:
            try:
                self._hand_over()
            except (RaftError, TimeoutError):
                pass  # best effort: stopping matters more
        self.node.stop()
        self._release_data_dir()

    def most_up_to_date_voter(self) -> str | None:
        """On the leader, the active voter (itself aside) with the highest match index:
        the one a leadership transfer reaches soonest. None elsewhere, or if none."""
        g = self.status()["groups"][self.group]
        if g["role"] != "leader":
            return None
        voters = [(p["match"], n) for n, p in g["peers"].items()
                  if g["members"].get(n) == "voter" and p["active"]]
        return max(voters)[1] if voters else None

    def _hand_over(self) -> None:
        to = self.most_up_to_date_voter()
        if to is not None:
            self.node.transfer_leadership(self.group, to).result(
                timeout=2 * self.node.cfg.election_tick * self.node.cfg.tick_seconds
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------
    def _wait(self, fut: Future[Any]) -> Any:
        try:
            return fut.result(timeout=self.timeout)
        except TimeoutError:
            raise RequestTimeout(f"no outcome within {self.timeout}s") from None

    def _sleep(self) -> None:
        time.sleep(0.02)



def _settle(out: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve ``out`` unless its caller cancelled it already."""
    try:
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(result)
    except InvalidStateError:
        pass


class ReplicatedNode(EmbeddedNode):
    """Hosts one ``ReplicatedObject``: its ``@replicated`` methods propose through this
    node, and the group's committed log is applied to it (``UserStateStore``). With a
    ``data_dir`` its checkpoints go to a file there, so a restart replays only the log
    after the last one.

        counter = Counter()
        node = ReplicatedNode(counter, "n1", "127.0.0.1:7001", peers, secret, data_dir=d)
        counter.incr(2)   # replicated; returns the value computed at apply
    """

    def __init__(self, obj: ReplicatedObject, node_id: str, raft_addr: str,
                 peers: dict[str, str], secret: bytes | str, **kwargs: Any) -> None:
        secret = secret_bytes(secret)  # before the state store reads its files
        data_dir = kwargs.get("data_dir")
        path = group_paths(data_dir, kwargs.get("group", DEFAULT_GROUP))[1] if data_dir else None
        if data_dir is not None:
            # Its settings first, as the base class checks them (NodeConfig) before it
            # writes anything: refused, they leave nothing written (found in review).
            NodeConfig(node_id, raft_addr, secret, peers=dict(peers),
                       tick_seconds=kwargs.get("tick_seconds", DEFAULT_TICK),
                       request_timeout=kwargs.get("request_timeout", DEFAULT_REQUEST_TIMEOUT))
            # Its raft address next, as the base class binds it before it claims the
            # directory: one in use must leave nothing written (review finding). The
            # probe's socket is closed at once; the base class binds for good.
            listen_on(raft_addr).close()
            # Before the state store reads (and tidies) its checkpoint files: a second
            # process on a running node's directory must not touch them. The base class
            # is handed the claim.
            claim_data_dir(data_dir, node_id, JOINING if kwargs.get("join") else
                           founding_cluster_id(kwargs.get("cluster_token", "")))
        try:
            store = UserStateStore(obj, path, volatile=path is None)
            super().__init__(node_id, raft_addr, peers, secret, state=store,
                             claimed=data_dir is not None, **kwargs)
        except BaseException:
            if data_dir is not None:
                release_data_dir(data_dir)  # again if the base class did: a no-op
            raise
        self.obj = obj
        self.store = store
        g = self.node.groups[self.group]
        self.node.call(lambda: g.on_tick.append(lambda _: store.expire(monotonic()))).result(
            self.timeout)
        obj._attach(self._propose)

    def _propose(self, data: bytes) -> Future[Any]:
        """The call's result, once this replica has applied its entry too: a call made on
        a follower is answered by the leader, with the leader's result, before the
        follower's own replica may have applied it, and the caller then read a state
        without its own write (found from outside; PySyncObj answers a call on the node
        that made it only once that node has applied it). A replica that has not applied
        it within ``request_timeout`` (cut off after the leader answered) gives the
        leader's result anyway: the call was applied, and must not wait for the link."""
        out: Future[Any] = Future()

        def answered(f: Future[Any]) -> None:
            if f.cancelled():
                out.cancel()
                return
            if (exc := f.exception()) is not None:
                _settle(out, exc=exc)
                return
            index, result = f.result()
            if self.store.applied >= index:  # the leader's own call: applied here already
                _settle(out, result)
                return

            def applied(ok: bool | None) -> None:
                if ok is not False:  # applied here, or not in time: the leader's result
                    _settle(out, result)
                else:
                    _settle(out, exc=NodeStopped(
                        f"node {self.node.id} stopped before applying the call made on it"))

            deadline = monotonic() + self.timeout
            registered = self.node.call(
                lambda: self.store.when_applied(index, applied, deadline))
            registered.add_done_callback(lambda r: applied(False) if r.exception() else None)

        self.node.propose(self.group, data).add_done_callback(answered)
        return out

    def close(self, handover: bool = True) -> None:
        self.obj._detach()
        super().close(handover)
