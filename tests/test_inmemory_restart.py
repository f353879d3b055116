"""IGNITE-16668: the safe restart of in-memory partitions (and of a persistent partition
whose storage was wiped), on in-process nodes over real TCP.

A restarted in-memory replica has lost its Raft log *and its vote*; it must not rejoin its
group as the voter it was. ``PlacementManager`` records it in
``<table>.<p>.assignments.switch.reduce`` instead of starting the group; the partition's
leader removes it (a rebalance to ``calc - switch.reduce``), and onRebalanceDone moves it to
``switch.append`` and re-adds it as a fresh learner. The node starts its group (empty, never
bootstrapped as a voter) only once stable no longer names it, i.e. after a configuration
without it applied.

The cluster helpers come from tests/test_rebalance.py (metastore on n1..n3, n4 a learner).
Tables here have one partition, so every key lives in group ``t.<table>.0``."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from raftkv.storage.commands import encode_put as kv_put
from raftkv.storage.layout import group_paths, partition_logs_path
from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
from test_rebalance import ALL, META, Cluster, wait_for

from raftkv.core import Role
from raftkv.node.driver import Node
from raftkv.node.errors import ReplicaEmpty, UnknownGroup
from raftkv.placement.assignments import (
    calc_assignments,
    decode_nodes,
    encode_nodes,
    partition_keys,
)
from raftkv.placement.catalog import holds_key, holds_prefix, incarnation_key, partition_group
from raftkv.placement.meta_commands import InvokeResult, Op, OpKind
from raftkv.placement.rebalance import PlacementManager
from raftkv.placement.rebalance_steps import switch_keys
from raftkv.placement.service import MetaService
from raftkv.testing.placement_cluster import VoterLog

T = "mem"
GID = partition_group(T, 0)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        for nid in META:
            c.start(nid)
        yield c
    finally:
        c.stop()


def _create(c: Cluster, storage: str) -> None:
    mgr = c.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(T, 1, 3, storage)
    wait_for(lambda: all(c.info(n, GID) is not None for n in META), 10, "the group on n1..n3")
    c.leader(GID)


def _put(c: Cluster, data: dict[bytes, bytes]) -> None:
    for k, v in data.items():
        def write(k: bytes = k, v: bytes = v) -> bool:
            c.nodes[c.leader(GID)].propose(GID, kv_put(k, v)).result(5)
            return True

        wait_for(write, 10, f"a write of {k!r}")


def _local(c: Cluster, nid: str, key: bytes) -> Any:
    return c.nodes[nid].read(GID, lambda s: s.get(key), False).result(5)


def _switch(c: Cluster) -> tuple[list[str], list[str]]:
    m = c.metas[c.live[0]]
    red, app = m.get_many(list(switch_keys(T, 0))).result(5)
    return decode_nodes(red.value if red else None), decode_nodes(app.value if app else None)


def _settled(c: Cluster, nodes: list[str]) -> bool | str:
    """stable == nodes, nothing pending/planned/switched, the leader's voters == nodes with
    no learner, every node hosts the group and all replicas are equal."""
    st, pe, pl = c.assignments(T, 0)
    sw = _switch(c)
    if (st, pe, pl, sw) != (nodes, [], [], ([], [])):
        return f"metastore {(st, pe, pl, sw)}"
    infos = {n: c.info(n, GID) for n in nodes}
    if any(i is None for i in infos.values()):
        return f"hosts {[n for n, i in infos.items() if i is not None]}"
    leaders = [i for i in infos.values() if i is not None and i["role"] == Role.LEADER]
    if len(leaders) != 1 or leaders[0]["voters"] != nodes or leaders[0]["learners"]:
        return f"leaders {leaders}"
    figures = {(i["applied"], i["digest"]) for i in infos.values() if i is not None}
    return True if len(figures) == 1 else f"replicas differ {figures}"


def _wait_settled(c: Cluster, nodes: list[str], timeout: float = 20.0) -> None:
    try:
        wait_for(lambda: _settled(c, nodes) is True, timeout, f"settled on {nodes}")
    except AssertionError as e:
        raise AssertionError(f"{e}: {_settled(c, nodes)}; "
                             f"{[m.status() for m in c.mgrs.values()]}") from None


def _record_starts(monkeypatch: pytest.MonkeyPatch, c: Cluster, victim: str,
                   ) -> list[dict[str, Any]]:
    """Every start of GID on ``victim``: the ``voters`` it was started with and, at that
    moment, the voters of the group's leader elsewhere (read from its core)."""
    starts: list[dict[str, Any]] = []
    orig = Node.add_group

    def add_group(self: Node, group_id: str, storage: Any, voters: list[str] | None,
                  **kwargs: Any) -> Any:
        if self.id == victim and group_id == GID:
            leaders = {}
            for nid, node in list(c.nodes.items()):
                g = node.groups.get(GID) if node is not self else None
                if g is not None and g.raft.role == Role.LEADER:
                    leaders[nid] = (sorted(g.raft.conf.voters), sorted(g.raft.conf.learners))
            g = orig(self, group_id, storage, voters, **kwargs)
            starts.append({"voters": voters, "leaders": leaders, "vote": g.raft.vote,
                           "own_voters": sorted(g.raft.conf.voters)})
            return g
        return orig(self, group_id, storage, voters, **kwargs)

    monkeypatch.setattr(Node, "add_group", add_group)
    return starts


def _metric(c: Cluster, name: str) -> int:
    return sum(m.status()["metrics"].get(name, 0) for m in c.mgrs.values())


def _check_rejoin(starts: list[dict[str, Any]], victim: str) -> None:
    assert len(starts) == 1, starts
    s = starts[0]
    assert s["voters"] is None  # joined empty: never bootstrapped as a voter
    assert s["vote"] is None and s["own_voters"] == []  # no vote, no configuration
    assert s["leaders"], "some leader existed when the restarted node started its group"
    for voters, _learners in s["leaders"].values():
        assert victim not in voters  # removed from the configuration before starting


def test_seed_example_restart_during_the_non_cancelable_phase(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stable=[A,B,C], pending=[A,B,C,D] with D already a voter (done not yet run); C (an
    in-memory replica) restarts. End: stable=[A,B,C,D], C removed then re-added fresh."""
    c = cluster
    A, B, C, D = "n1", "n2", "n3", "n4"
    _create(c, "memory")
    data = {f"k{i}".encode(): f"v{i}".encode() for i in range(10)}
    _put(c, data)
    c.start(D)
    c.transfer(GID, A)
    # Hold onRebalanceDone so [A,B,C] -> [A,B,C,D] stays in its non-cancelable phase.
    hold = {"done": True}
    orig_done = PlacementManager._on_new_peers_configuration_applied

    def held_done(self: PlacementManager, *a: Any, **k: Any) -> None:
        if not hold["done"]:
            orig_done(self, *a, **k)

    monkeypatch.setattr(PlacementManager, "_on_new_peers_configuration_applied", held_done)
    mgr = c.mgrs[A]
    mgr.set_replicas(T, 4)  # topology still [A,B,C]: nothing to do
    mgr.set_nodes(ALL)  # pending := [A,B,C,D]

    def d_is_voter() -> bool:
        i = c.info(c.leader(GID), GID)
        return i is not None and i["voters"] == ALL and not i["learners"]

    wait_for(d_is_voter, 10, "D promoted")
    assert c.assignments(T, 0)[:2] == ([A, B, C], ALL)

    voters = VoterLog(c, GID)
    starts = _record_starts(monkeypatch, c, C)
    c.kill(C)
    c.start(C)  # in memory: its log, state and vote are gone
    wait_for(lambda: _switch(c)[0] == [C], 10, "C in switch.reduce")
    time.sleep(0.3)
    assert c.info(C, GID) is None and not starts  # C did not start its Raft node
    assert c.assignments(T, 0)[:2] == ([A, B, C], ALL)

    hold["done"] = False
    lead = c.leader(GID)
    c.nodes[lead].call(lambda: c.mgrs[lead]._kick(GID)).result(5)
    _wait_settled(c, ALL)
    seen = voters.stop()
    # The leader's configuration went [A,B,C,D] -> [A,B,D] -> [A,B,C,D].
    i = seen.index(ALL)
    assert [A, B, D] in seen[i:], seen
    assert seen[-1] == ALL
    _check_rejoin(starts, C)
    for k, v in data.items():
        assert _local(c, C, k) == v  # C got everything back from the leader
    assert _metric(c, "switch_reduce") >= 1 and _metric(c, "switch_append") >= 1
    assert c.mgrs[C].status()["metrics"].get("partitions_rejoined") == 1


def test_one_in_memory_replica_restarts_with_a_majority_alive(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = cluster
    _create(c, "memory")
    data = {f"k{i}".encode(): f"v{i}".encode() for i in range(10)}
    _put(c, data)
    c.transfer(GID, "n1")
    voters = VoterLog(c, GID)
    starts = _record_starts(monkeypatch, c, "n3")
    c.kill("n3")
    for n in ("n1", "n2"):  # the survivors keep everything
        for k, v in data.items():
            assert _local(c, n, k) == v
    c.start("n3")
    # Until n3 has rejoined, a stale read of its replica is an error, never "absent"
    # (found from outside: the replica, restarted empty, answered committed keys 404).
    answers = []
    deadline = time.monotonic() + 10
    while not answers and time.monotonic() < deadline:
        try:
            answers.append(c.nodes["n3"].read_kv(GID, lambda s: s.get(b"k3"), False)
                           .result(5))
        except (ReplicaEmpty, UnknownGroup):
            time.sleep(0.005)
    assert answers == [b"v3"]
    _wait_settled(c, META)
    seen = voters.stop()
    assert ["n1", "n2"] in seen and seen[-1] == META, seen
    _check_rejoin(starts, "n3")
    for n in META:
        for k, v in data.items():
            assert _local(c, n, k) == v
    st = c.mgrs["n3"].status()
    assert st["metrics"].get("switch_reduce_added") == 1 and not st["errors"]


def test_full_partition_restart_of_an_in_memory_table_starts_empty(cluster: Cluster) -> None:
    c = cluster
    _create(c, "memory")
    _put(c, {b"k": b"v"})
    for n in META:
        c.kill(n)
    for n in META:
        c.start(n)
    _wait_settled(c, META)
    assert _local(c, c.leader(GID), b"k") is None  # the data went with the processes
    # ... and the partition says so (found from outside: it looked like any other).
    assert all(m.status()["partitions"][GID]["restarted_empty"] for m in c.mgrs.values())
    _put(c, {b"k2": b"v2"})
    # Each node bootstraps fresh, or (once a majority did) comes back through the switch.
    full = _metric(c, "full_restarts")
    assert full >= 2 and full + _metric(c, "partitions_rejoined") == 3
    assert _switch(c) == ([], [])


def test_a_persistent_partition_with_wiped_storage_takes_the_switch_path(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = cluster
    _create(c, "persistent")
    data = {f"k{i}".encode(): f"v{i}".encode() for i in range(10)}
    _put(c, data)
    c.transfer(GID, "n1")
    starts = _record_starts(monkeypatch, c, "n3")
    c.kill("n3")
    # Cleaned-up PDS: the partition's directory and its log in the node's shared one.
    shutil.rmtree(Path(group_paths(str(c.root / "n3"), GID)[0]).parent)
    logs = LogEnv(partition_logs_path(str(c.root / "n3")), shared=True)
    logs.drop(GID)
    logs.close()
    c.start("n3")
    _wait_settled(c, META)
    _check_rejoin(starts, "n3")
    for k, v in data.items():
        assert _local(c, "n3", k) == v
    m = c.mgrs["n3"].status()["metrics"]
    assert m.get("restarts_detected") == 1 and m.get("switch_reduce_added") == 1


def test_a_partition_log_from_before_logs_were_shared_counts_as_present(
    cluster: Cluster,
) -> None:
    """An upgraded node: n3's partition log is in its own directory, as before logs were
    shared. The storage self-check must find it (not take the partition for wiped), and
    the start moves it into the shared environment."""
    c = cluster
    _create(c, "persistent")
    _put(c, {b"k": b"v"})
    c.kill("n3")
    root = str(c.root / "n3")
    logs = LogEnv(partition_logs_path(root), shared=True)
    shared = logs.store(GID)
    hard = shared.initial_state()[0]
    assert shared.first_index() == 1  # no compaction yet: the whole log moves out
    entries = shared.entries(1, shared.last_index() + 1)
    shared.close()
    own = LmdbLogStore(group_paths(root, GID)[0])
    own.save(hard, entries)
    own.close()
    logs.drop(GID)
    logs.close()
    c.start("n3")
    _wait_settled(c, META)
    assert _local(c, "n3", b"k") == b"v"
    assert c.mgrs["n3"].status()["metrics"].get("restarts_detected", 0) == 0
    assert not Path(group_paths(root, GID)[0]).exists()


def test_a_persistent_partition_with_its_storage_restarts_normally(cluster: Cluster) -> None:
    c = cluster
    _create(c, "persistent")
    _put(c, {b"k": b"v"})
    c.kill("n3")
    c.start("n3")
    _wait_settled(c, META)
    assert _local(c, "n3", b"k") == b"v"
    assert c.mgrs["n3"].status()["metrics"].get("restarts_detected", 0) == 0


# ============================================== issue 14: no reachable state waits ========
def _two_replica_table(c: Cluster) -> tuple[str, str]:
    mgr = c.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(T, 1, 2, "memory")
    a, b = calc_assignments(T, 0, META, 2)
    wait_for(lambda: all(c.info(n, GID) is not None for n in (a, b)), 10, "the group")
    c.leader(GID)
    return a, b


def test_a_two_replica_in_memory_partition_whose_replica_restarts_converges(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stable [a, b]; b (the partition's leader) restarts without its state. IGNITE-16668's
    majority rule needs two holders besides b, and the full-restart rule does not apply
    because a holds the state: before the survivor rule (``rebalance.py``, "The lone
    holder of a two-voter configuration") b waited for ever and a sat in PRE_CANDIDATE.
    Now b records itself in switch.reduce, a wins a survivor election that removes b, and
    switch.append re-adds b fresh: stable [a, b], nothing pending, writes accepted."""
    c = cluster
    a, b = _two_replica_table(c)
    data = {f"k{i}".encode(): f"v{i}".encode() for i in range(10)}
    _put(c, data)
    c.transfer(GID, b)
    voters = VoterLog(c, GID)
    starts = _record_starts(monkeypatch, c, b)
    c.kill(b)
    c.start(b)
    started = time.monotonic()
    _wait_settled(c, [a, b], timeout=30)
    took = time.monotonic() - started
    seen = voters.stop()
    assert [a] in seen and seen[-1] == [a, b], seen
    _check_rejoin(starts, b)
    for n in (a, b):
        for k, v in data.items():
            assert _local(c, n, k) == v
    _put(c, {b"after": b"restart"})
    assert c.mgrs[a].status()["metrics"].get("survivor_elections", 0) >= 1
    assert c.mgrs[b].status()["metrics"].get("switch_reduce_added") == 1
    assert took < 15, took


def test_seed_102_two_voter_stable_with_a_re_add_in_flight_survives_a_second_loss(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chaos seed 102, driven directly. A 3-replica in-memory partition on [n1, n2, n3]
    loses n2's state; the switch path leaves stable [n1, n3] (two voters) and pending
    [n1, n2, n3] with n2 in switch.append, and n2 stays down (here: it never starts the
    group again), so the re-add waits with n2 a learner that cannot catch up. Then n1,
    the partition's leader and the metastore's, restarts without its state. Of stable
    [n1, n3] only n3 holds it, which is not a majority: before the survivor rule n1 took
    IGNITE-16668's "otherwise: wait" and the group never had a quorum again."""
    c = cluster
    _create(c, "memory")
    data = {f"k{i}".encode(): f"v{i}".encode() for i in range(10)}
    _put(c, data)
    # n2 loses its state and, restarted, is kept from hosting the partition again.
    hold = {"n2": True}
    orig_start = PlacementManager._start_partition

    def held_start(self: PlacementManager, part: Any, *a: Any, **k: Any) -> None:
        if not hold.get(self.id, False):
            orig_start(self, part, *a, **k)

    monkeypatch.setattr(PlacementManager, "_start_partition", held_start)
    # The seed's n2 did not lead the partition. When it does (1 run in 3, by the election
    # after create), its switch.reduce was not acted on in 2 runs of 3 while it is kept
    # from hosting: a gap left open, noted in the session's closing note.
    c.transfer(GID, "n1")
    c.kill("n2")
    c.start("n2")

    def window() -> bool:
        st, pe, _ = c.assignments(T, 0)
        return st == ["n1", "n3"] and pe == META and _switch(c) == ([], ["n2"])

    wait_for(window, 20, "stable [n1, n3], pending [n1, n2, n3], switch.append [n2]")
    wait_for(lambda: c.info(c.leader(GID), GID)["voters"] == ["n1", "n3"], 10, "{n1, n3}")
    c.transfer(GID, "n1")
    wait_for(lambda: c.meta_leader() == "n1" or c.nodes[c.meta_leader()].transfer_leadership(
        "meta", "n1").result(5) or True, 10, "n1 to lead the metastore")
    starts = _record_starts(monkeypatch, c, "n1")
    c.kill("n1")
    c.start("n1")  # in memory: its log, state and vote are gone
    wait_for(lambda: "n1" in _switch(c)[0], 20, "n1 in switch.reduce")
    wait_for(lambda: c.info("n3", GID)["voters"] == ["n3"], 20, "n3 to continue alone")
    for k, v in data.items():
        assert _local(c, "n3", k) == v
    hold["n2"] = False
    for n in ("n2", "n3"):
        c.nodes[n].call(lambda n=n: c.mgrs[n]._kick(GID)).result(5)
    _wait_settled(c, META, timeout=30)
    _check_rejoin(starts, "n1")
    for n in META:
        for k, v in data.items():
            assert _local(c, n, k) == v
    _put(c, {b"after": b"both"})
    assert c.mgrs["n3"].status()["metrics"].get("survivor_elections", 0) >= 1


def test_bug_c_in_memory_a_voter_dropped_from_pending_that_lost_its_state(
    cluster: Cluster,
) -> None:
    """Bug C (chaos seed 13/25; tests/test_rebalance.py has the persistent case) with an
    in-memory table: x hosted the partition, is a voter of the two-voter configuration
    {a, x} that a change to pending [a, y] still needs, and neither stable nor pending
    names it. A persistent x rejoins with its log; an in-memory x has none. Before the
    fix it never rejoined and the change hung. Now x records itself in switch.reduce,
    a wins a survivor election that removes x, and the change finishes."""
    c = cluster
    mgr = c.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(T, 1, 2, "memory")
    a, x = calc_assignments(T, 0, META, 2)
    y = next(n for n in META if n not in (a, x))
    wait_for(lambda: all(c.info(n, GID) is not None for n in (a, x)), 10, "the group")
    _put(c, {b"k": b"v1"})
    c.kill(x)
    wait_for(lambda: c.mgrs[a].set_nodes([a, y]) or True, 10, "x to leave the topology")
    wait_for(lambda: c.assignments(T, 0)[1] == sorted([a, y]), 10, "pending [a, y]")
    stable = partition_keys(T, 0).stable
    wait_for(lambda: c.metas[a].invoke([], [Op.put(stable, encode_nodes([a]))]).result(5),
             10, "stable [a]")
    c.start(x)  # in memory: the configuration {a, x} counts on state x no longer has

    def done() -> bool:
        st, pe, _ = c.assignments(T, 0)
        return st == sorted([a, y]) and not pe and _switch(c) == ([], [])

    wait_for(done, 30, f"the change to [{a}, {y}] to finish without {x}'s old state")
    wait_for(lambda: c.info(c.leader(GID), GID)["voters"] == sorted([a, y]), 10, "voters")
    assert c.info(x, GID) is None
    assert c.get(T, b"k") == b"v1"


def test_a_member_that_joined_after_a_full_restart_never_founds_it_again(
        cluster: Cluster) -> None:
    """Found from outside: after a full-partition restart (a history of epoch E), n4 joins
    as a learner and is promoted; n4 and n1 then restart without their state. n4's holds
    key named no epoch, so it took itself for a late founder of E that never voted in it,
    bootstrapped E's configuration empty, and with n1 formed a second history over the
    writes n2 holds (the node that led it then died on an append answer beyond its log).
    A joiner's key now names the history it joins: two of three lost, the partition waits
    for n2 (IGNITE-16668: "otherwise, do nothing") and n2 keeps the data."""
    c = cluster
    _create(c, "memory")
    for n in META:
        c.kill(n)
    for n in META:
        c.start(n)
    _wait_settled(c, META)
    c.start("n4")
    members = ["n1", "n2", "n4"]
    c.mgrs["n1"].set_nodes(members)
    _wait_settled(c, members)
    _put(c, {b"k": b"v"})
    prefix = f"placement.holds.{T}.0.".encode()
    keys = c.metas["n2"].range(prefix).result(5).items
    epochs = {bytes(v.value).partition(b"/")[2] for _, v in keys if v.value}
    assert len(epochs) == 1 and b"" not in epochs, keys  # n4's key names E too
    for n in ("n4", "n1"):
        c.kill(n)
    for n in ("n4", "n1"):
        c.start(n)
    time.sleep(3)
    for n in ("n4", "n1"):  # neither founded a second history
        assert c.mgrs[n].status()["metrics"].get("full_restarts", 0) == 0, n
    assert _local(c, "n2", b"k") == b"v"
    for n in ("n1", "n4"):
        info = c.info(n, GID)
        assert info is None or info["role"] != Role.LEADER


def test_a_joiners_history_is_rechecked_if_the_epoch_moved_before_its_key_was_written(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a joiner reads the history it joins, then writes its own holds
    key naming it. A full restart committed in between begins another history, and the
    key must not name the one before it. The write is guarded by the partition's epoch
    key as read (only a full restart writes it): here it moves between n4's read and its
    write, and the write is refused, then made again on a fresh read. The founders'
    concurrent first writes at the table's creation all succeed (guarded by every
    node's holds key, they failed one another and each waited an election timeout)."""
    c = cluster
    real = MetaService.invoke
    writes: list[tuple[str, bytes, bool]] = []  # node, the value written, succeeded
    moved: list[bytes] = []
    prefix = holds_prefix(T, 0)

    def invoke(self: MetaService, conditions: Any, success: Any, failure: Any = ()) -> Any:
        conditions, success = list(conditions), list(success)
        ours = [op for op in success if op.kind is OpKind.PUT and op.key.startswith(prefix)]
        nid = self.node.id

        def note(f: Future[Any]) -> None:
            if ours and f.exception() is None:
                r = f.result()
                writes.append((nid, ours[0].value or b"",
                               not isinstance(r, InvokeResult) or r.succeeded))

        if not (ours and nid == "n4" and not moved):
            f = real(self, conditions, success, failure)
            f.add_done_callback(note)
            return f
        # n4's first holds write: the epoch key moves first (rewritten with its value).
        hk = partition_keys(T, 0).epoch
        moved.append(c.mgrs["n4"]._kv[hk].value)
        out: Future[Any] = Future()

        def go(bump: Future[Any]) -> None:
            g = real(self, conditions, success, failure)
            g.add_done_callback(note)
            g.add_done_callback(lambda g: out.set_result(g.result()) if g.exception() is None
                                else out.set_exception(g.exception()))  # type: ignore[arg-type]

        real(self, [], [Op.put(hk, moved[0])]).add_done_callback(go)
        return out

    monkeypatch.setattr(MetaService, "invoke", invoke)
    _create(c, "memory")
    _wait_settled(c, META)
    assert writes and all(ok for _, _, ok in writes), writes  # no founder refused
    for n in META:
        c.kill(n)
    for n in META:
        c.start(n)
    _wait_settled(c, META)
    _put(c, {b"k": b"v"})
    c.start("n4")
    members = ["n1", "n2", "n4"]
    c.mgrs["n1"].set_nodes(members)
    _wait_settled(c, members)
    n4 = [(value, ok) for nid, value, ok in writes if nid == "n4"]
    assert moved and n4[0][1] is False, n4  # refused: the epoch moved since n4's read
    epoch = moved[0]
    assert epoch and n4[-1][1] and n4[-1][0].partition(b"/")[2] == epoch, (n4, moved)
    assert c.get(T, b"k") == b"v"


def _hold_holds_writes(monkeypatch: pytest.MonkeyPatch, holds: dict[str, Any],
                       log: list[tuple[str, str, bytes, object]]) -> None:
    """Hold a node's holds-key writes while ``holds[node](value)`` says so (10 s at
    most): each is logged as ("held", node, value, None) when held and ("sent", node,
    value, succeeded) once answered."""
    real = MetaService.invoke

    def invoke(self: MetaService, conditions: Any, success: Any, failure: Any = ()) -> Any:
        conditions, success = list(conditions), list(success)
        nid = self.node.id
        ours = [op for op in success
                if op.kind is OpKind.PUT and op.key == holds_key(T, 0, nid)]
        hold = holds.get(nid)
        if not ours or hold is None or not hold(ours[0].value or b""):
            return real(self, conditions, success, failure)
        value = ours[0].value or b""
        log.append(("held", nid, value, None))
        out: Future[Any] = Future()

        def later() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and hold(value):
                time.sleep(0.02)
            g = real(self, conditions, success, failure)

            def fin(g: Future[Any]) -> None:
                exc = g.exception()
                log.append(("sent", nid, value, exc if exc is not None
                            else g.result().succeeded))
                if exc is not None:
                    out.set_exception(exc)
                else:
                    out.set_result(g.result())

            g.add_done_callback(fin)

        threading.Thread(target=later, daemon=True).start()
        return out

    monkeypatch.setattr(MetaService, "invoke", invoke)


def _holds_keys(c: Cluster) -> dict[str, bytes]:
    prefix = holds_prefix(T, 0)
    got = c.metas[c.live[0]].range(prefix).result(5).items
    return {bytes(k[len(prefix):]).decode(): bytes(v.value) for k, v in got}


def test_a_founders_first_start_that_races_a_full_restart_names_its_history(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: n3, a founder down when the table was created, never started the
    partition; n1 and n2, which held it, restart whole. n3's first-start write (no epoch)
    was guarded only by the table's existence, so written after the full restart it
    named no history while n3 took part in the new one, and restarted without its state
    later it could found that history again (two votes in one term). Every holds-key
    write is now guarded by the partition's epoch key: n3's is refused (a full restart
    began another history after its read) and n3 joins that history by its rules."""
    c = cluster
    mgr = c.mgrs["n1"]
    mgr.set_nodes(META)
    c.kill("n3")
    mgr.create_table(T, 1, 3, "memory")
    wait_for(lambda: all(c.info(n, GID) is not None for n in ("n1", "n2")), 10, "n1, n2")
    c.kill("n1")
    c.kill("n2")
    log: list[tuple[str, str, bytes, object]] = []

    def no_epoch_yet(value: bytes) -> bool:
        try:
            return b"/" not in value and not any(b"/" in v for v in _holds_keys(c).values())
        except Exception:  # noqa: BLE001 - no metastore leader yet: keep holding
            return True

    def n3_not_held(value: bytes) -> bool:
        return b"/" in value and not any(e[:2] == ("held", "n3") for e in log)

    # n3's epoch-less write waits until a full restart's key is in; the full restart's
    # writes wait until n3's is on its way (read, not yet sent).
    _hold_holds_writes(monkeypatch, {"n3": no_epoch_yet, "n1": n3_not_held,
                                     "n2": n3_not_held}, log)
    for n in META:
        c.start(n)
    wait_for(lambda: all(c.info(n, GID) is not None for n in META), 30, "every node hosts")
    n3 = [ok for kind, n, v, ok in log if kind == "sent" and n == "n3" and b"/" not in v]
    assert n3 and n3[0] is False, log  # the epoch-less first start was refused
    keys = _holds_keys(c)
    epochs = {n: v.partition(b"/")[2] for n, v in keys.items()}
    assert len(set(epochs.values())) == 1 and b"" not in epochs.values(), keys
    assert c.mgrs["n3"].status()["metrics"].get("full_restarts", 0) == 0


def test_a_joiner_without_state_waits_for_a_holder_and_never_blocks_a_full_restart(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: pending names n4, which never hosted the partition, and the whole
    in-memory cluster restarts. n4 (no state, no holder to catch up from) wrote its holds
    key first: it then read as a holder of the history before any full restart, so no
    founder could begin one, and the partition waited for good. Such a joiner now waits
    for a holder: the founders' full restart goes first, and n4 joins its history."""
    c = cluster
    mgr = c.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(T, 1, 3, "memory")
    wait_for(lambda: all(c.info(n, GID) is not None for n in META), 10, "the group")
    c.start("n4")
    wait_for(lambda: c.metas["n1"].get(incarnation_key("n4")).result(5) is not None, 10,
             "n4's incarnation")
    c.kill("n4")
    mgr.set_replicas(T, 4)
    mgr.set_nodes(ALL)
    wait_for(lambda: "n4" in c.assignments(T, 0)[1], 10, "pending to name n4")
    for n in META:
        c.kill(n)
    log: list[tuple[str, str, bytes, object]] = []

    def n4_not_written(value: bytes) -> bool:  # the founders go after n4 would have
        try:
            return b"/" in value and "n4" not in _holds_keys(c) and not any(
                e[1] == "n4" for e in log) and time.monotonic() < hold_until
        except Exception:  # noqa: BLE001 - no metastore leader yet: keep holding
            return True

    hold_until = time.monotonic() + 5
    _hold_holds_writes(monkeypatch, dict.fromkeys(META, n4_not_written), log)
    for n in ALL:
        c.start(n)
    _wait_settled(c, ALL, timeout=40)
    keys = _holds_keys(c)
    epochs = {n: v.partition(b"/")[2] for n, v in keys.items()}
    assert set(keys) == set(ALL) and len(set(epochs.values())) == 1, keys
    assert b"" not in epochs.values(), keys


def test_a_replica_whose_partition_log_was_lost_restarts_empty_and_takes_writes(
        cluster: Cluster) -> None:
    """Found from outside: a node's partition logs deleted (the shared environment), the
    partitions' state stores kept, a table of one replica. The placement layer found no
    log, took the replica for one without state and restarted the partition empty (a
    full restart, as IGNITE-16668 has it), but its state store still held the old
    history: the "empty" partition served the old rows, and the new history's entries,
    at indexes the store counted as applied, were skipped (every write failed with an
    unknown outcome). A state store whose partition log is gone is discarded with it."""
    c = cluster
    mgr = c.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(T, 1, 1, "persistent")
    wait_for(lambda: any(c.info(n, GID) is not None for n in META), 10, "the group")
    host = next(n for n in META if c.info(n, GID) is not None)
    _put(c, {f"k{i}".encode(): b"old" for i in range(20)})
    c.kill(host)
    shutil.rmtree(partition_logs_path(str(c.root / host)))
    c.start(host)
    wait_for(lambda: c.info(host, GID) is not None and c.info(host, GID)["role"]
             == Role.LEADER, 20, "the partition to restart")
    assert c.mgrs[host].status()["metrics"].get("full_restarts", 0) == 1
    assert c.get(T, b"k3") is None  # restarted empty, as it says
    _put(c, {b"new": b"v"})
    assert c.get(T, b"new") == b"v"


def test_a_joiner_without_state_waits_while_the_only_holder_is_down(
        cluster: Cluster) -> None:
    """Found in review: an in-memory table of one replica on n4; n4 is killed and the
    table grows to two replicas, so pending names n1. n4's holds key still named its
    incarnation (unchanged while it is down), so n1 took it for a live holder, wrote its
    own key and became a holder without state; n4, restarted empty, then found a holder
    and never restarted the partition: no leader, for good. A joiner without state waits
    for a live holder in stable, so n1 writes nothing while n4 is down."""
    c = cluster
    c.start("n4")
    wait_for(lambda: c.metas["n1"].get(incarnation_key("n4")).result(5) is not None, 10,
             "n4's incarnation")
    mgr = c.mgrs["n1"]
    mgr.set_nodes(["n4"])
    mgr.create_table(T, 1, 1, "memory")
    wait_for(lambda: c.info("n4", GID) is not None, 10, "the group on n4")
    c.kill("n4")
    # A holder killed just as a joiner looks is taken for live (liveness is a guess).
    wait_for(lambda: "n4" not in c.nodes["n1"].transport.connected_peers(), 10,
             "n1 to see n4 down")
    mgr.set_nodes(["n1", "n4"])
    mgr.set_replicas(T, 2)
    wait_for(lambda: "n1" in c.assignments(T, 0)[1], 10, "pending to name n1")
    for _ in range(3):  # n1 looks (on every change and timer), and waits
        time.sleep(0.5)
        c.nodes["n1"].call(lambda: c.mgrs["n1"]._kick(GID)).result(5)
    assert "n1" not in _holds_keys(c) and c.info("n1", GID) is None
    # (Not checked here: n4's restart. A holder that restarted and connected before its
    # new incarnation is registered still reads as a live holder for that moment, and a
    # joiner that looks then writes its key: left open, see the closing note.)
