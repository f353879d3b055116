"""Framing: ``[u32 length][u8 version][msgpack payload]``, length counting version + payload.

The decoder is incremental (bytes arrive in arbitrary pieces) and refuses, before
buffering it, any frame longer than ``max_frame`` or of an unknown version: a peer that
speaks nonsense costs one closed connection, never unbounded memory.
"""

from __future__ import annotations

import struct

import msgpack

VERSION = 1
HEADER = struct.Struct(">IB")
# A frame holds one loop turn's messages for a peer, including a whole snapshot image
# (sent as one message for now), so the cap is generous but finite.
DEFAULT_MAX_FRAME = 256 << 20


class FrameError(ValueError):
    """The byte stream is not a valid frame sequence; close the connection."""


def encode_frame(payload: object) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return HEADER.pack(len(body) + 1, VERSION) + body


class FrameDecoder:
    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[object]:
        """Append ``data``; return every complete frame's decoded payload."""
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEADER.size:
            length, version = HEADER.unpack_from(buf, pos)
            if version != VERSION:
                raise FrameError(f"unknown frame version {version}")
            if length < 1 or length > self.max_frame:
                raise FrameError(f"frame of {length} bytes exceeds the {self.max_frame} limit")
            end = pos + 4 + length
            if len(buf) < end:
                break
            body = bytes(buf[pos + HEADER.size:end])
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
