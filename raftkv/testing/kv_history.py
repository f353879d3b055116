"""A checker for histories of the KV API: revisions, compare-and-set on a value or a
revision, multi-key transactions, and leases with their expiry.

What is checked
---------------
The KV API exposes a total order: a write's revision is the log index of its entry, and
reads answer the revisions of what they read. So unlike ``raftkv.testing.linearizability``
this checker does not search for an order; it is given one and verifies that it explains
everything the clients saw. A history is accepted iff some choice of which
unknown-outcome writes took effect makes all of these hold:

(a) Placement. Every write with a known outcome sits at the index it was proposed at (its
    client saw its own entry applied there). A write whose client gave up (``ret`` is
    ``inf``) sits at the index it was proposed at or nowhere: an entry never moves, and
    the client knows the index from the propose. A write whose client saw another entry
    at its index failed for good and is left out of the history by the caller.
(b) Real time between writes: if ``a.ret < b.call`` then ``rev(a) < rev(b)``.
(c) The sequential model. Replaying the writes in revision order on a model, a map of
    key -> (value, create_revision, mod_revision, version, lease) and of lease -> TTL,
    reproduces every observed output: a compare-and-set's success, a transaction's
    branch and its gets, a grant's, lease put's and revoke's answers. The model is
    written here from the documented semantics (``docs/kv-api.md``, the docstrings of
    ``raftkv.storage.revisions``, ``txn`` and ``leases``), not by calling the store.
(d) Linearizable reads. Every read (a get with its metadata) equals the model at some
    revision R (the state after every write at an index <= R) with R >= the revision of
    every write that returned before the read was called, R below the revision of every
    write called after the read returned, and R1 <= R2 whenever read 1 returned before
    read 2 was called. A transaction's gets are checked by (c), at its own revision.
(e) Leases are never cut short. A lease's expiry is a revoke entry that the leader
    proposes (kind ``expire``: a write like any other, with the proposing leader as its
    client). One that takes effect (the lease still existed at its revision) must have
    been proposed no earlier than the lease's TTL after the later of its grant's call and
    the last keepalive acknowledged for it, in simulated time, whichever leader
    acknowledged it. A keepalive acknowledged for a lease whose expiry was already on its
    way is caught the same way. ``lease_liveness`` checks the other side, once the
    faults have stopped: a lease nobody keeps alive is gone within its TTL plus a bound.

How the search works
--------------------
The revisions in the history are the only places anything can happen, so the checker
walks them in increasing order with a *frontier*: the distinct (model state, set of reads
placed) pairs that some choice of unknown writes so far leads to. At a known write every
member applies it and is dropped if an output differs (c) or if a read that returned
before the write was called is still unplaced (d). At an index held only by unknown
writes, each member forks: none of them applied, or one of them (at most one entry sits at
an index). After each index (and before the first) every member places each unplaced read
that may be placed there: its lower bound reached, every read that returned before its
call placed, and the state equal to what it saw. Placing a read as early as it matches is
never worse (later reads only need it placed; writes only need it placed before them), so
the greedy placement loses no accepted history, and the dedup of equal pairs loses none
either. The history is accepted iff some member survives the last index with every read
placed. The frontier only grows at unknown writes that nothing has told apart yet (a
read's revisions and version tell most of them apart at once); past ``max_frontier``
members the check gives up as *undecided* rather than guess.

Soundness and what it cannot catch
----------------------------------
Every rejection exhibits a contradiction with the documented semantics for *every*
choice of the unknown writes, so a rejected history is a real bug (or a wrong model). It
cannot catch: a bug that shows in no output (a read that nobody issued), a wrong answer
of an unknown-outcome write, entries other than the clients' and the leaders' expiries
(no-ops and configuration changes change no key), a keepalive's answer for a lease that
a *client* revoked (keepalives are served from the leader's memory, not the log, and are
not linearizable), or an expiry that comes late while faults still run (only the settle
phase bounds it).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from raftkv.testing.linearizability import CheckResult

WRITES = frozenset({"put", "delete", "cas", "cas_index", "txn", "grant", "put_lease", "revoke",
                    "expire"})
DEFAULT_MAX_FRONTIER = 4096


class Meta(NamedTuple):
    """A key as a read with metadata answers it."""

    value: str
    create: int
    mod: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class KvOp:
    """One operation as its client saw it. ``index``: a write's revision, the index it
    was proposed at. ``args`` and ``output`` by kind:

    - put: value; delete: None (output None); get: None -> ``Meta`` or None
    - cas: (expected | None, new) -> bool; cas_index: (mod_revision, new) -> bool
    - txn: (compares, success, failure) -> (succeeded, responses); a compare is
      (key, target, op, operand), target one of value/mod/create/version/exists and op
      one of == != < >; an operation is (put|delete|get, key, value | None); a response
      is None (put), bool (delete: it existed) or ``Meta`` | None (get)
    - grant: (lease, ttl) -> bool; put_lease: (value, lease) -> bool
    - revoke, expire: lease -> the keys deleted, sorted, or False; keepalive: lease ->
      the ttl, or None (not found). An ``expire`` is the leader's revoke of an expired
      lease; its ``call`` is when the leader proposed it.
    """

    client: int
    call: float
    ret: float
    kind: str
    key: str | None = None
    args: Any = None
    output: Any = None
    index: int = 0

    @property
    def known(self) -> bool:
        return self.ret != math.inf


class _State(NamedTuple):
    kv: dict[str, Meta]
    leases: dict[int, int]

    def frozen(self) -> tuple[object, ...]:
        return tuple(sorted(self.kv.items())), tuple(sorted(self.leases.items()))


class _Mismatch(Exception):
    pass


def _write(kv: dict[str, Meta], key: str, value: str, index: int, lease: int = 0) -> None:
    old = kv.get(key)
    kv[key] = (Meta(value, index, index, 1, lease) if old is None
               else Meta(value, old.create, index, old.version + 1, lease))


def _holds(kv: dict[str, Meta], compare: Sequence[Any]) -> bool:
    key, target, op, operand = compare
    m = kv.get(key)
    if target == "exists":
        return (m is not None) == operand if op == "==" else (m is not None) != operand
    if target == "value":
        if m is None:
            return False  # a value compare on an absent key is false, whatever the operator
        got: Any = m.value
    else:
        got = 0 if m is None else {"mod": m.mod, "create": m.create, "version": m.version}[target]
    return {"==": got == operand, "!=": got != operand, "<": got < operand,
            ">": got > operand}[op]


def _run(op: KvOp, state: _State, floors: dict[int, float]) -> tuple[_State, Any]:
    """Apply write ``op`` at its index: the new state and the output it answers.
    ``_Mismatch`` if an expiry would cut its lease short."""
    kv, leases, i = dict(state.kv), state.leases, op.index
    k, kind, a = op.key, op.kind, op.args
    out: Any = None
    if kind == "put":
        assert k is not None
        _write(kv, k, a, i)
    elif kind == "delete":
        assert k is not None
        kv.pop(k, None)
    elif kind in ("cas", "cas_index"):
        assert k is not None
        expected, new = a
        m = kv.get(k)
        have = (None if m is None else m.value) if kind == "cas" else (0 if m is None else m.mod)
        out = have == expected
        if out:
            if new is None:
                kv.pop(k, None)
            else:
                _write(kv, k, new, i)
    elif kind == "txn":
        compares, success, failure = a
        ok = all(_holds(kv, c) for c in compares)
        responses: list[Any] = []
        for what, key, value in (success if ok else failure):
            if what == "put":
                _write(kv, key, value, i)
                responses.append(None)
            elif what == "delete":
                responses.append(kv.pop(key, None) is not None)
            else:
                responses.append(kv.get(key))
        out = (ok, tuple(responses))
    elif kind == "grant":
        lease, ttl = a
        out = lease not in leases
        if out:
            leases = {**leases, lease: ttl}
    elif kind == "put_lease":
        assert k is not None
        value, lease = a
        out = lease in leases
        if out:
            _write(kv, k, value, i, lease)
    elif kind in ("revoke", "expire"):
        lease = a
        if lease not in leases:
            out = False
        else:
            if kind == "expire" and op.call < floors.get(lease, -math.inf):
                raise _Mismatch(f"lease {lease} cut short: its expiry was proposed at "
                                f"t={op.call:g}, before t={floors[lease]:g} (its TTL after "
                                "its grant or last acknowledged keepalive)")
            out = sorted(key for key, m in kv.items() if m.lease == lease)
            for key in out:
                del kv[key]
            leases = {x: t for x, t in leases.items() if x != lease}
    else:
        raise ValueError(f"not a write: {kind!r}")
    return _State(kv, leases), out


def _lease_floors(ops: Iterable[KvOp]) -> dict[int, float]:
    """Per lease, the earliest time its expiry may be proposed (check (e))."""
    ttl: dict[int, int] = {}
    start: dict[int, float] = {}
    for op in ops:
        if op.kind == "grant":
            lease, t = op.args
            ttl[lease] = t
            start[lease] = max(start.get(lease, -math.inf), op.call)
        elif op.kind == "keepalive" and op.output is not None:
            start[op.args] = max(start.get(op.args, -math.inf), op.call)
    return {lease: start[lease] + t for lease, t in ttl.items() if lease in start}


def describe(op: KvOp) -> str:
    ret = "?" if not op.known else f"{op.ret:g}"
    at = f" @{op.index}" if op.index else ""
    key = f" {op.key}" if op.key is not None else ""
    return (f"c{op.client} {op.kind}{key} {op.args!r}{at} -> {op.output!r} "
            f"[{op.call:g}, {ret}]")


def check_kv_history(ops: Iterable[KvOp], *,
                     max_frontier: int = DEFAULT_MAX_FRONTIER) -> CheckResult:
    """Whether the history satisfies (a)-(e) of the module docstring."""
    ops = list(ops)
    for op in ops:
        if op.kind in WRITES and op.index <= 0:
            raise ValueError(f"a write needs the index it was proposed at: {op}")
    writes = [op for op in ops if op.kind in WRITES]
    known = sorted((w for w in writes if w.known), key=lambda w: w.index)
    reads = sorted((op for op in ops if op.kind == "get"), key=lambda r: r.ret)
    floors = _lease_floors(ops)

    def fail(detail: str) -> CheckResult:
        return CheckResult(False, None, detail)

    # (a) one known write per index; (b) real time between known writes.
    at: dict[int, KvOp] = {}
    for w in known:
        if w.index in at:
            return fail(f"two writes at revision {w.index}: {describe(at[w.index])} and "
                        f"{describe(w)}")
        at[w.index] = w
    later_ret, first_ret = math.inf, None
    for w in reversed(known):  # min ret over the writes at higher revisions
        if later_ret < w.call:
            assert first_ret is not None
            return fail(f"revisions against real time: {describe(first_ret)} returned "
                        f"before {describe(w)} was called, at a higher revision")
        if w.ret < later_ret:
            later_ret, first_ret = w.ret, w
    # Unknown writes: out where a known one holds the index, or where being applied
    # would break (b) against a known write that returned before they were called.
    candidates: dict[int, list[KvOp]] = {}
    for w in writes:
        if w.known or w.index in at:
            continue
        if any(a.ret < w.call and a.index > w.index for a in known):
            continue
        candidates.setdefault(w.index, []).append(w)
    positions = sorted(set(at) | set(candidates))

    # Reads, numbered in return order: read j may be placed once reads 0..pred[j]-1 are.
    rets = [r.ret for r in reads]
    pred = [bisect.bisect_left(rets, r.call) for r in reads]
    known_rets = sorted((w.ret, w.index) for w in known)
    # lo[j]: the highest revision of a write that returned before read j was called.
    lo = [0] * len(reads)
    order = sorted(range(len(reads)), key=lambda j: reads[j].call)
    best, ki = 0, 0
    for j in order:
        while ki < len(known_rets) and known_rets[ki][0] < reads[j].call:
            best = max(best, known_rets[ki][1])
            ki += 1
        lo[j] = best
    by_lo = sorted(range(len(reads)), key=lambda j: lo[j])

    def full(n: int) -> int:
        return (1 << n) - 1

    def place(state: _State, placed: int, upto: int, open_reads: list[int]) -> int:
        for j in open_reads:
            if placed >> j & 1 or lo[j] > upto:
                continue
            if placed & full(pred[j]) != full(pred[j]):
                continue
            r = reads[j]
            assert r.key is not None
            if state.kv.get(r.key) == r.output:
                placed |= 1 << j
        return placed

    frontier: dict[tuple[object, int], tuple[_State, int]] = {}
    start = _State({}, {})
    open_reads: list[int] = []
    nxt = 0

    def activate(upto: int) -> None:
        nonlocal nxt
        while nxt < len(by_lo) and lo[by_lo[nxt]] <= upto:
            open_reads.append(by_lo[nxt])
            nxt += 1
        open_reads.sort()

    activate(0)
    p0 = place(start, 0, 0, open_reads)
    frontier[(start.frozen(), p0)] = (start, p0)
    why = ""
    for pos in positions:
        choices: list[KvOp | None] = [at[pos]] if pos in at else [None, *candidates[pos]]
        new: dict[tuple[object, int], tuple[_State, int]] = {}
        activate(pos)
        for state, placed in frontier.values():
            for u in choices:
                if u is None:
                    s = state
                else:
                    need = full(bisect.bisect_left(rets, u.call))
                    if placed & need != need:
                        j = (~placed & need).bit_length() - 1
                        why = (f"stale read: {describe(reads[j])} matches no revision "
                               f"before {describe(u)}, called after it returned")
                        continue
                    try:
                        s, out = _run(u, state, floors)
                    except _Mismatch as e:
                        why = f"{describe(u)}: {e}"
                        continue
                    if u.known and out != u.output:
                        why = (f"{describe(u)}: the model answers {out!r} at revision "
                               f"{pos}")
                        continue
                p = place(s, placed, pos, open_reads)
                new.setdefault((s.frozen(), p), (s, p))
        if not new:
            return fail(why)
        if len(new) > max_frontier:
            return CheckResult(False, None, f"undecided: {len(new)} states at revision {pos}",
                               undecided=True)
        frontier = new
        everywhere = 0
        for _, placed in frontier.values():
            everywhere = placed if not everywhere else everywhere & placed
        open_reads[:] = [j for j in open_reads if not everywhere >> j & 1]
    activate(math.inf)  # type: ignore[arg-type]
    want = full(len(reads))
    for state, placed in frontier.values():
        if place(state, placed, math.inf, open_reads) == want:  # type: ignore[arg-type]
            return CheckResult(True, None, f"ok: {len(writes)} writes, {len(reads)} reads")
    state, placed = next(iter(frontier.values()))
    j = (~placed & want).bit_length() - 1
    return fail(f"read {describe(reads[j])} matches no revision it could have read at")


def lease_liveness(ops: Iterable[KvOp], remaining: Iterable[int], end: float,
                   quiet_since: float, slack: float) -> list[str]:
    """Leases still there at ``end`` that should be gone: nothing has kept them alive
    since ``TTL + slack`` after the later of their last activity (the grant's return, or
    its call if unknown; an acknowledged keepalive) and ``quiet_since``, the time from
    which there were no faults and no leader change."""
    last: dict[int, float] = {}
    ttl: dict[int, int] = {}
    for op in ops:
        if op.kind == "grant":
            lease, t = op.args
            ttl[lease] = t
            last[lease] = max(last.get(lease, -math.inf), op.ret if op.known else op.call)
        elif op.kind == "keepalive" and op.output is not None:
            last[op.args] = max(last.get(op.args, -math.inf), op.call)
    out = []
    for lease in sorted(remaining):
        if lease not in ttl:
            out.append(f"lease {lease} exists but no grant of it is in the history")
            continue
        due = max(last[lease], quiet_since) + ttl[lease] + slack
        if end > due:
            out.append(f"lease {lease} (ttl {ttl[lease]}) still exists at t={end:g}, due by "
                       f"t={due:g} (last kept t={last[lease]:g}, quiet since "
                       f"t={quiet_since:g})")
    return out
