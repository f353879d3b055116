"""A synchronous in-process cluster for scenario tests (raft-rs' ``Network`` idea).

Messages are delivered in rounds until the cluster is quiet (``stabilize``); nothing is
timed. Tests cut links, isolate nodes, drop or capture messages with a filter, tick
chosen nodes, and read the cores' state directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

from raftkv.core import Message, Role, bootstrap
from raftkv.storage.log_store import MemoryLogStore
from raftkv.testing.node import Applied, SimNode

MessageFilter = Callable[[Message], bool]  # return False to drop


class Cluster:
    def __init__(
        self, voters: Iterable[str], seed: int = 0, **config: Any
    ) -> None:
        self.seed = seed
        self.config = {"election_tick": 10, **config}
        self.nodes: dict[str, SimNode] = {}
        self.blocked: set[tuple[str, str]] = set()
        self.filters: list[MessageFilter] = []
        self.applied: dict[str, list[Applied]] = {}
        self.read_states: dict[str, list] = {}
        self.delivered: list[Message] = []
        ids = list(voters)
        self.founders = ids
        self._incs = random.Random(f"incarnations/{seed}")
        for nid in ids:
            store = self._new_store()
            bootstrap(store, ids)
            self._add(nid, store)

    def _new_store(self) -> MemoryLogStore:
        """A store with a seeded incarnation (used only by nodes with identities)."""
        return MemoryLogStore(self._incs.getrandbits(63) or 1)

    def _add(self, nid: str, store: MemoryLogStore) -> SimNode:
        node = SimNode(nid, store, self.seed, **self.config)
        self.nodes[nid] = node
        self.applied.setdefault(nid, [])
        self.read_states.setdefault(nid, [])
        return node

    def add_empty_node(self, nid: str) -> SimNode:
        """A joining node: empty storage, knows no configuration, waits to be contacted."""
        return self._add(nid, self._new_store())

    def wipe(self, nid: str) -> None:
        """``nid`` loses its files and starts again with its old arguments: a founder
        bootstraps the founding configuration afresh, a joined node starts empty."""
        store = self._new_store()
        if nid in self.founders:
            bootstrap(store, self.founders)
        self.nodes[nid].wipe(store)

    def raft(self, nid: str):
        return self.nodes[nid].raft

    # -- faults ------------------------------------------------------------------------
    def cut(self, a: str, b: str) -> None:
        self.blocked |= {(a, b), (b, a)}

    def isolate(self, nid: str) -> None:
        for other in self.nodes:
            if other != nid:
                self.cut(nid, other)

    def heal(self) -> None:
        self.blocked.clear()
        self.filters.clear()

    # -- driving -----------------------------------------------------------------------
    def _collect(self) -> list[Message]:
        out: list[Message] = []
        for nid, node in self.nodes.items():
            res = node.handle_ready()
            out.extend(res.messages)
            self.applied[nid].extend(res.applied)
            self.read_states[nid].extend(res.read_states)
        return out

    def deliver(self, msgs: list[Message]) -> None:
        for m in msgs:
            node = self.nodes.get(m.to)
            if node is None or not node.alive or (m.frm, m.to) in self.blocked:
                continue
            if not all(f(m) for f in self.filters):
                continue
            self.delivered.append(m)
            node.raft.step(m)

    def stabilize(self, max_rounds: int = 1000) -> None:
        for _ in range(max_rounds):
            msgs = self._collect()
            if not msgs:
                return
            self.deliver(msgs)
        raise AssertionError("cluster did not stabilize")

    def tick(self, nodes: Iterable[str] | None = None, n: int = 1) -> None:
        """Tick the given (default: all live) nodes ``n`` times, stabilizing after each."""
        targets = list(nodes) if nodes is not None else list(self.nodes)
        for _ in range(n):
            for nid in targets:
                if self.nodes[nid].alive:
                    self.nodes[nid].raft.tick()
            self.stabilize()

    def elect(self, nid: str) -> None:
        self.nodes[nid].raft.campaign()
        self.stabilize()
        if self.raft(nid).role != Role.LEADER and self.nodes[nid].identities:
            self.introduce(nid)
            self.nodes[nid].raft.campaign()
            self.stabilize()
        assert self.raft(nid).role == Role.LEADER, f"{nid} failed to become leader"

    def introduce(self, nid: str) -> None:
        """A newborn voter grants a vote only once enough others have shown it, in their
        vote requests, that they hold no record of it ("Incarnations" in raftkv.core.raft).
        A real cluster's election timers do that; here every node but ``nid`` campaigns
        with every answer to it dropped, so that none of them can win."""
        for other in sorted(self.nodes):
            if other != nid and self.nodes[other].alive:
                deaf = {(m, other) for m in self.nodes}
                added = deaf - self.blocked
                self.blocked |= added
                self.nodes[other].raft.campaign()
                self.stabilize()
                self.blocked -= added

    def leader(self) -> str | None:
        leaders = [
            (n.raft.term, nid) for nid, n in self.nodes.items()
            if n.alive and n.raft.role == Role.LEADER
        ]
        return max(leaders)[1] if leaders else None

    def propose(self, nid: str, data: bytes) -> int:
        index = self.raft(nid).propose(data)
        self.stabilize()
        return index

    def logs(self, nid: str) -> list[tuple[int, int]]:
        """(index, term) of every entry in ``nid``'s log, including unstable ones."""
        log = self.raft(nid).log
        return [(e.index, e.term) for e in log.entries(log.first_index(), log.last_index() + 1)]
