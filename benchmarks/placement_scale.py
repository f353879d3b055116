"""Tables at scale: one table of many partitions on 3 ``raftkv serve`` processes.

What is measured (all on 127.0.0.1, every node its own process, fsync on)
------------------------------------------------------------------------
1. **Setup**: a ``ProcCluster`` of 3 nodes (each also hosting the metastore), then
   ``create_table(--partitions P, --replicas R)``. ``setup_s`` is the time from the
   create request until ``describe_table`` reports a leader for every partition.
2. **Idle CPU**: no client load, ``--idle`` seconds; each node's utime+stime from
   ``/proc/<pid>/stat`` over that span, as % of one core. Target < 10% per node. If a
   node is above it, ``py-spy record`` (``--pyspy``, default /tmp/pyspy/bin/py-spy)
   samples that node for ``--profile-s`` seconds and the top functions by own and by
   inclusive samples are printed (idle threads parked in ``select``/``wait`` are left out
   of "own" by py-spy's default ``--idle`` off).
3. **Throughput**: the same ``--ops`` N PUTs (distinct keys, ``--value-size`` bytes)
   from ``--clients`` threads in ``--procs`` client processes (each thread a
   ``raftkv.client.Client`` on one kept-alive connection, sequential PUTs): once on the
   default ``/v1/kv`` group (every thread on its leader, its best case) and once on the
   table (``/v1/tables/{t}/kv/{key}``; threads spread over the 3 nodes; every node hosts
   every partition when R = 3 on 3 nodes, and the driver forwards a proposal to the
   partition's leader). ops/s over the wall-clock span; ratio table / default. Both use
   single PUTs, the hardest case for a table: the default group folds the concurrent
   clients' PUTs into one entry (one message per follower, one apply) per loop turn,
   while a table's land in different groups, each with its own entry, messages and
   apply; only the log commit is shared (``raftkv.storage.lmdb_log.LogEnv``). Bulk writes have
   ``POST /v1/tables/{t}/batch``. This runs on the 3 founders, before step 4, so both
   sides have the same 3 replicas. The default ``--ops`` keeps each run going for
   at least two partition checkpoint intervals (``PARTITION_CHECKPOINT_SECONDS``, 10 s), so
   the table's figure pays its steady-state checkpoints rather than finishing first.
4. **Rebalance**: ``add_table_node("n4")``; ``rebalance_s`` is the time until, for every
   partition p, ``stable == calc_assignments(table, p, [n1..n4], R)`` and ``pending`` is
   empty (``describe_table`` polled every ``--poll`` s; the progress is in the JSON).
   ``--rebalance-timeout`` caps it: a rebalance not done by then is reported with the
   count converged so far.

Usage::

    python -m benchmarks.placement_scale [--partitions 256] [--replicas 3] [--idle 20]
        [--ops 30000] [--clients 16] [--procs 2] [--value-size 100]
        [--setup-timeout 600] [--rebalance-timeout 900] [--no-profile]
        [--json FILE] [--dir DIR]

Results: a table on stdout, ``--json`` (default
``benchmarks/results/placement_scale_<P>.json``) and a PNG next to it (rebalance
progress and idle CPU) if matplotlib is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks._plot import pyplot
from benchmarks._throughput_peer import percentiles
from benchmarks.recovery import machine, value, verdict
from benchmarks.throughput import PEER, ROOT, fmt
from raftkv.client import Client
from raftkv.placement.assignments import calc_assignments
from raftkv.testing.procs import ProcCluster

RESULTS = Path(__file__).resolve().parent / "results"
TABLE = "bench"
TARGET_IDLE_PCT = 10.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- process CPU -----------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """utime+stime of a process (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15 of stat(5)


def threads_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def pids(cluster: ProcCluster) -> dict[str, int]:
    return {nid: n.proc.pid for nid, n in cluster.nodes.items() if n.proc and n.alive}


def measure_cpu(cluster: ProcCluster, seconds: float) -> dict[str, Any]:
    ps = pids(cluster)
    c0 = {nid: cpu_s(p) for nid, p in ps.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    out = {nid: {"cpu_s": cpu_s(p) - c0[nid], "threads": threads_of(p)} for nid, p in ps.items()}
    for v in out.values():
        v["pct_one_core"] = v["cpu_s"] / wall * 100.0
    return {"seconds": wall, "nodes": out, "loadavg_1m": os.getloadavg()[0]}


# -- describe helpers ----------------------------------------------------------------------
def describe(c: Client) -> dict[str, Any] | None:
    try:
        return c.describe_table(TABLE)
    except Exception:  # noqa: BLE001 - a node busy or restarting: poll again
        return None


def with_leader(d: dict[str, Any]) -> int:
    return sum(1 for p in d["partitions"] if p.get("leader"))


def converged(d: dict[str, Any], nodes: list[str], replicas: int) -> int:
    n = 0
    for p in d["partitions"]:
        want = calc_assignments(TABLE, p["partition"], nodes, replicas)
        if sorted(p.get("stable") or []) == want and not p.get("pending"):
            n += 1
    return n


def wait_for(c: Client, count: Any, total: int, timeout: float, poll: float
             ) -> tuple[float | None, list[tuple[float, int]], dict[str, Any] | None]:
    """Poll describe until ``count(d) == total``: (seconds or None, progress, last)."""
    t0 = time.monotonic()
    progress: list[tuple[float, int]] = []
    last = None
    while True:
        d = describe(c)
        now = time.monotonic() - t0
        if d is not None:
            last = d
            k = count(d)
            progress.append((round(now, 2), k))
            if k == total:
                return now, progress, last
        if now > timeout:
            return None, progress, last
        time.sleep(poll)


def run_load(cluster: ProcCluster, endpoints: list[str], table: str | None, n: int,
             clients: int, procs: int, size: int, prefix: str) -> dict[str, Any]:
    procs = max(1, min(procs, clients))
    threads = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    ops = [n * t // clients for t in threads]
    ops[0] += n - sum(ops)
    start_at = time.time() + 1.5 + 0.2 * procs
    ps = pids(cluster)
    children = []
    for i in range(procs):
        # rotate the endpoint list per process so threads spread over every node
        eps = endpoints[i % len(endpoints):] + endpoints[:i % len(endpoints)]
        children.append(subprocess.Popen(
            [sys.executable, "-m", PEER, "http", ",".join(eps), table or "-",
             str(ops[i]), str(threads[i]), str(size), f"{prefix}{i}", repr(start_at)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    time.sleep(max(0.0, start_at - time.time()))
    c0 = {nid: cpu_s(p) for nid, p in ps.items()}
    outs = []
    for ch in children:
        stdout, stderr = ch.communicate()
        if ch.returncode != 0:
            raise RuntimeError(f"load client failed ({ch.returncode}):\n{stderr[-3000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    cpu = {nid: cpu_s(p) - c0[nid] for nid, p in ps.items()}
    lat = [x for o in outs for x in o["lat_ms"]]
    span = max(o["t_end"] for o in outs) - min(o["t_start"] for o in outs)
    return {"target": f"table {table}" if table else "default /v1/kv", "n": n,
            "clients": clients, "client_procs": procs, "endpoints": endpoints,
            "seconds": span, "ops_s": len(lat) / span,
            "errors": sum(o["errors"] for o in outs), **percentiles(lat),
            "node_cpu_s": cpu}


# -- profiling an idle node ----------------------------------------------------------------
def profile_idle(pyspy: str, pid: int, seconds: float, out: str) -> dict[str, Any]:
    if not os.path.exists(pyspy):
        return {"error": f"{pyspy} not found"}
    raw = out + ".txt"
    cmd = [pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
           "--rate", "200", "--format", "raw", "--output", raw, "--nonblocking"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(raw):
        return {"error": (r.stderr or r.stdout)[-2000:], "cmd": " ".join(cmd)}
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            k = int(count)
            total += k
            frames = stack.split(";")
            threads[frames[0]] += k
            own[frames[-1]] += k
            for fr in set(frames[1:]):
                incl[fr] += k
    return {"samples": total, "seconds": seconds, "rate": 200, "raw": raw,
            "own": own.most_common(25), "inclusive": incl.most_common(40),
            "threads": threads.most_common(20)}


# -- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"partitions": args.partitions, "replicas": args.replicas,
                           "value_size": args.value_size, **machine()}
    cluster = ProcCluster(base, size=3, faults=False, extra_args=["--log-level", "WARNING"])
    with cluster:
        t0 = time.monotonic()
        cluster.start()
        lead = cluster.wait_leader()
        doc["cluster_start_s"] = time.monotonic() - t0
        c = cluster.client(timeout=60.0)
        # the metastore may still be electing: retry the create
        t_create = time.monotonic()
        deadline = t_create + 60
        while True:
            try:
                c.create_table(TABLE, args.partitions, args.replicas)
                break
            except Exception as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"create_table failed: {e}") from e
                time.sleep(0.2)
        doc["create_call_s"] = time.monotonic() - t_create
        setup_s, prog, last = wait_for(
            c, with_leader, args.partitions, args.setup_timeout, args.poll)
        setup_s = None if setup_s is None else setup_s + doc["create_call_s"]
        doc["setup"] = {"seconds": setup_s, "progress": prog,
                        "with_leader": with_leader(last) if last else 0,
                        "leaders_per_node": dict(Counter(
                            p["leader"] for p in (last or {"partitions": []})["partitions"]
                            if p.get("leader")))}
        print(f"setup: every partition has a leader after {fmt(setup_s, '.2f')} s "
              f"({doc['setup']['with_leader']}/{args.partitions})", flush=True)

        time.sleep(args.settle)
        idle = measure_cpu(cluster, args.idle)
        doc["idle"] = idle
        print("idle CPU (% of one core): " + ", ".join(
            f"{nid} {v['pct_one_core']:.1f}% ({v['threads']} threads)"
            for nid, v in idle["nodes"].items()), flush=True)
        worst = max(idle["nodes"].items(), key=lambda kv: kv[1]["pct_one_core"])
        if worst[1]["pct_one_core"] >= TARGET_IDLE_PCT and args.profile:
            pid = cluster.nodes[worst[0]].proc.pid  # type: ignore[union-attr]
            doc["idle_profile"] = {"node": worst[0], **profile_idle(
                args.pyspy, pid, args.profile_s,
                os.path.join(str(args.json.parent), f"placement_scale_{args.partitions}_"
                             f"pyspy_{worst[0]}"))}
        if args.idle_only:
            # Setup and idle CPU only: the quick loop for tuning idle cost.
            c.close()
            cluster.close()
            return doc

        # throughput: default group (on its leader) vs the table (spread over the nodes)
        eps = [cluster.nodes[i].endpoint for i in ("n1", "n2", "n3")]
        warm = Client([cluster.nodes[lead].endpoint])
        for i in range(50):
            warm.put(f"warm-{i}", value(i, args.value_size))
            warm.put(f"warm-{i}", value(i, args.value_size), table=TABLE)
        warm.close()
        lead = cluster.wait_leader()
        doc["load_default"] = run_load(cluster, [cluster.nodes[lead].endpoint], None,
                                       args.ops, args.clients, args.procs, args.value_size, "d")
        print(f"default group: {doc['load_default']['ops_s']:,.0f} ops/s", flush=True)
        doc["load_table"] = run_load(cluster, eps, TABLE, args.ops, args.clients, args.procs,
                                     args.value_size, "t")
        print(f"table ({args.partitions} partitions): "
              f"{doc['load_table']['ops_s']:,.0f} ops/s", flush=True)

        # rebalance onto a 4th node
        ps = pids(cluster)
        c0 = {nid: cpu_s(p) for nid, p in ps.items()}
        nodes4 = ["n1", "n2", "n3", "n4"]
        t_add = time.monotonic()
        cluster.add_table_node("n4")
        add_call = time.monotonic() - t_add
        moved = sum(1 for p in range(args.partitions)
                    if calc_assignments(TABLE, p, nodes4, args.replicas)
                    != calc_assignments(TABLE, p, nodes4[:3], args.replicas))
        rb_s, prog, last = wait_for(
            c, lambda d: converged(d, nodes4, args.replicas), args.partitions,
            args.rebalance_timeout, args.poll)
        wall = time.monotonic() - t_add
        cpu = {nid: cpu_s(p) - c0[nid] for nid, p in ps.items()}
        doc["rebalance"] = {
            "seconds": None if rb_s is None else rb_s + add_call, "add_call_s": add_call,
            "partitions_moving": moved, "progress": prog,
            "converged": converged(last, nodes4, args.replicas) if last else 0,
            "errors": (last or {}).get("errors", [])[:20],
            "cpu_pct_one_core": {nid: v / wall * 100.0 for nid, v in cpu.items()},
        }
        print(f"rebalance: {doc['rebalance']['converged']}/{args.partitions} converged after "
              f"{wall:.1f} s ({moved} partitions gain n4)", flush=True)
        if rb_s is not None and args.idle_after > 0:
            time.sleep(args.settle)
            doc["idle_after"] = measure_cpu(cluster, args.idle_after)
        c.close()
        cluster.close()
    return doc


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    worst = max(v["pct_one_core"] for v in doc["idle"]["nodes"].values())
    out.append({"target": f"idle CPU < {TARGET_IDLE_PCT:.0f}% of a core per node",
                "met": worst < TARGET_IDLE_PCT, "value": f"worst {worst:.1f}%"})
    if "ratios" not in doc:
        return out  # --idle-only
    r = doc["ratios"]["table_over_default"]
    out.append({"target": "across-partitions ops/s >= single group", "met": r >= 1.0,
                "value": f"{r:.2f}x ({doc['load_table']['ops_s']:,.0f} vs "
                         f"{doc['load_default']['ops_s']:,.0f} ops/s)"})
    return out


def print_table(doc: dict[str, Any]) -> None:
    P = doc["partitions"]
    print(f"\n== {P} partitions x {doc['replicas']} replicas on 3 nodes "
          f"({doc['cpu_count']} CPUs) ==")
    rows = [
        ("cluster start (3 nodes, default leader)", fmt(doc["cluster_start_s"], ".2f") + " s"),
        ("setup: create -> every partition led", fmt(doc["setup"]["seconds"], ".2f") + " s"
         f" ({doc['setup']['with_leader']}/{P}; leaders per node "
         f"{doc['setup']['leaders_per_node']})"),
    ]
    for nid, v in doc["idle"]["nodes"].items():
        rows.append((f"idle CPU {nid} ({doc['idle']['seconds']:.0f} s)",
                     f"{v['pct_one_core']:.1f}% of a core, {v['threads']} threads"))
    for nid, v in (doc.get("idle_after") or {}).get("nodes", {}).items():
        rows.append((f"idle CPU {nid} after rebalance", f"{v['pct_one_core']:.1f}% of a core"))
    for k in ("load_default", "load_table"):
        if k not in doc:
            continue  # --idle-only
        x = doc[k]
        rows.append((f"PUT {x['target']}",
                     (f"{x['ops_s']:,.0f} ops/s, p50 {fmt(x['p50_ms'], '.1f')} ms, p99 "
                     f"{fmt(x['p99_ms'], '.1f')} ms, {x['errors']} errors, "
                     f"{x['clients']} clients / {x['client_procs']} procs")))
    if "ratios" in doc:
        rows.append(("ratio table / default", f"{doc['ratios']['table_over_default']:.2f}"))
    rb = doc.get("rebalance")
    if rb is not None:
        rows.append(("rebalance: add n4 -> converged",
                     fmt(rb["seconds"], ".2f") + f" s ({rb['converged']}/{P} converged; "
                     f"{rb['partitions_moving']} gain n4; add call {rb['add_call_s']:.2f} s)"))
        rows.append(("CPU during rebalance", ", ".join(
            f"{n} {v:.0f}%" for n, v in rb["cpu_pct_one_core"].items())))
    w = max(len(r[0]) for r in rows)
    for a, b in rows:
        print(f"{a:<{w}}  {b}")
    prof = doc.get("idle_profile")
    if prof:
        print(f"\npy-spy on idle {prof['node']}:")
        if "error" in prof:
            print("  failed: " + prof["error"])
        else:
            tot = max(prof["samples"], 1)
            print(f"  {prof['samples']} samples ({prof['rate']}/s x {prof['seconds']} s, "
                  "non-idle threads only)")
            print("  by thread:")
            for fr, k in prof["threads"][:10]:
                print(f"    {k / tot:6.1%}  {fr}")
            print("  own (leaf frame):")
            for fr, k in prof["own"][:15]:
                print(f"    {k / tot:6.1%}  {fr}")
            print("  inclusive:")
            for fr, k in prof["inclusive"][:25]:
                print(f"    {k / tot:6.1%}  {fr}")
    if rb is not None and rb["errors"]:
        print(f"\nrebalance errors reported by describe (first {len(rb['errors'])}):")
        for e in rb["errors"][:5]:
            print("  ", e)
    print()
    for t in doc["targets"]:
        print(f"{verdict(t['met'])}: {t['target']}: {t['value']}")


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    P = doc["partitions"]
    for key, label in (("setup", "partitions with a leader (setup)"),
                       ("rebalance", "partitions converged (after adding n4)")):
        if key not in doc:
            continue  # --idle-only
        pr = doc[key]["progress"]
        axes[0].plot([t for t, _ in pr], [k for _, k in pr], label=label)
    axes[0].axhline(P, color="grey", lw=0.5)
    axes[0].set_xlabel("seconds")
    axes[0].set_ylabel("partitions")
    axes[0].set_title(f"{P} partitions x {doc['replicas']}")
    axes[0].legend(fontsize=8)
    idle = doc["idle"]["nodes"]
    axes[1].bar(list(idle), [v["pct_one_core"] for v in idle.values()])
    axes[1].axhline(TARGET_IDLE_PCT, color="C3", ls="--", label="target")
    axes[1].set_ylabel("% of one core")
    axes[1].set_title(f"idle CPU over {doc['idle']['seconds']:.0f} s")
    axes[1].legend(fontsize=8)
    if "load_default" not in doc:  # --idle-only
        axes[2].set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        print(f"plot: {path}")
        return
    axes[2].bar(["default group", f"table ({P} parts)"],
                [doc["load_default"]["ops_s"], doc["load_table"]["ops_s"]], color=["C0", "C1"])
    axes[2].set_ylabel("PUTs/s")
    axes[2].set_title(f"{doc['load_default']['n']:,} PUTs, {doc['load_default']['clients']} "
                      "clients")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.placement_scale")
    p.add_argument("--partitions", type=int, default=256)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--idle", type=float, default=20.0, help="idle CPU window, seconds")
    p.add_argument("--idle-after", type=float, default=10.0,
                   help="idle CPU window on 4 nodes after the rebalance (0: skip)")
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--ops", type=int, default=30000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--setup-timeout", type=float, default=600.0)
    p.add_argument("--rebalance-timeout", type=float, default=900.0)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--profile-s", type=float, default=10.0)
    p.add_argument("--pyspy", default="/tmp/pyspy/bin/py-spy")
    p.add_argument("--idle-only", action="store_true",
                   help="stop after setup and the idle CPU window (no load, no rebalance)")
    p.add_argument("--json", type=Path)
    p.add_argument("--dir", help="keep the data dirs here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = RESULTS / f"placement_scale_{args.partitions}.json"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    base = args.dir or tempfile.mkdtemp(prefix="raftkv-placement-")
    t_all = time.perf_counter()
    try:
        doc = run(args, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if "load_table" in doc:
        doc["ratios"] = {"table_over_default":
                         doc["load_table"]["ops_s"] / doc["load_default"]["ops_s"]}
    doc["targets"] = targets(doc)
    doc["total_s"] = time.perf_counter() - t_all
    print_table(doc)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"json: {args.json}")
    plot(args.json.with_suffix(".png"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
