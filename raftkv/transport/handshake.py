"""The HMAC challenge that every connection passes before a frame is decoded.

Both sides prove they hold the cluster secret without sending it, and each binds the
other's fresh nonce so a recorded handshake cannot be replayed::

    acceptor -> dialer : MAGIC | nonce_a(32)
    dialer -> acceptor : MAGIC | nonce_d(32) | mac_d(32) | len | id | len | addr
                         mac_d = HMAC(secret, "D" | nonce_a | nonce_d | len | id | len | addr)
    acceptor -> dialer : mac_a(32) | len | id
                         mac_a = HMAC(secret, "A" | nonce_d | nonce_a | len | id)

Every field has a fixed size or a one-byte length, so the parser needs no decoder at all;
msgpack sees only bytes from a peer that has proved the secret. The dialer also announces
its listening address, which is how a node learns where a newly added peer lives.

The handshake also keys the frames that follow (``frame_keys``): HKDF-SHA256 (RFC 5869)
with both nonces as the salt and the secret as the input key, one key per direction.
Both nonces are fresh, so every connection has keys of its own, and a frame recorded on
one connection is worthless on any other (``frames`` says what the tags protect). Under
TLS the same handshake runs inside the TLS channel: TLS proves the certificates, this
proves the cluster secret. Neither mode hides anything from a peer that holds the secret:
docs/security.md lists what an attacker can and cannot do in each mode.
"""

from __future__ import annotations

import hashlib
import hmac
import os

# \x02: frames carry tags (``frames``). A peer still sending \x01 would send untagged
# frames, so it is refused, by name, rather than trusted.
MAGIC = b"RKV\x02"
OLD_MAGIC = b"RKV\x01"
# A TLS record of type handshake (22) with major version 3: a ClientHello.
TLS_RECORD = b"\x16\x03"
NONCE = 32
MAC = 32
MAX_FIELD = 255


class HandshakeError(ValueError):
    """The peer failed the challenge or sent something that is not a handshake."""


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _field(b: bytes) -> bytes:
    if len(b) > MAX_FIELD:
        raise HandshakeError("handshake field too long")
    return bytes([len(b)]) + b


def _take_field(buf: bytes | bytearray, pos: int) -> tuple[bytes, int] | None:
    """The length-prefixed field at ``pos`` and the position after it; None if incomplete."""
    if len(buf) <= pos:
        return None
    end = pos + 1 + buf[pos]
    if len(buf) < end:
        return None
    return bytes(buf[pos + 1:end]), end


def _check_magic(buf: bytes | bytearray) -> None:
    head = bytes(buf[:len(MAGIC)])
    if head == MAGIC:
        return
    if head == OLD_MAGIC:
        raise HandshakeError("the peer runs an older raftkv whose frames are not "
                             "authenticated: upgrade it")
    if head.startswith(TLS_RECORD):
        raise HandshakeError("the peer speaks TLS but this node does not: give every node "
                             "the same --peer-cert-file/--peer-key-file settings")
    raise HandshakeError("the peer is not a raftkv node (bad magic)")


def frame_keys(secret: bytes, nonce_a: bytes, nonce_d: bytes) -> tuple[bytes, bytes]:
    """(dialer-to-acceptor key, acceptor-to-dialer key) for this connection's frames:
    HKDF-SHA256 extract (salt = both nonces) and expand (one block per direction)."""
    prk = hmac.digest(nonce_a + nonce_d, secret, "sha256")
    return (hmac.digest(prk, b"raftkv frames: dialer to acceptor\x01", "sha256"),
            hmac.digest(prk, b"raftkv frames: acceptor to dialer\x01", "sha256"))


def new_nonce() -> bytes:
    return os.urandom(NONCE)


def challenge(nonce_a: bytes) -> bytes:
    return MAGIC + nonce_a


def parse_challenge(buf: bytes | bytearray) -> tuple[bytes, int] | None:
    n = len(MAGIC) + NONCE
    if len(buf) < n:
        return None
    _check_magic(buf)
    return bytes(buf[len(MAGIC):n]), n


def hello(secret: bytes, nonce_a: bytes, nonce_d: bytes, node_id: str, addr: str) -> bytes:
    nid, a = node_id.encode(), addr.encode()
    fields = _field(nid) + _field(a)
    return MAGIC + nonce_d + _mac(secret, b"D", nonce_a, nonce_d, fields) + fields


def parse_hello(
    buf: bytes | bytearray, secret: bytes, nonce_a: bytes
) -> tuple[str, str, bytes, int] | None:
    """(peer id, peer address, nonce_d, bytes used), None if incomplete, or HandshakeError."""
    fixed = len(MAGIC) + NONCE + MAC
    if len(buf) < fixed:
        return None
    _check_magic(buf)
    nonce_d = bytes(buf[len(MAGIC):len(MAGIC) + NONCE])
    mac = bytes(buf[len(MAGIC) + NONCE:fixed])
    got = _take_field(buf, fixed)
    if got is None:
        return None
    nid, pos = got
    got = _take_field(buf, pos)
    if got is None:
        return None
    addr, pos = got
    # The MAC covers the length-prefixed fields, so the id/address split is bound too.
    signed = _field(nid) + _field(addr)
    if not hmac.compare_digest(mac, _mac(secret, b"D", nonce_a, nonce_d, signed)):
        raise HandshakeError("the peer does not know the cluster secret")
    try:
        return nid.decode(), addr.decode(), nonce_d, pos
    except UnicodeDecodeError:
        raise HandshakeError("peer id or address is not UTF-8") from None


def welcome(secret: bytes, nonce_a: bytes, nonce_d: bytes, node_id: str) -> bytes:
    nid = node_id.encode()
    return _mac(secret, b"A", nonce_d, nonce_a, _field(nid)) + _field(nid)


def parse_welcome(
    buf: bytes | bytearray, secret: bytes, nonce_a: bytes, nonce_d: bytes
) -> tuple[str, int] | None:
    if len(buf) < MAC:
        return None
    got = _take_field(buf, MAC)
    if got is None:
        return None
    nid, pos = got
    if not hmac.compare_digest(bytes(buf[:MAC]),
                               _mac(secret, b"A", nonce_d, nonce_a, _field(nid))):
        raise HandshakeError("the acceptor does not know the cluster secret")
    try:
        return nid.decode(), pos
    except UnicodeDecodeError:
        raise HandshakeError("peer id is not UTF-8") from None
