"""An order-independent digest of a set of KV rows, shared by every state store.

Replicas (and the Spark verify job) compare a key range by ``(count, digest)``. They must
get the same figures from the same data, whatever the insertion order, the batching or
the store (dict, LMDB, Spark partition), so the digest is a multiset hash:

    row_hash(k, v) = int.from_bytes(blake2b(len(k).to_bytes(4, "big") + k + v,
                                            digest_size=8).digest(), "big")
    digest         = sum(row_hash over the rows) mod 2**64, as 16 lowercase hex chars

The length prefix makes ``(b"ab", b"c")`` and ``(b"a", b"bc")`` different rows. A sum is
commutative, so any order and any partitioning (sum the parts) gives the same result; Spark
can compute it with a plain ``sum`` aggregate.

This detects corruption, divergence and lost or extra rows with overwhelming probability
(64-bit hashes). It is not a cryptographic commitment: an adversary who chooses rows can
find a sum collision far faster than a hash collision (generalized birthday). We only
defend against accidents and bugs.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b
from typing import NamedTuple

_MASK = (1 << 64) - 1


class Digest(NamedTuple):
    # Shadows tuple.count on purpose: the (count, digest) pair is the published interface.
    count: int  # type: ignore[assignment]
    digest: str  # 16 hex chars


EMPTY = Digest(0, "0" * 16)


def row_hash(key: bytes, value: bytes) -> int:
    return int.from_bytes(
        blake2b(len(key).to_bytes(4, "big") + key + value, digest_size=8).digest(), "big"
    )


class DigestBuilder:
    """Accumulates rows one at a time (the snapshot writer and loader stream through it)."""

    __slots__ = ("_acc", "count")

    def __init__(self) -> None:
        self.count = 0
        self._acc = 0

    def add(self, key: bytes, value: bytes) -> None:
        self.count += 1
        # Reduce lazily: Python ints do not overflow, and one mask at the end is cheaper.
        self._acc += row_hash(key, value)

    def result(self) -> Digest:
        return Digest(self.count, f"{self._acc & _MASK:016x}")


def digest_rows(rows: Iterable[tuple[bytes, bytes]]) -> Digest:
    b = DigestBuilder()
    for k, v in rows:
        b.add(k, v)
    return b.result()
