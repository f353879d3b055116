"""A hand-driven peer connection to a real node's raft port, for tests that play a
misbehaving peer or an attacker on the network.

``RawPeer`` is a ``raftkv.transport.blocking.PeerLink`` (the blocking dialer the admin
tool uses too): it dials, passes the cluster-secret handshake with whatever secret and
id it is given, and keys the connection's frames as a node does. The test then sends
messages, well tagged (``send_items``), or bytes of its own making (``send``).
``recv_frames`` decodes what the node sends back, checking its tags. Blocking sockets,
no poller: the test is the peer.
"""

from __future__ import annotations

import socket
import ssl
import time

from raftkv.transport import handshake as hs
from raftkv.transport.blocking import PeerLink


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


class RawPeer(PeerLink):
    def __init__(self, port: int, secret: bytes, peer_id: str, addr: str = "127.0.0.1:1",
                 timeout: float = 5.0, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(f"127.0.0.1:{port}", secret, peer_id, addr, timeout=timeout, tls=tls)
        self.timeout = timeout
        self.sock.settimeout(timeout)  # for the test's own reads and writes
        self.received: list[object] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_frames(self) -> list[object]:
        """Every frame the node sent so far (waits up to the timeout for one more;
        ``LinkError`` on a bad tag)."""
        self.deadline = time.monotonic() + self.timeout
        self.received += self.read_frames()
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
