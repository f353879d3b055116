"""Custom replicated state machines (raftkv.statemachine) on the real storage path.

The harness is a single-node Raft group: a real ``Raft`` core, ``GroupStorage`` over a
``MemoryLogStore`` and a ``UserStateStore``, driven by the Ready loop
(persist -> apply -> advance). The object's ``propose`` appends through the core and
resolves each Future with the apply result of its index. Tests are named after the rule they
check (the module docstrings of raftkv/statemachine.py and raftkv/node/user_state.py).
"""

from __future__ import annotations

import enum
import os
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import pytest
from raftkv.recovery.compaction import compact
from raftkv.storage.errors import IndexMismatch, StorageError
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.state_store import MemoryStateStore

from raftkv.core import Config, Message, MessageType, Raft, Role, Snapshot, SnapshotMeta, bootstrap
from raftkv.examples.counter import Counter
from raftkv.node.group_storage import (
    ALREADY_APPLIED,
    GroupStorage,
    pack_image,
    unpack_image,
)
from raftkv.node.user_state import CHECKPOINT_FILE, PIECE_BYTES, UserStateStore, piece_key
from raftkv.statemachine import (
    MalformedCommand,
    NotAttachedError,
    ReplicatedObject,
    StateMachine,
    UnknownMethod,
    decode_value,
    encode_call,
    replicated,
)


class Registry(ReplicatedObject):
    """State of several kinds: a dict with tuple keys, a blob, and a failing method."""

    def __init__(self) -> None:
        self.items: dict[Any, Any] = {}
        self.blob = b""
        self._local_note = "not replicated"

    @replicated
    def put(self, key: Any, value: Any) -> Any:
        old = self.items.get(key)
        self.items[key] = value
        return old

    @replicated
    def set_blob(self, blob: bytes) -> int:
        self.blob = blob
        return len(blob)

    @replicated
    def put_twice(self, key: Any, value: Any) -> list[Any]:
        # Nested replicated calls run directly: this apply is already replicated.
        return [self.put(key, value), self.put(key, value)]

    @replicated
    def fail(self, message: str) -> None:
        self.items["before-fail"] = True
        raise KeyError(message)


class Group:
    """One node, one group: the Ready loop of raftkv/testing/node.py's StoreSimNode."""

    def __init__(self, obj: ReplicatedObject, path: Path | None = None,
                 log: MemoryLogStore | None = None, **store_kw: Any) -> None:
        self.obj = obj
        self.log = log if log is not None else MemoryLogStore()
        bootstrap(self.log, ["n1"])
        self.store = UserStateStore(obj, path, **store_kw)
        self.gs = GroupStorage(self.log, self.store)
        self.gs.recover()
        config = Config(id="n1", applied=self.store.applied_index())
        self.raft = Raft(config, self.log, random.Random(1))
        self.pending: dict[int, tuple[int, Future[Any]]] = {}
        self.results: dict[int, object] = {}  # every apply result, by index
        self.raft.campaign()
        self.pump()
        assert self.raft.role == Role.LEADER
        obj._attach(self.propose)

    def propose(self, data: bytes) -> Future[Any]:
        fut: Future[Any] = Future()
        index = self.raft.propose(data)
        self.pending[index] = (self.raft.term, fut)
        self.pump()
        return fut

    def pump(self) -> None:
        while self.raft.has_ready():
            rd = self.raft.ready()
            self.gs.persist(rd)
            assert not rd.messages  # a single voter talks to no one
            results = self.gs.apply(rd.committed_entries)
            for e, r in zip(rd.committed_entries, results, strict=True):
                self.results[e.index] = r
                term, fut = self.pending.pop(e.index, (None, None))
                if fut is None:
                    continue
                if e.term != term:
                    fut.set_exception(RuntimeError(f"entry {e.index} was overwritten"))
                elif r is ALREADY_APPLIED:
                    fut.set_exception(RuntimeError(f"entry {e.index}: result unknown"))
                else:
                    fut.set_result(r)
            self.raft.advance(rd)


# -- the decorator path ----------------------------------------------------------------------
def test_sync_call_returns_the_result_computed_at_apply() -> None:
    c = Counter()
    g = Group(c)
    assert c.incr(5) == 5
    assert c.incr() == 6
    assert c.get() == 6
    assert c.set(10) is None
    assert c.incr(n=2) == 12
    assert g.store.applied_index() == g.log.last_index()


def test_async_call_returns_a_future_and_callback_gets_result_and_error() -> None:
    c = Counter()
    Group(c)
    fut = c.incr(3, sync=False)
    assert isinstance(fut, Future)
    assert fut.result(0) == 3
    seen: list[tuple[Any, Any]] = []
    ret = c.incr(1, callback=lambda r, e: seen.append((r, e)))
    assert isinstance(ret, Future)  # a callback makes the call asynchronous
    _until(lambda: len(seen) == 1)  # callbacks run on a thread of their own
    assert seen == [(4, None)]
    r = Registry()
    Group(r)
    r.fail("boom", callback=lambda res, err: seen.append((res, err)))
    _until(lambda: len(seen) == 2)
    assert seen[-1][0] is None and isinstance(seen[-1][1], KeyError)


def _until(pred: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.005)


def test_call_does_not_run_locally_only_through_the_log() -> None:
    c = Counter()
    proposed: list[bytes] = []

    def propose(data: bytes) -> Future[Any]:
        proposed.append(data)
        return Future()  # never applied

    c._attach(propose)
    fut = c.incr(7, sync=False)
    assert c.get() == 0 and not fut.done()
    assert msgpack.unpackb(proposed[0], raw=False) == ["incr", [7], {}]


def test_sync_call_blocks_until_a_driver_thread_applies() -> None:
    c = Counter()
    g = Group(c)
    inbox: queue.Queue[tuple[bytes, Future[Any]] | None] = queue.Queue()

    def driver() -> None:  # the node's thread: it alone touches the core and the stores
        while (item := inbox.get()) is not None:
            data, fut = item
            fut.set_result(g.propose(data).result(0))  # applied by the time it returns

    def propose(data: bytes) -> Future[Any]:
        fut: Future[Any] = Future()
        inbox.put((data, fut))
        return fut

    c._detach()
    c._attach(propose)
    t = threading.Thread(target=driver)
    t.start()
    try:
        results = [c.incr(2, timeout=10) for _ in range(5)]
    finally:
        inbox.put(None)
        t.join()
    assert results == [2, 4, 6, 8, 10]


def test_timeout_raises_timeout_error_and_the_command_may_still_apply() -> None:
    c = Counter()
    c._attach(lambda data: Future())
    with pytest.raises(TimeoutError, match="not applied within 0.01s"):
        c.incr(1, timeout=0.01)


def test_method_exception_is_raised_at_the_caller_and_is_the_same_on_every_replica() -> None:
    r = Registry()
    g = Group(r)
    with pytest.raises(KeyError, match="boom"):
        r.fail("boom")
    assert r.items == {"before-fail": True}  # the method's effects stay, as on every replica
    copy = Registry()
    copy_store = UserStateStore(copy)
    results = copy_store.apply(g.log.payloads(1, g.log.last_index() + 1))
    assert isinstance(results[-1], KeyError) and copy.items == r.items


def test_non_msgpack_argument_is_a_type_error_before_anything_is_proposed() -> None:
    class Color(enum.IntEnum):
        RED = 1

    r = Registry()
    g = Group(r)
    last = g.log.last_index()
    for bad in [object(), Color.RED, 1j, OrderedDict(), "\ud800"]:
        with pytest.raises(TypeError, match="msgpack-serialisable"):
            r.put("k", bad)
    with pytest.raises(TypeError, match="arrive as a plain int"):
        r.put("k", Color.RED)
    with pytest.raises(TypeError, match=r"put\(\)"):
        r.put("k")  # a missing argument would fail on every replica: refuse it now
    assert g.log.last_index() == last and r.items == {}


def test_arguments_keep_their_types_tuples_included() -> None:
    r = Registry()
    Group(r)
    value = {"t": (1, (b"x", None)), "l": [1.5, True], 3: "int key"}
    r.put((1, 2), value)
    assert r.items == {(1, 2): value}
    assert type(next(iter(r.items))) is tuple and type(r.items[(1, 2)]["t"]) is tuple


def test_nested_replicated_call_runs_directly_during_apply() -> None:
    r = Registry()
    g = Group(r)
    last = g.log.last_index()
    assert r.put_twice("k", 1) == [None, 1]
    assert g.log.last_index() == last + 1  # one entry, not three


def test_unattached_object_refuses_replicated_calls() -> None:
    with pytest.raises(NotAttachedError, match="no node hosts"):
        Counter().incr()


def test_reserved_and_clashing_names_are_refused_at_definition() -> None:
    with pytest.raises(TypeError, match="reserved"):
        replicated(lambda self, sync: None)  # type: ignore[misc]

    def f(self: Any, timeout: float) -> None: ...

    with pytest.raises(TypeError, match="reserved"):
        replicated(f)
    with pytest.raises(TypeError, match="ReplicatedObject's own"):

        class Bad(ReplicatedObject):
            @replicated
            def restore(self, data: bytes) -> None: ...

    with pytest.raises(TypeError, match="plain methods"):
        replicated(staticmethod(f))  # type: ignore[arg-type]


def test_counter_is_a_state_machine() -> None:
    assert isinstance(Counter(), StateMachine)


# -- apply -----------------------------------------------------------------------------------
def test_unknown_method_or_malformed_command_in_the_log_is_an_exception_result() -> None:
    r = Registry()
    g = Group(r)
    bad = [
        encode_call("nope", (), {}),
        encode_call("snapshot", (), {}),  # a real method, but not a replicated one
        encode_call("_attach", (None,), {}),
        b"\xc1",  # never valid msgpack
        msgpack.packb({"not": "a command"}),
        msgpack.packb(["put", "not a list", {}]),
        msgpack.packb(["put", [], {1: 2}]),
        msgpack.packb(["put", [msgpack.ExtType(9, b"")], {}]),
        msgpack.packb(["put", ["k"], {"sync": True}]),  # a reserved kwarg reaching the method
    ]
    futures = [g.propose(data) for data in bad]
    results = [f.result(0) for f in futures]
    assert [type(x) for x in results] == [
        UnknownMethod, UnknownMethod, UnknownMethod, MalformedCommand, MalformedCommand,
        MalformedCommand, MalformedCommand, MalformedCommand, TypeError,
    ]
    assert r.items == {} and g.store.applied_index() == g.log.last_index()
    assert r.put("k", 1) is None  # the replica carries on


def test_results_equal_on_a_restored_copy() -> None:
    r = Registry()
    g = Group(r)
    r.put("a", 1)
    r.put(("t", 1), [1, 2])
    mid = g.log.last_index()
    copy = Registry()
    copy_store = UserStateStore(copy)
    copy_store.install_snapshot(g.store.snapshot_chunks())
    assert copy_store.applied_index() == mid
    r.put("a", 2)
    r.put_twice(("t", 1), None)
    try:
        r.fail("x")
    except KeyError:
        pass
    later = g.log.payloads(mid + 1, g.log.last_index() + 1)
    mine = [g.results[i] for i, _ in later]
    theirs = copy_store.apply(later)
    assert [repr(x) for x in theirs] == [repr(x) for x in mine]
    assert copy.items == r.items and copy._local_note == "not replicated"
    assert copy_store.digest() == g.store.digest()


def test_entry_failure_of_a_hand_written_state_machine_is_its_result() -> None:
    class Fragile:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def apply(self, index: int, command: bytes) -> object:
            if command == b"bad":
                raise ValueError("bad command")
            self.seen.append(index)
            return index

        def snapshot(self) -> bytes:
            return msgpack.packb(self.seen)

        def restore(self, data: bytes) -> None:
            self.seen = msgpack.unpackb(data)

    s = UserStateStore(Fragile())
    results = s.apply([(1, b"x"), (2, b""), (3, b"bad"), (4, b"y")])
    assert results[:2] == [1, None] and isinstance(results[2], ValueError)
    assert results[3] == 4 and s.applied_index() == 4


def test_apply_keeps_the_index_rules_of_every_store() -> None:
    s = UserStateStore(Counter())
    s.apply([(1, b""), (2, encode_call("incr", (1,), {}))])
    with pytest.raises(StorageError, match="already applied"):
        s.apply([(2, b"")])
    with pytest.raises(StorageError, match="gap"):
        s.apply([(4, b"")])
    with pytest.raises(StorageError, match="contiguous"):
        s.apply([(3, b""), (5, b"")])
    assert s.applied_index() == 2 and s.sm.get() == 1  # type: ignore[attr-defined]
    s.install_snapshot(UserStateStore(Counter(9)).snapshot_chunks())  # at index 0
    t = UserStateStore(Counter())
    t.apply([(1, b""), (2, b""), (3, encode_call("set", (4,), {}))])
    s.install_snapshot(t.snapshot_chunks())
    with pytest.raises(IndexMismatch):
        s.apply([(3, b"")])
    assert s.checkpoint_index() == s.applied_index() == 3


# -- durability ------------------------------------------------------------------------------
def test_checkpoint_then_reopen_restores_state_and_applied_index(tmp_path: Path) -> None:
    c = Counter()
    g = Group(c, tmp_path)
    c.incr(5)
    c.incr(6)
    at = g.store.checkpoint()
    assert at == g.store.applied_index() == g.store.checkpoint_index() == g.log.last_index()
    assert (tmp_path / CHECKPOINT_FILE).exists()
    c.incr(100)  # after the checkpoint: only in the log
    g.store.close()

    reopened = Counter()
    s = UserStateStore(reopened, tmp_path)
    assert s.applied_index() == s.checkpoint_index() == at
    assert reopened.get() == 11
    s.close()

    # A restart on the same log: replay brings back what followed the checkpoint.
    again = Counter()
    g2 = Group(again, tmp_path, log=g.log)
    assert again.get() == 111 and g2.store.checkpoint_index() == at
    assert again.incr() == 112


def test_maybe_checkpoint_follows_the_policy(tmp_path: Path) -> None:
    c = Counter()
    g = Group(c, tmp_path, checkpoint_entries=3, checkpoint_seconds=5.0)
    base = g.store.checkpoint()  # the bootstrap entry and the leader's no-op
    c.incr()
    assert not g.store.maybe_checkpoint(0.0)
    assert g.store.maybe_checkpoint(5.0)  # the time bound
    assert g.store.checkpoint_index() == base + 1
    for _ in range(3):
        c.incr()
    assert g.store.maybe_checkpoint(5.0)  # the entries bound
    assert g.store.checkpoints == 3


@pytest.mark.parametrize(
    "damage",
    ["flip_payload", "flip_header", "truncate", "extend", "magic", "short"],
)
def test_corrupt_checkpoint_file_is_a_storage_error_and_restores_nothing(
    tmp_path: Path, damage: str
) -> None:
    c = Counter()
    g = Group(c, tmp_path)
    c.incr(42)
    g.store.checkpoint()
    g.store.close()
    file = tmp_path / CHECKPOINT_FILE
    raw = bytearray(file.read_bytes())
    if damage == "flip_payload":
        raw[-1] ^= 0x01
    elif damage == "flip_header":
        raw[12] ^= 0x01  # inside the applied index
    elif damage == "truncate":
        del raw[-1]
    elif damage == "extend":
        raw += b"\0"
    elif damage == "magic":
        raw[0:8] = b"NOTMINE!"
    else:
        del raw[20:]
    file.write_bytes(bytes(raw))
    fresh = Counter()
    with pytest.raises(StorageError, match=CHECKPOINT_FILE):
        UserStateStore(fresh, tmp_path)
    assert fresh.get() == 0


def test_checkpoint_that_restore_rejects_is_a_storage_error(tmp_path: Path) -> None:
    c = Counter()
    g = Group(c, tmp_path)
    c.incr()
    g.store.checkpoint()

    class Strict(ReplicatedObject):
        def restore(self, data: bytes) -> None:
            raise ValueError("never")

    with pytest.raises(StorageError, match="could not restore its checkpoint.*never"):
        UserStateStore(Strict(), tmp_path)


def test_stale_temporary_checkpoint_is_ignored(tmp_path: Path) -> None:
    c = Counter()
    g = Group(c, tmp_path)
    c.incr(3)
    g.store.checkpoint()
    (tmp_path / (CHECKPOINT_FILE + ".tmp")).write_bytes(b"half a checkpoint")
    s = UserStateStore(Counter(), tmp_path)
    assert s.sm.get() == 3  # type: ignore[attr-defined]
    assert not (tmp_path / (CHECKPOINT_FILE + ".tmp")).exists()


def test_in_memory_store_never_advances_its_checkpoint_index() -> None:
    c = Counter()
    g = Group(c)
    for _ in range(5):
        c.incr()
    assert g.store.checkpoint() == 0 and not g.store.maybe_checkpoint(1e9)
    assert g.store.checkpoint_index() == 0
    # So compaction keeps the whole log, and a restart can replay all of it.
    compact(g.log, g.store, g.raft.conf_at)
    assert g.log.first_index() == 1
    again = Counter()
    Group(again, log=g.log)
    assert again.get() == 5


# -- snapshots -------------------------------------------------------------------------------
def test_snapshot_chunks_install_round_trip_over_one_mib(tmp_path: Path) -> None:
    r = Registry()
    g = Group(r)
    blob = os.urandom(2 * PIECE_BYTES + 12345)
    assert r.set_blob(blob) == len(blob)
    r.put(("k", 1), {"v": (1, 2)})
    chunks = list(g.store.snapshot_chunks())
    assert len(chunks) >= 5  # header, >= 3 pieces, trailer
    rows = list(g.store.scan())
    assert [k for k, _ in rows] == [piece_key(n) for n in range(len(rows))]
    assert all(len(v) <= PIECE_BYTES for _, v in rows)

    fresh = Registry()
    target = UserStateStore(fresh, tmp_path)
    assert target.install_snapshot(chunks) == g.store.applied_index()
    assert fresh.blob == blob and fresh.items == r.items
    assert target.applied_index() == target.checkpoint_index() == g.store.applied_index()
    assert target.digest() == g.store.digest()
    target.close()
    # The install is durable: it is the checkpoint.
    reopened = Registry()
    s = UserStateStore(reopened, tmp_path)
    assert reopened.blob == blob and s.applied_index() == g.store.applied_index()


def test_image_passes_group_storage_validation() -> None:
    c = Counter()
    g = Group(c)
    c.incr(9)
    image = pack_image(g.store)
    msg = Message(MessageType.SNAPSHOT, to="n2", frm="n1", term=g.raft.term,
                  snapshot=Snapshot(SnapshotMeta(index=g.store.applied_index()), image))
    assert g.gs.accept(msg)
    fresh = Counter()
    UserStateStore(fresh).install_snapshot(unpack_image(image))
    assert fresh.get() == 9


def test_bad_image_installs_nothing_and_keeps_the_old_state() -> None:
    c = Counter()
    g = Group(c)
    c.incr(9)
    good = list(g.store.snapshot_chunks())
    target_obj = Counter(5)
    target = UserStateStore(target_obj)
    target.apply([(1, encode_call("incr", (1,), {}))])
    bad_cases = [
        good[:-1],  # no trailer
        good[:1] + [msgpack.packb([[b"sm/000000000000", b"\xc1"]])] + good[2:],  # digest
    ]
    for bad in bad_cases:
        with pytest.raises(StorageError):
            target.install_snapshot(bad)
    kv = MemoryStateStore()
    kv.apply([(1, msgpack.packb([1, b"key", b"value"], use_bin_type=True))])
    with pytest.raises(StorageError, match="cannot install this snapshot: it holds KV rows"):
        target.install_snapshot(kv.snapshot_chunks())
    assert target_obj.get() == 6 and target.applied_index() == 1


class CheckedCounter(Counter):
    def restore(self, data: bytes) -> None:
        state = decode_value(data)
        assert isinstance(state, list)
        version, attrs = state
        if version != 2 or "_Counter__counter" not in attrs:
            raise ValueError("not a counter")
        super().restore(data)


def test_image_the_state_machine_rejects_is_rolled_back() -> None:
    r = Registry()
    g = Group(r)
    r.put("k", "v")
    obj = CheckedCounter(5)
    target = UserStateStore(obj)
    target.apply([(1, encode_call("incr", (1,), {}))])
    with pytest.raises(StorageError, match="could not restore a snapshot.*not a counter"):
        target.install_snapshot(g.store.snapshot_chunks())
    assert obj.get() == 6 and target.applied_index() == 1 and target.checkpoint_index() == 0


def test_closed_store_refuses_calls() -> None:
    s = UserStateStore(Counter())
    s.close()
    s.close()
    for call in (s.applied_index, s.checkpoint, lambda: s.apply([(1, b"")]),
                 lambda: s.get(b"sm/000000000000"), s.snapshot_chunks):
        with pytest.raises(StorageError, match="closed"):
            call()


def test_default_snapshot_refuses_state_that_is_not_plain_data() -> None:
    c = Counter()
    c._Counter__counter = lambda: 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"Counter\._Counter__counter"):
        c.snapshot()
    s = UserStateStore(c)
    with pytest.raises(StorageError, match="snapshot\\(\\) failed"):
        list(s.snapshot_chunks())
