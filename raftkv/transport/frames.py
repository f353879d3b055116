"""Framing: ``[u32 length][u8 kind][msgpack payload][tag]``, length counting the rest.

The decoder is incremental (bytes arrive in arbitrary pieces) and refuses, before
buffering it, any frame longer than ``max_frame`` or of an unknown kind: a peer that
speaks nonsense costs one closed connection, never unbounded memory.

Split messages
--------------
One message (a loop turn's items for a peer) is normally one frame (kind ``VERSION``, 2).
A message whose frame would exceed ``max_frame`` (a snapshot image of a large state
holds hundreds of MB) is split instead: a first part (kind ``FIRST``, 3, whose header
also carries the message's total length as a u64) and following parts (kind ``MORE``,
4), each holding at most ``PART`` bytes of the encoded message. The receiver appends the
parts and decodes the message once its total has arrived.

Why split rather than raise ``max_frame``: a frame is buffered whole before its tag is
checked, so the per-frame cap is what bounds the memory an unchecked length can claim,
and it must stay well below what a node can afford. A message that is simply large is
bounded separately, by ``max_message`` (``DEFAULT_MAX_MESSAGE``, 4 GiB), which the first
part announces: an oversized message is refused at its first header, before anything of
it is buffered (refusing needs no tag), and an announced total is only ever filled by
parts that each pass their check.
Parts are small (``PART``, 1 MiB, whatever ``max_frame`` is) so that neither end holds a
second copy of the message while it is in transit: the sender frames (and tags, and
under TLS encrypts) one part at a time as the socket drains, and the receiver holds one
part plus the message assembled so far.

Parts travel in order on the connection, with nothing between them: a split message
delays the messages queued after it for that peer, exactly as one big frame did. A
message that fits in one frame is encoded exactly as before this split existed, so a
node of the previous release (which knows only kind 2) still understands everything
but a split message, which it refuses as an unknown frame version, closing the
connection; it could not have received a message that large anyway.

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

A part of a split message is a frame like any other: it has its own tag and takes the
next sequence number, and its header (the kind, and the first part's total) is under the
tag. So a part cannot be forged, altered, moved, dropped or spliced in from another
message without failing a check, and the part is checked before a byte of it is kept.

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

# The kind byte (once the format's version, hence the name). 2: a whole message, whose
# payload may be followed by a tag (1, before tags, is refused: see handshake.MAGIC).
VERSION = 2
FIRST = 3  # the first part of a split message: a TOTAL follows the header
MORE = 4  # a following part
HEADER = struct.Struct(">IB")
TOTAL = struct.Struct(">Q")
SEQ = struct.Struct(">Q")
TAG = 16
# A frame holds one loop turn's messages for a peer; anything larger is split into
# parts, so the cap only has to be generous for ordinary traffic (a 4 MiB append, a
# small image), and finite.
DEFAULT_MAX_FRAME = 256 << 20
# The largest split message a receiver assembles: a snapshot image plus its envelope.
# Receiving one costs about twice this in memory (the parts assembled, then decoded).
DEFAULT_MAX_MESSAGE = 4 << 30
# Bytes of the message in each part (less when max_frame is smaller).
PART = 1 << 20
# The smallest max_frame that leaves a part room for more than its header and tag.
MIN_FRAME = 256


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

    def tag(self, header: bytes, payload: bytes | memoryview) -> bytes:
        h = self._keyed.copy()
        h.update(SEQ.pack(self.seq) + header)
        h.update(payload)
        self.seq += 1
        return h.digest()[:TAG]

    def check(self, header: bytes, payload: bytes | memoryview, tag: bytes) -> None:
        if not hmac.compare_digest(self.tag(header, payload), tag):
            raise FrameError("frame authentication failed (forged, altered, replayed or "
                             "out of order)")


def pack(payload: object) -> memoryview:
    """The encoded message: what ``Outgoing`` frames and ``FrameDecoder`` decodes. A view
    of the packer's own buffer rather than ``packb``'s bytes, which are a copy of it: for
    a 348 MB image that copy alone took the loop about half a second."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack(payload)
    return packer.getbuffer()


def _frame(kind: int, extra: bytes, body: bytes | memoryview, mac: FrameMac | None) -> bytes:
    tag = TAG if mac is not None else 0
    header = HEADER.pack(1 + len(extra) + len(body) + tag, kind) + extra
    if mac is None:
        return b"".join((header, body))
    return b"".join((header, body, mac.tag(header, body)))


def encode_frame(payload: object, mac: FrameMac | None = None) -> bytes:
    """``payload`` as one frame, whatever its size (``Outgoing`` splits a message too
    large for one frame)."""
    return _frame(VERSION, b"", msgpack.packb(payload, use_bin_type=True), mac)


class Outgoing:
    """One encoded message on its way out, a frame at a time (``next_frame``): whole if
    its frame fits in ``max_frame``, else split into parts (module docstring), framed,
    tagged and copied one part at a time as the socket drains. A frame's tag is computed
    when the frame is taken, so frames must be taken in the order they are sent."""

    def __init__(self, body: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._body = memoryview(body)
        self._pos = 0
        # Decided with the tag counted whether or not the connection tags, so a message
        # is split the same way with and without TLS.
        self.split = 1 + len(body) + TAG > max_frame
        self._part = min(PART, max_frame - 1 - TOTAL.size - TAG)
        if self.split and self._part < 1:
            raise ValueError(f"a max_frame of {max_frame} bytes leaves no room for a part")

    @property
    def left(self) -> int:
        """Bytes of the message not yet framed; 0 once every frame has been taken."""
        return len(self._body) - self._pos

    def next_frame(self, mac: FrameMac | None) -> bytes:
        """The next frame; call only while ``left``."""
        body, pos = self._body, self._pos
        if not self.split:
            self._pos = len(body)
            return _frame(VERSION, b"", body, mac)
        end = min(pos + self._part, len(body))
        self._pos = end
        if pos == 0:
            return _frame(FIRST, TOTAL.pack(len(body)), body[:end], mac)
        return _frame(MORE, b"", body[pos:end], mac)


class FrameDecoder:
    """Frames in, decoded messages out (``feed``). Refused with ``FrameError``, each
    before the bytes it concerns are buffered: a frame longer than ``max_frame``, an
    unknown kind, a split message announcing more than ``max_message`` bytes. Refused
    once read: a frame whose tag fails (``mac``), parts out of sequence (a whole frame or
    a first part inside a split message, a following part outside one, parts longer
    than their announced total), a payload that is not msgpack."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, mac: FrameMac | None = None,
                 max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self.max_frame = max_frame
        self.max_message = max_message
        self.mac = mac
        self.frames = 0  # frames accepted (authenticated, when tagged): a sign of life
        self._buf = bytearray()
        self._message: bytearray | None = None  # a split message assembled so far
        self._total = 0  # its announced length

    def feed(self, data: bytes) -> list[object]:
        """Append ``data``; return every complete message's decoded payload."""
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        tag = TAG if self.mac is not None else 0
        try:
            while len(buf) - pos >= HEADER.size:
                length, kind = HEADER.unpack_from(buf, pos)
                if kind not in (VERSION, FIRST, MORE):
                    raise FrameError(f"unknown frame version {kind}")
                extra = TOTAL.size if kind == FIRST else 0
                if length > self.max_frame:
                    raise FrameError(f"frame of {length} bytes exceeds the {self.max_frame} "
                                     "limit")
                if length < 1 + extra + tag:
                    raise FrameError(f"frame of {length} bytes is too short")
                if kind == FIRST:
                    if len(buf) - pos < HEADER.size + extra:
                        break
                    total, = TOTAL.unpack_from(buf, pos + HEADER.size)
                    if total > self.max_message:
                        raise FrameError(f"a message of {total} bytes exceeds the "
                                         f"{self.max_message}-byte message limit")
                end = pos + 4 + length
                if len(buf) < end:
                    break
                message = self._frame(buf, pos, HEADER.size + extra, end - tag, end)
                pos = end
                if message is not None:
                    out.append(_unpack(message))
        finally:
            if pos:
                del buf[:pos]
        return out

    def _frame(self, buf: bytearray, pos: int, header: int, body_end: int,
               end: int) -> bytes | bytearray | None:
        """Check and take the frame at ``pos`` (its header ``header`` bytes long, its
        payload up to ``body_end``, its tag up to ``end``): the complete message it ends,
        if any."""
        kind = buf[pos + 4]
        with memoryview(buf) as view:
            body = view[pos + header:body_end]
            try:
                if self.mac is not None:
                    self.mac.check(bytes(view[pos:pos + header]), body,
                                   bytes(view[body_end:end]))
                self.frames += 1
                assembling = self._message
                if kind == VERSION:
                    if assembling is not None:
                        raise FrameError("a whole frame inside a split message")
                    return bytes(body)
                if kind == FIRST:
                    if assembling is not None:
                        raise FrameError("a split message began inside another")
                    self._total, = TOTAL.unpack_from(buf, pos + HEADER.size)
                    assembling = self._message = bytearray()
                elif assembling is None:
                    raise FrameError("a part of a split message that never began")
                if len(assembling) + len(body) > self._total:
                    raise FrameError("a split message longer than it announced")
                assembling += body
            finally:
                body.release()
        if len(assembling) < self._total:
            return None
        self._message = None
        return assembling

    @property
    def buffered(self) -> int:
        """Bytes held: the frame being read and the split message assembled so far."""
        return len(self._buf) + (len(self._message) if self._message is not None else 0)


def _unpack(body: bytes | bytearray) -> object:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        raise FrameError(f"undecodable frame: {e}") from None
