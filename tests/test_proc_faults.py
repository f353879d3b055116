"""Fault tests against real ``raftkv serve`` processes (``raftkv.testing.procs``).

What they check, each against the rule named in its docstring:

1. A partitioned minority never acknowledges a write, the majority carries on, and
   after healing nothing acknowledged is lost and nothing unacknowledged appears
   (Raft §5.3/§5.4: only entries replicated on a majority commit).
2. Client histories stay linearizable while the leader is SIGKILLed and restarted and
   the network is cut and healed (DESIGN "Testing": real processes + checker), and the
   replicas' digests agree afterwards.
3. Bad input on the raft port (garbage, broken or forged handshakes, oversized or
   malformed frames, ill-typed records from an authenticated peer) closes that one
   connection with a warning and never disturbs the node (DESIGN "Transport and
   security": "Bad input").
4. Bad input on the HTTP port gets a clear client error and loses nothing.

The client histories of test 2 are recorded with single-attempt requests, not with
``raftkv.client.Client``: the Client retries a write after a 504 or a dropped
connection, so a cas whose first attempt applied but whose answer was lost comes back
as ``swapped=False`` from the retry, and a retried put may apply twice. Either would be
recorded as a definite outcome the cluster never produced, and the checker would report
a violation that is the test's own. Each request here is sent once; only a 2xx/412 is a
known outcome, a 4xx is a definite refusal (dropped), anything else is unknown.

The soak variant (``-m long``) runs the same schedule for several rounds.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pytest
from pysyncobj.poller import createPoller

from raftkv.client import Client, ClientError, Unavailable
from raftkv.node.driver import DEFAULT_REQUEST_TIMEOUT as REQUEST_TIMEOUT
from raftkv.testing.linearizability import Operation, check_history
from raftkv.testing.procs import ProcCluster, ProcNode, free_ports
from raftkv.testing.raw_peer import RawPeer, read_challenge
from raftkv.transport import handshake as hs
from raftkv.transport.frames import HEADER, TAG, VERSION, FrameMac, encode_frame
from raftkv.transport.tcp import Transport

INF = math.inf


# ================================================================ helpers ============
def http_req(
    port: int, method: str, path: str, body: bytes | None = None,
    headers: dict[str, str] | None = None, timeout: float = 5.0,
) -> tuple[int, str, bytes]:
    """One request on a fresh connection: (status, content type, body). No retries."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def json_error(ctype: str, body: bytes) -> str:
    """The ``error`` message of a JSON error body (fails the test if it is not one)."""
    assert "application/json" in ctype, (ctype, body[:200])
    doc = json.loads(body)
    assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"], doc
    return str(doc["error"])


def raw_exchange(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send raw bytes to a port and collect whatever comes back until close/timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def log_since(node: ProcNode, mark: int) -> str:
    return node.log_text()[mark:]


def wait_log(c: ProcCluster, node: ProcNode, mark: int, needle: str, timeout: float = 10.0) -> None:
    c.wait_until(lambda: needle in log_since(node, mark), timeout,
                 f"{node.id}'s log to mention {needle!r}")


REJECTED = "raftkv_transport_rejected_connections_total"


def transport_counter(node: ProcNode, name: str) -> float:
    _, _, body = http_req(node.http_port, "GET", "/metrics")
    m = re.search(r"^" + re.escape(name) + r" (\S+)$", body.decode(), re.MULTILINE)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


def stale_get(node: ProcNode, key: bytes | str) -> bytes | None:
    """The value of ``key`` in this replica's local state (no Raft round)."""
    k = key.encode() if isinstance(key, str) else key
    status, _, body = http_req(node.http_port, "GET", "/v1/kv/" + quote(k, safe="")
                                   + "?stale=true")
    if status == 404:
        return None
    assert status == 200, (node.id, status, body[:200])
    return body


def assert_digests_equal(c: ProcCluster) -> dict[str, Any]:
    c.wait_leader()
    c.wait_caught_up()
    digests = {nid: c.digest(nid) for nid in c.alive_ids()}
    first = next(iter(digests.values()))
    assert all(d == first for d in digests.values()), f"replicas diverge: {digests}"
    return first


def assert_no_traceback(c: ProcCluster) -> None:
    for n in c.nodes.values():
        text = n.log_text()
        assert "Traceback" not in text, f"{n.id} logged a traceback:\n{text[-4000:]}"
        assert " CRITICAL " not in text, f"{n.id} logged a critical error:\n{text[-4000:]}"


def _port_taken(e: BaseException) -> bool:
    return "address already in use" in str(e)


@contextmanager
def started_cluster(tmp_path: Any, size: int = 3, attempts: int = 4) -> Iterator[ProcCluster]:
    """A started ProcCluster (SIGKILLed on exit). ``procs.free_port`` picks a port and
    lets it go before the node binds it, so a busy machine can hand it to someone else
    in between; such a start is retried on fresh ports (any other failure is raised)."""
    for attempt in range(attempts):
        c = ProcCluster(os.path.join(str(tmp_path), f"cluster{attempt}"), size=size)
        try:
            c.start()
        except RuntimeError as e:
            c.__exit__(None, None, None)
            if _port_taken(e) and attempt + 1 < attempts:
                continue
            raise
        with c:
            yield c
        return


def restart(c: ProcCluster, node_id: str, attempts: int = 10) -> None:
    """Restart a killed node on its own ports (its peers know them), waiting out a port
    briefly held by someone else's connection."""
    for attempt in range(attempts):
        try:
            c.start(node_id)
            return
        except RuntimeError as e:
            if not _port_taken(e) or attempt + 1 == attempts:
                raise
            time.sleep(0.5)


# ===================================== 1. a partitioned minority never acknowledges ==
@pytest.mark.parametrize("size", [3, 5])
def test_partitioned_minority_never_acknowledges_and_heal_loses_nothing(
    tmp_path: Any, size: int
) -> None:
    """Raft §5.3/§5.4 (commitment needs a majority; a deposed leader's uncommitted entries
    are overwritten): a leader cut off with a minority must never acknowledge a write,
    whether the write reaches it directly or through a follower on its side; the majority
    elects a new leader and accepts writes. After healing, every acknowledged write is on
    every replica, none of the minority's writes ever appears, and the digests agree.

    The heal waits until the nodes' request timeout has run out on every minority
    request: a node may hold a write that arrives while no leader is known and forward it
    once one is (an unknown outcome, allowed to apply late). Past that timeout, whatever
    the minority still has is an uncommitted entry of the old term, which must vanish."""
    with started_cluster(tmp_path, size) as c:
        old = c.wait_leader()
        acked: dict[str, str] = {}
        cl = c.client()
        for i in range(5):
            cl.put(f"base-{i}", f"b{i}")
            acked[f"base-{i}"] = f"b{i}"
        cl.put("shared", "before")
        cl.close()

        # The leader plus, with 5 nodes, one follower: a minority that can still forward
        # writes to its (stale) leader.
        followers = [n for n in c.nodes if n != old]
        minority = [old] + followers[: size // 2 - 1]
        majority = [n for n in c.nodes if n not in minority]
        c.partition(minority, majority)

        # Each writer talks only to one minority endpoint and gives up after ~2 s.
        outcomes: list[tuple[str, str, object]] = []
        lock = threading.Lock()
        minority_keys = [f"minority-{j}" for j in range(3)] + [f"minority-cas-{j}"
                                                             for j in range(3)]

        def minority_write(j: int, what: str) -> None:
            endpoint = c.nodes[minority[j % len(minority)]].endpoint
            mc = Client([endpoint], timeout=2.0)
            key = {"put": f"minority-{j}", "shared": "shared"}.get(what, f"minority-cas-{j}")
            try:
                result: object
                if what == "cas":
                    result = mc.cas(key, None, f"mc{j}")
                else:
                    result = mc.put(key, f"m{j}" if what == "put" else f"minority-{j}")
            except (Unavailable, ClientError) as e:
                result = e
            finally:
                mc.close()
            with lock:
                outcomes.append((endpoint, key, result))

        writers = [threading.Thread(target=minority_write, args=(j, what))
                   for j in range(3) for what in ("put", "shared", "cas")]
        for t in writers:
            t.start()

        new = c.wait_leader(among=majority)
        assert new != old and new in majority
        mj = Client([c.nodes[n].endpoint for n in majority], timeout=10.0)
        for i in range(5):
            mj.put(f"majority-{i}", f"M{i}")
            acked[f"majority-{i}"] = f"M{i}"
        mj.put("shared", "majority-final")
        acked["shared"] = "majority-final"
        mj.close()

        for t in writers:
            t.join(30)
            assert not t.is_alive()
        writers_done = time.monotonic()
        # Nothing sent to the minority side was acknowledged: each attempt timed out or
        # was refused (421/503/504); any other answer would be a bug too.
        assert len(outcomes) == 9
        for endpoint, key, result in outcomes:
            assert isinstance(result, Unavailable | ClientError), (
                f"the minority ({minority}) acknowledged {key} via {endpoint}: {result!r}"
            )
            if isinstance(result, ClientError):
                assert result.status in (421, 503, 504), (key, result)

        time.sleep(max(0.0, writers_done + REQUEST_TIMEOUT + 1.0 - time.monotonic()))
        c.heal()
        assert_digests_equal(c)
        cl = c.client()
        for key, value in acked.items():
            assert cl.get(key) == value.encode(), key
        for key in minority_keys:
            assert cl.get(key) is None, f"minority write {key} appeared after the heal"
        cl.close()
        for nid, node in c.nodes.items():
            for key, value in acked.items():
                assert stale_get(node, key) == value.encode(), (nid, key)
            for key in minority_keys:
                assert stale_get(node, key) is None, (
                    f"minority write {key} appeared on {nid} after the heal"
                )
        assert_no_traceback(c)


def test_isolated_leader_answers_a_write_with_504_in_time(tmp_path: Any) -> None:
    """app.py contract ("504 no outcome in time"): a write sent to a leader that has lost
    its quorum gets an answer (503/504) within about the request timeout (5 s), not a
    request that hangs for as long as the partition lasts."""
    with started_cluster(tmp_path) as c:
        old = c.wait_leader()
        c.partition([old], [n for n in c.nodes if n != old])
        t0 = time.monotonic()
        try:
            status, _, body = http_req(c.nodes[old].http_port, "PUT", "/v1/kv/isolated",
                                       b"v", timeout=9.0)
        except TimeoutError:
            pytest.fail(f"no answer after {time.monotonic() - t0:.1f}s (request timeout 5 s)")
        assert status in (503, 504), (status, body)


# ============================== 2. linearizability under kill -9 and partitions =====
KEYS = ("k0", "k1", "k2")
OP_TIMEOUT = 3.0  # client-side; below the nodes' own request timeout


@dataclass
class WorkerLog:
    ops: list[Operation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


class _Endpoints:
    """One kept-alive connection per endpoint (few sockets, so little port churn).
    ``send`` connects first, separately: a refused connect means the request was never
    sent; any failure after that leaves its outcome unknown."""

    def __init__(self, ports: list[int]) -> None:
        self.conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=OP_TIMEOUT)
                      for p in ports}

    def send(self, port: int, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        conn = self.conns[port]
        if conn.sock is None:
            conn.connect()  # raises ConnectionRefusedError etc.: nothing was sent
        try:
            conn.request(method, path, body=body)
            r = conn.getresponse()
            data = r.read()
            if r.will_close:
                conn.close()
            return r.status, data
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


def _worker(cid: int, ports: list[int], seed: int, stop: threading.Event, out: WorkerLog) -> None:
    """Random single-attempt put/get/cas/delete on KEYS against random endpoints."""
    rng = random.Random(seed)
    seen: dict[str, str | None] = dict.fromkeys(KEYS)  # last value this client saw
    endpoints = _Endpoints(ports)
    n = 0
    while not stop.is_set():
        key = rng.choice(KEYS)
        port = rng.choice(ports)
        r = rng.random()
        n += 1
        value = f"c{cid}-{n}"
        if r < 0.4:
            kind, method, path, body = "get", "GET", f"/v1/kv/{key}", None
            op_value: object = None
        elif r < 0.75:
            kind, method, path, body = "put", "PUT", f"/v1/kv/{key}", value.encode()
            op_value = value
        elif r < 0.95:
            expected = seen[key] if rng.random() < 0.8 else None
            q = "prev_absent=true" if expected is None else "prev_value=" + quote(expected)
            kind, method, path, body = "cas", "PUT", f"/v1/kv/{key}?{q}", value.encode()
            op_value = (expected, value)
        else:
            kind, method, path, body = "delete", "DELETE", f"/v1/kv/{key}", None
            op_value = None
        call = time.monotonic()
        try:
            status, data = endpoints.send(port, method, path, body)
        except ConnectionRefusedError:
            out.count("refused-connect")  # never sent: no effect, not in the history
            time.sleep(0.01)
            continue
        except (OSError, http.client.HTTPException):
            status, data = -1, b""
        ret = time.monotonic()
        if kind == "get":
            if status in (200, 404):
                output = data.decode() if status == 200 else None
                out.ops.append(Operation(cid, call, ret, "get", key, None, output))
                seen[key] = output
                out.count("get-ok")
            else:
                out.count("get-dropped")  # a failed read constrains nothing
            continue
        if status == 200 or (kind == "cas" and status == 412):
            swapped: bool | None = None
            if kind == "cas":
                swapped = status == 200
                if swapped:
                    seen[key] = value
            elif kind == "put":
                seen[key] = value
            else:
                seen[key] = None
            out.ops.append(Operation(cid, call, ret, kind, key, op_value, swapped))
            out.count(f"{kind}-ok")
        elif 400 <= status < 500:
            out.count(f"{kind}-refused-{status}")  # definite refusal: never applied
        else:
            out.ops.append(Operation(cid, call, INF, kind, key, op_value, None))
            out.count(f"{kind}-unknown")
    endpoints.close()


def _fault_round(c: ProcCluster, rng: random.Random, events: list[str]) -> None:
    """SIGKILL the leader, restart it; then isolate the (new) leader and heal."""
    time.sleep(1.5)
    lead = c.wait_leader()
    c.kill(lead)
    events.append(f"{time.monotonic():.2f} kill {lead}")
    rest = [n for n in c.nodes if n != lead]
    new = c.wait_leader(among=rest)
    events.append(f"{time.monotonic():.2f} leader {new}")
    time.sleep(rng.uniform(0.5, 1.5))
    restart(c, lead)
    events.append(f"{time.monotonic():.2f} restarted {lead}")
    time.sleep(1.5)
    lead = c.wait_leader()
    others = [n for n in c.nodes if n != lead]
    c.partition([lead], others)
    events.append(f"{time.monotonic():.2f} partition [{lead}] | {others}")
    time.sleep(2 * c.election_timeout + rng.uniform(0, 1))
    c.heal()
    events.append(f"{time.monotonic():.2f} heal")
    time.sleep(1.5)


def run_linearizability(tmp_path: Any, rounds: int, clients: int, seed: int) -> None:
    with started_cluster(tmp_path) as c:
        _run_linearizability(c, tmp_path, rounds, clients, seed)


def _run_linearizability(c: ProcCluster, tmp_path: Any, rounds: int, clients: int,
                         seed: int) -> None:
    rng = random.Random(seed)
    c.wait_leader()
    ports = [n.http_port for n in c.nodes.values()]
    stop = threading.Event()
    logs = [WorkerLog() for _ in range(clients)]
    threads = [
        threading.Thread(target=_worker, args=(i, ports, seed * 100 + i, stop, logs[i]),
                         daemon=True)
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    events: list[str] = []
    try:
        for _ in range(rounds):
            _fault_round(c, rng, events)
    finally:
        stop.set()
        for t in threads:
            t.join(OP_TIMEOUT + 5)
    assert not any(t.is_alive() for t in threads)

    c.heal()
    assert_digests_equal(c)
    # One final linearizable read per key, after everything, pins the end state.
    history = [op for lg in logs for op in lg.ops]
    for key in KEYS:
        call = time.monotonic()
        status, _, data = http_req(ports[0], "GET", f"/v1/kv/{key}", timeout=10)
        assert status in (200, 404), (status, data)
        history.append(Operation(clients, call, time.monotonic(), "get", key, None,
                                 data.decode() if status == 200 else None))

    counts: dict[str, int] = {}
    for lg in logs:
        for k, v in lg.counts.items():
            counts[k] = counts.get(k, 0) + v
    summary = f"seed={seed} counts={dict(sorted(counts.items()))} events={events}"
    known_writes = sum(v for k, v in counts.items() if k.endswith("-ok") and
                       not k.startswith("get"))
    assert known_writes >= 20 and counts.get("get-ok", 0) >= 20, (
        f"too little got through to mean anything: {summary}"
    )
    result = check_history(history)
    if not result.ok:
        dump = os.path.join(str(tmp_path), "history.json")
        with open(dump, "w") as f:
            json.dump([op.__dict__ for op in history], f, default=str)
        pytest.fail(f"not linearizable ({result.key}): {result.detail}\n{summary}\n"
                    f"history: {dump}")
    assert_no_traceback(c)
    print(summary)


def test_peer_reset_between_polls_closes_that_connection_not_the_loop() -> None:
    """DESIGN "Transport and security" (a failure costs one connection, never the node):
    when a peer dies abruptly (RST) after the last poll, the next ``flush`` must drop
    that connection rather than raise into the driver loop. Two in-process transports
    make the timing exact; the real-process runs above hit it at random on kill -9."""
    poller = createPoller("auto")
    got: list[Any] = []
    pa, pb = free_ports(2)
    a = Transport("a", f"127.0.0.1:{pa}", b"s", poller, lambda p, items: got.append(items),
                  addresses={"b": f"127.0.0.1:{pb}"})
    b = Transport("b", f"127.0.0.1:{pb}", b"s", poller, lambda p, items: got.append(items),
                  addresses={"a": f"127.0.0.1:{pa}"})
    a.start()
    b.start()
    try:
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:  # connect, deliver one frame
            a.send("b", [2, 1, True, [1, None]])
            a.flush()
            poller.poll(0.05)
        conn = b.peers["a"].conn
        assert got and conn is not None and a.peers["b"].conn is not None
        # b's end vanishes as under SIGKILL with unread data: an RST, before a polls.
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.sock.close()
        time.sleep(0.1)
        a.send("b", [2, 2, True, [2, None]])
        a.flush()  # must not raise
        for _ in range(5):
            poller.poll(0.02)
        assert a.peers["b"].conn is None, "the reset connection is still in use"
    finally:
        a.close()
        b.close()


def test_linearizable_under_leader_kill_and_partition(tmp_path: Any) -> None:
    """DESIGN "Testing" / Raft §6.3, §8: with five clients doing put/get/cas/delete on
    three keys, the leader SIGKILLed and restarted and the new leader isolated and
    healed, the client history is linearizable (Wing-Gong check; unknown outcomes may or
    may not have applied) and all replicas end with the same digest."""
    run_linearizability(tmp_path, rounds=1, clients=5, seed=random.randrange(1 << 30))


@pytest.mark.long
def test_linearizable_under_repeated_faults_soak(tmp_path: Any) -> None:
    """Soak of the rule above: eight rounds of kill -9 / restart / partition / heal with
    six clients, then the linearizability check and the digest comparison."""
    run_linearizability(tmp_path, rounds=8, clients=6, seed=random.randrange(1 << 30))


# ===================================================== 3. bad input on the raft port ==
def _connect(port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _authenticate(port: int, secret: bytes, peer_id: str) -> tuple[socket.socket, FrameMac]:
    """Dial as a peer that knows the secret; the socket once welcomed, and the key and
    sequence number its frames must be tagged with."""
    peer = RawPeer(port, secret, peer_id)
    return peer.sock, peer.mac


def _closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the other side closes the connection within ``timeout`` (then closes ours)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


def _raft_record(to: str, frm: str, **over: Any) -> list[Any]:
    """A well-formed heartbeat response record (codec layout); ``over`` replaces fields."""
    fields: dict[str, Any] = {
        "kind": 0, "group": "default", "type": 8, "to": to, "frm": frm, "term": 0,
        "log_term": 0, "index": 0, "entries": [], "commit": 0, "reject": False,
        "reject_hint": 0, "snapshot": None, "context": None,
    }
    fields.update(over)
    return list(fields.values())


def test_raft_port_bad_input_closes_one_connection_and_node_keeps_serving(
    tmp_path: Any,
) -> None:
    """DESIGN "Transport and security" (Bad input; peers authenticate before any frame
    is decoded): garbage, a truncated or forged handshake, a frame without a handshake,
    huge length prefixes, and, from an authenticated peer, frames that are not item
    lists or hold ill-typed Raft records each close that one connection, are logged as
    a warning (never a traceback), leave the node's peer links up, and the node keeps
    committing and serving."""
    with started_cluster(tmp_path) as c:
        lead = c.wait_leader()
        node = c.nodes[lead]
        port = node.raft_port
        cl = c.client()
        cl.put("before", "1")
        mark = len(node.log_text())
        rejected0 = transport_counter(node, REJECTED)

        # Slow cases, started first and checked last: bytes that are too short to judge
        # stay in the handshake buffer until the handshake timeout (5 s) closes them.
        slow = []
        s = _connect(port)
        read_challenge(s)
        s.sendall(hs.MAGIC + b"\x00" * 10)  # (b) truncated hello, held open
        slow.append(("truncated hello", s))
        s = _connect(port)
        s.sendall(encode_frame([_raft_record(lead, "n2")]))  # (c) short frame, no handshake
        slow.append(("short frame without handshake", s))
        s = _connect(port)
        s.sendall(HEADER.pack(0xFFFFFFFF, VERSION))  # (e) huge length prefix, no handshake
        slow.append(("huge length prefix without handshake", s))

        def expect_rejection(what: str, sock: socket.socket, data: bytes, needle: str) -> None:
            """Send ``data``; the node must close ``sock`` and log ``needle`` as a warning."""
            start = len(node.log_text())
            sock.sendall(data)
            assert _closed_by_peer(sock), f"{what}: the node kept the connection open"
            wait_log(c, node, start, needle)
            assert "WARNING" in next(
                line for line in log_since(node, start).splitlines() if needle in line
            ), f"{what}: the rejection is not logged as a warning"

        rejecting = 0
        # (a) garbage bytes, long enough to be judged at once.
        expect_rejection("garbage", _connect(port), b"\x00GARBAGE\xff" * 16, "bad magic")
        rejecting += 1

        # (b) a truncated handshake, then close: the node just drops the connection
        # (a peer leaving is not an error, so this one need not be logged).
        s = _connect(port)
        read_challenge(s)
        s.sendall(hs.MAGIC + hs.new_nonce()[:7])
        s.close()

        # (c) a valid-looking frame without any handshake, long enough to be judged.
        frame = encode_frame([_raft_record(lead, "n2", type=1, entries=[[2, 9, 0, b"x" * 200]])])
        expect_rejection("frame without handshake", _connect(port), frame, "bad magic")
        rejecting += 1

        # (d) a correctly built hello with the wrong secret, claiming a real peer's id.
        s = _connect(port)
        nonce_a = read_challenge(s)
        other = next(n for n in c.nodes if n != lead)
        forged = hs.hello(b"not-the-secret", nonce_a, hs.new_nonce(), other,
                          c.nodes[other].raft_addr)
        expect_rejection("wrong secret", s, forged, "does not know the cluster secret")
        rejecting += 1

        # An oversized handshake (more bytes than any hello can hold).
        s = _connect(port)
        read_challenge(s)
        start = len(node.log_text())
        s.sendall(hs.MAGIC + b"\x00" * 4000)
        assert _closed_by_peer(s)
        c.wait_until(lambda: "oversized handshake" in log_since(node, start)
                     or "does not know the cluster secret" in log_since(node, start),
                     10, "the oversized handshake's rejection")
        rejecting += 1

        # (e) and (f): authenticated peers (each with its own id, so that no connection
        # of a real peer is replaced) sending bad frames, tagged with the connection's key
        # (a frame with a bad tag is tests/test_peer_security.py's case).
        def raft(peer: str, mac: FrameMac, **over: Any) -> bytes:
            return encode_frame([_raft_record(lead, peer, **over)], mac)

        def undecodable(mac: FrameMac) -> bytes:
            body = b"\xc1\xc1\xc1"
            header = HEADER.pack(len(body) + 1 + TAG, VERSION)
            return header + body + mac.tag(header, body)

        bad_frames: list[tuple[str, Any, str]] = [
            ("huge length prefix", lambda p, m: HEADER.pack(0xFFFFFFFF, VERSION),
             "exceeds the"),
            ("unknown frame version", lambda p, m: HEADER.pack(3, 9) + b"ab",
             "unknown frame version"),
            ("undecodable msgpack", lambda p, m: undecodable(m), "undecodable frame"),
            ("payload not a list", lambda p, m: encode_frame({"items": 1}, m),
             "must hold a list of items"),
            ("items not lists", lambda p, m: encode_frame([1, "x"], m), "malformed item"),
            ("unknown item kind", lambda p, m: encode_frame([[9, 1]], m), "unknown item kind"),
            ("raft record too short", lambda p, m: encode_frame([[0, "default", 8]], m),
             "expected 17 fields"),
            ("raft term of wrong type", lambda p, m: raft(p, m, term="x"),
             "expected a non-negative integer"),
            ("raft reject of wrong type", lambda p, m: raft(p, m, reject=1),
             "reject: expected a bool"),
            ("raft entry of wrong types",
             lambda p, m: raft(p, m, type=1, entries=[[1, 1, 0, "s"]]), "malformed entry"),
            ("raft context of wrong type", lambda p, m: raft(p, m, context=[1]),
             "context: expected"),
            ("forward of wrong types", lambda p, m: encode_frame([[1, -1, "default", "x"]], m),
             "malformed forward record"),
            ("message claiming another sender", lambda p, m: raft(other, m),
             f"sent a message from {other}"),
        ]
        for i, (what, frame, needle) in enumerate(bad_frames):
            peer = f"intruder-{i}"
            sock, mac = _authenticate(port, c.secret, peer)
            expect_rejection(what, sock, frame(peer, mac), needle)
            rejecting += 1

        for what, s in slow:
            assert _closed_by_peer(s, timeout=15), f"{what}: never closed"
        c.wait_until(lambda: log_since(node, mark).count("handshake timed out") >= len(slow),
                     10, "handshake timeouts logged")

        # The node is unharmed: same process, healthy, still a voter, peer links never
        # dropped, and it commits and applies new writes.
        assert node.alive
        status, _, body = http_req(node.http_port, "GET", "/health")
        assert status == 200, body
        assert transport_counter(node, REJECTED) - rejected0 >= rejecting
        text = log_since(node, mark)
        assert not re.search(r"lost connection to n\d", text), text
        members = c.group_status(lead)["members"]  # type: ignore[index]
        assert members == {n: "voter" for n in c.nodes}, members
        nc = Client([node.endpoint], timeout=10.0)
        nc.put("after", "2")
        assert nc.get("before") == b"1" and nc.get("after") == b"2"
        nc.close()
        cl.close()
        assert_digests_equal(c)
        for n in c.nodes.values():
            assert stale_get(n, "after") == b"2", n.id
        assert_no_traceback(c)


# ===================================================== 4. bad input on the HTTP port ==
def _status_line(response: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", response)
    assert m, f"not an HTTP response: {response[:120]!r}"
    return int(m.group(1))


def test_http_bad_input_gets_clear_client_errors_and_loses_nothing(tmp_path: Any) -> None:
    """DESIGN "Transport and security" (Bad input: an oversized request returns a clear
    client error, never kills the node or corrupts its state) and the app.py contract:
    malformed requests get a 4xx, an oversized body 413, bad keys/flags/JSON 400,
    unknown keys and paths 404 (JSON errors throughout), a non-UTF-8 key round-trips as
    bytes, and afterwards every earlier write is intact and the replicas agree."""
    with started_cluster(tmp_path) as c:
        lead = c.wait_leader()
        follower = next(n for n in c.nodes if n != lead)
        cl = c.client()
        before = {f"keep-{i}": f"v{i}" for i in range(10)}
        for k, v in before.items():
            cl.put(k, v)
        members = c.group_status(lead)["members"]  # type: ignore[index]

        for nid in (lead, follower):
            port = c.nodes[nid].http_port
            # Malformed HTTP on a raw socket: a 400, and the connection is closed.
            for raw in (
                b"GARBAGE\r\n\r\n",
                b"\x00\xff\xfe\x01 / HTTP/1.1\r\n\r\n",
                b"GET / HTTP/9.9\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nno-colon-header\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
                b"PUT /v1/kv/keep-0 HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\nzz",
            ):
                status = _status_line(raw_exchange(port, raw))
                assert status == 400, (raw[:40], status)
            # A client that hangs up halfway through a body: nothing is written.
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"PUT /v1/kv/keep-1 HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                          b"\r\nhalf")

            # Bodies: over the HTTP limit -> 413; over the value limit -> 400/413;
            # exactly the limit -> stored.
            status, ctype, body = http_req(port, "PUT", "/v1/kv/too-big", b"x" * (2 << 20))
            assert status == 413, (status, body[:200])
            json_error(ctype, body)
            status, ctype, body = http_req(port, "PUT", "/v1/kv/too-big",
                                           b"x" * ((1 << 20) + 1))
            assert status in (400, 413), (status, body[:200])
            json_error(ctype, body)

            # Keys: empty, too long, bad
            # flags, unsupported compare.
            status, ctype, body = http_req(port, "PUT", "/v1/kv/", b"v")
            assert status in (400, 404), (status, body)
            json_error(ctype, body)
            for method in ("PUT", "GET", "DELETE"):
                status, ctype, body = http_req(port, method, "/v1/kv/" + "k" * 600,
                                               b"v" if method == "PUT" else None)
                assert status == 400, (method, status, body)
                assert "511" in json_error(ctype, body)
            for path in ("/v1/kv/keep-0?stale=maybe", "/v1/digest?stale=maybe"):
                status, ctype, body = http_req(port, "GET", path)
                assert status == 400, (path, status, body)
                json_error(ctype, body)
            status, ctype, body = http_req(port, "PUT", "/v1/kv/keep-0?prev_index=x1", b"zz")
            assert status == 400, (status, body)
            json_error(ctype, body)

            # Bad admin bodies: 400 on the leader and on a follower, nothing changes.
            for raw_body in (b"{not json", b"[1, 2]", b'{"id": 3, "raft_addr": "x:1"}',
                             b'{"id": "n9"}', b"\xff\xfe", b""):
                status, ctype, body = http_req(port, "POST", "/v1/cluster/learners", raw_body)
                assert status == 400, (nid, raw_body, status, body)
                json_error(ctype, body)
            status, ctype, body = http_req(port, "POST", "/v1/test/partition",
                                           b'{"block": "n1"}')
            assert status == 400, (status, body)

            # Unknown key, unknown path, wrong method: JSON errors.
            status, ctype, body = http_req(port, "GET", "/v1/kv/no-such-key")
            assert status == 404 and "not found" in json_error(ctype, body)
            for method, path, code in (("GET", "/nope", 404), ("GET", "/v1/kvx", 404),
                                       ("POST", "/v1/kv/keep-0", 405)):
                status, ctype, body = http_req(port, method, path, b"" if method == "POST"
                                               else None)
                assert status == code, (method, path, status, body)
                json_error(ctype, body)

        # A non-UTF-8 key (percent-encoded) round-trips as bytes, both spellings and
        # through the Python client.
        port = c.nodes[follower].http_port
        status, _, body = http_req(port, "PUT", "/v1/kv/%ff%fe", b"binary-key")
        assert status == 200, body
        for path in ("/v1/kv/%ff%fe", "/v1/kv/%FF%FE"):
            status, _, body = http_req(port, "GET", path)
            assert (status, body) == (200, b"binary-key"), path
        assert cl.get(b"\xff\xfe") == b"binary-key"
        status, _, body = http_req(port, "PUT", "/v1/kv/max-value", b"m" * (1 << 20))
        assert status == 200, body

        # Nothing lost, nothing extra, membership unchanged, replicas equal.
        assert cl.get("too-big") is None and cl.get("keep-1") == b"v1"
        for k, v in before.items():
            assert cl.get(k) == v.encode(), k
        assert c.group_status(lead)["members"] == members  # type: ignore[index]
        digest = assert_digests_equal(c)
        assert digest["count"] == len(before) + 2
        for n in c.nodes.values():
            assert n.alive
            for k, v in before.items():
                assert stale_get(n, k) == v.encode(), (n.id, k)
            assert stale_get(n, b"\xff\xfe") == b"binary-key"
            assert len(stale_get(n, "max-value") or b"") == 1 << 20
            assert " CRITICAL " not in n.log_text()
        cl.close()


@pytest.fixture(scope="module")
def http_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    """One cluster shared by the small HTTP contract checks below."""
    with started_cluster(tmp_path_factory.mktemp("http")) as c:
        c.wait_leader()
        yield c


def test_empty_key_is_a_400(http_cluster: ProcCluster) -> None:
    """app.py contract ("the key is ... any 1..511 bytes"; "400 bad input"): an empty key
    is bad input, answered 400 with a JSON error, not 404."""
    port = http_cluster.nodes["n1"].http_port
    for method in ("PUT", "GET", "DELETE"):
        status, ctype, body = http_req(port, method, "/v1/kv/", b"v" if method == "PUT" else None)
        assert status == 400, (method, status, body)
        json_error(ctype, body)


def test_malformed_http_request_is_not_logged_as_a_server_error(
    http_cluster: ProcCluster,
) -> None:
    """DESIGN "Bad input" (a client's bad input is the client's error): a malformed HTTP
    request is answered 400 and logged, if at all, without an ERROR traceback."""
    node = http_cluster.nodes["n2"]
    mark = len(node.log_text())
    raw = b"GET /health HTTP/1.1\r\nHost: x\r\nno-colon-header\r\n\r\n"
    assert _status_line(raw_exchange(node.http_port, raw)) == 400
    time.sleep(0.5)
    text = log_since(node, mark)
    assert "Traceback" not in text and " ERROR " not in text, text


def test_client_hangup_mid_body_is_not_logged_as_an_internal_error(
    http_cluster: ProcCluster,
) -> None:
    """DESIGN "Bad input": a client hanging up mid-request is the client's doing, not an
    internal error; the node logs no ERROR traceback for it (and writes nothing)."""
    node = http_cluster.nodes["n3"]
    mark = len(node.log_text())
    with socket.create_connection(("127.0.0.1", node.http_port)) as s:
        s.sendall(b"PUT /v1/kv/hangup HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf")
        time.sleep(0.3)
    time.sleep(0.7)
    status, _, _ = http_req(node.http_port, "GET", "/v1/kv/hangup")
    assert status == 404
    text = log_since(node, mark)
    assert "Traceback" not in text and " ERROR " not in text, text
