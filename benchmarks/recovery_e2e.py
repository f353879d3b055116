"""Recovery time end to end: from a crash to the first acknowledged write, raftkv against etcd.

What is measured (3 nodes of each system on 127.0.0.1, both fsyncing, each at its defaults)
-----------------------------------------------------------------------------------------
The same data for both: ``--keys`` K keys of 100-byte values, loaded in batches (raftkv
``POST /v1/batch``, 1,000 puts an entry; etcd ``POST /v3/kv/txn``, 128 puts a txn, its
default ``--max-txn-ops``), then, for raftkv, until every node's checkpoint has caught up
with its applied index (the "checkpoint current" case: nothing to replay).

- **whole cluster**: SIGKILL all three, start all three again, and from the moment the
  processes are spawned send a PUT (one attempt, 1 s timeout) to every node every 20 ms
  until one is acknowledged: ``first_write_s``. This is what a user measures, and it
  includes process start (imports), opening the stores, replay, the first election and
  the first commit.
- **leader**: SIGKILL the leader alone and probe the two others the same way (the
  failover), then start it again.

Each scenario runs ``--repeat`` times; the median and the spread (min, max) are
reported. Prints a table, writes ``benchmarks/results/recovery_e2e.json`` and a PNG.

Not yet measured (issue 21 asks for them): checkpoint lags of 10K and 100K entries, 1M
keys, a follower's catch-up after M writes, a 256-partition table's time until every
partition is writable, and PySyncObj's rows.

Usage::

    python -m benchmarks.recovery_e2e [--keys 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._plot import pyplot
from benchmarks.http_vs_etcd import ensure
from benchmarks.kv_api import Etcd, _b
from raftkv.testing.procs import ProcCluster

RESULTS = Path(__file__).resolve().parent / "results"
VALUE = b"v" * 100
PROBE_EVERY = 0.02


def first_write(targets: list[tuple[int, Callable[[http.client.HTTPConnection], bool]]],
                t0: float, limit: float = 60.0) -> float:
    """Seconds from ``t0`` until one of the probes (port, attempt) is acknowledged; every
    target is tried each ``PROBE_EVERY`` seconds, each attempt on a fresh connection with a
    1 s timeout, in its own thread."""
    done = threading.Event()
    when: list[float] = []

    def probe(port: int, attempt: Callable[[http.client.HTTPConnection], bool]) -> None:
        while not done.is_set() and time.perf_counter() - t0 < limit:
            start = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            try:
                if attempt(conn):
                    when.append(time.perf_counter())
                    done.set()
                    return
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            time.sleep(max(0.0, PROBE_EVERY - (time.perf_counter() - start)))

    threads = [threading.Thread(target=probe, args=t, daemon=True) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(limit + 2)
    if not when:
        raise RuntimeError(f"no write acknowledged within {limit}s")
    return min(when) - t0


def _raftkv_put(seq: list[int]) -> Callable[[http.client.HTTPConnection], bool]:
    def attempt(conn: http.client.HTTPConnection) -> bool:
        seq[0] += 1
        conn.request("PUT", f"/v1/kv/probe-{seq[0]}", body=b"x")
        return conn.getresponse().status == 200
    return attempt


def _etcd_put(seq: list[int]) -> Callable[[http.client.HTTPConnection], bool]:
    def attempt(conn: http.client.HTTPConnection) -> bool:
        seq[0] += 1
        conn.request("POST", "/v3/kv/put", json.dumps({"key": _b(f"probe-{seq[0]}"),
                                                        "value": _b("x")}))
        r = conn.getresponse()
        return r.status == 200 and "header" in json.loads(r.read() or b"{}")
    return attempt


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples": samples}


def run_raftkv(base: str, keys: int, repeat: int) -> dict[str, Any]:
    with ProcCluster(base, size=3, faults=False, extra_args=["--log-level", "WARNING"]) as c:
        c.start()
        c.wait_leader()
        client = c.client(timeout=60)
        for i in range(0, keys, 1000):
            client.batch([(b"k%09d" % j, VALUE) for j in range(i, min(i + 1000, keys))])
        client.close()

        def current() -> bool:
            gs = [c.group_status(n) for n in c.nodes]
            return all(g and g["checkpoint"] >= g["applied"] for g in gs)

        c.wait_until(current, 60, "every checkpoint caught up")
        seq = [0]
        ports = [n.http_port for n in c.nodes.values()]
        whole = []
        for _ in range(repeat):
            for n in c.nodes:
                c.kill(n)
            t0 = time.perf_counter()
            starter = threading.Thread(target=c.start, daemon=True)
            starter.start()
            whole.append(first_write([(p, _raftkv_put(seq)) for p in ports], t0))
            starter.join(60)
            c.wait_leader(timeout=30)
        leader = []
        for _ in range(repeat):
            lead = c.wait_leader(timeout=30)
            c.kill(lead)
            t0 = time.perf_counter()
            leader.append(first_write([(c.nodes[n].http_port, _raftkv_put(seq))
                                       for n in c.nodes if n != lead], t0))
            c.start(lead)
        return {"keys": keys, "whole_cluster": _summary(whole), "leader": _summary(leader)}


def run_etcd(base: str, keys: int, repeat: int) -> dict[str, Any]:
    e = Etcd(base)
    try:
        for i in range(0, keys, 128):
            e.post(0, "/v3/kv/txn", {"success": [
                {"requestPut": {"key": base64.b64encode(b"k%09d" % j).decode(),
                                "value": base64.b64encode(VALUE).decode()}}
                for j in range(i, min(i + 128, keys))]})
        seq = [0]
        whole = []
        for _ in range(repeat):
            for p in e.procs:
                p.kill()
                p.wait()
            t0 = time.perf_counter()
            e.restart()
            whole.append(first_write([(p, _etcd_put(seq)) for p in e.client_ports], t0))
        leader = []
        for _ in range(repeat):
            lead = e.leader()
            e.procs[lead].kill()
            e.procs[lead].wait()
            t0 = time.perf_counter()
            leader.append(first_write([(p, _etcd_put(seq)) for i, p in
                                       enumerate(e.client_ports) if i != lead], t0))
            e.restart(only=lead)
        return {"keys": keys, "whole_cluster": _summary(whole), "leader": _summary(leader)}
    finally:
        e.close()


def print_table(doc: dict[str, Any]) -> None:
    print(f"{'system':8} {'scenario':14} {'median s':>9} {'min s':>7} {'max s':>7}")
    for system in ("raftkv", "etcd"):
        r = doc.get(system)
        if not r:
            continue
        for scenario in ("whole_cluster", "leader"):
            s = r[scenario]
            print(f"{system:8} {scenario:14} {s['median_s']:>9.3f} {s['min_s']:>7.3f} "
                  f"{s['max_s']:>7.3f}")
    for k, v in doc.get("ratios", {}).items():
        print(f"etcd / raftkv {k}: {v:.2f}")


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    scenarios = ("whole_cluster", "leader")
    for i, system in enumerate(s for s in ("raftkv", "etcd") if doc.get(s)):
        r = doc[system]
        ax.bar([j + 0.4 * i for j in range(len(scenarios))],
               [r[s]["median_s"] for s in scenarios], 0.4, label=system,
               yerr=[[r[s]["median_s"] - r[s]["min_s"] for s in scenarios],
                     [r[s]["max_s"] - r[s]["median_s"] for s in scenarios]])
    ax.set_xticks([j + 0.2 for j in range(len(scenarios))], scenarios)
    ax.set_ylabel("crash to first acknowledged write, s")
    ax.set_title(f"Recovery end to end ({doc['keys']:,} keys, 3 nodes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "recovery_e2e.json"))
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {"keys": args.keys, "repeat": args.repeat, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="recovery-e2e-") as base:
        doc["raftkv"] = run_raftkv(os.path.join(base, "raftkv"), args.keys, args.repeat)
        if ensure("etcd", "etcd-server"):
            doc["etcd"] = run_etcd(os.path.join(base, "etcd"), args.keys, args.repeat)
    if doc.get("etcd"):
        doc["ratios"] = {s: doc["etcd"][s]["median_s"] / doc["raftkv"][s]["median_s"]
                         for s in ("whole_cluster", "leader")}
    print_table(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(out.with_suffix(".png"), doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
