"""The subprocess side of ``benchmarks.throughput``: one node, or one HTTP load client.

Three modes::

    python -m benchmarks._throughput_peer raftkv ID RAFT_ADDR DATA_DIR PEERS_JSON [options]
    python -m benchmarks._throughput_peer pysyncobj SELF_ADDR OTHER_ADDR,OTHER_ADDR
    python -m benchmarks._throughput_peer http ENDPOINT N THREADS VALUE_SIZE PREFIX START_AT

**raftkv** runs one embedded ``RaftKV`` node (LMDB under DATA_DIR, durable unless
``--no-fsync``; ``--join`` starts empty and waits for ``add_learner``; ``--compact-entries``
and ``--compact-keep`` set its CompactionPolicy). **pysyncobj** runs one PySyncObj 0.3.17
``SyncObj`` with a ``ReplDict`` consumer, configured with ``appendEntriesUseBatch=True``
and otherwise PySyncObj's defaults (auto tick thread, in-memory journal: no fsync, ever).

Both node modes then obey commands from the orchestrator, one JSON object per line on
stdin, and answer each with one JSON line on stdout (logging goes to stderr):

- ``{"cmd": "status"}``: role, leader, commit/applied indexes (raftkv: the group status).
- ``{"cmd": "load", "n", "window", "size", "prefix"}``: run on the leader. Issues ``n``
  asynchronous puts (raftkv ``put_async``; PySyncObj ``ReplDict.set(..., callback=)``)
  of ``size``-byte values with at most ``window`` outstanding, and reports ops/s, the
  per-op latency from submit to completion (p50/p99/mean/max, ms) and, for raftkv, what
  the driver reported meanwhile: fsyncs (count, latency), proposals per driver turn.
- ``{"cmd": "fill", "n", "batch", "window", "size"}`` (raftkv): load ``n`` keys with
  ``batch_async`` of ``batch`` puts per log entry, ``window`` batches outstanding.
- ``{"cmd": "add_learner", "id", "addr"}`` (raftkv, on the leader).
- ``{"cmd": "digest"}`` (raftkv): ``{"count", "digest", "applied"}`` of the local replica.
- ``{"cmd": "cpu"}``: this process's CPU seconds so far (user + system, all threads).
- ``{"cmd": "metrics"}`` (raftkv): this node's fsync count and latency so far.
- ``{"cmd": "profile_start"}`` / ``{"cmd": "profile_stop", "path"}`` (raftkv): cProfile
  the driver loop thread (enabled from inside it, through ``Node.call``) and this main
  thread; ``profile_stop`` dumps ``path.driver`` and ``path.client`` (pstats files).
- ``{"cmd": "quit"}``: close the node and exit.

**http** is one load-client process for the HTTP run: ``THREADS`` threads, each with its
own ``raftkv.client.Client`` (one kept-alive connection) to ENDPOINT, together doing N
sequential PUTs (keys ``PREFIX-<thread>-<i>``), starting at the wall-clock time
START_AT so that every client process starts together. It prints one JSON line with
every latency (ms), its start and end wall-clock times and the error count.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks._pysyncobj_peer import value

SECRET = b"raftkv-throughput-benchmark"


def percentiles(lat_ms: list[float]) -> dict[str, float | None]:
    """p50/p99/mean/max of a list of latencies (ms); Nones for an empty list."""
    if not lat_ms:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None, "max_ms": None}
    s = sorted(lat_ms)
    n = len(s)
    return {
        "p50_ms": s[min(n - 1, n // 2)],
        "p99_ms": s[min(n - 1, (n * 99) // 100)],
        "mean_ms": sum(s) / n,
        "max_ms": s[-1],
    }


def run_window(n: int, window: int, submit: Callable[[int, Callable[..., None]], None],
               fail: Callable[..., str | None], stall_s: float = 30.0) -> dict[str, Any]:
    """Issue ``n`` operations with at most ``window`` outstanding and time each one.

    ``submit(i, done)`` starts operation ``i``; whatever thread completes it calls
    ``done(*args)``, and ``fail(*args)`` names the failure (None: it succeeded). The completion side only
    stamps a time and appends to a deque (atomic under the GIL), so it adds almost
    nothing to the node's own thread; the submitting thread polls the deque's length.
    If nothing completes for ``stall_s`` seconds the run stops, and ``lost`` says how
    many operations never completed (their latency is not counted).
    """
    pc = time.perf_counter
    sub = [0.0] * n
    fin = [0.0] * n
    finished: deque[int] = deque()
    errors: deque[str] = deque()

    def done(i: int, *args: Any) -> None:
        fin[i] = pc()
        kind = fail(*args)
        if kind is not None:
            errors.append(kind)
        finished.append(i)

    sleep = time.sleep
    stalled = False

    def wait_below(limit: int) -> bool:
        """Wait until fewer than ``limit`` ops are outstanding; False if it stalled."""
        seen, since = len(finished), pc()
        while issued - len(finished) >= limit:
            sleep(0.0002)
            now_done = len(finished)
            if now_done != seen:
                seen, since = now_done, pc()
            elif pc() - since > stall_s:
                return False
        return True

    t0 = pc()
    issued = 0
    for i in range(n):
        if i - len(finished) >= window and not wait_below(window):
            stalled = True
            break
        sub[i] = pc()
        issued = i + 1
        submit(i, partial(done, i))
    if not stalled:
        stalled = not wait_below(1)
    got = list(finished)
    t1 = max((fin[i] for i in got), default=pc())
    lat = [(fin[i] - sub[i]) * 1000.0 for i in got]
    return {"n": n, "window": window, "seconds": t1 - t0,
            "ops_s": (len(got) - len(errors)) / (t1 - t0),  # acknowledged successes only
            "errors": len(errors), "error_kinds": dict(Counter(errors)), "issued": issued, "lost": issued - len(got),
            "stalled": stalled, **percentiles(lat)}


def answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def cpu() -> dict[str, float]:
    """This process's CPU seconds so far (every thread, user + system)."""
    t = os.times()
    return {"cpu_s": t.user + t.system}


def commands() -> Any:
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


# -- raftkv -----------------------------------------------------------------------------
class CountingMetrics:
    """``raftkv.node.driver.Metrics`` that keeps every observation (benchmark only)."""

    def __init__(self) -> None:
        self.fsyncs: list[float] = []
        self.proposal_batches: list[int] = []
        self.leader_changes = 0

    def fsync(self, group: str, seconds: float) -> None:
        self.fsyncs.append(seconds)

    def proposals(self, group: str, n: int) -> None:
        self.proposal_batches.append(n)

    def leader_change(self, group: str) -> None:
        self.leader_changes += 1

    def group_removed(self, group: str) -> None:
        pass

    def mark(self) -> tuple[int, int]:
        return len(self.fsyncs), len(self.proposal_batches)

    def since(self, mark: tuple[int, int]) -> dict[str, Any]:
        fs = [s * 1000.0 for s in self.fsyncs[mark[0]:]]
        pb = self.proposal_batches[mark[1]:]
        pct = percentiles(fs)
        return {
            "count": len(fs),
            "total_s": sum(fs) / 1000.0,
            "p50_ms": pct["p50_ms"], "p99_ms": pct["p99_ms"], "mean_ms": pct["mean_ms"],
            "max_ms": pct["max_ms"],
            "proposal_turns": len(pb),
            "proposals": sum(pb),
            "proposals_per_turn": (sum(pb) / len(pb)) if pb else None,
        }


def raftkv_node(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="_throughput_peer raftkv")
    p.add_argument("id")
    p.add_argument("raft_addr")
    p.add_argument("data_dir")
    p.add_argument("peers_json")
    p.add_argument("--join", action="store_true")
    p.add_argument("--no-fsync", action="store_true")
    p.add_argument("--compact-entries", type=int, default=None)
    p.add_argument("--compact-keep", type=int, default=None)
    p.add_argument("--tls-dir", default=None,
                   help="peer mTLS with <id>.pem, <id>-key.pem and ca.pem from this directory")
    args = p.parse_args(argv)

    from raftkv.recovery.compaction import CompactionPolicy

    from raftkv.kv import RaftKV
    from raftkv.tls import TlsConfig

    policy = None
    if args.compact_entries is not None or args.compact_keep is not None:
        d = CompactionPolicy()
        policy = CompactionPolicy(
            max_entries=args.compact_entries if args.compact_entries is not None
            else d.max_entries,
            keep=args.compact_keep if args.compact_keep is not None else d.keep,
        )
    metrics = CountingMetrics()
    peers = json.loads(args.peers_json)
    d = args.tls_dir
    tls = (TlsConfig(f"{d}/{args.id}.pem", f"{d}/{args.id}-key.pem", f"{d}/ca.pem",
                     client_cert_auth=True) if d else None)
    kv = RaftKV(args.id, args.raft_addr, peers, SECRET, data_dir=args.data_dir,
                durable=not args.no_fsync, join=args.join, metrics=metrics,
                compaction=policy, peer_tls=tls)
    answer({"ready": True, "id": args.id})
    profs: tuple[cProfile.Profile, cProfile.Profile] | None = None
    try:
        for c in commands():
            cmd = c["cmd"]
            if cmd == "quit":
                answer({"bye": True})
                break
            try:
                profs = raftkv_command(kv, metrics, c, profs)
            except Exception as e:  # noqa: BLE001 - the orchestrator decides what it means
                answer({"error": f"{type(e).__name__}: {e}"})
    finally:
        kv.close()
    return 0


def raftkv_command(kv: Any, metrics: CountingMetrics, c: dict[str, Any],
                   profs: tuple[cProfile.Profile, cProfile.Profile] | None
                   ) -> tuple[cProfile.Profile, cProfile.Profile] | None:
    """Run one command and answer it; returns the profilers in use, if any."""
    cmd = c["cmd"]
    if cmd == "status":
        answer(raftkv_status(kv))
    elif cmd == "wait_leader":
        answer({"leader": kv.wait_for_leader(timeout=c.get("timeout", 20.0))})
    elif cmd == "load":
        answer(raftkv_load(kv, metrics, c["n"], c["window"], c["size"], c["prefix"]))
    elif cmd == "fill":
        answer(raftkv_fill(kv, c["n"], c["batch"], c["window"], c["size"]))
    elif cmd == "add_learner":
        t0 = time.time()
        index = kv.add_learner(c["id"], c["addr"])
        answer({"index": index, "t_call": t0, "t_done": time.time()})
    elif cmd == "cpu":
        answer(cpu())
    elif cmd == "digest":
        answer(kv.digest(stale=True))
    elif cmd == "metrics":
        answer(metrics.since((0, 0)))
    elif cmd == "profile_start":
        driver, client = cProfile.Profile(), cProfile.Profile()
        kv.node.call(driver.enable).result(timeout=10)
        client.enable()
        profs = (driver, client)
        answer({"profiling": True})
    elif cmd == "profile_stop":
        if profs is None:
            answer({"error": "not profiling"})
            return None
        driver, client = profs
        client.disable()
        kv.node.call(driver.disable).result(timeout=10)
        driver.dump_stats(c["path"] + ".driver")
        client.dump_stats(c["path"] + ".client")
        profs = None
        answer({"driver": c["path"] + ".driver", "client": c["path"] + ".client"})
    else:
        answer({"error": f"unknown command {cmd!r}"})
    return profs


def raftkv_status(kv: Any) -> dict[str, Any]:
    st = kv.status()
    g = st["groups"][kv.group]
    return {"id": st["id"], "role": g["role"], "leader": g["leader"], "term": g["term"],
            "commit": g["commit"], "applied": g["applied"], "last_index": g["last_index"],
            "first_index": g["first_index"], "checkpoint": g["checkpoint"],
            "members": g["members"], "peers": g["peers"], "recovery": g["recovery"],
            "t": time.time()}


def raftkv_load(kv: Any, metrics: CountingMetrics, n: int, window: int, size: int,
                prefix: str) -> dict[str, Any]:
    keys = [b"%s%08d" % (prefix.encode(), i) for i in range(n)]
    vals = [value(i, size) for i in range(n)]
    put_async = kv.put_async

    def submit(i: int, done: Callable[..., None]) -> None:
        put_async(keys[i], vals[i]).add_done_callback(done)

    def fail(fut: Any) -> str | None:
        exc = fut.exception()
        return None if exc is None else type(exc).__name__

    mark = metrics.mark()
    out = run_window(n, window, submit, fail)
    out["fsync"] = metrics.since(mark)
    return out


def raftkv_fill(kv: Any, n: int, batch: int, window: int, size: int) -> dict[str, Any]:
    """Load keys k00000000.. with one ``batch_async`` of ``batch`` puts per log entry."""
    starts = list(range(0, n, batch))
    batch_async = kv.batch_async

    def submit(j: int, done: Callable[..., None]) -> None:
        lo = starts[j]
        ops = [(b"k%08d" % i, value(i, size)) for i in range(lo, min(lo + batch, n))]
        batch_async(ops).add_done_callback(done)

    def fail(fut: Any) -> str | None:
        exc = fut.exception()
        return None if exc is None else type(exc).__name__

    out = run_window(len(starts), window, submit, fail)
    return {"keys": n, "entries": len(starts), "seconds": out["seconds"],
            "keys_s": n / out["seconds"], "errors": out["errors"]}


# -- PySyncObj --------------------------------------------------------------------------
def pysyncobj_node(argv: list[str]) -> int:
    self_addr, others = argv[0], [a for a in argv[1].split(",") if a]
    from pysyncobj import SyncObj, SyncObjConf
    from pysyncobj.batteries import ReplDict

    d = ReplDict()
    node = SyncObj(self_addr, others, SyncObjConf(appendEntriesUseBatch=True), consumers=[d])
    answer({"ready": True, "id": self_addr})
    try:
        for c in commands():
            cmd = c["cmd"]
            if cmd == "quit":
                answer({"bye": True})
                break
            if cmd in ("status", "wait_leader"):
                deadline = time.monotonic() + c.get("timeout", 20.0)
                while cmd == "wait_leader" and node._getLeader() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                st = node.getStatus()
                lead = node._getLeader()
                answer({"id": self_addr, "leader": None if lead is None else str(lead.address
                        if hasattr(lead, "address") else lead),
                        "role": "leader" if node._isLeader() else "follower",
                        "commit": st.get("commit_idx"), "applied": st.get("last_applied"),
                        "keys": len(d)})
            elif cmd == "cpu":
                answer(cpu())
            elif cmd == "load":
                answer(pysyncobj_load(d, c["n"], c["window"], c["size"], c["prefix"]))
            else:
                answer({"error": f"unknown command {cmd!r}"})
    finally:
        node.destroy()
    return 0


def pysyncobj_load(d: Any, n: int, window: int, size: int, prefix: str) -> dict[str, Any]:
    """``ReplDict.set`` with ``callback=`` (asynchronous), at most ``window`` outstanding."""
    from pysyncobj import FAIL_REASON

    keys = [b"%s%08d" % (prefix.encode(), i) for i in range(n)]
    vals = [value(i, size) for i in range(n)]
    setter = d.set
    reasons = {v: k for k, v in vars(FAIL_REASON).items() if k.isupper()}

    def submit(i: int, done: Callable[..., None]) -> None:
        setter(keys[i], vals[i], callback=done)

    def fail(_res: Any, err: Any) -> str | None:
        return None if err == FAIL_REASON.SUCCESS else reasons.get(err, str(err))

    return run_window(n, window, submit, fail)


# -- HTTP load client ---------------------------------------------------------------------
def http_client(argv: list[str]) -> int:
    """``http ENDPOINTS(comma) TABLE|- N THREADS SIZE PREFIX START_AT [BATCH]``: sequential
    PUTs per thread (thread t on endpoint t mod len), into TABLE or the default group;
    with BATCH > 1 (a table), each thread gathers its keys per partition and sends each
    partition's BATCH keys as one partition batch (its latencies are per batch)."""
    eps, table, n, threads, size, prefix, start_at, *rest = argv
    batch = int(rest[0]) if rest else 1
    endpoints = eps.split(",")
    tbl = None if table == "-" else table
    n_total, n_threads, vsize = int(n), int(threads), int(size)
    from raftkv.client import Client

    per = [n_total // n_threads + (1 if t < n_total % n_threads else 0)
           for t in range(n_threads)]
    lats: list[list[float]] = [[] for _ in range(n_threads)]
    errors = [0] * n_threads
    done = [0] * n_threads
    clients = [Client([endpoints[t % len(endpoints)]], timeout=30.0) for t in range(n_threads)]
    for c in clients:  # open the kept-alive connection before the clock starts
        c.request("GET", "/health")
    barrier = threading.Barrier(n_threads + 1)

    parts = len(clients[0].describe_table(tbl)["partitions"]) if batch > 1 and tbl else 0

    def work(t: int) -> None:
        c, out = clients[t], lats[t]
        keys = [f"{prefix}-{t}-{i:08d}" for i in range(per[t])]
        vals = [value(i, vsize) for i in range(per[t])]
        pc = time.perf_counter
        if parts:
            from raftkv.placement.assignments import partitions_of

            by: dict[int, list[tuple[bytes, bytes | None]]] = {}
            for k, v, p in zip(keys, vals, partitions_of([k.encode() for k in keys], parts),
                               strict=True):
                by.setdefault(p, []).append((k.encode(), v))
            jobs = [(p, ops[i:i + batch]) for p, ops in sorted(by.items())
                    for i in range(0, len(ops), batch)]
            barrier.wait()
            for j, (p, ops) in enumerate(jobs):
                t0 = pc()
                try:
                    assert tbl is not None
                    c.partition_batch(tbl, p, ops, batch_id=f"{prefix}-{t}-{j}".encode())
                except Exception:  # noqa: BLE001 - counted, the run goes on
                    errors[t] += len(ops)
                    continue
                out.append((pc() - t0) * 1000.0)
                done[t] += len(ops)
            return
        barrier.wait()
        for k, v in zip(keys, vals):
            t0 = pc()
            try:
                c.put(k, v, table=tbl)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors[t] += 1
                continue
            out.append((pc() - t0) * 1000.0)
            done[t] += 1

    ths = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(n_threads)]
    for th in ths:
        th.start()
    time.sleep(max(0.0, float(start_at) - time.time()))
    t_start = time.time()
    barrier.wait()
    for th in ths:
        th.join()
    t_end = time.time()
    for c in clients:
        c.close()
    answer({"t_start": t_start, "t_end": t_end, "errors": sum(errors), "ops": sum(done),
            "lat_ms": [round(x, 3) for lat in lats for x in lat]})
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not argv:
        raise SystemExit("usage: _throughput_peer raftkv|pysyncobj|http ...")
    mode, rest = argv[0], argv[1:]
    if mode == "raftkv":
        return raftkv_node(rest)
    if mode == "pysyncobj":
        return pysyncobj_node(rest)
    if mode == "http":
        return http_client(rest)
    raise SystemExit(f"unknown mode {mode!r} (raftkv, pysyncobj or http)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
