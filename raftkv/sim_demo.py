"""``python -m raftkv.sim_demo``: a 5-node simulated cluster, narrated (``make sim-demo``).

It runs the pure core over the in-process harness (no sockets: ``make demo`` runs
real ``raftkv serve`` processes) through four acts:

1. an election from cold start;
2. a learner (PRE_FOLLOWER) joining, catching up and being promoted automatically;
3. removing the leader, which first hands leadership to the most up-to-date voter;
4. a partition that cuts the leader off, a new election on the majority side, and the
   heal, after which the old leader steps down and catches up.

Every change of role, term, leader, commit index or configuration is printed as a
timeline line stamped with the simulated tick (one tick = 10 ms).
"""

from __future__ import annotations

import sys
from typing import TextIO

from raftkv.core import ConfChange, ConfChangeOp, LeaderStepping, Role
from raftkv.testing.cluster import Cluster
from raftkv.testing.node import encode_command

TICK_MS = 10


class Narrator:
    def __init__(self, cluster: Cluster, out: TextIO) -> None:
        self.c = cluster
        self.out = out
        self.ticks = 0
        self.seen: dict[str, tuple] = {}

    def say(self, text: str) -> None:
        print(f"\n== {text}", file=self.out)

    def observe(self) -> None:
        """Print what changed on each node since the last look."""
        for nid, node in sorted(self.c.nodes.items()):
            r = node.raft
            state = (r.role, r.term, r.lead, r.conf) if node.alive else ("down",)
            before = self.seen.get(nid)
            self.seen[nid] = state
            if state == before:
                continue
            if not node.alive:
                line = "down"
            else:
                line = (f"{r.role.name:<13} term={r.term:<3} leader={r.lead or '-':<3} "
                        f"commit={r.log.committed:<4} {r.conf.describe()}")
            print(f"  t={self.ticks * TICK_MS:>5}ms  {nid}: {line}", file=self.out)

    def tick(self, n: int = 1, nodes: list[str] | None = None) -> None:
        for _ in range(n):
            self.c.tick(nodes)
            self.ticks += 1
            self.observe()

    def until(self, pred, limit: int = 500) -> None:
        for _ in range(limit):
            if pred():
                return
            self.tick()
        raise RuntimeError("the demo cluster did not converge")

    def leader(self) -> str:
        lead = self.c.leader()
        assert lead is not None
        return lead

    def write(self, count: int, start: int = 0) -> None:
        lead = self.leader()
        for i in range(start, start + count):
            self.c.raft(lead).propose(encode_command(0, i, "put", f"key{i % 10}", i))
        self.c.stabilize()
        print(f"  {count} writes through {lead}: commit index now "
              f"{self.c.raft(lead).log.committed}", file=self.out)

    def table(self) -> None:
        print(f"\n  {'node':<5} {'role':<13} {'term':>4} {'commit':>6} {'applied':>7}  member",
              file=self.out)
        lead = self.leader()
        conf = self.c.raft(lead).conf
        for nid, node in sorted(self.c.nodes.items()):
            r = node.raft
            kind = ("voter" if nid in conf.voters else
                    "pre-follower" if nid in conf.learners else "removed")
            print(f"  {nid:<5} {r.role.name:<13} {r.term:>4} {r.log.committed:>6} "
                  f"{node.last_applied:>7}  {kind}", file=self.out)


def run(out: TextIO = sys.stdout, seed: int = 7) -> Cluster:
    voters = [f"n{i}" for i in range(1, 6)]
    c = Cluster(voters, seed=seed)
    n = Narrator(c, out)
    print("raftkv demo: 5 simulated nodes over the pure Raft core (1 tick = 10 ms)", file=out)
    n.observe()

    n.say("1. Election: randomized timeouts, pre-vote, then a real vote")
    n.until(lambda: c.leader() is not None)
    n.tick(3)
    n.write(50)

    n.say("2. n6 joins as a PRE_FOLLOWER (learner) and is promoted once caught up")
    c.add_empty_node("n6")
    lead = n.leader()
    c.raft(lead).propose_conf_change(ConfChange(ConfChangeOp.ADD_LEARNER, "n6"))
    # The leader uses the new configuration as soon as it is appended (Kudu design).
    print(f"  {lead} appended the change; its config is now {c.raft(lead).conf.describe()}"
          " (* = promoted automatically once caught up)", file=out)
    n.tick()
    n.until(lambda: "n6" in c.raft(n.leader()).conf.voters)
    n.tick(2)
    print(f"  n6 applied {c.nodes['n6'].last_applied} entries and now votes", file=out)

    n.say("3. Remove the leader: it transfers leadership first (TimeoutNow)")
    old = n.leader()
    try:
        c.raft(old).propose_conf_change(ConfChange(ConfChangeOp.REMOVE, old))
    except LeaderStepping as e:
        print(f"  {old}: {e}", file=out)
    n.until(lambda: c.leader() not in (None, old)
            and old not in c.raft(c.leader()).conf.members())
    n.tick(3)
    n.write(20, start=50)

    n.say("4. Partition: the leader and one follower are cut off from the rest")
    lead = n.leader()
    others = [x for x in sorted(c.nodes) if x not in (lead, old)]
    buddy = others[0]
    minority = {lead, buddy}
    for a in minority:
        for b in c.nodes:
            if b not in minority:
                c.cut(a, b)
    before = c.raft(lead).log.committed
    c.raft(lead).propose(encode_command(0, 999, "put", "lost", "never committed"))
    n.until(lambda: any(
        c.raft(x).role == Role.LEADER for x in others if x not in minority
    ))
    n.tick(5)
    print(f"  old leader {lead} is cut off: its commit index stayed at "
          f"{c.raft(lead).log.committed} (was {before}); the write it took is not committed",
          file=out)
    n.write(20, start=70)

    n.say("5. Heal: the old leader steps down, drops its uncommitted entry and catches up")
    c.heal()
    new = n.leader()
    n.until(lambda: all(
        c.nodes[x].last_applied == c.raft(new).log.committed
        for x in c.raft(new).conf.members()
    ))
    n.tick(2)
    n.table()
    data = {nid: node.sm.data for nid, node in c.nodes.items()
            if nid in c.raft(new).conf.members()}
    same = all(d == data[new] for d in data.values())
    print(f"\n  replicas identical: {same}; 'lost' key present: "
          f"{'lost' in data[new]}", file=out)
    return c


if __name__ == "__main__":
    run()
