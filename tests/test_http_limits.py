"""What a client that misbehaves at the connection level can cost a ``raftkv serve`` node,
from outside, on real processes (an outside-in security run found each):

- a connection that never completes a request head, or idles, is closed after
  ``--http-idle-timeout`` (aiohttp's own default held it an hour, and a flood of them ran
  a node out of file descriptors);
- connections beyond ``--http-max-connections`` are closed at once, and the node keeps
  serving;
- a request the HTTP parser refuses is answered without quoting its bytes, so a bearer
  token with a stray byte reaches neither the log nor the answer;
- an HTTP port already in use fails the start before anything is written.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raftkv.testing.procs import ProcCluster, free_ports


def _one_node(tmp_path: Path, *args: str) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path / "c"), size=1, faults=False, auth=True,
                     extra_args=list(args)) as c:
        c.start()
        c.wait_leader()
        yield c


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ProcCluster]:
    """A node that closes idle connections after 1 s."""
    yield from _one_node(tmp_path, "--http-idle-timeout", "1")


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[ProcCluster]:
    """A node that takes 20 connections at once (and idles them the default 30 s, so the
    cap alone decides which are closed, however slowly a loaded machine accepts them)."""
    yield from _one_node(tmp_path, "--http-max-connections", "20")


def _token(c: ProcCluster) -> str:
    token = c.admin_token
    assert token is not None
    return token


def _request(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out:
                break
        return out


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_a_silent_or_slow_connection_is_closed_after_the_idle_timeout(
    node: ProcCluster,
) -> None:
    port = node.nodes["n1"].http_port
    silent = socket.create_connection(("127.0.0.1", port))
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET /health HTTP/1.1\r\n")
    start = time.monotonic()
    for _ in range(3):  # slowloris: a header line now and then, never the end of the head
        time.sleep(0.3)
        try:
            slow.sendall(b"X-Slow: 1\r\n")
        except OSError:
            break
    assert _closed_within(silent, 5) and _closed_within(slow, 5)
    assert time.monotonic() - start < 5
    silent.close()
    slow.close()


def test_connections_beyond_the_cap_are_closed_and_the_node_keeps_serving(
    capped: ProcCluster,
) -> None:
    node = capped
    port = node.nodes["n1"].http_port
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        closed = sum(_closed_within(s, 0.5) for s in held[25:])
        assert closed == 15  # every one past the cap (20, and a little slack)
    finally:
        for s in held:
            s.close()
    # Once the flood is gone the node serves as before (its loop never noticed it). Until
    # the node has seen the held connections close, they still count against the cap and a
    # new one is closed at once: on a loaded machine that takes a while, so retry.
    deadline = time.monotonic() + 10
    while True:
        try:
            got = _request(port, (f"PUT /v1/kv/after HTTP/1.1\r\nHost: x\r\nAuthorization: "
                                  f"Bearer {_token(node)}\r\nContent-Length: 1\r\n"
                                  f"Connection: close\r\n\r\nv").encode())
        except ConnectionResetError as e:
            got = repr(e).encode()
        if b" 200 " in got.split(b"\r\n")[0]:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.2)


def test_a_malformed_authorization_header_is_quoted_nowhere(node: ProcCluster) -> None:
    port = node.nodes["n1"].http_port
    token = _token(node)
    for header in (f"Authorization: Bearer \x00{token}", f"Authorization: Bearer\r\n {token}"):
        got = _request(port, (f"GET /v1/kv/k HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n"
                              ).encode("latin-1"))
        assert b" 400 " in got.split(b"\r\n")[0], got
        assert token.encode() not in got
    time.sleep(0.5)
    log = node.nodes["n1"].log_text()
    assert "bad HTTP request" in log and token not in log


def test_an_http_port_in_use_fails_the_start_before_anything_is_written(
    tmp_path: Path,
) -> None:
    raft, http = free_ports(2)
    taken = socket.create_server(("127.0.0.1", http))
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    data = tmp_path / "n1"
    try:
        res = subprocess.run(
            [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n1", "--data-dir", str(data),
             "--raft-addr", f"127.0.0.1:{raft}", "--http-addr", f"127.0.0.1:{http}",
             "--peers", f"n1=127.0.0.1:{raft}", "--secret-file", str(secret)],
            check=False, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert res.returncode == 1, res.stderr
    assert f"--http-addr 127.0.0.1:{http}" in res.stderr and "Traceback" not in res.stderr
    assert not data.exists() or not os.listdir(data)


def test_a_malformed_percent_escape_is_refused_not_taken_literally(node: ProcCluster) -> None:
    """Found from outside: ``PUT /v1/kv/x%zz`` stored the key ``x%zz``, the one
    ``x%25zz`` names."""
    port = node.nodes["n1"].http_port
    auth = f"Authorization: Bearer {_token(node)}\r\n"
    for target in ("/v1/kv/x%zz", "/v1/kv/x%4", "/v1/kv/k?prev_value=%g1"):
        got = _request(port, (f"PUT {target} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1"
                              f"\r\nConnection: close\r\n\r\nv").encode())
        assert b" 400 " in got.split(b"\r\n")[0] and b"percent-escape" in got, got
    got = _request(port, (f"GET /v1/kv/x%25zz HTTP/1.1\r\nHost: x\r\n{auth}"
                          "Connection: close\r\n\r\n").encode())
    assert b" 404 " in got.split(b"\r\n")[0], got  # nothing was written


def test_peer_tls_without_the_peers_ca_is_refused_at_start(tmp_path: Path) -> None:
    """Found from outside: it started, then every peer dial failed against the system's
    CAs and the cluster never elected."""
    from raftkv.certs import issue, make_ca

    ca = make_ca(str(tmp_path / "tls"))
    cert = issue(ca, str(tmp_path / "tls"), "n1")
    raft, http = free_ports(2)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n1",
         "--data-dir", str(tmp_path / "n1"), "--raft-addr", f"127.0.0.1:{raft}",
         "--http-addr", f"127.0.0.1:{http}", "--peers", f"n1=127.0.0.1:{raft}",
         "--secret-file", str(secret), "--peer-cert-file", cert.cert,
         "--peer-key-file", cert.key],
        check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "--peer-cert-file needs --peer-trusted-ca-file" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "n1").exists()
