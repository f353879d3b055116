"""The metastore invokes the rebalance manager runs, each one atomic If tree.

- ``plan_rebalance``: seed 004 step (1), with two fixes to the literal pseudocode (which
  ``assignments.write_pending_assignments`` reproduces exactly). Both fixes are about the
  seed's own promise that the *latest* intent wins:

  1. With pending empty and stable already equal to the calculated assignment, the
     literal text falls into the ``else`` branch and writes *planned* (pending is empty,
     so ``pending != calc``). That planned value is stale as soon as another event
     arrives: a later event writes pending (the first branch, which leaves planned
     alone), and when that rebalance finishes, ``onNewPeersConfigurationApplied`` moves
     the stale planned into pending, undoing the newer intent. Here that case records
     the trigger and drops planned (Approach 1 of the seed skips it likewise), and the
     pending branch drops any planned too.
  2. The branch "pending already equals calc: remove(planned)" leaves the trigger
     revision where it was. An *older* event processed late by a slower node then still
     passes ``trigger < event.revision`` and writes its stale assignment as planned,
     overriding the newer event that had just cancelled it. Here that branch also
     records ``trigger = event.revision``.

  Tags: assignments' SKIPPED, PENDING_WRITTEN, PLANNED_WRITTEN, PLANNED_REMOVED, plus
  ``ALREADY_PLACED`` for fix 1.

- ``finish_rebalance``: ``onNewPeersConfigurationApplied`` (``assignments.rebalance_done``)
  guarded by ``pending == applied peers``. Without the guard, a leader that finishes late
  (say a new leader re-running it after the first one's invoke already succeeded and a new
  rebalance wrote pending) would set stable back and clear the newer pending.
  ``DONE_STALE``: pending no longer names these peers; nothing was written.

- ``move_planned_to_pending``: Approach 2's "move planned peers to pending", guarded by the
  revisions of both keys as the caller read them (``MOVE_RETRY``: re-read and decide again).
"""

from __future__ import annotations

from raftkv.placement.assignments import (
    PENDING_WRITTEN,
    PLANNED_REMOVED,
    PLANNED_WRITTEN,
    SKIPPED,
    PartitionKeys,
    rebalance_done,
)
from raftkv.placement.meta_commands import Cond, Do, If, Op, VersionedValue, encode_revision

ALREADY_PLACED = 4
DONE_STALE = 3
MOVE_RETRY, MOVED = 0, 1


def plan_rebalance(keys: PartitionKeys, event_revision: int, calculated: bytes) -> If:
    """Seed 004 step (1) with the fixes in the module docstring::

        if empty(trigger) || trigger < event.revision:
            if empty(pending):
                if stable != calc: pending = calc; trigger = rev; remove(planned)
                else:              trigger = rev; remove(planned)          # fix 1
            else:
                if pending != calc: planned = calc; trigger = rev
                else:               remove(planned); trigger = rev         # fix 2
        else: skip
    """
    rev = encode_revision(event_revision)
    return If(
        Cond.empty(keys.trigger) | Cond.value(keys.trigger).lt(rev),
        If(
            Cond.empty(keys.pending),
            If(
                Cond.value(keys.stable).ne(calculated),
                Do(PENDING_WRITTEN, Op.put(keys.pending, calculated), Op.put(keys.trigger, rev),
                   Op.remove(keys.planned)),
                Do(ALREADY_PLACED, Op.put(keys.trigger, rev), Op.remove(keys.planned)),
            ),
            If(
                Cond.value(keys.pending).ne(calculated),
                Do(PLANNED_WRITTEN, Op.put(keys.planned, calculated), Op.put(keys.trigger, rev)),
                Do(PLANNED_REMOVED, Op.remove(keys.planned), Op.put(keys.trigger, rev)),
            ),
        ),
        Do(SKIPPED),
    )


def finish_rebalance(keys: PartitionKeys, applied_peers: bytes,
                     planned: VersionedValue | None) -> If:
    """``rebalance_done`` if pending still names ``applied_peers``, else ``DONE_STALE``."""
    return If(
        Cond.value(keys.pending).eq(applied_peers),
        rebalance_done(keys, applied_peers, planned),
        Do(DONE_STALE),
    )


def move_planned_to_pending(keys: PartitionKeys, pending: VersionedValue,
                            planned: VersionedValue) -> If:
    """Approach 2: ``pending = planned; remove(planned)`` if neither moved since read."""
    return If(
        Cond.revision(keys.pending).eq(pending.mod_revision)
        & Cond.revision(keys.planned).eq(planned.mod_revision),
        Do(MOVED, Op.put(keys.pending, planned.value), Op.remove(keys.planned)),
        Do(MOVE_RETRY),
    )
