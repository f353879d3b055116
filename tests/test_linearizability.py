"""Tests for the WGL linearizability checker in raftkv.testing.linearizability."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from raftkv.testing.linearizability import (
    CheckResult,
    Operation,
    check_history,
    check_key,
)

INF = math.inf


def put(client: int, call: float, ret: float, value: object, key: str = "k") -> Operation:
    return Operation(client, call, ret, "put", key, value)


def get(client: int, call: float, ret: float, output: object, key: str = "k") -> Operation:
    return Operation(client, call, ret, "get", key, output=output)


def cas(
    client: int,
    call: float,
    ret: float,
    expected: object,
    new: object,
    swapped: bool | None,
    key: str = "k",
) -> Operation:
    return Operation(client, call, ret, "cas", key, (expected, new), swapped)


def delete(client: int, call: float, ret: float, key: str = "k") -> Operation:
    return Operation(client, call, ret, "delete", key)


# --- histories that are linearizable ---------------------------------------------


def test_sequential_history_is_linearizable() -> None:
    history = [
        put(0, 0, 1, "a"),
        get(1, 2, 3, "a"),
        cas(0, 4, 5, "a", "b", True),
        cas(1, 6, 7, "a", "c", False),
        get(0, 8, 9, "b"),
        delete(1, 10, 11),
        get(0, 12, 13, None),
        cas(1, 14, 15, None, "d", True),
        get(0, 16, 17, "d"),
    ]
    assert check_history(history).ok


@pytest.mark.parametrize("observed", ["old", "new"])
def test_read_overlapping_a_write_may_see_old_or_new_value(observed: str) -> None:
    history = [put(0, 0, 1, "old"), put(0, 2, 10, "new"), get(1, 3, 4, observed)]
    assert check_history(history).ok


@pytest.mark.parametrize("winner", [1, 2])
def test_concurrent_cas_race_exactly_one_wins(winner: int) -> None:
    history = [
        put(0, 0, 1, "v0"),
        cas(1, 2, 6, "v0", "v1", winner == 1),
        cas(2, 3, 5, "v0", "v2", winner == 2),
        get(0, 7, 8, f"v{winner}"),
    ]
    assert check_history(history).ok


def test_unknown_outcome_put_observed_later_is_linearizable() -> None:
    history = [put(0, 0, INF, "maybe"), get(1, 5, 6, "maybe"), get(1, 7, 8, "maybe")]
    assert check_history(history).ok


def test_unknown_outcome_put_never_observed_is_linearizable() -> None:
    history = [put(0, 0, 1, "a"), put(1, 2, INF, "lost"), get(0, 5, 6, "a"), get(0, 7, 8, "a")]
    assert check_history(history).ok


def test_unknown_outcome_put_may_take_effect_between_reads() -> None:
    history = [put(0, 0, INF, "late"), get(1, 1, 2, None), get(1, 50, 51, "late")]
    assert check_history(history).ok


def test_unknown_outcome_cas_may_succeed_or_be_omitted() -> None:
    applied = [put(0, 0, 1, "a"), cas(1, 2, INF, "a", "b", None), get(0, 3, 4, "b")]
    omitted = [put(0, 0, 1, "a"), cas(1, 2, INF, "a", "b", None), get(0, 3, 4, "a")]
    assert check_history(applied).ok
    assert check_history(omitted).ok


def test_unknown_outcome_read_imposes_no_constraint() -> None:
    history = [put(0, 0, 1, "a"), get(1, 2, INF, "garbage"), get(0, 3, 4, "a")]
    assert check_history(history).ok


def test_history_of_only_unknown_outcomes_is_linearizable() -> None:
    assert check_key([put(0, 0, INF, "a"), cas(1, 1, INF, "a", "b", None)]).ok


def test_multiple_independent_keys_are_linearizable() -> None:
    history = [
        put(0, 0, 1, "x1", key="x"),
        put(1, 0, 1, "y1", key="y"),
        get(0, 2, 3, "y1", key="y"),
        get(1, 2, 3, "x1", key="x"),
        delete(0, 4, 5, key="x"),
        get(1, 6, 7, None, key="x"),
    ]
    assert check_history(history).ok


def test_initial_values_seed_each_key() -> None:
    history = [get(0, 0, 1, "seed", key="x"), get(0, 2, 3, None, key="y")]
    assert check_history(history, initial={"x": "seed"}).ok
    assert not check_history(history).ok


def test_return_and_call_at_equal_time_are_concurrent() -> None:
    # The read is invoked at the instant the write returns; equal timestamps are
    # treated as overlapping, so the read may still be ordered before the write.
    assert check_history([put(0, 0, 5, "a"), get(1, 5, 6, None)]).ok


def test_empty_history_is_linearizable() -> None:
    assert check_history([]) == CheckResult(True, None, "linearizable: 0 ops over 0 keys")


# --- histories that are not linearizable -----------------------------------------


def test_stale_read_after_completed_write_is_not_linearizable() -> None:
    history = [put(0, 0, 1, "old"), put(0, 2, 3, "new"), get(1, 4, 5, "old")]
    result = check_history(history)
    assert not result.ok and not result.undecided
    assert result.key == "k"


def test_two_concurrent_cas_with_same_expected_cannot_both_succeed() -> None:
    history = [
        put(0, 0, 1, "v0"),
        cas(1, 2, 6, "v0", "v1", True),
        cas(2, 3, 5, "v0", "v2", True),
    ]
    assert not check_history(history).ok


def test_read_of_value_never_written_is_not_linearizable() -> None:
    history = [put(0, 0, 1, "a"), get(1, 0, 2, "ghost")]
    assert not check_history(history).ok


def test_read_going_back_in_time_is_not_linearizable() -> None:
    history = [
        put(0, 0, 1, "v1"),
        put(0, 2, 10, "v2"),
        get(1, 3, 4, "v2"),
        get(1, 5, 6, "v1"),
    ]
    assert not check_history(history).ok


def test_known_cas_failure_contradicting_state_is_not_linearizable() -> None:
    history = [put(0, 0, 1, "a"), cas(1, 2, 3, "a", "b", False)]
    assert not check_history(history).ok


def test_unknown_outcome_write_cannot_take_effect_before_its_call() -> None:
    history = [get(1, 0, 1, "early"), put(0, 2, INF, "early")]
    assert not check_history(history).ok


def test_violation_on_one_key_is_reported_among_linearizable_keys() -> None:
    history = [
        put(0, 0, 1, "a1", key="a"),
        get(1, 2, 3, "a1", key="a"),
        put(0, 0, 1, "b1", key="b"),
        put(0, 2, 3, "b2", key="b"),
        get(1, 4, 5, "b1", key="b"),
        put(2, 0, 1, "c1", key="c"),
        get(2, 2, 3, "c1", key="c"),
    ]
    result = check_history(history)
    assert not result.ok and not result.undecided
    assert result.key == "b"


def test_failure_detail_lists_history_and_longest_prefix() -> None:
    history = [put(0, 0, 1, "old"), put(0, 2, 3, "new"), get(1, 4, 5, "old")]
    detail = check_key(history).detail
    assert "'k' is not linearizable" in detail
    assert "#2 client 1 [4, 5] get() -> 'old'" in detail
    assert "longest linearizable prefix found (2 of 3 ops)" in detail
    assert "=> 'new'" in detail


def test_exhausted_search_budget_is_reported_as_undecided() -> None:
    history = [put(0, 0, 1, "old"), put(0, 2, 3, "new"), get(1, 4, 5, "old")]
    result = check_history(history, max_steps=1)
    assert not result.ok
    assert result.undecided
    assert result.detail.startswith("undecided: search budget exhausted")


def test_definite_violation_is_preferred_over_undecided_key() -> None:
    # "slow" needs three steps to linearize; "bad" is refuted in two.
    slow = [put(0, 0, 1, "a", key="slow"), put(0, 2, 3, "b", key="slow")]
    slow.append(get(1, 4, 5, "b", key="slow"))
    bad = [get(1, 0, 1, "zz", key="bad")]
    assert check_history(slow, max_steps=2).undecided
    result = check_history(slow + bad, max_steps=2)
    assert result.key == "bad" and not result.undecided


def test_check_key_rejects_ops_of_several_keys() -> None:
    with pytest.raises(ValueError):
        check_key([put(0, 0, 1, "a", key="x"), put(0, 0, 1, "a", key="y")])


def test_operation_returning_before_its_call_is_rejected() -> None:
    with pytest.raises(ValueError):
        check_key([put(0, 5, 1, "a")])


def test_unhashable_values_compare_by_equality() -> None:
    history = [put(0, 0, 1, [1, 2]), get(1, 2, 3, [1, 2]), cas(0, 4, 5, [1, 2], [3], True)]
    assert check_history(history).ok
    assert not check_history([*history, get(1, 6, 7, [1, 2])]).ok


# --- generated histories ---------------------------------------------------------

NEVER_WRITTEN = "never-written"


def random_history(
    rng: random.Random,
    n_ops: int,
    keys: tuple[str, ...] = ("a", "b", "c"),
    clients: int = 4,
    unknown_rate: float = 0.1,
    phantoms: int = 2,
) -> list[Operation]:
    """A concurrent history that is linearizable by construction.

    Ops are executed sequentially against a dict; op ``i`` takes effect at time
    ``i``.  Each client's ops get intervals around their effect times that never
    overlap each other, so the sequential order is a valid linearization.  Some
    writes and reads lose their response (ret=inf); a few "phantom" writes with
    unknown outcome never take effect at all.
    """
    model: dict[str, object] = {}
    written: dict[str, list[object]] = {key: [None] for key in keys}
    steps: list[tuple[int, str, str, object, object]] = []
    for i in range(n_ops):
        key = rng.choice(keys)
        kind = rng.choice(("put", "get", "cas", "delete"))
        current = model.get(key)
        value: object = None
        output: object = None
        if kind == "put":
            value = f"v{i}"
            model[key] = value
            written[key].append(value)
        elif kind == "delete":
            model.pop(key, None)
        elif kind == "get":
            output = current
        else:
            expected = current if rng.random() < 0.5 else rng.choice(written[key])
            value = (expected, f"v{i}")
            output = expected == current
            if output:
                model[key] = f"v{i}"
                written[key].append(f"v{i}")
        steps.append((rng.randrange(clients), kind, key, value, output))

    by_client: dict[int, list[int]] = {}
    for i, (client, *_) in enumerate(steps):
        by_client.setdefault(client, []).append(i)

    history: list[Operation] = []
    for client, points in by_client.items():
        low = float(points[0] - 1)
        for n, point in enumerate(points):
            upper = float(points[n + 1]) if n + 1 < len(points) else point + 5.0
            call = min(float(point), low + rng.random() * (point - low))
            ret = min(upper, max(float(point), point + rng.random() * (upper - point)))
            low = ret
            _, kind, key, value, output = steps[point]
            if rng.random() < unknown_rate:
                ret = INF
            history.append(Operation(client, call, ret, kind, key, value, output))

    for j in range(phantoms):
        kind = rng.choice(("put", "delete", "cas"))
        key = rng.choice(keys)
        value = {"put": f"phantom{j}", "delete": None, "cas": (None, f"phantom{j}")}[kind]
        call = rng.uniform(0, max(n_ops, 1))
        history.append(Operation(clients + j, call, INF, kind, key, value))
    rng.shuffle(history)
    return history


@settings(max_examples=200, deadline=None)
@given(rng=st.randoms(use_true_random=False), n_ops=st.integers(0, 40))
def test_history_built_from_sequential_execution_is_linearizable(
    rng: random.Random, n_ops: int
) -> None:
    history = random_history(rng, n_ops)
    result = check_history(history)
    assert result.ok, result.detail


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(rng=st.randoms(use_true_random=False), n_ops=st.integers(4, 40), pick=st.integers(0))
def test_read_of_value_never_written_is_detected_in_generated_history(
    rng: random.Random, n_ops: int, pick: int
) -> None:
    history = random_history(rng, n_ops)
    reads = [i for i, op in enumerate(history) if op.kind == "get" and op.known]
    assume(reads)
    victim = reads[pick % len(reads)]
    history[victim] = replace(history[victim], output=NEVER_WRITTEN)
    result = check_history(history)
    assert not result.ok and not result.undecided
    assert result.key == history[victim].key


def test_long_single_key_history_with_five_clients_is_checked() -> None:
    history = random_history(random.Random(20240611), 300, keys=("hot",), clients=5)
    result = check_history(history)
    assert result.ok, result.detail


def test_long_single_key_history_with_a_corrupt_late_read_is_refuted() -> None:
    # Refuting needs the whole search space before the last read explored, with
    # some thirty unknown-outcome ops available throughout: the costly case.
    history = random_history(random.Random(12), 300, keys=("hot",), clients=5)
    reads = [i for i, op in enumerate(history) if op.kind == "get" and op.known]
    victim = max(reads, key=lambda i: history[i].call)
    history[victim] = replace(history[victim], output=NEVER_WRITTEN)
    result = check_history(history)
    assert not result.ok and not result.undecided


# --- cross-check against exhaustive search --------------------------------------


def brute_force_linearizable(ops: list[Operation], initial: object = None) -> bool:
    """Exhaustive search over every real-time-respecting order: a reference oracle."""

    def apply(op: Operation, state: object) -> tuple[bool, object]:
        if op.kind == "put":
            return True, op.value
        if op.kind == "delete":
            return True, None
        if op.kind == "get":
            return (not op.known or op.output == state), state
        assert isinstance(op.value, tuple)
        expected, new = op.value
        swapped = expected == state
        if op.known and op.output is not swapped:
            return False, state
        return True, new if swapped else state

    def search(remaining: frozenset[int], state: object) -> bool:
        if all(not ops[i].known for i in remaining):
            return True
        for i in remaining:
            if any(ops[j].ret < ops[i].call for j in remaining):
                continue
            accepted, new_state = apply(ops[i], state)
            if accepted and search(remaining - {i}, new_state):
                return True
        return False

    return search(frozenset(range(len(ops))), initial)


_VALUES = (None, "x", "y", "z")


@st.composite
def arbitrary_single_key_histories(draw: st.DrawFn) -> list[Operation]:
    """Small histories with random outcomes, so both verdicts are common."""
    ops = []
    for client in range(draw(st.integers(0, 7))):
        call = draw(st.integers(0, 10))
        ret = INF if draw(st.integers(0, 3)) == 0 else call + draw(st.integers(0, 4))
        kind = draw(st.sampled_from(("put", "get", "cas", "delete")))
        value: object = None
        output: object = None
        if kind == "put":
            value = draw(st.sampled_from(_VALUES[1:]))
        elif kind == "get":
            output = draw(st.sampled_from(_VALUES))
        elif kind == "cas":
            value = (draw(st.sampled_from(_VALUES)), draw(st.sampled_from(_VALUES[1:])))
            output = draw(st.booleans())
        ops.append(Operation(client, float(call), float(ret), kind, "k", value, output))
    return ops


@settings(max_examples=500, deadline=None)
@given(ops=arbitrary_single_key_histories(), initial=st.sampled_from(_VALUES))
def test_verdict_agrees_with_exhaustive_search(ops: list[Operation], initial: object) -> None:
    result = check_key(ops, initial)
    assert not result.undecided
    assert result.ok == brute_force_linearizable(ops, initial), result.detail
