"""``raftkv serve``: one node process (Raft on --raft-addr, HTTP on --http-addr).

Start-up order: the arguments (and the tokens file) are checked before anything is
written. Then the node opens on a thread of its own (``NodeOpening``: its stores, the
default group's replay, its Raft loop, so a restarted group elects and commits at
once), while this thread imports the HTTP stack: aiohttp and the API are a third of a
start's CPU, and a whole cluster restarted on one machine waits for the slowest. Then
the HTTP port opens, so ``/health`` answers and ``/ready`` says "starting". The open
node is attached to the API (the default group serves), then the placement manager is
built on a worker thread (the metastore's log replayed) and attached in turn: a
restarted node's first write waits for no metastore. A long replay thus never looks like a dead process
to a liveness probe. The phases (``StartupClock``: imported, opened, elected,
committed, http, in seconds since the process started) are logged in one line and
exported as ``raftkv_startup_seconds{phase}``. The node logs its
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
import resource
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from raftkv.recovery.compaction import CompactionPolicy
from raftkv.server.auth import Tokens
from raftkv.server.http_import import import_http_stack
from raftkv.server.node_metrics import PrometheusMetrics
from raftkv.tls import TlsConfig
from raftkv.transport.tcp import check_peer_addresses, parse_addr

if TYPE_CHECKING:
    from aiohttp import web

    from raftkv.kv import RaftKV

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
    check_peer_addresses(peers)
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
    if peer and ca is None:
        # Nodes verify each other: without the cluster's CA every dial fails against the
        # system store, and the cluster never elects (found from outside: it started
        # without a word).
        raise ValueError("--peer-cert-file needs --peer-trusted-ca-file: the CA that "
                         "signs the other nodes' certificates")
    if auth and ca is None:
        raise ValueError(f"{flag}client-cert-auth needs {flag}trusted-ca-file")
    return TlsConfig(cert, key, ca, auth)


def read_secret(path: str | None) -> bytes:
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"--secret-file {path}: {e.strerror or e}") from None
    else:
        secret = os.environ.get("RAFTKV_SECRET", "").encode()
    if not secret:
        raise ValueError("a cluster secret is required: --secret-file F or RAFTKV_SECRET")
    return secret


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return v


def _tick_seconds(text: str) -> float:
    """A tick of at least a millisecond: shorter ones spin the loop (found from outside:
    --tick 0 kept a core at 99%)."""
    v = _positive_seconds(text)
    if v < 0.001:
        raise argparse.ArgumentTypeError(f"must be at least 0.001 seconds, not {text}")
    return v


def _whole_number(least: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``least`` (``why`` says why)."""
    def check(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or int(text) < least:
            raise argparse.ArgumentTypeError(
                f"must be a whole number of at least {least}{why}, not {text!r}")
        return int(text)
    return check


_positive_int = _whole_number(1)
# NodeConfig.heartbeat_tick, which raftkv serve leaves at its default (not imported here:
# the driver loads on the node's thread, while this one imports the HTTP stack). An
# election timeout must be longer than the heartbeat interval.
HEARTBEAT_TICKS = 2


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
    p.add_argument("--tick", type=_tick_seconds, default=0.05,
                   help="seconds per Raft tick (at least 0.001)")
    p.add_argument("--election-ticks", default=10,
                   type=_whole_number(HEARTBEAT_TICKS + 1,
                                      f" (more than the {HEARTBEAT_TICKS} between heartbeats)"),
                   help="election timeout in ticks (randomized up to twice this)")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the HTTP server's event loop: uvloop (a libuv loop, less CPU per "
                        "request) or Python's own; auto: uvloop when installed")
    p.add_argument("--http-idle-timeout", type=_positive_seconds, default=None,
                   metavar="SECONDS",
                   help="close an HTTP connection that takes longer than this to send a "
                        "request head, or stays idle this long between requests "
                        "(default: 30; raftkv's client replaces a connection idle 10 s, so "
                        "keep it above that)")
    p.add_argument("--http-max-connections", type=_positive_int, default=None, metavar="N",
                   help="close HTTP connections beyond this many at once (default: 4096)")
    p.add_argument("--compact-entries", type=_positive_int,
                   default=CompactionPolicy.max_entries,
                   help="compact the Raft log once it holds this many entries")
    p.add_argument("--compact-keep", type=_whole_number(0), default=CompactionPolicy.keep,
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
    p.add_argument("--cluster-token", default="",
                   help="founding only: the founders derive the cluster's id from it "
                        "(as etcd's --initial-cluster-token), and refuse nodes of other "
                        "clusters; without one the cluster has no id (docs/operations.md)")
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
    if args.memory and args.data_dir:  # the directory was ignored (found from outside)
        raise ValueError("--memory keeps nothing on disk: give --data-dir or --memory, "
                         "not both")
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
    raise_descriptor_limit()
    http_socks = bind_http(host, port)  # before the node opens: see bind_http
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    clock = StartupClock(metrics)
    clock.mark("imported")
    opening = NodeOpening(args, peers, secret, metrics, peer_tls, clock)
    opening.start()  # the node opens and elects while the HTTP stack is imported
    closers: list[Callable[[], None]] = []  # what build made, to undo in reverse
    try:
        import_http_stack()
        from raftkv.server.app import Api
        from raftkv.server.tables import Placement

        api = Api(args.id, registry, faults=args.enable_test_faults, tokens=tokens)

        def build() -> None:
            """The placement manager, once the node is open; on a worker thread while
            HTTP serves."""
            kv = opening.result()
            closers.append(kv.close)
            api.attach(kv)  # the default group serves while the placement is built
            meta_dir = args.data_dir
            if args.memory:
                tmp = tempfile.TemporaryDirectory(prefix=f"raftkv-meta-{args.id}-")
                closers.append(tmp.cleanup)
                meta_dir = tmp.name
            placement = Placement(
                kv, None if args.memory else args.data_dir, meta_dir, args.http_addr,
                None if args.join else sorted(peers), durable=not args.no_fsync,
                http_ssl=proxy_ssl,
            )
            closers.append(placement.stop)
            placement.start()
            api.attach_placement(placement)
            log.info("serving: raft on %s%s", args.raft_addr, " (TLS)" if peer_tls else "")

        log.info("%s on %s; starting the node", "HTTPS" if http_ssl else "HTTP",
                 args.http_addr)
        with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
            runner.run(serve_http(api.app(), http_socks, build, ssl_context=http_ssl,
                                  on_hangup=tokens.reload if tokens is not None else None,
                                  on_listening=lambda: clock.mark("http"),
                                  idle_seconds=args.http_idle_timeout,
                                  max_connections=args.http_max_connections))
    finally:
        kv = opening.abandon()  # still opening when HTTP failed to start: close it too
        if kv is not None and kv.close not in closers:
            closers.insert(0, kv.close)
        # Last built, first stopped: the placement manager uses the node.
        for close in reversed(closers):
            close()
        log.info("stopped")
    return 0


def raise_descriptor_limit() -> None:
    """Raise the soft limit on open files to the hard one, as Go's runtime does for etcd:
    every partition holds a few files open, and a soft limit of 1,024 is soon reached."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # not allowed here: the soft limit stands
        pass


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc, to a clock tick), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """The start-up phases, as seconds since the process started: ``imported`` (the
    code loaded: run() began), ``opened`` (the default group's stores open and
    replayed), ``elected`` (a leader of it known), ``committed`` (the commit index it
    knows holds an entry of the leader's term: writes are served)
    and ``http`` (the API listening). Each goes to ``raftkv_startup_seconds{phase}``;
    once the node has committed and HTTP listens, one log line gives them all."""

    PHASES = ("imported", "opened", "elected", "committed", "http")

    def __init__(self, metrics: PrometheusMetrics) -> None:
        age = process_age()
        self._zero = time.monotonic() - (age or 0.0)
        self._metrics = metrics
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self.detail = ""

    def mark(self, phase: str) -> None:
        at = time.monotonic() - self._zero
        with self._lock:
            if phase in self._seen:
                return
            self._seen[phase] = at
            done = all(p in self._seen for p in self.PHASES)
        self._metrics.startup(phase, at)
        if done:
            log.info("startup: %s seconds after the process started%s", ", ".join(
                f"{p} {self._seen[p]:.3f}" for p in self.PHASES), self.detail)


class NodeOpening:
    """Opens the node (``RaftKV``: its stores, the replay, its Raft loop) on a thread of
    its own, started before the HTTP stack is imported, then watches its default group
    until a leader has committed (``StartupClock``). A restarted cluster elects and
    commits while aiohttp and the API load, instead of after."""

    def __init__(self, args: argparse.Namespace, peers: dict[str, str], secret: bytes,
                 metrics: PrometheusMetrics, peer_tls: TlsConfig | None,
                 clock: StartupClock) -> None:
        self._args, self._peers, self._secret = args, peers, secret
        self._metrics, self._peer_tls, self._clock = metrics, peer_tls, clock
        self._kv: RaftKV | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._opened = threading.Event()  # set when the node is open, or failed to
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._open, name="open-node", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _open(self) -> None:
        args = self._args
        try:
            from raftkv.kv import RaftKV

            kv = RaftKV(
                args.id, args.raft_addr, self._peers, self._secret,
                data_dir=None if args.memory else args.data_dir,
                durable=not args.no_fsync, join=args.join, tick_seconds=args.tick,
                election_tick=args.election_ticks, metrics=self._metrics,
                faults=args.enable_test_faults, peer_tls=self._peer_tls,
                compaction=CompactionPolicy(max_entries=args.compact_entries,
                                            keep=args.compact_keep),
                cluster_token=args.cluster_token,
            )
        except Exception as e:  # noqa: BLE001 - handed to result(), raised in serve's build
            self._error = e
            self._opened.set()
            return
        with self._lock:
            self._kv = kv
            abandoned = self._abandoned
        self._opened.set()
        if abandoned:
            return
        self._clock.mark("opened")
        recovery = kv.node.groups[kv.group].recovery
        log.info("%s", recovery.describe())
        self._watch(kv)

    def _watch(self, kv: RaftKV, limit: float = 60.0) -> None:
        """Mark ``elected`` (a leader known) and ``committed`` (the commit index this
        node knows holds an entry of the current term: the leader can serve writes).
        Polled with a call that reads the default group alone, every 5 ms for the first
        second (a restart's phases take that long) and every 100 ms after; gives up
        after ``limit`` seconds or when the node stops."""
        g = kv.node.groups[kv.group]

        def look() -> tuple[bool, bool]:
            raft = g.raft
            return (g.leader is not None,
                    raft.log.term_or_zero(raft.log.committed) == raft.term)

        start = time.monotonic()
        while time.monotonic() - start < limit and not self._abandoned:
            try:
                elected, committed = kv.node.call(look).result(limit)
            except Exception:  # noqa: BLE001 - stopped or stopping: nothing to report
                return
            if elected:
                self._clock.mark("elected")
                if committed:
                    self._clock.mark("committed")
                    return
            time.sleep(0.005 if time.monotonic() - start < 1.0 else 0.1)

    def result(self) -> RaftKV:
        """The open node (waiting for it); raises what opening it raised."""
        self._opened.wait()
        if self._error is not None:
            raise self._error
        assert self._kv is not None
        return self._kv

    def abandon(self) -> RaftKV | None:
        """Stop watching; the node if it opened (the caller closes it), else None."""
        with self._lock:
            self._abandoned = True
            kv = self._kv
        if kv is None and self._thread.is_alive():
            self._opened.wait()  # opening: wait, so that nothing is left running
            kv = self._kv
        return kv


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


def bind_http(host: str, port: int) -> list[socket.socket]:
    """The HTTP port on every address ``host`` names (as aiohttp's own sites bind), bound
    and listening before the node opens: a port in use fails the start before anything is
    written or any vote cast (found from outside: a node whose HTTP port was taken joined
    Raft, elected, wrote its files, and only then exited), and a client that connects
    while the HTTP stack still loads waits in the backlog."""
    socks: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # Each address once, in the resolver's order (it may list one several times).
        addrs = list(dict.fromkeys((i[0], i[4]) for i in infos))
        for family, addr in addrs:
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                if len(addrs) > 1:  # a family this kernel lacks (no IPv6): the others serve
                    continue
                raise
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # each family on its own socket, as asyncio does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(1024)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise ValueError(f"--http-addr {host}:{port}: {e.strerror or e}") from None
    if not socks:
        raise ValueError(f"--http-addr {host}:{port}: no address of it can be served here")
    return socks


async def serve_http(app: web.Application, socks: list[socket.socket],
                     start: Callable[[], None],
                     ssl_context: ssl.SSLContext | None = None,
                     on_hangup: Callable[[], None] | None = None,
                     on_listening: Callable[[], None] | None = None,
                     idle_seconds: float | None = None,
                     max_connections: int | None = None) -> None:
    """Serve ``app`` on the listening ``socks`` (HTTPS with ``ssl_context``), run
    ``start`` on a worker thread meanwhile, and return on SIGTERM or SIGINT (once
    ``start`` returned: it cannot be interrupted). ``start`` raising stops the server and
    raises here. SIGHUP calls ``on_hangup``; ``on_listening`` once it serves.
    ``idle_seconds`` and ``max_connections`` (``raftkv.server.requests``' defaults when
    None) bound what idle and concurrent connections may hold."""
    from aiohttp import web

    from raftkv.server.requests import JsonErrorsRunner

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    runner = JsonErrorsRunner(app, access_log=None, handle_signals=False,
                              idle_seconds=idle_seconds, max_connections=max_connections)
    await runner.setup()
    try:
        for sock in socks:
            await web.SockSite(runner, sock, ssl_context=ssl_context).start()
        if on_listening is not None:
            on_listening()
        started = loop.run_in_executor(None, start)
        stopping = asyncio.ensure_future(stop.wait())
        either: set[asyncio.Future[Any]] = {started, stopping}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        await started  # its failure ends the server (after a stop, let it finish first)
        await stopping
    finally:
        await runner.cleanup()
