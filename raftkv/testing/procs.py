"""Real ``raftkv serve`` processes on 127.0.0.1, for tests, the demo and benchmarks.

``ProcCluster`` starts nodes as subprocesses (``python -m raftkv.cli serve``), each with
its own data directory and log file, and can SIGKILL, restart, add joining nodes and cut
the network through the transport's test fault switch (``--enable-test-faults``). Ports
come from the kernel (bind to port 0), so parallel runs do not collide.

``tls=True`` makes a throw-away CA and a certificate per node in ``<base_dir>/tls``
(``raftkv.certs``) and runs HTTPS and mutual TLS between peers; endpoints are then
``https://``, and ``client`` and the harness's own requests verify them against that CA
and present the ``client`` certificate (so ``--client-cert-auth`` may be added).

``auth=True`` makes the nodes check bearer tokens: the cluster writes a tokens file with
one token per role (``tokens``; ``token.<role>`` files hold each alone, for the CLI's
``--token-file``), and its own calls and clients use the admin token. The two combine.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Self

from raftkv.certs import CertFiles, issue, make_ca
from raftkv.client import Client
from raftkv.server.auth import Role
from raftkv.tls import client_context


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port that is free now, chosen *below* the kernel's ephemeral range: a port the
    kernel hands out (bind to 0) is released before the node binds it, and any outgoing
    connection on the machine may take it meanwhile. Below the range only another
    explicit bind can collide, which random choice makes unlikely."""
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def free_ports(n: int, taken: Iterable[int] = ()) -> list[int]:
    """``n`` distinct ports, each as ``free_port`` picks them, none of ``taken`` (ports
    already handed to nodes that may not have bound them yet)."""
    out: list[int] = []
    avoid = set(taken)
    while len(out) < n:
        port = free_port()
        if port not in out and port not in avoid:
            out.append(port)
    return out


def http_json(url: str, body: dict[str, Any] | None = None, method: str | None = None,
              timeout: float = 2.0, context: ssl.SSLContext | None = None,
              token: str | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


@dataclass
class ProcNode:
    id: str
    raft_port: int
    http_port: int
    data_dir: str
    log_path: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    tls: CertFiles | None = None  # its certificate, key and CA, if the cluster runs TLS

    @property
    def raft_addr(self) -> str:
        return f"127.0.0.1:{self.raft_port}"

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    def tls_args(self) -> list[str]:
        """``serve`` flags for HTTPS and mutual TLS between peers (none without TLS)."""
        c = self.tls
        if c is None:
            return []
        return ["--cert-file", c.cert, "--key-file", c.key, "--trusted-ca-file", c.ca,
                "--peer-cert-file", c.cert, "--peer-key-file", c.key,
                "--peer-trusted-ca-file", c.ca, "--peer-client-cert-auth"]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


@dataclass
class ProcCluster:
    base_dir: str
    size: int = 3
    secret: bytes = b"raftkv-test-secret"
    tick: float = 0.05
    election_ticks: int = 10
    faults: bool = True
    auth: bool = False
    extra_args: list[str] = field(default_factory=list)
    nodes: dict[str, ProcNode] = field(default_factory=dict)
    tokens: dict[Role, str] = field(default_factory=dict)
    tls: bool = False

    def __post_init__(self) -> None:
        os.makedirs(self.base_dir, exist_ok=True)
        self.secret_file = os.path.join(self.base_dir, "secret")
        with open(self.secret_file, "wb") as f:
            f.write(self.secret)
        self.tokens_file = os.path.join(self.base_dir, "tokens")
        if self.auth:
            self.tokens = {r: secrets.token_urlsafe(24) for r in Role}
            lines = [f"{r.label} {r.label} {t}\n" for r, t in self.tokens.items()]
            self._private(self.tokens_file, "".join(lines))
            for r, t in self.tokens.items():
                self._private(self.token_file(r), t + "\n")
        self.tls_dir = os.path.join(self.base_dir, "tls")
        self.ca: CertFiles | None = None
        self.client_cert: CertFiles | None = None
        # What this harness's own HTTP calls verify the nodes with (None: plain HTTP).
        self.ssl_context: ssl.SSLContext | None = None
        if self.tls:
            self.ca = make_ca(self.tls_dir)
            self.client_cert = issue(self.ca, self.tls_dir, "client")
            self.ssl_context = client_context(self.ca.cert, self.client_cert.cert,
                                              self.client_cert.key)
        for i in range(1, self.size + 1):
            self._new_node(f"n{i}")
        self.founders = dict(self.peers())

    @staticmethod
    def _private(path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def token_file(self, role: Role) -> str:
        """The file holding the token of ``role`` alone (with ``auth``)."""
        return os.path.join(self.base_dir, f"token.{role.label}")

    @property
    def admin_token(self) -> str | None:
        """What the cluster's own calls send: the admin token, None without ``auth``."""
        return self.tokens.get(Role.ADMIN)

    def _new_node(self, node_id: str) -> ProcNode:
        # Distinct from every port of this cluster: two independent picks could coincide
        # (a node's HTTP port on another's Raft listener answered health checks with the
        # handshake's bytes, and a second bind made a node exit at start).
        raft, http = free_ports(2, (p for n in self.nodes.values()
                                    for p in (n.raft_port, n.http_port)))
        n = ProcNode(
            node_id, raft, http, os.path.join(self.base_dir, node_id),
            os.path.join(self.base_dir, f"{node_id}.log"),
            tls=issue(self.ca, self.tls_dir, node_id) if self.ca else None,
        )
        self.nodes[node_id] = n
        return n

    def peers(self) -> dict[str, str]:
        return {n.id: n.raft_addr for n in self.nodes.values()}

    @property
    def election_timeout(self) -> float:
        """The longest randomized election timeout, in seconds."""
        return 2 * self.election_ticks * self.tick

    # -- processes --------------------------------------------------------------------
    def start(self, node_id: str | None = None, join: bool = False) -> None:
        targets = [self.nodes[node_id]] if node_id else list(self.nodes.values())
        for n in targets:
            peers = self.founders if not join else {n.id: n.raft_addr}
            args = [
                sys.executable, "-m", "raftkv.cli", "serve", "--id", n.id,
                "--data-dir", n.data_dir, "--raft-addr", n.raft_addr,
                "--http-addr", f"127.0.0.1:{n.http_port}",
                "--peers", ",".join(f"{k}={v}" for k, v in peers.items()),
                "--secret-file", self.secret_file, "--tick", str(self.tick),
                "--election-ticks", str(self.election_ticks), *n.tls_args(),
                *self.extra_args,
            ]
            if join:
                args.append("--join")
            if self.auth:
                args += ["--tokens-file", self.tokens_file]
            if self.faults:
                args.append("--enable-test-faults")
            with open(n.log_path, "ab") as log:
                n.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            n.starts += 1
        for n in targets:
            self.wait_http(n.id)

    def add_node(self, node_id: str) -> ProcNode:
        """Start a new, empty node with --join (add it with ``add_learner`` after)."""
        n = self._new_node(node_id)
        self.start(node_id, join=True)
        return n

    def add_table_node(self, node_id: str) -> ProcNode:
        """Start a new node with --join and add it to the placement topology
        (``POST /v1/cluster/nodes``: a metastore learner, then in ``placement.nodes``)."""
        n = self.add_node(node_id)
        c = self.client([i for i in self.nodes if i != node_id])
        try:
            c.add_node(node_id, n.raft_addr, f"127.0.0.1:{n.http_port}")
        finally:
            c.close()
        return n

    def wait_http(self, node_id: str, timeout: float = 20.0) -> None:
        n = self.nodes[node_id]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not n.alive:
                raise RuntimeError(f"{node_id} exited at start:\n{n.log_text()[-3000:]}")
            try:
                status, body = http_json(n.endpoint + "/health", timeout=0.5,
                                         context=self.ssl_context)
                # "starting": HTTP is up, the node is still replaying its log.
                if status == 200 and isinstance(body, dict) and body.get("status") != "starting":
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{node_id} did not serve HTTP within {timeout}s")

    def kill(self, node_id: str) -> None:
        """SIGKILL: no shutdown path runs, exactly like a crash."""
        n = self.nodes[node_id]
        if n.proc is not None and n.alive:
            os.killpg(n.proc.pid, signal.SIGKILL)
            n.proc.wait()

    def stop(self, node_id: str) -> None:
        n = self.nodes[node_id]
        if n.proc is not None and n.alive:
            n.proc.send_signal(signal.SIGTERM)
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(node_id)

    def close(self) -> None:
        for nid in self.nodes:
            self.stop(nid)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for nid in self.nodes:
            self.kill(nid)

    # -- observation and control ------------------------------------------------------
    def alive_ids(self) -> list[str]:
        return [nid for nid, n in self.nodes.items() if n.alive]

    def status(self, node_id: str) -> dict[str, Any] | None:
        try:
            code, body = http_json(self.nodes[node_id].endpoint + "/v1/cluster", timeout=2.0,
                                   context=self.ssl_context, token=self.admin_token)
        except OSError:
            return None
        return body if code == 200 else None

    def group_status(self, node_id: str, group: str = "default") -> dict[str, Any] | None:
        st = self.status(node_id)
        return None if st is None else st["groups"][group]

    def wait_leader(self, among: list[str] | None = None, timeout: float = 20.0) -> str:
        """A leader that every node in ``among`` (default: the live ones) agrees on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = among or self.alive_ids()
            seen = {
                (g or {}).get("leader") for g in (self.group_status(i) for i in ids)
            }
            if len(seen) == 1 and None not in seen:
                lead = seen.pop()
                if lead in ids:
                    return str(lead)
            time.sleep(0.05)
        raise TimeoutError(f"no agreed leader within {timeout}s")

    def wait_until(self, pred: Any, timeout: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{what} not reached within {timeout}s")

    def create_table(self, name: str, partitions: int, replicas: int,
                     storage: str = "persistent", timeout: float = 60.0) -> None:
        """Create a table and wait until every partition has a leader and no change
        pending (its replicas placed)."""
        admin = self.client()
        try:
            admin.create_table(name, partitions, replicas, storage)
            self.wait_until(lambda: all(p["leader"] and not p["pending"] for p in
                                        admin.describe_table(name)["partitions"]),
                            timeout, f"a leader for every partition of {name}")
        finally:
            admin.close()

    def wait_caught_up(self, ids: list[str] | None = None, timeout: float = 30.0) -> None:
        """Every node in ``ids`` has applied the same index (no writes in flight)."""
        def same() -> bool:
            gs = [self.group_status(i) for i in (ids or self.alive_ids())]
            return all(gs) and len({g["applied"] for g in gs if g}) == 1
        self.wait_until(same, timeout, "replicas applying the same index")

    def client(self, ids: list[str] | None = None, timeout: float = 10.0,
               role: Role = Role.ADMIN) -> Client:
        """A client of ``ids`` (default: every node): with ``tls``, verifying them against
        the cluster's CA and presenting the client certificate; with ``auth``, sending
        ``role``'s token."""
        cc = self.client_cert
        return Client([self.nodes[i].endpoint for i in (ids or list(self.nodes))], timeout,
                      cacert=cc.ca if cc else None, cert=cc.cert if cc else None,
                      key=cc.key if cc else None, token=self.tokens.get(role))

    def partition(self, *sides: list[str]) -> None:
        """Cut traffic between the given sides (each node blocks everyone not on its side)."""
        everyone = set(self.nodes)
        for side in sides:
            for nid in side:
                block = sorted(everyone - set(side))
                code, body = http_json(self.nodes[nid].endpoint + "/v1/test/partition",
                                       {"block": block}, context=self.ssl_context,
                                       token=self.admin_token)
                if code != 200:
                    raise RuntimeError(f"partition on {nid} failed: {body}")

    def heal(self) -> None:
        for nid in self.alive_ids():
            http_json(self.nodes[nid].endpoint + "/v1/test/partition", {"block": []},
                      context=self.ssl_context, token=self.admin_token)

    def digest(self, node_id: str) -> dict[str, Any]:
        """``{"count", "digest", "applied"}`` of a replica's local state."""
        code, body = http_json(self.nodes[node_id].endpoint + "/v1/digest?stale=true",
                               context=self.ssl_context, token=self.admin_token)
        if code != 200:
            raise RuntimeError(f"digest of {node_id} failed: {body}")
        return dict(body)
