"""Leases in both state stores (``raftkv.storage.leases``): grant, attach, detach by any
other write, revoke deleting exactly the attached keys (recorded for a watch), snapshots
carrying them, and the commands' validation."""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgpack
import pytest
from raftkv.storage.commands import (
    CommandError,
    decode,
    encode_batch,
    encode_cas,
    encode_delete,
    encode_lease_grant,
    encode_lease_revoke,
    encode_put,
    encode_put_lease,
    encode_txn,
)
from raftkv.storage.leases import MAX_LEASED_KEY_BYTES, MAX_TTL
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.state_store import KVStateStore
from raftkv.storage.txn import Kind, Txn, TxnOp

from raftkv.server.leases import lease_keys, read_leases


def test_a_revoke_deletes_exactly_the_keys_still_attached(kv_store: KVStateStore) -> None:
    cmds = [
        encode_lease_grant(7, 10),                       # 1
        encode_put_lease(b"a", b"1", 7),                 # 2
        encode_put_lease(b"b", b"2", 7),                 # 3
        encode_put_lease(b"c", b"3", 7),                 # 4
        encode_put(b"b", b"plain"),                      # 5: detaches b
        encode_txn(Txn((), (TxnOp(Kind.PUT, b"c", b"t"),), ())),  # 6: detaches c
        encode_put_lease(b"d", b"4", 7),                 # 7
        encode_delete(b"d"),                             # 8: deletes and detaches d
        encode_put_lease(b"e", b"5", 99),                # 9: no such lease
        encode_lease_grant(7, 20),                       # 10: taken
        encode_lease_revoke(7),                          # 11
        encode_lease_revoke(7),                          # 12: gone
    ]
    res = kv_store.apply([(i + 1, c) for i, c in enumerate(cmds)])
    assert res[0] is True and res[1] is True and res[8] is False and res[9] is False
    assert res[10] == [b"a"] and res[11] is False
    assert kv_store.outcome(11) == [b"a"] and kv_store.outcome(9) is False
    assert {k: v for k, v in kv_store.scan()} == {b"b": b"plain", b"c": b"t"}
    assert read_leases(kv_store) == {}
    assert kv_store.get(b"e") is None  # nothing written for a missing lease


def test_attachment_moves_with_the_key_and_snapshots_carry_leases(kv_store: KVStateStore) -> None:
    kv_store.apply([(1, encode_lease_grant(1, 5)), (2, encode_lease_grant(2, 60)),
                 (3, encode_put_lease(b"k", b"v", 1)), (4, encode_put_lease(b"k", b"w", 2)),
                 (5, encode_batch([(b"x", b"1")])), (6, encode_put_lease(b"x", b"2", 2)),
                 (7, encode_cas(b"x", b"2", b"3"))])  # the compare-and-set detaches x
    assert lease_keys(kv_store, 1) == [] and lease_keys(kv_store, 2) == [b"k"]
    meta = kv_store.get_meta(b"k")
    assert meta is not None and meta.lease == 2 and meta.version == 2
    with tempfile.TemporaryDirectory() as d:
        copy = LmdbStateStore(Path(d) / "c")
        try:
            copy.install_snapshot(kv_store.snapshot_chunks())
            assert read_leases(copy) == {1: 5, 2: 60}
            copy.apply([(8, encode_lease_revoke(2))])
            assert copy.get(b"k") is None and copy.get(b"x") == b"3"
        finally:
            copy.close()


def test_lease_commands_are_validated() -> None:
    for bad in (lambda: encode_lease_grant(0, 5), lambda: encode_lease_grant(1, 0),
                lambda: encode_lease_grant(1, MAX_TTL + 1), lambda: encode_lease_grant(-3, 5),
                lambda: encode_lease_revoke(1 << 63),
                lambda: encode_put_lease(b"k" * (MAX_LEASED_KEY_BYTES + 1), b"v", 1),
                lambda: encode_put_lease(b"k", b"v", 0)):
        with pytest.raises(CommandError):
            bad()
    for obj in ([7, 1], [7, 1, 5.0], [8, b"k", b"v"], [9, True], [9, b"1"]):
        with pytest.raises(CommandError):
            decode(msgpack.packb(obj, use_bin_type=True))
    assert encode_put_lease(b"k" * MAX_LEASED_KEY_BYTES, b"v", 1)


def test_a_keeper_failing_every_tick_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found from outside: a node whose loop had died logged "lease keeper: node n3 is
    not running" four times a second for as long as it ran."""
    import asyncio
    import logging

    from raftkv.server.leases import LeasesApi

    class Broken:
        async def tick(self) -> None:
            raise RuntimeError("node n3 is not running")

    api = LeasesApi()
    api._keeper = Broken()  # type: ignore[assignment]

    async def run_a_while() -> None:
        task = asyncio.get_running_loop().create_task(api._run())
        await asyncio.sleep(1.0)
        task.cancel()

    with caplog.at_level(logging.WARNING, logger="raftkv.server.leases"):
        asyncio.run(run_a_while())
    said = [r for r in caplog.records if "lease keeper" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
