"""An in-process cluster of real ``Node``s running ``MetaService`` + ``PlacementManager``
(Ignite 3's rebalance design), for tests: 127.0.0.1 TCP, LMDB data directories under ``root``.

The metastore's voters are ``meta`` (n1..n3 by default); any other node hosts a metastore
replica that joins as a non-voting learner (no auto-promotion), so it reads and watches
like the others. Shared by tests/test_rebalance.py, tests/test_inmemory_restart.py and
tests/test_placement_chaos.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raftkv.core import NotLeader, Role
from raftkv.node.driver import Node, NodeConfig
from raftkv.placement.assignments import (
    calc_assignments,
    decode_nodes,
    partition_keys,
    partition_of,
)
from raftkv.placement.catalog import TableDescriptor, partition_group, table_key
from raftkv.placement.rebalance import (
    PARTITION_CHECKPOINT_SECONDS,
    PlacementManager,
    join_metastore_as_learner,
)
from raftkv.placement.retry import RetryPolicy
from raftkv.placement.service import MetaService
from raftkv.storage.commands import encode_put as kv_put
from raftkv.testing.procs import free_ports

SECRET = b"rebalance-secret"
META = ["n1", "n2", "n3"]
ALL = ["n1", "n2", "n3", "n4"]
TICK = 0.02
DURABLE = True  # fsync every Ready, as in production


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``pred`` (every 50 ms) until it returns something truthy; exceptions count as
    "not yet" (a leader change, a stopped group). Fails with the last result."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001  # transient (leader change, stopped group)
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


class Cluster:
    """Nodes ``nodes`` (started on demand with ``start``), metastore voters ``meta``."""

    def __init__(self, root: Path, nodes: Sequence[str] = ALL,
                 meta: Sequence[str] = META,
                 checkpoint_seconds: float = PARTITION_CHECKPOINT_SECONDS) -> None:
        self.root = root
        self.checkpoint_seconds = checkpoint_seconds
        self.meta = list(meta)
        self.addrs = {n: f"127.0.0.1:{p}" for n, p in zip(nodes, free_ports(len(nodes)),
                                                          strict=True)}
        self.nodes: dict[str, Node] = {}
        self.metas: dict[str, MetaService] = {}
        self.mgrs: dict[str, PlacementManager] = {}
        self.admitted: set[str] = set()

    def start(self, nid: str) -> PlacementManager:
        # Founders know each other; a newcomer knows the founders (and itself).
        peers = {n: self.addrs[n] for n in self.meta}
        peers[nid] = self.addrs[nid]
        data = str(self.root / nid)
        node = Node(NodeConfig(nid, self.addrs[nid], SECRET, peers=peers, data_dir=data,
                               tick_seconds=TICK, request_timeout=2.0))
        meta = MetaService(node, data, self.meta if nid in self.meta else None,
                           durable=DURABLE)
        node.start()
        self.nodes[nid], self.metas[nid] = node, meta
        if nid not in self.meta and nid not in self.admitted:
            self._admit(nid)
        mgr = PlacementManager(meta, data, durable=DURABLE,
                               retry=RetryPolicy(base=0.02, cap=0.5, max_attempts=20),
                               watch_timeout=2.0, checkpoint_seconds=self.checkpoint_seconds)
        mgr.start()
        self.mgrs[nid] = mgr
        return mgr

    def _admit(self, nid: str) -> None:
        """Add ``nid`` to the metastore as a learner that is never promoted."""
        def admit() -> bool:
            join_metastore_as_learner(self.metas[self.meta_leader()], nid,
                                      self.addrs[nid]).result(5)
            return True

        wait_for(admit, 10, f"{nid} to join the metastore")
        self.admitted.add(nid)

    def kill(self, nid: str) -> None:
        self.mgrs.pop(nid).stop()
        self.metas.pop(nid)
        self.nodes.pop(nid).stop()

    def stop(self) -> None:
        for nid in list(self.nodes):
            self.kill(nid)

    @property
    def live(self) -> list[str]:
        return sorted(self.nodes)

    def meta_leader(self) -> str:
        for nid, m in list(self.metas.items()):
            if m.node.groups["meta"].raft.role == Role.LEADER:
                return nid
        raise NotLeader("test", None)

    def descriptor(self, table: str) -> TableDescriptor | None:
        got = self.metas[self.live[0]].get(table_key(table)).result(5)
        return None if got is None else TableDescriptor.decode(got.value)

    def partitions(self, table: str) -> int:
        desc = self.descriptor(table)
        if desc is None:
            raise KeyError(table)
        return desc.partitions

    def info(self, nid: str, gid: str) -> dict[str, Any] | None:
        node = self.nodes[nid]

        def look() -> dict[str, Any] | None:
            g = node.groups.get(gid)
            if g is None:
                return None
            conf = g.raft.conf
            return {"role": g.raft.role, "term": g.raft.term, "voters": sorted(conf.voters),
                    "learners": sorted(conf.learners), "applied": g.state.applied_index(),
                    "checkpoint": g.state.checkpoint_index(), "digest": g.state.digest()}

        result: dict[str, Any] | None = node.call(look).result(5)
        return result

    def leader(self, gid: str) -> str:
        def find() -> str | None:
            for nid in self.live:
                i = self.info(nid, gid)
                if i is not None and i["role"] == Role.LEADER:
                    return nid
            return None

        found: str = wait_for(find, 10, f"a leader of {gid}")
        return found

    def transfer(self, gid: str, to: str) -> None:
        def moved() -> bool:
            lead = self.leader(gid)
            if lead != to:
                self.nodes[lead].transfer_leadership(gid, to).result(5)
            return True

        wait_for(moved, 10, f"{to} to lead {gid}")

    def assignments(self, table: str, p: int) -> tuple[list[str], list[str], list[str]]:
        m = self.metas[self.live[0]]
        st, pe, pl = m.get_many(list(partition_keys(table, p))[:3]).result(5)
        return (decode_nodes(st.value if st else None), decode_nodes(pe.value if pe else None),
                decode_nodes(pl.value if pl else None))

    def group_of(self, table: str, key: bytes) -> str:
        return partition_group(table, partition_of(key, self.partitions(table)))

    def put(self, table: str, key: bytes, value: bytes) -> None:
        def write() -> bool:
            gid = self.group_of(table, key)  # a metastore read: retried here too
            self.nodes[self.leader(gid)].propose(gid, kv_put(key, value)).result(5)
            return True

        wait_for(write, 10, f"a write of {key!r} to {table}")

    def get(self, table: str, key: bytes) -> bytes | None:
        got: list[bytes | None] = []

        def read() -> bool:
            gid = self.group_of(table, key)
            got.append(self.nodes[self.leader(gid)].read(gid, lambda s: s.get(key)).result(5))
            return True

        wait_for(read, 10, f"a read of {key!r} from {table}")
        return got[-1]

    def converged(self, table: str, nodes: list[str], replicas: int) -> bool | str:
        """Every partition: stable == calc, nothing pending or planned, the leader's voters
        are stable with no learners, exactly the live stable nodes host it, and their
        replicas hold the same data. Returns a reason string while not there yet."""
        for p in range(self.partitions(table)):
            gid = partition_group(table, p)
            want = calc_assignments(table, p, nodes, replicas)
            st, pe, pl = self.assignments(table, p)
            if (st, pe, pl) != (want, [], []):
                return f"{gid}: metastore {(st, pe, pl)} != {want}"
            infos = {n: self.info(n, gid) for n in self.live}
            hosts = {n for n, i in infos.items() if i is not None}
            if hosts != set(want) & set(self.live):
                return f"{gid}: hosted on {sorted(hosts)}, want {want}"
            leaders = [i for i in infos.values() if i is not None and i["role"] == Role.LEADER]
            if len(leaders) != 1:
                return f"{gid}: {len(leaders)} leaders"
            if leaders[0]["voters"] != want or leaders[0]["learners"]:
                return f"{gid}: voters {leaders[0]['voters']} learners {leaders[0]['learners']}"
            figures = {(i["applied"], i["digest"]) for i in infos.values() if i is not None}
            if len(figures) != 1:
                return f"{gid}: replicas differ {figures}"
        return True

    def wait_converged(self, table: str, nodes: list[str], replicas: int,
                       timeout: float = 20.0) -> None:
        """Wait until ``converged``; on a timeout, the failure names the last reason."""
        reason: list[object] = [None]

        def check() -> bool:
            reason[0] = self.converged(table, nodes, replicas)
            return reason[0] is True

        try:
            wait_for(check, timeout, f"convergence to {nodes} x{replicas}")
        except AssertionError as e:
            raise AssertionError(f"{e}; last reason: {reason[0]!r}") from None


class VoterLog:
    """Polls the voters of ``gid``'s leader (10 ms) and records each distinct set, in
    order. Reads the cores' attributes from this thread (racy, but enough to see a
    configuration that lasts longer than the polling period)."""

    def __init__(self, c: Cluster, gid: str) -> None:
        self.c = c
        self.gid = gid
        self.seen: list[list[str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.01)

    def _sample(self) -> None:
        for node in list(self.c.nodes.values()):
            g = node.groups.get(self.gid)
            if g is not None and g.raft.role == Role.LEADER:
                voters = sorted(g.raft.conf.voters)
                if not self.seen or self.seen[-1] != voters:
                    self.seen.append(voters)

    def stop(self) -> list[list[str]]:
        """The sets seen, ending with the one in force now: a last look on the caller's
        thread, which has just seen the state it waited for (the poller may not have
        looked since; test_inmemory_restart once ended on the configuration before)."""
        self._stop.set()
        self._t.join()
        self._sample()
        return self.seen
