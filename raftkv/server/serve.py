"""``raftkv serve``: one node process (Raft on --raft-addr, HTTP on --http-addr).

It logs its recovery report at start, serves until SIGTERM/SIGINT, then stops the
node cleanly (pending requests fail with "node stopped"; nothing durable is at risk,
since every acknowledged write was fsynced to the Raft log before it was acknowledged).

TLS flags mirror etcd's: ``--cert-file``/``--key-file``/``--trusted-ca-file``/
``--client-cert-auth`` for the HTTP API, ``--peer-cert-file``/``--peer-key-file``/
``--peer-trusted-ca-file``/``--peer-client-cert-auth`` for the peer port
(``raftkv.tls``; docs/security.md). With HTTP TLS on, the node also speaks HTTPS to the
other nodes when it proxies a table request, verifying them against the same CA and
presenting its own certificate.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections import Counter

from aiohttp import web
from prometheus_client import CollectorRegistry

from raftkv.kv import RaftKV
from raftkv.recovery.compaction import CompactionPolicy
from raftkv.server.app import Api, QuietBadRequests
from raftkv.server.metrics import PrometheusMetrics
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
    p.add_argument("--join", action="store_true",
                   help="start empty and wait to be added as a learner")
    p.add_argument("--memory", action="store_true", help="in-memory storage (nothing persists)")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the Raft log")
    p.add_argument("--tick", type=float, default=0.05, help="seconds per Raft tick")
    p.add_argument("--election-ticks", type=int, default=10,
                   help="election timeout in ticks (randomized up to twice this)")
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
    logging.getLogger("aiohttp.server").addFilter(QuietBadRequests())
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
    http_tls = tls_config(args, peer=False)
    peer_tls = tls_config(args, peer=True)
    if peer_tls is not None:
        peer_tls.client_context()  # loads every file: a bad one fails here, not at first dial
    # Both contexts now: a missing or bad file fails the start, before anything is written.
    http_ssl = http_tls.server_context() if http_tls is not None else None
    proxy_ssl = http_tls.client_context() if http_tls is not None else None
    registry = CollectorRegistry()
    kv = RaftKV(
        args.id, args.raft_addr, peers,
        read_secret(args.secret_file), data_dir=None if args.memory else args.data_dir,
        durable=not args.no_fsync, join=args.join, tick_seconds=args.tick,
        election_tick=args.election_ticks, metrics=PrometheusMetrics(registry),
        faults=args.enable_test_faults, peer_tls=peer_tls,
        compaction=CompactionPolicy(max_entries=args.compact_entries, keep=args.compact_keep),
    )
    placement: Placement | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    try:
        if args.memory:
            tmp = tempfile.TemporaryDirectory(prefix=f"raftkv-meta-{args.id}-")
        placement = Placement(
            kv, None if args.memory else args.data_dir,
            tmp.name if tmp is not None else args.data_dir, args.http_addr,
            None if args.join else sorted(peers), durable=not args.no_fsync,
            http_ssl=proxy_ssl,
        )
        placement.start()
        group = kv.node.groups[kv.group]
        log.info("%s", group.recovery.describe())
        log.info("serving %s on %s, raft on %s%s", "HTTPS" if http_ssl else "HTTP",
                 args.http_addr, args.raft_addr, " (TLS)" if peer_tls else "")
        api = Api(kv, registry, faults=args.enable_test_faults, placement=placement)
        web.run_app(api.app(), host=host, port=port, print=None, ssl_context=http_ssl,
                    access_log=None, handle_signals=True)
    finally:
        if placement is not None:
            placement.stop()
        kv.close()
        if tmp is not None:
            tmp.cleanup()
        log.info("stopped")
    return 0
