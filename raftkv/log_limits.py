"""Log records that a remote party can cause, at a bounded rate.

A peer with the wrong secret redials many times a second, and each of its peers logged
every refusal (found from outside: 20 WARNINGs a second); a client without credentials
could likewise add a log line per request, 3,000 for 3,000 requests, and fill the disk.
``RateLimitedLog`` shows at most ``burst`` records per ``every`` seconds for each
(source, reason); the rest go to DEBUG and are counted in the next window's first record,
so nothing is lost from the count, and a new kind of trouble is still seen at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic
from typing import Any

EVERY = 10.0  # seconds in a window of records of one kind about one source
BURST = 3  # records of one kind about one source shown in a window
SOURCES = 1000  # (source, reason) windows remembered; the oldest goes first


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
                 every: float = EVERY, burst: int = BURST,
                 clock: Callable[[], float] = monotonic) -> None:
        self.logger, self.level, self.every, self.burst = logger, level, every, burst
        self.clock = clock
        # (source, reason) -> (window start, records shown, repeats hidden)
        self._windows: dict[tuple[str, str], tuple[float, int, int]] = {}

    def log(self, source: str, reason: str, msg: str, *args: Any) -> None:
        """``logger.log(level, msg, *args)``, within the limit for (source, reason)."""
        now = self.clock()
        key = (source, reason)
        w = self._windows.get(key)
        if w is not None and now - w[0] < self.every:
            if w[1] >= self.burst:
                self._windows[key] = (w[0], w[1], w[2] + 1)
                self.logger.debug(msg, *args)
                return
            self._windows[key] = (w[0], w[1] + 1, w[2])
            self.logger.log(self.level, msg, *args)
            return
        self._windows.pop(key, None)  # to the end: the first entry is then the oldest
        if len(self._windows) >= SOURCES:  # many sources: forget the oldest, in O(1)
            del self._windows[next(iter(self._windows))]
        self._windows[key] = (now, 1, 0)
        if w is not None and w[2]:
            msg += " (%d more like it not shown, from %.0f s ago)"
            args = (*args, w[2], now - w[0])
        self.logger.log(self.level, msg, *args)
