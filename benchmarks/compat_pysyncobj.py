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
   way, destroyed, and started again in a fresh process: the time from just before
   the constructor until the dict holds every key and the last one reads back.
   PySyncObj restarts from its last full dump plus its journal; raftkv from its last
   checkpoint plus the log after it. The fill is timed too.

Usage::

    python -m benchmarks.compat_pysyncobj [--ops 20000] [--entries 1000000]
        [--window 1000] [--value-size 100] [--impls pysyncobj,compat] [--json FILE]

Results: a table on stdout with the compat/PySyncObj ratios, and ``--json`` (default
``benchmarks/results/compat_pysyncobj.json``).
"""

from __future__ import annotations

import argparse
import json
import os
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


def restart(impl: str, tmp: str, entries: int, size: int, window: int) -> dict[str, Any]:
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    directory = os.path.join(tmp, f"{impl}-r")
    fill = peer(impl, "fill", directory, entries, size, window, addr, [])
    filled = last_json(fill, 7200)
    fill.wait(60)
    print(f"{impl:10s} fill    {filled['ops_s']:10.0f} ops/s ({filled['keys']} keys)",
          flush=True)
    again = peer(impl, "restart", directory, entries, size, window, addr, [])
    out = last_json(again, 1800)
    again.wait(60)
    return {"fill": filled, **out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--impls", default="pysyncobj,compat")
    p.add_argument("--skip", default="", help="write and/or restart, comma-separated")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    skip = set(filter(None, args.skip.split(",")))
    results: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        for impl in impls:
            r: dict[str, Any] = {}
            if "write" not in skip:
                r["write"] = write(impl, tmp, args.ops, args.value_size, args.window)
                print(f"{impl:10s} write   {r['write']['ops_s']:10.0f} ops/s "
                      f"(ok {r['write']['ok']}/{r['write']['ops']}, "
                      f"failures {r['write']['failures']})", flush=True)
            if "restart" not in skip:
                r["restart"] = restart(impl, tmp, args.entries, args.value_size, args.window)
                rs = r["restart"]["restart_s"]
                took = "   stalled" if rs is None else f"{rs:10.3f}"
                print(f"{impl:10s} restart {took} s ({r['restart']['keys']} keys back)",
                      flush=True)
            results[impl] = r
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
