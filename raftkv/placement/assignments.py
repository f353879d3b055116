"""Where a table's data lives: the partition of a key, the replicas of a partition, and
the metastore keys and invokes of Ignite 3's rebalance design.

- ``partition_of(key, partitions)``: a stable hash (BLAKE2b, 64 bits, mod the count).
  The server and the Spark jobs call this same function, so a row is always routed to
  the partition that holds it.
- ``calc_assignments``: rendezvous (highest-random-weight) hashing over the live nodes.
  Each node gets a score per partition and the top ``replicas`` win, so adding or removing
  a node moves only the partitions whose top set it enters or leaves (about 1/n of
  them), and every node computes the same answer without coordination.
- Metastore keys per partition (``<table>.<p>.``): ``assignments.stable|pending|planned``
  hold a sorted, comma-separated node list; ``change.trigger.revision`` the revision of
  the event that last changed them (8 bytes big-endian, so byte order is numeric order).
- ``write_pending_assignments``: step (1) of Ignite's rebalance design as ONE atomic multi-invoke.
- ``rebalance_done``: ``onNewPeersConfigurationApplied``'s invoke.

``write_pending_assignments`` is the seed's literal pseudocode, kept as the reference the
tests pin. It can lose the latest intent (a no-op event leaves a stale planned behind; a
branch that removes planned does not advance the trigger, so a late older event wins), so
the rebalance runs the corrected ``rebalance_steps.plan_rebalance`` instead
(``tests/test_rebalance.py`` shows both failures of the literal text).
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b
from typing import NamedTuple

from raftkv.placement.meta_commands import Cond, Do, If, Op, VersionedValue, encode_revision

# Branch tags of write_pending_assignments (reported by BranchResult.tag).
SKIPPED, PENDING_WRITTEN, PLANNED_WRITTEN, PLANNED_REMOVED = 0, 1, 2, 3
# Branch tags of rebalance_done.
DONE_RETRY, DONE_CLEARED, DONE_PLANNED_MOVED = 0, 1, 2


def hash64(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def partition_of(key: bytes, partitions: int) -> int:
    return partitions_of((key,), partitions)[0]


def partitions_of(keys: Iterable[bytes], partitions: int) -> list[int]:
    """``partition_of`` of many keys (the Spark jobs route a million rows through this):
    the same hash, without a function call per key."""
    if partitions < 1:
        raise ValueError("a table has at least one partition")
    return [int.from_bytes(blake2b(k, digest_size=8).digest(), "big") % partitions
            for k in keys]


def rendezvous(name: str, nodes: Iterable[str]) -> list[str]:
    """``nodes`` by rendezvous (highest-random-weight) score for ``name``, best first."""
    scored = sorted(((hash64(f"{name}/{n}".encode()), n) for n in set(nodes)), reverse=True)
    return [n for _, n in scored]


def calc_assignments(table: str, partition: int, nodes: Iterable[str], replicas: int) -> list[str]:
    """The ``replicas`` nodes with the highest rendezvous score for this partition."""
    return sorted(rendezvous(f"{table}/{partition}", nodes)[:replicas])


def encode_nodes(nodes: Iterable[str]) -> bytes:
    return ",".join(sorted(nodes)).encode()


def decode_nodes(raw: bytes | None) -> list[str]:
    return [n for n in raw.decode().split(",") if n] if raw else []


class PartitionKeys(NamedTuple):
    stable: bytes
    pending: bytes
    planned: bytes
    trigger: bytes
    # Ours: set by the leader before its first removal towards pending, cleared by
    # onRebalanceDone; while set, planned's cancel is refused (rebalance_steps.fence_removals).
    removing: bytes
    # Ours: the (index, term) of the configuration entry the last change ended with,
    # written by its onRebalanceDone once the leader saw it commit (encode_applied); a
    # holder that missed the commit learns it here (SafeRestart._maybe_survive).
    applied: bytes
    # Ours: the epoch of the partition's current history, the incarnation of the first
    # founder of its latest full-partition restart (absent before any). Written by that
    # restart's invoke; every holds-key write is guarded by its revision, so none can
    # name the history before a restart that committed after it was read (SafeRestart).
    epoch: bytes


def partition_keys(table: str, partition: int) -> PartitionKeys:
    base = f"{table}.{partition}".encode()
    return PartitionKeys(
        base + b".assignments.stable", base + b".assignments.pending",
        base + b".assignments.planned", base + b".change.trigger.revision",
        base + b".assignments.removing", base + b".assignments.applied",
        base + b".assignments.epoch",
    )


def encode_applied(index: int, term: int) -> bytes:
    return index.to_bytes(8, "big") + term.to_bytes(8, "big")


def decode_applied(raw: bytes) -> tuple[int, int] | None:
    """The (index, term) of an ``applied`` record; None for anything else."""
    if len(raw) != 16:
        return None
    return int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:], "big")


def write_pending_assignments(keys: PartitionKeys, event_revision: int, calculated: bytes) -> If:
    """Seed 004, step (1)::

        if empty(trigger) || trigger < event.revision:
            if empty(pending) && stable != calcPartAssignments():
                pending = calcPartAssignments(); trigger = event.revision
            else:
                if pending != calcPartAssignments:
                    planned = calcPartAssignments(); trigger = event.revision
                else:
                    remove(planned)
        else:
            skip
    """
    rev = encode_revision(event_revision)
    return If(
        Cond.empty(keys.trigger) | Cond.value(keys.trigger).lt(rev),
        If(
            Cond.empty(keys.pending) & Cond.value(keys.stable).ne(calculated),
            Do(PENDING_WRITTEN, Op.put(keys.pending, calculated), Op.put(keys.trigger, rev)),
            If(
                Cond.value(keys.pending).ne(calculated),
                Do(PLANNED_WRITTEN, Op.put(keys.planned, calculated), Op.put(keys.trigger, rev)),
                Do(PLANNED_REMOVED, Op.remove(keys.planned)),
            ),
        ),
        Do(SKIPPED),
    )


def rebalance_done(keys: PartitionKeys, applied_peers: bytes,
                   planned: VersionedValue | None) -> If:
    """Seed 004, ``onNewPeersConfigurationApplied``::

        stable = appliedPeers
        if empty(planned): pending = empty
        else: pending = planned; remove(planned)

    ``pending = planned`` copies a value the invoke cannot read, so the caller reads
    planned first and the invoke is guarded by its revision: ``DONE_RETRY`` means planned
    moved meanwhile and the caller must read it again and retry. Ours: both branches also
    clear the removal fence (``keys.removing``): the change it fenced is over."""
    seen = 0 if planned is None else planned.mod_revision
    return If(
        Cond.empty(keys.planned),
        Do(DONE_CLEARED, Op.put(keys.stable, applied_peers), Op.put(keys.pending, b""),
           Op.remove(keys.removing)),
        If(
            Cond.revision(keys.planned).eq(seen),
            Do(
                DONE_PLANNED_MOVED,
                Op.put(keys.stable, applied_peers),
                Op.put(keys.pending, b"" if planned is None else planned.value),
                Op.remove(keys.planned),
                Op.remove(keys.removing),
            ),
            Do(DONE_RETRY),
        ),
    )
