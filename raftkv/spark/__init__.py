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

import os
import sys
from typing import TYPE_CHECKING, Any

from raftkv.spark.cluster import SparkJobError
from raftkv.spark.load import LoadReport, PartitionLoad, bulk_load
from raftkv.spark.verify import Mismatch, VerifyReport, verify

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["LoadReport", "Mismatch", "PartitionLoad", "SparkJobError", "VerifyReport",
           "bulk_load", "read_input", "session", "verify"]


def session(master: str = "local[*]", app_name: str = "raftkv", **conf: Any) -> SparkSession:
    """A SparkSession whose Python workers run this interpreter (so they import the same
    raftkv), with Spark's console progress bar on. ``SparkJobError`` if pyspark is not
    installed (it is the ``spark`` extra: ``pip install 'raftkv[spark]'``)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise SparkJobError(
            f"the Spark jobs need pyspark, which is not installed ({e}): "
            "pip install 'raftkv[spark]'") from None

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.ui.showConsoleProgress", "true")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "16"))
    for k, v in conf.items():
        b = b.config(k, v)
    return b.getOrCreate()


def read_input(spark: SparkSession, path: str) -> Any:
    """A DataFrame from a ``.parquet`` file or directory, or a ``.csv`` with a header (all
    columns read as strings, so nothing is reinterpreted on the way in)."""
    local = "://" not in path
    if local and not os.path.exists(path):
        raise SparkJobError(f"input {path} does not exist")
    lower = path.rstrip("/").lower()
    if lower.endswith(".parquet"):
        return spark.read.parquet(path)
    if lower.endswith(".csv"):
        return spark.read.option("header", "true").csv(path)
    raise SparkJobError(f"input {path}: expected a .parquet or .csv path")
