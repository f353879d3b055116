"""``ManagerBase``: the state every part of a node's placement manager shares, and the
plumbing that runs its work on the node's loop thread (deferred calls, coalesced
reconciles, retries with back-off, recorded errors).

``PlacementManager`` (``raftkv.placement.rebalance``) is assembled from one class per
concern, each in its own module and each a ``ManagerBase``:

- ``metastore_view.MetastoreView``: the cache of the placement keys and the watch;
- ``partition_files.PartitionFiles``: a partition's files on disk;
- ``safe_restart.SafeRestart``: IGNITE-16668's restart path and the survivor rule;
- ``change_peers.ChangePeers``: the leader's change in progress (step 2 of Ignite's rebalance
  design);
- ``rebalance.PlacementManager``: the admin calls, reconcile (steps 1 and 3), starting
  and stopping partition groups, status.

Everything but the admin calls and queries runs on the loop thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from raftkv.core import Raft
from raftkv.node.driver import Node
from raftkv.placement.assignments import (
    decode_nodes,
)
from raftkv.placement.catalog import (
    TableDescriptor,
    parse_partition_key,
    table_key,
)
from raftkv.placement.key_cache import KeyCache
from raftkv.placement.meta_commands import (
    Cond,
    Do,
    If,
    InvokeResult,
    VersionedValue,
)
from raftkv.placement.partition_state import PartitionState
from raftkv.placement.retry import Backoff, RetryPolicy, TickTimer
from raftkv.placement.service import MetaService
from raftkv.storage.errors import (
    CheckpointDeferred,
    Rebuildable,
    SnapshotUnavailable,
    StorageError,
)
from raftkv.storage.lmdb_log import LogEnv

if TYPE_CHECKING:
    from raftkv.placement.liveness import ClusterSettings

log = logging.getLogger(__name__)

PLACEMENT_PREFIX = b"placement."
ADMIN_ATTEMPTS = 5
# Partitions one drain may open (its files, replay, its Raft core: a few ms each). A
# node restarted with hundreds would otherwise hold its loop for a second or more: no
# ticks, no frames, so its peers take it for dead and its first partitions, open long
# since, cannot elect. The rest are reconciled again on the next loop turn.
START_BUDGET = 16
DROPPED = 0xD0D  # the tag of an invoke that found its table gone (``_if_table``)
GEN_FILE = "table.gen"  # in groups/<gid>/: the descriptor's create revision (generation)
# How often a persistent partition's state store checkpoints (CheckpointPolicy). Each
# checkpoint is an fsync of that partition's own file: at the one second the default
# group uses, a node with 256 partitions under write load ran 256 of them a second,
# and table writes were about a tenth slower for it (steady state, 2 cores). Ten
# seconds bounds what a crash replays from a partition's log to ten seconds of its
# writes (Ignite checkpoints every three minutes by default).
PARTITION_CHECKPOINT_SECONDS = 10.0
EMPTY = VersionedValue(b"", 0, 0)  # what a missing key reads as


class ManagerBase:
    """Shared state (set by ``PlacementManager.__init__``) and loop-thread plumbing."""

    meta: MetaService
    node: Node
    id: str
    data_dir: str | None
    durable: bool
    checkpoint_seconds: float
    retry: RetryPolicy
    watch_timeout: float
    admin_timeout: float
    metrics: Counter[str]
    errors: list[dict[str, Any]]
    incarnation: bytes
    _logs: LogEnv | None
    _timer: TickTimer
    _kv: KeyCache
    _tables: dict[str, TableDescriptor]
    _parts: dict[str, PartitionState]
    _hosted: set[str]
    _releasing: set[bytes]  # our holds keys being deleted (PlacementManager._release_holds)
    _routes: dict[str, Any]
    _dirty: set[str]
    _move_waiters: set[str]  # partitions waiting for a move slot (ChangePeers._move_slot)
    _drain_queued: bool
    _start_budget: int  # partitions this drain may still open (START_BUDGET)
    _start_queue: list[Callable[[], None]]  # starts waiting for a drain's budget
    _revision: int
    _synced: bool
    _stopped: bool
    _loop_thread: threading.Thread | None
    _backoffs: dict[str, Backoff]
    _incarnation_rev: int

    # What one concern calls of another (see the module docstring); each is implemented
    # once, by the class named, and PlacementManager inherits that one.
    def _reconcile_group(self, gid: str) -> None:  # rebalance.PlacementManager
        raise NotImplementedError

    def _start_partition(self, part: PartitionState, desc: TableDescriptor,
                         voters: list[str] | None) -> None:  # rebalance.PlacementManager
        raise NotImplementedError

    def _sweep_holds(self) -> None:  # rebalance.PlacementManager
        raise NotImplementedError

    def _abort_change(self, part: PartitionState, err: Exception) -> None:  # ChangePeers
        raise NotImplementedError

    def _delete_files(self, gid: str) -> None:  # PartitionFiles
        raise NotImplementedError

    def _sweep_orphan_files(self) -> None:  # PartitionFiles
        raise NotImplementedError

    def _clear_stale_files(self, part: PartitionState) -> None:  # PartitionFiles
        raise NotImplementedError

    def _holds(self, part: PartitionState, node: str,
               kv: dict[bytes, VersionedValue] | None = None) -> bool:  # SafeRestart
        raise NotImplementedError

    def _settings(self) -> ClusterSettings:  # Liveness
        raise NotImplementedError

    # ================================================= loop thread: plumbing ============
    def _not_on_loop(self) -> None:
        # The thread itself, not its ident: a loop thread that died (its node failed)
        # leaves an ident the next thread may be given, and an admin call on a pool
        # thread was refused as if it ran on the loop (found from outside: a 500).
        if self._loop_thread is not None and threading.current_thread() is self._loop_thread:
            raise RuntimeError("a blocking PlacementManager call on the node's loop thread")

    def _defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread in a call of its own: never inside the driver's
        iteration over its groups (hooks), so it may add and remove groups."""
        self.node.call(lambda: self._guard(fn))

    def _guard(self, fn: Callable[[], None]) -> None:
        if self._stopped:
            return
        try:
            fn()
        except Exception as e:  # a bug must not go unseen, nor kill the loop
            log.exception("node %s: placement manager error", self.id)
            self.metrics["internal_errors"] += 1
            self._record("-", "internal", e, 0)

    def _on_loop(self, fut: Future[Any], fn: Callable[[Future[Any]], None]) -> None:
        fut.add_done_callback(lambda f: self._defer(lambda: fn(f)))

    def _kick(self, group: str) -> None:
        """Reconcile ``group`` soon (coalesced; safe from hooks)."""
        self._dirty.add(group)
        if not self._drain_queued:
            self._drain_queued = True
            self._defer(self._drain)

    def _queue_start(self, start: Callable[[], None]) -> None:
        """Run ``start`` in the next drain, before its reconciles, on that drain's
        START_BUDGET: a start past this drain's budget whose holds key is written. Kicked
        instead, its reconcile wrote the key again, since the cache learns our own
        writes only from the watch, which lags: a node restarting with 256 partitions
        wrote 750-860 holds keys, and each batch of 16 starts waited on the metastore."""
        self._start_queue.append(start)
        if not self._drain_queued:
            self._drain_queued = True
            self._defer(self._drain)

    def _past_budget(self, part: PartitionState, written: Future[Any]) -> bool:
        """A start whose holds key write ``written`` succeeded would open ``part`` now,
        but this drain's START_BUDGET is spent (``_queue_start``)."""
        if self._start_budget > 0 or part.group in self._hosted or not self._current(part):
            return False
        if written.exception() is not None:
            return False
        result = written.result()  # None: the key was already ours (no write)
        return not isinstance(result, InvokeResult) or result.succeeded

    def _drain(self) -> None:
        self._drain_queued = False
        dirty, self._dirty = self._dirty, set()
        self._start_budget = START_BUDGET
        starts, self._start_queue = self._start_queue, []
        for start in starts:
            self._guard(start)
        for gid in sorted(dirty):
            self._guard(partial(self._reconcile_group, gid))

    def _wait(self, part: PartitionState) -> None:
        """Reconcile ``part`` again in an election timeout: a condition it waits for
        (a peer back, a metastore key moved) is not always announced by a watch event."""
        if part.wait_scheduled:
            return
        part.wait_scheduled = True

        def again() -> None:
            part.wait_scheduled = False
            self._kick(part.group)

        self._timer.after(max(0.1, self.node.cfg.election_tick * self.node.cfg.tick_seconds),
                          again)

    def _backoff(self, part: PartitionState, kind: str) -> Backoff:
        bo = part.backoffs.get(kind)
        if bo is None:
            bo = part.backoffs[kind] = Backoff(self.retry)
        return bo

    def _failed(self, part: PartitionState, kind: str, exc: BaseException) -> None:
        """onReconfigurationError: back off and retry, or record exhaustion."""
        bo = self._backoff(part, kind)
        delay = bo.failed(exc, self.node.clock())
        self.metrics[f"errors.{kind}"] += 1
        if delay is None:
            self.metrics["retries_exhausted"] += 1
            self._record(part.group, kind, exc, bo.failures)
            log.error("node %s: %s of %s failed %d times, giving up until the leader or the "
                      "target changes: %s", self.id, kind, part.group, bo.failures, exc)
        else:
            self.metrics["retries"] += 1
            # A damaged store does not heal by retrying: say so where an operator looks
            # (found from outside: a truncated partition store showed only at INFO).
            # Other failures are usually transient: the first is a warning, the rest info.
            damaged = isinstance(exc, StorageError) and not isinstance(
                exc, Rebuildable | CheckpointDeferred | SnapshotUnavailable)
            level = logging.WARNING if bo.failures == 1 or damaged else logging.INFO
            log.log(level, "node %s: %s of %s failed (%s); retry in %.2fs",
                    self.id, kind, part.group, exc, delay)
            self._timer.after(delay, lambda: self._kick(part.group))

    def _record(self, group: str, kind: str, exc: BaseException, attempts: int) -> None:
        self.errors.append({"partition": group, "kind": kind, "attempts": attempts,
                            "error": f"{type(exc).__name__}: {exc}", "at": time.time()})
        del self.errors[:-100]

    def _current(self, part: PartitionState) -> bool:
        """``part`` is still the manager's partition (its table was not dropped since)."""
        return self._parts.get(part.group) is part

    def _if_table(self, part: PartitionState, tree: If | Do) -> If:
        """Run ``tree`` only while the table exists (else tag ``DROPPED``): a node that
        has not seen a drop yet must not write the dropped table's keys back."""
        return If(Cond.exists(table_key(part.table)), tree, Do(DROPPED))

    def _nodes(self, key: bytes) -> list[str]:
        v = self._kv.get(key)
        return decode_nodes(v.value) if v is not None else []


def tracked(key: bytes) -> bool:
    return key.startswith(PLACEMENT_PREFIX) or parse_partition_key(key) is not None


def fail(fut: Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def conf_settled(raft: Raft) -> bool:
    """Whether the leader may propose a membership change now: no transfer under way,
    the last configuration committed, and an entry of its own term committed (the
    known fix for single-server changes)."""
    log_ = raft.log
    return (raft.lead_transferee is None and raft.confs[-1][0] <= log_.committed
            and log_.term_or_zero(log_.committed) == raft.term)
