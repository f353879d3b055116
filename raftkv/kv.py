"""``RaftKV``: the replicated key-value store embedded in a Python application.

Each process creates one ``RaftKV`` with its node id, its raft address, the addresses of
the founding members and the cluster secret. Every call works on any node: writes on a
follower are forwarded to the leader over the peer connection; linearizable reads do a
ReadIndex round through the leader and are served from the local replica (§6.4);
``stale=True`` reads the local replica at once.

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

import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Self

from pysyncobj.monotonic import monotonic

from raftkv.core import ConfChangeOp, LeaderStepping, NotLeader
from raftkv.node.driver import Metrics, Node, NodeConfig, conf_change
from raftkv.node.errors import RequestTimeout
from raftkv.node.stores import claim_data_dir, open_group_storage
from recovery.compaction import CompactionPolicy
from storage.commands import (
    check_key,
    check_value,
    encode_batch,
    encode_cas,
    encode_delete,
    encode_put,
)
from storage.layout import DEFAULT_GROUP
from storage.state_store import StateStore

Key = bytes | str
Value = bytes | str


def _key(key: Key) -> bytes:
    return check_key(key.encode() if isinstance(key, str) else key)


def _value(value: Value) -> bytes:
    return check_value(value.encode() if isinstance(value, str) else value)


def _index(fut: Future[Any]) -> Future[int]:
    out: Future[int] = Future()

    def done(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result()[0])

    fut.add_done_callback(done)
    return out


class RaftKV:
    def __init__(
        self,
        node_id: str,
        raft_addr: str,
        peers: dict[str, str],
        secret: bytes | str,
        *,
        data_dir: str | None = None,
        durable: bool = True,
        join: bool = False,
        tick_seconds: float = 0.05,
        election_tick: int = 10,
        request_timeout: float = 5.0,
        metrics: Metrics | None = None,
        faults: bool = False,
        group: str = DEFAULT_GROUP,
        compaction: CompactionPolicy | None = None,
    ) -> None:
        """``data_dir=None`` keeps everything in memory (storage "memory"); otherwise the
        group lives in LMDB files there. ``durable=False`` skips the log's fsync (faster;
        a machine crash may then lose acknowledged writes on this replica). ``join``
        starts with an empty log and waits to be added with ``add_learner``; otherwise
        the voters in ``peers`` bootstrap the group on first start."""
        if node_id not in peers and not join:
            raise ValueError(f"{node_id} is not in peers; pass join=True to join a cluster")
        self.node_id = node_id
        self.group = group
        self.timeout = request_timeout
        if data_dir is not None:
            claim_data_dir(data_dir, node_id)
        self.node = Node(NodeConfig(
            node_id=node_id, raft_addr=raft_addr,
            secret=secret.encode() if isinstance(secret, str) else secret,
            peers=dict(peers), tick_seconds=tick_seconds, election_tick=election_tick,
            request_timeout=request_timeout, data_dir=data_dir, faults=faults,
        ), metrics)
        storage = open_group_storage(data_dir, group, durable, compaction)
        self.node.add_group(group, storage, None if join else sorted(peers))
        self.node.start()

    # -- writes ---------------------------------------------------------------------------
    def put_async(self, key: Key, value: Value) -> Future[int]:
        return _index(self.node.propose(self.group, encode_put(_key(key), _value(value))))

    def delete_async(self, key: Key) -> Future[int]:
        return _index(self.node.propose(self.group, encode_delete(_key(key))))

    def cas_async(
        self, key: Key, expected: Value | None, new: Value | None
    ) -> Future[tuple[bool, int]]:
        """Set ``key`` to ``new`` (None deletes) if its value is ``expected`` (None: the
        key must be absent). Resolves to ``(swapped, index)``."""
        cmd = encode_cas(
            _key(key), None if expected is None else _value(expected),
            None if new is None else _value(new),
        )
        inner = self.node.propose(self.group, cmd)
        out: Future[tuple[bool, int]] = Future()

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                index, swapped = f.result()
                out.set_result((bool(swapped), index))

        inner.add_done_callback(done)
        return out

    def batch_async(self, ops: Iterable[tuple[Key, Value | None]]) -> Future[int]:
        """Apply puts (and deletes, value None) atomically as one log entry."""
        cmd = encode_batch(
            (_key(k), None if v is None else _value(v)) for k, v in ops
        )
        return _index(self.node.propose(self.group, cmd))

    def put(self, key: Key, value: Value) -> int:
        return self._wait(self.put_async(key, value))

    def delete(self, key: Key) -> int:
        return self._wait(self.delete_async(key))

    def cas(self, key: Key, expected: Value | None, new: Value | None) -> tuple[bool, int]:
        return self._wait(self.cas_async(key, expected, new))

    def batch(self, ops: Iterable[tuple[Key, Value | None]]) -> int:
        return self._wait(self.batch_async(ops))

    # -- reads ----------------------------------------------------------------------------
    def get_async(self, key: Key, stale: bool = False) -> Future[bytes | None]:
        k = _key(key)
        return self.node.read(self.group, lambda s: s.get(k), linearizable=not stale)

    def get(self, key: Key, stale: bool = False) -> bytes | None:
        return self._wait(self.get_async(key, stale))

    def read_async(self, fn: Any, stale: bool = False) -> Future[Any]:
        """Run ``fn(state_store)`` against the replica (scan, digest, ...)."""
        return self.node.read(self.group, fn, linearizable=not stale)

    def digest_async(self, stale: bool = False) -> Future[dict[str, Any]]:
        """The replica's ``{"count", "digest", "applied"}``: equal digests at equal
        applied indexes mean equal states (storage.digest)."""
        def run(s: StateStore) -> dict[str, Any]:
            d = s.digest()
            return {"count": d.count, "digest": d.digest, "applied": s.applied_index()}
        return self.read_async(run, stale)

    def digest(self, stale: bool = False) -> dict[str, Any]:
        return self._wait(self.digest_async(stale))

    # -- membership and leadership --------------------------------------------------------
    def add_learner(self, node_id: str, raft_addr: str) -> int:
        """Add a PRE_FOLLOWER; the leader promotes it once it has caught up."""
        cc = conf_change(ConfChangeOp.ADD_LEARNER, node_id, raft_addr)
        return self._wait(self.node.change_membership(self.group, cc))[0]

    def promote(self, node_id: str) -> int:
        cc = conf_change(ConfChangeOp.PROMOTE, node_id)
        return self._wait(self.node.change_membership(self.group, cc))[0]

    def remove(self, node_id: str) -> None:
        """Remove a member. Removing the leader transfers leadership first; the new
        leader then performs the removal, and this waits for it to be applied here."""
        cc = conf_change(ConfChangeOp.REMOVE, node_id)
        try:
            self._wait(self.node.change_membership(self.group, cc))
        except LeaderStepping:
            deadline = monotonic() + self.timeout
            while node_id in self.members():
                if monotonic() > deadline:
                    raise RequestTimeout(f"the removal of {node_id} did not complete") from None
                self._sleep()

    def transfer_leadership(self, to: str) -> None:
        self._wait(self.node.transfer_leadership(self.group, to))

    def members(self) -> dict[str, str]:
        return dict(self.status()["groups"][self.group]["members"])

    def status(self) -> dict[str, Any]:
        return self._wait(self.node.status())

    def leader(self) -> str | None:
        return self.status()["groups"][self.group]["leader"]

    def wait_for_leader(self, timeout: float = 10.0) -> str:
        deadline = monotonic() + timeout
        while True:
            lead = self.leader()
            if lead is not None:
                return lead
            if monotonic() > deadline:
                raise RequestTimeout(f"no leader elected within {timeout}s")
            self._sleep()

    def close(self) -> None:
        self.node.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------
    def _wait(self, fut: Future[Any]) -> Any:
        try:
            return fut.result(timeout=self.timeout)
        except TimeoutError:
            raise RequestTimeout(f"no outcome within {self.timeout}s") from None

    def _sleep(self) -> None:
        time.sleep(0.02)


__all__ = ["NotLeader", "RaftKV", "RequestTimeout"]
