"""A hand-driven peer connection to a real node's raft port, for tests that play a
misbehaving peer or an attacker on the network.

``RawPeer`` dials, passes the cluster-secret handshake (``raftkv.transport.handshake``)
with whatever secret and id it is given, derives the connection's frame keys as a node
does, and then sends frames the test builds: well tagged (``frame``), or bytes of its own
making (``send``). ``recv_frames`` decodes what the node sends back, checking its tags.
Blocking sockets, no poller: the test is the peer.
"""

from __future__ import annotations

import socket

from raftkv.transport import handshake as hs
from raftkv.transport.frames import FrameDecoder, FrameMac, encode_frame


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_challenge(s: socket.socket) -> bytes:
    """The acceptor's nonce, from the challenge it sends first."""
    got = hs.parse_challenge(recv_exact(s, len(hs.MAGIC) + hs.NONCE))
    assert got is not None
    return got[0]


class RawPeer:
    def __init__(self, port: int, secret: bytes, peer_id: str, addr: str = "127.0.0.1:1",
                 timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        nonce_a = read_challenge(self.sock)
        nonce_d = hs.new_nonce()
        self.sock.sendall(hs.hello(secret, nonce_a, nonce_d, peer_id, addr))
        buf = b""
        while True:
            chunk = self.sock.recv(1024)
            if not chunk:
                raise EOFError("the node closed the handshake")
            buf += chunk
            got = hs.parse_welcome(buf, secret, nonce_a, nonce_d)
            if got is not None:
                break
        self.node_id = got[0]
        to_acceptor, to_dialer = hs.frame_keys(secret, nonce_a, nonce_d)
        self.mac = FrameMac(to_acceptor)
        self.decoder = FrameDecoder(mac=FrameMac(to_dialer))
        self.received = self.decoder.feed(buf[got[1]:])

    def frame(self, items: object) -> bytes:
        """A correctly tagged frame holding ``items`` (it takes the next sequence number)."""
        return encode_frame(items, self.mac)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_frames(self) -> list[object]:
        """Frames the node sent (blocks for at least one read; FrameError on a bad tag)."""
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError("the node closed the connection")
        self.received += self.decoder.feed(data)
        return self.received

    def closed_by_node(self, timeout: float = 10.0) -> bool:
        """Whether the node closes the connection within ``timeout`` (then close ours)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.close()
