"""The leader's lease deadlines, with the clock injected: the bookkeeping half of lease
expiry, shared by the server's ``LeaseKeeper`` (``raftkv.server.leases``) and the
simulator (``raftkv.testing.kv_node``).

Theory of operation
-------------------
Time is not part of the replicated state, so expiry cannot be: the leader keeps each
lease's deadline in memory and, when one passes, proposes a revoke entry, which deletes
the lease's keys on every replica at one index (``raftkv.storage.leases``). This class is
that memory and its rules; its owner does the I/O (reading the state, proposing):

- ``take_over(term)`` at every tick with the term this node leads (0: it does not). A
  change of term throws every clock away: a new leader does not know its predecessor's
  clocks, so it gives every lease its full TTL again from the moment it takes over (etcd
  extends leases on a leader change the same way). A lease is then never cut short by a
  failover, and one nobody keeps alive expires at most one TTL after the change (plus the
  election, and one reload for a grant the new leader had not applied yet).
- ``reload(ttls)`` with the leases the state holds: a lease new to us gets a full TTL
  from now; one gone from the state (revoked through another node) is dropped. The owner
  reloads at a take-over and every ``RELOAD_SECONDS`` while leading.
- ``due()`` the leases whose deadline passed and whose revoke is not yet on its way; the
  owner proposes a revoke for each and reports back with ``revoked`` (it applied) or
  ``retry`` (it failed: tried again at the next tick). A lease whose revoke was proposed
  in this term is *doomed* until it is revoked or the term ends: a keepalive is refused
  even after a ``retry``, since a revoke that timed out may still commit.
- ``granted`` and ``keepalive`` restart one lease's clock on the leader.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack

from raftkv.storage.leases import LEASE_PREFIX
from raftkv.storage.revisions import value_of
from raftkv.storage.state_store import KVStateStore, prefix_end

TICK_SECONDS = 0.25  # how often the owner calls ``take_over`` and ``due``
RELOAD_SECONDS = 1.0


def read_leases(state: KVStateStore) -> dict[int, int]:
    """Every lease in ``state``: id -> ttl."""
    out = {}
    for key, row in state.scan_rows(LEASE_PREFIX, prefix_end(LEASE_PREFIX)):
        out[int.from_bytes(key[len(LEASE_PREFIX):], "big")] = int(msgpack.unpackb(value_of(row)))
    return out


class LeaseClocks:
    """One node's lease deadlines while it leads (module docstring). ``clock`` returns
    seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.term = 0  # the term we lead, 0 if we do not
        self.ttls: dict[int, int] = {}
        self.deadlines: dict[int, float] = {}
        self.revoking: set[int] = set()
        self.doomed: set[int] = set()  # a revoke proposed in this term (module docstring)
        self._loaded = 0.0

    def take_over(self, term: int) -> bool:
        """We lead ``term`` (0: we do not). True if that changed: every clock is gone, and
        the owner must ``reload`` if ``term`` is not 0."""
        if term == self.term:
            return False
        self.term, self.ttls, self.deadlines = term, {}, {}
        self.revoking.clear()
        self.doomed.clear()
        return True

    def reload(self, ttls: dict[int, int]) -> None:
        now = self.clock()
        for lease, ttl in ttls.items():
            if lease not in self.deadlines:
                self.deadlines[lease] = now + ttl  # new to us: a full TTL from now
        for lease in set(self.deadlines) - set(ttls):
            del self.deadlines[lease]  # revoked through another node
        self.ttls = dict(ttls)
        self._loaded = now

    def reload_due(self) -> bool:
        return bool(self.term) and self.clock() - self._loaded >= RELOAD_SECONDS

    def due(self) -> list[int]:
        """The leases to revoke now (in id order); each counts as on its way until
        ``revoked`` or ``retry``."""
        if not self.term:
            return []
        now = self.clock()
        out = sorted(lease for lease, deadline in self.deadlines.items()
                     if deadline <= now and lease not in self.revoking)
        self.revoking.update(out)
        self.doomed.update(out)
        return out

    def revoked(self, lease: int) -> None:
        """``lease`` was revoked (here, or found gone): forget its clock."""
        self.deadlines.pop(lease, None)
        self.ttls.pop(lease, None)
        self.revoking.discard(lease)
        self.doomed.discard(lease)

    def retry(self, lease: int) -> None:
        """Proposing ``lease``'s revoke failed: ``due`` offers it again."""
        self.revoking.discard(lease)

    def granted(self, lease: int, ttl: int) -> None:
        if self.term:
            self.ttls[lease] = ttl
            self.deadlines[lease] = self.clock() + ttl

    def knows(self, lease: int) -> bool:
        return lease in self.ttls

    def keepalive(self, lease: int) -> int:
        """Restart ``lease``'s clock; its TTL. ``KeyError`` if it is unknown (the owner
        reloads first if ``knows`` says so) or doomed."""
        if lease in self.doomed:
            raise KeyError(lease)  # expired: its revoke is (or may be) on its way to the log
        ttl = self.ttls[lease]
        self.deadlines[lease] = self.clock() + ttl
        return ttl

    def remaining(self, lease: int) -> float | None:
        d = self.deadlines.get(lease)
        return None if d is None or not self.term else max(0.0, d - self.clock())
