"""``verify``: does every replica of every partition hold exactly what the DataFrame says?

Theory of operation
-------------------
The digest of a set of rows (``raftkv.storage.digest``) is the count and the sum, modulo 2**64, of
one 64-bit hash per row. It does not depend on order, so Spark can compute it per Raft
partition with no sort, and a replica can compute it with one scan of its LMDB.

1. **Spark side**: the same route and shuffle as the load (``raftkv.spark.shuffle``), so
   each partition's rows are exactly what the load wrote (duplicate keys resolved the
   same way), then per partition their count and digest and, when there are at most
   ``diff_limit`` of them, each key's row hash.
2. **Replica side**, per partition: a *linearizable* digest from the leader (ReadIndex, so
   it covers every write acknowledged before verify started) gives an applied index A;
   then every other replica (stable members and any node hosting the group) is asked for
   its own local digest once it has applied A, waiting up to ``timeout`` for a replica
   that is catching up. Each replica hashes its own copy: nothing is trusted second-hand.
   Batch markers (``raftkv.storage.commands.user_key``) are not user rows and are left out.
3. **Compare**: a replica matches when its count and digest equal Spark's. For a mismatch
   on a small partition, the two key lists name the missing, extra and altered keys. A
   replica that does not answer is a mismatch too (``error``), because "could not check"
   is not "clean".
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from raftkv.client import ClientError, Unavailable
from raftkv.spark.cluster import PartitionInfo, SparkJobError, TableView, table_view
from raftkv.spark.progress import Progress
from raftkv.spark.rows import ValueFn
from raftkv.spark.shuffle import check_columns, job_error, routed, task_partitions
from raftkv.storage.digest import EMPTY, DigestBuilder, row_hash

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

DEFAULT_DIFF_LIMIT = 1000


@dataclass
class Expected:
    partition: int
    count: int
    digest: str
    rows: dict[str, str] | None  # key hex -> row hash hex, when small enough


@dataclass
class Mismatch:
    partition: int
    node: str
    expected_count: int
    expected_digest: str
    count: int | None = None
    digest: str | None = None
    missing: list[bytes] = field(default_factory=list)  # in the input, not on the replica
    extra: list[bytes] = field(default_factory=list)  # on the replica, not in the input
    altered: list[bytes] = field(default_factory=list)  # on both, different values
    error: str | None = None  # the replica could not be checked
    keys_named: bool = False  # both sides listed their keys (at most diff_limit rows)

    def describe(self) -> str:
        if self.error is not None:
            return f"partition {self.partition} on {self.node}: not checked: {self.error}"
        parts = [(f"partition {self.partition} on {self.node}: {self.count} rows "
                  f"digest {self.digest}, expected {self.expected_count} rows digest "
                  f"{self.expected_digest}")]
        for name, keys in (("missing", self.missing), ("extra", self.extra),
                           ("altered", self.altered)):
            if keys:
                shown = ", ".join(repr(k) for k in keys[:20])
                more = f" (+{len(keys) - 20} more)" if len(keys) > 20 else ""
                parts.append(f"  {name} keys: {shown}{more}")
        if not self.keys_named:
            parts.append("  keys not named: more rows than the diff limit")
        return "\n".join(parts)


@dataclass
class VerifyReport:
    table: str
    seconds: float
    rows: int
    partitions: int
    replicas_checked: int
    mismatches: list[Mismatch]
    diff_limit: int = DEFAULT_DIFF_LIMIT

    @property
    def ok(self) -> bool:
        """Every replica was checked and holds exactly the input."""
        return not self.mismatches

    @property
    def differing(self) -> list[Mismatch]:
        """The replicas checked whose rows differ from the input."""
        return [m for m in self.mismatches if m.error is None]

    @property
    def unchecked(self) -> list[Mismatch]:
        """The replicas that could not be checked (unreachable, no answer in time):
        ``mismatches`` holds them too, as the table is not verified, but they are not
        known to differ (found from outside: a node down counted as a mismatch)."""
        return [m for m in self.mismatches if m.error is not None]

    def format(self) -> str:
        head = (f"verify {self.table}: {self.rows} rows in {self.partitions} partitions, "
                f"{self.replicas_checked} replicas checked in {self.seconds:.1f} s: ")
        if self.ok:
            return head + "clean"
        differing, unchecked = self.differing, self.unchecked
        says = [f"{len(differing)} MISMATCHES"] if differing else []
        if unchecked:
            says.append(f"{len(unchecked)} replicas NOT CHECKED")
        lines = [head + ", ".join(says)] + [m.describe() for m in self.mismatches]
        if differing:
            lines.append(f"keys are named for partitions of at most {self.diff_limit} rows: "
                         "raise --diff-limit (diff_limit=) to name them in larger ones")
        return "\n".join(lines)


def verify(df: DataFrame, table: str, key_col: str,
           value_cols: Sequence[str] | None = None, value_fn: ValueFn | None = None, *,
           cluster: str | list[str] = "127.0.0.1:8080", diff_limit: int = DEFAULT_DIFF_LIMIT,
           timeout: float = 60.0, progress: bool = False, out: Any = None,
           token: str | None = None) -> VerifyReport:
    """Compare ``df`` (read as ``bulk_load`` would load it) with every replica of
    ``table``. Returns the report (``.ok``), also printed to ``out`` (stdout).
    ``token``: a read token, as for ``bulk_load``."""
    out = out or sys.stdout
    if (value_cols is None) == (value_fn is None):
        raise SparkJobError("give exactly one of value_cols and value_fn")
    if not (type(diff_limit) is int and diff_limit >= 0):
        raise SparkJobError(f"diff_limit must be a whole number of rows, not {diff_limit!r}")
    view = table_view(cluster, table, token=token)
    check_columns(df.columns, key_col, value_cols)
    n = len(view.partitions)
    t0 = time.monotonic()
    sc = df.sparkSession.sparkContext
    sc.setJobDescription(f"raftkv verify {table}: digests")
    try:
        with Progress(sc, f"verify {table}", out) if progress else contextlib.nullcontext():
            got = routed(df, key_col, value_cols, value_fn, n, n).mapInArrow(
                _Digester(diff_limit), EXPECTED_SCHEMA).collect()
    except Exception as e:  # noqa: BLE001 - re-raised as is unless it is a bad row
        raise job_error(e, "verify") from None
    finally:
        sc.setJobDescription(None)  # type: ignore[arg-type]
    expected = {r["partition"]: Expected(
        r["partition"], r["count"], r["digest"],
        None if r["rows"] is None else msgpack.unpackb(r["rows"])) for r in got}
    for p in range(n):
        expected.setdefault(p, Expected(p, EMPTY.count, EMPTY.digest, {}))
    print(f"[raftkv] verify {table}: Spark digested {sum(e.count for e in expected.values())} "
          f"rows in {time.monotonic() - t0:.1f} s; asking every replica", file=out, flush=True)
    with ThreadPoolExecutor(max_workers=min(8, n)) as pool:
        results = list(pool.map(
            lambda info: _check_partition(view, info, expected[info.partition],
                                          diff_limit, timeout),
            view.partitions))
    report = VerifyReport(table, time.monotonic() - t0,
                          sum(e.count for e in expected.values()), n,
                          sum(checked for checked, _ in results),
                          [m for _, ms in results for m in ms], diff_limit)
    print(report.format(), file=out, flush=True)
    return report


EXPECTED_SCHEMA = "partition int, count long, digest string, rows binary"


class _Digester:
    """The Spark side of step 1, run by ``mapInArrow`` in each task."""

    def __init__(self, diff_limit: int) -> None:
        self.diff_limit = diff_limit

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for p, (_, rows) in sorted(task_partitions(batches).items()):
            b = DigestBuilder()
            listed: dict[str, str] | None = {} if len(rows) <= self.diff_limit else None
            for k, v in rows:
                b.add(k, v)
                if listed is not None:
                    listed[k.hex()] = f"{row_hash(k, v):016x}"
            d = b.result()
            yield pa.RecordBatch.from_pylist(
                [{"partition": p, "count": d.count, "digest": d.digest,
                  "rows": None if listed is None else msgpack.packb(listed)}],
                schema=pa.schema([("partition", pa.int32()), ("count", pa.int64()),
                                  ("digest", pa.string()), ("rows", pa.binary())]))


def _check_partition(view: TableView, info: PartitionInfo, exp: Expected, diff_limit: int,
                     timeout: float) -> tuple[int, list[Mismatch]]:
    """(replicas checked, mismatches and replicas not checked) for one partition."""
    client = view.client(list(view.endpoints), timeout + 10)
    try:
        answers: dict[str, dict[str, Any] | str] = {}
        # The first replica that serves a linearizable digest (the leader, if it is known)
        # fixes the index every other replica must reach.
        order = ([info.leader] if info.leader in info.replicas else []) + \
            [r for r in info.replicas if r != info.leader]
        applied: int | None = None
        for node in order:
            addr = view.http.get(node)
            if addr is None:
                answers[node] = "no HTTP address published"
                continue
            try:
                if applied is None:
                    d = client.partition_digest(view.table, info.partition, addr,
                                                linearizable=True, keys=diff_limit + 1,
                                                timeout=timeout)
                    applied = int(d["applied"])
                else:
                    d = client.partition_digest(view.table, info.partition, addr,
                                                min_index=applied, keys=diff_limit + 1,
                                                timeout=timeout)
                answers[node] = d
            except (ClientError, Unavailable, OSError) as e:
                answers[node] = str(e)
        return (sum(1 for a in answers.values() if not isinstance(a, str)),
                [m for node, a in answers.items()
                 if (m := _compare(info.partition, node, exp, a)) is not None])
    finally:
        client.close()


def _compare(p: int, node: str, exp: Expected, got: dict[str, Any] | str) -> Mismatch | None:
    m = Mismatch(p, node, exp.count, exp.digest)
    if isinstance(got, str):
        m.error = got
        return m
    if got["count"] == exp.count and got["digest"] == exp.digest:
        return None
    m.count, m.digest = int(got["count"]), str(got["digest"])
    mine, theirs = exp.rows, got.get("rows")
    if mine is not None and theirs is not None:
        m.missing = sorted(bytes.fromhex(k) for k in mine.keys() - theirs.keys())
        m.extra = sorted(bytes.fromhex(k) for k in theirs.keys() - mine.keys())
        m.altered = sorted(bytes.fromhex(k) for k in mine.keys() & theirs.keys()
                           if mine[k] != theirs[k])
        m.keys_named = True
    return m
