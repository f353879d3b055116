"""raftkv.compat.pysyncobj: PySyncObj programs, with only their imports changed, on
embedded raftkv nodes over real TCP on 127.0.0.1.

The programs below are written as PySyncObj's README and examples write them: a
``SyncObj`` subclass keeping its state in ``self.__counter``, consumers, callbacks taking
``(result, FAIL_REASON)``, ``addNodeToCluster``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from raftkv.compat.pysyncobj import (
    _RAFT_STATE,
    FAIL_REASON,
    SyncObj,
    SyncObjConf,
    SyncObjConsumer,
    SyncObjException,
    TCPNode,
    replicated,
    replicated_sync,
)
from raftkv.compat.pysyncobj.batteries import (
    ReplCounter,
    ReplDict,
    ReplList,
    ReplLockManager,
    ReplPriorityQueue,
    ReplQueue,
    ReplSet,
)
from raftkv.compat.pysyncobj.syncobj import _engine
from raftkv.testing.procs import free_ports

PASSWORD = "compat-test"


# -- the programs ------------------------------------------------------------------------------
class MyCounter(SyncObj):  # PySyncObj's README counter; only the constructor's arguments vary
    def __init__(self, selfAddr: str, partners: list[str], conf: SyncObjConf | None = None):
        super(MyCounter, self).__init__(selfAddr, partners, conf)  # noqa: UP008
        self.__counter = 0

    @replicated
    def incCounter(self) -> int:
        self.__counter += 1
        return self.__counter

    @replicated
    def addValue(self, value: int, cn: int) -> tuple[int, int]:
        self.__counter += value
        return self.__counter, cn

    def getCounter(self) -> int:
        return self.__counter


# -- helpers -------------------------------------------------------------------------------------
def addresses(n: int) -> list[str]:
    return [f"127.0.0.1:{p}" for p in free_ports(n)]


def others(addrs: list[str], me: str) -> list[str]:
    return [a for a in addrs if a != me]


def wait_until(pred: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.02)


class Collect:
    """A callback that records ``(result, error)`` and the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, int]] = []
        self.threads: list[str] = []
        self.done = threading.Event()

    def __call__(self, result: Any, error: int) -> None:
        self.calls.append((result, error))
        self.threads.append(threading.current_thread().name)
        self.done.set()

    def wait(self, timeout: float = 15.0) -> tuple[Any, int]:
        assert self.done.wait(timeout), "the callback was not called"
        return self.calls[0]


@pytest.fixture
def destroy_later() -> Iterator[list[Any]]:
    objs: list[Any] = []
    yield objs
    for o in reversed(objs):
        try:
            o.destroy()
        except Exception:
            logging.getLogger(__name__).exception("destroying %r failed", o)


def conf(tmp_path: Path | None = None, name: str = "", **kw: Any) -> SyncObjConf:
    if tmp_path is not None:
        kw.setdefault("journalFile", str(tmp_path / f"{name}.journal"))
    kw.setdefault("password", PASSWORD)
    return SyncObjConf(**kw)


def raft_group(obj: SyncObj) -> dict[str, Any]:
    engine = _engine(obj)
    assert engine is not None and engine.embedded is not None
    return engine.embedded.status()["groups"]["default"]


# -- the README counter -------------------------------------------------------------------------
@pytest.mark.parametrize("through", ["replay", "checkpoint"])
def test_readme_counter_keeps_its_value_when_all_three_nodes_restart(
        tmp_path: Path, destroy_later: list[Any], through: str) -> None:
    """The README counter keeps ``self.__counter``, a name-mangled attribute set after
    ``super().__init__()``. After increments and a restart of every node its value is
    the same, rebuilt by replaying the log, or from a checkpoint (logCompactionMinEntries
    small enough to checkpoint)."""
    addrs = addresses(3)
    extra = {"logCompactionMinEntries": 2} if through == "checkpoint" else {}

    def start() -> list[MyCounter]:
        objs = [MyCounter(a, others(addrs, a), conf(tmp_path, f"n{i}", **extra))
                for i, a in enumerate(addrs)]
        destroy_later.extend(objs)
        return objs

    nodes = start()
    assert nodes[0].incCounter(sync=True, timeout=15) == 1
    for i in range(4):
        nodes[i % 3].incCounter(sync=True, timeout=15)
    assert nodes[2].addValue(10, 7, sync=True, timeout=15) == (15, 7)  # a tuple comes back
    wait_until(lambda: [n.getCounter() for n in nodes] == [15] * 3, what="all replicas at 15")
    if through == "checkpoint":
        wait_until(lambda: all(raft_group(n)["checkpoint"] >= 7 for n in nodes),
                   what="every replica checkpointed")
    for n in nodes:
        n.destroy()

    nodes = start()
    # Restored before any leader is elected: from the checkpoint, or replayed.
    assert [n.getCounter() for n in nodes] == [15, 15, 15]
    if through == "checkpoint":
        assert all(raft_group(n)["recovery"] for n in nodes)
    assert nodes[1].incCounter(sync=True, timeout=15) == 16
    wait_until(lambda: [n.getCounter() for n in nodes] == [16] * 3, what="all replicas at 16")


def test_calls_are_asynchronous_by_default_and_callbacks_get_fail_reason_success(
        destroy_later: list[Any]) -> None:
    addrs = addresses(3)
    nodes = [MyCounter(a, others(addrs, a), conf()) for a in addrs]
    destroy_later.extend(nodes)
    # A leader every node knows first: a call made during the founders' election can be
    # forwarded to a leader that loses its term before appending it, and fail with
    # UNKNOWN_OUTCOME (1 failure in a fresh-clone run), as PySyncObj's fails with
    # LEADER_CHANGED.
    wait_until(lambda: len({str(n._getLeader()) for n in nodes}) == 1
               and nodes[0]._getLeader() is not None, what="a leader every node knows")
    assert nodes[0].incCounter(sync=True, timeout=15) == 1
    assert nodes[1].incCounter() is None  # fire and forget: returns at once
    got = Collect()
    nodes[2].addValue(10, 3, callback=partial(lambda res, err, cnt: got(res, err), cnt=3))
    result, error = got.wait()
    assert error == FAIL_REASON.SUCCESS
    assert result in {(11, 3), (12, 3)}  # after the first increment, maybe after the second
    assert got.threads[0].startswith("syncobj-tick"), "callbacks run on the tick thread"
    wait_until(lambda: {n.getCounter() for n in nodes} == {12}, what="all replicas at 12")


def test_no_leader_gives_missing_leader_to_callbacks_and_sync_calls(
        destroy_later: list[Any]) -> None:
    """One node of three, alone: it never has a leader."""
    addrs = addresses(3)
    alone = MyCounter(addrs[0], addrs[1:], conf(commandsWaitLeader=False))
    destroy_later.append(alone)
    got = Collect()
    alone.incCounter(callback=got)
    assert got.wait() == (None, FAIL_REASON.MISSING_LEADER)
    with pytest.raises(SyncObjException) as e:
        alone.incCounter(sync=True)
    assert e.value.errorCode == FAIL_REASON.MISSING_LEADER
    lonely = addresses(3)  # another cluster of three, one node of which runs
    waiting = MyCounter(lonely[0], lonely[1:], conf())  # commandsWaitLeader=True
    destroy_later.append(waiting)
    t0 = time.monotonic()
    with pytest.raises(SyncObjException) as e:
        waiting.incCounter(sync=True, timeout=1.0)
    assert e.value.errorCode == "Timeout"
    assert 0.9 < time.monotonic() - t0 < 5
    assert alone.getCounter() == waiting.getCounter() == 0


def test_a_command_waiting_for_a_leader_gives_up_at_its_timeout(
        destroy_later: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """With commandsWaitLeader, the node parks a command until its request deadline and
    the layer proposes it again until the call's own timeout; then the callback hears
    MISSING_LEADER."""
    from raftkv.compat.pysyncobj import syncobj

    monkeypatch.setattr(syncobj, "REQUEST_TIMEOUT", 0.4)
    addrs = addresses(3)
    waiting = MyCounter(addrs[0], addrs[1:], conf())
    destroy_later.append(waiting)
    got = Collect()
    t0 = time.monotonic()
    waiting.incCounter(callback=got, timeout=1.0)
    assert got.wait() == (None, FAIL_REASON.MISSING_LEADER)
    assert 1.0 <= time.monotonic() - t0 < 5, "given up before the call's timeout"


class Strict(SyncObj):
    def __init__(self, selfAddr: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(selfAddr, partners, conf)
        self.__items: list[Any] = []
        self.__calls = 0

    @replicated
    def take(self, item: Any) -> int:
        self.__calls += 1
        if item == "bad":
            raise ValueError("no bad items")
        self.__items.append(item)
        return len(self.__items)

    @replicated
    def take_twice(self, item: Any) -> int:
        self.take(item)  # nested: applied once per replica, not proposed again
        return self.take(item)

    def state(self) -> tuple[list[Any], int]:
        return list(self.__items), self.__calls


def test_a_method_that_raises_is_applied_everywhere_and_reaches_its_caller(
        destroy_later: list[Any]) -> None:
    addrs = addresses(3)
    nodes = [Strict(a, others(addrs, a), conf()) for a in addrs]
    destroy_later.extend(nodes)
    assert nodes[0].take(("a", 1), sync=True, timeout=15) == 1
    with pytest.raises(ValueError, match="no bad items"):
        nodes[1].take("bad", sync=True, timeout=15)
    got = Collect()
    nodes[2].take("bad", callback=got)
    result, error = got.wait()
    assert isinstance(result, ValueError) and error == FAIL_REASON.REQUEST_DENIED
    assert nodes[2].take_twice("b", sync=True, timeout=15) == 3
    wait_until(lambda: all(n.state() == ([("a", 1), "b", "b"], 5) for n in nodes),
               what="the same state everywhere")


def test_arguments_that_are_not_plain_data_are_refused_before_proposing(
        destroy_later: list[Any]) -> None:
    addrs = addresses(1)
    node = Strict(addrs[0], [], conf())
    destroy_later.append(node)
    assert node.take({1: {"x"}, "t": (1, 2), "d": deque([1], 3), "big": 1 << 70},
                     sync=True, timeout=15) == 1
    applied = raft_group(node)["last_index"]
    with pytest.raises(TypeError, match="arguments of take"):
        node.take(object(), sync=True)
    with pytest.raises(TypeError, match="arguments of take"):
        node.take(threading.Lock())
    with pytest.raises(TypeError, match="take"):
        node.take(1, 2, sync=True)  # does not fit the signature
    # Found from outside: a callback that cannot be called was accepted (a traceback was
    # logged once the call applied), and a timeout that is not a number raised a bare
    # TypeError from inside the wait, after proposing.
    with pytest.raises(TypeError, match="take\\(\\): callback must be callable"):
        node.take(1, callback=5)
    with pytest.raises(TypeError, match="take\\(\\): timeout must be a number"):
        node.take(1, sync=True, timeout="x")
    time.sleep(0.2)
    assert raft_group(node)["last_index"] == applied, "something was proposed"
    assert node.state()[1] == 1


def test_a_snapshot_that_cannot_be_encoded_fails_loudly_and_keeps_the_log(
        tmp_path: Path, destroy_later: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    class Holder(SyncObj):
        def __init__(self, addr: str, conf: SyncObjConf) -> None:
            self.config = {"set before": "super().__init__(): configuration"}
            super().__init__(addr, [], conf)
            self.__n = 0
            self.lock = threading.Lock()  # state by PySyncObj's rule, and not plain data

        @replicated
        def inc(self) -> int:
            self.__n += 1
            return self.__n

    node = Holder(addresses(1)[0], conf(tmp_path, "h", logCompactionMinEntries=2))
    destroy_later.append(node)
    with caplog.at_level(logging.ERROR):
        for _ in range(5):
            node.inc(sync=True, timeout=15)
        wait_until(lambda: any("Holder.lock" in r.getMessage() for r in caplog.records),
                   what="a logged checkpoint failure naming the attribute")
    g = raft_group(node)
    assert g["checkpoint"] == 0 and g["first_index"] == 1, "the log must be kept"


def test_force_log_compaction_of_a_state_that_cannot_be_encoded_is_logged(
        tmp_path: Path, destroy_later: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """The migration guide's check: ``forceLogCompaction()`` returns at once, as
    PySyncObj's does, and its failure names the attribute in the log (it was silent)."""
    class Holder(SyncObj):
        def __init__(self, addr: str, conf: SyncObjConf) -> None:
            super().__init__(addr, [], conf)
            self.__n = 0

        @replicated
        def spoil(self) -> None:
            self.__n += 1
            self.__bad = object()

    node = Holder(addresses(1)[0], conf(tmp_path, "f", logCompactionMinEntries=10 ** 9))
    destroy_later.append(node)
    node.spoil(sync=True, timeout=15)
    with caplog.at_level(logging.ERROR):
        assert node.forceLogCompaction() is None
        wait_until(lambda: any("forceLogCompaction" in r.getMessage()
                               and "Holder._Holder__bad" in r.getMessage()
                               for r in caplog.records),
                   what="a logged forceLogCompaction failure naming the attribute")
    assert raft_group(node)["checkpoint"] == 0, "nothing may be written"


def test_log_compaction_options_compact_the_log_and_force_log_compaction_does_now(
        tmp_path: Path, destroy_later: list[Any]) -> None:
    """Found from outside: ``logCompactionMinEntries`` checkpointed the state machine but
    the log was compacted only at raftkv's own 100,000 entries, and
    ``forceLogCompaction()`` only checkpointed. As in PySyncObj, the log now holds about
    ``logCompactionMinEntries`` entries at most (raftkv keeps half of them for a follower
    a little behind), and ``forceLogCompaction()`` compacts at once."""
    counter = ReplCounter()
    addr = addresses(1)[0]
    node = SyncObj(addr, [], conf(tmp_path, "lc", logCompactionMinEntries=100,
                                            logCompactionMinTime=1), consumers=[counter])
    destroy_later.append(node)
    for _ in range(599):
        counter.inc()
    assert counter.inc(sync=True, timeout=15) == 600
    # The policy is looked at once a second.
    wait_until(lambda: node.getStatus()["log_len"] <= 150, timeout=10,
               what="the log compacted to about logCompactionMinEntries")
    for _ in range(79):
        counter.inc()
    assert counter.inc(sync=True, timeout=15) == 680
    assert node.forceLogCompaction() is None
    wait_until(lambda: node.getStatus()["log_len"] <= 51, timeout=5,
               what="forceLogCompaction compacting to the 50 entries kept")
    node.destroy()
    again = ReplCounter()
    node = SyncObj(addr, [], conf(tmp_path, "lc", logCompactionMinEntries=100,
                                            logCompactionMinTime=1), consumers=[again])
    destroy_later.append(node)
    wait_until(lambda: again.get() == 680, what="the counter back after a restart")


# -- consumers: ReplDict and ReplLockManager ------------------------------------------------------
def lock_table(lm: ReplLockManager) -> dict[Any, Any]:
    return dict(lm._consumer()._ReplLockManagerImpl__locks)  # type: ignore[attr-defined]


def test_repldict_and_lock_manager_as_consumers_with_deterministic_auto_unlock(
        destroy_later: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ReplDict + ReplLockManager app. The lock of a client whose node
    crashed expires autoUnlockTime after its last prolongation, by the times carried in
    the log entries: the threads that apply entries see a clock a million seconds
    ahead, and nothing changes."""
    real_time = time.time

    def skewed() -> float:
        ahead = threading.current_thread().name.startswith("raftkv-")
        return real_time() + (1e6 if ahead else 0.0)

    monkeypatch.setattr(time, "time", skewed)
    unlock = 1.5
    addrs = addresses(3)
    dicts = [ReplDict() for _ in addrs]
    locks = [ReplLockManager(autoUnlockTime=unlock, selfID=f"client{i}")
             for i in range(len(addrs))]
    nodes = [SyncObj(a, others(addrs, a), conf(), consumers=[dicts[i], locks[i]])
             for i, a in enumerate(addrs)]
    destroy_later.extend(locks)
    destroy_later.extend(nodes)
    dicts[0].set("testKey1", "testValue1", sync=True, timeout=15)
    dicts[1]["testKey2"] = "testValue2"  # asynchronous
    wait_until(lambda: all(d.get("testKey2") == "testValue2" for d in dicts))
    assert dicts[2]["testKey1"] == "testValue1" and len(dicts[2]) == 2

    assert locks[0].tryAcquire("job", sync=True, timeout=15) is True
    assert locks[1].tryAcquire("job", sync=True, timeout=15) is False
    assert locks[0].isAcquired("job") and not locks[1].isAcquired("job")
    time.sleep(unlock * 1.5)  # client0 prolongs its lock meanwhile
    assert locks[1].tryAcquire("job", sync=True, timeout=15) is False
    locks[0].release("job", sync=True, timeout=15)
    assert locks[1].tryAcquire("job", sync=True, timeout=15) is True
    locks[1].release("job", sync=True, timeout=15)

    # client0 takes the lock again, then its node crashes: nobody prolongs it any more.
    assert locks[0].tryAcquire("job", sync=True, timeout=15) is True
    # A sync call returns once the caller's node applied it; node 1 may lag (it did, on
    # a loaded machine, and the lookup below raised KeyError).
    wait_until(lambda: "job" in lock_table(locks[1]))
    nodes[0].destroy()
    crashed_at = real_time()
    held_until = lock_table(locks[1])["job"][1] + unlock
    tries = 0
    while not locks[2].tryAcquire("job", sync=True, timeout=15):
        tries += 1
        time.sleep(0.05)
    got_at = real_time()
    assert tries > 0, "the crashed client's lock was taken at once"
    assert got_at >= held_until - 0.05, "taken before autoUnlockTime had passed"
    assert got_at - crashed_at < unlock + 3
    # Every live replica holds the same table, at the same log index.
    wait_until(lambda: nodes[1].raftLastApplied == nodes[2].raftLastApplied
               and lock_table(locks[1]) == lock_table(locks[2]), what="equal lock tables")
    assert lock_table(locks[1])["job"][0] == "client2"


# -- membership -------------------------------------------------------------------------------
def test_add_a_fourth_node_then_remove_it(tmp_path: Path, destroy_later: list[Any]) -> None:
    """PySyncObj's dynamic membership: start the new node with the existing ones as
    partners, add it from any node; it catches up as a learner, is promoted to a voter,
    and is removed again."""
    addrs = addresses(4)
    founders = addrs[:3]

    def node(i: int, partners: list[str]) -> tuple[SyncObj, ReplCounter]:
        c = ReplCounter()
        so = SyncObj(addrs[i], partners, conf(tmp_path, f"n{i}", dynamicMembershipChange=True),
                     consumers=[c])
        destroy_later.append(so)
        return so, c

    nodes = [node(i, others(founders, a)) for i, a in enumerate(founders)]
    for _ in range(30):
        nodes[0][1].inc()  # asynchronous: they wait for the first leader
    wait_until(lambda: all(c.get() == 30 for _, c in nodes), what="30 increments applied")
    assert nodes[1][1].inc(sync=True, timeout=15) == 31
    _fourth, counter4 = node(3, founders)
    follower = next(n for n, _ in nodes if not n._isLeader())
    added = Collect()
    follower.addNodeToCluster(addrs[3], callback=added)
    assert added.wait() == (None, FAIL_REASON.SUCCESS)
    wait_until(lambda: counter4.get() == 31, what="the new node caught up")
    wait_until(lambda: raft_group(nodes[0][0])["members"].get(addrs[3]) == "voter",
               what="the new node promoted")
    assert nodes[0][0].getStatus()["partner_nodes_count"] == 3
    assert counter4.inc(sync=True, timeout=15) == 32  # the new node proposes too

    removed = Collect()
    nodes[2][0].removeNodeFromCluster(addrs[3], callback=removed)
    assert removed.wait() == (None, FAIL_REASON.SUCCESS)
    wait_until(lambda: all(addrs[3] not in raft_group(n)["members"] for n, _ in nodes))
    assert {str(n) for n in nodes[0][0].otherNodes} == set(founders[1:])
    nodes[0][1].inc(sync=True, timeout=15)
    time.sleep(0.5)
    assert counter4.get() == 32, "a removed node still receives the log"
    with pytest.raises(Exception, match="dynamicMembershipChange is disabled"):
        SyncObj(addresses(1)[0], [], conf()).addNodeToCluster(addrs[3])


def test_a_read_only_node_follows_without_voting(destroy_later: list[Any]) -> None:
    addrs = addresses(3)
    dicts = [ReplDict() for _ in addrs]
    nodes = [SyncObj(a, others(addrs, a), conf(), consumers=[dicts[i]])
             for i, a in enumerate(addrs)]
    destroy_later.extend(nodes)
    dicts[0].set("k", "v", sync=True, timeout=15)
    ro_dict = ReplDict()
    ro = SyncObj(None, addrs, conf(), consumers=[ro_dict])
    destroy_later.append(ro)
    wait_until(lambda: ro_dict.get("k") == "v", what="the read-only node caught up")
    assert ro.selfNode is None and ro.getStatus()["self"] is None
    lead = next(n for n in nodes if n._isLeader())
    wait_until(lambda: lead.getStatus()["readonly_nodes_count"] == 1)
    members = raft_group(lead)["members"]
    assert sorted(k for k, v in members.items() if v == "voter") == sorted(addrs)
    ro_dict.set("from", "ro", sync=True, timeout=15)  # it may write, through the leader
    wait_until(lambda: all(d.get("from") == "ro" for d in dicts))


def test_a_read_only_node_that_joined_by_snapshot_follows_a_member_added_before_it(
        tmp_path: Path, destroy_later: list[Any]) -> None:
    """Found from outside: n4 was added, the log compacted, then a read-only node joined
    (by snapshot, so it never saw n4's addition) with the founders as its partners. When
    n4 came to lead, nothing connected them: a read-only node's address is unknown to
    the leader, and it dialed only its partners. It stayed behind for good, its reads
    stale without a word. It now dials every member of its configuration."""
    addrs = addresses(4)
    founders = addrs[:3]
    counters = [ReplCounter() for _ in addrs]

    def node(i: int, partners: list[str]) -> SyncObj:
        so = SyncObj(addrs[i], partners,
                     conf(tmp_path, f"n{i}", dynamicMembershipChange=True,
                          logCompactionMinEntries=50),
                     consumers=[counters[i]])
        destroy_later.append(so)
        return so

    nodes = [node(i, others(founders, a)) for i, a in enumerate(founders)]
    counters[0].inc(sync=True, timeout=15)
    nodes.append(node(3, founders))
    added = Collect()
    nodes[0].addNodeToCluster(addrs[3], callback=added)
    assert added.wait() == (None, FAIL_REASON.SUCCESS)
    for _ in range(120):
        counters[1].inc(sync=True, timeout=15)
    wait_until(lambda: all(raft_group(n)["first_index"] > 20 for n in nodes),
               what="every log compacted")
    ro_counter = ReplCounter()
    ro = SyncObj(None, founders, conf(), consumers=[ro_counter])
    destroy_later.append(ro)
    wait_until(lambda: ro_counter.get() == 121, what="the read-only node caught up")
    lead = next(n for n in nodes if n._isLeader())
    if lead is not nodes[3]:
        lead.transferLeadership(addrs[3])
        wait_until(lambda: nodes[3]._isLeader(), what="n4 leading")
    for _ in range(10):
        counters[3].inc(sync=True, timeout=15)
    wait_until(lambda: ro_counter.get() == 131, timeout=20,
               what="the read-only node following n4")


def test_a_battery_used_after_its_node_was_destroyed_is_denied_as_the_node_is(
        destroy_later: list[Any]) -> None:
    """Found from outside: the SyncObj's own replicated methods answered REQUEST_DENIED
    after destroy(), as documented, but a battery said it was "not attached to a
    SyncObj"."""
    counter = ReplCounter()
    node = SyncObj(addresses(1)[0], [], conf(), consumers=[counter])
    destroy_later.append(node)
    assert counter.inc(sync=True, timeout=15) == 1
    node.destroy()
    with pytest.raises(SyncObjException) as e:
        counter.inc(sync=True, timeout=5)
    assert e.value.errorCode == FAIL_REASON.REQUEST_DENIED


# -- the rest of the API -------------------------------------------------------------------------
def test_status_keys_and_state_callbacks(destroy_later: list[Any]) -> None:
    addrs = addresses(3)
    ready = [threading.Event() for _ in addrs]
    changes: list[list[tuple[int, int]]] = [[] for _ in addrs]
    nodes = [MyCounter(a, others(addrs, a),
                       conf(onReady=ready[i].set,
                            onStateChanged=lambda o, n, i=i: changes[i].append((o, n))))
             for i, a in enumerate(addrs)]
    destroy_later.extend(nodes)
    nodes[0].incCounter(sync=True, timeout=15)
    for e in ready:
        assert e.wait(15), "onReady was not called"
    assert all(n.isReady() for n in nodes)
    lead = next(n for n in nodes if n._isLeader())
    i = nodes.index(lead)
    assert changes[i][-1][1] == _RAFT_STATE.LEADER
    st = lead.getStatus()
    for key in ("version", "revision", "self", "state", "leader", "has_quorum",
                "partner_nodes_count", "readonly_nodes_count", "log_len", "last_applied",
                "commit_idx", "raft_term", "next_node_idx_count", "match_idx_count",
                "leader_commit_idx", "uptime", "self_code_version", "enabled_code_version"):
        assert key in st, key
    assert st["state"] == _RAFT_STATE.LEADER and st["leader"] == lead.selfNode
    assert st["partner_nodes_count"] == 2 and st["next_node_idx_count"] == 2
    for a in others(addrs, str(lead.selfNode)):
        assert st[f"partner_node_status_server_{a}"] == 2
        assert st[f"match_idx_server_{a}"] >= 1
    assert st["commit_idx"] == st["last_applied"] >= 2 and st["raft_term"] >= 2
    assert lead.hasQuorum and lead._getLeader() == lead.selfNode
    follower = nodes[(i + 1) % 3]
    assert not follower._isLeader() and str(follower._getLeader()) == str(lead.selfNode)
    follower.waitReady()
    follower.waitBinded()
    lead.printStatus()
    lead.destroy()
    wait_until(lambda: follower._getLeader() not in (None, lead.selfNode),
               what="a new leader")


def test_auto_tick_off_runs_callbacks_inside_do_tick(destroy_later: list[Any]) -> None:
    addrs = addresses(1)
    node = MyCounter(addrs[0], [], conf(autoTick=False))
    destroy_later.append(node)
    waiter = threading.Thread(target=node.waitBinded, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "waitBinded() hung with autoTick=False"
    got = Collect()
    assert node.incCounter(sync=True, timeout=15) == 1  # the node runs without doTick
    node.incCounter(callback=got)
    time.sleep(0.3)
    assert not got.done.is_set(), "a callback ran outside doTick"
    deadline = time.monotonic() + 10
    while not got.done.is_set() and time.monotonic() < deadline:
        node.doTick(0.05)
    assert got.calls == [(2, FAIL_REASON.SUCCESS)]
    assert got.threads == [threading.current_thread().name]
    ticking = MyCounter(addresses(1)[0], [], conf())
    destroy_later.append(ticking)
    with pytest.raises(RuntimeError):
        ticking.doTick()


class Versioned(SyncObj):
    def __init__(self, addr: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(addr, partners, conf)
        self.log: list[str] = []

    @replicated
    def act(self, x: int) -> str:
        self.log.append(f"v0:{x}")
        return "v0"

    @replicated(ver=1)
    def act(self, x: int) -> str:  # noqa: F811 - PySyncObj's code versioning
        self.log.append(f"v1:{x}")
        return "v1"

    @replicated_sync
    def act_sync(self, x: int) -> int:
        return x * 2


def test_code_versions_switch_for_the_whole_cluster(destroy_later: list[Any]) -> None:
    addrs = addresses(2)
    changed: list[tuple[int, int]] = []
    nodes = [Versioned(a, others(addrs, a),
                       conf(onCodeVersionChanged=lambda o, n: changed.append((o, n))))
             for a in addrs]
    destroy_later.extend(nodes)
    assert nodes[0].act(1, sync=True, timeout=15) == "v0"
    assert nodes[0].act_sync(21) == 42  # replicated_sync blocks by default
    assert nodes[1].getCodeVersion() == 0
    assert nodes[1].getStatus()["self_code_version"] == 1
    done = Collect()
    nodes[1].setCodeVersion(1, callback=done)
    assert done.wait() == (None, FAIL_REASON.SUCCESS)
    wait_until(lambda: all(n.getCodeVersion() == 1 for n in nodes))
    assert nodes[1].act(2, sync=True, timeout=15) == "v1"
    wait_until(lambda: all(n.log == ["v0:1", "v1:2"] for n in nodes))
    wait_until(lambda: (0, 1) in changed, what="onCodeVersionChanged")
    with pytest.raises(Exception, match="wrong version"):
        nodes[0].setCodeVersion(2)


def test_every_battery(destroy_later: list[Any]) -> None:
    counter, lst, dct, st = ReplCounter(), ReplList(), ReplDict(), ReplSet()
    q, pq = ReplQueue(maxsize=2), ReplPriorityQueue()
    node = SyncObj(addresses(1)[0], [], conf(), consumers=[counter, lst, dct, st, q, pq])
    destroy_later.append(node)
    s: dict[str, Any] = {"sync": True, "timeout": 15}
    assert counter.set(40, **s) == 40 and counter.add(5, **s) == 45
    assert counter.sub(3, **s) == 42 and counter.inc(**s) == 43 and counter.get() == 43
    lst.extend([3, 1, 2], **s)
    lst.append(0, **s)
    lst.insert(0, 9, **s)
    lst.sort(**s)
    assert lst.rawData() == [0, 1, 2, 3, 9] and lst.pop(**s) == 9 and lst.pop(0, **s) == 0
    lst.remove(2, **s)
    assert list(lst.rawData()) == [1, 3] and lst.index(3) == 1 and len(lst) == 2
    with pytest.raises(SyncObjException, match="setCodeVersion"):
        lst[0] = 5  # version 1 in PySyncObj too
    dct.update({"a": 1, (1, 2): frozenset({3})}, **s)
    assert dct.setdefault("a", 7, **s) == 1 and dct[(1, 2)] == frozenset({3})
    assert dct.pop("a", **s) == 1 and dct.pop("zz", "dflt", **s) == "dflt"
    assert list(dct.keys()) == [(1, 2)] and (1, 2) in dct
    st.update({"b", "a", "c"}, **s)
    assert st.pop(**s) == "a"  # deterministic: the smallest by encoded bytes
    st.discard("zz", **s)
    st.remove("b", **s)
    assert st.rawData() == {"c"} and "c" in st and len(st) == 1
    assert q.put((1, "x"), **s) and q.put([2], **s) and not q.put(3, **s) and q.full()
    assert q.get(**s) == (1, "x") and q.qsize() == 1 and q.get(**s) == [2]
    assert q.get("empty", **s) == "empty" and q.empty()
    for item in [(3, "c"), (1, "a"), (2, "b")]:
        pq.put(item, **s)
    assert [pq.get(**s) for _ in range(4)] == [(1, "a"), (2, "b"), (3, "c"), None]
    with pytest.raises(SyncObjException):
        ReplCounter().inc()  # not attached to a SyncObj


def test_options_are_mapped_warned_about_or_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, destroy_later: list[Any]) -> None:
    with pytest.raises(ValueError, match="serializer"):
        SyncObj(addresses(1)[0], [], SyncObjConf(serializer=print, deserializer=print))
    # Alone, it is refused for what it is, not for lacking its deserializer (found from
    # outside).
    with pytest.raises(ValueError, match="'serializer' is not supported"):
        SyncObj(addresses(1)[0], [], SyncObjConf(serializer=print))
    with pytest.raises(ValueError, match="raftMinTimeout must be a number, not str"):
        SyncObj(addresses(1)[0], [], SyncObjConf(raftMinTimeout="abc"))
    with pytest.raises(ValueError, match="logCompactionMinEntries must be finite"):
        SyncObj(addresses(1)[0], [], SyncObjConf(logCompactionMinEntries=float("inf")))
    with pytest.raises(ValueError, match="transport"):
        SyncObj(addresses(1)[0], [], conf(), transportClass=object)
    with caplog.at_level(logging.WARNING, logger="raftkv.compat.pysyncobj"):
        node = SyncObj(addresses(1)[0], [],
                       SyncObjConf(appendEntriesPeriod=0.05, tcp_keepalive=None,
                                   journalFile=str(tmp_path / "j"), noSuchOption=1))
        destroy_later.append(node)
    text = caplog.text
    assert "appendEntriesPeriod" in text and "tcp_keepalive" in text
    assert "noSuchOption" in text and "unauthenticated" in text
    assert "connectionTimeout" not in text, "a default value was warned about"
    assert os.path.isdir(tmp_path / "j.raftkv"), "journalFile maps to <journalFile>.raftkv/"
    assert not os.path.exists(tmp_path / "j")


class Tally(SyncObjConsumer):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    @replicated
    def see(self, what: str) -> int:
        self.seen.append(what)
        return len(self.seen)


def test_consumers_and_the_syncobj_share_one_log_and_one_snapshot(
        tmp_path: Path, destroy_later: list[Any]) -> None:
    addr = addresses(1)[0]
    a, b = Tally(), Tally()
    so = SyncObj(addr, [], conf(tmp_path, "both", logCompactionMinEntries=2), consumers=[a, b])
    destroy_later.append(so)
    assert a.see("x", sync=True, timeout=15) == 1
    assert b.see("y", sync=True, timeout=15) == 1 and b.see("z", sync=True, timeout=15) == 2
    wait_until(lambda: raft_group(so)["checkpoint"] >= 3, what="a checkpoint")
    so.destroy()
    a2, b2 = Tally(), Tally()
    so2 = SyncObj(addr, [], conf(tmp_path, "both", logCompactionMinEntries=2),
                  consumers=[a2, b2])
    destroy_later.append(so2)
    assert (a2.seen, b2.seen) == (["x"], ["y", "z"])
    so2.destroy()
    with pytest.raises(Exception, match="consumers"):
        SyncObj(addr, [], conf(tmp_path, "both", autoTick=False), consumers=[Tally()])


class Registry(SyncObj):
    """Announces itself from its constructor, a PySyncObj idiom (found from outside:
    such calls were dropped with MISSING_LEADER, for the node starts only when the
    constructor returns)."""

    def __init__(self, me: str, partners: list[str], seen: list[tuple[str, Any, int]]):
        super().__init__(me, partners, conf())
        self.members: list[str] = []
        self.announce(me, callback=lambda r, e: seen.append((me, r, e)))
        with pytest.raises(SyncObjException):  # a sync call could only wait for itself
            self.announce(me, sync=True, timeout=1)

    @replicated
    def announce(self, who: str) -> int:
        self.members.append(who)
        return len(self.members)


def test_an_asynchronous_call_made_in_the_constructor_waits_for_the_node_and_applies(
        destroy_later: list[Any]) -> None:
    """Each constructor's call is answered SUCCESS and applied everywhere. A call made
    during the founders' election may be forwarded to a leader that loses its term
    before appending it, and rightly fail UNKNOWN_OUTCOME (once in a fresh-clone run of
    the whole suite on two busy cores): such a birth is run again with new nodes, at
    most three times. A call lost without an answer, or any other failure, still fails."""
    for _ in range(3):
        addrs = addresses(3)
        seen: list[tuple[str, Any, int]] = []
        nodes = [Registry(a, others(addrs, a), seen) for a in addrs]
        destroy_later.extend(nodes)
        wait_until(lambda seen=seen: len(seen) == 3, what="three callbacks")
        if FAIL_REASON.UNKNOWN_OUTCOME in {e for _, _, e in seen}:
            continue
        assert {e for _, _, e in seen} == {FAIL_REASON.SUCCESS}, seen
        assert sorted(r for _, r, _ in seen) == [1, 2, 3]
        wait_until(lambda addrs=addrs, nodes=nodes: all(
            sorted(n.members) == sorted(addrs) for n in nodes), what="3 members")
        return
    pytest.fail("every birth had a call with an unknown outcome")


def _inventory(version: int) -> type[SyncObj]:
    class Inventory(SyncObj):
        def __init__(self, me: str, c: SyncObjConf) -> None:
            super().__init__(me, [], c)
            self.count = 0
            self.scratch: list[int] = []
            if version >= 2:
                self.history: list[int] = []  # new in version 2

        @replicated
        def add(self) -> int:
            self.count += 1
            if version >= 2:
                self.history.append(self.count)
            return self.count

        @replicated
        def note(self) -> None:
            self.extra = self.count  # set by a method: replicated state, not __init__'s

        @replicated
        def forget(self) -> None:
            del self.scratch

    return Inventory


def test_a_restore_starts_from_what_the_constructor_made_as_pysyncobj_keeps_new_attributes(
        tmp_path: Path) -> None:
    """Found from outside: a restart from a checkpoint deleted every attribute the
    checkpoint did not name, so an attribute a new version's ``__init__`` adds was gone
    and every call using it failed on every replica. PySyncObj sets the dump's
    attributes over what ``__init__`` made. Restored state is now the constructor's
    state, less what a method deleted since, with the snapshot over it: the new attribute
    keeps its initial value, and one a method deleted stays deleted (the snapshot names
    it), as on the replica that took the snapshot."""
    (port,) = free_ports(1)
    me = f"127.0.0.1:{port}"
    c = conf(tmp_path, "inv", logCompactionMinEntries=2)
    v1 = _inventory(1)(me, c)
    try:
        wait_until(v1._isLeader, what="a leader")
        for _ in range(3):
            v1.add(sync=True, timeout=10)  # type: ignore[attr-defined]
        v1.note(sync=True, timeout=10)  # type: ignore[attr-defined]
        v1.forget(sync=True, timeout=10)  # type: ignore[attr-defined]
        v1.forceLogCompaction()
        wait_until(lambda: raft_group(v1)["checkpoint"] >= 5, what="a checkpoint")
    finally:
        v1.destroy()
    v2 = _inventory(2)(me, c)
    try:
        state = vars(v2)
        assert (state["count"], state["history"], state["extra"]) == (3, [], 3)
        assert "scratch" not in state  # deleted by a method: not made again by __init__
        wait_until(v2._isLeader, what="a leader")
        assert v2.add(sync=True, timeout=10) == 4  # type: ignore[attr-defined]
        assert vars(v2)["history"] == [4]
    finally:
        v2.destroy()


def test_a_snapshot_of_the_first_format_still_restores(destroy_later: list[Any]) -> None:
    """Format 1 (before snapshots named the attributes deleted since the constructor) is
    the whole state, as it was restored when it was written: an attribute it does not
    name is deleted, even one the constructor makes (a method may have deleted it: to
    keep it would give this replica what the others no longer have; found in review)."""
    from raftkv.statemachine import encode_value

    (port,) = free_ports(1)
    inv = _inventory(2)(f"127.0.0.1:{port}", conf())
    destroy_later.append(inv)
    machine = _engine(inv).machine  # type: ignore[union-attr]
    machine.restore(encode_value([1, 0, 5, [{"count": 7}]]))
    assert vars(inv)["count"] == 7 and "history" not in vars(inv) and "scratch" not in vars(inv)
    assert machine.last_index == 5
    with pytest.raises(ValueError, match="not a raftkv.compat.pysyncobj snapshot"):
        machine.restore(encode_value([1, 0, 5, [{"count": 7}], [[]]]))  # 5 fields in format 1


def test_a_call_whose_leader_was_replaced_waits_for_its_entry_here(
        destroy_later: list[Any]) -> None:
    """Found from outside: with the leader SIGKILLed, a follower's calls forwarded to it
    were reported LEADER_CHANGED ("not committed", which a PySyncObj program retries)
    although they were committed and applied everywhere. An unknown outcome now waits
    for the entry to reach this replica, whose apply resolves the call; it is
    UNKNOWN_OUTCOME only if nothing comes in time."""
    from concurrent.futures import Future

    from raftkv.compat.pysyncobj.syncobj import _fail_reason, _Waiter
    from raftkv.node.errors import RequestTimeout

    replaced = RequestTimeout("leader n1 was replaced before answering; the outcome is unknown")
    assert _fail_reason(replaced) == FAIL_REASON.UNKNOWN_OUTCOME
    (port,) = free_ports(1)
    node = MyCounter(f"127.0.0.1:{port}", [], conf())
    destroy_later.append(node)
    engine = _engine(node)
    assert engine is not None
    for applied in (True, False):
        got = Collect()
        request = 424242 + applied
        with engine._lock:
            engine._waiters[request] = _Waiter(got, None)
            engine._inflight += 1
        failed: Future[Any] = Future()
        failed.set_exception(replaced)
        engine._proposed(b"", request, None, failed)
        assert not got.done.is_set() and engine._waiters[request].expires is not None
        if applied:  # what the apply of the entry, which names the request, does
            engine.resolve(request, 16, FAIL_REASON.SUCCESS)
        else:
            engine._waiters[request].expires = 0.0  # nothing came in time
        node._onTick(0.0)
        assert got.wait() == ((16, FAIL_REASON.SUCCESS) if applied
                              else (None, FAIL_REASON.UNKNOWN_OUTCOME))


def test_tcp_utility_status_names_nodes_as_tcp_nodes(destroy_later: list[Any]) -> None:
    """As PySyncObj's TcpUtility and as getStatus(): 'self' and 'leader' are TCPNode
    objects (found from outside: they were the address text, so
    ``status['leader'].address`` failed)."""
    from raftkv.compat.pysyncobj.utility import TcpUtility

    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    node = SyncObj(addr, [], conf())
    destroy_later.append(node)
    wait_until(node._isLeader, what="a leader")
    status = TcpUtility(PASSWORD, timeout=10).executeCommand(addr, ["status"])
    assert isinstance(status["leader"], TCPNode) and isinstance(status["self"], TCPNode)
    assert status["leader"].address == status["self"].address == addr
    assert status["leader"] == node.getStatus()["leader"]


def test_a_call_refused_not_leader_is_proposed_again_while_it_waits_for_a_leader(
        destroy_later: list[Any]) -> None:
    """NOT_LEADER and LEADER_CHANGED mean the entry was never applied (another leader's
    entry took its index, or it was dropped unproposed): with commandsWaitLeader the
    call proposes it again (seen under load: the first call of a new cluster failed
    NOT_LEADER as the first leader appeared). Without commandsWaitLeader the code
    reaches the caller, as in PySyncObj."""
    from concurrent.futures import Future

    from raftkv.compat.pysyncobj.syncobj import _Waiter
    from raftkv.core import NotLeader
    from raftkv.statemachine import encode_value

    for wait_leader in (True, False):
        (port,) = free_ports(1)
        node = MyCounter(f"127.0.0.1:{port}", [], conf(commandsWaitLeader=wait_leader))
        destroy_later.append(node)
        wait_until(node._isLeader, what="a leader")
        engine = _engine(node)
        assert engine is not None
        got = Collect()
        request = 777
        data = encode_value([0, 0, "incCounter_v0", [], {}, engine.id, request])
        with engine._lock:
            engine._waiters[request] = _Waiter(got, None)
            engine._inflight += 1
        refused: Future[Any] = Future()
        refused.set_exception(NotLeader(engine.id, "127.0.0.1:1"))
        engine._proposed(data, request, None, refused)
        if wait_leader:  # proposed again, applied, and the caller gets its result
            assert got.wait() == (1, FAIL_REASON.SUCCESS)
            assert node.getCounter() == 1
        else:
            assert got.wait() == (None, FAIL_REASON.NOT_LEADER)
            assert node.getCounter() == 0


def test_a_port_taken_after_the_bindable_probe_is_a_bind_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: the raft address is bound when the node is built, and an error
    there must stay the OSError PySyncObj's layer turns into BindError (a ValueError
    escaped the constructor and left the journal's directory claimed)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    addr = f"127.0.0.1:{taken.getsockname()[1]}"
    # Another process takes the port between _bindable's probe and the node's bind.
    from raftkv.compat.pysyncobj import syncobj as so

    monkeypatch.setattr(so, "_bindable", lambda a: True)
    conf = SyncObjConf(journalFile=str(tmp_path / "j"), maxBindRetries=1)
    try:
        o = SyncObj(addr, [], conf)  # PySyncObj: the constructor returns ...
        try:
            with pytest.raises(SyncObjException, match="BindError"):
                o.waitBinded()  # ... and waitBinded says BindError
        finally:
            o.destroy()
    finally:
        taken.close()
