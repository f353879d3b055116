"""A node that accepts connections but never answers (SIGSTOPped: a wedged process, a
paused VM), against real ``raftkv serve`` processes. Found from outside:

- a ``Client`` (and so the CLI) whose first endpoint hung waited out its whole timeout
  on it for every request and stayed on it for the next one, though two healthy nodes
  were up: a retried request's attempt used the whole deadline, and a write whose
  outcome was unknown left the client where it was;
- ``raftkv lease keepalive`` exited on the first keepalive that got no answer, each of
  which could wait longer than the lease's TTL, so the lease it kept expired;
- a leadership transfer to a stopped node, which the leader answered with a 504 in a
  second, was sent again to the next endpoint (the stopped one) and reported as "no
  answer within 10s": the leader's answer was lost.
"""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raftkv.client import Client, OutcomeUnknown, Unavailable
from raftkv.testing.procs import ProcCluster


@pytest.fixture
def cluster(proc_cluster: ProcCluster) -> ProcCluster:
    return proc_cluster


def _stop(c: ProcCluster, nid: str) -> None:
    proc = c.nodes[nid].proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)


def _resume(c: ProcCluster, nid: str) -> None:
    proc = c.nodes[nid].proc
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGCONT)


def _client(c: ProcCluster, first: str, timeout: float) -> Client:
    order = [first] + [n for n in c.nodes if n != first]
    return Client([c.nodes[n].endpoint for n in order], timeout)


def test_a_client_whose_first_endpoint_hangs_reads_and_writes_through_the_others(
        cluster: ProcCluster) -> None:
    c = cluster
    lead = c.wait_leader()
    hung = next(n for n in c.nodes if n != lead)
    w = _client(c, hung, 3.0)
    w.put("k", "before")  # its connection to the node that will hang is open
    c.wait_caught_up()
    _stop(c, hung)
    try:
        # A write sent on the open connection is sent once: unknown, and the next goes
        # on to another node.
        with pytest.raises(OutcomeUnknown, match="is the node stopped"):
            w.put("k", "abandoned")
        for i in range(3):
            assert w.put(f"after{i}", "v") > 0
        assert w.get("after2") == b"v"
        # A read may be sent again: it leaves the hung node, which answers no health
        # check either, and is answered by another.
        assert _client(c, hung, 6.0).get("after0") == b"v"
        # A write on a new connection finds the node hung before it goes out, and is
        # sent to another node (every CLI write failed so).
        assert _client(c, hung, 3.0).put("fresh", "v") > 0
    finally:
        _resume(c, hung)


def test_lease_keepalive_outlives_a_stopped_leader(cluster: ProcCluster,
                                                   tmp_path: Path) -> None:
    c = cluster
    lead = c.wait_leader()
    setup = c.client()
    lease = setup.lease_grant(3)
    setup.put("held", "1", lease=lease)
    endpoints = ",".join(c.nodes[n].endpoint
                         for n in [lead] + [n for n in c.nodes if n != lead])
    out = open(tmp_path / "keepalive.out", "w+")  # noqa: SIM115  # closed below
    # The command with Python's SIGINT handler installed whatever it inherited: a suite
    # started in the background by a shell without job control has SIGINT ignored, and
    # a keeper inheriting that outlived the SIGINT below (a fresh-clone run under `&`).
    cli = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "from raftkv.cli import main; sys.exit(main(sys.argv[1:]))")
    keeper = subprocess.Popen(
        [sys.executable, "-c", cli, "--endpoints", endpoints, "lease",
         "keepalive", str(lease)], stdout=out, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.5)
        _stop(c, lead)
        try:
            rest = [n for n in c.nodes if n != lead]
            c.wait_leader(rest)
            time.sleep(7.0)  # more than twice the TTL
            out.seek(0)
            assert keeper.poll() is None, out.read()
            assert Client([c.nodes[n].endpoint for n in rest], 5.0).get("held") == b"1"
        finally:
            _resume(c, lead)
    finally:
        keeper.send_signal(signal.SIGINT)
        keeper.wait(10)
        out.close()


def test_a_transfer_to_a_stopped_node_reports_the_leaders_answer(
        cluster: ProcCluster) -> None:
    c = cluster
    lead = c.wait_leader()
    target = next(n for n in c.nodes if n != lead)
    _stop(c, target)
    try:
        with pytest.raises(OutcomeUnknown, match="did not take over"):
            _client(c, lead, 10.0).transfer(target)
    finally:
        _resume(c, target)


def test_a_slow_answer_from_a_live_node_is_waited_for() -> None:
    """Found in review of the fix above, which gave each attempt of a retried request a
    third of the timeout: a live node answering a read in 1.5 s failed a client with a
    3 s timeout, after three attempts. The client now waits the whole deadline for a
    node that still answers its health check (a server here that takes 1.5 s for
    everything but ``/health``), and gives up early only on one that does not."""
    attempts: list[str] = []

    class Slow(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path != "/health":
                attempts.append(self.path)
                time.sleep(1.5)
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ep = f"http://127.0.0.1:{server.server_address[1]}"
        client = Client([ep, ep], 3.0)
        assert client.request("GET", "/v1/slow")[0] == 200
        assert attempts == ["/v1/slow"]
    finally:
        server.shutdown()
        server.server_close()


def test_cluster_status_against_a_stopped_endpoint_keeps_to_its_timeout(
        cluster: ProcCluster) -> None:
    """--timeout bounds a whole command (docs/operations.md). Found from outside:
    ``cluster status`` with only a stopped node's endpoint took twice --timeout (the
    status, then the placement nodes asked of the node that had just not answered)."""
    c = cluster
    hung = next(n for n in c.nodes if n != c.wait_leader())
    _stop(c, hung)
    try:
        t0 = time.monotonic()
        res = subprocess.run(
            [sys.executable, "-m", "raftkv.cli", "--endpoints", c.nodes[hung].endpoint,
             "--timeout", "3", "cluster", "status", "--only-endpoints"],
            capture_output=True, text=True, timeout=60, check=False)
        took = time.monotonic() - t0
        assert res.returncode == 1 and "unreachable" in res.stdout, (res.stdout, res.stderr)
        assert took < 3 + 2.5, f"took {took:.1f}s"  # the interpreter's start, not 6 s
    finally:
        _resume(c, hung)


def test_a_watch_leaves_a_hung_node_and_gives_up_when_none_serves_it(
        cluster: ProcCluster) -> None:
    """Found from outside: ``raftkv watch`` against a node that accepted connections and
    never answered waited in silence for good, its ``--timeout`` ignored. A node now has
    a probe wait to answer a watch, and when no node has served it for ``timeout``
    seconds the watch fails, naming the revision to resume from."""
    c = cluster
    lead = c.wait_leader()
    hung = next(n for n in c.nodes if n != lead)
    _stop(c, hung)
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable, match="no node served the watch for 2.0s"):
            next(Client([c.nodes[hung].endpoint], 2.0).watch(prefix="w"))
        assert time.monotonic() - started < 6
        res = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints",
                              c.nodes[hung].endpoint, "--timeout", "2", "watch", "--count", "1"],
                             check=False, capture_output=True, text=True, timeout=30)
        assert res.returncode == 1 and "no node served the watch" in res.stderr, res
        assert "Traceback" not in res.stderr
        # Listed first of several, the hung node is passed over.
        index = Client([c.nodes[lead].endpoint]).put("w1", "v")
        rev, events = next(_client(c, hung, 3.0).watch(prefix="w", from_revision=index))
        assert rev == index and events[0]["key"] == b"w1"
    finally:
        _resume(c, hung)


def test_a_write_to_a_lone_hung_endpoint_is_not_sent_and_says_so() -> None:
    """Found from outside: with one endpoint, a node that accepted connections and never
    answered got the write, which then ended "may or may not have applied" (with several
    endpoints the health check on the new connection had already kept it from leaving).
    A write now checks a new connection with one endpoint too: nothing is sent, and the
    answer is that the node did not answer."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # the kernel accepts; nobody ever reads or answers
    try:
        c = Client([f"http://127.0.0.1:{hung.getsockname()[1]}"], 3.0, connect_timeout=2.0)
        with pytest.raises(Unavailable, match="no answer to a health check"):
            c.put("k", "v")
        c.close()
    finally:
        hung.close()


def test_an_established_watch_whose_node_hangs_resumes_on_another(
        cluster: ProcCluster) -> None:
    """Found in review: a watch streaming from a node that then hung (its connection open,
    nothing more on it) waited out its timeout on the read and then gave up with
    ``Unavailable``, though another node was up. A silent stream is now broken after
    ``WATCH_SILENCE`` and resumed elsewhere, with the whole timeout for the failover."""
    c = cluster
    lead = c.wait_leader()
    hung = next(n for n in c.nodes if n != lead)
    writer = Client([c.nodes[lead].endpoint])
    first = writer.put("w/1", "v")
    stream = _client(c, hung, 3.0).watch(prefix="w/", from_revision=first)
    assert next(stream)[1][0]["key"] == b"w/1"
    _stop(c, hung)
    try:
        second = writer.put("w/2", "v")
        rev, events = next(stream)  # from another node, after the hung one's silence
        assert (rev, events[0]["key"]) == (second, b"w/2")
    finally:
        _resume(c, hung)
