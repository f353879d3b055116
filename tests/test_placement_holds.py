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
from pathlib import Path

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
