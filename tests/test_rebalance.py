"""Seed 004 (Ignite 3 rebalance) on real nodes: tables of partitions, each its own Raft group,
moved by the pending/stable/planned protocol that ``PlacementManager`` drives from the
metastore. In-process nodes on 127.0.0.1, LMDB data directories in tmp_path.

The metastore lives on n1..n3; n4 hosts a metastore replica that joins as a non-voting
learner (no auto-promotion), so it reads and watches like the others.

The first tests check the step-(1)/done invokes alone against a MetaStore, including the
two ways the seed's literal step (1) loses the latest intent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from raftkv.storage.commands import encode_put as kv_put

from raftkv.core import ConfChange, ConfChangeRejected, Role
from raftkv.placement.assignments import (
    DONE_CLEARED,
    PENDING_WRITTEN,
    PLANNED_REMOVED,
    PLANNED_WRITTEN,
    SKIPPED,
    PartitionKeys,
    calc_assignments,
    decode_nodes,
    encode_nodes,
    partition_keys,
    partition_of,
    write_pending_assignments,
)
from raftkv.placement.assignments import rebalance_done as literal_done
from raftkv.placement.catalog import TableDescriptor, parse_partition_key, partition_group
from raftkv.placement.meta_commands import Op, decode_revision, encode_iif, encode_put
from raftkv.placement.metastore import MetaStore
from raftkv.placement.rebalance import PlacementManager, StaleTerm
from raftkv.placement.rebalance_steps import (
    ALREADY_PLACED,
    DONE_STALE,
    MOVE_RETRY,
    MOVED,
    finish_rebalance,
    move_planned_to_pending,
    plan_rebalance,
)
from raftkv.placement.retry import Backoff, RetryPolicy
from raftkv.testing.placement_cluster import ALL, META, Cluster, wait_for

TABLE = "users"
PARTS = 8


# ============================================================ the invokes alone ============
class Meta:
    def __init__(self, path: Path) -> None:
        self.store = MetaStore(str(path), map_size=1 << 26)

    def run(self, data: bytes) -> Any:
        return self.store.apply([(self.store.applied_index() + 1, data)])[0]

    def state(self, k: PartitionKeys) -> tuple[list[str], list[str], list[str] | None, int]:
        st, pe, pl, tr = self.store.get_many(list(k)[:4])
        return (decode_nodes(st.value if st else None), decode_nodes(pe.value if pe else None),
                None if pl is None else decode_nodes(pl.value),
                decode_revision(tr.value) if tr else 0)


@pytest.fixture
def meta(tmp_path: Path) -> Iterator[Meta]:
    m = Meta(tmp_path / "meta")
    yield m
    m.store.close()


def _n(*ids: str) -> bytes:
    return encode_nodes(ids)


def test_literal_step_1_loses_the_latest_intent_after_a_no_op_event(meta: Meta) -> None:
    """Seed 004 step (1) as written (assignments.write_pending_assignments): an event that
    computes the current stable writes *planned* (pending is empty); a later event writes
    pending but leaves that planned; the rebalance's done then moves the stale planned
    into pending and the partition moves back. plan_rebalance keeps the newest intent."""
    k = partition_keys("t", 0)
    abc, abd = _n("A", "B", "C"), _n("A", "B", "D")
    meta.run(encode_put(k.stable, abc))
    assert meta.run(encode_iif(write_pending_assignments(k, 5, abc))).tag == PLANNED_WRITTEN
    assert meta.run(encode_iif(write_pending_assignments(k, 6, abd))).tag == PENDING_WRITTEN
    planned = meta.store.get_entry(k.planned)
    meta.run(encode_iif(literal_done(k, abd, planned)))
    assert meta.state(k)[:2] == (["A", "B", "D"], ["A", "B", "C"])  # back to the stale one

    k2 = partition_keys("t", 1)
    meta.run(encode_put(k2.stable, abc))
    assert meta.run(encode_iif(plan_rebalance(k2, 5, abc))).tag == ALREADY_PLACED
    assert meta.run(encode_iif(plan_rebalance(k2, 6, abd))).tag == PENDING_WRITTEN
    planned = meta.store.get_entry(k2.planned)
    assert planned is None
    assert meta.run(encode_iif(finish_rebalance(k2, abd, planned))).tag == DONE_CLEARED
    assert meta.state(k2) == (["A", "B", "D"], [], None, 6)


def test_literal_step_1_lets_a_late_older_event_override_a_newer_cancel(meta: Meta) -> None:
    """The "pending == calc: remove(planned)" branch keeps the old trigger revision, so an
    older event handled late by a slow node still writes its stale planned."""
    k = partition_keys("t", 0)
    meta.run(encode_put(k.stable, _n("A", "B", "C")))
    abd, abe = _n("A", "B", "D"), _n("A", "B", "E")
    for tree in (write_pending_assignments, plan_rebalance):
        k = partition_keys("t", 1 if tree is plan_rebalance else 0)
        meta.run(encode_put(k.stable, _n("A", "B", "C")))
        assert meta.run(encode_iif(tree(k, 10, abd))).tag == PENDING_WRITTEN
        assert meta.run(encode_iif(tree(k, 12, abe))).tag == PLANNED_WRITTEN
        assert meta.run(encode_iif(tree(k, 14, abd))).tag == PLANNED_REMOVED  # newest: abd
        late = meta.run(encode_iif(tree(k, 13, _n("X", "Y", "Z")))).tag  # a slow node
        if tree is write_pending_assignments:
            assert late == PLANNED_WRITTEN and meta.state(k)[2] == ["X", "Y", "Z"]
        else:
            assert late == SKIPPED and meta.state(k) == (["A", "B", "C"], ["A", "B", "D"],
                                                         None, 14)


def test_done_is_guarded_by_pending_and_the_cancel_by_both_revisions(meta: Meta) -> None:
    k = partition_keys("t", 0)
    meta.run(encode_put(k.stable, _n("A", "B", "C")))
    meta.run(encode_iif(plan_rebalance(k, 3, _n("A", "B", "D"))))
    assert meta.run(encode_iif(plan_rebalance(k, 4, _n("A", "B", "E")))).tag == PLANNED_WRITTEN
    pending, planned = meta.store.get_entry(k.pending), meta.store.get_entry(k.planned)
    assert pending is not None and planned is not None
    # A late done for another configuration changes nothing.
    assert meta.run(encode_iif(finish_rebalance(k, _n("A", "B", "C"), None))).tag == DONE_STALE
    # The cancel moves planned into pending once; a second one with stale revisions retries.
    assert meta.run(encode_iif(move_planned_to_pending(k, pending, planned))).tag == MOVED
    assert meta.run(encode_iif(move_planned_to_pending(k, pending, planned))).tag == MOVE_RETRY
    assert meta.state(k) == (["A", "B", "C"], ["A", "B", "E"], None, 4)


def test_catalog_names_and_backoff() -> None:
    d = TableDescriptor.new("users", 2, 2, "memory", ["n1", "n2", "n3"])
    assert TableDescriptor.decode(d.encode()) == d
    assert parse_partition_key(partition_keys("users", 7).trigger) == ("users", 7, "trigger")
    assert parse_partition_key(b"placement.tables.users") is None
    with pytest.raises(ValueError):
        TableDescriptor.new("bad.name", 1, 1, "memory", ["n1"])
    bo = Backoff(RetryPolicy(base=0.1, factor=2, cap=0.3, max_attempts=3))
    assert bo.ready("k", 0.0)
    assert bo.failed(RuntimeError("x"), 0.0) == pytest.approx(0.1)
    assert not bo.ready("k", 0.05) and bo.ready("k", 0.1)
    assert bo.failed(RuntimeError("x"), 0.1) == pytest.approx(0.2)
    assert bo.failed(RuntimeError("x"), 0.3) is None and not bo.ready("k", 9.0)
    assert bo.ready("new context", 9.0)  # a new leader term or target: a fresh budget


# ============================================================ real nodes ===================
# Cluster, wait_for: raftkv/testing/placement_cluster.py (also used by test_inmemory_restart
# and test_placement_chaos).


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        for nid in META:
            c.start(nid)
        yield c
    finally:
        c.stop()


def _table(c: Cluster, nodes: list[str], replicas: int = 3,
           storage: str = "persistent") -> PlacementManager:
    mgr = c.mgrs["n1"]
    mgr.set_nodes(nodes)
    mgr.create_table(TABLE, PARTS, replicas, storage)
    return mgr


def _write(c: Cluster, n: int = 40) -> dict[bytes, bytes]:
    data = {f"k{i:03d}".encode(): f"v{i}".encode() for i in range(n)}
    for k, v in data.items():
        c.put(TABLE, k, v)
    return data


def _check(c: Cluster, data: dict[bytes, bytes]) -> None:
    for k, v in data.items():
        assert c.get(TABLE, k) == v


def _no_errors(c: Cluster) -> None:
    for nid, m in c.mgrs.items():
        st = m.status()
        assert not st["errors"], (nid, st["errors"])


def test_a_new_table_elects_a_leader_per_partition_and_serves_reads_and_writes(
    cluster: Cluster,
) -> None:
    _table(cluster, META)
    cluster.wait_converged(TABLE, META, 3)
    for p in range(PARTS):
        cluster.leader(partition_group(TABLE, p))
    data = _write(cluster)
    _check(cluster, data)
    cluster.wait_converged(TABLE, META, 3)  # digests equal on every replica
    route = cluster.mgrs["n2"].route(TABLE, b"k001")
    assert route.nodes == tuple(META) and route.partition == partition_of(b"k001", PARTS)
    _no_errors(cluster)


@pytest.mark.parametrize("seconds", [0.3, 600.0])
def test_persistent_partitions_checkpoint_on_the_placement_interval(
    tmp_path: Path, seconds: float
) -> None:
    """Partition state stores checkpoint on PARTITION_CHECKPOINT_SECONDS (passed here),
    not the default group's one second: at 0.3 s every replica reaches checkpoint ==
    applied; at 600 s none has checkpointed its writes two and a half seconds later."""
    c = Cluster(tmp_path, checkpoint_seconds=seconds)
    try:
        for nid in META:
            c.start(nid)
        _table(c, META)
        c.wait_converged(TABLE, META, 3)
        _write(c, 20)
        gids = [partition_group(TABLE, p) for p in range(PARTS)]

        def states() -> list[tuple[int, int]]:
            out = []
            for nid in META:
                for gid in gids:
                    info = c.info(nid, gid)
                    assert info is not None
                    out.append((info["checkpoint"], info["applied"]))
            return out

        if seconds < 1:
            wait_for(lambda: all(ck == ap > 0 for ck, ap in states()), 15, "checkpoints")
        else:
            time.sleep(2.5)
            assert all(ck < ap for ck, ap in states())
    finally:
        c.stop()


@pytest.mark.parametrize("storage", ["persistent", "memory"])
def test_a_fourth_node_joins_and_every_partition_moves_to_its_calculated_assignment(
    cluster: Cluster, storage: str,
) -> None:
    """Seed 004 steps (1)-(3): set_nodes writes pending, leaders add the new member as a
    PRE_FOLLOWER, it is promoted once caught up, the departing member is removed (the
    leader last, by transfer), stable := pending, and the departed node stops the group."""
    _table(cluster, META, storage=storage)
    data = _write(cluster)
    moving = [p for p in range(PARTS) if calc_assignments(TABLE, p, ALL, 3) != META]
    assert moving  # rendezvous hashing hands n4 some partitions
    cluster.start("n4")
    cluster.mgrs["n4"].set_nodes(ALL)  # the newcomer's metastore replica forwards the write
    cluster.wait_converged(TABLE, ALL, 3)
    _check(cluster, data)
    assert sum(m.status()["metrics"].get("rebalances_done", 0)
               for m in cluster.mgrs.values()) >= len(moving)
    _no_errors(cluster)


def test_replica_count_3_to_2_and_back(cluster: Cluster) -> None:
    mgr = _table(cluster, META)
    data = _write(cluster)
    mgr.set_replicas(TABLE, 2)
    cluster.wait_converged(TABLE, META, 2)
    _check(cluster, data)
    cluster.mgrs["n3"].set_replicas(TABLE, 3)
    cluster.wait_converged(TABLE, META, 3)  # the removed replicas come back and catch up
    _check(cluster, data)
    _no_errors(cluster)


def test_the_partition_leader_dies_mid_rebalance_and_the_new_leader_resumes(
    cluster: Cluster,
) -> None:
    """Failover (seed 004, onLeaderElected): pending is written and the leader has added
    n4 as a learner (n4 is down, so it cannot catch up); the leader is then killed. The new
    leader resumes the change from pending once n4 is back; the killed node, on restart,
    stops the partition it no longer owns."""
    _table(cluster, META)
    data = _write(cluster)
    p = next(p for p in range(PARTS) if calc_assignments(TABLE, p, ALL, 3) != META)
    gid = partition_group(TABLE, p)
    doomed = (set(META) - set(calc_assignments(TABLE, p, ALL, 3))).pop()
    cluster.transfer(gid, doomed)  # the leader is also the member being removed
    survivor = next(n for n in META if n != doomed)
    cluster.mgrs[survivor].set_nodes(ALL)

    def catching_up() -> str | None:
        lead = cluster.leader(gid)  # normally `doomed`, unless an election intervened
        i = cluster.info(lead, gid)
        return lead if i is not None and i["learners"] == ["n4"] else None

    victim: str = wait_for(catching_up, 10, f"the leader to add n4 as a learner of {gid}")
    assert cluster.assignments(TABLE, p)[1] == calc_assignments(TABLE, p, ALL, 3)
    cluster.kill(victim)
    cluster.start("n4")
    cluster.wait_converged(TABLE, ALL, 3)  # on the live nodes
    cluster.start(victim)
    cluster.wait_converged(TABLE, ALL, 3)
    assert (cluster.info(victim, gid) is None) == (victim == doomed)
    _check(cluster, data)


def test_a_planned_assignment_during_a_change_wins_and_is_never_lost(cluster: Cluster) -> None:
    """Adjustable changePeers, Approach 2. n4 joins the topology but is down, so changes
    that add it stay catching up. Then the replica count drops (planned while catching
    up: the leaders cancel and move planned to pending), then n4 leaves the topology
    again (planned again). The last intent wins everywhere; no learner is left."""
    mgr = _table(cluster, META)
    data = _write(cluster)
    mgr.set_nodes(ALL)
    stuck = [p for p in range(PARTS) if "n4" in calc_assignments(TABLE, p, ALL, 3)]

    def stuck_on_n4() -> bool:
        return all(cluster.assignments(TABLE, p)[1] == calc_assignments(TABLE, p, ALL, 3)
                   for p in stuck)

    wait_for(stuck_on_n4, 10, "pending with n4")
    mgr.set_replicas(TABLE, 2)
    cluster.mgrs["n2"].set_nodes(META)
    cluster.wait_converged(TABLE, META, 2)
    _check(cluster, data)
    metrics = [m.status()["metrics"] for m in cluster.mgrs.values()]
    assert sum(x.get("changes_cancelled", 0) for x in metrics) >= 1
    assert sum(x.get("plan.planned_written", 0) for x in metrics) >= 1


def test_change_peers_with_an_old_term_is_refused(cluster: Cluster) -> None:
    """Seed 004: "RaftGroupService#changePeersAsync from old terms must be skipped"."""
    _table(cluster, META)
    cluster.wait_converged(TABLE, META, 3)
    gid = partition_group(TABLE, 0)

    def accepted_in_the_current_term() -> tuple[str, int]:
        lead = cluster.leader(gid)
        info = cluster.info(lead, gid)
        assert info is not None
        cluster.mgrs[lead].change_peers(gid, info["term"], META).result(5)  # a no-op here
        return lead, info["term"]

    lead, term = wait_for(accepted_in_the_current_term, 10, "an accepted changePeers")
    mgr = cluster.mgrs[lead]
    with pytest.raises(StaleTerm):
        mgr.change_peers(gid, term - 1, META).result(5)
    follower = next(n for n in META if n != lead)
    with pytest.raises(StaleTerm):  # not the leader (or, if it became one, in a later term)
        cluster.mgrs[follower].change_peers(gid, term, META).result(5)
    # After a leader change the old term is refused everywhere, the new leader included.
    cluster.transfer(gid, follower)
    with pytest.raises(StaleTerm):
        cluster.mgrs[follower].change_peers(gid, term, META).result(5)
    with pytest.raises(StaleTerm):
        mgr.change_peers(gid, term, META).result(5)


def test_reconfiguration_errors_back_off_are_recorded_when_exhausted_and_a_new_leader_resumes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onReconfigurationError: every membership change of one partition fails; the leader
    retries with back-off, then gives up, recording and counting the error. A new leader
    (a new term) starts with a fresh budget and completes the rebalance."""
    _table(cluster, META)
    cluster.start("n4")
    p = next(p for p in range(PARTS) if calc_assignments(TABLE, p, ALL, 3) != META)
    gid = partition_group(TABLE, p)
    for m in cluster.mgrs.values():
        m.retry = RetryPolicy(base=0.01, factor=2, cap=0.05, max_attempts=3)
    for node in cluster.nodes.values():
        def broken(group: str, cc: ConfChange, learner_only: bool = False, *,
                   orig: Any = node.change_membership) -> Any:
            if group != gid:
                return orig(group, cc, learner_only)
            f: Future[Any] = Future()
            f.set_exception(ConfChangeRejected("injected"))
            return f

        monkeypatch.setattr(node, "change_membership", broken)
    cluster.mgrs["n1"].set_nodes(ALL)

    def recorded() -> tuple[str, list[dict[str, Any]]] | None:
        for nid, m in cluster.mgrs.items():
            errors = m.status()["errors"]
            if errors:
                return nid, errors
        return None

    lead, errors = wait_for(recorded, 10, "the recorded error")
    assert [(e["partition"], e["kind"], e["attempts"]) for e in errors] == [(gid, "change", 3)]
    assert "injected" in errors[0]["error"]
    metrics = cluster.mgrs[lead].status()["metrics"]
    # Each exhausted budget is three failed attempts. A busy machine may let a second
    # budget start, or run out, before the first look (a new term, or pending moved by
    # the topology change, starts a fresh one), so count budgets rather than expect
    # exactly one: the exhausted ones, and at most two attempts of one still running.
    exhausted = metrics["retries_exhausted"]
    assert exhausted >= 1, metrics
    assert 3 * exhausted <= metrics["errors.change"] <= 3 * exhausted + 2, metrics
    assert metrics["retries"] >= 2 * exhausted
    before = cluster.info(lead, gid)
    monkeypatch.undo()
    time.sleep(0.3)
    after = cluster.info(lead, gid)
    if before == after and after is not None and after["role"] == Role.LEADER:
        # Exhausted: no further attempt in this term, even though changes would now work.
        assert cluster.assignments(TABLE, p)[1] == calc_assignments(TABLE, p, ALL, 3)
        assert after["voters"] == META and after["learners"] == []
    other = next(n for n in calc_assignments(TABLE, p, ALL, 3) if n != lead and n != "n4")
    cluster.transfer(gid, other)  # a new term: a fresh budget
    cluster.wait_converged(TABLE, ALL, 3)


# ============================================================ dropping a table =============
def test_dropping_a_table_under_load_spares_the_other_table_and_recreation_starts_empty(
    cluster: Cluster,
) -> None:
    """drop_table while writers hammer the dropped table and another one: the other table
    loses no acknowledged write and its replicas stay equal; the dropped table's writes
    fail (NodeStopped / UnknownGroup) and its groups and files are gone on every node; a
    table re-created under the name starts empty; dropping an unknown table fails."""
    import threading

    from raftkv.placement.rebalance import UnknownTable

    other = "orders"
    mgr = _table(cluster, META)
    mgr.create_table(other, PARTS, 3)
    cluster.wait_converged(TABLE, META, 3)
    cluster.wait_converged(other, META, 3)
    acked: dict[str, dict[bytes, bytes]] = {TABLE: {}, other: {}}
    errors: dict[str, list[BaseException]] = {TABLE: [], other: []}
    dropped = threading.Event()
    stop = threading.Event()

    def writer(table: str, w: int) -> None:
        i = 0
        while not stop.is_set():
            key, value = f"w{w}-{i:04d}".encode(), f"v{i}".encode()
            gid = partition_group(table, partition_of(key, PARTS))
            for nid in cluster.live:  # a follower forwards to the leader
                try:
                    cluster.nodes[nid].propose(gid, kv_put(key, value)).result(5)
                except Exception as e:  # noqa: BLE001
                    if dropped.is_set():
                        errors[table].append(e)
                    continue
                acked[table][key] = value
                break
            i += 1

    threads = [threading.Thread(target=writer, args=(t, w)) for t in (TABLE, other)
               for w in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked[TABLE]) > 40 and len(acked[other]) > 40, 20, "some writes")
    before = dict(acked[TABLE])
    started = time.monotonic()
    dropped.set()
    cluster.mgrs["n2"].drop_table(TABLE)

    def gone() -> bool:
        for nid in META:
            for p in range(PARTS):
                gid = partition_group(TABLE, p)
                if cluster.info(nid, gid) is not None or (cluster.root / nid / "groups" / gid
                                                          ).exists():
                    return False
        return all(m.table(TABLE) is None for m in cluster.mgrs.values())

    wait_for(gone, 10, "every node to stop the dropped table's groups and delete them")
    drop_seconds = time.monotonic() - started
    wait_for(lambda: len(errors[TABLE]) >= 10, 10, "writes to the dropped table failing")
    n_other = len(acked[other])
    wait_for(lambda: len(acked[other]) > n_other + 20, 10, "the other table to keep going")
    stop.set()
    for t in threads:
        t.join(20)
    # Here, or forwarded to a leader that stopped the group (RemoteError of that kind).
    kinds = {getattr(e, "kind", type(e).__name__) for e in errors[TABLE]}
    assert kinds <= {"NodeStopped", "UnknownGroup"}, kinds
    # The other table's writes do not fail because of the drop. On a busy machine one of
    # its leaders may lose an election meanwhile, which leaves a write in flight with an
    # unknown outcome (it is not counted as acknowledged); nothing else may fail.
    assert all("outcome is unknown" in str(e) for e in errors[other]), errors[other][:3]
    for k, v in acked[other].items():
        assert cluster.get(other, k) == v
    cluster.wait_converged(other, META, 3)  # digests equal on every replica
    assert drop_seconds < 5, drop_seconds
    for m in cluster.mgrs.values():
        assert m.status()["metrics"]["partitions_dropped"] == PARTS
        assert TABLE not in m.status()["tables"]
    with pytest.raises(UnknownTable):
        mgr.drop_table(TABLE)
    assert all(cluster.assignments(TABLE, p) == ([], [], []) for p in range(PARTS))

    cluster.mgrs["n3"].create_table(TABLE, PARTS, 3)
    cluster.wait_converged(TABLE, META, 3)
    for k in before:
        assert cluster.get(TABLE, k) is None
    cluster.put(TABLE, b"fresh", b"1")
    assert cluster.get(TABLE, b"fresh") == b"1"
    cluster.wait_converged(TABLE, META, 3)
    _no_errors(cluster)


def test_a_restarted_voter_dropped_from_pending_rejoins_while_the_change_needs_it(
    cluster: Cluster,
) -> None:
    """Step (2) on a restart (module docstring, IGNITE-16668 notes): a persistent
    partition this node hosted before the restart, with its log, is started again while
    pending is non-empty even though neither stable nor pending names it, because the
    configuration may count on it. Chaos seed 25 reached that state through a cancel
    (stable [n2, n3], pending [n2, n3, n5], while the group's configuration had n4 as a
    voter and an uncommitted removal that needed n4's vote); here the keys are written
    directly. The two-voter group {a, x} can commit nothing without x, so the change to
    pending finishes only if x rejoins; x then leaves once stable excludes it. Before the
    fix x wrote its holds key but never started the group, and the change hung."""
    table = "held"
    mgr = cluster.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(table, 1, 2, "persistent")
    gid = partition_group(table, 0)
    a, x = calc_assignments(table, 0, META, 2)
    y = next(n for n in META if n not in (a, x))
    wait_for(lambda: set(cluster.assignments(table, 0)[0]) == {a, x}, 10, "the table's stable")
    cluster.put(table, b"k", b"v1")
    cluster.kill(x)  # possibly the metastore leader too: the writes below retry
    wait_for(lambda: cluster.mgrs[a].set_nodes([a, y]) or True, 10, "x to leave the topology")
    wait_for(lambda: set(cluster.assignments(table, 0)[1]) == {a, y}, 10, "pending [a, y]")
    # The divergence a cancel produced in seed 25: stable no longer names x, a voter.
    stable = partition_keys(table, 0).stable
    wait_for(lambda: cluster.metas[a].invoke([], [Op.put(stable, encode_nodes([a]))]).result(5),
             10, "stable [a]")
    cluster.start(x)

    def done() -> bool:
        st, pe, _ = cluster.assignments(table, 0)
        return set(st) == {a, y} and not pe

    wait_for(done, 30, f"the change to [{a}, {y}] to finish with {x}'s vote")
    wait_for(lambda: cluster.info(x, gid) is None, 10, f"{x} to stop hosting {gid}")
    assert cluster.info(a, gid)["voters"] == sorted([a, y])  # type: ignore[index]
    assert cluster.get(table, b"k") == b"v1"


def test_a_blocking_admin_call_is_refused_only_on_the_live_loop_thread(
    cluster: Cluster,
) -> None:
    """Found from outside: with its node's loop thread dead (the node failed), a table
    drop answered 500 "a blocking PlacementManager call on the node's loop thread": the
    guard compared thread idents, and a pool thread may be given the dead thread's. It
    compares the thread itself now. Here the dead thread is one that finished."""
    mgr = cluster.mgrs["n1"]
    with pytest.raises(RuntimeError, match="on the node's loop thread"):
        mgr.node.call(lambda: mgr.set_nodes(META)).result(10)  # on the loop: refused
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    live = mgr._loop_thread
    mgr._loop_thread = gone
    try:
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(mgr.set_nodes(META)))
        t.start()
        t.join(30)
        assert got and isinstance(got[0], int)
    finally:
        mgr._loop_thread = live


def test_a_retried_failure_is_a_warning_first_and_a_damaged_store_every_time(
    cluster: Cluster, caplog: pytest.LogCaptureFixture,
) -> None:
    """Found from outside: a partition whose state store was truncated failed to start
    over and over, logged only at INFO. The first failure of a kind is a warning; a
    StorageError (damage that retrying will not heal) is one every time."""
    import logging

    from raftkv.storage.errors import StorageError

    mgr = _table(cluster, META)
    cluster.wait_converged(TABLE, META, 3)
    part = next(iter(mgr._parts.values()))

    def fail(kind: str, exc: BaseException) -> None:
        mgr.node.call(lambda: mgr._failed(part, kind, exc)).result(10)

    with caplog.at_level(logging.INFO, logger="raftkv.placement.manager_base"):
        fail("probe", RuntimeError("blip"))
        fail("probe", RuntimeError("blip"))
        fail("damaged", StorageError("truncated"))
        fail("damaged", StorageError("truncated"))
    levels = [(r.levelno, r.getMessage().split(" of ")[0].split()[-1])
              for r in caplog.records if "; retry in" in r.getMessage()]
    assert levels == [(logging.WARNING, "probe"), (logging.INFO, "probe"),
                      (logging.WARNING, "damaged"), (logging.WARNING, "damaged")], levels
