"""Failure detection and automatic re-replication (raftkv.placement.liveness): a node
silent for ``scale_down_timeout`` is declared dead by the metastore leader, its
partitions regain their replica count on the live nodes, and once it is back for
``scale_up_timeout`` partitions are placed on it again. In-process nodes over real TCP,
LMDB files (tests/test_rebalance.py's cluster)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from test_rebalance import ALL, META, PARTS, TABLE, Cluster, _check, _no_errors, _write, wait_for

from raftkv.core.errors import NotLeader, ProposalDropped
from raftkv.node.errors import RequestTimeout
from raftkv.placement.catalog import (
    DEAD_KEY,
    DRAINING_KEY,
    HOLDS_PREFIX,
    TOPOLOGY_KEY,
    partition_group,
)
from raftkv.placement.liveness import ClusterSettings, LivenessRecord, data_nodes
from raftkv.placement.meta_commands import VersionedValue
from raftkv.placement.partition_state import UnknownNode


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        for nid in ALL:
            c.start(nid)
        yield c
    finally:
        c.stop()


def _nodes(c: Cluster, via: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in c.mgrs[via].cluster_nodes()}


def _state(c: Cluster, via: str, node: str) -> str:
    return _nodes(c, via)[node]["state"]


def _table_on_all(c: Cluster, scale_down: float, scale_up: float) -> dict[bytes, bytes]:
    mgr = c.mgrs["n1"]
    mgr.update_settings({"scale_down_timeout": scale_down, "scale_up_timeout": scale_up})
    mgr.set_nodes(ALL)
    mgr.create_table(TABLE, PARTS, 3)
    c.wait_converged(TABLE, ALL, 3)
    wait_for(lambda: all(r["state"] == "alive" for r in _nodes(c, "n1").values()), 10,
             "every node alive")
    return _write(c)


def test_a_founder_killed_for_good_is_declared_dead_and_its_partitions_re_replicate(
    cluster: Cluster,
) -> None:
    """The issue's scenario in process: a metastore founder dies for good; after the
    scale-down timeout every partition has three replicas on the three live nodes and
    no acknowledged write is lost. It is suspect first, and nothing moves then."""
    data = _table_on_all(cluster, scale_down=3.0, scale_up=1.0)
    cluster.kill("n3")
    wait_for(lambda: _state(cluster, "n1", "n3") == "suspect", 10, "n3 suspect")
    # On suspicion alone the assignments stay.
    assert cluster.mgrs["n1"].status()["nodes"]
    assert not cluster.mgrs["n1"].meta.get(DEAD_KEY).result(5)
    wait_for(lambda: _state(cluster, "n1", "n3") == "dead", 15, "n3 dead")
    live = ["n1", "n2", "n4"]
    cluster.wait_converged(TABLE, live, 3, timeout=30)
    _check(cluster, data)
    row = _nodes(cluster, "n2")["n3"]
    assert (row["in_topology"], row["data_node"]) == (True, False)
    _no_errors(cluster)


def test_a_dead_node_that_returns_is_a_data_node_again_after_scale_up(
    cluster: Cluster,
) -> None:
    data = _table_on_all(cluster, scale_down=2.0, scale_up=2.0)
    cluster.kill("n4")  # a metastore learner
    wait_for(lambda: _state(cluster, "n1", "n4") == "dead", 15, "n4 dead")
    cluster.wait_converged(TABLE, META, 3, timeout=30)
    epoch = _nodes(cluster, "n1")["n4"]["epoch"]
    cluster.start("n4")
    wait_for(lambda: _state(cluster, "n1", "n4") == "alive", 15, "n4 alive again")
    row = _nodes(cluster, "n1")["n4"]
    assert row["data_node"] and row["epoch"] == epoch + 1  # a new incarnation
    cluster.wait_converged(TABLE, ALL, 3, timeout=30)
    _check(cluster, data)
    _no_errors(cluster)


def test_scale_down_zero_turns_automatic_removal_off(cluster: Cluster) -> None:
    _table_on_all(cluster, scale_down=0, scale_up=0)
    cluster.kill("n4")
    wait_for(lambda: _state(cluster, "n1", "n4") == "suspect", 10, "n4 suspect")
    time.sleep(3)  # dead at once if 0 meant "no delay": it means "never"
    assert cluster.mgrs["n1"].meta.get(DEAD_KEY).result(5) is None
    assert _state(cluster, "n2", "n4") == "suspect"


# ============================================================ settings: bad input =====
@pytest.mark.parametrize("body, message", [
    ({"scale_down_timeout": -1}, "between 0 and"),
    ({"scale_down_timeout": "30"}, "must be a number"),
    ({"scale_up_timeout": math.nan}, "must be a number"),
    ({"scale_up_timeout": math.inf}, "must be a number"),
    ({"scale_down_timeout": True}, "must be a number"),
    ({"scale_down": 3}, "unknown setting"),
    ({"metastore_voters": 4}, "3 or 5"),
    ({"max_moves": -1}, "max_moves must be an integer"),
    ({"max_moves": 2.5}, "max_moves must be an integer"),
    ({"max_moves": True}, "max_moves must be an integer"),
    ({"catch_up_timeout": "60"}, "must be a number"),
    ({"catch_up_timeout": -0.5}, "between 0 and"),
    ({"metastore_voters": 3.0}, "3 or 5"),
    ({}, "expected a JSON object"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_settings_are_refused_with_the_field_named(body: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterSettings().update(body)


def test_settings_and_records_decode_strictly() -> None:
    s = ClusterSettings().update({"scale_down_timeout": 12, "scale_up_timeout": 0.5})
    assert ClusterSettings.decode(s.encode()) == s
    assert ClusterSettings.decode(b"{not json") == ClusterSettings()  # defaults, no crash
    older = json.dumps({"scale_down_timeout": 12, "scale_up_timeout": 0.5,
                        "metastore_voters": 5}).encode()  # before max_moves existed
    assert ClusterSettings.decode(older) == ClusterSettings(12, 0.5, 5)
    newer = json.dumps({"scale_down_timeout": 0, "a_later_setting": 1}).encode()
    assert ClusterSettings.decode(newer) == ClusterSettings(scale_down_timeout=0)
    assert ClusterSettings.decode(json.dumps({"scale_down_timeout": -5}).encode()) == \
        ClusterSettings()
    for raw in (b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa5state\xa3bad"):
        with pytest.raises(ValueError, match="malformed liveness record"):
            LivenessRecord.decode(raw)


def test_data_nodes_are_the_topology_without_the_dead_and_never_empty() -> None:
    topo = VersionedValue(b"n1,n2,n3", 5, 1)
    assert data_nodes(topo, None) == (["n1", "n2", "n3"], 5)
    assert data_nodes(topo, VersionedValue(b"n2", 9, 9)) == (["n1", "n3"], 9)
    assert data_nodes(topo, VersionedValue(b"n1,n2,n3", 11, 9)) == (["n1", "n2", "n3"], 11)
    assert data_nodes(None, None) == ([], 0)


# ====================================== the metastore follows the cluster, and drain =====
def _meta_conf(c: Cluster) -> tuple[list[str], list[str]]:
    lead = c.meta_leader()

    def look() -> tuple[list[str], list[str]]:
        conf = c.nodes[lead].groups[c.metas[lead].group].raft.conf
        return sorted(conf.voters), sorted(conf.learners)

    result: tuple[list[str], list[str]] = c.nodes[lead].call(look).result(5)
    return result


def test_a_dead_metastore_voter_is_replaced_and_a_second_loss_costs_nothing(
    cluster: Cluster,
) -> None:
    """Issue 18: the metastore's voters follow the cluster. A founder dies for good: once
    it is dead the spare node (a metastore learner) is promoted and the dead one demoted
    to a learner. Then losing another founder leaves a quorum of the new voters."""
    data = _table_on_all(cluster, scale_down=2.0, scale_up=1.0)
    assert _meta_conf(cluster) == (META, ["n4"])
    cluster.kill("n3")
    wait_for(lambda: _meta_conf(cluster) == (["n1", "n2", "n4"], ["n3"]), 30,
             "n4 promoted in n3's place")
    cluster.wait_converged(TABLE, ["n1", "n2", "n4"], 3, timeout=30)
    victim = "n1" if cluster.meta_leader() != "n1" else "n2"
    cluster.kill(victim)  # two founders gone for good: the metastore still commits
    survivor = next(n for n in ("n1", "n2") if n != victim)
    res = cluster.mgrs[survivor].meta.put(b"app.after", b"two losses").result(15)
    assert res.revision > 0
    _check(cluster, data)


def test_failures_add_up_a_node_declared_dead_no_longer_counts_in_the_majority(
    cluster: Cluster,
) -> None:
    """A dead node stays in the topology until an operator removes it; it must not count
    in the majority the leader needs to hear before it declares anyone dead, or healing
    stops once failures add up (found from outside: three founders and three spares,
    two founders dead and healed, a third node SIGKILLed stayed suspect for good, the
    leader hearing 3 of 6). Here: n3 dead, then a second founder; the leader hears 2 of
    4, but 2 of the 3 not yet dead, so the second is declared dead too and every
    partition moves onto the two nodes left."""
    data = _table_on_all(cluster, scale_down=2.0, scale_up=1.0)
    cluster.kill("n3")
    wait_for(lambda: _meta_conf(cluster) == (["n1", "n2", "n4"], ["n3"]), 30,
             "n4 promoted in n3's place")
    cluster.wait_converged(TABLE, ["n1", "n2", "n4"], 3, timeout=30)
    victim = "n1" if cluster.meta_leader() != "n1" else "n2"
    survivor = next(n for n in ("n1", "n2") if n != victim)
    cluster.kill(victim)
    wait_for(lambda: _state(cluster, survivor, victim) == "dead", 30, f"{victim} dead")
    cluster.wait_converged(TABLE, sorted([survivor, "n4"]), 2, timeout=60)
    _check(cluster, data)


def test_drain_moves_everything_off_a_node_then_it_leaves_the_metastore(
    cluster: Cluster,
) -> None:
    """``drain`` of a founder (a metastore voter) with a spare: its partitions move to
    the other data nodes, the spare takes its metastore vote, and it leaves the
    metastore; its row shows the progress and then disappears."""
    data = _table_on_all(cluster, scale_down=30.0, scale_up=1.0)
    mgr = cluster.mgrs["n2"]
    assert mgr.drain("n1") == ["n2", "n3", "n4"]
    assert mgr.drain("n1") == ["n2", "n3", "n4"]  # again: already draining
    cluster.wait_converged(TABLE, ["n2", "n3", "n4"], 3, timeout=30)
    wait_for(lambda: _meta_conf(cluster) == (["n2", "n3", "n4"], []), 30,
             "n1 out of the metastore")
    wait_for(lambda: "n1" not in _nodes(cluster, "n2"), 10, "n1's row gone")
    cluster.kill("n1")  # drained: the operator stops it (it no longer hears the metastore)
    _check(cluster, data)
    _no_errors(cluster)


@pytest.mark.parametrize("when", ["during", "before"])
def test_a_node_that_dies_before_its_drain_is_done_is_declared_dead_and_leaves(
    cluster: Cluster, when: str,
) -> None:
    """Found from outside: a node SIGKILLed 0.3 s into its drain, or already dead when it
    was drained, stayed draining (shown alive, or unknown) for good: its holds keys, never
    removed by the dead process, read as still hosting. A draining node is now watched and
    declared dead as a topology node is, and then it leaves the metastore and the list."""
    data = _table_on_all(cluster, scale_down=2.0, scale_up=1.0)
    mgr = cluster.mgrs["n1"]
    if when == "before":
        cluster.kill("n4")
        wait_for(lambda: _state(cluster, "n1", "n4") == "dead", 30, "n4 dead")
        mgr.drain("n4")
    else:
        mgr.drain("n4")
        cluster.kill("n4")
    cluster.wait_converged(TABLE, META, 3, timeout=30)
    wait_for(lambda: _meta_conf(cluster) == (META, []), 30, "n4 out of the metastore")
    wait_for(lambda: "n4" not in _nodes(cluster, "n1"), 10, "n4's row gone")
    assert mgr.meta.get(DRAINING_KEY).result(5).value == b""
    wait_for(lambda: mgr.meta.get(DEAD_KEY).result(5).value == b"", 10, "nobody dead")
    _check(cluster, data)


def test_a_dead_voter_drained_without_the_replica_check_leaves_the_metastore(
    cluster: Cluster,
) -> None:
    """``remove-node`` is ``drain(check_replicas=False)``: a founder lost for good is
    replaced by the spare, then leaves the metastore instead of staying a learner the
    leader tracks for ever (found from outside)."""
    data = _table_on_all(cluster, scale_down=2.0, scale_up=1.0)
    cluster.kill("n3")
    wait_for(lambda: _meta_conf(cluster) == (["n1", "n2", "n4"], ["n3"]), 30,
             "n4 promoted in n3's place")
    assert cluster.mgrs["n1"].drain("n3", check_replicas=False) == ["n1", "n2", "n4"]
    wait_for(lambda: _meta_conf(cluster) == (["n1", "n2", "n4"], []), 30,
             "n3 out of the metastore")
    wait_for(lambda: "n3" not in _nodes(cluster, "n1"), 10, "n3's row gone")
    cluster.wait_converged(TABLE, ["n1", "n2", "n4"], 3, timeout=30)
    _check(cluster, data)


def test_a_lost_holds_release_is_sent_again_so_a_live_drain_finishes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found from outside (diagnosed from the metastore's history): a node drained while
    it led the metastore stopped a partition during its leadership transfer; the delete
    of its holds key was dropped with the transfer, sent once and never again, and the
    key of its live incarnation read as hosting for good. Here n4's first holds delete
    fails; the drain must still finish."""
    data = _table_on_all(cluster, scale_down=30.0, scale_up=1.0)
    meta = cluster.mgrs["n4"].meta
    real = meta.invoke
    dropped: list[bytes] = []

    def invoke(conds: Any, ops: Any) -> Any:
        if not dropped and len(ops) == 1 and ops[0].key.startswith(HOLDS_PREFIX):
            dropped.append(ops[0].key)
            fut: Future[Any] = Future()
            fut.set_exception(ProposalDropped("leadership transfer in progress"))
            return fut
        return real(conds, ops)

    monkeypatch.setattr(meta, "invoke", invoke)
    cluster.mgrs["n1"].drain("n4")
    cluster.wait_converged(TABLE, META, 3, timeout=30)
    wait_for(lambda: _meta_conf(cluster) == (META, []), 30, "n4 out of the metastore")
    wait_for(lambda: "n4" not in _nodes(cluster, "n1"), 10, "n4's row gone")
    assert dropped  # the fault was met
    cluster.kill("n4")
    _check(cluster, data)


def test_drain_refuses_an_unknown_node_and_the_last_one(cluster: Cluster) -> None:
    mgr = cluster.mgrs["n1"]
    mgr.set_nodes(["n1"])
    with pytest.raises(UnknownNode, match="n7 is not in the placement topology"):
        mgr.drain("n7")
    with pytest.raises(ValueError, match="last node"):
        mgr.drain("n1")
    with pytest.raises(ValueError):
        mgr.drain("bad id!")
    assert mgr.meta.get(TOPOLOGY_KEY).result(5).value == b"n1"  # nothing changed
    assert mgr.meta.get(DRAINING_KEY).result(5) is None


def test_drain_refuses_to_leave_a_table_fewer_nodes_than_replicas(cluster: Cluster) -> None:
    """Found from outside: draining two of three nodes of a 3-replica table answered 200
    and left every partition one copy, with nothing reporting it. Draining is an
    operator's choice, so it is refused, naming the table, and nothing changes."""
    mgr = cluster.mgrs["n1"]
    mgr.set_nodes(["n1", "n2", "n3"])
    mgr.create_table(TABLE, PARTS, 3)
    wait_for(lambda: mgr.table(TABLE) is not None, 10, "the table cached")
    with pytest.raises(ValueError, match=f"live data node.*{TABLE}'s 3 replicas"):
        mgr.drain("n3")
    assert mgr.meta.get(TOPOLOGY_KEY).result(5).value == b"n1,n2,n3"  # nothing changed
    assert mgr.meta.get(DRAINING_KEY).result(5) is None


def test_a_node_taken_out_of_the_topology_alive_leaves_the_node_list(
    cluster: Cluster,
) -> None:
    """Found from outside: a node removed from the topology while alive kept its row,
    "alive" and counting up, for ever (no look maintains it any more)."""
    mgr = cluster.mgrs["n1"]
    mgr.set_nodes(ALL)
    wait_for(lambda: _state(cluster, "n1", "n4") == "alive", 10, "n4 alive")
    mgr.set_nodes(["n1", "n2", "n3"])
    wait_for(lambda: "n4" not in _nodes(cluster, "n2"), 10, "n4's row gone")


def test_a_change_begun_during_a_transfer_to_a_dead_node_goes_on(cluster: Cluster) -> None:
    """Found from outside (a 256-partition heal run, one partition in five runs): the
    leader balancer had begun moving an idle partition's leadership to a node that then
    died; the change to replace that node began while the transfer was pending, found
    the configuration unsettled, and nothing looked again once the transfer timed out
    (an idle partition applies nothing). It now looks again."""
    mgr = cluster.mgrs["n1"]
    mgr.set_nodes(META)
    mgr.create_table(TABLE, 1, 3)
    cluster.wait_converged(TABLE, META, 3, timeout=20)
    gid = partition_group(TABLE, 0)
    lead = cluster.leader(gid)
    doomed = next(n for n in META if n != lead)
    cluster.kill(doomed)
    cluster.nodes[lead].transfer_leadership(gid, doomed)  # pending for an election timeout
    rest = [n for n in ALL if n != doomed]
    # The killed node may have led the metastore: this write's first try may then time
    # out in the election (setting the topology again is harmless).
    deadline = time.monotonic() + 20
    while True:
        try:
            cluster.mgrs[lead].set_nodes(rest)
            break
        except RequestTimeout:
            if time.monotonic() > deadline:
                raise
    cluster.wait_converged(TABLE, rest, 3, timeout=40)  # a loaded machine: see above


def test_a_metastore_founded_on_one_node_fills_up_to_its_voters(
        tmp_path: Path) -> None:
    """Found outside-in: a cluster founded on one node, the others added as learners
    (docs/wiped-nodes.md's advice), kept that one metastore voter for good, and
    ``metastore_voters`` 5 changed nothing; the founder's loss then stopped placement.
    The metastore leader promotes live spares until it has ``metastore_voters`` voters
    (five once raised); the metastore then survives its founder's loss."""
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    c = Cluster(tmp_path, nodes=nodes, meta=["n1"])
    try:
        for nid in nodes:
            c.start(nid)
        c.mgrs["n1"].set_nodes(nodes)
        wait_for(lambda: _meta_conf(c) == (["n1", "n2", "n3"], ["n4", "n5"]), 30,
                 "two spares promoted")
        c.mgrs["n1"].update_settings({"metastore_voters": 5})
        wait_for(lambda: _meta_conf(c)[0] == nodes, 30, "five voters")
        voters, _ = _meta_conf(c)
        c.kill("n1")  # the founder and leader, for good: the other two voters elect
        survivor = next(n for n in voters if n != "n1")

        def put() -> bool:
            try:  # the first tries reach the dead leader: "replaced before answering"
                return c.mgrs[survivor].meta.put(b"app.after", b"founder lost").result(
                    5).revision > 0
            except (RequestTimeout, ProposalDropped, NotLeader):
                return False

        wait_for(put, 30, "a metastore write without the founder")
    finally:
        c.stop()


def test_two_nodes_founded_on_one_keep_one_metastore_voter(tmp_path: Path) -> None:
    """Found in review of the fill-up: promoting the only spare of a two-node cluster
    made a two-voter metastore, stopped by the loss of either node where one voter is
    stopped only by its own. Filling up aims at an odd count the spares can reach."""
    c = Cluster(tmp_path, nodes=["n1", "n2"], meta=["n1"])
    try:
        for nid in ("n1", "n2"):
            c.start(nid)
        c.mgrs["n1"].set_nodes(["n1", "n2"])
        wait_for(lambda: {r["id"] for r in c.mgrs["n1"].cluster_nodes()} == {"n1", "n2"},
                 20, "both listed")
        time.sleep(3.0)  # several liveness periods
        assert _meta_conf(c) == (["n1"], ["n2"])
    finally:
        c.stop()
