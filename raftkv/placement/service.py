"""The metastore as a service of a node: the ``MetaStore`` group plus reads and watches.

``MetaService`` hosts the metastore's Raft group on a ``Node`` (group ``meta``) and
offers, from any thread:

- ``invoke`` / ``put`` / ``remove``: proposals (forwarded to the leader from a follower);
  they resolve to the typed result (``InvokeResult``, ``BranchResult``, ``WriteResult``);
- ``get`` / ``get_many`` / ``range``: linearizable (ReadIndex) unless ``stale``;
- ``watch(prefix, from_revision)``: a long poll. It resolves with the next
  ``EventBatch`` at or after ``from_revision`` once one exists (or an empty batch at the
  timeout). A watcher that saw revision R asks again from R + 1; since every replica holds
  the same gap-free history, it may ask any node, which is how a watch survives a
  metastore leader change.

Watches are served after a ReadIndex round, so a watcher never sees a replica's history
go backwards across nodes: the answer starts at or after what was committed when asked.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from raftkv.futures import then
from raftkv.node.driver import Group, Node
from raftkv.node.errors import NodeStopped
from raftkv.node.group_storage import GroupStorage
from raftkv.placement import meta_commands as mc
from raftkv.placement.metastore import EventBatch, HistoryCompacted, MetaStore, RangeResult
from raftkv.storage.layout import META_GROUP, group_paths
from raftkv.storage.lmdb_log import LmdbLogStore

__all__ = ["META_GROUP", "MetaService"]


class MetaService:
    def __init__(self, node: Node, data_dir: str, voters: list[str] | None,
                 group: str = META_GROUP, durable: bool = True) -> None:
        """Host the metastore group. ``data_dir`` holds its LMDB files; ``voters``
        bootstraps it (None: join)."""
        log_path, state_path = group_paths(data_dir, group)
        raft_log = LmdbLogStore(log_path, durable=durable)
        self.store = MetaStore(state_path)
        self.node = node
        self.group = group
        self._watches: list[tuple[bytes, int, Future[EventBatch], float]] = []
        g = node.add_group(group, GroupStorage(raft_log, self.store), voters)
        g.on_applied.append(self._wake_watches)
        g.on_tick.append(self._wake_watches)  # deadlines pass in an idle group too
        g.on_close.append(self._fail_watches)

    # -- writes ---------------------------------------------------------------------------
    def propose(self, data: bytes) -> Future[Any]:
        return then(self.node.propose(self.group, data),
                    lambda r: _raise_or(mc.restore_result(data, r[1])))

    def invoke(self, conditions: Iterable[mc.Condition], success: Iterable[mc.Op],
               failure: Iterable[mc.Op] = ()) -> Future[Any]:
        return self.propose(mc.encode_invoke(list(conditions), list(success), list(failure)))

    def iif(self, tree: mc.If | mc.Do) -> Future[Any]:
        return self.propose(mc.encode_iif(tree))

    def put(self, key: bytes, value: bytes) -> Future[Any]:
        return self.propose(mc.encode_put(key, value))

    def remove(self, key: bytes) -> Future[Any]:
        return self.propose(mc.encode_remove(key))

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: bytes, stale: bool = False) -> Future[mc.VersionedValue | None]:
        return self.node.read(self.group, lambda s: self.store.get_entry(key), not stale)

    def get_many(self, keys: list[bytes], stale: bool = False) -> Future[list[Any]]:
        return self.node.read(self.group, lambda s: self.store.get_many(keys), not stale)

    def range(self, prefix: bytes = b"", stale: bool = False) -> Future[RangeResult]:
        return self.node.read(self.group, lambda s: self.store.range(prefix), not stale)

    def watch(self, prefix: bytes, from_revision: int, timeout: float = 10.0,
              limit: int = 1000) -> Future[EventBatch]:
        """Resolves with the events under ``prefix`` from ``from_revision`` on, waiting
        up to ``timeout`` for the first; ``HistoryCompacted`` if that revision is gone."""
        out: Future[EventBatch] = Future()

        def start(_: object) -> None:
            batch = self.store.read_events(prefix, from_revision, limit)
            if batch.events:
                out.set_result(batch)
            else:
                self._watches.append((prefix, from_revision, out, self.node.clock() + timeout))

        def failed(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None and not out.done():
                out.set_exception(exc)

        self.node.read(self.group, start).add_done_callback(failed)
        return out

    def _wake_watches(self, g: Group) -> None:
        """After each applied batch (loop thread): answer watches that now have events,
        and empty-handed those past their deadline."""
        if not self._watches:
            return
        now = self.node.clock()
        waiting = []
        for prefix, rev, fut, deadline in self._watches:
            if fut.done():
                continue
            try:
                batch = self.store.read_events(prefix, rev)
            except HistoryCompacted as e:
                fut.set_exception(e)
                continue
            if batch.events or now > deadline:
                fut.set_result(batch)
            else:
                waiting.append((prefix, rev, fut, deadline))
        self._watches = waiting


    def _fail_watches(self, g: Group) -> None:
        watches, self._watches = self._watches, []
        for _, _, fut, _ in watches:
            if not fut.done():
                fut.set_exception(NodeStopped(f"the {self.group} group stopped on this node"))


def _raise_or(result: object) -> object:
    if isinstance(result, Exception):
        raise result
    return result
