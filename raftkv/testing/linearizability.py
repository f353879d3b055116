"""Linearizability checker for key-value histories.

What is checked
---------------
A *history* is a set of operations, each with an invocation time (``call``), a
response time (``ret``) and an observed outcome.  It is *linearizable* with
respect to a sequential model iff every operation can be assigned a single
instant (its *linearization point*) inside its ``[call, ret]`` interval such
that executing the operations one at a time in the order of those points, on
the sequential model, yields exactly the observed outcomes.  Equivalently: there
is a total order of the operations that (a) respects real time -- if
``a.ret < b.call`` then ``a`` comes before ``b`` -- and (b) is a legal
sequential execution of the model.

The model here is a map of independent registers.  Per key: ``put(v)`` sets the
register, ``delete`` clears it (``None`` means absent), ``get`` returns the
current value and ``cas((expected, new))`` swaps iff the register equals
``expected`` and reports whether it did.

Why per-key partitioning is sound
---------------------------------
Linearizability is *local* (Herlihy & Wing, 1990): a history over several
objects is linearizable iff each object's sub-history is.  The keys of the
store are independent objects -- no operation reads or writes two keys -- so a
global linearization can be assembled by interleaving per-key linearizations
along real time, and conversely any global linearization restricts to a
per-key one.  Checking keys separately turns one search whose cost is
exponential in the total concurrency into several much smaller ones.

How the search works (Wing & Gong, with Lowe's cache, as in porcupine)
-----------------------------------------------------------------------
Every operation contributes a call event and a return event, kept in a doubly
linked list sorted by time.  The search walks the list from the front:

* On a call event it tries to linearize that operation *now*: apply it to the
  current model state, and if the model accepts the observed outcome, remove
  ("lift") the call and its return from the list, push the operation and the
  previous state on a stack, and restart from the front of the list.
* On a return event, the operation whose response this is was not linearized
  although it has already returned; every operation that could still precede
  it has been tried, so the last choice was wrong: pop the stack, restore the
  previous state, put the operation back into the list and try the next
  candidate after it.

Only operations whose call precedes the first remaining return can be
linearized next, which is exactly the real-time constraint.  Different orders
of the same concurrent operations often reach the same configuration, so every
``(set of linearized operations, model state)`` pair that has been explored is
cached and never explored again; the set is an ``int`` bitmask.

Model states are small ints.  Only values that some operation compares the
register with (a read's output, a cas's expected value) get an id of their
own; every other value maps to one shared "opaque" id, because a register
holding any of them fails every comparison alike.  This quotient of the model
keeps the cache small when most writes are never read.

Unknown outcomes
----------------
An operation whose client gave up (``ret == math.inf``) may have taken effect
at any moment after its call, or never.  Its return event sits at +inf, after
every known return, so it never forces a backtrack; the search succeeds as soon
as every operation with a *known* outcome has been linearized, leaving the
unknown ones either linearized somewhere or omitted.  Because its output was
never seen, an unknown ``cas`` is applied with whatever outcome the state
dictates, and an unknown ``get`` constrains nothing and is dropped.

Unknown operations stay candidates for the rest of the search, so the plain
cache would see every subset of them spent at every point; refuting a history
with a dozen of them could take millions of steps.  These refinements, each of
which only skips configurations that some explored one makes redundant, keep
this in check (a test compares the verdicts with an exhaustive search):

* Dominance instead of equality in the cache: with the same known operations
  linearized and the same state, having spent a *subset* of the unknown
  operations leaves strictly more options open, so a configuration is skipped
  if one with a subset of its unknown operations was explored.
* Known candidates are tried before unknown ones, so that the configurations
  with fewer unknown operations spent tend to be explored first.
* An unknown operation is not linearized where it would not change the state,
  nor before an earlier-called unknown operation with the same effect (such
  twins are interchangeable), nor just before a put or delete that would
  overwrite it unobserved.

Equal timestamps
----------------
At equal times, call events sort before return events, so ``a.ret == b.call``
makes ``a`` and ``b`` *concurrent* (either order is allowed).  This is
porcupine's convention and the permissive choice: with coarse clocks, two
events stamped alike may have happened in either order, and the checker must
not report a violation that might not exist.

Search budget
-------------
The problem is NP-complete, so each key's search is bounded by ``max_steps``
iterations.  When the budget runs out the result is ``ok=False`` with
``undecided=True``: the history was neither proven linearizable nor refuted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

__all__ = [
    "DEFAULT_MAX_STEPS",
    "CheckResult",
    "Operation",
    "check_history",
    "check_key",
]

DEFAULT_MAX_STEPS = 2_000_000

_KINDS = frozenset({"put", "get", "cas", "delete"})


@dataclass(frozen=True)
class Operation:
    """One client request against the store, as observed by the client."""

    client: int
    call: float
    ret: float
    kind: str
    key: str
    value: object = None
    output: object = None

    @property
    def known(self) -> bool:
        """Whether the client saw the response (otherwise the outcome is unknown)."""
        return self.ret != math.inf


@dataclass(frozen=True)
class CheckResult:
    """Verdict of a check; ``undecided`` results are reported with ``ok=False``."""

    ok: bool
    key: str | None
    detail: str
    undecided: bool = False


def check_history(
    ops: Iterable[Operation],
    initial: dict | None = None,
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> CheckResult:
    """Check a multi-key history; keys absent from ``initial`` start absent.

    Keys are checked in order of first appearance.  The first key proven not
    linearizable is reported; a key whose search ran out of budget is reported
    only if no other key is proven bad, since a definite violation is the more
    useful answer.
    """
    initial = initial or {}
    by_key: dict[str, list[Operation]] = {}
    for op in ops:
        by_key.setdefault(op.key, []).append(op)

    first_undecided: CheckResult | None = None
    for key, key_ops in by_key.items():
        result = check_key(key_ops, initial.get(key), max_steps=max_steps)
        if result.ok:
            continue
        if not result.undecided:
            return result
        first_undecided = first_undecided or result
    if first_undecided is not None:
        return first_undecided
    total = sum(len(key_ops) for key_ops in by_key.values())
    return CheckResult(True, None, f"linearizable: {total} ops over {len(by_key)} keys")


def check_key(
    ops: list[Operation],
    initial_value: object = None,
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> CheckResult:
    """Check the history of a single key, whose register starts at ``initial_value``."""
    keys = {op.key for op in ops}
    if len(keys) > 1:
        raise ValueError(f"check_key needs ops of a single key, got {sorted(keys)!r}")
    key = next(iter(keys), None)
    for op in ops:
        _validate(op)

    # Call order gives stable op numbers shared by the search and the report.
    ordered = sorted(ops, key=lambda op: (op.call, op.ret, op.client))
    compiled, init_state = _compile(ordered, initial_value)

    outcome = _search(compiled, init_state, max_steps)
    if outcome.ok:
        return CheckResult(True, key, f"key {key!r}: linearizable ({len(ops)} ops)")
    if outcome.undecided:
        headline = f"undecided: search budget exhausted after {max_steps} steps on key {key!r}"
    else:
        headline = f"key {key!r} is not linearizable"
    detail = _describe_failure(headline, ordered, compiled, outcome, initial_value)
    return CheckResult(False, key, detail, undecided=outcome.undecided)


def _validate(op: Operation) -> None:
    if op.kind not in _KINDS:
        raise ValueError(f"unknown operation kind {op.kind!r} in {op!r}")
    if not math.isfinite(op.call):
        raise ValueError(f"call time must be finite: {op!r}")
    if math.isnan(op.ret) or op.ret < op.call:
        raise ValueError(f"ret must be >= call (or math.inf): {op!r}")
    if op.kind == "cas" and not (isinstance(op.value, tuple) and len(op.value) == 2):
        raise ValueError(f"cas value must be a tuple (expected, new): {op!r}")


def _cas_args(op: Operation) -> tuple[object, object]:
    """The (expected, new) pair of a cas, whose shape _validate has checked."""
    return cast("tuple[object, object]", op.value)


class _Interner:
    """Dense ids for values, equal ids iff the values compare ``==``."""

    def __init__(self) -> None:
        self.size = 0
        self._hashable: dict[object, int] = {}
        self._unhashable: list[tuple[object, int]] = []

    def intern(self, value: object) -> int:
        try:
            existing = self._hashable.get(value)
        except TypeError:
            # Unhashable values (lists, dicts) are rare; a linear scan keeps
            # them usable without asking callers to freeze them.
            for other, ident in self._unhashable:
                if other == value:
                    return ident
            self._unhashable.append((value, self.size))
        else:
            if existing is not None:
                return existing
            self._hashable[value] = self.size
        self.size += 1
        return self.size - 1


@dataclass(frozen=True, slots=True)
class _Op:
    """An operation compiled to interned state ids for the search loop."""

    number: int  # index in call order; also its bit in the linearized-set mask
    op: Operation
    known: bool
    kind: str  # "put" (also delete), "get" or "cas"
    arg: int  # put: new state; cas: expected state; get: state read
    new: int  # cas only: state after a successful swap
    swapped: bool  # known cas only: the observed outcome
    # Unknown ops only: bit of the previous unknown op in call order with the
    # same effect, or 0.  Such twins are interchangeable once both are called,
    # so the search spends them in call order instead of trying every subset.
    twin: int


def _compile(ordered: list[Operation], initial_value: object) -> tuple[list[_Op], int]:
    """Compile ops to abstract states; returns them and the initial abstract state.

    Only values that some op compares the register against (a known read's
    output, a cas's expected value) can ever make a difference: a register
    holding any other value fails every comparison alike.  Those *observed*
    values get their own state id and every other value shares one "opaque"
    id.  This keeps the cache small when many writes are never read, and it
    makes unknown writes of unread values twins of one another.
    """
    interner = _Interner()
    for op in ordered:
        if op.kind == "get" and op.known:
            interner.intern(op.output)
        elif op.kind == "cas":
            interner.intern(_cas_args(op)[0])
    opaque = interner.size

    def state_of(value: object) -> int:
        return min(interner.intern(value), opaque)

    compiled: list[_Op] = []
    last_twin: dict[tuple[str, int, int], int] = {}
    for number, op in enumerate(ordered):
        new = -1
        if op.kind == "put":
            kind, arg = "put", state_of(op.value)
        elif op.kind == "delete":
            kind, arg = "put", state_of(None)
        elif op.kind == "get":
            if not op.known:
                continue  # its output was never seen, so it constrains nothing
            kind, arg = "get", state_of(op.output)
        else:
            expected, new_value = _cas_args(op)
            kind, arg, new = "cas", state_of(expected), state_of(new_value)
        twin = 0
        if not op.known:
            twin = last_twin.get((kind, arg, new), 0)
            last_twin[(kind, arg, new)] = 1 << number
        compiled.append(_Op(number, op, op.known, kind, arg, new, op.output is True, twin))
    return compiled, state_of(initial_value)


def _step(op: _Op, state: int) -> int | None:
    """Apply ``op`` to ``state``; the new state, or None if the outcome contradicts it."""
    if op.kind == "put":
        return op.arg
    if op.kind == "get":
        return state if state == op.arg else None
    matches = state == op.arg
    if not op.known:
        return op.new if matches else state
    if matches != op.swapped:
        return None
    return op.new if matches else state


class _Node:
    """Event in the doubly linked list; a call node's ``match`` is its return node."""

    __slots__ = ("match", "next", "op", "prev")

    def __init__(self, op: _Op | None, match: _Node | None) -> None:
        self.op = op
        self.match = match
        self.prev: _Node | None = None
        self.next: _Node | None = None


def _build_events(ops: Sequence[_Op]) -> _Node:
    """Sorted event list behind a sentinel head; calls sort first at equal times."""
    events: list[tuple[float, int, int, _Node]] = []
    for op in ops:
        ret_node = _Node(op, None)
        call_node = _Node(op, ret_node)
        events.append((op.op.call, 0, op.number, call_node))
        events.append((op.op.ret, 1, op.number, ret_node))
    events.sort(key=lambda event: event[:3])
    head = _Node(None, None)
    prev = head
    for *_, node in events:
        prev.next = node
        node.prev = prev
        prev = node
    return head


def _lift(call: _Node) -> None:
    for node in (call, call.match):
        assert node is not None and node.prev is not None
        node.prev.next = node.next
        if node.next is not None:
            node.next.prev = node.prev


def _unlift(call: _Node) -> None:
    # Reinsert in the reverse order of _lift so the stale prev/next pointers
    # of the removed nodes are valid again when each is relinked.
    for node in (call.match, call):
        assert node is not None and node.prev is not None
        node.prev.next = node
        if node.next is not None:
            node.next.prev = node


@dataclass
class _Outcome:
    ok: bool
    undecided: bool = False
    best: tuple[_Op, ...] = ()  # deepest partial linearization reached


def _search(ops: Sequence[_Op], init_state: int, max_steps: int) -> _Outcome:
    pending_known = sum(1 for op in ops if op.known)
    if pending_known == 0:
        return _Outcome(ok=True)

    head = _build_events(ops)
    unknown_bits = sum(1 << op.number for op in ops if not op.known)
    state = init_state
    linearized = 0
    seen: dict[tuple[int, int], list[int]] = {}
    stack: list[tuple[_Node, _Op, int]] = []  # (lifted call node, its op, state before)
    best = _Outcome(ok=False)

    # Each configuration's candidates are scanned in two passes, known ops
    # first, then unknown ones.  Paths that defer unknown ops reach a given
    # (known ops, state) pair with fewer unknown ops spent, and such a
    # configuration makes the later ones that spent more redundant.
    #
    # The loop never runs off the end of the list: while a known op is still
    # pending its return node is in the list, and reaching it either starts
    # the unknown pass, backtracks or fails.
    node = head.next
    known_pass = True
    for _ in range(max_steps):
        assert node is not None and node.op is not None
        op = node.op
        if node.match is not None:
            if op.known == known_pass:
                new_state = _step(op, state)
                if (
                    new_state is not None
                    and _worth_trying(op, state, new_state, linearized, stack)
                    and _first_visit(seen, linearized | (1 << op.number), unknown_bits, new_state)
                ):
                    stack.append((node, op, state))
                    state = new_state
                    linearized |= 1 << op.number
                    _lift(node)
                    if op.known:
                        pending_known -= 1
                        if pending_known == 0:
                            return _Outcome(ok=True)
                    if len(stack) > len(best.best):
                        best = _Outcome(ok=False, best=tuple(op for _, op, _ in stack))
                    node, known_pass = head.next, True
                    continue
            node = node.next
        elif known_pass and linearized & unknown_bits != unknown_bits:
            node, known_pass = head.next, False
        else:
            if not stack:
                return best
            node, op, state = stack.pop()
            linearized &= ~(1 << op.number)
            if op.known:
                pending_known += 1
            _unlift(node)
            node, known_pass = node.next, op.known
    best.undecided = True
    return best


def _worth_trying(
    op: _Op, state: int, new_state: int, linearized: int, stack: list[tuple[_Node, _Op, int]]
) -> bool:
    """Whether linearizing ``op`` next can lead anywhere its alternatives cannot.

    Each rule skips a move whose every continuation is also a continuation of
    a move the search makes anyway, so no linearization is lost:

    * an unknown op that leaves the state unchanged is the same as leaving it
      unlinearized for now;
    * an unknown op whose earlier-called twin is still unspent could be
      swapped for that twin;
    * a put or delete straight after an unknown op overwrites it unobserved,
      so that unknown op could have been left out.
    """
    if not op.known and (new_state == state or linearized & op.twin != op.twin):
        return False
    overwrites_unknown = op.kind == "put" and bool(stack) and not stack[-1][1].known
    return not overwrites_unknown


def _first_visit(
    seen: dict[tuple[int, int], list[int]], linearized: int, unknown_bits: int, state: int
) -> bool:
    """Record a configuration; False if an explored one makes it redundant.

    Configurations that agree on the linearized known ops and the state differ
    only in which unknown ops were spent.  Spending fewer leaves strictly more
    options open (an unknown op never has to be linearized), so a configuration
    is redundant if one with a subset of its unknown ops was explored already.
    Each bucket is kept as an antichain of unknown-op sets.
    """
    unknown = linearized & unknown_bits
    bucket = seen.setdefault((linearized & ~unknown_bits, state), [])
    if any(explored & ~unknown == 0 for explored in bucket):
        return False
    bucket[:] = [explored for explored in bucket if unknown & ~explored != 0]
    bucket.append(unknown)
    return True


def _show_value(value: object) -> str:
    return "absent" if value is None else repr(value)


def _describe_op(op: Operation) -> str:
    if op.kind == "put":
        action = f"put({op.value!r})"
    elif op.kind == "delete":
        action = "delete()"
    elif op.kind == "get":
        action = "get()"
    else:
        expected, new = _cas_args(op)
        action = f"cas({_show_value(expected)} -> {new!r})"
    if not op.known:
        result = " -> ? (unknown outcome)"
    elif op.kind == "get":
        result = f" -> {_show_value(op.output)}"
    elif op.kind == "cas":
        result = f" -> {op.output!r}"
    else:
        result = ""
    return f"client {op.client} [{op.call:g}, {op.ret:g}] {action}{result}"


def _describe_failure(
    headline: str,
    ordered: list[Operation],
    compiled: list[_Op],
    outcome: _Outcome,
    initial_value: object,
) -> str:
    kept = {op.number for op in compiled}
    lines = [headline, f"history ({len(ordered)} ops, call order):"]
    for number, op in enumerate(ordered):
        note = "" if number in kept else "  (dropped: read with unknown outcome)"
        lines.append(f"  #{number} {_describe_op(op)}{note}")
    lines.append(f"longest linearizable prefix found ({len(outcome.best)} of {len(compiled)} ops):")
    # Replay on the real values, since the search only tracked abstract states.
    value = initial_value
    for compiled_op in outcome.best:
        op = compiled_op.op
        if op.kind == "put":
            value = op.value
        elif op.kind == "delete":
            value = None
        elif op.kind == "cas":
            expected, new = _cas_args(op)
            if value == expected:
                value = new
        lines.append(f"  #{compiled_op.number} {_describe_op(op)}  => {_show_value(value)}")
    return "\n".join(lines)
