"""Spark jobs for raftkv tables: ``bulk_load`` a DataFrame, ``verify`` every replica.

Nothing else in raftkv imports this package, and it imports pyspark only where a job
needs it, so the server, the embedded API and the CLI start without a JVM. pyspark,
pyarrow and pandas are the ``spark`` extra (``pip install 'raftkv[spark]'``). ``session``
builds the embedded default, a ``local[*]`` SparkSession; pass a master URL to run the
same job on a real cluster (the executors then need raftkv installed).

    from raftkv.spark import bulk_load, session, verify
    spark = session()
    df = spark.read.parquet("users.parquet")
    bulk_load(df, "users", "id", ["name", "email"], cluster="127.0.0.1:8080")
    assert verify(df, "users", "id", ["name", "email"], cluster="127.0.0.1:8080").ok
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from raftkv.spark.cluster import SparkJobError
from raftkv.spark.load import LoadReport, PartitionLoad, bulk_load
from raftkv.spark.verify import Mismatch, VerifyReport, verify

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["LoadReport", "Mismatch", "PartitionLoad", "SparkJobError", "VerifyReport",
           "bulk_load", "input_columns", "read_input", "require_extra", "session", "verify"]


# What the ``spark`` extra brings that the jobs import (pyspark[sql] needs pandas too).
EXTRA_MODULES = ("pyspark", "pyarrow", "pandas")


def require_extra(what: str = "raftkv.spark") -> None:
    """``SparkJobError`` naming the extra to install, unless every module of the ``spark``
    extra imports: a missing extra is one line for the user, not an ``ImportError`` from
    deep inside a job, and is found before any cluster is asked anything."""
    for module in EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            raise SparkJobError(f"{what} needs the spark extra ({module} is not installed): "
                                "pip install 'raftkv[spark]'") from None


def session(master: str = "local[*]", app_name: str = "raftkv", *,
            progress_bar: bool = True, **conf: Any) -> SparkSession:
    """A SparkSession whose Python workers run this interpreter (so they import the same
    raftkv). ``progress_bar``: Spark's console progress bar, on stderr; turn it off when
    the jobs' own progress lines are wanted (``progress=True``), so the two do not
    interleave, as ``raftkv spark`` does. ``conf``: more Spark settings (pass dotted names
    as ``**{"spark.x": v}``). ``SparkJobError`` if the ``spark`` extra is not installed
    (``require_extra``)."""
    require_extra()
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.ui.showConsoleProgress", "true" if progress_bar else "false")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "16"))
    for k, v in conf.items():
        b = b.config(k, v)
    return b.getOrCreate()


def _input_format(path: str) -> str:
    """``parquet`` or ``csv``, from the path (``SparkJobError`` for anything else or a
    local path that does not exist)."""
    if "://" not in path and not os.path.exists(path):
        raise SparkJobError(f"input {path} does not exist")
    lower = path.rstrip("/").lower()
    for fmt in ("parquet", "csv"):
        if lower.endswith("." + fmt):
            return fmt
    raise SparkJobError(f"input {path}: expected a .parquet or .csv path")


def read_input(spark: SparkSession, path: str) -> Any:
    """A DataFrame from a ``.parquet`` file or directory, or a ``.csv`` with a header (all
    columns read as strings, so nothing is reinterpreted on the way in). CSV is RFC 4180's,
    as Python's ``csv`` module writes it: a field in double quotes may hold commas and
    newlines, and a quote inside one is doubled. Spark's defaults differ (a backslash
    escapes a quote, a record is one line): a quoted field ``say ""hi""`` was stored with
    its quotes doubled, and a quoted newline failed the load (found from outside). A
    malformed CSV line (too few or too many fields, an unterminated quote) fails the job,
    in the read stage before any write: Spark's default would load it with nulls, stored
    as empty values (found from outside).

    Spark's reader is lenient where RFC 4180 is not: an unterminated quote took the rest
    of the file as one value, and a load of 20,000 rows stored 10,001 and said so with
    exit 0, and verify, reading the file the same way, said clean (found from outside).
    A local input is therefore checked first, record by record, by ``check_csv``, and
    Spark's record count must equal its count."""
    if _input_format(path) == "parquet":
        return spark.read.parquet(path)
    local = path.removeprefix("file://")
    expected = None if "://" in local else check_csv(local)
    df = (spark.read.option("header", "true").option("mode", "FAILFAST")
          .option("escape", '"').option("multiLine", "true").csv(path))
    if expected is not None:
        got = df.count()
        if got != expected:
            raise SparkJobError(f"input {path}: Spark's CSV reader finds {got} records where "
                                f"RFC 4180 has {expected} (mixed line endings?); nothing was "
                                "written")
    return df


CSV_FIELD_LIMIT = 16 << 20  # characters: well over a 1 MiB value's
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open}  # the codecs Spark writes that Python reads


def _csv_files(path: str) -> list[str]:
    """A local CSV input's files: the file, or a directory's part files (as Spark writes
    them, each with its header line)."""
    if not os.path.isdir(path):
        return [path]
    return sorted(os.path.join(path, f) for f in os.listdir(path)
                  if not f.startswith(("_", ".")))


def check_csv(path: str) -> int | None:
    """The number of records (header lines left out) of a local CSV input, each checked
    as RFC 4180 with Python's ``csv`` module in strict mode: a quote left open, text after
    a closing quote, a record with another field count than the header, or a part file
    whose header is not the first file's (Spark would take its columns by position) is a
    ``SparkJobError`` naming the file and the line the record starts on. Blank lines are
    skipped, as Spark skips them, and a byte order mark is not part of the first column's
    name. Files compressed with gzip or bzip2 are read through them; None (nothing
    checked) for an input with a codec Python cannot read. One pass over the input on the
    driver, one record in memory at a time, before Spark reads anything."""
    files = _csv_files(path)
    if any(os.path.splitext(f)[1].lower() not in (".csv", "", *_OPENERS) for f in files):
        return None
    # Python's csv refuses a field over 131,072 characters by default; a value may be
    # 1 MiB (and a field over this limit is refused, naming its line, as it should be).
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_LIMIT))
    total, first = 0, None
    for name in files:
        opener: Any = _OPENERS.get(os.path.splitext(name)[1].lower(), open)
        start = 1
        try:
            with opener(name, "rt", newline="", encoding="utf-8-sig") as f:
                reader = csv.reader(f, strict=True)
                header = None
                for record in reader:
                    if not record:
                        pass  # a blank line
                    elif header is None:
                        header = record
                        first = first or (name, header)
                        if header != first[1]:
                            raise SparkJobError(
                                f"input {name}: its header {header} is not {first[0]}'s "
                                f"{first[1]}; nothing was written")
                    elif len(record) != len(header):
                        raise SparkJobError(
                            f"input {name}: the record on line {start} has {len(record)} "
                            f"fields, its header {len(header)}; nothing was written")
                    else:
                        total += 1
                    start = reader.line_num + 1
        except csv.Error as e:
            raise SparkJobError(f"input {name}: the record starting on line {start} is not "
                                f"RFC 4180 CSV ({e}: a quote left open?); nothing was "
                                "written") from None
        except (OSError, UnicodeDecodeError, EOFError) as e:
            raise SparkJobError(f"input {name}: cannot read it as UTF-8 CSV: {e}") from None
    return total


def input_columns(path: str) -> list[str] | None:
    """The column names of the input ``read_input`` would read, found without Spark: from
    the Parquet footer(s) with pyarrow, or from a CSV's header line. A JVM takes seconds
    to start, so a wrong ``--key`` is caught this way first. None for a remote path (a
    URL), which only Spark can read; Spark's own schema is checked again in any case."""
    fmt = _input_format(path)
    if "://" in path:
        return None
    try:
        if fmt == "parquet":
            import pyarrow.dataset as ds

            return list(ds.dataset(path, format="parquet").schema.names)
        first = path
        if os.path.isdir(path):  # Spark writes a directory of part files
            parts = sorted(f for f in os.listdir(path) if not f.startswith(("_", ".")))
            if not parts:
                raise SparkJobError(f"input {path}: the directory holds no CSV file")
            first = os.path.join(path, parts[0])
        with open(first, newline="", encoding="utf-8-sig") as f:
            header = next((r for r in csv.reader(f) if r), None)
    except (OSError, ValueError, csv.Error) as e:  # pyarrow's ArrowInvalid: a ValueError
        raise SparkJobError(f"input {path}: cannot read its schema: {e}") from None
    if not header:
        raise SparkJobError(f"input {path}: the CSV file has no header line")
    return header
