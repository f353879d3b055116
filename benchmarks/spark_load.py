"""Spark bulk load and verify of a raftkv table, against the naive way to do it.

What is measured (one machine: 3 ``raftkv serve`` processes, fsync on, and Spark
``--master`` (default local[2]) all share its cores)
--------------------------------------------------------------------------------------
1. **Input**: ``--rows`` rows (``id`` string key, ``name`` and ``age`` columns, ~60-byte
   values as JSON) written to Parquet first (not timed), then read back by every job,
   as a user's load would.
2. **Load**: ``raftkv.spark.bulk_load`` into a fresh ``--partitions`` x 3 table. rows/s
   over the whole call, which includes Spark's route-and-shuffle stage (its JVM and
   Python workers warm up in it: this is the first job of the session) and the write
   stage; both stage times are reported separately.
3. **Verify**: ``raftkv.spark.verify`` of the same input: seconds, and that it is clean.
4. **Naive baseline**: the same rows, first ``--naive-rows`` of them (the full input
   would take many minutes), loaded by a Spark ``foreachPartition`` that does one
   ``Client.put`` per row into a second table: what a first attempt at a Spark loader
   looks like. rows/s, and the ratio bulk / naive.

Targets (issue 6): load >= 100,000 rows/s; verify of 1,000,000 rows < 30 s.

Usage::

    python -m benchmarks.spark_load [--rows 1000000] [--partitions 16] [--master local[2]]
        [--naive-rows 5000] [--batch-rows 1000] [--inflight 4] [--json FILE] [--dir DIR]

Results: a table on stdout, ``--json`` (default ``benchmarks/results/spark_load.json``)
and a PNG next to it if matplotlib is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._plot import pyplot
from raftkv.client import Client
from raftkv.spark import bulk_load, session, verify
from raftkv.testing.procs import ProcCluster

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_ROWS_S = 100_000
TARGET_VERIFY_S = 30.0


def _put_rows(endpoints: list[str], table: str, rows: Iterable[Any]) -> Iterator[int]:
    """The naive loader's task: one PUT per row (no batching, no partition routing)."""
    client = Client(endpoints, timeout=30.0)
    n = 0
    try:
        for r in rows:
            client.put(r["id"], json.dumps({"name": r["name"], "age": r["age"]},
                                           separators=(",", ":")), table=table)
            n += 1
    finally:
        client.close()
    yield n


def wait_leaders(c: Client, table: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p["leader"] for p in c.describe_table(table)["partitions"]):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{table}: no leader for every partition in {timeout}s")


def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    spark = session(args.master, app_name="raftkv-bench")
    spark.sparkContext.setLogLevel("ERROR")
    path = str(Path(base) / "input.parquet")
    spark.range(args.rows).selectExpr(
        "concat('user-', id) as id", "concat('name-', id, '-', repeat('x', 24)) as name",
        "cast(id % 100 as int) as age").write.parquet(path)
    df = spark.read.parquet(path)
    doc: dict[str, Any] = {"rows": args.rows, "partitions": args.partitions,
                           "master": args.master, "batch_rows": args.batch_rows,
                           "inflight": args.inflight}
    with ProcCluster(str(Path(base) / "cluster"), size=3, faults=False) as cluster:
        cluster.start()
        eps = [f"127.0.0.1:{n.http_port}" for n in cluster.nodes.values()]
        admin = Client(eps, timeout=30.0)
        for t in ("bulk", "naive"):
            admin.create_table(t, args.partitions, 3)
            wait_leaders(admin, t)

        rep = bulk_load(df, "bulk", "id", ["name", "age"], cluster=eps,
                        batch_rows=args.batch_rows, inflight=args.inflight)
        write_s = max(p.seconds for p in rep.partitions)
        doc["load"] = {"seconds": rep.seconds, "rows_s": rep.rows / rep.seconds,
                       "batches": rep.batches, "retries": rep.retries,
                       "write_stage_s": max(p.started + p.seconds for p in rep.partitions)
                       - min(p.started for p in rep.partitions),
                       "slowest_partition_write_s": write_s}
        v = verify(df, "bulk", "id", ["name", "age"], cluster=eps)
        doc["verify"] = {"seconds": v.seconds, "clean": v.ok,
                         "replicas_checked": v.replicas_checked}

        sample = df.orderBy("id").limit(args.naive_rows)
        n_parts = max(1, spark.sparkContext.defaultParallelism * 4)
        t0 = time.monotonic()
        done = sum(sample.repartition(n_parts).rdd.mapPartitions(
            lambda it: _put_rows(eps, "naive", it)).collect())
        naive_s = time.monotonic() - t0
        doc["naive"] = {"rows": done, "seconds": naive_s, "rows_s": done / naive_s,
                        "tasks": n_parts}
        doc["ratio_bulk_over_naive"] = doc["load"]["rows_s"] / doc["naive"]["rows_s"]
        admin.close()
    spark.stop()
    return doc


def print_table(doc: dict[str, Any]) -> None:
    load, ver, naive = doc["load"], doc["verify"], doc["naive"]
    rows = [
        ("bulk_load", f"{doc['rows']:,} rows", f"{load['seconds']:.1f} s",
         f"{load['rows_s']:,.0f} rows/s",
         f"target >= {TARGET_ROWS_S:,}: {'met' if load['rows_s'] >= TARGET_ROWS_S else 'MISSED'}"),
        ("  write stage", f"{load['batches']} batches", f"{load['write_stage_s']:.1f} s",
         f"{doc['rows'] / load['write_stage_s']:,.0f} rows/s", f"{load['retries']} retries"),
        ("verify", f"{ver['replicas_checked']} replicas", f"{ver['seconds']:.1f} s",
         "clean" if ver["clean"] else "MISMATCH",
         (f"target < {TARGET_VERIFY_S:.0f} s: "
         f"{'met' if ver['seconds'] < TARGET_VERIFY_S else 'MISSED'}")),
        ("naive put per row", f"{naive['rows']:,} rows", f"{naive['seconds']:.1f} s",
         f"{naive['rows_s']:,.0f} rows/s", f"bulk is {doc['ratio_bulk_over_naive']:.1f}x"),
    ]
    print(f"\nSpark load into {doc['partitions']} partitions x 3, master {doc['master']}, "
          f"batch {doc['batch_rows']} rows, {doc['inflight']} in flight")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:>16} {r[2]:>9} {r[3]:>18}   {r[4]}")


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].bar(["bulk_load", "naive put/row"], [doc["load"]["rows_s"], doc["naive"]["rows_s"]],
              color=["C0", "C3"])
    ax[0].axhline(TARGET_ROWS_S, color="grey", ls="--", label="target")
    ax[0].set_ylabel("rows/s")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    ax[0].set_title(f"{doc['rows']:,} rows, {doc['partitions']} partitions x 3")
    ax[1].bar(["load", "verify"], [doc["load"]["seconds"], doc["verify"]["seconds"]])
    ax[1].axhline(TARGET_VERIFY_S, color="grey", ls="--", label="verify target")
    ax[1].set_ylabel("seconds")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spark_load")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--naive-rows", type=int, default=5_000)
    p.add_argument("--batch-rows", type=int, default=1000)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    # Spark's Python workers import the naive loader's task from this package.
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (root, os.environ.get("PYTHONPATH")) if x)
    base = args.dir or tempfile.mkdtemp(prefix="raftkv-spark-bench-")
    try:
        doc = run(args, base)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print_table(doc)
    out = Path(args.json) if args.json else RESULTS / "spark_load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"json: {out}")
    plot(out.with_suffix(".png"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
