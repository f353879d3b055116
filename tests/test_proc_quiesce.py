"""Quiescence against real ``raftkv serve`` processes (raftkv.core.raft, "Quiescence";
raftkv.node.driver, "Peer liveness").

An idle group stops heartbeating, so its followers no longer learn of a dead leader
from missed heartbeats. These tests check the replacement, node liveness from the
transport, on both ways a leader disappears:

1. SIGKILL: the connection drops at once; the followers wake and elect a new leader
   within about one randomized election timeout (Raft §5.2 liveness).
2. A silent cut (the test fault switch drops traffic, connections stay up): the
   keepalive frames stop, the peer is declared unreachable after one election timeout,
   and the majority elects a new leader; the cut-off leader, woken by the same report,
   steps down by check-quorum (dissertation §6.2).
"""

from __future__ import annotations

import http.client
import time
from pathlib import Path

from raftkv.testing.procs import ProcCluster


def _quiet(c: ProcCluster) -> bool:
    gs = [c.group_status(n) for n in c.alive_ids()]
    return all(g is not None and g.get("quiesced") for g in gs)


def _put_once(endpoint: str, key: str) -> bool:
    """One PUT, one attempt, fresh connection: True only if acknowledged."""
    host = endpoint.split("//")[1]
    try:
        conn = http.client.HTTPConnection(host, timeout=2)
        conn.request("PUT", "/v1/kv/" + key, body=b"v")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except (OSError, http.client.HTTPException):
        return False


def _first_ack(c: ProcCluster, among: list[str], since: float, timeout: float = 20.0) -> float:
    deadline = since + timeout
    i = 0
    while time.monotonic() < deadline:
        for nid in among:
            i += 1
            if _put_once(c.nodes[nid].endpoint, f"probe-{i}"):
                return time.monotonic() - since
        time.sleep(0.02)
    raise AssertionError(f"no write acknowledged by {among} within {timeout} s")


def test_idle_leader_sigkill_is_replaced(tmp_path: Path) -> None:
    with ProcCluster(str(tmp_path), faults=False) as c:
        c.start()
        c.wait_leader()
        c.client().put("k", b"v")
        times = []
        for _ in range(2):
            old = c.wait_leader()
            c.wait_until(lambda: _quiet(c), 15.0, "the idle default group to quiesce")
            survivors = [n for n in c.alive_ids() if n != old]
            t0 = time.monotonic()
            c.kill(old)
            times.append(_first_ack(c, survivors, t0))
            assert c.wait_leader(among=survivors) in survivors
            c.start(old)
            c.wait_caught_up(timeout=30.0)
        print(f"idle-leader failover (kill -> first ack): {[f'{t:.3f}' for t in times]} s")
        # One randomized election timeout (0.5-1 s) plus the pre-vote and vote rounds;
        # loose for a loaded 2-core machine.
        assert max(times) < 5 * c.election_timeout, times


def test_idle_leader_cut_off_silently_is_replaced_and_steps_down(tmp_path: Path) -> None:
    with ProcCluster(str(tmp_path)) as c:
        c.start()
        c.wait_leader()
        c.client().put("k", b"v")
        old = c.wait_leader()
        c.wait_until(lambda: _quiet(c), 15.0, "the idle default group to quiesce")
        rest = [n for n in c.nodes if n != old]
        t0 = time.monotonic()
        c.partition([old], rest)
        took = _first_ack(c, rest, t0)
        print(f"idle-leader silent cut (cut -> first ack on the majority): {took:.3f} s")
        assert took < 8 * c.election_timeout, took
        new = c.wait_leader(among=rest)
        assert new != old
        # The cut-off leader was woken by the same liveness report and, without a
        # quorum, stepped down (check-quorum) instead of staying quiet as leader.
        c.wait_until(lambda: (c.group_status(old) or {}).get("role") != "leader", 10.0,
                     "the cut-off leader to step down")
        c.heal()
        c.wait_leader()
        c.wait_caught_up(timeout=30.0)
