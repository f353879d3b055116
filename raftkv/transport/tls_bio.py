"""TLS for one peer connection on the poller: ``ssl.SSLObject`` over two memory BIOs.

The poller owns the non-blocking socket, so TLS must not: ciphertext read from the
socket goes into ``incoming``, OpenSSL turns it into plaintext (``receive``), and
plaintext to send comes back as ciphertext from ``outgoing`` (``send``). No thread, no
blocking call: the connection's state machine in ``tcp`` stays what it was, with a TLS
handshake in front of the cluster-secret handshake.

Errors: ``ssl.SSLError`` (a certificate not signed by the trusted CA, a name mismatch,
a peer that does not speak TLS) propagates to the connection, which logs it and closes;
``TlsClosed`` means the peer sent close_notify.
"""

from __future__ import annotations

import ssl

READ_CHUNK = 1 << 18


class TlsClosed(ConnectionError):
    """The peer closed the TLS session."""


class TlsSession:
    def __init__(self, ctx: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=server_side,
                                server_hostname=server_hostname)
        self.established = False

    def start(self) -> bytes:
        """Begin the handshake; the ciphertext to send (a client's ClientHello)."""
        self._handshake()
        return self.outgoing.read()

    def _handshake(self) -> None:
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            return
        self.established = True

    def receive(self, data: bytes) -> tuple[bytes, bytes]:
        """Feed ciphertext from the socket: (plaintext it held, ciphertext to send back,
        e.g. the next handshake flight)."""
        self.incoming.write(data)
        if not self.established:
            self._handshake()
        plain = bytearray()
        if self.established:
            while True:
                try:
                    chunk = self.obj.read(READ_CHUNK)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:
                    raise TlsClosed("the peer closed the TLS session") from None
                if not chunk:
                    break
                plain += chunk
        return bytes(plain), self.outgoing.read()

    def send(self, plain: bytes | bytearray) -> bytes:
        """Encrypt ``plain`` (the handshake must be done): the ciphertext to send."""
        view = memoryview(plain)
        while view:
            n = self.obj.write(view)
            view = view[n:]
        return self.outgoing.read()

    def pending(self) -> bytes:
        """Ciphertext OpenSSL queued on its own (an alert after a failed handshake)."""
        return self.outgoing.read()
