"""``raftkv spark load|verify``: the Spark jobs from the command line.

    raftkv --endpoints H:P,... spark load --table T --input PATH --key COL
        [--value-cols A,B] [--master URL] [--batch-rows N] [--load-id ID]
    raftkv --endpoints H:P,... spark verify --table T --input PATH --key COL
        [--value-cols A,B] [--master URL] [--diff-limit N]

``--value-cols`` defaults to every column but the key (one column: its value as is; more:
a JSON object, see ``raftkv.spark.rows``).

Everything that can be checked without Spark is checked before a JVM starts (which takes
seconds), in this order: the ``spark`` extra is installed, the input exists and has the
key and value columns (its schema read with pyarrow, or its CSV header), the cluster
answers and knows the table. Each failure is one line on stderr.

Progress: Spark's console progress bar is turned off and the jobs print their own lines
(``[raftkv] ...``: one per running stage every few seconds, then one per finished stage
and the report) on stdout; with both, the bar's carriage returns on stderr and the lines
on stdout interleave into an unreadable terminal.

Credentials: the token of ``raftkv --token-file`` (else ``RAFTKV_TOKEN`` or
``RAFTKV_TOKEN_FILE``) is resolved once on the driver and carried to every task in the
table view (``raftkv.spark.cluster``); ``--cacert``/``--cert``/``--key`` are passed on as
``RAFTKV_CACERT``/``RAFTKV_CERT``/``RAFTKV_KEY``, which every client reads.

Exit status: 0 done and clean, 1 an error (nothing was written if it came before the
write stage), 3 verify found mismatches.
"""

from __future__ import annotations

import argparse
import re
import sys

from raftkv.spark import (
    SparkJobError,
    bulk_load,
    input_columns,
    read_input,
    require_extra,
    session,
    verify,
)
from raftkv.spark.cluster import table_view
from raftkv.spark.load import DEFAULT_INFLIGHT, check_load_options, new_load_id
from raftkv.spark.shuffle import check_columns

MISMATCH_EXIT = 3
# Some replica could not be checked and none checked differs: not verified, but no
# mismatch known (found from outside: a node down read as "MISMATCHES", exit 3).
UNCHECKED_EXIT = 4


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def add_arguments(spark: argparse.ArgumentParser) -> None:
    """``load`` and ``verify`` under the ``raftkv spark`` subcommand."""
    jobs = spark.add_subparsers(dest="action", required=True, metavar="{load,verify}")
    helps = {"load": "bulk-load a Parquet or CSV file into a table",
             "verify": "check that every replica of a table holds exactly the input "
                       "(exit 3 on a mismatch, 4 if a replica could not be checked)"}
    for action, text in helps.items():
        a = jobs.add_parser(action, help=text, description=text)
        a.add_argument("--table", required=True, help="the raftkv table (it must exist)")
        a.add_argument("--input", required=True,
                       help="a .parquet file or directory, or a .csv with a header line")
        a.add_argument("--key", required=True, help="the column that holds each row's key")
        a.add_argument("--value-cols", default="",
                       help="comma-separated value columns (default: every other column); "
                            "one column is stored as is, several as a JSON object")
        a.add_argument("--master", default="local[*]",
                       help="Spark master URL (default: local[*], an embedded Spark)")
        if action == "load":
            a.add_argument("--batch-rows", type=_positive, default=1000,
                           help="rows per Raft entry, at most 10000 (default: 1000; a "
                                "batch is also cut at 4 MiB)")
            a.add_argument("--load-id", default=None,
                           help="reuse an earlier load's id to resume it: the batches of "
                                "the same rows it applied are skipped, the rest written")
        else:
            a.add_argument("--diff-limit", type=_positive, default=1000,
                           help="name the missing, extra and altered keys of a "
                                "mismatched partition of up to this many rows "
                                "(default: 1000)")


def run(args: argparse.Namespace, endpoints: str, token: str | None) -> int:
    """``token``: the bearer token to send (None: none)."""
    eps = [e for e in endpoints.split(",") if e]  # schemes kept: https must stay https
    chosen = [c for c in args.value_cols.split(",") if c] if args.value_cols else None
    try:
        require_extra("raftkv spark")
        if args.action == "load":
            check_load_options(args.batch_rows, DEFAULT_INFLIGHT, args.load_id)
        columns = input_columns(args.input)
        if columns is not None:
            check_columns(columns, args.key,
                          chosen if chosen is not None else
                          [c for c in columns if c != args.key])
        table_view(eps, args.table, timeout=args.timeout, connect_timeout=args.connect_timeout,
                   token=token)
    except SparkJobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        spark = session(args.master, app_name=f"raftkv {args.action} {args.table}",
                        progress_bar=False)
    except Exception as e:  # noqa: BLE001 - no JVM, bad master URL: one line, not a trace
        print(f"error: cannot start Spark ({args.master}): {e}", file=sys.stderr)
        return 1
    try:
        # A failed task is reported in one line (task_failure); Spark's own ERROR lines
        # would repeat it as Java and Python stack traces.
        spark.sparkContext.setLogLevel("FATAL")
        df = read_input(spark, args.input)
        cols = chosen if chosen is not None else [c for c in df.columns if c != args.key]
        if args.action == "load":
            load_id = args.load_id or new_load_id()
            try:
                bulk_load(df, args.table, args.key, cols, cluster=eps,
                          batch_rows=args.batch_rows, load_id=load_id, progress=True,
                          token=token)
            except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - one line, as below
                # What to rerun, in the error itself (found from outside: the id was only
                # in the progress lines on stdout). It may have failed before writing.
                resume = (f" (load {load_id}: to resume it once the cause is fixed, run it "
                          f"again with --load-id {load_id}; any batches it applied are "
                          "skipped)")
                why = ("interrupted" if isinstance(e, KeyboardInterrupt) else str(e)
                       if isinstance(e, SparkJobError) else
                       f"the Spark job failed: {task_failure(e)}")
                print(f"error: {why}{resume}", file=sys.stderr)
                return 130 if isinstance(e, KeyboardInterrupt) else 1
            return 0
        report = verify(df, args.table, args.key, cols, cluster=eps,
                        diff_limit=args.diff_limit, progress=True, token=token)
        if report.differing:
            return MISMATCH_EXIT
        return UNCHECKED_EXIT if report.unchecked else 0
    except SparkJobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a task failed for good: one line, not a trace
        print(f"error: the Spark job failed: {task_failure(e)}", file=sys.stderr)
        return 1
    finally:
        spark.stop()


def task_failure(e: BaseException) -> str:
    """The Python exception that failed a Spark task, as one line (``raftkv.client.
    ClientError: HTTP 403 ...``), out of the Java exception's text that carries the
    task's whole traceback; else the exception's first line."""
    lines = [re.sub(r"^(Caused by: |: )", "", line.strip()) for line in str(e).splitlines()]
    for line in reversed(lines):  # the innermost cause is printed last
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable): ", line):
            return line
    return next((line for line in lines if line), type(e).__name__)
