"""``RaftKV``: the replicated key-value store embedded in a Python application.

Each process creates one ``RaftKV`` with its node id, its raft address, the addresses of
the founding members and the cluster secret. Every read and write works on any node:
writes on a follower are forwarded to the leader over the peer connection; linearizable
reads do a ReadIndex round through the leader and are served from the local replica
(§6.4); ``stale=True`` reads the local replica at once. So does ``transfer_leadership``
(a follower forwards it). The membership calls (``add_learner``, ``promote``,
``remove``) run on the leader: a follower raises ``NotLeader`` naming it.

Every operation has a synchronous form, which blocks until the outcome is known and
raises on failure, and an ``*_async`` form returning a ``concurrent.futures.Future``.
Writes return the log index they were applied at.

    kv = RaftKV("n1", "127.0.0.1:7001", peers={"n1": "127.0.0.1:7001", ...},
                secret=b"...", data_dir="/var/lib/raftkv/n1")
    kv.wait_for_leader()
    index = kv.put(b"k", b"v")
    assert kv.get(b"k") == b"v"
    kv.close()
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from raftkv.embedded import EmbeddedNode
from raftkv.storage.commands import (
    CommandError,
    check_key,
    check_value,
    encode_batch,
    encode_cas,
    encode_cas_index,
    encode_delete,
    encode_put,
)
from raftkv.storage.revisions import KeyMeta
from raftkv.storage.state_store import KVStateStore

Key = bytes | str
Value = bytes | str


def _flag(stale: object) -> bool:
    """``stale`` as given, if a bool: a string such as "false" read as true, and so gave
    a stale read where a linearizable one was asked for (found from outside)."""
    if type(stale) is not bool:
        raise TypeError(f"stale must be True or False, not {stale!r:.40}")
    return stale


def _key(key: Key) -> bytes:
    return check_key(_bytes(key, "key"))


def _value(value: Value) -> bytes:
    return check_value(_bytes(value, "value"))


def _bytes(x: object, what: str) -> bytes:
    """A key or value as bytes: str as UTF-8, a bytes subclass as plain bytes; anything
    else, or a str UTF-8 cannot encode (a lone surrogate, found from outside raising
    UnicodeEncodeError), is a CommandError."""
    if isinstance(x, str):
        try:
            return x.encode()
        except UnicodeEncodeError as e:
            raise CommandError(f"{what} is not valid text ({e.reason} at position {e.start}); "
                               f"pass bytes for a binary {what}") from None
    if isinstance(x, bytes):
        return bytes(x)
    # "must be bytes" would hide that str works too
    raise CommandError(f"{what} must be bytes or str, not {type(x).__name__}")


def _batch_op(op: object) -> tuple[bytes, bytes | None]:
    """One (key, value) pair of a batch, value None for a delete; CommandError if not."""
    if not isinstance(op, tuple | list) or len(op) != 2:
        raise CommandError(f"a batch operation is a (key, value) pair, not {op!r:.80}")
    k, v = op
    return _key(k), None if v is None else _value(v)


def _index(index: int, result: object) -> int:
    return index


def _swapped(index: int, result: object) -> tuple[bool, int]:
    return bool(result), index


class RaftKV(EmbeddedNode):
    """See the module docstring; construction arguments are ``EmbeddedNode``'s."""

    # -- writes ---------------------------------------------------------------------------
    def put_async(self, key: Key, value: Value) -> Future[int]:
        return self.node.propose(self.group, encode_put(_key(key), _value(value)), _index)

    def delete_async(self, key: Key) -> Future[int]:
        return self.node.propose(self.group, encode_delete(_key(key)), _index)

    def cas_async(
        self, key: Key, expected: Value | None, new: Value | None,
        prev_index: int | None = None,
    ) -> Future[tuple[bool, int]]:
        """Set ``key`` to ``new`` (None deletes) if its value is ``expected`` (None: the
        key must be absent), or, with ``prev_index``, if its mod revision is that (0:
        absent; ``expected`` is then ignored). Resolves to ``(swapped, index)``."""
        k, v = _key(key), None if new is None else _value(new)
        cmd = (encode_cas_index(k, prev_index, v) if prev_index is not None else
               encode_cas(k, None if expected is None else _value(expected), v))
        return self.node.propose(self.group, cmd, _swapped)

    def batch_async(self, ops: Iterable[tuple[Key, Value | None]]) -> Future[int]:
        """Apply puts (and deletes, value None) atomically as one log entry. An empty
        batch is refused (``CommandError``), as the HTTP API refuses it."""
        pairs = [_batch_op(op) for op in ops]
        if not pairs:
            raise CommandError("a batch needs at least one operation")
        cmd = encode_batch(pairs)
        return self.node.propose(self.group, cmd, _index)

    def put(self, key: Key, value: Value) -> int:
        return self._wait(self.put_async(key, value))

    def delete(self, key: Key) -> int:
        return self._wait(self.delete_async(key))

    def cas(self, key: Key, expected: Value | None, new: Value | None,
            prev_index: int | None = None) -> tuple[bool, int]:
        return self._wait(self.cas_async(key, expected, new, prev_index))

    def batch(self, ops: Iterable[tuple[Key, Value | None]]) -> int:
        return self._wait(self.batch_async(ops))

    # -- reads ----------------------------------------------------------------------------
    def get_async(self, key: Key, stale: bool = False) -> Future[bytes | None]:
        k = _key(key)
        return self.node.read_kv(self.group, lambda s: s.get(k), linearizable=not _flag(stale))

    def get(self, key: Key, stale: bool = False) -> bytes | None:
        return self._wait(self.get_async(key, stale))

    def get_meta(self, key: Key, stale: bool = False) -> KeyMeta | None:
        """The value with the key's create and mod revisions and version
        (``raftkv.storage.revisions``), or None if absent."""
        k = _key(key)
        return self._wait(self.node.read_kv(self.group, lambda s: s.get_meta(k),
                                         linearizable=not _flag(stale)))

    def read_async(self, fn: Any, stale: bool = False) -> Future[Any]:
        """Run ``fn(state_store)`` against the replica (scan, digest, ...)."""
        return self.node.read_kv(self.group, fn, linearizable=not _flag(stale))

    def digest_async(self, stale: bool = False) -> Future[dict[str, Any]]:
        """The replica's ``{"count", "digest", "revisions_digest", "applied"}``: equal
        digests at equal applied indexes mean equal values (``digest``, what a bulk
        load's source can compute too) and equal rows, revisions included
        (``revisions_digest``; raftkv.storage.digest)."""
        def run(s: KVStateStore) -> dict[str, Any]:
            d, r = s.digest(), s.digest(revisions=True)
            return {"count": d.count, "digest": d.digest, "revisions_digest": r.digest,
                    "applied": s.applied_index()}
        return self.node.read_kv(self.group, run, linearizable=not _flag(stale))

    def digest(self, stale: bool = False) -> dict[str, Any]:
        return self._wait(self.digest_async(stale))

