"""Making incarnations (``records.Identity``): the one place storage draws randomness.

Kept out of the modules the pure core imports (``records``, ``log_store``), so that
importing the core loads no source of randomness (a test enforces it).
"""

from __future__ import annotations

import os


def new_incarnation() -> int:
    """A fresh incarnation: 63 random bits, never 0 (0 means "none")."""
    return int.from_bytes(os.urandom(8), "big") >> 1 or 1
