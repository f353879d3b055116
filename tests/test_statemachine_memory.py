"""An in-memory replicated object's log is compacted (``UserStateStore(volatile=True)``).

A node without a data directory keeps its log in memory too, so nothing is replayed
after a restart and the state is its own checkpoint ("path=None" in
raftkv/node/user_state.py). Without this, the log of an in-memory ``ReplicatedNode`` or
compat ``SyncObj`` (PySyncObj's default: no journalFile) grew for as long as the process
ran. A checkpoint still needs a state that snapshots: otherwise the log is kept.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from raftkv.recovery.compaction import CompactionPolicy

from raftkv.core.errors import NotLeader
from raftkv.embedded import ReplicatedNode
from raftkv.examples.counter import Counter
from raftkv.node.user_state import SnapshotFailed, UserStateStore
from raftkv.statemachine import encode_call
from raftkv.testing.procs import free_ports

SECRET = b"memory-test"


def incr_entries(n: int) -> list[tuple[int, bytes]]:
    return [(i, encode_call("incr", (1,), {})) for i in range(1, n + 1)]


def test_a_volatile_store_checkpoints_without_a_file_once_its_state_snapshots() -> None:
    counter = Counter()
    store = UserStateStore(counter, volatile=True)
    store.apply(incr_entries(5))
    assert store.checkpoint() == 5 and store.checkpoint_index() == 5
    counter.__dict__["handle"] = object()  # not plain data: a snapshot must fail
    store.apply([(6, encode_call("incr", (1,), {}))])
    with pytest.raises(SnapshotFailed):
        store.checkpoint()
    assert store.checkpoint_index() == 5, "the log after the last good state is kept"
    with pytest.raises(ValueError):
        UserStateStore(Counter(), "somewhere", volatile=True)


def test_an_in_memory_group_compacts_its_log_and_a_new_node_catches_up_from_a_snapshot(
    tmp_path: Path,
) -> None:
    ports = free_ports(4)
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(ports[:3])}
    policy = CompactionPolicy(max_entries=40, keep=5)
    objs = {n: Counter() for n in peers}
    nodes = {n: ReplicatedNode(objs[n], n, a, peers, SECRET, compaction=policy)
             for n, a in peers.items()}
    try:
        lead = nodes["n1"].wait_for_leader()
        for _ in range(120):
            objs[lead].incr()
        deadline = time.monotonic() + 20
        while nodes[lead].status()["groups"]["default"]["first_index"] <= 1:
            assert time.monotonic() < deadline, "the in-memory log was never compacted"
            objs[lead].incr()
            time.sleep(0.1)
        value = objs[lead].get()
        newcomer = Counter()
        nodes["n4"] = ReplicatedNode(newcomer, "n4", f"127.0.0.1:{ports[3]}",
                                     {**peers, "n4": f"127.0.0.1:{ports[3]}"}, SECRET,
                                     join=True, compaction=policy)
        deadline = time.monotonic() + 20
        while True:  # the leader may have moved since (a busy machine): ask the current one
            lead = nodes["n1"].wait_for_leader()
            try:
                nodes[lead].add_learner("n4", f"127.0.0.1:{ports[3]}")
                break
            except NotLeader:
                assert time.monotonic() < deadline, "no leader took the learner"
                time.sleep(0.05)
        deadline = time.monotonic() + 20
        while newcomer.get() < value:  # from a snapshot: the log no longer starts at 1
            assert time.monotonic() < deadline, f"n4 has {newcomer.get()}, not {value}"
            time.sleep(0.05)
        assert newcomer.incr() == value + 1  # forwarded by a learner to the leader
    finally:
        for node in nodes.values():
            node.close()
