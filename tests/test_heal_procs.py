"""Self-healing from outside, on real ``raftkv serve`` processes (raftkv.testing.heal_procs):
a founder SIGKILLed for good under a table and default-group write load, a second one
after it, and a drain. Each ends fully replicated on the live nodes with three live
metastore voters, the table history linearizable per key, nothing acknowledged lost and
every replica's digest equal. ``benchmarks/heal.py`` times the same runs at 16 and 256
partitions."""

from __future__ import annotations

from pathlib import Path

import pytest

from raftkv.testing.heal_procs import HealRun, describe


def _check(h: HealRun) -> None:
    r = h.finish()
    assert r.ok, describe(r)
    assert r.counts.get("put-ok", 0) and r.counts.get("cas-ok", 0), describe(r)
    assert not any(k.startswith("get-error") for k in r.counts), describe(r)


def test_a_founder_killed_for_good_is_replaced_and_nothing_is_lost(tmp_path: Path) -> None:
    """Four nodes, 16 x 3: SIGKILL a founder (a metastore voter hosting partitions) and
    never restart it. After scale_down_timeout it is dead, its replicas move to the live
    nodes and a spare takes its metastore vote; writes go on throughout (the longest gap
    between acknowledged writes stays far below the scale-down timeout)."""
    h = HealRun(str(tmp_path), partitions=16, spares=1, scale_down_timeout=3.0)
    try:
        h.start()
        k = h.kill("n1")
        assert k.dead_after >= 3.0  # never on suspicion alone
        assert k.max_write_stall < 3.0, describe(h.report)
        _check(h)
    finally:
        h.close()


def test_a_live_node_is_drained_to_nothing(tmp_path: Path) -> None:
    """``drain`` of a founder: every replica and its metastore vote move off it, it leaves
    the topology, and the other four nodes are fully replicated."""
    h = HealRun(str(tmp_path), partitions=8, spares=2, scale_down_timeout=30.0)
    try:
        h.start()
        h.drain("n2")
        _check(h)
    finally:
        h.close()


@pytest.mark.long
def test_two_founders_lost_one_after_the_other_are_each_replaced(tmp_path: Path) -> None:
    """Five nodes, 16 x 3: two founders SIGKILLed in turn, each healed before the next.
    The metastore ends with three live voters (both spares promoted)."""
    h = HealRun(str(tmp_path), partitions=16, spares=2, scale_down_timeout=3.0)
    try:
        h.start()
        for node in ("n1", "n2"):
            h.kill(node)
        _check(h)
    finally:
        h.close()
