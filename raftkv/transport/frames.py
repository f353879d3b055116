"""Framing: ``[u32 length][u8 version][msgpack payload][tag]``, length counting the rest.

The decoder is incremental (bytes arrive in arbitrary pieces) and refuses, before
buffering it, any frame longer than ``max_frame`` or of an unknown version: a peer that
speaks nonsense costs one closed connection, never unbounded memory.

Authenticated frames
--------------------
Without TLS, the bytes after the handshake cross a network the operator may not trust,
so every frame carries a ``tag``: HMAC-SHA256, truncated to 16 bytes as in RFC 4868's
HMAC-SHA-256-128, over ``seq | header | payload``. Each direction of a connection has its
own key (``handshake.frame_keys``, derived from the cluster secret and both sides'
fresh nonces) and its own sequence number, which counts frames from 0 and is never sent:
both ends know it. So an on-path attacker who cannot learn the secret cannot

- inject or alter a frame (no key, no valid tag),
- replay one, from this connection or an older one (the sequence number, or the key,
  differs), nor reorder or drop one without the next frame failing its check.

The tag is checked before msgpack sees a byte of the payload; a bad tag raises
``FrameError`` and the connection is closed, so nothing of a forged frame is applied.
Under TLS (``raftkv.transport.tls_bio``) the TLS records already carry an AEAD tag and
an implicit sequence number, so frames go without a tag of their own (``mac=None``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgpack

# 2: the payload may be followed by a tag (1, before tags, is refused: see handshake.MAGIC).
VERSION = 2
HEADER = struct.Struct(">IB")
SEQ = struct.Struct(">Q")
TAG = 16
# A frame holds one loop turn's messages for a peer, including a whole snapshot image
# (sent as one message for now), so the cap is generous but finite.
DEFAULT_MAX_FRAME = 256 << 20


class FrameError(ValueError):
    """The byte stream is not a valid frame sequence; close the connection."""


class FrameMac:
    """One direction's key and frame counter. The sender calls ``tag`` for each frame it
    encodes and the receiver ``check`` for each it decodes, in the same order, so the
    counters agree without ever being sent."""

    def __init__(self, key: bytes) -> None:
        # The keyed inner and outer hash states, computed once: each frame copies them
        # instead of paying HMAC's key schedule again (a copy is a memcpy of two states).
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)
        self.seq = 0

    def tag(self, header: bytes, payload: bytes) -> bytes:
        h = self._keyed.copy()
        h.update(SEQ.pack(self.seq) + header)
        h.update(payload)
        self.seq += 1
        return h.digest()[:TAG]

    def check(self, header: bytes, payload: bytes, tag: bytes) -> None:
        if not hmac.compare_digest(self.tag(header, payload), tag):
            raise FrameError("frame authentication failed (forged, altered, replayed or "
                             "out of order)")


def encode_frame(payload: object, mac: FrameMac | None = None) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    if mac is None:
        return HEADER.pack(len(body) + 1, VERSION) + body
    header = HEADER.pack(len(body) + 1 + TAG, VERSION)
    return header + body + mac.tag(header, body)


class FrameDecoder:
    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, mac: FrameMac | None = None) -> None:
        self.max_frame = max_frame
        self.mac = mac
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[object]:
        """Append ``data``; return every complete frame's decoded payload."""
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        mac = self.mac
        tag = TAG if mac is not None else 0
        while len(buf) - pos >= HEADER.size:
            length, version = HEADER.unpack_from(buf, pos)
            if version != VERSION:
                raise FrameError(f"unknown frame version {version}")
            if length < 1 + tag or length > self.max_frame:
                raise FrameError(f"frame of {length} bytes exceeds the {self.max_frame} limit"
                                 if length > self.max_frame else
                                 f"frame of {length} bytes is too short")
            end = pos + 4 + length
            if len(buf) < end:
                break
            body = bytes(buf[pos + HEADER.size:end - tag])
            if mac is not None:
                mac.check(bytes(buf[pos:pos + HEADER.size]), body, bytes(buf[end - tag:end]))
            pos = end
            try:
                out.append(msgpack.unpackb(body, raw=False, strict_map_key=True))
            except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                    msgpack.StackError) as e:
                raise FrameError(f"undecodable frame: {e}") from None
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)
