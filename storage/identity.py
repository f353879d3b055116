"""Making incarnations (``records.Identity``): the one place storage draws randomness.

Kept out of the modules the pure core imports (``records``, ``log_store``), so that
importing the core loads no source of randomness (a test enforces it).

``seeded`` lets a simulator draw them from its own generator for a while, so that a
seed replays bit for bit (``raftkv.testing.placement_sim``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

_source: random.Random | None = None


def new_incarnation() -> int:
    """A fresh incarnation: 63 random bits, never 0 (0 means "none")."""
    if _source is not None:
        return _source.getrandbits(63) or 1
    return int.from_bytes(os.urandom(8), "big") >> 1 or 1


@contextmanager
def seeded(rng: random.Random) -> Iterator[None]:
    """Within the block, incarnations come from ``rng`` (one thread: a simulator's)."""
    global _source
    old, _source = _source, rng
    try:
        yield
    finally:
        _source = old
