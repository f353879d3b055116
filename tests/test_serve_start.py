"""How ``raftkv serve`` starts: arguments that would split a cluster are refused before
anything is written, and ``/health`` tells a load balancer whether a leader is known."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raftkv.testing.procs import ProcCluster, free_ports, http_json


def test_an_id_missing_from_peers_is_refused_without_join(tmp_path: Path) -> None:
    """A mistyped --id used to bootstrap a configuration of the peers plus itself: a
    4-voter group no other node shares."""
    ports = free_ports(5)
    peers = ",".join(f"n{i}=127.0.0.1:{ports[i - 1]}" for i in (1, 2, 3))
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    data = tmp_path / "n7"
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n7", "--data-dir", str(data),
         "--raft-addr", f"127.0.0.1:{ports[3]}", "--http-addr", f"127.0.0.1:{ports[4]}",
         "--peers", peers, "--secret-file", str(secret)],
        check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "n7 is not among --peers (n1, n2, n3)" in res.stderr
    assert "Traceback" not in res.stderr
    assert not data.exists() or not os.listdir(data)  # nothing written


def test_health_is_503_until_a_leader_is_known(tmp_path: Path) -> None:
    with ProcCluster(str(tmp_path), size=3, tick=0.02) as c:
        c.start("n1")  # alone: no quorum, so no leader
        status, body = http_json(c.nodes["n1"].endpoint + "/health")
        assert status == 503 and body["status"] == "no leader" and body["id"] == "n1"
        # A new group of three is born once all three founders have run (each must see
        # that the other two hold no record of it: docs/wiped-nodes.md).
        c.start("n2")
        c.start("n3")
        c.wait_leader()
        status, body = http_json(c.nodes["n1"].endpoint + "/health")
        assert status == 200 and body["status"] == "ok" and body["leader"] in c.nodes
