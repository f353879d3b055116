"""Write throughput and latency of a 3-node raftkv group, failover time and learner catch-up.

What is measured (all on 127.0.0.1, every node its own process)
--------------------------------------------------------------
1. **raftkv embedded** (the like-for-like comparison with PySyncObj, which is embedded
   too): ``--nodes`` processes each run a ``RaftKV`` (LMDB data dirs in a temp dir,
   durable: one fsync per Ready). The leader's process drives the load itself (see
   ``benchmarks/_throughput_peer.py``): ``--ops`` N ``put_async`` of ``--value-size``
   byte values, distinct keys, at most ``--window`` outstanding. ops/s is N over the
   time from the first submit to the last completion; latency is per op, from submit to
   the future's completion. The driver's ``Metrics`` hooks count the leader's fsyncs
   (one per persisted Ready) and their latency, and the proposals per driver turn.
2. **raftkv over HTTP**: a ``ProcCluster`` of ``raftkv serve`` processes (fsync on), and
   ``--http-procs`` client processes with ``--http-clients`` threads in all, each thread
   a ``raftkv.client.Client`` on one kept-alive connection to the leader, doing
   sequential PUTs (concurrency = the number of threads). ops/s over the wall-clock
   span of all clients; per-request latency; the leader's fsyncs from ``/metrics``
   (``raftkv_fsync_seconds``).
3. **PySyncObj 0.3.17**: ``--nodes`` processes with ``SyncObj`` + ``ReplDict``,
   ``SyncObjConf(appendEntriesUseBatch=True)`` and otherwise defaults; the leader's
   process issues the same N ``set`` calls with ``callback=`` (asynchronous) and the same
   window. PySyncObj keeps its log in memory by default and never fsyncs. For both,
   ops/s counts acknowledged successes only; failed operations (PySyncObj reports
   ``DISCARDED``/``LEADER_CHANGED`` when it loses its leader under load) are listed
   by kind, and their latencies are still in the percentiles.
4. **LMDB limit**: a plain LMDB write loop on one local env (no Raft, no network, the
   env opened with sync on, as the durable Raft log is), committing every B puts with one
   fsync per commit, for B = 1, 10, 100, 1000 and the ops per leader fsync that raftkv's
   driver achieved in run 1. ``lmdb_limit_ops_s`` is the rate at that achieved B: the
   physical ceiling for one node committing that many ops per fsync.

Then (``--failover``, part of the default run):

5. A ``ProcCluster`` of 3 with default timeouts (tick 0.05 s, election 10 ticks) and a
   ``raftkv.client.Client`` writing continuously. The leader is SIGKILLed; from that
   moment, fresh single-attempt PUT probes go to every surviving node every
   ``PROBE_EVERY`` seconds. ``failover_s`` is the time from the kill until the first probe
   is acknowledged (necessarily by a new leader: it was sent after the old one died).
   What the continuous writer saw is reported too: ``client_stall_s``, the longest gap
   between two of its acknowledged writes, from its last ack before the kill until the
   first ack of a request it sent after the kill (``client_resumed_s``). That includes
   the client's retry policy and the fate of the request it had in flight when the
   leader died. ``--failover-repeats`` R times, the killed node restarted and caught
   up in between; p50 and max.

And with ``--catchup-keys K`` (not in the default run):

6. An embedded 3-node group is loaded with K keys through ``batch`` (``--catchup-batch``
   puts per log entry). A 4th node starts with ``join`` and the leader calls
   ``add_learner``. ``caught_up_s`` is the time from that call until the learner's
   applied index reaches the leader's commit index; ``promoted_s`` until the leader
   lists it as a voter. The learner's digest is compared with the leader's. Whether it
   caught up from a snapshot or from the log is read off its log's first index.
   ``--catchup-snapshot`` sets a tiny CompactionPolicy on the founders (max 100
   entries, keep 10) so that the snapshot path is taken for sure.

Targets: raftkv embedded (fsync on) >= 3x PySyncObj (no fsync); failover p50 < 1 s;
learner catch-up of 1,000,000 keys < 20 s.

Usage::

    python -m benchmarks.throughput [--nodes 3] [--ops 50000] [--value-size 100]
        [--window 1000] [--repeat R] [--nofsync] [--http-ops N] [--http-clients 16]
        [--http-procs 2] [--failover] [--failover-repeats 5] [--catchup-keys K]
        [--catchup-batch 1000] [--catchup-snapshot | --catchup-both] [--all]
        [--skip embedded,pysyncobj,http,lmdb] [--profile] [--tls] [--json FILE] [--dir DIR]

``--tls`` runs 1 and 2 with TLS on every raftkv port: mutual TLS between peers (run 1),
and HTTPS plus mutual peer TLS (run 2), with a throw-away CA (``raftkv.certs``); run it
with and without to get the cost of TLS (docs/security.md reports it).

With none of ``--failover``, ``--catchup-keys``: runs 1-5. With ``--failover`` and/or
``--catchup-keys``: only those. ``--all``: 1-6 (catch-up of 1,000,000 keys by default).
``--repeat R`` runs 1 and 3 R times each, alternating raftkv and PySyncObj on fresh
groups (the machine may be shared: alternation spreads background load over both), and
reports the median run of each. ``--nofsync`` adds run 1 with ``durable=False``: if it
is no faster, the fsync is not what limits throughput. ``--catchup-both`` runs 6 with the
default CompactionPolicy and then with the forced snapshot.
Results: a table on stdout, ``--json`` (default ``benchmarks/results/throughput.json``)
and a PNG next to it if matplotlib is importable. ``--profile`` re-runs the embedded
load under cProfile (leader's driver thread, its load thread and a follower's driver
thread) after the measured run and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import lmdb

from benchmarks._plot import pyplot
from benchmarks._throughput_peer import percentiles
from benchmarks.recovery import key, machine, value, verdict
from raftkv.certs import CertFiles, issue, make_ca
from raftkv.client import Client
from raftkv.server.auth import Role
from raftkv.testing.procs import ProcCluster, free_ports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "throughput.json"
PEER = "benchmarks._throughput_peer"
LMDB_BATCHES = (1, 10, 100, 1000)
PROBE_EVERY = 0.01  # seconds between failover probes to each surviving node
TARGET_SPEEDUP = 3.0
TARGET_FAILOVER_S = 1.0
TARGET_CATCHUP_S = 20.0
TARGET_CATCHUP_KEYS = 1_000_000
CATCHUP_TIMEOUT_S = 180.0  # a catch-up still running then is reported as not finished


# -- node processes speaking the peer's line protocol -------------------------------------
class Peer:
    """One ``_throughput_peer`` node process: a JSON command per line in, one answer out."""

    def __init__(self, name: str, args: list[str], log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", PEER, *args], cwd=ROOT, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
            )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=5)
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                               f"{self.log_tail()}")
        return dict(json.loads(line))

    def ask(self, cmd: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"{self.name}: {cmd}: {out['error']}")
        return out

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(timeout=15)
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


class Group:
    """``--nodes`` peer processes of one kind (``raftkv`` or ``pysyncobj``)."""

    def __init__(self, kind: str, base: str, nodes: int, extra: list[str] | None = None,
                 tls: bool = False) -> None:
        os.makedirs(base, exist_ok=True)
        self.base = base
        self.kind = kind
        self.extra = extra or []
        self.tls_dir = os.path.join(base, "tls")
        self.ca: CertFiles | None = make_ca(self.tls_dir) if tls else None
        self.addrs = {f"n{i}": f"127.0.0.1:{p}"
                      for i, p in enumerate(free_ports(nodes), start=1)}
        self.peers: dict[str, Peer] = {}
        try:
            for nid in self.addrs:
                self.peers[nid] = self._spawn(nid)
        except BaseException:
            self.close()
            raise

    def _spawn(self, nid: str, join: bool = False) -> Peer:
        log = os.path.join(self.base, f"{nid}.log")
        if self.kind == "raftkv":
            peers = {nid: self.addrs[nid]} if join else self.addrs
            args = ["raftkv", nid, self.addrs[nid], os.path.join(self.base, nid),
                    json.dumps(peers), *self.extra] + (["--join"] if join else [])
            if self.ca is not None:
                issue(self.ca, self.tls_dir, nid)
                args += ["--tls-dir", self.tls_dir]
        else:
            others = ",".join(a for n, a in self.addrs.items() if n != nid)
            args = ["pysyncobj", self.addrs[nid], others]
        return Peer(nid, args, log)

    def add(self, nid: str) -> Peer:
        """Start a new empty raftkv node with ``join`` (the leader must add it)."""
        taken = (int(a.rsplit(":", 1)[1]) for a in self.addrs.values())
        self.addrs[nid] = f"127.0.0.1:{free_ports(1, taken)[0]}"
        self.peers[nid] = self._spawn(nid, join=True)
        return self.peers[nid]

    def leader(self, timeout: float = 30.0) -> Peer:
        """The peer every node agrees leads."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = {p.ask("wait_leader", timeout=timeout)["leader"] for p in self.peers.values()}
            if len(seen) == 1 and None not in seen:
                lead = seen.pop()
                for nid, p in self.peers.items():
                    if lead in (nid, self.addrs[nid]):
                        return p
            time.sleep(0.1)
        raise TimeoutError(f"{self.kind}: no agreed leader within {timeout}s")

    def close(self) -> None:
        for p in self.peers.values():
            p.close()


# -- 1. raftkv embedded ---------------------------------------------------------------------
def loaded_run(group: Group, lead: Peer, n: int, window: int, size: int,
               prefix: str) -> dict[str, Any]:
    """The leader's ``load``, with every node's CPU seconds and the load average."""
    cpu0 = {nid: p.ask("cpu")["cpu_s"] for nid, p in group.peers.items()}
    load0 = os.getloadavg()[0]
    res = lead.ask("load", n=n, window=window, size=size, prefix=prefix)
    cpu = {nid: p.ask("cpu")["cpu_s"] - cpu0[nid] for nid, p in group.peers.items()}
    res["leader"] = lead.name
    res["cpu_s"] = cpu
    res["cpu_us_per_op"] = {nid: c / n * 1e6 for nid, c in cpu.items()}
    res["cpu_busy_share"] = sum(cpu.values()) / (res["seconds"] * (os.cpu_count() or 1))
    res["loadavg_1m"] = [load0, os.getloadavg()[0]]
    return res


def run_embedded(base: str, nodes: int, n: int, window: int, size: int, profile: bool,
                 durable: bool = True, tls: bool = False) -> dict[str, Any]:
    extra = [] if durable else ["--no-fsync"]
    group = Group("raftkv", base, nodes, extra, tls=tls)
    try:
        lead = group.leader()
        lead.ask("load", n=100, window=window, size=size, prefix="warm")  # connections up
        marks = {nid: p.ask("metrics")["count"] for nid, p in group.peers.items()}
        res = loaded_run(group, lead, n, window, size, "k")
        res["followers_fsync"] = {
            nid: {"count": p.ask("metrics")["count"] - marks[nid]}
            for nid, p in group.peers.items() if p is not lead}
        res["durable"] = durable
        if profile:
            res["profile"] = profile_embedded(group, lead, min(n, 20_000), window, size, base)
        return res
    finally:
        group.close()


def profile_embedded(group: Group, lead: Peer, n: int, window: int, size: int,
                     base: str) -> dict[str, Any]:
    """Re-run the load under cProfile; print the top functions by own time."""
    follower = next(p for p in group.peers.values() if p is not lead)
    paths = {"leader": os.path.join(base, "prof-leader"),
             "follower": os.path.join(base, "prof-follower")}
    lead.ask("profile_start")
    follower.ask("profile_start")
    res = lead.ask("load", n=n, window=window, size=size, prefix="p")
    lead.ask("profile_stop", path=paths["leader"])
    follower.ask("profile_stop", path=paths["follower"])
    print(f"\n== cProfile: {n:,} puts under the profiler: {res['ops_s']:,.0f} ops/s "
          f"(read the shares, not the rate) ==")
    shares: dict[str, Any] = {}
    for title, path in (("leader driver thread", paths["leader"] + ".driver"),
                        ("leader load thread (put_async callers)", paths["leader"] + ".client"),
                        ("follower driver thread", paths["follower"] + ".driver")):
        print(f"\n-- {title}: top 25 by own time --")
        st = pstats.Stats(path, stream=sys.stdout)
        st.strip_dirs().sort_stats(pstats.SortKey.TIME).print_stats(25)
        total = st.total_tt  # type: ignore[attr-defined]
        rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]  # type: ignore[attr-defined]
        shares[title] = {"total_s": total, "top": [
            {"func": f"{f[0]}:{f[1]}:{f[2]}", "tottime_s": v[2], "cumtime_s": v[3],
             "calls": v[1]} for f, v in rows]}
    return {"ops_s_under_profiler": res["ops_s"], "threads": shares}


# -- 2. raftkv over HTTP --------------------------------------------------------------------
_FSYNC_RE = re.compile(r'^raftkv_fsync_seconds_(count|sum)\{group="default"\} (\S+)$',
                       re.MULTILINE)


def fsync_metrics(cluster: ProcCluster, node: str) -> dict[str, float]:
    """The leader's fsync count and seconds from ``/metrics`` (with the metrics token
    when the cluster checks tokens, and its CA and client certificate under TLS)."""
    c = cluster.client([node], role=Role.METRICS)
    try:
        text = c.request("GET", "/metrics")[1].decode()
    finally:
        c.close()
    return {m.group(1): float(m.group(2)) for m in _FSYNC_RE.finditer(text)}


def run_http(base: str, nodes: int, n: int, clients: int, procs: int, size: int,
             tls: bool = False) -> dict[str, Any]:
    cluster = ProcCluster(base, size=nodes, faults=False, extra_args=["--log-level", "WARNING"],
                          tls=tls)
    env = dict(os.environ)
    if cluster.client_cert is not None:  # the client processes' Client reads these
        env.update(RAFTKV_CACERT=cluster.client_cert.ca, RAFTKV_CERT=cluster.client_cert.cert,
                   RAFTKV_KEY=cluster.client_cert.key)
    try:
        cluster.start()
        lead = cluster.wait_leader()
        ep = cluster.nodes[lead].endpoint
        warm = cluster.client([lead])
        for i in range(50):
            warm.put(f"warm-{i}", value(i, size))
        warm.close()
        before = fsync_metrics(cluster, lead)
        procs = max(1, min(procs, clients))
        threads = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
        ops = [n * t // clients for t in threads]
        ops[0] += n - sum(ops)
        start_at = time.time() + 1.5 + 0.2 * procs
        children = [
            subprocess.Popen([sys.executable, "-m", PEER, "http", ep, "-", str(ops[i]),
                              str(threads[i]), str(size), f"h{i}", repr(start_at)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
            for i in range(procs)
        ]
        outs = []
        for c in children:
            stdout, stderr = c.communicate()
            if c.returncode != 0:
                raise RuntimeError(f"HTTP client failed ({c.returncode}):\n{stderr[-3000:]}")
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
        after = fsync_metrics(cluster, lead)
        lat = [x for o in outs for x in o["lat_ms"]]
        span = max(o["t_end"] for o in outs) - min(o["t_start"] for o in outs)
        fs_count = after.get("count", 0.0) - before.get("count", 0.0)
        fs_sum = after.get("sum", 0.0) - before.get("sum", 0.0)
        return {
            "n": n, "clients": clients, "client_procs": procs, "leader": lead,
            "seconds": span, "ops_s": len(lat) / span, "errors": sum(o["errors"] for o in outs),
            **percentiles(lat),
            "fsync": {"count": int(fs_count),
                      "mean_ms": fs_sum / fs_count * 1000.0 if fs_count else None,
                      "ops_per_fsync": len(lat) / fs_count if fs_count else None},
        }
    finally:
        cluster.close()


# -- 3. PySyncObj ---------------------------------------------------------------------------
def run_pysyncobj(base: str, nodes: int, n: int, window: int, size: int) -> dict[str, Any]:
    group = Group("pysyncobj", base, nodes)
    try:
        lead = group.leader()
        lead.ask("load", n=100, window=window, size=size, prefix="warm")
        res = loaded_run(group, lead, n, window, size, "k")
        res["fsync"] = "none: PySyncObj never fsyncs (in-memory journal by default)"
        return res
    finally:
        group.close()


# -- 4. LMDB limit ----------------------------------------------------------------------------
def lmdb_limit(path: str, n: int, size: int, batch: int) -> dict[str, Any]:
    """ops/s of plain LMDB puts, ``batch`` per write transaction, fsync at every commit."""
    shutil.rmtree(path, ignore_errors=True)
    env = lmdb.open(path, subdir=True, create=True, map_size=1 << 32, max_dbs=2,
                    sync=True, metasync=True, readahead=False)
    db = env.open_db(b"data")
    items = [(key(i), value(i, size)) for i in range(1, n + 1)]
    batches = [items[lo:lo + batch] for lo in range(0, n, batch)]
    t0 = time.perf_counter()
    for b in batches:
        with env.begin(write=True, db=db) as txn:
            put = txn.put
            for k, v in b:
                put(k, v)
    seconds = time.perf_counter() - t0
    env.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"batch": batch, "ops": n, "commits": len(batches), "seconds": seconds,
            "ops_s": n / seconds, "ms_per_commit": seconds / len(batches) * 1000.0}


def run_lmdb(base: str, n: int, size: int, achieved: float | None) -> dict[str, Any]:
    sizes = set(LMDB_BATCHES)
    at = max(1, round(achieved)) if achieved else None
    if at is not None:
        sizes.add(at)
    rows = []
    for b in sorted(sizes):
        ops = min(n, max(2_000, b * 300))  # ~300+ fsyncs per point is a stable rate
        rows.append(lmdb_limit(os.path.join(base, "lmdb"), ops, size, b))
    pick = at if at is not None else max(LMDB_BATCHES)
    limit = next(r for r in rows if r["batch"] == pick)
    return {"rows": rows, "batch": pick, "ops_s": limit["ops_s"],
            "batch_source": "ops per leader fsync in the embedded run" if at else "default"}


# -- 5. failover ----------------------------------------------------------------------------
class Writer(threading.Thread):
    """A ``raftkv.client.Client`` writing sequentially, as fast as it is answered."""

    def __init__(self, endpoints: list[str], size: int) -> None:
        super().__init__(daemon=True)
        self.client = Client(endpoints, timeout=30.0)
        self.size = size
        self.acks: list[tuple[float, float, int]] = []  # (sent, acked, index)
        self.errors: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            t0 = time.monotonic()
            try:
                index = self.client.put(f"w{i:08d}", value(i, self.size))
            except Exception as e:  # noqa: BLE001 - recorded; a writer keeps writing
                self.errors.append((time.monotonic(), repr(e)[:200]))
                time.sleep(0.01)
                continue
            self.acks.append((t0, time.monotonic(), index))

    def resumed_after(self, t: float) -> tuple[float, float, int] | None:
        """The first ack of a request sent after ``t``."""
        return next((a for a in self.acks if a[0] > t), None)

    def stall_around(self, t: float) -> float:
        """The longest wait between two acks, from the last ack before ``t`` to the
        first ack of a request sent after ``t``: what the application saw."""
        acks = sorted(a[1] for a in self.acks)
        resumed = self.resumed_after(t)
        end = resumed[1] if resumed else acks[-1]
        before = [a for a in acks if a <= t]
        window = [before[-1] if before else t] + [a for a in acks if t < a <= end]
        return max((b - a for a, b in pairwise(window)), default=0.0)


def probe_once(endpoint: str, k: str, v: bytes, out: list[tuple[float, float, str]]) -> None:
    """One PUT, one attempt, a fresh connection: appends (sent, answered, outcome)."""
    host = endpoint.split("//")[1]
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection(host, timeout=10)
        c.request("PUT", "/v1/kv/" + k, body=v)
        r = c.getresponse()
        r.read()
        c.close()
        outcome = str(r.status)
    except (OSError, http.client.HTTPException) as e:
        outcome = type(e).__name__
    out.append((t0, time.monotonic(), outcome))


def run_failover(base: str, repeats: int, size: int) -> dict[str, Any]:
    cluster = ProcCluster(base, size=3, faults=False, extra_args=["--log-level", "WARNING"])
    samples: list[dict[str, Any]] = []
    writer: Writer | None = None
    try:
        cluster.start()
        cluster.wait_leader()
        writer = Writer([n.endpoint for n in cluster.nodes.values()], size)
        writer.start()
        for r in range(repeats):
            old = cluster.wait_leader()
            # The writer must be making progress before the kill.
            n_acks = len(writer.acks)
            cluster.wait_until(lambda n0=n_acks: len(writer.acks) >= n0 + 20, 20.0,
                               "writer progress")
            survivors = [nid for nid in cluster.nodes if nid != old]
            probes: list[tuple[float, float, str]] = []
            t_kill = time.monotonic()
            cluster.kill(old)
            deadline = t_kill + 30.0
            seq = 0
            first: tuple[float, float, str] | None = None
            while first is None and time.monotonic() < deadline:
                for nid in survivors:
                    seq += 1
                    threading.Thread(
                        target=probe_once, daemon=True,
                        args=(cluster.nodes[nid].endpoint, f"probe-{r}-{seq}",
                              value(seq, size), probes),
                    ).start()
                time.sleep(PROBE_EVERY)
                oks = [p for p in list(probes) if p[2] == "200"]
                if oks:
                    first = min(oks, key=lambda p: p[1])
            if first is None:
                raise TimeoutError("no write was acknowledged within 30 s of the kill")
            new = cluster.wait_leader(among=survivors)
            cluster.wait_until(lambda t=t_kill: writer.resumed_after(t) is not None, 30.0,
                               "the continuous writer's next ack")
            resumed = writer.resumed_after(t_kill)
            assert resumed is not None
            sample = {
                "killed": old, "new_leader": new,
                "failover_s": first[1] - t_kill,
                "client_stall_s": writer.stall_around(t_kill),
                "client_resumed_s": resumed[1] - t_kill,
                "probes_sent": seq,
                "probe_outcomes": _count(p[2] for p in probes),
            }
            samples.append(sample)
            print(f"  failover {r + 1}/{repeats}: killed {old}, {new} leads; first ack "
                  f"{sample['failover_s']:.3f} s after the kill; the continuous client "
                  f"stalled {sample['client_stall_s']:.3f} s", flush=True)
            cluster.start(old)
            cluster.wait_caught_up(timeout=60.0)
    finally:
        if writer is not None:
            writer.stop.set()
            writer.join(timeout=35)
        cluster.close()
    fo = sorted(x["failover_s"] for x in samples)
    cs = sorted(x["client_stall_s"] for x in samples)
    return {
        "repeats": repeats, "tick_s": 0.05, "election_ticks": 10,
        "p50_s": fo[len(fo) // 2], "max_s": fo[-1],
        "client_stall_p50_s": cs[len(cs) // 2], "client_stall_max_s": cs[-1],
        "writer_acks": len(writer.acks) if writer else 0,
        "writer_errors": len(writer.errors) if writer else 0,
        "writer_error_kinds": _count(e[1].split("(")[0] for e in writer.errors) if writer else {},
        "samples": samples,
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


# -- 6. learner catch-up ----------------------------------------------------------------------
def run_catchup(base: str, keys: int, batch: int, size: int, snapshot: bool) -> dict[str, Any]:
    extra = ["--compact-entries", "100", "--compact-keep", "10"] if snapshot else []
    group = Group("raftkv", base, 3, extra)
    try:
        lead = group.leader()
        print(f"  loading {keys:,} keys ({batch} puts per entry) ...", flush=True)
        fill = lead.ask("fill", n=keys, batch=batch, window=8, size=size)
        if fill["errors"]:
            raise RuntimeError(f"the fill had {fill['errors']} failed batches")
        print(f"  loaded in {fill['seconds']:.1f} s ({fill['keys_s']:,.0f} keys/s)", flush=True)
        # Every founder applies the fill before the learner arrives (it is not racing them).
        target = lead.ask("status")["commit"]
        deadline = time.monotonic() + 120
        while any(p.ask("status")["applied"] < target for p in group.peers.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("the founders did not apply the fill")
            time.sleep(0.1)
        if snapshot:  # wait for the leader's compaction (its driver checks once a second)
            deadline = time.monotonic() + 30
            while lead.ask("status")["first_index"] <= 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the leader's log was not compacted")
                time.sleep(0.1)
        lst = lead.ask("status")
        learner = group.add("n4")
        t_spawned = time.time()
        added = lead.ask("add_learner", id="n4", addr=group.addrs["n4"])
        t0 = added["t_call"]
        caught = promoted = None
        # One row a second: what the learner has and what the leader thinks of it, so
        # that a catch-up that does not finish says where it is stuck.
        trace: list[dict[str, Any]] = []
        next_trace = 0.0
        deadline = time.monotonic() + CATCHUP_TIMEOUT_S
        while caught is None or promoted is None:
            if time.monotonic() > deadline:
                break
            try:
                ls, ld = learner.ask("status"), lead.ask("status")
            except RuntimeError as e:  # a status call timed out: the loop thread is busy
                trace.append({"t": time.time() - t0, "error": str(e)[:200]})
                continue
            if caught is None and ls["applied"] >= ld["commit"]:
                caught = ls["t"] - t0
            if promoted is None and ld["members"].get("n4") == "voter":
                promoted = ld["t"] - t0
            if time.monotonic() >= next_trace:
                next_trace = time.monotonic() + 1.0
                founders = {}
                for nid, p in group.peers.items():
                    if nid != "n4":
                        try:
                            st = p.ask("status")
                            founders[nid] = f"{st['role']}@{st['term']}"
                        except RuntimeError:
                            founders[nid] = "busy"
                cur = next((group.peers[n] for n, r in founders.items()
                            if r.startswith("leader")), lead)
                ld = cur.ask("status") if cur is not lead else ld
                pr = ld["peers"].get("n4", {})
                trace.append({"t": round(ls["t"] - t0, 2), "learner_applied": ls["applied"],
                              "learner_first_index": ls["first_index"],
                              "leader_commit": ld["commit"],
                              "leader_view": {k: pr.get(k) for k in ("match", "next", "state")},
                              "kind": ld["members"].get("n4"), "founders": founders})
            time.sleep(0.05)
        done = caught is not None and promoted is not None
        final = learner.ask("status")
        terms = [int(r.split("@")[1]) for row in trace for r in row.get("founders", {}).values()
                 if "@" in r]
        same = _digests_equal(lead, learner) if done else None
        return {
            "keys": keys, "batch": batch, "forced_snapshot": snapshot, "fill": fill,
            "leader_first_index_at_add": lst["first_index"],
            "leader_commit_at_add": lst["commit"],
            "learner_first_index": final["first_index"],
            "mode": ("snapshot" if final["first_index"] > 1 else "log") if done
            else f"did not finish within {CATCHUP_TIMEOUT_S:.0f} s",
            "learner_start_s": t0 - t_spawned,
            "caught_up_s": caught, "promoted_s": promoted,
            "learner_applied": final["applied"], "digest_equal": same,
            # Elections among the founders while the learner caught up (0 is healthy).
            "elections_during_catchup": (max(terms) - min(terms)) if terms else None,
            "trace": trace,
        }
    finally:
        group.close()


def _digests_equal(a: Peer, b: Peer) -> bool | None:
    """Compare the two replicas' digests (only meaningful at equal applied indexes)."""
    try:
        da, db = a.ask("digest"), b.ask("digest")
    except RuntimeError:
        return None
    return bool(da["digest"] == db["digest"] and da["count"] == db["count"])


# -- report -------------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(doc: dict[str, Any]) -> None:
    rows = []
    e, h, p, lm = doc.get("embedded"), doc.get("http"), doc.get("pysyncobj"), doc.get("lmdb")
    if e:
        f = e["fsync"]
        rows.append(("raftkv embedded (fsync)", e["ops_s"], e["p50_ms"], e["p99_ms"],
                     (f"{f['count']:,} fsyncs, {f['mean_ms']:.2f} ms mean, "
                      f"{e['n'] / max(f['count'], 1):.0f} ops/fsync, window {e['window']}")))
    ne = doc.get("embedded_nofsync")
    if ne:
        rows.append(("raftkv embedded (no fsync)", ne["ops_s"], ne["p50_ms"], ne["p99_ms"],
                     "durable=False, for the CPU share"))
    if h:
        f = h["fsync"]
        rows.append(("raftkv HTTP (fsync)", h["ops_s"], h["p50_ms"], h["p99_ms"],
                     (f"{h['clients']} clients in {h['client_procs']} procs; "
                      f"{f['count']:,} fsyncs, {fmt(f['mean_ms'], '.2f')} ms mean")))
    if p:
        rows.append(("PySyncObj 0.3.17 ReplDict", p["ops_s"], p["p50_ms"], p["p99_ms"],
                     (f"NO fsync (in-memory log); window {p['window']}; "
                      f"{p['errors']:,} failed {p['error_kinds'] or ''}")))
    if lm:
        rows.append((f"LMDB limit (batch {lm['batch']})", lm["ops_s"], None, None,
                     "plain txn.put loop, fsync per commit, 1 node, no Raft"))
    header = f"{'system':<28} {'ops/s':>10} {'p50 ms':>8} {'p99 ms':>8}  notes"
    if rows:
        print(header)
        print("-" * (len(header) + 40))
    for name, ops, p50, p99, note in rows:
        print(f"{name:<28} {fmt(ops):>10} {fmt(p50, '.2f'):>8} {fmt(p99, '.2f'):>8}  {note}")
    for label, run in (("raftkv embedded", e), ("PySyncObj", p)):
        if run and run.get("cpu_us_per_op"):
            per = ", ".join(f"{nid}{' (leader)' if nid == run['leader'] else ''} "
                            f"{us:.0f}" for nid, us in run["cpu_us_per_op"].items())
            reps = run.get("samples_ops_s") or []
            print(f"{label}: CPU us per op: {per}; machine busy {run['cpu_busy_share']:.0%} "
                  f"of {os.cpu_count()} CPUs; load avg {run['loadavg_1m'][0]:.1f}"
                  + (f"; ops/s of {len(reps)} runs: "
                     + ", ".join(f"{x:,.0f}" for x in reps) if len(reps) > 1 else ""))
    if lm:
        print("\nLMDB limit by batch size (fsync per commit): " + ", ".join(
            f"{r['batch']}: {r['ops_s']:,.0f} ops/s ({r['ms_per_commit']:.2f} ms/commit)"
            for r in lm["rows"]))
    r = doc["ratios"]
    if r.get("raftkv_over_pysyncobj") is not None:
        print(f"raftkv / pysyncobj: {r['raftkv_over_pysyncobj']:.2f}")
    if r.get("raftkv_over_lmdb_limit") is not None:
        print(f"raftkv / lmdb_limit: {r['raftkv_over_lmdb_limit']:.3f}")
    if r.get("raftkv_http_over_pysyncobj") is not None:
        print(f"raftkv_http / pysyncobj: {r['raftkv_http_over_pysyncobj']:.2f}")
    fo = doc.get("failover")
    if fo:
        print(f"\nfailover ({fo['repeats']} kills of the leader): first write acknowledged by "
              f"the new leader p50 {fo['p50_s']:.3f} s, max {fo['max_s']:.3f} s; the "
              f"continuous client stalled p50 {fo['client_stall_p50_s']:.3f} s, max "
              f"{fo['client_stall_max_s']:.3f} s")
    for c in doc.get("catchup") or []:
        print(f"\ncatch-up of {c['keys']:,} keys ({c['batch']} per entry"
              f"{', forced snapshot' if c['forced_snapshot'] else ''}): caught up "
              f"{fmt(c['caught_up_s'], '.2f')} s, promoted {fmt(c['promoted_s'], '.2f')} s; "
              f"mode: {c['mode']} (leader log first index {c['leader_first_index_at_add']:,}, "
              f"learner {c['learner_first_index']:,}); digest equal: {c['digest_equal']}; "
              f"elections among the founders meanwhile: {c['elections_during_catchup']}")


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    r = doc["ratios"].get("raftkv_over_pysyncobj")
    if r is not None:
        out.append({"target": f"raftkv embedded with fsync >= {TARGET_SPEEDUP:.0f}x PySyncObj",
                    "met": r >= TARGET_SPEEDUP,
                    "value": f"{r:.2f}x ({doc['raftkv_ops_s']:,.0f} vs "
                             f"{doc['pysyncobj_ops_s']:,.0f} ops/s)"})
    fo = doc.get("failover")
    if fo:
        out.append({"target": f"failover p50 < {TARGET_FAILOVER_S:.0f} s",
                    "met": fo["p50_s"] < TARGET_FAILOVER_S,
                    "value": f"{fo['p50_s']:.3f} s (max {fo['max_s']:.3f} s)"})
    for c in doc.get("catchup") or []:
        full = c["keys"] >= TARGET_CATCHUP_KEYS
        finished = c["promoted_s"] is not None and c["caught_up_s"] is not None
        ok = finished and max(c["caught_up_s"], c["promoted_s"]) < TARGET_CATCHUP_S
        out.append({"target": f"learner catch-up of {TARGET_CATCHUP_KEYS:,} keys < "
                              f"{TARGET_CATCHUP_S:.0f} s ({c['mode']})"
                              + ("" if full else f" (ran {c['keys']:,} keys)"),
                    "met": ok,
                    "value": f"caught up {fmt(c['caught_up_s'], '.2f')} s, promoted "
                             f"{fmt(c['promoted_s'], '.2f')} s"
                             + ("" if finished else f" ({c['mode']})")})
    return out


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    bars = [(name, doc.get(k)) for name, k in (
        ("raftkv\nembedded", "raftkv_ops_s"), ("raftkv\nno fsync", "raftkv_nofsync_ops_s"),
        ("raftkv\nHTTP", "raftkv_http_ops_s"), ("PySyncObj\n(no fsync)", "pysyncobj_ops_s"),
        ("LMDB\nlimit", "lmdb_limit_ops_s"))]
    bars = [(n, v) for n, v in bars if v]
    fo = doc.get("failover")
    panels = int(bool(bars)) + int(bool(fo))
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax_i = 0
    if bars:
        ax = axes[0][ax_i]
        ax_i += 1
        ax.bar([n for n, _ in bars], [v for _, v in bars],
               color=["C0", "C0", "C0", "C3", "grey"][:len(bars)])
        ax.set_yscale("log")
        ax.set_ylabel("puts/s (log scale)")
        ax.set_title(f"{doc['nodes']} nodes, {doc['value_size']}-byte values, "
                     f"{doc['ops']:,} ops")
        for i, (_, v) in enumerate(bars):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize="small")
    if fo:
        ax = axes[0][ax_i]
        xs = range(1, len(fo["samples"]) + 1)
        ax.set_xticks(list(xs))
        ax.plot(xs, [s["failover_s"] for s in fo["samples"]], marker="o",
                label="first ack by the new leader")
        ax.plot(xs, [s["client_stall_s"] for s in fo["samples"]], marker="s", linestyle=":",
                label="continuous client's stall")
        ax.axhline(TARGET_FAILOVER_S, color="grey", linestyle="--", label="target 1 s")
        ax.set_xlabel("kill #")
        ax.set_ylabel("seconds after SIGKILL of the leader")
        ax.set_title("failover (tick 0.05 s, election 10 ticks)")
        ax.legend(fontsize="small")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput",
        description="Write throughput/latency of raftkv (embedded and HTTP) against PySyncObj "
                    "and the plain LMDB limit; failover time; learner catch-up time.",
    )
    p.add_argument("--nodes", type=int, default=3, help="nodes per group (default 3)")
    p.add_argument("--ops", type=int, default=50_000, help="puts per run (default 50,000)")
    p.add_argument("--value-size", type=int, default=100, help="value bytes (default 100)")
    p.add_argument("--window", type=int, default=1_000,
                   help="outstanding async puts, raftkv and PySyncObj (default 1,000)")
    p.add_argument("--repeat", type=int, default=1,
                   help="fresh-group runs of raftkv embedded and PySyncObj, alternating; "
                        "the median by ops/s is reported (default 1)")
    p.add_argument("--http-ops", type=int, default=None,
                   help="puts in the HTTP run (default: --ops)")
    p.add_argument("--http-clients", type=int, default=16,
                   help="concurrent HTTP clients, one connection each (default 16)")
    p.add_argument("--http-procs", type=int, default=2,
                   help="processes the HTTP clients are spread over (default 2)")
    p.add_argument("--failover", action="store_true", help="run the failover measurement")
    p.add_argument("--failover-repeats", type=int, default=5)
    p.add_argument("--catchup-keys", type=int, default=None,
                   help="run the learner catch-up with this many keys")
    p.add_argument("--catchup-batch", type=int, default=1000,
                   help="puts per log entry when loading the catch-up keys (default 1000)")
    p.add_argument("--catchup-snapshot", action="store_true",
                   help="force the snapshot path: tiny CompactionPolicy on the founders")
    p.add_argument("--catchup-both", action="store_true",
                   help="catch up twice: default compaction, then forced snapshot")
    p.add_argument("--all", action="store_true", help="throughput, failover and catch-up")
    p.add_argument("--skip", default="",
                   help="comma-separated parts to skip: embedded,nofsync,http,pysyncobj,lmdb")
    p.add_argument("--nofsync", action="store_true",
                   help="also run raftkv embedded with durable=False (the CPU-only share)")
    p.add_argument("--profile", action="store_true",
                   help="re-run the embedded load under cProfile and print the top functions")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--dir", default=None, help="parent of the temp dir (default /tmp)")
    p.add_argument("--tls", action="store_true",
                   help="runs 1 and 2 with TLS on every raftkv port (peer mTLS, HTTPS)")
    args = p.parse_args(argv)
    if (args.nodes < 1 or args.ops <= 0 or args.value_size < 10 or args.window <= 0
            or args.repeat < 1):
        p.error("--nodes, --ops, --window, --repeat must be positive, --value-size >= 10")

    selected = args.failover or args.catchup_keys is not None
    do_tp = args.all or not selected
    do_fo = args.all or args.failover or not selected
    do_cu = args.catchup_keys is not None or args.all
    catchup_keys = args.catchup_keys or TARGET_CATCHUP_KEYS
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    http_ops = args.http_ops or args.ops

    base = tempfile.mkdtemp(prefix="raftkv-throughput-", dir=args.dir or "/tmp")
    print(f"raftkv throughput: {args.nodes} nodes on 127.0.0.1, {args.ops:,} puts of "
          f"{args.value_size}-byte values, window {args.window:,}; files in {base}; Python "
          f"{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs",
          flush=True)
    t_all = time.perf_counter()
    doc: dict[str, Any] = {"nodes": args.nodes, "ops": args.ops, "value_size": args.value_size,
                           "window": args.window, "tls": args.tls}
    try:
        # raftkv and PySyncObj alternate, so that a change in the machine's background
        # load hits both alike; each sample is a fresh group; the median is reported.
        samples: dict[str, list[dict[str, Any]]] = {"embedded": [], "pysyncobj": []}
        for r in range(args.repeat if do_tp else 0):
            tag = f" [{r + 1}/{args.repeat}]" if args.repeat > 1 else ""
            if "embedded" not in skip:
                print(f"raftkv embedded (fsync on){tag} ...", flush=True)
                one = run_embedded(os.path.join(base, f"embedded{r}"), args.nodes, args.ops,
                                   args.window, args.value_size,
                                   args.profile and r == args.repeat - 1, tls=args.tls)
                samples["embedded"].append(one)
                print(f"  {one['ops_s']:,.0f} ops/s, p50 {one['p50_ms']:.1f} ms, p99 "
                      f"{one['p99_ms']:.1f} ms, {one['fsync']['count']:,} leader fsyncs, "
                      f"{one['errors']} errors", flush=True)
            if "pysyncobj" not in skip:
                print(f"PySyncObj 0.3.17{tag} ...", flush=True)
                ps = run_pysyncobj(os.path.join(base, f"pysyncobj{r}"), args.nodes,
                                   args.ops, args.window, args.value_size)
                samples["pysyncobj"].append(ps)
                print(f"  {ps['ops_s']:,.0f} ops/s, p50 {ps['p50_ms']:.1f} ms, p99 "
                      f"{ps['p99_ms']:.1f} ms, {ps['errors']} errors {ps['error_kinds']}",
                      flush=True)
        for name, runs in samples.items():
            if runs:
                med = sorted(runs, key=lambda x: x["ops_s"])[len(runs) // 2]
                doc[name] = {**med, "samples_ops_s": [x["ops_s"] for x in runs]}
        if do_tp and args.nofsync and "nofsync" not in skip:
            print("raftkv embedded (fsync off) ...", flush=True)
            doc["embedded_nofsync"] = run_embedded(
                os.path.join(base, "nofsync"), args.nodes, args.ops, args.window,
                args.value_size, False, durable=False)
            print(f"  {doc['embedded_nofsync']['ops_s']:,.0f} ops/s", flush=True)
        if do_tp and "http" not in skip:
            print(f"raftkv over HTTP ({args.http_clients} clients) ...", flush=True)
            doc["http"] = run_http(os.path.join(base, "http"), args.nodes, http_ops,
                                   args.http_clients, args.http_procs, args.value_size,
                                   tls=args.tls)
            print(f"  {doc['http']['ops_s']:,.0f} ops/s, p50 {doc['http']['p50_ms']:.1f} ms",
                  flush=True)
        if do_tp and "lmdb" not in skip:
            emb = doc.get("embedded")
            achieved = (emb["n"] / emb["fsync"]["count"]
                        if emb and emb["fsync"]["count"] else None)
            doc["lmdb"] = run_lmdb(base, args.ops, args.value_size, achieved)
        if do_fo:
            print(f"failover: {args.failover_repeats} leader kills ...", flush=True)
            doc["failover"] = run_failover(os.path.join(base, "failover"),
                                           args.failover_repeats, args.value_size)
        if do_cu:
            modes = [args.catchup_snapshot] if not args.catchup_both else [False, True]
            doc["catchup"] = []
            for i, snap in enumerate(modes):
                print(f"catch-up of {catchup_keys:,} keys"
                      f"{' (forced snapshot)' if snap else ''} ...", flush=True)
                doc["catchup"].append(run_catchup(
                    os.path.join(base, f"catchup{i}"), catchup_keys, args.catchup_batch,
                    args.value_size, snap))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    e, h, pso, lm = (doc.get("embedded"), doc.get("http"), doc.get("pysyncobj"),
                     doc.get("lmdb"))
    doc.update({
        "raftkv_ops_s": e["ops_s"] if e else None,
        "raftkv_http_ops_s": h["ops_s"] if h else None,
        "raftkv_nofsync_ops_s": (doc["embedded_nofsync"]["ops_s"]
                                 if doc.get("embedded_nofsync") else None),
        "pysyncobj_ops_s": pso["ops_s"] if pso else None,
        "lmdb_limit_ops_s": lm["ops_s"] if lm else None,
        "p50_ms": e["p50_ms"] if e else None,
        "p99_ms": e["p99_ms"] if e else None,
        "pysyncobj_p50_ms": pso["p50_ms"] if pso else None,
        "pysyncobj_p99_ms": pso["p99_ms"] if pso else None,
        "http_p50_ms": h["p50_ms"] if h else None,
        "http_p99_ms": h["p99_ms"] if h else None,
        "fsync": ({**e["fsync"], "ops_per_fsync": e["n"] / e["fsync"]["count"]
                   if e["fsync"]["count"] else None,
                   "followers": e["followers_fsync"], "http": h["fsync"] if h else None}
                  if e else None),
        "pysyncobj_fsync": False,
        "failover_p50_s": doc["failover"]["p50_s"] if doc.get("failover") else None,
        "failover_max_s": doc["failover"]["max_s"] if doc.get("failover") else None,
        # Until the learner has applied everything AND been promoted: the later of the two.
        "catchup_s": ({("snapshot" if c["forced_snapshot"] else "default"):
                       (max(c["caught_up_s"], c["promoted_s"])
                        if c["caught_up_s"] is not None and c["promoted_s"] is not None
                        else None) for c in doc["catchup"]}
                      if doc.get("catchup") else None),
    })
    doc["ratios"] = {
        "raftkv_over_pysyncobj": (doc["raftkv_ops_s"] / doc["pysyncobj_ops_s"]
                                  if e and pso else None),
        "raftkv_over_lmdb_limit": (doc["raftkv_ops_s"] / doc["lmdb_limit_ops_s"]
                                   if e and lm else None),
        "raftkv_http_over_pysyncobj": (doc["raftkv_http_ops_s"] / doc["pysyncobj_ops_s"]
                                       if h and pso else None),
    }
    doc["targets"] = targets(doc)
    doc["total_s"] = time.perf_counter() - t_all
    doc["machine"] = machine()

    print()
    print_table(doc)
    print()
    for t in doc["targets"]:
        print(f"[{verdict(t['met'])}] {t['target']}: {t['value']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json} (total {doc['total_s']:.0f} s)")
    plot(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
