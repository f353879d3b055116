"""``raftkv spark load|verify``: the Spark jobs from the command line.

    raftkv --endpoints H:P,... spark load --table T --input PATH --key COL
        [--value-cols A,B] [--master URL] [--batch-rows N] [--load-id ID]
    raftkv --endpoints H:P,... spark verify --table T --input PATH --key COL
        [--value-cols A,B] [--master URL] [--diff-limit N]

``--value-cols`` defaults to every column but the key (one column: its value as is; more:
a JSON object, see ``raftkv.spark.rows``). Both print Spark's progress bar, a progress line
every few seconds and the report. Exit status: 0 done and clean, 1 an error (nothing was
written if it came before the write stage), 3 verify found mismatches.
"""

from __future__ import annotations

import argparse
import os
import sys

from raftkv.spark import SparkJobError, bulk_load, read_input, session, verify
from raftkv.spark.cluster import table_view

MISMATCH_EXIT = 3


def run(args: argparse.Namespace, endpoints: str, token: str | None) -> int:
    """``token``: the bearer token to send (None: none)."""
    eps = [e.split("://", 1)[-1] for e in endpoints.split(",") if e]
    try:
        # Before starting a JVM: a missing input or an unknown table fails in a second.
        if "://" not in args.input and not os.path.exists(args.input):
            raise SparkJobError(f"input {args.input} does not exist")
        table_view(eps, args.table, token=token)
    except SparkJobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        spark = session(args.master, app_name=f"raftkv {args.action} {args.table}")
    except Exception as e:  # noqa: BLE001 - no JVM, bad master URL: one line, not a trace
        print(f"error: cannot start Spark ({args.master}): {e}", file=sys.stderr)
        return 1
    try:
        spark.sparkContext.setLogLevel("ERROR")
        df = read_input(spark, args.input)
        if args.key not in df.columns:
            raise SparkJobError(f"no key column {args.key!r} in {args.input}; the columns "
                                f"are {df.columns}")
        cols = ([c for c in args.value_cols.split(",") if c] if args.value_cols
                else [c for c in df.columns if c != args.key])
        if args.action == "load":
            bulk_load(df, args.table, args.key, cols, cluster=eps, batch_rows=args.batch_rows,
                      load_id=args.load_id, progress=True, token=token)
            return 0
        report = verify(df, args.table, args.key, cols, cluster=eps,
                        diff_limit=args.diff_limit, progress=True, token=token)
        return 0 if report.ok else MISMATCH_EXIT
    except SparkJobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
