"""How a DataFrame row becomes a raftkv row, and which Raft partition it belongs to.

Load and verify share this module, so the bytes verify hashes are the bytes load wrote. It
imports no pyspark: executors run these functions on plain values.

- **Key**: the key column's value as bytes: ``bytes``/``bytearray`` as they are, ``str`` as
  UTF-8, anything else (ints, dates, decimals) as ``str(value)`` in UTF-8. A null key is an
  error (there is nothing to address the row by).
- **Value**, with ``value_cols``: one column gives that column's value in the same encoding as
  a key (a null gives ``b""``); several columns give a compact JSON object ``{col: value}``
  in the given column order (non-JSON types as ``str``). With ``value_fn``: whatever bytes
  (or str, as UTF-8) the function returns for the Row.
- **Partition**: ``partition_of(key, partitions)``, the server's own function
  (``raftkv.spark.shuffle`` calls it).
- **Duplicate keys** within the input: a key can hold one value, so of several rows with the
  same key the one with the greatest value bytes is stored. Both load and verify apply that
  rule (``shuffle.task_partitions``), so a clean load of an input with duplicates still verifies.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack

from raftkv.storage.commands import check_key, check_value

Pair = tuple[bytes, bytes]
ValueFn = Callable[[Any], bytes | str]


class RowError(ValueError):
    """A row cannot be loaded (null or oversized key, oversized value)."""


def to_bytes(v: object) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, bytearray):
        return bytes(v)
    if isinstance(v, str):
        return v.encode()
    return str(v).encode()


def key_bytes(v: object) -> bytes:
    if v is None:
        raise RowError("null key")
    return to_bytes(v)


def value_encoder(value_cols: Sequence[str] | None, value_fn: ValueFn | None
                  ) -> Callable[[Any], bytes]:
    """A function from a row (a mapping of column name to value: a dict from an Arrow batch,
    or a Spark Row) to the stored value bytes."""
    if value_fn is not None:
        fn = value_fn

        def by_fn(row: Any) -> bytes:
            out = fn(row)
            return out.encode() if isinstance(out, str) else bytes(out)
        return by_fn
    cols = list(value_cols or [])
    if len(cols) == 1:
        col = cols[0]
        return lambda row: b"" if row[col] is None else to_bytes(row[col])

    def as_json(row: Any) -> bytes:
        return json.dumps({c: row[c] for c in cols}, separators=(",", ":"),
                          default=str, ensure_ascii=False).encode()
    return as_json


def checked_pair(k: bytes, v: bytes) -> Pair:
    """A row that passes the command limits, or ``RowError`` naming the key."""
    try:
        check_key(k)
        check_value(v)
    except ValueError as e:
        raise RowError(f"row with key {k[:60]!r}: {e}") from None
    return k, v


# A batch's bytes at most (keys, values and msgpack's framing): well under the server's
# cap on a command (16 MiB, MAX_COMMAND_BYTES) and the HTTP body it travels in. Rows of
# 24 KB in batches of 1,000 rows were refused as a 413 after the shuffle (found from
# outside); a smaller entry also keeps a follower's AppendEntries within a few messages.
BATCH_BYTES = 4 << 20
_OP_BYTES = 16  # msgpack's framing of one [key, value] op, at most


def cut_batches(rows: Sequence[Pair], max_rows: int,
                max_bytes: int = BATCH_BYTES) -> Iterator[Sequence[Pair]]:
    """Consecutive batches of ``rows``: at most ``max_rows`` rows and ``max_bytes`` bytes
    each (a row alone may not exceed it: keys and values are far smaller). A function of
    its arguments alone, so every attempt of a task cuts the same batches."""
    start, size = 0, 0
    for i, (k, v) in enumerate(rows):
        n = len(k) + len(v) + _OP_BYTES
        if i > start and (i - start >= max_rows or size + n > max_bytes):
            yield rows[start:i]
            start, size = i, 0
        size += n
    if start < len(rows):
        yield rows[start:]


def batch_id(load_id: str, partition: int, number: int, chunk: Sequence[Pair]) -> bytes:
    """The id a batch is applied at most once under: its load, partition and number, and
    a digest of its rows. The digest is what makes skipping safe: a resumed load that cuts
    its batches differently (another ``batch_rows``) or reads a changed input sends its
    batches under ids no earlier attempt used, so only a batch of the very same rows is
    skipped. Without it, a resume with another batch size skipped 8% of the rows as
    "already applied" and reported them stored (found from outside)."""
    digest = hashlib.blake2b(msgpack.packb(chunk, use_bin_type=True), digest_size=12)
    return f"{load_id}/{partition}/{number}/{digest.hexdigest()}".encode()


LOAD_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
