"""Self-healing measured from outside: real ``raftkv serve`` processes lose founders for
good (SIGKILL, never restarted) under a continuous write load, and the cluster regains
every partition's replica count and three live metastore voters on its own.

The run (``HealRun``):

1. three founders (n1..n3: the default group and the metastore) and one spare per
   planned loss (n4, n5, ...), each added to the placement topology (a metastore
   learner, a data node): after k losses, 3 live nodes remain for 3 replicas. The
   metastore leader declares a node dead only while it hears a majority of the
   topology, dead nodes included, so 4 nodes survive one loss and 5 nodes two.
   ``scale_down_timeout`` is set short so that a run takes seconds;
2. a table of P partitions x 3 replicas, converged (every partition's stable has three
   members, pending is empty, voters are stable, no learner);
3. client threads over HTTP, each a chain of single requests (put, get, cas with
   ``prev_value``/``prev_absent``) on the table's keys, plus one thread putting to the
   default KV group, each outcome recorded with its call and return time (an error that
   may have applied is recorded as unknown, as Jepsen does);
4. ``kill`` SIGKILLs a node and times, from the kill: *dead* (the metastore declares it)
   and *healed* (every partition has 3 replicas on live nodes, all converged, and the
   metastore has ``min(3, live)`` voters, all live);
5. ``finish`` stops the clients and checks: per-key linearizability of the table history
   (``raftkv.testing.linearizability``), no acknowledged write lost (a final linearizable
   read of every key), and equal digests on every replica of every partition.

The longest gap between two acknowledged table writes during healing is reported as the
write stall: the failover bound is an election plus a request's retry, so a stall near
``scale_down_timeout`` would mean writes waited for re-replication.

Used by ``tests/test_heal_procs.py`` (16 partitions, one founder) and
``benchmarks/heal.py`` (16 and 256 partitions, one and two founders).
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from dataclasses import dataclass, field

from raftkv.client import Client, ClientError, OutcomeUnknown
from raftkv.testing.linearizability import CheckResult, Operation, check_history
from raftkv.testing.placement_chaos import acknowledged_lost
from raftkv.testing.procs import ProcCluster

TABLE = "heal"
FOUNDERS = ["n1", "n2", "n3"]
OP_TIMEOUT = 10.0  # a client request's own deadline (it retries inside it)


@dataclass
class Kill:
    node: str
    dead_after: float  # seconds from the kill until the metastore declared it dead
    healed_after: float  # seconds from the kill until fully re-replicated
    max_write_stall: float  # the longest gap between acknowledged table writes, kill..healed
    # The slowest requests begun in kill..healed: "kind key +call_s took_s outcome" (an
    # unknown outcome counts until the client gave up).
    slowest: list[str] = field(default_factory=list)


@dataclass
class HealReport:
    partitions: int
    scale_down_timeout: float
    kills: list[Kill] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    check: CheckResult | None = None
    lost: list[str] = field(default_factory=list)
    digest_mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.check is not None and self.check.ok and not self.lost
                and not self.digest_mismatches)


class HealRun:
    """One cluster, one table, one load; see the module docstring."""

    def __init__(self, base_dir: str, partitions: int, spares: int = 1,
                 scale_down_timeout: float = 4.0, clients: int = 4, seed: int = 0) -> None:
        self.partitions = partitions
        self.spares = [f"n{4 + i}" for i in range(spares)]
        self.scale_down = scale_down_timeout
        self.cluster = ProcCluster(base_dir, size=3, faults=False)
        self.report = HealReport(partitions, scale_down_timeout)
        self.keys = [f"k{i}" for i in range(max(16, 2 * partitions))][:64]
        self.history: list[Operation] = []
        self.acks: list[float] = []  # when each table write was acknowledged
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i, seed * 100 + i),
                                          daemon=True, name=f"heal-client-{i}")
                         for i in range(clients)]
        self._threads.append(threading.Thread(target=self._default_writer, daemon=True,
                                              name="heal-default"))
        self.dead: set[str] = set()
        self.why = ""
        self.drained: set[str] = set()

    # ------------------------------------------------------------------ set-up ---------
    def start(self) -> None:
        c = self.cluster
        c.start()
        c.wait_leader()
        for n in self.spares:
            c.add_table_node(n)
        admin = c.client()
        try:
            admin.update_settings(scale_down_timeout=self.scale_down, scale_up_timeout=1.0)
            admin.create_table(TABLE, self.partitions, 3)
        finally:
            admin.close()
        self.wait_healed(timeout=60 + self.partitions)
        for t in self._threads:
            t.start()

    def live(self) -> list[str]:
        return [n for n in self.cluster.nodes if n not in self.dead and n not in self.drained]

    def _admin(self) -> Client:
        return self.cluster.client(self.live())

    # ------------------------------------------------------------------ the load -------
    def _record(self, op: Operation, what: str) -> None:
        with self._lock:
            self.history.append(op)
            self.report.counts[what] = self.report.counts.get(what, 0) + 1
            if op.known and op.kind in ("put", "cas") and op.output is not False:
                self.acks.append(op.ret)

    def _client(self, cid: int, seed: int) -> None:
        rng = random.Random(seed)
        seen: dict[str, str | None] = dict.fromkeys(self.keys)
        client = self.cluster.client(timeout=OP_TIMEOUT)
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                key = rng.choice(self.keys)
                value = f"c{cid}-{n}"
                r = rng.random()
                call = time.monotonic()
                try:
                    if r < 0.4:
                        got = client.get(key, table=TABLE)
                        out = None if got is None else got.decode()
                        seen[key] = out
                        self._record(Operation(cid, call, time.monotonic(), "get", key, None,
                                               out), "get-ok")
                    elif r < 0.75:
                        client.put(key, value, table=TABLE)
                        seen[key] = value
                        self._record(Operation(cid, call, time.monotonic(), "put", key, value),
                                     "put-ok")
                    else:
                        expected = seen[key] if rng.random() < 0.8 else f"wrong-{n}"
                        swapped, _ = client.cas(key, expected, value, table=TABLE)
                        if swapped:
                            seen[key] = value
                        self._record(Operation(cid, call, time.monotonic(), "cas", key,
                                               (expected, value), swapped),
                                     "cas-ok" if swapped else "cas-refused")
                except Exception as e:  # noqa: BLE001  # any failure: maybe applied
                    if r < 0.4:
                        self._record_failed_read(e)
                    else:
                        kind = "put" if r < 0.75 else "cas"
                        val: object = value if kind == "put" else (seen[key], value)
                        self._record(Operation(cid, call, math.inf, kind, key, val),
                                     f"{kind}-unknown")
                self._stop.wait(0.002)
        finally:
            client.close()

    def _record_failed_read(self, e: BaseException) -> None:
        # A failed read constrains nothing; count it (a 4xx would be a finding).
        with self._lock:
            what = f"get-error-{e.status}" if isinstance(e, ClientError) else "get-failed"
            self.report.counts[what] = self.report.counts.get(what, 0) + 1

    def _default_writer(self) -> None:
        client = self.cluster.client(timeout=OP_TIMEOUT)
        try:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    client.put(f"default-{i % 50}", str(i))
                    what = "default-put-ok"
                except Exception:  # noqa: BLE001  # counted, not checked
                    what = "default-put-failed"
                with self._lock:
                    self.report.counts[what] = self.report.counts.get(what, 0) + 1
                self._stop.wait(0.01)
        finally:
            client.close()

    # ------------------------------------------------------------------ faults ---------
    def healed(self) -> bool:
        """Every partition on 3 live nodes and converged; the metastore's voters live and
        as many as it can have. ``self.why`` says what is missing."""
        self.why = self._unhealed()
        return not self.why

    def _unhealed(self) -> str:
        live = set(self.live())
        admin = self._admin()
        try:
            desc = admin.describe_table(TABLE)
            nodes = admin.cluster_nodes()
        except Exception as e:  # noqa: BLE001  # a node mid-failover: not yet
            return f"no answer: {e}"
        finally:
            admin.close()
        for p in desc["partitions"]:
            stable = set(p["stable"])
            if (len(stable) != 3 or not stable <= live or p["pending"] or p["planned"]
                    or set(p["voters"] or ()) != stable or p["learners"] or p["leader"] is None):
                return (f"partition {p['partition']}: stable {p['stable']} pending "
                        f"{p['pending']} planned {p['planned']} voters {p['voters']} "
                        f"learners {p['learners']} leader {p['leader']} change {p['change']}")
        voters = {r["id"] for r in nodes if r.get("metastore") == "voter"}
        if not voters <= live or len(voters) != min(3, len(live)):
            return f"metastore voters {sorted(voters)}"
        return ""

    def _wait_healed(self, timeout: float) -> None:
        try:
            self.cluster.wait_until(self.healed, timeout, "full replication on live nodes")
        except TimeoutError as e:
            raise TimeoutError(f"{e}: {self.why}") from None

    def wait_healed(self, timeout: float) -> float:
        t0 = time.monotonic()
        self._wait_healed(timeout)
        return time.monotonic() - t0

    def _declared_dead(self, node: str) -> bool:
        admin = self._admin()
        try:
            return any(r["id"] == node and r["state"] == "dead"
                       for r in admin.cluster_nodes())
        except Exception:  # noqa: BLE001
            return False
        finally:
            admin.close()

    def kill(self, node: str, timeout: float = 240.0) -> Kill:
        """SIGKILL ``node`` for good; returns the times to dead and to healed."""
        t0 = time.monotonic()
        self.cluster.kill(node)
        self.dead.add(node)
        self.cluster.wait_until(lambda: self._declared_dead(node), timeout,
                                f"{node} declared dead")
        dead_after = time.monotonic() - t0
        self._wait_healed(timeout)
        t1 = time.monotonic()
        with self._lock:
            acks = sorted(a for a in self.acks if t0 <= a <= t1)
            ops = [o for o in self.history if t0 <= o.call <= t1]
        marks = [t0, *acks, t1]
        stall = max(b - a for a, b in itertools.pairwise(marks))
        ops.sort(key=lambda o: o.ret - o.call, reverse=True)
        slowest = [f"{o.kind} {o.key} +{o.call - t0:.2f}s "
                   f"{'unknown' if not o.known else f'{o.ret - o.call:.2f}s'} {o.output!r}"
                   for o in ops[:3]]
        k = Kill(node, dead_after, t1 - t0, stall, slowest)
        self.report.kills.append(k)
        return k

    def drain(self, node: str, timeout: float = 240.0) -> float:
        """``raftkv cluster drain``: returns the seconds until the node holds nothing, has
        left the topology and the metastore, and the rest is fully replicated; then the
        node is stopped (a drained node no longer hears the metastore)."""
        t0 = time.monotonic()
        admin = self._admin()
        try:
            admin.drain(node)
        finally:
            admin.close()
        self.drained.add(node)

        def gone() -> bool:
            admin = self._admin()
            try:
                return all(r["id"] != node for r in admin.cluster_nodes())
            except Exception:  # noqa: BLE001
                return False
            finally:
                admin.close()

        self.cluster.wait_until(lambda: gone() and self.healed(), timeout,
                                f"{node} drained and the rest fully replicated")
        took = time.monotonic() - t0
        # The drained node no longer answers for the cluster (found from outside: it
        # served its frozen view, then, restarted, 200 and no nodes at all).
        own = self.cluster.client([node])
        try:
            own.request("GET", "/v1/cluster/nodes", once=True)
            raise AssertionError(f"drained {node} still answers /v1/cluster/nodes")
        except (ClientError, OutcomeUnknown) as e:  # a single attempt's 503
            # Its metastore replica may know by now that it was removed (NotAMember).
            assert "503" in str(e) and ("drained or removed" in str(e)
                                        or "not a member" in str(e)), e
        finally:
            own.close()
        self.cluster.stop(node)
        return took

    # ------------------------------------------------------------------ the checks -----
    def finish(self) -> HealReport:
        self._stop.set()
        for t in self._threads:
            t.join(OP_TIMEOUT + 5)
        admin = self._admin()
        try:
            final = {k: _decode(admin.get(k, table=TABLE)) for k in self.keys}
            # A partition whose replicas just moved may be between leaders for a moment
            # (describe says leader null): the digests are taken once every one has one.
            deadline = time.monotonic() + 20
            desc = admin.describe_table(TABLE)
            while (any(p["leader"] not in desc["http"] for p in desc["partitions"])
                   and time.monotonic() < deadline):
                time.sleep(0.2)
                desc = admin.describe_table(TABLE)
            http = desc["http"]
            for p in desc["partitions"]:
                leader_digest = admin.partition_digest(TABLE, p["partition"],
                                                       http[p["leader"]], linearizable=True)
                index = leader_digest["applied"]
                for n in p["stable"]:
                    d = admin.partition_digest(TABLE, p["partition"], http[n], min_index=index)
                    if (d["digest"], d["count"]) != (leader_digest["digest"],
                                                     leader_digest["count"]):
                        self.report.digest_mismatches.append(
                            f"partition {p['partition']}: {n} {d} != leader {leader_digest}")
        finally:
            admin.close()
        with self._lock:
            history = list(self.history)
        self.report.check = check_history(history)
        self.report.lost = acknowledged_lost(history, final)
        return self.report

    def close(self) -> None:
        self._stop.set()
        self.cluster.close()


def _decode(v: bytes | None) -> str | None:
    return None if v is None else v.decode()


def describe(r: HealReport) -> str:
    lines = [f"{r.partitions} partitions x 3, scale_down_timeout {r.scale_down_timeout}s"]
    for k in r.kills:
        lines.append(f"  kill {k.node}: dead after {k.dead_after:.1f}s, healed after "
                     f"{k.healed_after:.1f}s, longest write stall {k.max_write_stall:.2f}s; "
                     f"slowest: {'; '.join(k.slowest)}")
    lines.append(f"  ops {dict(sorted(r.counts.items()))}")
    lines.append(f"  {r.check.detail if r.check else 'not checked'}; lost {r.lost or 'none'};"
                 f" digest mismatches {r.digest_mismatches or 'none'}")
    return "\n".join(lines)


def run(base_dir: str, partitions: int, kills: list[str], scale_down_timeout: float = 4.0,
        seed: int = 0) -> HealReport:
    """Start, kill each of ``kills`` in turn (each healed before the next), finish."""
    h = HealRun(base_dir, partitions, len(kills), scale_down_timeout, seed=seed)
    try:
        h.start()
        for node in kills:
            h.kill(node)
        return h.finish()
    finally:
        h.close()
