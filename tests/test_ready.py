"""``/health`` (liveness) and ``/ready`` (readiness), and the 503 a node that knows no
leader answers at once (``raftkv.server.app``'s docstring, ``docs/operations.md``).

Liveness must not depend on a leader: a probe that restarted every node of a minority
partition, or every node during an election, would make an outage of a hiccup.
Readiness is what a load balancer needs: a leader known for the default group and the
metastore, the log replayed. A node that knows no leader says so with a 503 and
``Retry-After`` at once; a ``--join`` node not yet added used to hold every request for
the driver's whole request timeout (5 s) before answering the same.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from raftkv.storage.dir_lock import release_data_dir

from raftkv import cli
from raftkv import kv as kv_module
from raftkv.node.driver import DEFAULT_REQUEST_TIMEOUT
from raftkv.node.stores import claim_data_dir
from raftkv.server import serve
from raftkv.server.auth import Role
from raftkv.testing.procs import ProcCluster, free_ports


def get(port: int, method: str, path: str, body: bytes | None = None,
        token: str | None = None) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body,
                     headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        raw = r.read()
        ctype = r.getheader("Content-Type", "")
        return r.status, dict(r.getheaders()), json.loads(raw) if "json" in ctype else raw
    finally:
        conn.close()


def test_health_is_liveness_and_ready_waits_for_a_leader(tmp_path: Path) -> None:
    with ProcCluster(str(tmp_path), size=3, tick=0.02) as c:
        c.start("n1")  # alone: no quorum, so no leader
        port = c.nodes["n1"].http_port
        status, _, body = get(port, "GET", "/health")
        assert status == 200 and body["status"] == "ok" and body["id"] == "n1"
        assert body["leader"] is None
        status, headers, body = get(port, "GET", "/ready")
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["ready"] is False and body["leaders"] == {"default": None, "meta": None}
        assert body["error"] == "no leader known for default and meta"
        status, headers, body = get(port, "GET", "/v1/kv/k")
        assert (status, body["leader"], headers["Retry-After"]) == (503, None, "1"), body
        # A new group of three is born once all three founders have run (each must see
        # that the other two hold no record of it: docs/wiped-nodes.md).
        c.start("n2")
        c.start("n3")
        lead = c.wait_leader()
        c.wait_until(lambda: get(port, "GET", "/ready")[0] == 200, what="n1 ready")
        status, _, body = get(port, "GET", "/ready")
        assert body["ready"] is True and body["leaders"]["default"] == lead
        assert body["leaders"]["meta"] in c.nodes
        # Without a token file the API is open, and the node says so where it is read.
        assert "no --tokens-file: the HTTP API" in c.nodes["n1"].log_text()


@pytest.fixture(scope="module")
def joined(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    """Three founders with a table, and n4 started with --join and not added yet."""
    with ProcCluster(str(tmp_path_factory.mktemp("join")), size=3, tick=0.02,
                     auth=True) as c:
        c.start()
        c.wait_leader()
        admin = c.client(timeout=30)
        admin.create_table("jt", 2, 3)
        admin.put("k", "v")
        c.add_node("n4")
        yield c


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/kv/k", None),
    ("PUT", "/v1/kv/k", b"w"),
    ("DELETE", "/v1/kv/k", None),
    ("PUT", "/v1/kv/k?prev_value=v", b"w"),
    ("POST", "/v1/batch", b'{"ops": [["a", "1"]]}'),
    ("GET", "/v1/digest", None),
    ("GET", "/v1/tables/jt/kv/k", None),
    ("PUT", "/v1/tables/jt/kv/k", b"w"),
    ("POST", "/v1/tables/jt/batch", b'{"ops": [["a", "1"]]}'),
    ("GET", "/v1/tables", None),
    ("GET", "/v1/tables/jt", None),
    # Found from outside: the lease reads waited out the request timeout.
    ("GET", "/v1/leases", None),
    ("GET", "/v1/leases/7", None),
])
def test_a_joined_node_not_added_yet_answers_503_at_once(
        joined: ProcCluster, method: str, path: str, body: bytes | None) -> None:
    port = joined.nodes["n4"].http_port
    t0 = time.monotonic()
    status, headers, answer = get(port, method, path, body, joined.admin_token)
    took = time.monotonic() - t0
    assert status == 503 and headers["Retry-After"] == "1", answer
    # "leader": null tells a client nothing was proposed: even a compare-and-set may be
    # sent again (raftkv.client._nothing_proposed).
    assert answer == {"error": "no leader is known; retry shortly", "leader": None}
    # Not parked until the driver's request timeout: answered without waiting for it.
    assert took < DEFAULT_REQUEST_TIMEOUT


def test_a_joined_node_serves_what_needs_no_leader_and_a_client_moves_on(
        joined: ProcCluster) -> None:
    n4 = joined.nodes["n4"]
    status, _, body = get(n4.http_port, "GET", "/health")
    assert (status, body["status"], body["leader"]) == (200, "ok", None)
    status, _, body = get(n4.http_port, "GET", "/ready")
    assert status == 503 and body["ready"] is False
    # A stale read is the local replica's, which needs no leader; but n4's holds nothing
    # of the group yet, so "absent" would be wrong: a 503 too (found from outside).
    status, _, body = get(n4.http_port, "GET", "/v1/kv/k?stale=true", token=joined.admin_token)
    assert status == 503 and "started empty" in body["error"], body
    both = joined.client(["n4", "n1"], role=Role.READ)
    assert both.get("k") == b"v"  # n4's 503 sent it to n1
    both.close()


def test_a_joined_node_is_ready_once_added(joined: ProcCluster) -> None:
    n4 = joined.nodes["n4"]
    admin = joined.client(["n1", "n2", "n3"])
    admin.add_learner("n4", n4.raft_addr)
    admin.add_node("n4", n4.raft_addr, f"127.0.0.1:{n4.http_port}")
    joined.wait_until(lambda: get(n4.http_port, "GET", "/ready")[0] == 200, 30, "n4 ready")
    assert joined.client(["n4"]).get("k") == b"v"


def test_the_probes_answer_while_the_log_is_replayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``raftkv serve`` in this process, its node's construction (where the logs are
    replayed) held until the probes have been asked: HTTP answers meanwhile, /health
    200 "starting", /ready and every other route 503 "starting" with Retry-After, a
    request without a token still 401. Then the node comes up and serves."""
    release = threading.Event()
    real = kv_module.RaftKV  # serve imports it where it opens the node

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_module, "RaftKV", held)
    raft, http_port = free_ports(2)
    (tmp_path / "secret").write_text("s3cret")
    token = "t" * 24
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin ops {token}\n")
    tokens.chmod(0o600)
    args = cli.parser().parse_args([
        "serve", "--id", "n1", "--data-dir", str(tmp_path / "n1"),
        "--raft-addr", f"127.0.0.1:{raft}", "--http-addr", f"127.0.0.1:{http_port}",
        "--peers", f"n1=127.0.0.1:{raft}", "--secret-file", str(tmp_path / "secret"),
        "--tokens-file", str(tokens), "--tick", "0.02"])
    seen: dict[str, Any] = {}

    def probe() -> None:
        answered = False
        try:
            deadline = time.monotonic() + 30
            while not answered and time.monotonic() < deadline:
                try:
                    seen["health"] = get(http_port, "GET", "/health")
                    answered = True
                except OSError:
                    time.sleep(0.02)
            seen["ready"] = get(http_port, "GET", "/ready")
            seen["kv"] = get(http_port, "GET", "/v1/kv/k", token=token)
            seen["anonymous"] = get(http_port, "GET", "/v1/kv/k")
            seen["metrics"] = get(http_port, "GET", "/metrics", token=token)
            release.set()
            while time.monotonic() < deadline:
                if get(http_port, "GET", "/ready")[0] == 200:
                    seen["put"] = get(http_port, "PUT", "/v1/kv/k", b"v", token)
                    break
                time.sleep(0.02)
        finally:
            release.set()
            if answered:  # serve's handler is installed: SIGTERM stops it, not pytest
                os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=probe)
    t.start()
    assert serve.run(args) == 0
    t.join()
    status, _, body = seen["health"]
    assert (status, body) == (200, {"status": "starting", "id": "n1", "leader": None})
    for what in ("ready", "kv", "metrics"):
        status, headers, body = seen[what]
        assert status == 503 and headers["Retry-After"] == "1", (what, body)
        assert "starting: replaying the log" in body["error"], (what, body)
    assert seen["anonymous"][0] == 401
    assert seen["put"][0] == 200, seen.get("put")


def test_a_node_that_cannot_start_exits_with_one_line(tmp_path: Path) -> None:
    """The node is built after HTTP opened: its failure still ends the process with the
    one-line error and status 1, as a failure before HTTP does."""
    data = tmp_path / "n2"
    claim_data_dir(str(data), "n1")
    release_data_dir(str(data))  # n1's directory, no longer in use
    raft, http_port = free_ports(2)
    (tmp_path / "secret").write_text("s3cret")
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n2", "--data-dir", str(data),
         "--raft-addr", f"127.0.0.1:{raft}", "--http-addr", f"127.0.0.1:{http_port}",
         "--peers", f"n2=127.0.0.1:{raft}", "--secret-file", str(tmp_path / "secret")],
        check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert f"error: {data} holds the data of node 'n1', not of 'n2'" in res.stderr
    assert "Traceback" not in res.stderr
