"""``bulk_load``: write a DataFrame into a raftkv table, one Raft entry per batch of rows.

Theory of operation
-------------------
1. **On the driver, before any Spark work**: the table is described (unknown table or
   unreachable cluster: ``SparkJobError``) and the key and value columns are checked
   against the schema.
2. **Route and shuffle** (``raftkv.spark.shuffle``): every row becomes a ``(key, value)``
   pair in its Raft partition, by the server's own ``partition_of``, and the DataFrame is
   repartitioned so each Spark task owns whole Raft partitions. A null or oversized key
   or an oversized value fails this stage, which a shuffle separates from the write
   stage, so a bad row stops the load before anything is written (``SparkJobError``).
3. **Write** (each task): its rows, sorted by key with duplicate keys resolved, are cut
   into batches of at most ``batch_rows`` rows and ``rows.BATCH_BYTES`` bytes, up to
   ``inflight`` of them in flight at once (their keys are distinct, so they commute).
   Each batch is POSTed to the partition's leader (``/v1/tables/{t}/partitions/{p}/
   batch``; a follower would forward it) as one idempotent ``BATCH`` command, one Raft
   entry, whose id is ``(load id, partition, batch number, digest of its rows)``
   (``rows.batch_id``). Because the rows are sorted, every attempt of a task cuts the
   same batches with the same ids. A task that Spark retries after a partial write, or a
   speculative copy of one, re-sends batches the state machine has already applied; it
   skips them (the answer says ``applied: false``), so no batch is ever applied twice.
   A load resumed with its ``load_id`` skips exactly the batches of the same rows, and
   writes the others again (a put of the same value is harmless), whatever its batch
   size now.
4. **Retries**: a leader change, a 421/5xx, a refused or dropped connection is retried
   with exponential back-off (``max_attempts`` per batch) on the next endpoint; a retried
   batch is safe for the reason above. Anything else (a 400: a bug; a 404: the table was
   dropped) fails the task, and Spark's own task retries follow.
5. **Report**: one ``PartitionLoad`` per Raft partition (rows in, distinct keys stored,
   batches, batches skipped as already applied, seconds, retries, the Spark task attempt
   that succeeded), printed as a table.

Progress: ``bulk_load`` prints a summary line per stage (route and shuffle; write), and
with ``progress=True`` also a line every few seconds with each running stage's finished
tasks, which reads well in a log too. Spark's console progress bar
(``spark.ui.showConsoleProgress``; ``raftkv.spark.session(progress_bar=...)``) shows the
same live on a terminal. Use one or the other: the bar redraws itself on stderr with
carriage returns, and lines printed meanwhile break it into fragments. ``raftkv spark``
turns the bar off and prints the lines.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from raftkv.client import Client, ClientError, Unavailable
from raftkv.spark.cluster import SparkJobError, TableView, table_view
from raftkv.spark.progress import Progress
from raftkv.spark.rows import LOAD_ID, Pair, ValueFn, batch_id, cut_batches
from raftkv.spark.shuffle import check_columns, job_error, routed, task_partitions
from raftkv.storage.commands import MAX_BATCH_OPS

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

# A batch of 1,000 rows of ~100 bytes is ~120 KiB: big enough that the per-entry cost
# (an HTTP request, a Raft round, an fsync shared with other entries) is amortized, small
# enough that a retried batch is cheap and one entry never stalls its group's apply loop.
DEFAULT_BATCH_ROWS = 1000
# Batches in flight per partition: enough to keep the leader's pipeline full (it batches
# concurrent entries into one fsync and one append per follower), few enough that a
# leader change strands little work.
DEFAULT_INFLIGHT = 4
RETRYABLE_STATUS = {421, 500, 502, 503, 504}

BatchHook = Callable[[int, int, int], None]


@dataclass
class PartitionLoad:
    partition: int
    rows: int = 0  # rows of the input that belong here
    stored: int = 0  # distinct keys written (duplicate keys resolved)
    batches: int = 0
    skipped: int = 0  # batches already applied by an earlier attempt
    seconds: float = 0.0
    retries: int = 0
    attempt: int = 0  # the Spark task attempt that completed this partition
    started: float = 0.0  # wall clock (time.time()) when its task began writing it


@dataclass
class LoadReport:
    table: str
    load_id: str
    seconds: float
    partitions: list[PartitionLoad] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    @property
    def stored(self) -> int:
        return sum(p.stored for p in self.partitions)

    @property
    def batches(self) -> int:
        return sum(p.batches for p in self.partitions)

    @property
    def skipped(self) -> int:
        return sum(p.skipped for p in self.partitions)

    @property
    def retries(self) -> int:
        return sum(p.retries for p in self.partitions)

    def format(self) -> str:
        head = f"{'partition':>9} {'rows':>9} {'stored':>9} {'batches':>7} {'skipped':>7} " \
               f"{'seconds':>8} {'retries':>7} {'attempt':>7}"
        lines = [head]
        for p in self.partitions:
            lines.append(f"{p.partition:>9} {p.rows:>9} {p.stored:>9} {p.batches:>7} "
                         f"{p.skipped:>7} {p.seconds:>8.2f} {p.retries:>7} {p.attempt:>7}")
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        lines.append(f"load {self.load_id} into {self.table}: {self.rows} rows "
                     f"({self.stored} distinct keys) in {len(self.partitions)} partitions, "
                     f"{self.batches} batches ({self.skipped} applied before: skipped), "
                     f"{self.retries} retries, {self.seconds:.1f} s "
                     f"({rate:,.0f} rows/s)")
        return "\n".join(lines)


def bulk_load(df: DataFrame, table: str, key_col: str,
              value_cols: Sequence[str] | None = None, value_fn: ValueFn | None = None, *,
              cluster: str | list[str] = "127.0.0.1:8080",
              batch_rows: int = DEFAULT_BATCH_ROWS, inflight: int = DEFAULT_INFLIGHT,
              load_id: str | None = None,
              tasks: int | None = None, max_attempts: int = 12,
              on_batch: BatchHook | None = None, progress: bool = False,
              out: Any = None, token: str | None = None) -> LoadReport:
    """Load ``df`` into ``table``: the key from ``key_col``, the value from ``value_cols``
    or ``value_fn(row)`` (``raftkv.spark.rows`` gives the encodings). ``cluster``: any
    nodes' HTTP ``host:port``; ``token``: a write token, when the cluster checks them
    (default: ``RAFTKV_TOKEN`` or ``RAFTKV_TOKEN_FILE``, see ``raftkv.spark.cluster``).
    ``on_batch(partition, batch_number, task_attempt)`` runs in the task before each
    batch is sent (progress hooks, fault injection in tests).
    Returns the per-partition report, which is also printed to ``out`` (stdout)."""
    out = out or sys.stdout
    if (value_cols is None) == (value_fn is None):
        raise SparkJobError("give exactly one of value_cols and value_fn")
    check_load_options(batch_rows, inflight, load_id)
    view = table_view(cluster, table, token=token)
    check_columns(df.columns, key_col, value_cols)
    load_id = load_id or new_load_id()
    n = len(view.partitions)
    t0, wall0 = time.monotonic(), time.time()
    sc = df.sparkSession.sparkContext
    write = _Writer(table, view, batch_rows, inflight, load_id, max_attempts, on_batch)
    sc.setJobDescription(f"raftkv load {load_id} into {table}")
    try:
        with Progress(sc, f"load {load_id}", out) if progress else contextlib.nullcontext():
            got = routed(df, key_col, value_cols, value_fn, n, tasks or n).mapInArrow(
                write, REPORT_SCHEMA).collect()
    except Exception as e:  # noqa: BLE001 - re-raised as is unless it is a bad row
        raise job_error(e, "load") from None
    finally:
        sc.setJobDescription(None)  # type: ignore[arg-type]
    by_part = {r["partition"]: PartitionLoad(**r.asDict()) for r in got}
    report = LoadReport(table, load_id, time.monotonic() - t0,
                        [by_part.get(p, PartitionLoad(p)) for p in range(n)])
    routed_at = min((r.started for r in by_part.values()), default=time.time()) - wall0
    print(f"[raftkv] load {load_id} stage 1/2 (route and shuffle): {report.rows} rows into "
          f"{n} partitions in {routed_at:.1f} s", file=out)
    print(f"[raftkv] load {load_id} stage 2/2 (write): {report.batches} batches, "
          f"{report.retries} retries in {report.seconds - routed_at:.1f} s", file=out)
    print(report.format(), file=out, flush=True)
    return report


def new_load_id() -> str:
    """A load id for a load given none: 12 hex digits, random."""
    return uuid.uuid4().hex[:12]


def check_load_options(batch_rows: int, inflight: int, load_id: str | None) -> None:
    """``SparkJobError`` for options the write stage could only fail on after the
    shuffle (found from outside: ``batch_rows`` 20,000 failed there on the server's
    10,000-operation limit)."""
    if not (type(batch_rows) is int and 1 <= batch_rows <= MAX_BATCH_OPS):
        raise SparkJobError(f"batch_rows must be 1..{MAX_BATCH_OPS} (the operations of one "
                            f"batch at most), not {batch_rows!r}")
    if not (type(inflight) is int and inflight >= 1):
        raise SparkJobError(f"inflight must be at least 1, not {inflight!r}")
    if load_id is not None and not (isinstance(load_id, str) and LOAD_ID.fullmatch(load_id)):
        raise SparkJobError(f"a load id is 1..64 letters, digits, '.', '_' or '-', not "
                            f"{load_id!r:.80}")


REPORT_SCHEMA = ("partition int, rows long, stored long, batches long, skipped long, "
                 "seconds double, retries long, attempt int, started double")


class _Writer:
    """Step 4, the write stage: a picklable callable run by ``mapInArrow`` in each task."""

    def __init__(self, table: str, view: TableView, batch_rows: int, inflight: int,
                 load_id: str, max_attempts: int, on_batch: BatchHook | None) -> None:
        self.table, self.view, self.batch_rows = table, view, batch_rows
        self.inflight = inflight
        self.load_id, self.max_attempts, self.on_batch = load_id, max_attempts, on_batch

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx is not None else 0
        for p, (count, rows) in sorted(task_partitions(batches).items()):
            rep = self._write(p, count, rows, attempt)
            yield pa.RecordBatch.from_pylist([asdict(rep)], schema=_report_schema())

    def _write(self, p: int, count: int, rows: list[Pair], attempt: int) -> PartitionLoad:
        """Send partition ``p``'s batches, ``inflight`` at a time: they hold distinct keys,
        so they commute, and concurrent entries share the leader's fsyncs and round trips.
        The hook runs, and a failure surfaces, in batch order."""
        rep = PartitionLoad(p, rows=count, stored=len(rows), attempt=attempt,
                            started=time.time())
        t0 = time.monotonic()
        local = threading.local()
        clients: list[Client] = []

        def send(number: int, chunk: Sequence[Pair]) -> tuple[bool, int]:
            client = getattr(local, "client", None)
            if client is None:
                local.client = client = self.view.client(self.view.endpoints_for(p), 10.0)
                clients.append(client)
            return _send(client, self.table, p, chunk,
                         batch_id(self.load_id, p, number, chunk), self.max_attempts)

        pending: deque[Future[tuple[bool, int]]] = deque()
        try:
            with ThreadPoolExecutor(self.inflight, thread_name_prefix=f"raftkv-load-{p}") as ex:
                for number, chunk in enumerate(cut_batches(rows, self.batch_rows)):
                    if self.on_batch is not None:
                        self.on_batch(p, number, attempt)
                    pending.append(ex.submit(send, number, chunk))
                    while len(pending) >= self.inflight or (pending and pending[0].done()):
                        self._count(rep, pending.popleft().result())
                while pending:
                    self._count(rep, pending.popleft().result())
        finally:
            for f in pending:
                f.cancel()
            for c in clients:
                c.close()
        rep.seconds = time.monotonic() - t0
        return rep

    @staticmethod
    def _count(rep: PartitionLoad, result: tuple[bool, int]) -> None:
        applied, retries = result
        rep.batches += 1
        rep.skipped += 0 if applied else 1
        rep.retries += retries


def _report_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema([("partition", pa.int32()), ("rows", pa.int64()), ("stored", pa.int64()),
                      ("batches", pa.int64()), ("skipped", pa.int64()),
                      ("seconds", pa.float64()), ("retries", pa.int64()),
                      ("attempt", pa.int32()), ("started", pa.float64())])


def _send(client: Client, table: str, p: int, chunk: Sequence[Pair], bid: bytes,
          max_attempts: int) -> tuple[bool, int]:
    """(applied, retries) of one batch; the last error if every attempt failed."""
    delay = 0.05
    for tries in range(1, max_attempts + 1):
        try:
            return bool(client.partition_batch(table, p, chunk, bid)["applied"]), tries - 1
        except ClientError as e:
            if e.status not in RETRYABLE_STATUS or tries == max_attempts:
                raise
        except (Unavailable, OSError):
            if tries == max_attempts:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
    raise AssertionError("unreachable")
