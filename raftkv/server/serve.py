"""``raftkv serve``: one node process (Raft on --raft-addr, HTTP on --http-addr).

Start-up order: the arguments (and the tokens file) are checked before anything is
written; then the HTTP port opens, so ``/health`` answers and ``/ready`` says
"starting" while the node is built on a worker thread (its logs replayed: the default
group's and the metastore's), and only then is the node attached to the API. A long
replay thus never looks like a dead process to a liveness probe. The node logs its
recovery report, serves until SIGTERM/SIGINT, then stops cleanly (pending requests fail
with "node stopped"; nothing durable is at risk, since every acknowledged write was
fsynced to the Raft log before it was acknowledged). SIGHUP reloads the tokens file.

TLS flags mirror etcd's: ``--cert-file``/``--key-file``/``--trusted-ca-file``/
``--client-cert-auth`` for the HTTP API, ``--peer-cert-file``/``--peer-key-file``/
``--peer-trusted-ca-file``/``--peer-client-cert-auth`` for the peer port
(``raftkv.tls``; docs/security.md). With HTTP TLS on, the node also speaks HTTPS to the
other nodes when it proxies a table request, verifying them against the same CA and
presenting its own certificate (and passing on the client's ``Authorization`` header).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from raftkv.kv import RaftKV
from raftkv.recovery.compaction import CompactionPolicy
from raftkv.server.app import Api
from raftkv.server.auth import Tokens
from raftkv.server.metrics import PrometheusMetrics
from raftkv.server.requests import JsonErrorsRunner
from raftkv.server.tables import Placement
from raftkv.tls import TlsConfig
from raftkv.transport.tcp import parse_addr

log = logging.getLogger("raftkv.serve")


def parse_peers(text: str) -> dict[str, str]:
    peers = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        node, sep, addr = part.partition("=")
        if not sep or not node:
            raise ValueError(f"bad peer {part!r}: expected id=host:port")
        parse_addr(addr)
        if node in peers:
            raise ValueError(f"--peers names {node} twice")
        peers[node] = addr
    shared = [a for a, n in Counter(peers.values()).items() if n > 1]
    if shared:
        # Two ids at one address: whichever process binds it answers for both, and each
        # of the two ids would be counted as a voter: a quorum one node can fake.
        raise ValueError(f"--peers gives the address {shared[0]} to "
                         f"{' and '.join(n for n, a in peers.items() if a == shared[0])}: "
                         "every node needs its own")
    return peers


def tls_config(args: argparse.Namespace, peer: bool) -> TlsConfig | None:
    """The HTTP (``peer=False``) or peer TLS settings of the flags, None if TLS is off."""
    pre = "peer_" if peer else ""
    flag = "--peer-" if peer else "--"
    cert, key = getattr(args, pre + "cert_file"), getattr(args, pre + "key_file")
    ca, auth = getattr(args, pre + "trusted_ca_file"), getattr(args, pre + "client_cert_auth")
    if cert is None and key is None:
        if ca is not None or auth:
            raise ValueError(f"{flag}trusted-ca-file and {flag}client-cert-auth need "
                             f"{flag}cert-file and {flag}key-file")
        return None
    if cert is None or key is None:
        raise ValueError(f"give both {flag}cert-file and {flag}key-file")
    if auth and ca is None:
        raise ValueError(f"{flag}client-cert-auth needs {flag}trusted-ca-file")
    return TlsConfig(cert, key, ca, auth)


def read_secret(path: str | None) -> bytes:
    if path is not None:
        with open(path, "rb") as f:
            secret = f.read().strip()
    else:
        secret = os.environ.get("RAFTKV_SECRET", "").encode()
    if not secret:
        raise ValueError("a cluster secret is required: --secret-file F or RAFTKV_SECRET")
    return secret


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", required=True, help="this node's id")
    p.add_argument("--data-dir", help="where the LMDB files live (omit with --memory)")
    p.add_argument("--raft-addr", required=True, help="host:port for peer traffic")
    p.add_argument("--http-addr", required=True, help="host:port for the HTTP API")
    p.add_argument("--peers", default="", help="founding members: n1=host:port,n2=...")
    p.add_argument("--secret-file", help="file holding the cluster secret (or RAFTKV_SECRET)")
    p.add_argument("--tokens-file",
                   help="bearer tokens of HTTP clients, lines of ROLE NAME TOKEN (roles: "
                        "metrics, read, write, admin); reloaded on SIGHUP. Without it the "
                        "HTTP API is open to anyone who can reach it")
    p.add_argument("--join", action="store_true",
                   help="start empty and wait to be added as a learner")
    p.add_argument("--memory", action="store_true", help="in-memory storage (nothing persists)")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the Raft log")
    p.add_argument("--tick", type=float, default=0.05, help="seconds per Raft tick")
    p.add_argument("--election-ticks", type=int, default=10,
                   help="election timeout in ticks (randomized up to twice this)")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the HTTP server's event loop: uvloop (a libuv loop, less CPU per "
                        "request) or Python's own; auto: uvloop when installed")
    p.add_argument("--compact-entries", type=int, default=CompactionPolicy.max_entries,
                   help="compact the Raft log once it holds this many entries")
    p.add_argument("--compact-keep", type=int, default=CompactionPolicy.keep,
                   help="entries kept after compaction for slightly-behind followers")
    for peer in (False, True):
        flag, who = ("--peer-", "peer") if peer else ("--", "HTTP")
        p.add_argument(f"{flag}cert-file", help=f"{who} TLS: this node's certificate (PEM)")
        p.add_argument(f"{flag}key-file", help=f"{who} TLS: its private key (PEM)")
        p.add_argument(f"{flag}trusted-ca-file",
                       help=f"{who} TLS: the CA that signs the other side's certificates")
        p.add_argument(f"{flag}client-cert-auth", action="store_true",
                       help=f"{who} TLS: require a certificate from "
                            f"{'peers' if peer else 'clients'} (mutual TLS)")
    p.add_argument("--enable-test-faults", action="store_true",
                   help="expose POST /v1/test/partition (tests only)")
    p.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s {args.id} %(levelname)s %(name)s: %(message)s",
    )
    if not args.memory and not args.data_dir:
        raise ValueError("--data-dir is required unless --memory is given")
    peers = parse_peers(args.peers)
    if peers and args.id not in peers and not args.join:
        # Bootstrapping with itself added would make a configuration of len(peers) + 1
        # voters that no other node shares: a mistyped --id splits the cluster.
        raise ValueError(f"--id {args.id} is not among --peers ({', '.join(sorted(peers))}): "
                         "list it there to found a cluster with them, or give --join to "
                         "start empty and be added to a running cluster")
    peers.setdefault(args.id, args.raft_addr)
    if peers[args.id] != args.raft_addr:
        raise ValueError(f"--peers gives {args.id} the address {peers[args.id]}, "
                         f"but --raft-addr is {args.raft_addr}")
    host, port = parse_addr(args.http_addr)
    secret = read_secret(args.secret_file)
    tokens = Tokens(args.tokens_file) if args.tokens_file else None
    http_tls = tls_config(args, peer=False)
    peer_tls = tls_config(args, peer=True)
    if peer_tls is not None:
        peer_tls.client_context()  # loads every file: a bad one fails here, not at first dial
    # Both contexts now: a missing or bad file fails the start, before anything is written.
    http_ssl = http_tls.server_context() if http_tls is not None else None
    proxy_ssl = http_tls.client_context() if http_tls is not None else None
    if tokens is None:  # once every argument passed: a refused start is one line
        log.warning("no --tokens-file: the HTTP API on %s answers anyone who can reach it, "
                    "membership and table changes included (docs/operations.md)",
                    args.http_addr)
    registry = CollectorRegistry()
    api = Api(args.id, registry, faults=args.enable_test_faults, tokens=tokens)
    closers: list[Callable[[], None]] = []  # what build made, to undo in reverse

    def build() -> None:
        """The node, its logs replayed; on a worker thread while HTTP serves."""
        meta_dir = args.data_dir
        if args.memory:
            tmp = tempfile.TemporaryDirectory(prefix=f"raftkv-meta-{args.id}-")
            closers.append(tmp.cleanup)
            meta_dir = tmp.name
        kv = RaftKV(
            args.id, args.raft_addr, peers, secret,
            data_dir=None if args.memory else args.data_dir,
            durable=not args.no_fsync, join=args.join, tick_seconds=args.tick,
            election_tick=args.election_ticks, metrics=PrometheusMetrics(registry),
            faults=args.enable_test_faults, peer_tls=peer_tls,
            compaction=CompactionPolicy(max_entries=args.compact_entries,
                                        keep=args.compact_keep),
        )
        closers.append(kv.close)
        placement = Placement(
            kv, None if args.memory else args.data_dir, meta_dir, args.http_addr,
            None if args.join else sorted(peers), durable=not args.no_fsync,
            http_ssl=proxy_ssl,
        )
        closers.append(placement.stop)
        placement.start()
        log.info("%s", kv.node.groups[kv.group].recovery.describe())
        api.attach(kv, placement)
        log.info("serving: raft on %s%s", args.raft_addr, " (TLS)" if peer_tls else "")

    try:
        log.info("%s on %s; starting the node", "HTTPS" if http_ssl else "HTTP",
                 args.http_addr)
        with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
            runner.run(serve_http(api.app(), host, port, build, ssl_context=http_ssl,
                                  on_hangup=tokens.reload if tokens is not None else None))
    finally:
        # Last built, first stopped: the placement manager uses the node.
        for close in reversed(closers):
            close()
        log.info("stopped")
    return 0


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``--event-loop``: uvloop's loop, or None for asyncio's own. The HTTP side spends
    most of a request's CPU in the event loop's machinery (scheduling callbacks, the
    selector, socket writes), which uvloop runs in C."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed "
                             "(pip install uvloop, or --event-loop asyncio)") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def serve_http(app: web.Application, host: str, port: int, start: Callable[[], None],
                     ssl_context: ssl.SSLContext | None = None,
                     on_hangup: Callable[[], None] | None = None) -> None:
    """Serve ``app`` on host:port (HTTPS with ``ssl_context``), run ``start`` on a worker
    thread meanwhile, and return on SIGTERM or SIGINT (once ``start`` returned: it cannot
    be interrupted). ``start`` raising stops the server and raises here. SIGHUP calls
    ``on_hangup``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    runner = JsonErrorsRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        started = loop.run_in_executor(None, start)
        stopping = asyncio.ensure_future(stop.wait())
        either: set[asyncio.Future[Any]] = {started, stopping}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        await started  # its failure ends the server (after a stop, let it finish first)
        await stopping
    finally:
        await runner.cleanup()
