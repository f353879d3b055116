"""Retries for the rebalance manager: exponential back-off per action, and a timer served
from the driver's per-tick hook, so retries run on the loop thread without a thread of
their own (the Ignite rebalance design's "failover thread" becomes deadlines checked every tick).

``Backoff`` belongs to one retried action of one partition (for instance "propose the next
membership change"). Its ``key`` names the context the attempts belong to (the leader's
term and the target peers): a new context starts a fresh budget, because a new leader or
a new target deserves new attempts. After ``max_attempts`` failures in one context it is
*exhausted*: the action stops until the context changes, and the manager records and
counts the error (Ignite's rebalance design: "notify node's failure handler").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RetryPolicy:
    base: float = 0.05
    factor: float = 2.0
    cap: float = 2.0
    max_attempts: int = 10

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th consecutive failure (1-based)."""
        return float(min(self.cap, self.base * self.factor ** max(0, failures - 1)))


class Backoff:
    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.key: Hashable = None
        self.failures = 0
        self.not_before = 0.0
        self.exhausted = False
        self.last_error: str | None = None

    def ready(self, key: Hashable, now: float) -> bool:
        """May the action run now in context ``key``? A new context resets the budget."""
        if key != self.key:
            self.key = key
            self.failures, self.not_before, self.exhausted = 0, 0.0, False
            self.last_error = None
        return not self.exhausted and now >= self.not_before

    def failed(self, error: BaseException, now: float) -> float | None:
        """Record a failure; returns the delay before the next attempt, or None when the
        budget is now exhausted."""
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        if self.failures >= self.policy.max_attempts:
            self.exhausted = True
            return None
        d = self.policy.delay(self.failures)
        self.not_before = now + d
        return d

    def succeeded(self) -> None:
        self.failures, self.not_before, self.exhausted = 0, 0.0, False
        self.last_error = None

    def describe(self) -> dict[str, Any]:
        return {"failures": self.failures, "exhausted": self.exhausted,
                "last_error": self.last_error}


class TickTimer:
    """Callbacks due at a monotonic time, fired by ``on_tick`` (install it as a group's
    ``on_tick`` hook). Hooks run while the driver iterates its groups, so callbacks must
    not add or remove groups themselves: they should only queue work (``Node.call``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self._clock() + delay, fn)

    def on_tick(self, _group: object = None) -> None:
        now = self._clock()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, fn = heapq.heappop(heap)
            fn()

    def __len__(self) -> int:
        return len(self._heap)
