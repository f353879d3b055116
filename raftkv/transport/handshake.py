"""The HMAC challenge that every connection passes before a frame is decoded.

Both sides prove they hold the cluster secret without sending it, and each binds the
other's fresh nonce so a recorded handshake cannot be replayed::

    acceptor -> dialer : MAGIC | nonce_a(32)
    dialer -> acceptor : MAGIC | nonce_d(32) | mac_d(32) | len | id | len | addr | len | cluster
                         mac_d = HMAC(secret, "D" | nonce_a | nonce_d | the three fields)
    acceptor -> dialer : mac_a(32) | len | id | len | cluster
                         mac_a = HMAC(secret, "A" | nonce_d | nonce_a | the two fields)

Every field has a fixed size or a one-byte length, so the parser needs no decoder at all;
msgpack sees only bytes from a peer that has proved the secret. The dialer also announces
its listening address, which is how a node learns where a newly added peer lives.

Each side also names its *cluster*: its id, nothing (a cluster without an id), or
``JOINING`` (a node that joins, and adopts the first id it meets). The transport refuses a
peer of another cluster (``Transport.admit_cluster``): the secret alone does not tell two
clusters apart, and a node started on a data directory from before a ``snapshot
restore`` (the old cluster's, with the same node ids, addresses and secret) was otherwise
readmitted into the restored one, answered reads from the old data and lost acknowledged
writes (found from outside). ``raftkv.node.stores`` says where ids come from.

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

# \x03: the hello and welcome name a cluster; \x02: frames carry tags (``frames``). A
# peer still sending \x01 would send untagged frames, and one sending \x02 names no
# cluster, so each is refused, by name, rather than trusted.
MAGIC = b"RKV\x03"
OLD_MAGIC = b"RKV\x01"
UNNAMED_MAGIC = b"RKV\x02"
# A TLS record of type handshake (22) with major version 3: a ClientHello.
TLS_RECORD = b"\x16\x03"
NONCE = 32
MAC = 32
# The cluster a node that joins names until it adopts one (``Transport.admit_cluster``).
JOINING = b"?"
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
    if head == UNNAMED_MAGIC:
        raise HandshakeError("the peer runs an older raftkv that names no cluster in its "
                             "handshake: upgrade it (every node of a cluster at once)")
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


def hello(secret: bytes, nonce_a: bytes, nonce_d: bytes, node_id: str, addr: str,
          cluster: bytes = b"") -> bytes:
    nid, a = node_id.encode(), addr.encode()
    fields = _field(nid) + _field(a) + _field(cluster)
    return MAGIC + nonce_d + _mac(secret, b"D", nonce_a, nonce_d, fields) + fields


def parse_hello(
    buf: bytes | bytearray, secret: bytes, nonce_a: bytes
) -> tuple[str, str, bytes, bytes, int] | None:
    """(peer id, peer address, its cluster, nonce_d, bytes used), None if incomplete, or
    HandshakeError."""
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
    got = _take_field(buf, pos)
    if got is None:
        return None
    cluster, pos = got
    # The MAC covers the length-prefixed fields, so the split between them is bound too.
    signed = _field(nid) + _field(addr) + _field(cluster)
    if not hmac.compare_digest(mac, _mac(secret, b"D", nonce_a, nonce_d, signed)):
        raise HandshakeError("the peer does not know the cluster secret")
    try:
        return nid.decode(), addr.decode(), cluster, nonce_d, pos
    except UnicodeDecodeError:
        raise HandshakeError("peer id or address is not UTF-8") from None


def welcome(secret: bytes, nonce_a: bytes, nonce_d: bytes, node_id: str,
            cluster: bytes = b"") -> bytes:
    fields = _field(node_id.encode()) + _field(cluster)
    return _mac(secret, b"A", nonce_d, nonce_a, fields) + fields


def parse_welcome(
    buf: bytes | bytearray, secret: bytes, nonce_a: bytes, nonce_d: bytes
) -> tuple[str, bytes, int] | None:
    """(acceptor id, its cluster, bytes used), None if incomplete, or HandshakeError."""
    if len(buf) < MAC:
        return None
    got = _take_field(buf, MAC)
    if got is None:
        return None
    nid, pos = got
    got = _take_field(buf, pos)
    if got is None:
        return None
    cluster, pos = got
    if not hmac.compare_digest(bytes(buf[:MAC]), _mac(secret, b"A", nonce_d, nonce_a,
                                                      _field(nid) + _field(cluster))):
        raise HandshakeError("the acceptor does not know the cluster secret")
    try:
        return nid.decode(), cluster, pos
    except UnicodeDecodeError:
        raise HandshakeError("peer id is not UTF-8") from None
