"""Holds keys under a lagging metastore watch (found by a review of the holds sweep).

``PlacementManager._sweep_holds`` deletes a node's holds key of a partition it does not
host. Until the delete's watch event reaches the node's cache, a start that reads the key
there would trust it and host the group with no holds key (chaos seed 11's hazard: a node
that later restarts without its state would not know it held the partition). The sweep
drops the key from the cache at once, as ``_stop_partition`` does, so the start writes it
again. The window is made deterministic by holding back the delete's watch event and the
start's retry."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from raftkv.placement.catalog import holds_key
from raftkv.testing.placement_cluster import Cluster, wait_for

TABLE, PARTS = "users", 4


def test_a_start_after_the_sweep_writes_its_holds_key_again(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    try:
        for nid in ("n1", "n2", "n3", "n4"):
            c.start(nid)
        m1 = c.mgrs["n1"]
        m1.set_nodes(["n1", "n2", "n3", "n4"])
        m1.create_table(TABLE, PARTS, 3)
        c.wait_converged(TABLE, ["n1", "n2", "n3", "n4"], 3)
        mgr = c.mgrs["n4"]
        gid = wait_for(lambda: next(iter(sorted(mgr._hosted)), None), 10, "n4 hosts one")
        part = mgr._parts[gid]
        hk = holds_key(part.table, part.index, "n4")
        wait_for(lambda: mgr.meta.get(hk).result(5) is not None, 10, "key written")

        held: list[tuple] = []
        hold = threading.Event()
        hold.set()
        real_apply = mgr._apply_event
        real_start = mgr._on_partition_start
        blocked = threading.Event()
        blocked.set()

        def apply_event(rev, key, value):  # the delete's event lags
            if hold.is_set() and key == hk and value is None:
                held.append((rev, key, value))
                return
            real_apply(rev, key, value)

        def on_start(p, *a):  # the start's retry timer has not fired yet
            if blocked.is_set() and p.group == gid:
                return
            real_start(p, *a)

        mgr._apply_event = apply_event
        mgr._on_partition_start = on_start

        def fail_start() -> None:  # as if the group's start failed and backs off
            mgr._hosted.discard(gid)
            mgr.node.remove_group(gid)
            mgr._sweep_holds()  # the liveness period's sweep
        mgr.node.call(fail_start).result(5)
        wait_for(lambda: hk not in mgr._releasing and held, 10, "delete answered")
        assert mgr.meta.get(hk).result(5) is None

        blocked.clear()  # the retry fires
        mgr.node.call(lambda: mgr._kick(gid)).result(5)
        wait_for(lambda: gid in mgr._hosted, 10, "n4 hosts it again")

        def release() -> None:
            hold.clear()
            for ev in held:
                real_apply(*ev)
        mgr.node.call(release).result(5)
        time.sleep(3.0)  # a few liveness periods and reconciles
        hosted = mgr.node.call(lambda: gid in mgr._hosted).result(5)
        key = mgr.meta.get(hk).result(5)
        assert not (hosted and key is None), f"n4 hosts {gid} with no holds key"
    finally:
        c.stop()


def test_a_restart_with_more_partitions_than_one_drain_opens_writes_each_key_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node restarted with more partitions than one drain may open (START_BUDGET)
    writes its holds key of each once. A start past the budget waits for the next drain
    with its key written (``_queue_start``); kicked back through the reconcile instead,
    it wrote the key again, because the node's cache learns its own writes only from the
    watch: 750-860 writes for 256 partitions in a measured restart, each batch of
    START_BUDGET waiting on the metastore."""
    from raftkv.placement.manager_base import START_BUDGET
    from raftkv.placement.meta_commands import OpKind
    from raftkv.placement.service import MetaService

    parts = 2 * START_BUDGET + 5
    c = Cluster(tmp_path, nodes=["n1", "n2", "n3"], meta=["n1", "n2", "n3"])
    try:
        for nid in ("n1", "n2", "n3"):
            c.start(nid)
        c.mgrs["n1"].set_nodes(["n1", "n2", "n3"])
        c.mgrs["n1"].create_table(TABLE, parts, 3)
        c.wait_converged(TABLE, ["n1", "n2", "n3"], 3, timeout=60)
        c.kill("n3")

        writes: Counter[bytes] = Counter()
        real_invoke = MetaService.invoke

        def invoke(self: MetaService, conditions, success, failure=()):  # type: ignore[no-untyped-def]
            success = list(success)
            if self.node.id == "n3":
                writes.update(op.key for op in success
                              if op.kind is OpKind.PUT and op.key.startswith(b"placement.holds."))
            return real_invoke(self, conditions, success, failure)

        monkeypatch.setattr(MetaService, "invoke", invoke)
        mgr = c.start("n3")
        wait_for(lambda: len(mgr._hosted) == parts, 60, "n3 hosts every partition again")
        assert set(writes) == {holds_key(TABLE, p, "n3") for p in range(parts)}
        assert max(writes.values()) == 1, writes.most_common(3)
        c.put(TABLE, b"after", b"restart")
        assert c.get(TABLE, b"after") == b"restart"
    finally:
        c.stop()
