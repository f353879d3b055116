"""Partition group ids carry the table's generation on the wire (issue 14 item 4: "a
re-created table can never receive the old table's messages from a node that lags the
drop").

Real nodes on 127.0.0.1. The same group id is hosted under two generations, as it is
when a table is dropped and created again while one node still runs the old table's
partition: the old incarnation's frames (votes, appends, forwarded proposals) must never
reach the new group, and a group of the same generation works as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from raftkv.storage.commands import encode_put

from raftkv.node.driver import Node, NodeConfig
from raftkv.node.errors import NodeStopped, RemoteError
from raftkv.node.stores import open_group_storage
from raftkv.placement.catalog import partition_group, partition_wire_id
from raftkv.testing.procs import free_ports

GID = partition_group("users", 0)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(2))}
    out = {nid: Node(NodeConfig(nid, addr, b"wire-secret", peers=peers,
                                data_dir=str(tmp_path / nid)))
           for nid, addr in peers.items()}
    for n in out.values():
        n.start()
    yield out
    for n in out.values():
        n.stop()


def _host(node: Node, tmp: Path, voters: list[str], generation: int) -> None:
    storage = open_group_storage(str(tmp / node.id), GID)
    node.call(lambda: node.add_group(GID, storage, voters, birth_known=True,
                                     wire_id=partition_wire_id(GID, generation))).result(5)


def _leader(node: Node, within: float) -> str | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        g = node.groups.get(GID)
        if g is not None and g.leader is not None:
            return g.leader
        time.sleep(0.02)
    return None


def test_a_group_of_an_earlier_generation_never_reaches_the_new_one(
    nodes: dict[str, Node], tmp_path: Path,
) -> None:
    # n1 runs the old table's partition (generation 3), n2 the re-created one
    # (generation 9), both founded by {n1, n2}: with one id on the wire, n1's vote
    # requests would count in n2's group and one of them would lead both.
    _host(nodes["n1"], tmp_path, ["n1", "n2"], 3)
    _host(nodes["n2"], tmp_path, ["n1", "n2"], 9)
    assert _leader(nodes["n1"], 2.0) is None
    assert _leader(nodes["n2"], 0.1) is None
    for nid in ("n1", "n2"):
        assert nodes[nid].groups[GID].raft.log.last_index() == 1  # the bootstrap only


def test_a_forwarded_proposal_for_another_generation_is_refused(
    nodes: dict[str, Node], tmp_path: Path,
) -> None:
    # n2 leads the new generation alone; n1 still hosts the old one (a learner-less
    # single voter that cannot lead: its configuration names n2 only) and forwards a
    # write to n2 as the old group's leader.
    _host(nodes["n2"], tmp_path, ["n2"], 9)
    assert _leader(nodes["n2"], 5.0) == "n2"
    _host(nodes["n1"], tmp_path, ["n2"], 3)
    nodes["n1"].groups[GID].leader = "n2"  # what it last knew of the old group
    fut = nodes["n1"].propose(GID, encode_put(b"k", b"old table"))
    with pytest.raises(RemoteError, match="does not host group .t.users.0@3."):
        fut.result(5)
    assert nodes["n2"].groups[GID].state.get(b"k") is None


def test_the_same_generation_elects_and_replicates(
    nodes: dict[str, Node], tmp_path: Path,
) -> None:
    _host(nodes["n1"], tmp_path, ["n1", "n2"], 9)
    _host(nodes["n2"], tmp_path, ["n1", "n2"], 9)
    lead = _leader(nodes["n1"], 10.0)
    assert lead in ("n1", "n2")
    nodes[lead].propose(GID, encode_put(b"k", b"v")).result(5)


def test_a_write_forwarded_for_the_old_generation_never_lands_in_the_new_one(
    nodes: dict[str, Node], tmp_path: Path,
) -> None:
    """Found by a review: a forwarded write's waiter named its group by id, so a NotLeader
    answer re-parked it on whatever group held the id by then, the re-created table's."""
    n1 = nodes["n1"]
    _host(nodes["n2"], tmp_path, ["n1"], 3)  # the old generation; cannot lead it
    old = open_group_storage(str(tmp_path / "n1-old"), GID)
    new = open_group_storage(str(tmp_path / "n1-new"), GID)
    fut: Future[Any] = Future()

    def forward_then_recreate() -> None:
        # In one loop turn: the write goes to n2 (the old group's leader, as n1 last knew
        # it), then the table is dropped and created again, before n2's answer (NotLeader)
        # comes back. (The driver's own entry point, to fix that interleaving.)
        g = n1.add_group(GID, old, ["n2"], birth_known=True,
                         wire_id=partition_wire_id(GID, 3))
        g.leader = "n2"
        n1._propose_or_forward(g, encode_put(b"k", b"old table"), fut)
        n1.remove_group(GID)
        n1.add_group(GID, new, ["n1"], birth_known=True, wire_id=partition_wire_id(GID, 9))

    n1.call(forward_then_recreate).result(5)
    with pytest.raises(NodeStopped, match="no longer hosted"):
        fut.result(8)
    assert _leader(n1, 5.0) == "n1"
    assert n1.call(lambda: n1.groups[GID].state.get(b"k")).result(5) is None
