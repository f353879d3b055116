"""Power losses of real ``raftkv serve`` processes (issue 22, part 2): the process path.

Each node of a ``ProcCluster`` keeps its data directory on a ``PowerLossFS`` of its
own, so one node, several or all can lose power while the others run. A client writes
throughout (sequential puts; only answered ones count as acknowledged). Each cycle
picks the victims and, for each, SIGKILLs it and loses power on its disk (all unsynced
data, or a seeded torn subset), then restarts it. At the end every node must be up and
the checks are:

The client writes half its keys to the default KV group and half to a table of two
partitions (``table=True``), whose logs share one LMDB environment per node; the
metastore runs on every node too.

- **no acknowledged write is lost**: a linearizable read of each key returns the last
  acknowledged put to it, or a later one (a put that timed out may still have landed);
- **no two leaders in one term**: every node's log line ``group G: leader is now N
  (term T)`` over the whole run, all nodes together, names one leader per group and term
  (the node logs live off the mounts, so they survive the power losses);
- **no replica uses a corrupt store**: every node came back (a refused or crashed start
  is a failure, with its log), and all replicas agree on the digest of their state.

``run_proc_cycles`` returns a ``ProcSummary``; failures carry the seed.
"""

from __future__ import annotations

import dataclasses
import random
import re
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from raftkv.client import Client
from raftkv.testing.powerloss_fs import PowerLossFS
from raftkv.testing.procs import ProcCluster

_LEADER = re.compile(r"group (\S+): leader is now (\S+) \(term (\d+)\)")


@dataclasses.dataclass
class ProcSummary:
    seed: int
    cycles: int = 0
    node_power_losses: int = 0
    torn: int = 0
    acked: int = 0
    terms_seen: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (f"seed {self.seed}: {self.cycles} cycles, {self.node_power_losses} node "
                f"power losses ({self.torn} torn), {self.acked} acknowledged puts, "
                f"{self.terms_seen} (group, term) leaderships, {len(self.failures)} failures")


class _Writer(threading.Thread):
    def __init__(self, cluster: ProcCluster, nkeys: int = 40) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.nkeys = nkeys
        self.acked: dict[str, int] = {}  # key -> seq of its last acknowledged put
        self.count = 0
        self.stop = threading.Event()
        self.table: str | None = None

    def table_of(self, key: str) -> str | None:
        """Odd keys go to the table (its partitions: the shared partition log), if any."""
        return self.table if int(key[1:]) % 2 else None

    def run(self) -> None:
        c: Client = self.cluster.client(timeout=2.0)
        seq = 0
        try:
            while not self.stop.is_set():
                seq += 1
                key = f"k{seq % self.nkeys}"
                try:
                    c.put(key, f"{seq}", table=self.table_of(key))
                except Exception:  # noqa: BLE001 - no answer: unknown outcome, not acknowledged
                    time.sleep(0.05)
                    continue
                self.acked[key] = seq
                self.count += 1
        finally:
            c.close()


def leaders_by_term(logs: dict[str, str]) -> tuple[dict[tuple[str, int], set[str]], int]:
    """(group, term) -> the leaders any node's log announced for it; and how many."""
    seen: dict[tuple[str, int], set[str]] = defaultdict(set)
    for text in logs.values():
        for group, leader, term in _LEADER.findall(text):
            if leader != "None":
                seen[(group, int(term))].add(leader)
    return seen, len(seen)


def run_proc_cycles(base: Path, seed: int, cycles: int, *, size: int = 3,
                    metadata: str = "strict", log: Any = print, table: bool = True,
                    run_seconds: tuple[float, float] = (0.5, 1.5)) -> ProcSummary:
    rng = random.Random(seed)
    summary = ProcSummary(seed)
    disks: dict[str, PowerLossFS] = {}
    cluster = ProcCluster(str(base / "cluster"), size=size)
    writer: _Writer | None = None
    try:
        for nid, node in cluster.nodes.items():
            fs = PowerLossFS(base / f"disk-{nid}", base / f"mnt-{nid}", metadata=metadata)
            disks[nid] = fs.start()
            node.data_dir = str(fs.mountpoint / "data")
        cluster.start()
        cluster.wait_leader(timeout=30)
        writer = _Writer(cluster)
        if table:
            cluster.create_table("plt", 2, size)
            writer.table = "plt"
        writer.start()
        for cycle in range(cycles):
            time.sleep(rng.uniform(*run_seconds))
            k = rng.choice([1, 1, 2, size])
            victims = sorted(rng.sample(sorted(cluster.nodes), k))
            for nid in victims:
                cluster.kill(nid)
            for nid in victims:
                torn = rng.random() < 0.5
                pl_seed, keep = rng.randrange(2**32), rng.choice([0.1, 0.5, 0.9])
                report = disks[nid].power_loss(torn=torn, seed=pl_seed, keep=keep,
                                               kill_users=True)
                summary.node_power_losses += 1
                summary.torn += torn
                log(f"seed {seed} cycle {cycle}: {nid}: {report.summary()}")
            for nid in victims:
                try:
                    cluster.start(nid)
                except (RuntimeError, TimeoutError) as e:
                    summary.failures.append(f"seed {seed} cycle {cycle}: {nid} did not come "
                                            f"back: {str(e)[-1500:]}")
                    return summary
            summary.cycles += 1
        cluster.wait_leader(timeout=30)
        time.sleep(0.5)
        writer.stop.set()
        writer.join(timeout=30)
        summary.acked = writer.count
        _check_end(cluster, writer, summary)
    finally:
        if writer is not None:
            writer.stop.set()
        logs = {nid: n.log_text() for nid, n in cluster.nodes.items()}
        for nid in cluster.nodes:
            cluster.kill(nid)
        for fs in disks.values():
            try:
                fs.close(kill_users=True)
            except Exception:  # noqa: BLE001 - best effort; detach what is left
                fs.detach()
    seen, summary.terms_seen = leaders_by_term(logs)
    for (group, term), leaders in sorted(seen.items()):
        if len(leaders) > 1:
            summary.failures.append(f"seed {seed}: group {group} had leaders "
                                    f"{sorted(leaders)} in term {term}")
    return summary


def _check_end(cluster: ProcCluster, writer: _Writer, summary: ProcSummary) -> None:
    seed = summary.seed
    c = cluster.client(timeout=5.0)
    try:
        for key, seq in sorted(writer.acked.items()):
            raw = c.get(key, table=writer.table_of(key))
            got = int(raw) if raw is not None else 0
            if got < seq or got % writer.nkeys != int(key[1:]):
                summary.failures.append(f"seed {seed}: acknowledged put lost: {key} holds "
                                        f"{raw!r}, its last acknowledged put was {seq}")
    finally:
        c.close()
    try:
        cluster.wait_caught_up(timeout=30)
    except TimeoutError as e:
        summary.failures.append(f"seed {seed}: replicas did not catch up: {e}")
        return
    digests = {nid: cluster.digest(nid) for nid in cluster.nodes}
    if len({(d["count"], d["digest"]) for d in digests.values()}) != 1:
        summary.failures.append(f"seed {seed}: replicas disagree: {digests}")
