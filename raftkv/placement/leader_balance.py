"""Leader balancing for table partitions: each node hands over the leadership of the
partitions it leads but should not.

Why: an election is won by whoever times out first, and on a fresh table that is mostly
the same node (the scale benchmark saw one node lead 251 of 256 partitions; a bulk load
saw all 16 on one node). A leader does all the work clients see (HTTP, encoding, the
replication fan-out), so one node then carries the table while the others idle.

Theory of operation
-------------------
- **Preference**: a partition's preferred leader is one of its voters in rotation: the
  voters sorted, and partition p of a table takes the one at (p + a hash of the table
  name) mod their count. Every node computes the same answer with no coordination, each
  voter is preferred for 1/r of the partitions whose r voters it is among (exactly, when
  every partition has the same voters; a rendezvous choice left 0 of 16 partitions to one
  node of three in a measured run), and a membership change moves the preference only for
  the partitions involved. A group id that is not a table partition's falls back to the
  highest rendezvous score.
- **Hand-over**: every ``interval`` seconds a node looks, on its loop thread, at the
  partition groups it leads. For each whose preferred leader is another voter, it starts
  a leadership transfer (TimeoutNow, Raft §3.10) when it is safe and cheap: the target has
  acknowledged the whole log and was recently active, everything is committed (so no
  membership change is in flight), there are no learners (a rebalance is under way: it
  moves leadership itself when it must), and no transfer is already running.
- **Damping**: at most one attempt per group per ``cooldown`` seconds and at most
  ``max_per_round`` per round, so a failing or slow target cannot make leadership flap,
  and a restart does not start hundreds of elections at once. A new table's elections
  leave most leaders on one node (the one that created its groups first), so a round
  moves up to 16, every second: 256 partitions are spread in about 11 s, where 4 every
  2 s took over a minute of one node carrying the table. A preferred node that is
  down simply never qualifies, and the current leader keeps the partition.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from time import monotonic

from raftkv.core import Role
from raftkv.node.driver import Node
from raftkv.node.errors import NodeStopped
from raftkv.placement.assignments import hash64, rendezvous

log = logging.getLogger(__name__)


def preferred_leader(group: str, voters: Iterable[str]) -> str:
    """The voter that should lead ``group`` ("Preference" above)."""
    ordered = sorted(set(voters))
    table, _, index = group.rpartition(".")
    if not table or not index.isdigit():
        return rendezvous(group, ordered)[0]
    return ordered[(int(index) + hash64(table.encode())) % len(ordered)]


class LeaderBalancer:
    def __init__(self, node: Node, prefix: str = "t.", interval: float = 1.0,
                 cooldown: float = 30.0, max_per_round: int = 16) -> None:
        self.node, self.prefix = node, prefix
        self.interval, self.cooldown, self.max_per_round = interval, cooldown, max_per_round
        self._tried: dict[str, float] = {}
        self._stop = threading.Event()
        self.transfers = 0  # started (for status and tests)

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"leader-balance-{self.node.id}",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.node.call(self.round).result(self.interval * 5)
            except (NodeStopped, TimeoutError):
                continue

    def round(self) -> int:
        """One pass on the loop thread; returns the transfers it started."""
        now, started = monotonic(), 0
        for gid, g in list(self.node.groups.items()):
            if started >= self.max_per_round:
                break
            if not gid.startswith(self.prefix) or g.raft.role != Role.LEADER:
                continue
            st = g.raft.status()
            if st.lead_transferee is not None or st.conf.learners or st.commit != st.last_index:
                continue
            target = preferred_leader(gid, st.conf.voters)
            pr = st.peers.get(target)
            if (target == self.node.id or pr is None or pr.match != st.last_index
                    or not pr.recent_active or now - self._tried.get(gid, -1e9) < self.cooldown):
                continue
            self._tried[gid] = now
            self.transfers += 1
            started += 1
            self.node.transfer_leadership(gid, target).add_done_callback(_quiet(gid, target))
        return started


def _quiet(gid: str, target: str) -> Callable[[Future[None]], None]:
    def done(f: Future[None]) -> None:
        if f.exception() is not None:  # the target lagged or an election intervened: fine
            log.debug("leadership of %s to %s not moved: %s", gid, target, f.exception())
    return done
