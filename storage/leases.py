"""Leases: keys that go away together when their lease expires (etcd's ``Lease``).

The state machine keeps, as its own rows under ``RESERVED_PREFIX`` (never a client's,
carried in snapshots like any row):

- ``lease.<id>`` (8-byte big-endian id): the lease's TTL in seconds (msgpack);
- ``leasekey.<id><key>``: ``key`` is attached to the lease; the key's own row also names
  the lease (``raftkv.storage.revisions``), so a write that moves the key elsewhere finds
  and drops this row without a search.

Commands (entries of the log):

    LEASE_GRANT  [7, id, ttl]          create it; False if the id is taken
    PUT_LEASE    [8, key, value, id]   a put attached to the lease; False (nothing
                                       written) if the lease does not exist
    LEASE_REVOKE [9, id]               delete every key attached to it, then the lease;
                                       the deleted keys (False if it did not exist)

Any other write of an attached key (put, delete, compare-and-set, batch, transaction)
detaches it, as in etcd. *Expiry is not in the state machine*: time is not deterministic.
The leader of the group tracks each lease's deadline in memory (``raftkv.server.leases``)
and, when one passes, proposes ``LEASE_REVOKE``; so every replica deletes the same keys at
the same index, and replay after a crash deletes them again at the same place.
"""

from __future__ import annotations

from raftkv.storage.commands import MAX_KEY_BYTES, RESERVED_PREFIX, CommandError

LEASE_PREFIX = RESERVED_PREFIX + b"lease."
ATTACH_PREFIX = RESERVED_PREFIX + b"leasekey."
MAX_TTL = 10_000_000  # seconds, about 115 days
MAX_LEASE_ID = (1 << 63) - 1
# An attached key's own row under ATTACH_PREFIX + id must fit LMDB's key size too.
MAX_LEASED_KEY_BYTES = MAX_KEY_BYTES - len(ATTACH_PREFIX) - 8


def check_lease_id(lease: object) -> int:
    if type(lease) is not int or not 0 < lease <= MAX_LEASE_ID:
        raise CommandError(f"a lease id is an integer from 1 to {MAX_LEASE_ID}, "
                           f"not {lease!r:.40}")
    return lease


def check_ttl(ttl: object) -> int:
    if type(ttl) is not int or not 0 < ttl <= MAX_TTL:
        raise CommandError(f"a lease's ttl is a whole number of seconds from 1 to {MAX_TTL}, "
                           f"not {ttl!r:.40}")
    return ttl


def lease_key(lease: int) -> bytes:
    return LEASE_PREFIX + lease.to_bytes(8, "big")


def attach_prefix(lease: int) -> bytes:
    return ATTACH_PREFIX + lease.to_bytes(8, "big")


def attach_key(lease: int, key: bytes) -> bytes:
    return attach_prefix(lease) + key
