"""A partition's progress as explicit phases (raftkv.placement.partition_state, issue 14
item 5): the leader's change in progress (``ChangePhase``, ``CHANGE_TRANSITIONS``) and how
a replica starts after a restart (``StartPhase``, ``START_TRANSITIONS``). The moves the
module docstring names are allowed, anything else is ``IllegalTransition``."""

from __future__ import annotations

import pytest

from raftkv.placement.assignments import partition_keys
from raftkv.placement.partition_state import (
    CHANGE_TRANSITIONS,
    START_TRANSITIONS,
    Change,
    ChangePhase,
    IllegalTransition,
    PartitionState,
    StartPhase,
)

P = ChangePhase


def change() -> Change:
    return Change(3, frozenset({"n1", "n2", "n3"}), "pending", 0.0)


def test_every_phase_has_a_row() -> None:
    assert set(CHANGE_TRANSITIONS) == set(ChangePhase)


@pytest.mark.parametrize("path", [
    # The one-by-one steps of Kudu's design: trim, add, catch up, remove, done.
    [P.TRIMMING, P.ADDING, P.ADDING, P.CATCHING_UP, P.REMOVING, P.REMOVING, P.APPLIED],
    # The leader removes itself last: a handover, which failed, then again.
    [P.REMOVING, P.HANDING_OVER, P.REMOVING, P.HANDING_OVER],
    # The core readmits a wiped target member (a learner again) after its promotion.
    [P.ADDING, P.CATCHING_UP, P.REMOVING, P.CATCHING_UP, P.APPLIED],
    # ... or a departing voter, now a learner outside the target, to be trimmed.
    [P.REMOVING, P.TRIMMING, P.REMOVING, P.APPLIED],
    # Nothing to do: the configuration already is the target.
    [P.APPLIED],
    # The catch-up timeout drops a silent learner, and adds it again after its
    # hold-off while another learner catches up (placement simulator, liveness seed 20).
    [P.ADDING, P.CATCHING_UP, P.TRIMMING, P.CATCHING_UP, P.ADDING, P.CATCHING_UP],
])
def test_documented_paths_are_legal(path: list[ChangePhase]) -> None:
    ch = change()
    for phase in path:
        ch.move(phase)
    assert ch.phase == path[-1]


@pytest.mark.parametrize("before, after", [
    (P.REMOVING, P.ADDING),  # a target member left the configuration: no one does that
    (P.APPLIED, P.REMOVING),
    (P.HANDING_OVER, P.APPLIED),  # the old leader cannot see the change finish
    (P.TRIMMING, P.NEW),  # only retarget starts over
])
def test_other_moves_are_bugs(before: ChangePhase, after: ChangePhase) -> None:
    ch = change()
    ch.phase = before
    with pytest.raises(IllegalTransition, match=f"{before.name} -> {after.name}"):
        ch.move(after)


def test_a_new_target_starts_over_and_a_late_answer_may_follow() -> None:
    ch = change()
    ch.move(P.REMOVING)
    ch.retarget(frozenset({"n1", "n2"}), "api")
    assert (ch.phase, ch.target, ch.origin) == (P.NEW, frozenset({"n1", "n2"}), "api")
    ch.move(P.HANDING_OVER)  # the answer to the self-removal proposed before the retarget


# ================================================ the start phases (IGNITE-16668) =====
S = StartPhase


def part() -> PartitionState:
    return PartitionState("t", 0, "t.t.0", partition_keys("t", 0))


def test_every_start_phase_has_a_row_and_only_normal_starts() -> None:
    assert set(START_TRANSITIONS) == set(StartPhase)
    assert {p for p in StartPhase if p.restarting} == {S.LOST, S.LEAVING, S.LEFT, S.RECORDED}


@pytest.mark.parametrize("path", [
    # A persistent replica with its log, or a founder's first start.
    [S.NORMAL],
    # A stable member that lost its state, with a majority available: recorded in
    # switch.reduce, removed by the leader, re-added empty.
    [S.LOST, S.RECORDED, S.NORMAL],
    # ... with nobody holding the state: a full-partition restart.
    [S.LOST, S.NORMAL],
    # A pending-only member that lost its state: leave pending, then be re-added.
    [S.LEAVING, S.LEFT, S.NORMAL],
    # Bug C's in-memory case, after a normal start decision.
    [S.NORMAL, S.LOST, S.RECORDED, S.NORMAL],
])
def test_documented_start_paths_are_legal(path: list[StartPhase]) -> None:
    p = part()
    for phase in path:
        p.move(phase)
    assert p.start == path[-1]


@pytest.mark.parametrize("before, after", [
    (S.RECORDED, S.LOST),  # recorded once; the leader's removal is what comes next
    (S.LEFT, S.LEAVING),
    (S.NORMAL, S.RECORDED),  # only a lost replica records itself
    (S.NORMAL, S.UNDECIDED),  # decided once per incarnation
])
def test_other_start_moves_are_bugs(before: StartPhase, after: StartPhase) -> None:
    p = part()
    p.start = before
    with pytest.raises(IllegalTransition, match=f"{before.name} -> {after.name}"):
        p.move(after)
