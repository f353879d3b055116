"""What authenticating a peer frame costs: encode + decode, with and without the tag.

Each frame holds one loop turn's items for one peer (``raftkv.transport.frames``); the
tag is HMAC-SHA256 over the frame, truncated to 16 bytes, so its cost is a fixed part
(two hash finalizations and a copy of the keyed state) plus SHA-256 over the bytes. This
measures both ends of one frame (the sender's ``encode_frame`` and the receiver's
``FrameDecoder.feed``) for frames from an empty keepalive to a 4 MiB append, and prints
microseconds per frame and the tag's share.

    python -m benchmarks.frame_auth [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import os
import time

from raftkv.transport import handshake as hs
from raftkv.transport.frames import FrameDecoder, FrameMac, encode_frame

# (label, the frame's items): an empty keepalive, one heartbeat record, and appends of
# 100-byte entries as the throughput benchmark sends them, 10 to 40,000 per frame.
SHAPES: list[tuple[str, list[object]]] = [
    ("keepalive (empty)", []),
    ("1 heartbeat", [[0, "default", 8, "n2", "n1", 3, 0, 0, [], 7, False, 0, None, None,
                      0, 0, False]]),
    *((f"append of {n:,} x 100 B", [[0, "default", 3, "n2", "n1", 3, 3, 9,
                                      [[3, 10 + i, 0, os.urandom(100)] for i in range(n)],
                                      9, False, 0, None, None, 0, 0, False]])
      for n in (10, 1_000, 40_000)),
]


def per_frame(items: list[object], tagged: bool, seconds: float) -> tuple[float, int]:
    """(seconds per encode + decode, frame bytes)."""
    key = hs.frame_keys(b"secret", os.urandom(32), os.urandom(32))[0]
    send, recv = (FrameMac(key), FrameMac(key)) if tagged else (None, None)
    dec = FrameDecoder(mac=recv)
    n, size = 0, 0
    t0 = time.perf_counter()
    while True:
        frame = encode_frame(items, send)
        dec.feed(frame)
        size = len(frame)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 3:
            return elapsed / n, size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    args = p.parse_args(argv)
    print(f"{'frame':<26}{'bytes':>12}{'plain us':>12}{'tagged us':>12}{'tag us':>10}"
          f"{'tag share':>11}")
    for label, items in SHAPES:
        plain, size = per_frame(items, False, args.seconds)
        tagged, _ = per_frame(items, True, args.seconds)
        extra = tagged - plain
        print(f"{label:<26}{size:>12,}{plain * 1e6:>12.1f}{tagged * 1e6:>12.1f}"
              f"{extra * 1e6:>10.1f}{extra / tagged:>11.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
