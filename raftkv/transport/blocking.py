"""A blocking connection to a node's raft port, for a program that is not a node.

``PeerLink`` dials and does what a dialing node's connection does (``raftkv.transport.
tcp``), with the transport's own functions, on a blocking socket instead of the poller:

- **TLS first**, when given a client ``ssl.SSLContext`` (``raftkv.tls.client_context``,
  or a node's ``TlsConfig.client_context``): the node's certificate is verified against
  the context's CA and the host dialed, and the context's certificate is presented to a
  node that requires one (``--peer-client-cert-auth``).
- **The cluster-secret handshake** (``handshake``): the node's challenge, a hello under
  the secret announcing ``peer_id`` and ``addr``, the node's welcome checked.
- **Keyed frames**: without TLS, the keys of both directions come from the handshake's
  nonces (``handshake.frame_keys``); every frame sent is tagged and every frame
  received checked (``frames.FrameMac``, ``Outgoing``, ``FrameDecoder``). Under TLS
  frames go untagged, as between nodes. A message larger than ``max_frame`` goes in
  parts, and one that arrives in parts is reassembled up to ``max_message``, as between
  nodes (``frames``, "Split messages").

Users: ``raftkv.admin`` (the admin tool announces an empty id, which a node takes for a
tool, never for a peer) and ``raftkv.testing.raw_peer`` (tests that play a peer or an
attacker).

Every wait for the node is bounded by one ``deadline`` (``time.monotonic``), which the
caller may move on. Whatever goes wrong, from the connect to a frame with a bad tag,
raises ``LinkError`` saying what was awaited; ``stage`` says where it failed.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, Self, TypeVar

from raftkv.transport import handshake as hs
from raftkv.transport.frames import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_MESSAGE,
    FrameDecoder,
    FrameError,
    FrameMac,
    Outgoing,
    pack,
)
from raftkv.transport.tcp import parse_addr

__all__ = ["LinkError", "PeerLink"]

T = TypeVar("T")
RECV = 1 << 16


class LinkError(Exception):
    """The node could not be reached, refused the link, or sent something invalid.
    ``stage``: ``connect``, ``tls``, ``handshake`` or ``frames``."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class PeerLink:
    """One connection to the node at ``address`` ("host:port"), through the handshake
    (module docstring). ``node_id`` is the id the node's welcome named; ``sock`` the
    socket (an ``ssl.SSLSocket`` under TLS); ``mac`` the key and counter of the frames
    sent (None under TLS)."""

    def __init__(self, address: str, secret: bytes, peer_id: str = "", addr: str = "", *,
                 timeout: float = 5.0, tls: ssl.SSLContext | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME,
                 max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        host, port = parse_addr(address)
        self.address = address
        self.max_frame = max_frame
        self.deadline = time.monotonic() + timeout
        self._buf = bytearray()
        self._stage = "connect"
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise LinkError(f"cannot connect to {address}: {e}", "connect") from None
        self.sock: socket.socket = raw
        try:
            if tls is not None:
                self._stage = "tls"
                self._tls_handshake(tls, host)
            self._stage = "handshake"
            nonce_a, used = self._parse(
                hs.parse_challenge,
                "challenge" if tls is not None else
                "challenge (a raft port under TLS waits for a TLS client)")
            del self._buf[:used]
            nonce_d = hs.new_nonce()
            self._sendall(hs.hello(secret, nonce_a, nonce_d, peer_id, addr))
            self.node_id, _, used = self._parse(
                lambda b: hs.parse_welcome(b, secret, nonce_a, nonce_d),
                "welcome: a wrong secret (a node closes the connection on one)?")
            del self._buf[:used]
            self.mac: FrameMac | None = None
            recv_mac = None
            if tls is None:
                to_acceptor, to_dialer = hs.frame_keys(secret, nonce_a, nonce_d)
                self.mac, recv_mac = FrameMac(to_acceptor), FrameMac(to_dialer)
            self._stage = "frames"
            self.decoder = FrameDecoder(max_frame, mac=recv_mac, max_message=max_message)
            early, self._buf = bytes(self._buf), bytearray()
            self._early = self._feed(early)  # frames that came with the welcome
        except BaseException:
            self.sock.close()
            raise

    # -- sending --------------------------------------------------------------------------
    def send_items(self, items: list[Any]) -> None:
        """``items`` as one message: one frame, or parts if larger than ``max_frame``."""
        out = Outgoing(pack(items), self.max_frame)
        while out.left:
            self._sendall(out.next_frame(self.mac))

    # -- receiving ------------------------------------------------------------------------
    def read_frames(self, waiting_for: str = "frame") -> list[object]:
        """The frames the node sent since the last call, waiting (until ``deadline``)
        for at least one; ``LinkError`` on a bad tag or a bad frame."""
        out, self._early = self._early, []
        while not out:
            out = self._feed(self._recv(waiting_for))
        return out

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------
    def _fail(self, message: str) -> LinkError:
        return LinkError(f"{self.address}: {message}", self._stage)

    def _left(self, waiting_for: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise LinkError(f"{self.address} sent no {waiting_for} in time", self._stage)
        return left

    def _tls_handshake(self, ctx: ssl.SSLContext, host: str) -> None:
        """As a dialing node: verify the node's certificate against ``ctx``'s CA and the
        host dialed (``tcp.Connection._connected``)."""
        self.sock.settimeout(self._left("TLS handshake"))
        try:
            self.sock = ctx.wrap_socket(self.sock, server_hostname=host)
        except TimeoutError:
            raise LinkError(f"{self.address} sent no TLS handshake in time", "tls") from None
        except ssl.SSLCertVerificationError as e:
            raise self._fail(f"TLS: {e.verify_message}: its certificate is not signed by "
                             "the trusted CA or does not name that host") from None
        except ssl.SSLError as e:
            raise self._fail(f"TLS: {e.reason or e} (does its raft port run TLS?)") from None
        except OSError as e:
            raise self._fail(f"TLS: {e}") from None

    def _recv(self, waiting_for: str) -> bytes:
        self.sock.settimeout(self._left(waiting_for))
        try:
            data = self.sock.recv(RECV)
        except TimeoutError:
            raise LinkError(f"{self.address} sent no {waiting_for} in time",
                            self._stage) from None
        except ssl.SSLError as e:  # an alert: e.g. the node requires a client certificate
            raise self._fail(f"TLS: {e.reason or e}") from None
        except OSError as e:
            raise self._fail(str(e)) from None
        if not data:
            raise LinkError(f"{self.address} closed the connection instead of sending "
                            f"{waiting_for}", self._stage)
        return data

    def _parse(self, parser: Callable[[bytearray], T | None], waiting_for: str) -> T:
        while True:
            try:
                got = parser(self._buf)
            except hs.HandshakeError as e:
                raise self._fail(str(e)) from None
            if got is not None:
                return got
            self._buf += self._recv(waiting_for)

    def _feed(self, data: bytes) -> list[object]:
        try:
            return self.decoder.feed(data)
        except FrameError as e:
            raise self._fail(str(e)) from None

    def _sendall(self, data: bytes) -> None:
        self.sock.settimeout(self._left("room to send"))
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise self._fail(str(e)) from None
