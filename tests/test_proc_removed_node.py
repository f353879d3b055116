"""A node removed while it was down, restarted with its files (real ``raftkv serve``
processes): it never received the entry that removed it, so it believed itself a voter,
campaigned unanswered for ever and told every client "no leader is known; retry
shortly" (found from outside). Now a member tells it it is not a member ("A removed
node learns it was removed" in ``raftkv.core.raft``): its status, ``/ready``, the API
and the CLI say so at once, it stops campaigning, and added back it serves again."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from raftkv.testing.procs import ProcCluster, http_json


def _removed_while_down(c: ProcCluster) -> str:
    leader = c.wait_leader()
    victim = next(n for n in ("n3", "n2", "n1") if n != leader)
    client = c.client()
    client.put(b"before", b"1")
    c.kill(victim)
    status, body = http_json(f"{c.nodes[leader].endpoint}/v1/cluster/members/{victim}",
                             method="DELETE", timeout=10)
    assert status == 200, body
    client.put(b"after", b"2")
    c.start(victim)
    c.wait_http(victim)
    return victim


def test_a_node_removed_while_down_says_so_and_added_back_serves(
        proc_cluster: ProcCluster) -> None:
    c = proc_cluster
    victim = _removed_while_down(c)
    endpoint = c.nodes[victim].endpoint
    c.wait_until(lambda: (c.group_status(victim) or {}).get("removed") is not None,
                 what=f"{victim} to learn it was removed")
    st = c.group_status(victim)
    assert st is not None and st["removed"]["by"] != victim
    others = [n for n in c.nodes if n != victim]
    term = c.group_status(c.wait_leader(others))["term"]  # type: ignore[index]

    status, body = http_json(f"{endpoint}/ready")
    assert status == 503 and "removed" in body["error"]
    status, body = http_json(f"{endpoint}/v1/kv/k", {"value": "x"}, method="PUT")
    assert status == 503 and body["removed"] and "not a member" in body["error"]
    # A stale read too: its copy stopped at its removal (a review finding).
    status, body = http_json(f"{endpoint}/v1/kv/before?stale=true")
    assert status == 503 and body["removed"], body
    started = time.monotonic()
    cli = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", endpoint,
                          "put", "k", "x"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 1 and "not a member" in cli.stderr
    assert "Traceback" not in cli.stderr
    assert time.monotonic() - started < 8  # at once, not after the client's 10 s deadline
    status_cli = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", endpoint,
                                 "-w", "json", "cluster", "status"], check=False,
                                capture_output=True, text=True, timeout=60)
    rows = [r for r in json.loads(status_cli.stdout)
            if r.get("node") == victim and r.get("group") == "default"]
    assert rows and rows[0]["kind"] == "removed" and rows[0]["removed"]["index"] > 0, rows
    # It campaigned no more: the group kept its leader and its term.
    time.sleep(1)
    leader = c.wait_leader(others)
    assert c.group_status(leader)["term"] == term  # type: ignore[index]

    # Added back (a learner, promoted once caught up), it hears from the leader again.
    status, body = http_json(f"{c.nodes[leader].endpoint}/v1/cluster/learners",
                             {"id": victim, "raft_addr": c.nodes[victim].raft_addr},
                             timeout=10)
    assert status in (200, 202), body
    c.wait_until(lambda: (c.group_status(victim) or {}).get("removed") is None
                 and (c.group_status(victim) or {}).get("members", {}).get(victim) == "voter",
                 what=f"{victim} to be a voter again")
    status, body = http_json(f"{endpoint}/v1/kv/after")
    assert status == 200, body


def test_a_node_removed_while_up_on_an_idle_cluster_says_so(
        proc_cluster: ProcCluster) -> None:
    """Found from outside: removed while up, with no writes after, n3 never received its
    removal (nor did anything else reach it), and its /ready said ready for as long as it
    ran; a linearizable read through it waited 5 s, then answered 504. The leader now
    sends it the notice when its removal applies."""
    c = proc_cluster
    leader = c.wait_leader()
    victim = next(n for n in ("n3", "n2", "n1") if n != leader)
    c.client().put(b"k", b"v")
    status, body = http_json(f"{c.nodes[leader].endpoint}/v1/cluster/members/{victim}",
                             method="DELETE", timeout=10)
    assert status == 200, body
    endpoint = c.nodes[victim].endpoint
    c.wait_until(lambda: http_json(f"{endpoint}/ready")[0] == 503, timeout=10,
                 what=f"{victim}'s /ready to say it was removed")
    started = time.monotonic()
    status, body = http_json(f"{endpoint}/v1/kv/k", timeout=10)
    assert status == 503 and body.get("removed"), body
    assert time.monotonic() - started < 2
