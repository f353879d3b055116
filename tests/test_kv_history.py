"""The KV API history checker (``raftkv.testing.kv_history``) on hand-made histories:
what it must accept, and the bugs it must reject."""

from __future__ import annotations

import math

from raftkv.testing.kv_history import KvOp, Meta, check_kv_history, lease_liveness

INF = math.inf


def put(c: int, call: float, ret: float, key: str, value: str, index: int) -> KvOp:
    return KvOp(c, call, ret, "put", key, value, None, index)


def get(c: int, call: float, ret: float, key: str, out: Meta | None) -> KvOp:
    return KvOp(c, call, ret, "get", key, None, out)


def ok(ops: list[KvOp]) -> bool:
    r = check_kv_history(ops)
    assert not r.undecided, r.detail
    return r.ok


def test_reads_see_revisions_and_versions() -> None:
    assert ok([put(0, 0, 1, "a", "1", 3), put(0, 2, 3, "a", "2", 5),
               get(1, 4, 5, "a", Meta("2", 3, 5, 2)),
               KvOp(1, 6, 7, "delete", "a", index=8), get(1, 8, 9, "a", None)])
    # the version counts the writes since creation
    assert not ok([put(0, 0, 1, "a", "1", 3), put(0, 2, 3, "a", "2", 5),
                   get(1, 4, 5, "a", Meta("2", 5, 5, 1))])


def test_a_stale_read_is_rejected() -> None:
    assert not ok([put(0, 0, 1, "a", "1", 3), put(0, 2, 3, "a", "2", 5),
                   get(1, 4, 5, "a", Meta("1", 3, 3, 1))])


def test_reads_may_not_go_back_in_time_even_with_no_write_returned_between() -> None:
    # the second write never returns, the first read sees it, a later read does not
    w2 = put(0, 2, INF, "a", "2", 5)
    r1 = get(1, 3, 4, "a", Meta("2", 3, 5, 2))
    r2 = get(2, 5, 6, "a", Meta("1", 3, 3, 1))
    base = [put(0, 0, 1, "a", "1", 3), w2]
    assert ok([*base, r1])
    assert ok([*base, r2])
    assert not ok([*base, r1, r2])


def test_revisions_out_of_real_time_order_are_rejected() -> None:
    assert not ok([put(0, 0, 1, "a", "1", 7), put(1, 2, 3, "b", "2", 5)])


def test_an_unknown_write_is_applied_at_its_index_or_not_at_all() -> None:
    lost = put(0, 0, INF, "a", "1", 3)
    assert ok([lost, get(1, 5, 6, "a", None)])
    assert ok([lost, get(1, 5, 6, "a", Meta("1", 3, 3, 1))])
    assert not ok([lost, get(1, 5, 6, "a", Meta("1", 4, 4, 1))])  # not at its index
    # a known write holds index 3: the unknown one cannot be there
    assert not ok([lost, put(2, 0, 1, "b", "9", 3), get(1, 5, 6, "a", Meta("1", 3, 3, 1))])


def test_cas_on_value_and_on_revision() -> None:
    w = put(0, 0, 1, "a", "1", 3)
    assert ok([w, KvOp(1, 2, 3, "cas", "a", ("1", "2"), True, 4),
               KvOp(1, 4, 5, "cas_index", "a", (3, "3"), False, 6),
               KvOp(1, 6, 7, "cas_index", "a", (4, "3"), True, 8),
               get(1, 8, 9, "a", Meta("3", 3, 8, 3))])
    assert not ok([w, KvOp(1, 2, 3, "cas_index", "a", (2, "3"), True, 6)])


def _txn(succeeded: bool, responses: tuple[object, ...], index: int, call: float = 2,
         ret: float = 3) -> KvOp:
    compares = (("a", "mod", "==", 3), ("b", "exists", "==", False))
    success = (("put", "b", "x"), ("get", "b", None), ("delete", "a", None))
    failure = (("get", "a", None),)
    return KvOp(1, call, ret, "txn", None, (compares, success, failure),
                (succeeded, responses), index)


def test_a_transaction_runs_the_right_branch_and_its_gets_see_its_writes() -> None:
    w = put(0, 0, 1, "a", "1", 3)
    good = _txn(True, (None, Meta("x", 4, 4, 1), True), 4)
    assert ok([w, good, get(2, 5, 6, "a", None), get(2, 7, 8, "b", Meta("x", 4, 4, 1))])
    # a wrong branch
    assert not ok([w, _txn(False, (Meta("1", 3, 3, 1),), 4)])
    # a lost transaction write: it answered success, yet b is absent afterwards
    assert not ok([w, good, get(2, 5, 6, "b", None)])


def test_compares_on_absent_keys() -> None:
    t = KvOp(1, 0, 1, "txn", None, ((("a", "value", "!=", "z"),), (), ()), (False, ()), 2)
    assert ok([t])  # a value compare on an absent key is false, even !=
    t = KvOp(1, 0, 1, "txn", None, ((("a", "version", "<", 1),), (), ()), (True, ()), 2)
    assert ok([t])  # an absent key's version is 0


def grant(call: float, lease: int, ttl: int, index: int) -> KvOp:
    return KvOp(0, call, call + 0.01, "grant", None, (lease, ttl), True, index)


def test_leases_revoke_their_keys_and_detach_on_other_writes() -> None:
    ops = [grant(0, 9, 5, 2),
           KvOp(0, 1, 1.1, "put_lease", "a", ("1", 9), True, 3),
           KvOp(0, 1, 1.1, "put_lease", "b", ("2", 9), True, 4),
           put(0, 2, 2.1, "b", "3", 5),  # detaches b
           KvOp(0, 3, 3.1, "revoke", None, 9, ["a"], 6),
           get(1, 4, 5, "b", Meta("3", 4, 5, 2)),
           KvOp(0, 6, 6.1, "put_lease", "a", ("4", 9), False, 7)]
    assert ok(ops)


def test_a_lease_cut_short_is_rejected() -> None:
    base = [grant(0, 9, 5, 2), KvOp(0, 1, 1.1, "put_lease", "a", ("1", 9), True, 3)]
    on_time = KvOp(-1, 5.5, 5.6, "expire", None, 9, ["a"], 4)
    assert ok([*base, on_time])
    early = KvOp(-1, 4.0, 4.1, "expire", None, 9, ["a"], 4)
    assert not ok([*base, early])
    # kept alive at t=3 (by whichever leader answered): not before t=8
    kept = KvOp(1, 3, 3, "keepalive", None, 9, 5)
    assert not ok([*base, kept, on_time])
    # an expiry whose outcome nobody saw may simply not have happened...
    unknown = KvOp(-1, 4.0, INF, "expire", None, 9, None, 4)
    assert ok([*base, unknown])
    # ...but not if a read shows the key gone
    assert not ok([*base, unknown, get(1, 6, 7, "a", None)])


def test_a_lease_nobody_keeps_must_go_once_things_are_quiet() -> None:
    ops = [grant(0, 9, 2, 2), KvOp(1, 3, 3, "keepalive", None, 9, 2)]
    assert lease_liveness(ops, [9], end=6.5, quiet_since=1, slack=1.5) == []
    assert lease_liveness(ops, [9], end=7, quiet_since=5, slack=1.5) == []
    assert lease_liveness(ops, [9], end=7, quiet_since=1, slack=1.5)
