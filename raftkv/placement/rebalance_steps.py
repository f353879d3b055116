"""The metastore invokes the rebalance manager runs, each one atomic If tree.

- ``plan_rebalance``: step (1) of Ignite's rebalance design, with two fixes to the literal
  pseudocode (which
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

- IGNITE-16668 (in-memory restart, see ``safe_restart.py``): ``switch_keys``,
  ``add_to_switch_reduce`` (the restarting node's invoke), ``trigger_switch_reduce`` (the
  leader's watch on ``switch.reduce``) and ``rebalance_done_switch`` (onRebalanceDone with
  the switch keys, the four retry preconditions and the planned revision).

- ``move_planned_to_pending``: Approach 2's "move planned peers to pending", guarded by the
  revisions of both keys as the caller read them (``MOVE_RETRY``: re-read and decide again),
  and refused while the removal fence is set (ours).

- ``fence_removals`` (ours): the leader's invoke before the first removal of a change
  towards pending. A cancel is decided on the leader's view ("some pending member is not
  yet a voter") but applies later, in the metastore; one issued by a leader that then
  lost its term could apply after its successor began removing voters towards the old
  pending, and the pending it writes would no longer say who may have been removed (a
  review of the survivor rule found that; ``safe_restart``'s (B) rests on it). With the
  fence set and committed before any removal, a cancel that applies later is refused
  whatever its sender saw. onRebalanceDone clears it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from raftkv.placement.assignments import (
    DONE_CLEARED,
    DONE_PLANNED_MOVED,
    DONE_RETRY,
    PENDING_WRITTEN,
    PLANNED_REMOVED,
    PLANNED_WRITTEN,
    SKIPPED,
    PartitionKeys,
    decode_nodes,
    encode_applied,
    encode_nodes,
    rebalance_done,
)
from raftkv.placement.meta_commands import (
    Cond,
    Condition,
    Do,
    If,
    Op,
    VersionedValue,
    encode_revision,
)

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
                            planned: VersionedValue, keep: Iterable[str] = ()) -> If:
    """Approach 2: ``pending = planned ∪ keep; remove(planned)`` if neither moved since
    read. ``keep``: as in ``leave_pending_for_switch_reduce`` (ours)."""
    value = encode_nodes(_nodes(planned) | set(keep)) if keep else planned.value
    return If(
        Cond.revision(keys.pending).eq(pending.mod_revision)
        & Cond.revision(keys.planned).eq(planned.mod_revision)
        & Cond.not_exists(keys.removing),
        Do(MOVED, Op.put(keys.pending, value), Op.remove(keys.planned)),
        Do(MOVE_RETRY),
    )


FENCED, FENCE_STALE = 8, 9


def fence_removals(keys: PartitionKeys, pending: VersionedValue) -> If:
    """``removing = pending's revision`` if pending has not moved since read (module
    docstring): from then on until onRebalanceDone, planned's cancel is refused.
    ``FENCE_STALE``: pending moved; the leader re-reads it and retargets."""
    return If(Cond.revision(keys.pending).eq(pending.mod_revision),
              Do(FENCED, Op.put(keys.removing, encode_revision(pending.mod_revision))),
              Do(FENCE_STALE))


# ====================================================== IGNITE-16668: the switch keys =====
# Tags of trigger_switch_reduce (SKIPPED: nothing written).
SWITCH_PENDING_WRITTEN = 5
# Tags of rebalance_done_switch (besides DONE_RETRY / DONE_CLEARED / DONE_PLANNED_MOVED).
DONE_SWITCH_APPEND, DONE_SWITCH_REDUCE, DONE_REPLANNED = 6, 7, 8


class SwitchKeys(NamedTuple):
    reduce: bytes
    append: bytes


def switch_keys(table: str, partition: int) -> SwitchKeys:
    base = f"{table}.{partition}.assignments.switch.".encode()
    return SwitchKeys(base + b"reduce", base + b"append")


def _rev(v: VersionedValue | None) -> int:
    return 0 if v is None else v.mod_revision


def _nodes(v: VersionedValue | None) -> set[str]:
    return set(decode_nodes(v.value if v is not None else None))


def _put_or_remove(key: bytes, nodes: Iterable[str]) -> Op:
    raw = encode_nodes(nodes)
    return Op.put(key, raw) if raw else Op.remove(key)


def add_to_switch_reduce(sw: SwitchKeys, node: str, read: VersionedValue | None) -> If:
    """The restarting node's step, one iteration of the seed's retry loop::

        if read is empty:  if empty(switch.reduce): switch.reduce = read ∪ {node}
        else:              if revision(switch.reduce) == read.revision: ... the same

    Tag 1: written; 0: the key moved since ``read`` (read again and retry)."""
    calc = encode_nodes(_nodes(read) | {node})
    cond: Condition
    if read is None or not read.value:
        cond = Cond.empty(sw.reduce)
    else:
        cond = Cond.revision(sw.reduce).eq(read.mod_revision)
    return If(cond, Do(1, Op.put(sw.reduce, calc)), Do(0))


def leave_pending_for_switch_reduce(keys: PartitionKeys, sw: SwitchKeys,
                                    nodes: Iterable[str], pending: VersionedValue,
                                    reduce: VersionedValue | None,
                                    keep: Iterable[str] = ()) -> If:
    """Ours (IGNITE-16668 is silent), for two cases:

    - a node that lost its state (and vote) while it was assigned only in *pending* (a
      learner, or a voter promoted before onRebalanceDone named it in stable) must not
      rejoin as that member either (the restarted node runs this for itself);
    - pending names a node of switch.reduce (say a cancel moved a planned assignment
      naming it into pending after it was removed, or it lost its state as a voter the
      change counts on): the change would wait for it to catch up as a learner, or
      count it in the quorum of the target, while it waits, not started, to be removed
      (the leader runs this).

    One invoke, guarded by the revisions of pending and switch.reduce::

        pending = pending - nodes ∪ keep; switch.reduce = switch.reduce ∪ nodes

    ``keep`` is the leader itself when it is the lone holder of a two-member stable
    (``ChangePeers._lone_holder``). The leader retargets its change to the new pending, which removes ``nodes`` from the
    configuration; onRebalanceDone (``rebalance_done_switch``) then finds them in
    ``reduced`` and re-adds them through switch.append as fresh learners.

    Tag 1: written; 0: a key moved since it was read (read again and retry)."""
    out = set(nodes)
    rest = (_nodes(pending) - out) | set(keep)
    cond = Cond.revision(keys.pending).eq(pending.mod_revision) & (
        Cond.empty(sw.reduce) if reduce is None or not reduce.value
        else Cond.revision(sw.reduce).eq(reduce.mod_revision))
    return If(cond, Do(1, Op.put(keys.pending, encode_nodes(rest)),
                       Op.put(sw.reduce, encode_nodes(_nodes(reduce) | out))), Do(0))


def trigger_switch_reduce(keys: PartitionKeys, sw: SwitchKeys, reduce: VersionedValue,
                          calc_part_assignments: Iterable[str],
                          stable: VersionedValue | None, keep: Iterable[str] = ()) -> If:
    """The leader's watch on ``switch.reduce`` (event.revision = the key's revision)::

        calculated = calcPartAssignments() - switch.reduce ∪ keep
        if (empty(trigger) || trigger < event.revision
            || revision(switch.reduce) == event.revision && revision(stable) == seen):
            if empty(pending): pending = calculated; trigger = event.revision

    The third alternative of the outer condition is ours: the trigger key is shared with
    the Ignite rebalance design's step (1), which may move it past the reduce event without
    handling it (an
    ALREADY_PLACED topology event right after the reduce); the reduce would then never
    be acted on. "reduce and stable unchanged since read" still runs the reduce once: the
    invoke makes pending non-empty, and the rebalance it starts rewrites stable. The
    trigger is written only if it would not go backwards. ``keep``: as in
    ``leave_pending_for_switch_reduce`` (ours too)."""
    rev = encode_revision(reduce.mod_revision)
    calculated = encode_nodes((set(calc_part_assignments) - _nodes(reduce)) | set(keep))
    fresh = Cond.empty(keys.trigger) | Cond.value(keys.trigger).lt(rev)
    again = (Cond.revision(sw.reduce).eq(reduce.mod_revision)
             & Cond.revision(keys.stable).eq(_rev(stable)))
    return If(
        Cond.empty(keys.pending),
        If(fresh,
           Do(SWITCH_PENDING_WRITTEN, Op.put(keys.pending, calculated),
              Op.put(keys.trigger, rev)),
           If(again, Do(SWITCH_PENDING_WRITTEN, Op.put(keys.pending, calculated)),
              Do(SKIPPED))),
        Do(SKIPPED),
    )


class SwitchDone(NamedTuple):
    tree: If | Do | None  # None: pending no longer names these peers (DONE_STALE)
    resolved_stable: list[str]
    reduce: list[str]
    append: list[str]
    pending: list[str]  # what pending becomes ([] in the common branch without planned)


def _applied_ops(keys: PartitionKeys, committed: tuple[int, int] | None) -> list[Op]:
    return [] if committed is None else [Op.put(keys.applied, encode_applied(*committed))]


def rebalance_done_switch(
    keys: PartitionKeys, sw: SwitchKeys, new_peers: Iterable[str],
    stable: VersionedValue | None, pending: VersionedValue | None,
    planned: VersionedValue | None, reduce: VersionedValue | None,
    append: VersionedValue | None, calc_part_assignments: Iterable[str],
    committed: tuple[int, int] | None = None,
    trigger: VersionedValue | None = None, calc_exact: bool = True,
) -> SwitchDone:
    """IGNITE-16668 onRebalanceDone, one iteration of its retry loop (the caller reads the
    five keys, runs the tree, and on ``DONE_RETRY`` reads again)::

        reduced   = switch.reduce - resolvedStable
        added     = resolvedStable - stable
        reduce'   = switch.reduce - reduced
        append'   = ((switch.append ∪ reduced) - added) ∩ calc      (- resolvedStable, ours)
        pendingReduction = resolvedStable - switch.reduce
        pendingAddition  = (resolvedStable ∪ reduced) ∩ calc             (∪ append', ours)
        <pre> = revisions of stable, pending, switch.reduce, switch.append (and planned)
        if append' != {}:   if <pre>: stable, pending = resolvedStable, pendingAddition;
                                      switch.reduce = reduce'; switch.append = append'
        elif reduce' != {}: if <pre>: stable, pending = resolvedStable, pendingReduction; ...
        else:               if <pre>: common done (pending = planned or empty) + append'
                            (ours: pending = calc if nothing is planned and the resolved
                            stable is not calc, with no lost node in it: see below)

    Ours, where the seed is silent: the planned revision joins the preconditions (the
    common branch copies planned, a value the invoke cannot read); nothing is written
    unless pending still names ``new_peers`` (a late duplicate is DONE_STALE, as in
    ``finish_rebalance``); ``append'`` also drops nodes already in resolvedStable (else
    a no-op "addition" would repeat forever); pendingAddition names every node of
    ``append'``, not only those reduced now (one whose re-add a cancel dropped from
    pending would otherwise stay in switch.append with nothing adding it: placement
    simulator seed 2902); a reduction that would empty pending
    falls to the common branch (a group needs a voter); every write clears the removal
    fence (``fence_removals``) and records ``committed``, the (index, term) of the
    configuration entry the change ended with (``PartitionKeys.applied``)."""
    resolved = set(new_peers)
    calc = set(calc_part_assignments)
    if _nodes(pending) != resolved:
        return SwitchDone(None, sorted(resolved), [], [], [])
    red, app, st = _nodes(reduce), _nodes(append), _nodes(stable)
    reduced = red - resolved
    added = resolved - st
    calc_reduce = red - reduced
    calc_append = ((app | reduced) - added - resolved) & calc
    pending_reduction = resolved - red
    # The seed's (resolvedStable ∪ reduced) ∩ calc, plus append': a node left in
    # switch.append by an earlier onRebalanceDone whose re-add a cancel took out of
    # pending (Approach 2 moved a planned without it in) is neither reduced nor added
    # now. Left out, this branch wrote pending = resolvedStable, that change finished
    # at once and ran this branch again, for ever, and planned never moved in
    # (placement simulator seed 2902).
    pending_addition = ((resolved | reduced) & calc) | calc_append
    pre = (Cond.revision(keys.stable).eq(_rev(stable))
           & Cond.revision(keys.pending).eq(_rev(pending))
           & Cond.revision(sw.reduce).eq(_rev(reduce))
           & Cond.revision(sw.append).eq(_rev(append))
           & Cond.revision(keys.planned).eq(_rev(planned)))
    new_stable = encode_nodes(resolved)
    switch_ops = (_put_or_remove(sw.reduce, calc_reduce), _put_or_remove(sw.append, calc_append))
    if calc_append:
        tag, new_pending = DONE_SWITCH_APPEND, pending_addition
    elif calc_reduce and pending_reduction:
        tag, new_pending = DONE_SWITCH_REDUCE, pending_reduction
    else:
        has_planned = planned is not None and bool(planned.value)
        # Ours: nothing planned, yet the change ended away from calc, with no lost node in
        # it (a lone holder kept itself in the pending it wrote, ``ChangePeers._lone_holder``).
        # Step (1) runs only on a newer trigger, and none may come: plan calc now, as its
        # first branch would (placement simulator seed 5176: stable [n2, n3, n4, n5] for
        # calc [n3, n4, n5], for good, after n2 kept itself through a cancel).
        # Only from a calc read from the topology and the descriptor (``calc_exact``), and
        # only if no step (1) ran since the read (the trigger, which every step (1) but a
        # skipped one writes, unchanged): a newer trigger finding pending equal to its
        # calc writes nothing else, and this invoke would then undo it (review finding).
        replan = (calc_exact and not has_planned and not calc_reduce and bool(calc)
                  and resolved != calc)
        if replan:
            pre = pre & Cond.revision(keys.trigger).eq(_rev(trigger))
        tag = (DONE_PLANNED_MOVED if has_planned else DONE_REPLANNED if replan
               else DONE_CLEARED)
        ops = [Op.put(keys.stable, new_stable)]
        if has_planned:
            assert planned is not None
            ops += [Op.put(keys.pending, planned.value), Op.remove(keys.planned)]
            next_pending = sorted(_nodes(planned))
        else:
            next_pending = sorted(calc) if replan else []
            ops.append(Op.put(keys.pending, encode_nodes(next_pending) if replan else b""))
        tree = If(pre, Do(tag, *ops, *switch_ops, Op.remove(keys.removing),
                          *_applied_ops(keys, committed)), Do(DONE_RETRY))
        return SwitchDone(tree, sorted(resolved), sorted(calc_reduce), sorted(calc_append),
                          next_pending)
    tree = If(pre, Do(tag, Op.put(keys.stable, new_stable),
                      Op.put(keys.pending, encode_nodes(new_pending)), *switch_ops,
                      Op.remove(keys.removing), *_applied_ops(keys, committed)),
              Do(DONE_RETRY))
    return SwitchDone(tree, sorted(resolved), sorted(calc_reduce), sorted(calc_append),
                      sorted(new_pending))
