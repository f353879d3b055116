"""The placement manager's view of the metastore: a cache of the placement keys kept
current by one watch, and this node's own registrations (address, incarnation).

**Cache and watch.** The manager reads the whole metastore once (``range``), keeps a cache
of the placement keys (``catalog``: table descriptors, the logical topology, node
addresses, and every partition's ``assignments.*`` / ``change.trigger.revision``), and
then long-polls ``watch(b"", revision + 1)``, applying events in revision order. After
each batch it *reconciles* every partition the batch touched. Reconciling is level-
triggered: it compares what the metastore says with what the local Raft group is, and
takes the next step; so a missed edge (a crash between two steps, a leader change, an
error) is repaired by the next reconcile rather than lost. Reconciles are also kicked by
the partition groups' hooks (``on_leader``, ``on_applied`` while a change is under way)
and by the retry timer.

"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from raftkv.core import Role
from raftkv.node.errors import NodeStopped
from raftkv.placement import rebalance_steps as steps
from raftkv.placement.assignments import (
    partition_keys,
)
from raftkv.placement.catalog import (
    ADDRESS_PREFIX,
    DEAD_KEY,
    HOLDS_PREFIX,
    INCARNATION_PREFIX,
    TABLES_PREFIX,
    TOPOLOGY_KEY,
    TableDescriptor,
    address_key,
    incarnation_key,
    parse_partition_key,
    partition_group,
)
from raftkv.placement.key_cache import KeyCache, holds_group
from raftkv.placement.manager_base import (
    ManagerBase,
    tracked,
)
from raftkv.placement.meta_commands import (
    Cond,
    Op,
    VersionedValue,
)
from raftkv.placement.metastore import EventBatch, HistoryCompacted, RangeResult
from raftkv.placement.partition_state import (
    PartitionState,
    TableDropped,
)

log = logging.getLogger(__name__)


class MetastoreView(ManagerBase):
    """The cache and the watch (see the module docstring)."""

    # ================================================ loop thread: metastore view =======
    def _register_address(self) -> None:
        key, addr = address_key(self.id), self.node.cfg.raft_addr.encode()
        bo = self._backoffs["address"]
        bo.ready("address", self.node.clock())

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                bo.succeeded()
            elif not isinstance(exc, NodeStopped):
                delay = bo.failed(exc, self.node.clock())
                if delay is not None:
                    self._timer.after(delay, lambda: self._defer(self._register_address))

        self._on_loop(self.meta.invoke([Cond.value(key).eq(addr)], [], [Op.put(key, addr)]),
                      done)

    def _register_incarnation(self) -> None:
        """IGNITE-16668: a fresh random id per start, written before anything is hosted
        (every holds key of an earlier incarnation is void from now on), then the first
        read of the metastore."""
        bo = self._backoffs["incarnation"]
        bo.ready("incarnation", self.node.clock())

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                bo.succeeded()
                self._incarnation_rev = int(f.result().revision)
                self._resync()
            elif not isinstance(exc, NodeStopped):
                delay = bo.failed(exc, self.node.clock())
                if delay is None:
                    bo.succeeded()
                    delay = self.retry.cap
                self._timer.after(delay, lambda: self._defer(self._register_incarnation))

        self._on_loop(self.meta.put(incarnation_key(self.id), self.incarnation), done)

    def _resync(self) -> None:
        """Read every key, rebuild the cache, reconcile everything, then watch."""
        self._on_loop(self.meta.range(b""), self._on_range)

    def _on_range(self, f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            self._watch_failed(exc, self._resync)
            return
        result: RangeResult = f.result()
        self._backoffs["watch"].succeeded()
        self._kv = KeyCache((k, v) for k, v in result.items if tracked(k))
        old, self._tables = self._tables, {}
        for k, v in self._kv.items():
            if k.startswith(TABLES_PREFIX):
                self._learn_table(k, v.value)
        for name in set(old) - set(self._tables):  # dropped while we were not watching
            self._forget_table(name)
        self._revision = result.revision
        self._sweep_orphan_files()
        self._synced = True
        for part in self._parts.values():
            part.cleanup_rev = -1  # step (3) looks again after a full read
            self._kick(part.group)
        self._watch(result.revision + 1)

    def _watch(self, from_revision: int) -> None:
        self._on_loop(self.meta.watch(b"", from_revision, self.watch_timeout),
                      lambda f: self._on_watch(f, from_revision))

    def _watch_failed(self, exc: BaseException, again: Callable[[], None]) -> None:
        if isinstance(exc, NodeStopped):
            return
        bo = self._backoffs["watch"]
        bo.ready("watch", self.node.clock())
        delay = bo.failed(exc, self.node.clock())
        self.metrics["errors.watch"] += 1
        if delay is None:  # never give up on the metastore: keep polling at the cap
            bo.succeeded()
            delay = self.retry.cap
        self._timer.after(delay, lambda: self._defer(again))

    def _on_watch(self, f: Future[Any], from_revision: int) -> None:
        exc = f.exception()
        if isinstance(exc, HistoryCompacted):
            self._resync()
            return
        if exc is not None:
            self._watch_failed(exc, lambda: self._watch(from_revision))
            return
        batch: EventBatch = f.result()
        self._backoffs["watch"].succeeded()
        for ev in batch.events:
            self._apply_event(ev.revision, ev.key, ev.value)
        self._revision = max(self._revision, batch.next_revision - 1)
        self._watch(max(batch.next_revision, from_revision))

    def _apply_event(self, revision: int, key: bytes, value: bytes | None) -> None:
        if not tracked(key):
            return
        if value is None:
            self._kv.pop(key, None)
        else:
            old = self._kv.get(key)
            created = old.create_revision if old else revision
            self._kv[key] = VersionedValue(value, revision, created)
        if key.startswith(TABLES_PREFIX):
            if value is not None:
                self._learn_table(key, value)
            else:
                self._forget_table(key[len(TABLES_PREFIX):].decode(errors="replace"))
        elif key.startswith(HOLDS_PREFIX):
            # The restart path reads a partition's holds keys, and so does the lone
            # holder's survivor check (``_survivor_case``: its own holds key and the lost
            # member's). A holder whose own holds key reached the cache after its group
            # started was never looked at again (placement simulator seed 1739). Only the
            # partition the key names reads it: a restart writes one per partition, and a
            # look at every partition for each cost O(partitions^2) (a tenth of the loop
            # thread's time in a 256-partition restart).
            gid = holds_group(key)
            part = self._parts.get(gid) if gid is not None else None
            if part is not None and (part.start.restarting or self._may_survive(part.group)):
                self._kick(part.group)
        elif key.startswith(INCARNATION_PREFIX):
            # Every partition's restart and survivor rules read the nodes' incarnations.
            for gid, part in self._parts.items():
                if part.start.restarting or self._may_survive(gid):
                    self._kick(gid)
        elif key in (TOPOLOGY_KEY, DEAD_KEY):
            for gid in self._parts:
                self._kick(gid)
        elif not key.startswith(ADDRESS_PREFIX):
            pk = parse_partition_key(key)
            if pk is not None:
                self._kick(partition_group(pk.table, pk.partition))

    def _may_survive(self, gid: str) -> bool:
        """We host ``gid``, do not lead it, and its configuration has two voters: the
        lone holder's survivor rule (``SafeRestart._maybe_survive``) may apply."""
        g = self.node.groups.get(gid) if gid in self._hosted else None
        return (g is not None and g.raft.role != Role.LEADER
                and len(g.raft.conf.voters) == 2)

    def _learn_table(self, key: bytes, raw: bytes) -> None:
        try:
            desc = TableDescriptor.decode(raw)
        except ValueError as e:
            log.warning("node %s: ignoring %r: %s", self.id, key, e)
            return
        dkv = self._kv.get(key)
        gen = dkv.create_revision if dkv is not None else 0
        if any(p.table == desc.name and p.gen != gen for p in self._parts.values()):
            self._forget_table(desc.name)  # dropped and re-created while we did not watch
        self._tables[desc.name] = desc
        # Created before this incarnation registered: we may have held (and lost) its state.
        preexisting = dkv is not None and dkv.create_revision < self._incarnation_rev
        for p in range(desc.partitions):
            gid = partition_group(desc.name, p)
            if gid not in self._parts:
                self._parts[gid] = PartitionState(desc.name, p, gid, partition_keys(desc.name, p),
                                              sw=steps.switch_keys(desc.name, p),
                                              preexisting=preexisting, gen=gen)
            self._kick(gid)

    # ============================================= loop thread: dropping a table ========
    def _forget_table(self, name: str) -> None:
        """The table's descriptor is gone: stop its partitions, delete their files, and
        forget them (a table re-created under this name is a new one)."""
        self._tables.pop(name, None)
        for part in [p for p in self._parts.values() if p.table == name]:
            self._parts.pop(part.group, None)
            self._routes.pop(part.group, None)
            self._dirty.discard(part.group)
            self._abort_change(part, TableDropped(f"table {name} was dropped"))
            if part.group in self._hosted:
                self._hosted.discard(part.group)
                self.node.remove_group(part.group)  # its pending requests fail: NodeStopped
                self.metrics["partitions_dropped"] += 1
            self._delete_files(part.group)
        log.info("node %s: table %s dropped", self.id, name)

