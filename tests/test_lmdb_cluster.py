"""The core over real LMDB stores: a 3-node in-process group whose followers crash,
restart with local recovery, and catch up through the log or, once the leader has
compacted, through a state-store snapshot (IGNITE-16907's log truncation)."""

from __future__ import annotations

import random
from pathlib import Path

from raftkv.recovery.compaction import CompactionPolicy
from raftkv.storage.commands import encode_put
from raftkv.storage.lmdb_log import LmdbLogStore
from raftkv.storage.lmdb_state import LmdbStateStore

from raftkv.core import Config, Message, Raft, Role, bootstrap
from raftkv.node.group_storage import GroupStorage

IDS = ["n1", "n2", "n3"]


class LmdbGroup:
    def __init__(self, root: Path, policy: CompactionPolicy) -> None:
        self.root = root
        self.policy = policy
        self.nodes: dict[str, tuple[Raft, GroupStorage]] = {}
        self.down: set[str] = set()
        self.cut: set[str] = set()
        for nid in IDS:
            self.open(nid, fresh=True)

    def open(self, nid: str, fresh: bool = False) -> GroupStorage:
        state = LmdbStateStore(str(self.root / nid / "state"))
        raft_log = LmdbLogStore(
            str(self.root / nid / "log"), verify_from=state.checkpoint_index() + 1
        )
        if fresh:
            bootstrap(raft_log, IDS)
        gs = GroupStorage(raft_log, state, self.policy)
        self.report = gs.recover()
        config = Config(id=nid, applied=state.applied_index(), vote_floor=gs.vote_floor)
        raft = Raft(config, raft_log, random.Random(nid))
        self.nodes[nid] = (raft, gs)
        self.down.discard(nid)
        return gs

    def crash(self, nid: str) -> None:
        _, gs = self.nodes[nid]
        gs.log.close()  # type: ignore[attr-defined]
        gs.state.close()
        self.down.add(nid)

    def stabilize(self) -> None:
        for _ in range(10_000):
            msgs: list[Message] = []
            for nid, (raft, gs) in self.nodes.items():
                if nid in self.down or not raft.has_ready():
                    continue
                rd = raft.ready()
                gs.persist(rd)
                msgs += [gs.outgoing(m) for m in rd.messages]
                gs.apply(rd.committed_entries)
                raft.advance(rd)
                gs.maybe_compact(raft.conf_at)
            if not msgs:
                return
            for m in msgs:
                if m.to in self.down or m.to in self.cut or m.frm in self.cut:
                    continue
                raft, gs = self.nodes[m.to]
                if gs.accept(m):
                    raft.step(m)
        raise AssertionError("did not stabilize")

    def tick(self, n: int) -> None:
        for _ in range(n):
            for nid, (raft, _) in self.nodes.items():
                if nid not in self.down:
                    raft.tick()
            self.stabilize()

    def write(self, leader: str, lo: int, hi: int) -> None:
        raft = self.nodes[leader][0]
        for start in range(lo, hi, 100):
            raft.propose_batch(
                [encode_put(b"k%05d" % (i % 1500), b"v%d" % i) for i in range(start, min(start + 100, hi))]
            )
            self.stabilize()

    def digests(self) -> dict[str, object]:
        return {nid: gs.state.digest() for nid, (_, gs) in self.nodes.items()}


def test_followers_recover_locally_and_catch_up_through_a_snapshot(tmp_path: Path) -> None:
    g = LmdbGroup(tmp_path, CompactionPolicy(max_entries=800, keep=20))
    g.nodes["n1"][0].campaign()
    g.stabilize()
    assert g.nodes["n1"][0].role == Role.LEADER
    g.write("n1", 0, 500)
    assert len(set(g.digests().values())) == 1

    # n3 falls far behind while the leader compacts its log past n3's position.
    g.cut.add("n3")
    g.write("n1", 500, 3000)
    leader_log = g.nodes["n1"][1].log
    assert leader_log.first_index() > g.nodes["n3"][1].state.applied_index() + 1
    g.cut.clear()
    g.tick(3)
    n3_state = g.nodes["n3"][1].state
    assert n3_state.applied_index() >= g.nodes["n1"][0].log.committed
    assert len(set(g.digests().values())) == 1

    # n2 crashes and restarts: local recovery from its checkpoint, then catch-up.
    g.crash("n2")
    g.write("n1", 3000, 3500)
    gs2 = g.open("n2")
    assert g.report.to_index == gs2.state.applied_index()
    g.tick(3)
    g.write("n1", 3500, 3600)
    commits = {nid: raft.log.committed for nid, (raft, _) in g.nodes.items()}
    assert len(set(commits.values())) == 1
    assert len(set(g.digests().values())) == 1
    assert g.digests()["n1"].count == 1500
