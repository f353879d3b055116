"""Linearizable reads on real nodes: the reads one loop turn receives share one ReadIndex
round (``Node._flush_reads``), and a read waiting on a leader that dies is asked of the
next leader (``Node._on_soft_state``), not left to the request timeout.

Found from outside (tests/test_heal_procs.py): a table read through a follower took 5.45 s
when the partition's leader was SIGKILLed, though a new leader was elected in 1.4 s: the
follower had sent its ReadIndex request to the dead leader and waited out the 5 s request
timeout. Real nodes on 127.0.0.1, a request timeout of 30 s so the two behaviours cannot
be confused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from raftkv.storage.commands import encode_put

from raftkv.core import ConfChange, ConfChangeOp, ConfChangeRejected
from raftkv.node.driver import Node, NodeConfig
from raftkv.node.stores import open_group_storage
from raftkv.testing.procs import free_ports

GID = "g"
TIMEOUT = 30.0


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}
    out = {nid: Node(NodeConfig(nid, addr, b"reads-secret", peers=peers,
                                data_dir=str(tmp_path / nid), request_timeout=TIMEOUT,
                                quiesce=False))
           for nid, addr in peers.items()}
    for nid, n in out.items():
        n.start()
        storage = open_group_storage(str(tmp_path / nid), GID)
        n.call(lambda n=n, s=storage: n.add_group(GID, s, sorted(peers),
                                                   birth_known=True)).result(5)
    yield out
    for n in out.values():
        n.stop()


def _leader(nodes: dict[str, Node], among: list[str], within: float = 10.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        leads = {nodes[n].groups[GID].leader for n in among}
        if len(leads) == 1 and None not in leads:
            lead = leads.pop()
            assert lead is not None
            if lead in among:
                return lead
        time.sleep(0.02)
    raise AssertionError("no leader")


@pytest.mark.parametrize("where", ["leader", "follower"])
def test_the_reads_of_one_turn_share_one_read_index_round(
    nodes: dict[str, Node], where: str,
) -> None:
    """Twenty reads queued by one loop call run in the same turn: the leader confirms
    one read point for all of them (one heartbeat round, not twenty), and each read
    still gets its own answer, which reflects every write acknowledged before it."""
    lead = _leader(nodes, list(nodes))
    node = nodes[lead] if where == "leader" else nodes[next(n for n in nodes if n != lead)]
    for i in range(20):
        nodes[lead].propose(GID, encode_put(b"k%d" % i, b"v%d" % i)).result(5)
    leader_reads = nodes[lead].groups[GID].raft.read_only
    before = leader_reads._seq

    def ask() -> list[Future[Any]]:
        return [node.read(GID, lambda s, i=i: s.get(b"k%d" % i)) for i in range(20)]

    reads = node.call(ask).result(5)
    assert [r.result(5) for r in reads] == [b"v%d" % i for i in range(20)]
    assert leader_reads._seq - before == 1


def test_a_read_sent_to_a_leader_that_dies_is_answered_by_the_next(
    nodes: dict[str, Node],
) -> None:
    lead = _leader(nodes, list(nodes))
    nodes[lead].propose(GID, encode_put(b"k", b"v")).result(5)
    follower = next(n for n in nodes if n != lead)
    time.sleep(0.3)  # the follower has applied the write
    nodes[lead].stop()  # its ReadIndex request below goes nowhere
    t0 = time.monotonic()
    got = nodes[follower].read(GID, lambda s: s.get(b"k")).result(TIMEOUT + 5)
    took = time.monotonic() - t0
    assert got == b"v"
    # An election (at most two election timeouts of 1 s, plus the pre-vote round),
    # not the 30 s request timeout.
    assert took < TIMEOUT / 3, f"the read waited {took:.1f}s"
    survivors = [n for n in nodes if n != lead]
    assert _leader(nodes, survivors) in survivors


def test_a_removal_meant_for_a_learner_never_removes_a_voter(
    nodes: dict[str, Node],
) -> None:
    """``change_membership(..., learner_only=True)``: the placement layer decides to drop
    a learner on one loop call and proposes on a later one; if the core promoted it in
    between, the removal must not take out a voter (that needs the removal phase's
    quorum checks)."""
    lead = _leader(nodes, list(nodes))
    voter = next(n for n in nodes if n != lead)
    cc = ConfChange(ConfChangeOp.REMOVE, voter)
    with pytest.raises(ConfChangeRejected, match="no longer a learner"):
        nodes[lead].change_membership(GID, cc, learner_only=True).result(5)
    assert voter in nodes[lead].groups[GID].raft.conf.voters
