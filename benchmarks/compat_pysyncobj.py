"""The same PySyncObj program on PySyncObj 0.3.17 and on ``raftkv.compat.pysyncobj``.

What is measured
----------------
The program (``benchmarks/_compat_peer.py``) is a ``SyncObj`` with a ``ReplDict``
consumer and ``SyncObjConf(journalFile=..., fullDumpFile=...)``, PySyncObj's defaults
otherwise; only its imports differ between the two runs. Every node is its own process
on 127.0.0.1.

1. **Write throughput**: 3 nodes; one of them (the leader or not: PySyncObj forwards
   from followers too) issues ``--ops`` asynchronous ``set(key, value, callback=)`` of
   ``--value-size``-byte values, at most ``--window`` outstanding. ops/s counts the
   successful callbacks over the time from the first call to the last callback. The
   compat layer fsyncs every batch of log entries before acknowledging it (raftkv's
   durable log); PySyncObj never fsyncs (its journal is an mmap).
2. **Restart time**: one node (no partners) is filled with ``--entries`` keys the same
   way and destroyed (once its full dump, if one is being written, is done: see
   ``_compat_peer.DUMP_SETTLE_S``), then started again in a fresh process: the time
   from just before the constructor until the dict holds every key and the last one
   reads back. PySyncObj restarts from its last full dump plus its journal; raftkv from
   its last checkpoint plus the log after it. Each implementation restarts
   ``--restarts`` times, each time from a fresh copy of its filled directory, the two
   implementations taking turns (so a busy machine slows both alike); the median is
   reported, and every sample is in the JSON. The fill is timed too.

Usage::

    python -m benchmarks.compat_pysyncobj [--ops 20000] [--entries 1000000]
        [--window 1000] [--value-size 100] [--restarts 3] [--impls pysyncobj,compat]
        [--skip write|restart] [--json FILE]

Results: a table on stdout with the compat/PySyncObj ratios, and ``--json`` (default
``benchmarks/results/compat_pysyncobj.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raftkv.testing.procs import free_ports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "compat_pysyncobj.json"


def peer(impl: str, mode: str, directory: str, n: int, size: int, window: int, me: str,
         partners: list[str], **kw: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks._compat_peer", impl, mode, directory, str(n),
         str(size), str(window), me, *partners],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        cwd=ROOT, env=env, **kw)


def last_json(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited ({proc.poll()}) without a result")
        doc: dict[str, Any] = json.loads(line)
        if "started" not in doc:
            return doc
        if time.monotonic() > deadline:
            raise RuntimeError("no result in time")


def write(impl: str, tmp: str, ops: int, size: int, window: int) -> dict[str, Any]:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    procs = []
    for i, a in enumerate(addrs):
        mode = "write" if i == 0 else "serve"
        procs.append(peer(impl, mode, os.path.join(tmp, f"{impl}-w{i}"), ops, size, window,
                          a, [b for b in addrs if b != a]))
    try:
        return last_json(procs[0], 1800)
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def fill(impl: str, tmp: str, entries: int, size: int, window: int) -> dict[str, Any]:
    """Fill one node's directory; where it is, its address (the compat layer's node id)
    and the fill's figures."""
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    directory = os.path.join(tmp, f"{impl}-r")
    proc = peer(impl, "fill", directory, entries, size, window, addr, [])
    filled = last_json(proc, 7200)
    proc.wait(60)
    print(f"{impl:10s} fill    {filled['ops_s']:10.0f} ops/s ({filled['keys']} keys)",
          flush=True)
    return {"dir": directory, "addr": addr, "fill": filled}


def restart(impl: str, filled: dict[str, Any], entries: int, size: int, window: int,
            n: int) -> dict[str, Any]:
    """One restart from a fresh copy of the filled directory."""
    copy = f"{filled['dir']}-{n}"
    shutil.copytree(filled["dir"], copy)
    try:
        proc = peer(impl, "restart", copy, entries, size, window, filled["addr"], [])
        out = last_json(proc, 1800)
        proc.wait(60)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if out["restart_s"] is None:
        print(f"{impl:10s} restart    stalled: {out['keys']} of {entries} keys back after "
              f"{out['partial_s']:.3f} s", flush=True)
    else:
        print(f"{impl:10s} restart {out['restart_s']:10.3f} s ({out['keys']} keys back)",
              flush=True)
    return out


def summary(filled: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    complete = [s["restart_s"] for s in samples if s["restart_s"] is not None]
    return {"fill": filled["fill"], "samples": samples,
            "restart_s": statistics.median(complete) if complete else None,
            "complete": len(complete), "keys": min(s["keys"] for s in samples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--restarts", type=int, default=3, help="restarts per implementation")
    p.add_argument("--impls", default="pysyncobj,compat")
    p.add_argument("--skip", default="", help="write and/or restart, comma-separated")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    skip = set(filter(None, args.skip.split(",")))
    results: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        for impl in impls:
            results[impl] = {}
            if "write" not in skip:
                w = results[impl]["write"] = write(impl, tmp, args.ops, args.value_size,
                                                   args.window)
                print(f"{impl:10s} write   {w['ops_s']:10.0f} ops/s (ok {w['ok']}/{w['ops']}, "
                      f"failures {w['failures']})", flush=True)
        if "restart" not in skip:
            filled = {impl: fill(impl, tmp, args.entries, args.value_size, args.window)
                      for impl in impls}
            samples: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
            for n in range(args.restarts):
                for impl in impls:
                    samples[impl].append(restart(impl, filled[impl], args.entries,
                                                 args.value_size, args.window, n))
            for impl in impls:
                r = results[impl]["restart"] = summary(filled[impl], samples[impl])
                took = "stalled" if r["restart_s"] is None else f"{r['restart_s']:.3f} s"
                print(f"{impl:10s} restart median {took} ({r['complete']}/{args.restarts} "
                      f"complete)", flush=True)
    if {"pysyncobj", "compat"} <= results.keys():
        a, b = results["pysyncobj"], results["compat"]
        ratios: dict[str, float] = {}
        if "write" in a and "write" in b:
            ratios["write_ops_s compat/pysyncobj"] = b["write"]["ops_s"] / a["write"]["ops_s"]
        if "restart" in a and "restart" in b:
            if a["restart"]["restart_s"] and b["restart"]["restart_s"]:
                ratios["restart_s compat/pysyncobj"] = (b["restart"]["restart_s"]
                                                        / a["restart"]["restart_s"])
            ratios["fill_ops_s compat/pysyncobj"] = (b["restart"]["fill"]["ops_s"]
                                                     / a["restart"]["fill"]["ops_s"])
        results["ratios"] = ratios
        for k, v in ratios.items():
            print(f"{k:32s} {v:8.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
