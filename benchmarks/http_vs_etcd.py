"""The served KV against etcd on the same machine, under the same ``wrk`` load.

What is measured (3 nodes of each system on 127.0.0.1, both fsyncing, one after the other
in the same run, each at its own defaults)
----------------------------------------------------------------------------------------
1. **Writes**: ``wrk`` with ``--conns`` connections (16 and 64 by default) to the leader,
   each request a PUT of a unique key (``k-<thread>-<n>``) with a 100-byte value, for
   ``--seconds``. raftkv: ``PUT /v1/kv/{key}``; etcd 3.4 (Debian's ``etcd-server``): its
   v3 JSON gateway's ``POST /v3/kv/put``, the HTTP API an etcd user without a gRPC
   client has. requests/s, p50 and p99 from wrk; non-2xx answers are counted as errors.
   **CPU per request**: the leader process's user + system CPU time (``/proc/PID/stat``,
   every thread) over the run, divided by the requests answered.
2. **Linearizable reads**: the same with GETs of 1,000 preloaded keys (raftkv
   ``GET /v1/kv/{key}``, linearizable by default; etcd ``POST /v3/kv/range``, also
   linearizable by default).
3. **Tables** (raftkv only): ``--table-clients`` Python client threads (in 2 processes,
   ``raftkv.client.Client``, partition-aware: each write goes to its partition's leader)
   doing single PUTs, first into the default group, then into a fresh table of
   ``--partitions`` x 3. The CPU of all three nodes per write, and the throughput, table
   against default group; then the same clients batching per partition (``TABLE_BATCH``
   keys per partition batch, one Raft entry each). How many partition leaders each node
   holds is reported when the table run starts. **Disk bytes per write**: what the three
   nodes wrote to storage (``/proc/PID/io`` ``write_bytes``, counted when a page is
   dirtied, so an LMDB commit's pages count even before a checkpoint flushes them), over
   the writes: the write amplification of a 100-byte PUT, log and state stores together.

TLS is off (``--tls`` turns it on for raftkv's rows; etcd stays plain). etcd and wrk come
from Debian's packages: when either is missing, the script installs it with ``apt-get``
if it runs as root, else says how, and skips what needs it.

Prints a table, writes ``benchmarks/results/http_vs_etcd.json`` and ``http_vs_etcd.png``.

Usage::

    python -m benchmarks.http_vs_etcd [--seconds 10] [--conns 16,64] [--partitions 256]
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
from benchmarks.kv_api import Etcd, _b
from benchmarks.throughput import PEER, ROOT
from raftkv.testing.procs import ProcCluster

RESULTS = Path(__file__).resolve().parent / "results"
READ_KEYS = 1000
TABLE_BATCH = 50  # keys per partition batch, for clients that batch per partition
VALUE = "v" * 100

# wrk's Lua side. Each thread numbers its requests; done() prints one JSON line.
_COMMON = r"""
local threads = {}
local tid = 0
function setup(thread)
  thread:set("tid", tid)
  tid = tid + 1
  table.insert(threads, thread)
end
local b64chars = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
function b64(data)
  return ((data:gsub('.', function(x)
    local r, b = '', x:byte()
    for i = 8, 1, -1 do r = r .. (b % 2 ^ i - b % 2 ^ (i - 1) > 0 and '1' or '0') end
    return r
  end) .. '0000'):gsub('%d%d?%d?%d?%d?%d?', function(x)
    if #x < 6 then return '' end
    local c = 0
    for i = 1, 6 do c = c + (x:sub(i, i) == '1' and 2 ^ (6 - i) or 0) end
    return b64chars:sub(c + 1, c + 1)
  end) .. ({'', '==', '='})[#data % 3 + 1])
end
n = 0
bad = 0
function response(status, headers, body)
  if status ~= 200 then bad = bad + 1 end
end
function done(summary, latency, requests)
  local errors = 0
  for _, t in ipairs(threads) do errors = errors + t:get("bad") end
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "non2xx": %d, ' ..
    '"socket_errors": %d}\n', summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), errors,
    summary.errors.connect + summary.errors.read + summary.errors.write +
    summary.errors.timeout))
end
"""

_SCRIPTS = {
    ("raftkv", "write"): r"""
local value = string.rep("v", 100)
function request()
  n = n + 1
  return wrk.format("PUT", "/v1/kv/k-" .. tid .. "-" .. n, nil, value)
end
""",
    ("etcd", "write"): r"""
local value = b64(string.rep("v", 100))
function request()
  n = n + 1
  local body = '{"key": "' .. b64("k-" .. tid .. "-" .. n) .. '", "value": "' .. value .. '"}'
  return wrk.format("POST", "/v3/kv/put", nil, body)
end
""",
    ("raftkv", "read"): f"""
function request()
  n = n + 1
  return wrk.format("GET", "/v1/kv/r" .. ((n * 7 + tid) % {READ_KEYS}), nil, nil)
end
""",
    ("etcd", "read"): f"""
function request()
  n = n + 1
  local body = '{{"key": "' .. b64("r" .. ((n * 7 + tid) % {READ_KEYS})) .. '"}}'
  return wrk.format("POST", "/v3/kv/range", nil, body)
end
""",
}


def ensure(tool: str, package: str) -> bool:
    """``tool`` on PATH, installing Debian's ``package`` when we may; False (and why)
    when it is missing."""
    if shutil.which(tool):
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"{tool} is missing: apt-get install -y {package}", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", package], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if shutil.which(tool):
        return True
    print(f"skipping what needs {tool}: install it with `apt-get install {package}`",
          file=sys.stderr)
    return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all threads (``/proc/PID/stat`` fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_write_bytes(pid: int) -> int:
    """Bytes a process caused to be written to storage (``/proc/PID/io``)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def wrk(url: str, system: str, kind: str, conns: int, seconds: float, pid: int,
        scripts: str) -> dict[str, Any]:
    path = os.path.join(scripts, f"{system}-{kind}.lua")
    with open(path, "w") as f:
        f.write(_COMMON + _SCRIPTS[(system, kind)])
    cpu0 = cpu_seconds(pid)
    res = subprocess.run(["wrk", "-t2", f"-c{conns}", f"-d{round(seconds)}s", "-s", path,
                          url], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"wrk failed: {res.stdout[-500:]} {res.stderr[-1000:]}")
    cpu = cpu_seconds(pid) - cpu0
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    ok = doc["requests"] - doc["non2xx"]
    return {"system": system, "kind": kind, "conns": conns,
            "req_s": ok / (doc["duration_us"] / 1e6), "p50_ms": doc["p50_us"] / 1000,
            "p99_ms": doc["p99_us"] / 1000, "errors": doc["non2xx"] + doc["socket_errors"],
            "leader_cpu_us_per_req": cpu / ok * 1e6 if ok else None}


def run_raftkv(base: str, conns: list[int], seconds: float, tls: bool,
               scripts: str) -> list[dict[str, Any]]:
    with ProcCluster(base, size=3, faults=False, tls=tls,
                     extra_args=["--log-level", "WARNING"]) as c:
        c.start()
        lead = c.wait_leader()
        client = c.client([lead])
        client.batch([(f"r{i}", VALUE) for i in range(READ_KEYS)])
        node = c.nodes[lead]
        assert node.proc is not None
        rows = [wrk(node.endpoint, "raftkv", kind, n, seconds, node.proc.pid, scripts)
                for kind in ("write", "read") for n in conns]
        client.close()
        return [{**r, "tls": tls} for r in rows]


def run_etcd(base: str, conns: list[int], seconds: float, scripts: str) -> list[dict[str, Any]]:
    e = Etcd(base)
    try:
        for i in range(READ_KEYS):
            e.post(0, "/v3/kv/put", {"key": _b(f"r{i}"), "value": _b(VALUE)})
        lead = e.leader()
        url = f"http://127.0.0.1:{e.client_ports[lead]}"
        return [wrk(url, "etcd", kind, n, seconds, e.procs[lead].pid, scripts)
                for kind in ("write", "read") for n in conns]
    finally:
        e.close()


def _load(endpoints: list[str], table: str | None, n: int, clients: int,
          prefix: str, batch: int = 1) -> dict[str, Any]:
    """``clients`` partition-aware Client threads in 2 processes, n sequential PUTs (or,
    with ``batch``, partition batches of that many keys)."""
    procs = 2
    threads = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    start_at = time.time() + 2.0
    children = [subprocess.Popen(
        [sys.executable, "-m", PEER, "http", ",".join(endpoints), table or "-",
         str(n * threads[i] // clients), str(threads[i]), "100", f"{prefix}{i}",
         repr(start_at), str(batch)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
        for i in range(procs)]
    outs = []
    for ch in children:
        out, err = ch.communicate()
        if ch.returncode != 0:
            raise RuntimeError(f"load client failed:\n{err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    span = max(o["t_end"] for o in outs) - min(o["t_start"] for o in outs)
    done = sum(o["ops"] for o in outs)
    lat = sorted(x for o in outs for x in o["lat_ms"])
    return {"writes": done, "seconds": span, "ops_s": done / span,
            "p50_ms": lat[len(lat) // 2] if lat else None,
            "errors": sum(o["errors"] for o in outs)}


def run_tables(base: str, partitions: int, clients: int, n: int) -> dict[str, Any]:
    with ProcCluster(base, size=3, faults=False, extra_args=["--log-level", "WARNING"]) as c:
        c.start()
        c.wait_leader()
        c.create_table("bench", partitions, 3, timeout=300)
        admin = c.client()
        endpoints = [node.endpoint for node in c.nodes.values()]
        pids = [node.proc.pid for node in c.nodes.values() if node.proc is not None]
        out: dict[str, Any] = {"partitions": partitions, "clients": clients}
        for name, table, batch in (("default", None, 1), ("table", "bench", 1),
                                   ("table_batched", "bench", TABLE_BATCH)):
            if name == "table":
                out["leaders_per_node"] = dict(Counter(
                    p["leader"] for p in admin.describe_table("bench")["partitions"]))
            cpu0 = sum(cpu_seconds(p) for p in pids)
            disk0 = sum(disk_write_bytes(p) for p in pids)
            run = _load(endpoints, table, n, clients, name, batch)
            cpu = sum(cpu_seconds(p) for p in pids) - cpu0
            disk = sum(disk_write_bytes(p) for p in pids) - disk0
            out[name] = {**run, "node_cpu_us_per_write": cpu / run["writes"] * 1e6,
                         "node_disk_bytes_per_write": disk / run["writes"]}
        admin.close()
        d, t = out["default"], out["table"]
        out["cpu_ratio"] = t["node_cpu_us_per_write"] / d["node_cpu_us_per_write"]
        out["throughput_ratio"] = t["ops_s"] / d["ops_s"]
        out["batched_throughput_ratio"] = out["table_batched"]["ops_s"] / d["ops_s"]
        return out


def print_table(doc: dict[str, Any]) -> None:
    print(f"{'system':8} {'kind':6} {'conns':>5} {'req/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'errors':>6} {'leader CPU us/req':>17}")
    for r in doc["http"]:
        cpu = r["leader_cpu_us_per_req"]
        print(f"{r['system']:8} {r['kind']:6} {r['conns']:>5} {r['req_s']:>9,.0f} "
              f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['errors']:>6} "
              f"{'-' if cpu is None else f'{cpu:,.0f}':>17}")
    for k, v in doc.get("ratios", {}).items():
        print(f"raftkv / etcd {k}: {v:.2f}")
    t = doc.get("tables")
    if t:
        print(f"tables ({t['partitions']} x 3, {t['clients']} clients, leaders per node at "
              f"start {t['leaders_per_node']}):")
        for name in ("default", "table", "table_batched"):
            r = t[name]
            print(f"  {name:14} {r['ops_s']:>8,.0f} writes/s  p50 {r['p50_ms']:.2f} ms  "
                  f"node CPU {r['node_cpu_us_per_write']:,.0f} us/write  "
                  f"disk {r['node_disk_bytes_per_write'] / 1024:,.1f} KiB/write  "
                  f"errors {r['errors']}")
        print(f"  table / default: CPU per write {t['cpu_ratio']:.2f}x, "
              f"throughput {t['throughput_ratio']:.2f}x; batched per partition "
              f"({TABLE_BATCH} keys) / default: {t['batched_throughput_ratio']:.2f}x")


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("write", "read"), strict=True):
        for system in ("raftkv", "etcd"):
            rows = [r for r in doc["http"] if r["system"] == system and r["kind"] == kind]
            if rows:
                ax.plot([r["conns"] for r in rows], [r["req_s"] for r in rows], "o-",
                        label=system)
        ax.set_title(f"HTTP {kind}s (3 nodes, fsync on)")
        ax.set_xlabel("wrk connections")
        ax.set_ylabel("requests/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--conns", default="16,64")
    ap.add_argument("--partitions", type=int, default=256)
    ap.add_argument("--table-clients", type=int, default=16)
    ap.add_argument("--table-writes", type=int, default=20_000)
    ap.add_argument("--no-tables", action="store_true")
    ap.add_argument("--no-http", action="store_true", help="only the tables' comparison")
    ap.add_argument("--tls", action="store_true", help="raftkv's rows over HTTPS")
    ap.add_argument("--out", default=str(RESULTS / "http_vs_etcd.json"))
    args = ap.parse_args(argv)
    conns = [int(x) for x in args.conns.split(",")]
    doc: dict[str, Any] = {"seconds": args.seconds, "cpus": os.cpu_count(), "http": []}
    with tempfile.TemporaryDirectory(prefix="http-vs-etcd-") as base:
        if not args.no_http and ensure("wrk", "wrk"):
            doc["http"] += run_raftkv(os.path.join(base, "raftkv"), conns, args.seconds,
                                      args.tls, base)
            if ensure("etcd", "etcd-server"):
                doc["http"] += run_etcd(os.path.join(base, "etcd"), conns, args.seconds, base)
        if not args.no_tables:
            doc["tables"] = run_tables(os.path.join(base, "tables"), args.partitions,
                                       args.table_clients, args.table_writes)
    by = {(r["system"], r["kind"], r["conns"]): r for r in doc["http"]}
    doc["ratios"] = {f"{kind} req/s at {n} conns": by[("raftkv", kind, n)]["req_s"]
                     / by[("etcd", kind, n)]["req_s"]
                     for kind in ("write", "read") for n in conns
                     if ("raftkv", kind, n) in by and ("etcd", kind, n) in by}
    print_table(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(out.with_suffix(".png"), doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
