"""Peer connections on PySyncObj's poller: dial, authenticate, batch, back off.

Why not PySyncObj's ``TcpConnection``/``TcpServer``: the connection unpickles every frame
it receives (arbitrary code execution for anyone who can reach the port) and the server
hard-wires that connection class. We keep what is sound in them: the poller
(``pysyncobj.poller``), the wake-up pipe and the monotonic clock, the non-blocking
socket options (TCP_NODELAY, buffer sizes, keepalive), and the shape of a connection
state machine driven by poll events.

Theory of operation
-------------------
- **One connection per pair.** Either side may dial when it has something to send and
  no connection. Should both dial at once, both keep the connection dialed by the
  smaller node id and retire the other, so they converge without talking about it.
  Retiring is a drain, not a close (``Connection.retire``): what was already queued or
  sent on the other connection is delivered, then each side half-closes it and closes
  it at the other's end of stream. Closing it at once lost what was in flight on it,
  and a vote request or answer lost so cost a full election timeout at a restart.
- **Handshake first** (``handshake``): until both MACs check out, the only parsing is
  of fixed-size fields; msgpack never sees an unauthenticated byte. A failure is logged
  and closes that connection; the node goes on.
- **Every frame authenticated.** Without TLS each frame carries a tag under a key of
  this connection and direction, with an implicit sequence number (``frames``): a
  forged, altered, replayed or reordered frame fails its check before it is decoded,
  and closes the connection like any bad input.
- **TLS** (optional, ``tls``): an ``ssl.SSLObject`` over memory BIOs (``tls_bio``) sits
  between the socket and everything above, so the poller design is unchanged: the TLS
  handshake comes first (the dialer verifies the acceptor's certificate against the
  trusted CA and the address it dialed; with ``client_cert_auth`` the acceptor verifies
  the dialer's), then the cluster-secret handshake inside it, then untagged frames (TLS
  records are authenticated already).
- **Batching.** ``send`` only queues; ``flush`` (once per loop turn) turns each peer's
  queue into a single message, so the heartbeats of every group bound for a peer travel
  together. A message is one frame, or, when larger than ``max_frame`` (a snapshot image
  of a large state), parts that the receiver reassembles up to ``max_message``
  (``frames``, "Split messages").
- **Incremental output.** A connection keeps the messages it has not framed yet
  (``Connection.outbox``) apart from the bytes ready for the socket (``outbuf``), and
  frames (tags, encrypts) only enough to keep ``SEND_AHEAD`` bytes ready as the socket
  drains. A message of hundreds of MB therefore costs its encoding once, never a second
  copy in ``outbuf``, and the loop frames 1 MiB parts between its other work rather than
  stopping for seconds to tag, encrypt and copy the whole. Messages stay in order: those
  queued behind a split message wait for its last part.
- **Bounded memory.** With no live connection the turn's messages are dropped (Raft
  retransmits; nothing durable depends on delivery) and a dial is scheduled with
  exponential back-off. A connection whose unsent bytes (``outbuf`` and ``outbox``
  together) exceed ``max_send_buffer`` gets nothing more until it drains: backpressure
  for a slow peer. A message larger than ``max_message`` is dropped and logged: the
  peer would refuse it.
- **Liveness.** ``ping`` asks ``flush`` for a frame to a peer even with nothing queued
  (an empty item list), and every authenticated frame received, a part of a split
  message included, stamps the peer's ``last_heard`` (so a peer busy receiving a large
  image still hears from its sender). ``is_live`` is then "connected, and heard from
  within the timeout": a dropped connection shows at once, a silent one (a partition, a
  hung process, the fault switch) within the timeout. The driver reports it to the core, whose quiesced
  groups rely on it instead of heartbeats (see ``raftkv.core.raft``, "Quiescence").
- **Admin tools** (``raftkv.admin``) dial the same port and pass the same handshake,
  announcing an empty node id and no address: no node can have that id, so such a
  connection is a tool's, never a peer's. It is not entered in the peer table (no
  address is learned, nothing is dialed back, liveness ignores it); its frames go to
  ``on_admin`` and the answers go back on it (``Connection.send_items``). Everything
  else is a peer connection's: the TLS handshake first when the port runs TLS, the frame
  keys derived from the handshake's nonces, every frame tagged both ways. At most
  ``MAX_ADMIN`` are open at once, and one idle for ``ADMIN_IDLE`` seconds is closed.
  A node without ``on_admin`` refuses them at the handshake.
- **Test fault switch.** When built with ``faults=True``, ``block`` silently drops
  traffic to and from chosen peers, which is how real-process tests cut the network.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import ssl
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pysyncobj.monotonic import monotonic
from pysyncobj.poller import POLL_EVENT_TYPE, Poller
from pysyncobj.tcp_connection import set_keepalive

from raftkv.log_limits import RateLimitedLog
from raftkv.tls import TlsConfig
from raftkv.transport import handshake as hs
from raftkv.transport.frames import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_MESSAGE,
    MIN_FRAME,
    FrameDecoder,
    FrameError,
    FrameMac,
    Outgoing,
    pack,
)
from raftkv.transport.tls_bio import TlsSession

log = logging.getLogger(__name__)

READ, WRITE, ERROR = POLL_EVENT_TYPE.READ, POLL_EVENT_TYPE.WRITE, POLL_EVENT_TYPE.ERROR
SOCK_BUFFER = 1 << 20
HANDSHAKE_TIMEOUT = 5.0
DRAIN_TIMEOUT = 5.0  # seconds a retired duplicate connection may take to drain
MAX_HANDSHAKE_BYTES = 1024
MAX_UNAUTHENTICATED = 128
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0
RECV_CHUNK = 1 << 18
# Bytes read from one connection per poll event, so one busy peer cannot starve the loop.
RECV_PER_EVENT = 8 << 20
# Bytes framed ahead of the socket: enough for a send to fill the kernel's buffer (about
# twice SOCK_BUFFER), little enough that a split message is never copied whole.
SEND_AHEAD = 4 << 20
MAX_ADMIN = 8  # admin tools' connections open at once
ADMIN_IDLE = 300.0  # seconds an admin connection may stay silent

ItemsHandler = Callable[[str, list[Any]], None]
AdminHandler = Callable[["Connection", list[Any]], None]


# A host name or an IPv4 address (dot-separated labels of letters, digits, "_" and inner
# "-"), or a bare IPv6 address with an optional zone. Anything else (a space, a slash,
# brackets, a control character) can never be dialled: such an address was accepted by
# add-node, and every node then logged "cannot dial" until the node was declared dead
# (found outside-in).
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*(?:%[A-Za-z0-9._-]+)?")


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if (not sep or not host or not port.isascii() or not port.isdigit()
            or not 0 < int(port) < 65536 or not _HOST.fullmatch(host)):
        raise ValueError(f"bad address {addr!r}: expected host:port")
    return host, int(port)


def check_peer_addresses(peers: dict[str, str]) -> None:
    """ValueError unless every address in ``peers`` parses and no two ids share one:
    whichever process binds a shared address answers for both ids, each counted as a
    voter, a quorum one node can fake (and otherwise a node that never elects, its
    dials answered by the wrong id)."""
    for addr in peers.values():
        parse_addr(addr)
    shared = [a for a, n in Counter(peers.values()).items() if n > 1]
    if shared:
        names = " and ".join(n for n, a in peers.items() if a == shared[0])
        raise ValueError(f"the peers map gives the address {shared[0]} to {names}: "
                         "every node needs its own")


def listen_on(addr: str) -> socket.socket:
    """A non-blocking socket listening on the raft address ``addr``; OSError, naming the
    address, if it cannot be had."""
    host, port = parse_addr(addr)
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setblocking(False)
        s.bind((host, port))
        s.listen(64)
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot listen on the raft address {addr}: "
                               f"{e.strerror or e}") from None
    return s


class _State:
    CONNECTING = "connecting"
    TLS_HANDSHAKE = "tls-handshake"
    AWAIT_CHALLENGE = "await-challenge"  # dialer
    AWAIT_HELLO = "await-hello"  # acceptor
    AWAIT_WELCOME = "await-welcome"  # dialer
    READY = "ready"
    DRAINING = "draining"  # a retired duplicate: no new messages, frames still read
    CLOSED = "closed"


class Connection:
    def __init__(self, transport: Transport, sock: socket.socket, dialed_to: str | None) -> None:
        self.t = transport
        self.sock = sock
        self.fd = sock.fileno()
        self.dialed_to = dialed_to  # the peer we dialed, or None for an accepted connection
        try:
            host, port = sock.getpeername()[:2]
            self.remote = f"{host}:{port}"
        except OSError:  # not connected yet (a dial), or already reset
            self.remote = "?"
        self.peer: str | None = None
        self.dialer_id = transport.node_id if dialed_to else ""
        self.inbuf = bytearray()
        self.outbuf = bytearray()  # bytes ready for the socket (framed, tagged, encrypted)
        self.outbox: deque[Outgoing] = deque()  # messages behind them, not yet framed
        self.unframed = 0  # the outbox's bytes
        self.decoder = FrameDecoder(transport.max_frame, max_message=transport.max_message)
        self.deadline = monotonic() + HANDSHAKE_TIMEOUT
        self.nonce_a = b""
        self.nonce_d = b""
        self.admin = False  # an admin tool's connection (module docstring)
        self.send_mac: FrameMac | None = None  # set once authenticated, unless under TLS
        self.tls: TlsSession | None = None
        self._mask = 0
        self._half_closed = False  # a retired duplicate that sent all it had
        if dialed_to:
            self.state = _State.CONNECTING
            self._subscribe(READ | WRITE | ERROR)  # writable: the connect completed
            return
        if transport.tls_server is not None:
            self.tls = TlsSession(transport.tls_server, server_side=True)
            self.state = _State.TLS_HANDSHAKE  # the client speaks first
            self._subscribe(READ | ERROR)
        else:
            self.state = _State.AWAIT_HELLO
            self.nonce_a = hs.new_nonce()
            self.outbuf += hs.challenge(self.nonce_a)  # sent when the poller says writable
            self._subscribe(READ | WRITE | ERROR)

    def _subscribe(self, mask: int) -> None:
        if mask != self._mask:  # re-registering is a syscall: only when interest changes
            self._mask = mask
            self.t.poller.subscribe(self.fd, self._on_event, mask)

    def describe(self) -> str:
        if self.admin:
            return "an admin tool"
        return self.peer or self.dialed_to or f"an unauthenticated peer ({self.remote})"

    # -- events ---------------------------------------------------------------------------
    def _on_event(self, fd: int, event: int) -> None:
        if self.state == _State.CLOSED:
            return
        try:
            if self.state == _State.CONNECTING:
                if event & (WRITE | ERROR):
                    err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        self.close(f"connect failed: {errno.errorcode.get(err, err)}", quiet=True)
                        return
                    self._subscribe(READ | ERROR)
                    self._connected()
                return
            if event & READ:
                self._read()
            if self.state != _State.CLOSED and event & WRITE:
                self._write()
            if self.state != _State.CLOSED and event & ERROR and not event & READ:
                self.close("socket error", quiet=True)
        except (hs.HandshakeError, FrameError) as e:
            self.t.stats["rejected"] += 1
            self.close(str(e))
        except ssl.SSLError as e:  # before OSError, its base: a refused peer is news
            self.t.stats["rejected"] += 1
            self._send_alert()
            detail = (f" ({e.verify_message})"
                      if isinstance(e, ssl.SSLCertVerificationError) else "")
            self.close(f"TLS: {e.reason or e}{detail}")
        except OSError as e:
            self.close(f"socket error: {e}", quiet=True)

    def _connected(self) -> None:
        """The dialer's TCP connection is up: start TLS, or wait for the challenge."""
        ctx = self.t.tls_client
        if ctx is None:
            self.state = _State.AWAIT_CHALLENGE
            return
        assert self.dialed_to is not None
        addr = self.t.peers[self.dialed_to].addr if self.dialed_to in self.t.peers else None
        host = parse_addr(addr)[0] if addr else None
        self.tls = TlsSession(ctx, server_side=False, server_hostname=host)
        self.state = _State.TLS_HANDSHAKE
        self._send_raw(self.tls.start())

    def _send_alert(self) -> None:
        """Best effort: let the peer read why TLS failed (the alert OpenSSL queued)."""
        if self.tls is not None:
            try:
                self.sock.send(self.outbuf + self.tls.pending())
            except OSError:
                pass

    def _read(self) -> None:
        got = 0
        while got < RECV_PER_EVENT:
            try:
                data = self.sock.recv(RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                if self.state == _State.AWAIT_WELCOME:
                    # It read our hello and hung up: it refused us, and only its log says
                    # why (found from outside: this side said nothing at all).
                    self.close("the peer closed the connection during the handshake: it "
                               "refused this node (another cluster secret, or another "
                               "cluster: its log says which)")
                    return
                self.close("peer closed the connection", quiet=True)
                return
            got += len(data)
            self.t.stats["bytes_in"] += len(data)
            if self.tls is not None:
                data, reply = self.tls.receive(data)
                if reply:
                    self._send_raw(reply)
                    if self.state == _State.CLOSED:
                        return
                if self.state == _State.TLS_HANDSHAKE and self.tls.established:
                    if self.dialed_to:
                        self.state = _State.AWAIT_CHALLENGE
                    else:
                        self.state = _State.AWAIT_HELLO
                        self.nonce_a = hs.new_nonce()
                        self._queue(hs.challenge(self.nonce_a))
                if not data:
                    continue
            if self.state == _State.READY or self.state == _State.DRAINING:
                self._frames(data)
            else:
                self.inbuf += data
                self._handshake()
                # Checked after parsing: the peer's first frames may share this read.
                if self.state != _State.READY and len(self.inbuf) > MAX_HANDSHAKE_BYTES:
                    raise hs.HandshakeError("oversized handshake")
            if self.state == _State.CLOSED:
                return

    def _frames(self, data: bytes) -> None:
        frames = self.decoder.frames
        payloads = self.decoder.feed(data)
        if (not payloads and self.decoder.frames != frames and not self.admin
                and self.peer is not None and self.peer not in self.t.blocked):
            self.t.heard(self.peer)  # parts of a split message: the peer is alive
        for payload in payloads:
            if type(payload) is not list:
                raise FrameError("a frame must hold a list of items")
            if self.admin:
                assert self.t.on_admin is not None
                self.deadline = monotonic() + ADMIN_IDLE
                self.t.on_admin(self, payload)
                if self.state == _State.CLOSED:
                    return
                continue
            assert self.peer is not None
            if self.peer in self.t.blocked:
                continue
            self.t.heard(self.peer)
            self.t.stats["frames_in"] += 1
            self.t.on_items(self.peer, payload)

    def _handshake(self) -> None:
        t = self.t
        buf = self.inbuf
        if self.state == _State.AWAIT_CHALLENGE:
            got = hs.parse_challenge(buf)
            if got is None:
                return
            self.nonce_a, used = got
            del buf[:used]
            self.nonce_d = hs.new_nonce()
            self._queue(hs.hello(t.secret, self.nonce_a, self.nonce_d, t.node_id,
                                 t.listen_addr, t.cluster_id))
            self.state = _State.AWAIT_WELCOME
        if self.state == _State.AWAIT_WELCOME:
            welcome = hs.parse_welcome(buf, t.secret, self.nonce_a, self.nonce_d)
            if welcome is None:
                return
            peer, cluster, used = welcome
            del buf[:used]
            if peer != self.dialed_to:
                raise hs.HandshakeError(f"dialed {self.dialed_to} but {peer} answered")
            t.admit_cluster(peer, cluster)
            self._ready(peer)
        elif self.state == _State.AWAIT_HELLO:
            got_hello = hs.parse_hello(buf, t.secret, self.nonce_a)
            if got_hello is None:
                return
            peer, addr, cluster, self.nonce_d, used = got_hello
            del buf[:used]
            if not peer:
                self._admin_ready()
                return
            if peer == t.node_id:
                raise hs.HandshakeError("a peer claims this node's own id")
            t.admit_cluster(peer, cluster)
            self.dialer_id = peer
            self._queue(hs.welcome(t.secret, self.nonce_a, self.nonce_d, t.node_id,
                                   t.cluster_id))
            t.learn_address(peer, addr)
            self._ready(peer)

    def _admin_ready(self) -> None:
        """The dialer proved the secret and announced no node id: an admin tool."""
        t = self.t
        if t.on_admin is None:
            raise hs.HandshakeError("an admin tool connected, but this node serves none")
        if len(t.admins) >= MAX_ADMIN:
            raise hs.HandshakeError(f"more than {MAX_ADMIN} admin connections at once")
        self._queue(hs.welcome(t.secret, self.nonce_a, self.nonce_d, t.node_id,
                               t.cluster_id))
        self.admin = True
        self.state = _State.READY
        self._key_frames()  # a tool's frames are tagged as a peer's are (or go under TLS)
        self.deadline = monotonic() + ADMIN_IDLE
        t.pending.discard(self)
        t.admins.add(self)
        rest, self.inbuf = bytes(self.inbuf), bytearray()
        if rest:
            self._frames(rest)

    def _key_frames(self) -> None:
        """Authenticated: key this connection's frames, one key per direction (none under
        TLS, whose records are authenticated already)."""
        if self.tls is None:
            to_acceptor, to_dialer = hs.frame_keys(self.t.secret, self.nonce_a, self.nonce_d)
            dialer = bool(self.dialed_to)
            self.send_mac = FrameMac(to_acceptor if dialer else to_dialer)
            self.decoder.mac = FrameMac(to_dialer if dialer else to_acceptor)

    def _ready(self, peer: str) -> None:
        self.peer = peer
        self.state = _State.READY
        self._key_frames()
        rest = bytes(self.inbuf)
        self.inbuf = bytearray()
        self.t.connected(self)
        if rest and self.state in (_State.READY, _State.DRAINING):
            self._frames(rest)

    # -- output ---------------------------------------------------------------------------
    def _queue(self, data: bytes) -> None:
        """Send plaintext (through TLS if on)."""
        self._send_raw(data if self.tls is None else self.tls.send(data))

    def _send_raw(self, data: bytes) -> None:
        self.outbuf += data
        self._write()

    @property
    def unsent(self) -> int:
        """Bytes queued on this connection and not yet sent."""
        return len(self.outbuf) + self.unframed

    def send_items(self, items: list[Any]) -> None:
        """One message of ``items`` (a peer's batch, or the answers to an admin tool; loop
        thread), framed as the socket drains; nothing once closed."""
        if self.state != _State.READY:
            return
        body = pack(items)
        if len(body) > self.t.max_message:
            log.error("a %d-byte message exceeds the %d-byte message limit; not sent to %s",
                      len(body), self.t.max_message, self.describe())
            self.t.stats["dropped"] += len(items)
            return
        self.t.stats["frames_out"] += 1
        self.outbox.append(Outgoing(body, self.t.max_frame))
        self.unframed += len(body)
        self._write()

    def _fill(self) -> None:
        """Frame queued messages into ``outbuf`` until ``SEND_AHEAD`` bytes are ready,
        in order (each frame takes the next tag sequence number)."""
        outbox = self.outbox
        while outbox and len(self.outbuf) < SEND_AHEAD:
            out = outbox[0]
            before = out.left
            frame = out.next_frame(self.send_mac)
            self.unframed -= before - out.left
            if not out.left:
                outbox.popleft()
            self.outbuf += frame if self.tls is None else self.tls.send(frame)

    def _write(self) -> None:
        if self.state in (_State.CLOSED, _State.CONNECTING):
            return
        self._fill()
        if not self.outbuf:
            if self.state == _State.DRAINING:
                self._half_close()
            return
        try:
            n = self.sock.send(self.outbuf)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:  # the peer reset or vanished since the last poll
            self.close(f"send failed: {e}", quiet=True)
            return
        if n:
            self.t.stats["bytes_out"] += n
            del self.outbuf[:n]
            self._fill()  # so the next writable event finds the next part ready
        if self.state == _State.DRAINING and not self.outbuf:
            self._half_close()
        self._subscribe(READ | ERROR | (WRITE if self.outbuf else 0))

    def retire(self) -> None:
        """Retire this connection, a duplicate (module docstring, "One connection per
        pair"): it takes no new messages, sends what it holds, then half-closes; the
        peer's frames are read until its end of stream, which closes it (or until
        ``DRAIN_TIMEOUT``). Both sides retire the same connection, so each sees the
        other's half-close once the other has sent all it had."""
        self.state = _State.DRAINING
        self.deadline = monotonic() + DRAIN_TIMEOUT
        self.t.draining.add(self)
        self._write()  # half-closes once nothing is left to send

    def _half_close(self) -> None:
        if self._half_closed:
            return
        self._half_closed = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:  # reset meanwhile: nothing more will come either
            self.close(f"socket error: {e}", quiet=True)

    def close(self, why: str, quiet: bool = False) -> None:
        if self.state == _State.CLOSED:
            return
        authenticated = self.state == _State.READY
        self.state = _State.CLOSED
        self.outbox.clear()  # a split message's encoding: free it now, not when collected
        self.unframed = 0
        if quiet:
            log.debug("connection with %s closed: %s", self.describe(), why)
        else:
            source = self.peer or self.dialed_to or self.remote.rpartition(":")[0]
            self.t.closed_warnings.log(source, why, "connection with %s closed: %s",
                                       self.describe(), why)
        try:
            self.t.poller.unsubscribe(self.fd)
        except (KeyError, OSError, ValueError):
            pass
        self.sock.close()
        self.t.disconnected(self, authenticated)


@dataclass
class _Peer:
    addr: str | None = None
    conn: Connection | None = None
    dialing: Connection | None = None
    next_dial: float = 0.0
    backoff: float = BACKOFF_MIN
    outbox: list[Any] = field(default_factory=list)
    ping: bool = False  # send a frame at the next flush even if the outbox is empty
    last_heard: float = 0.0  # monotonic time of the last frame received (liveness)


def _cluster_name(cluster: bytes) -> str:
    return f"id {cluster.hex()}" if cluster else "no id"


class Transport:
    def __init__(
        self,
        node_id: str,
        listen_addr: str,
        secret: bytes,
        poller: Poller,
        on_items: ItemsHandler,
        *,
        addresses: dict[str, str] | None = None,
        on_address: Callable[[str, str], None] | None = None,
        on_undelivered: ItemsHandler | None = None,
        on_connected: Callable[[str], None] | None = None,
        on_admin: AdminHandler | None = None,
        max_send_buffer: int = 64 << 20,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_message: int = DEFAULT_MAX_MESSAGE,
        faults: bool = False,
        tls: TlsConfig | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        if max_frame < MIN_FRAME:
            raise ValueError(f"max_frame must be at least {MIN_FRAME} bytes")
        # Built once (they load the files): a bad path fails here, at start, not per dial.
        self.tls_server = tls.server_context() if tls is not None else None
        self.tls_client = tls.client_context() if tls is not None else None
        self.node_id = node_id
        self.listen_addr = listen_addr
        self.secret = secret
        self.poller = poller
        self.on_items = on_items
        self.on_address = on_address
        self.on_undelivered = on_undelivered
        self.on_connected = on_connected  # a peer's connection came up (its handshake)
        self.on_admin = on_admin
        self.admins: set[Connection] = set()  # admin tools' connections
        self.max_send_buffer = max_send_buffer
        self.max_frame = max_frame
        self.max_message = max_message
        self.faults = faults
        # The cluster this node belongs to (b"": a cluster without an id; JOINING: adopt
        # the first peer's), and who keeps it when it is adopted (``admit_cluster``).
        self.cluster_id = b""
        self.on_cluster_id: Callable[[bytes], None] | None = None
        # Peers refused as another cluster's, by id, with the cluster they named, until
        # one passes: what /ready says when no leader is known.
        self.cluster_refusals: dict[str, str] = {}
        # A connection closed for a fault (a failed handshake, a bad frame) is a WARNING,
        # within raftkv.log_limits' bounds for each source (the peer's id, or its host
        # before it has one) and reason.
        self.closed_warnings = RateLimitedLog(log)
        self.blocked: frozenset[str] = frozenset()
        self.peers: dict[str, _Peer] = {}
        self.pending: set[Connection] = set()  # accepted, not yet authenticated
        self.draining: set[Connection] = set()  # retired duplicates (Connection.retire)
        self.stats: dict[str, int] = dict.fromkeys(
            ("bytes_in", "bytes_out", "frames_in", "frames_out", "dropped", "rejected",
             "connects"), 0,
        )
        for peer, addr in (addresses or {}).items():
            if peer != node_id:
                self.peer(peer).addr = addr
        self._server: socket.socket | None = None

    def admit_cluster(self, peer: str, theirs: bytes) -> None:
        """Check the cluster a peer named in its handshake (``handshake``'s docstring).
        A node that joins (``JOINING``) is taken by anyone, and adopts the first id it
        meets; otherwise both must name the same cluster, or both none (clusters founded
        without an id, or from before ids). Anything else is refused
        (``HandshakeError``, logged by name on both sides): a named cluster refuses a
        node that names none too, for the files of an old one (from before a restore, or
        from before ids) name none."""
        mine = self.cluster_id
        if theirs == mine or theirs == hs.JOINING:
            self.cluster_refusals.pop(peer, None)
            return
        if mine == hs.JOINING:
            self.cluster_refusals.pop(peer, None)
            if theirs:
                self.cluster_id = theirs
                if self.on_cluster_id is not None:
                    self.on_cluster_id(theirs)
            return
        self.cluster_refusals[peer] = _cluster_name(theirs)
        raise hs.HandshakeError(
            f"{peer} belongs to another cluster ({_cluster_name(theirs)}) than this node "
            f"({_cluster_name(mine)}): a data directory from before a snapshot restore, or "
            "another cluster's? It is refused; a node that joins starts on an empty data "
            "directory with --join")

    def peer(self, peer_id: str) -> _Peer:
        p = self.peers.get(peer_id)
        if p is None:
            p = self.peers[peer_id] = _Peer()
        return p

    # -- lifecycle ------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind and listen on the raft address (``start`` accepts on it). Done when the
        node is built, so that an address in use fails it before anything else does:
        before a data directory is claimed, a file written or a vote cast. The error is
        an OSError naming the address (the PySyncObj layer turns it into BindError)."""
        if self._server is None:
            self._server = listen_on(self.listen_addr)

    def start(self) -> None:
        self.bind()
        assert self._server is not None
        self.poller.subscribe(self._server.fileno(), self._on_accept, READ | ERROR)

    def close(self) -> None:
        if self._server is not None:
            self.poller.unsubscribe(self._server.fileno())
            self._server.close()
            self._server = None
        for p in list(self.peers.values()):
            for c in (p.conn, p.dialing):
                if c is not None:
                    c.close("transport closed", quiet=True)
        for c in list(self.pending) + list(self.admins) + list(self.draining):
            c.close("transport closed", quiet=True)

    @staticmethod
    def _tune(sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUFFER)
        set_keepalive(sock)

    def _on_accept(self, fd: int, event: int) -> None:
        assert self._server is not None
        while True:
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            if len(self.pending) >= MAX_UNAUTHENTICATED:
                # Unauthenticated connections cost a descriptor each: cap them, so a flood
                # cannot starve the node of sockets for its real peers.
                sock.close()
                self.stats["rejected"] += 1
                continue
            self._tune(sock)
            self.pending.add(Connection(self, sock, None))

    # -- connection bookkeeping -----------------------------------------------------------
    def learn_address(self, peer: str, addr: str) -> None:
        p = self.peer(peer)
        if p.addr != addr:
            p.addr = addr
            if self.on_address is not None:
                self.on_address(peer, addr)

    def forget(self, peer_id: str) -> None:
        """Drop a peer for good: its connections, queue and address. It is known again
        only if it dials in (it must still pass the handshake) or is given an address."""
        p = self.peers.pop(peer_id, None)
        if p is not None:
            for c in (p.conn, p.dialing):
                if c is not None:
                    c.close("no longer a member", quiet=True)

    def connected(self, conn: Connection) -> None:
        self.pending.discard(conn)
        assert conn.peer is not None
        p = self.peer(conn.peer)
        if p.dialing is conn:
            p.dialing = None
        old = p.conn
        if old is not None and old is not conn:
            # Both dialed: keep the connection the smaller id dialed (both sides agree).
            keep_old = old.dialer_id == min(self.node_id, conn.peer)
            (conn if keep_old else old).retire()
            if keep_old:
                return
        p.conn = conn
        p.backoff = BACKOFF_MIN
        p.last_heard = monotonic()  # the handshake just proved it alive
        self.stats["connects"] += 1
        log.info("connected to %s", conn.peer)
        if self.on_connected is not None:
            self.on_connected(conn.peer)

    def disconnected(self, conn: Connection, authenticated: bool) -> None:
        self.pending.discard(conn)
        self.draining.discard(conn)
        if conn.admin:
            self.admins.discard(conn)
            return
        for pid, p in self.peers.items():
            if p.conn is conn:
                p.conn = None
                log.info("lost connection to %s", pid)
            if p.dialing is conn:
                p.dialing = None

    def _dial(self, peer_id: str, p: _Peer, now: float) -> None:
        if p.addr is None or p.dialing is not None or now < p.next_dial:
            return
        p.next_dial = now + p.backoff
        p.backoff = min(p.backoff * 2, BACKOFF_MAX)
        try:
            host, port = parse_addr(p.addr)
            sock = socket.socket(
                socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
            )
            self._tune(sock)
            err = sock.connect_ex((host, port))
        except (OSError, ValueError) as e:
            log.warning("cannot dial %s at %s: %s", peer_id, p.addr, e)
            return
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            return
        p.dialing = Connection(self, sock, peer_id)

    # -- sending --------------------------------------------------------------------------
    def send(self, peer_id: str, item: list[Any]) -> None:
        self.peer(peer_id).outbox.append(item)

    def ping(self, peer_id: str) -> None:
        """Make the next ``flush`` send ``peer_id`` a frame (empty if nothing else is
        queued), dialing if need be: the keepalive that ``is_live`` on the far side
        counts on when no Raft traffic flows."""
        self.peer(peer_id).ping = True

    def heard(self, peer_id: str) -> None:
        p = self.peers.get(peer_id)
        if p is not None:
            p.last_heard = monotonic()

    def is_live(self, peer_id: str, now: float, timeout: float) -> bool:
        """Connected, not cut off by the fault switch, and heard from within ``timeout``."""
        p = self.peers.get(peer_id)
        return (p is not None and p.conn is not None and peer_id not in self.blocked
                and now - p.last_heard <= timeout)

    def flush(self) -> None:
        """Send each peer's queued items as one message (called once per loop turn)."""
        now = monotonic()
        for pid, p in self.peers.items():
            if not p.outbox and not p.ping:
                continue
            items, p.outbox = p.outbox, []
            p.ping = False
            conn = p.conn
            if pid in self.blocked:
                continue
            if conn is None:
                self.stats["dropped"] += len(items)
                self._dial(pid, p, now)
                if self.on_undelivered is not None and items:
                    self.on_undelivered(pid, items)  # known never sent: safe to retry
                continue
            if conn.unsent > self.max_send_buffer:
                self.stats["dropped"] += len(items)  # backpressure: the peer is not reading
                continue
            conn.send_items(items)

    def maintain(self) -> None:
        """Expire stalled handshakes and keep dialing peers that have work queued."""
        now = monotonic()
        for c in list(self.pending):
            if now > c.deadline:
                c.close("handshake timed out")
        for c in list(self.admins):
            if now > c.deadline:
                c.close(f"admin connection idle for {ADMIN_IDLE:.0f} s", quiet=True)
        for c in list(self.draining):
            if now > c.deadline:
                c.close("duplicate connection not drained in time", quiet=True)
        for p in self.peers.values():
            d = p.dialing
            if d is not None and now > d.deadline:
                d.close("handshake timed out", quiet=True)

    def connected_peers(self) -> list[str]:
        return sorted(pid for pid, p in self.peers.items() if p.conn is not None)

    # -- test fault switch ----------------------------------------------------------------
    def block(self, peers: set[str] | frozenset[str]) -> None:
        if not self.faults:
            raise PermissionError("the transport fault switch is disabled (start with faults on)")
        self.blocked = frozenset(peers)
        log.warning("fault switch: blocking traffic with %s", sorted(peers) or "nobody")
