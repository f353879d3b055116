"""The metastore group on real nodes (TCP on 127.0.0.1): invokes from any node, typed
results across forwarding, linearizable reads, and watches that resume gap-free on
another node after the metastore leader stops (seed 004 relies on exactly this)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raftkv.node.driver import Node, NodeConfig
from raftkv.placement import meta_commands as mc
from raftkv.placement.service import MetaService
from raftkv.testing.procs import free_ports

Cond, Op = mc.Cond, mc.Op


@pytest.fixture
def metas(tmp_path: Path) -> Iterator[dict[str, MetaService]]:
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}
    out = {}
    for nid, addr in peers.items():
        node = Node(NodeConfig(nid, addr, b"meta-secret", peers=peers,
                               data_dir=str(tmp_path / nid)))
        out[nid] = MetaService(node, str(tmp_path / nid), sorted(peers))
        node.start()
    yield out
    for m in out.values():
        m.node.stop()  # idempotent: a test may have stopped some already


def _leader(metas: dict[str, MetaService]) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for nid, m in metas.items():
            g = m.node.groups[m.group]
            if g.leader == nid:
                return nid
        time.sleep(0.02)
    raise TimeoutError("no metastore leader")


def test_invoke_from_a_follower_returns_the_typed_result(metas: dict[str, MetaService]) -> None:
    lead = _leader(metas)
    follower = next(m for n, m in metas.items() if n != lead)
    r = follower.put(b"a", b"1").result(5)
    assert isinstance(r, mc.WriteResult) and r.revision == 1
    ok = follower.invoke([Cond.value(b"a").eq(b"1")], [Op.put(b"b", b"2")]).result(5)
    assert ok == mc.InvokeResult(True, 2)
    no = follower.invoke([Cond.not_exists(b"a")], [Op.put(b"c", b"3")]).result(5)
    assert no == mc.InvokeResult(False, 2)
    for m in metas.values():  # linearizable: every node sees both writes
        entry = m.get(b"b").result(5)
        assert entry is not None and entry.value == b"2" and entry.mod_revision == 2


def test_a_watch_waits_for_the_next_event_and_resumes_elsewhere_without_gaps(
    metas: dict[str, MetaService],
) -> None:
    lead = _leader(metas)
    others = [n for n in metas if n != lead]
    watcher = metas[others[0]].watch(b"p/", 1, timeout=10)
    time.sleep(0.2)
    assert not watcher.done()  # nothing yet: the long poll waits
    metas[others[1]].put(b"p/x", b"1").result(5)
    batch = watcher.result(5)
    assert [(e.revision, e.key) for e in batch.events] == [(1, b"p/x")]
    seen = batch.events[-1].revision
    metas[lead].put(b"p/y", b"2").result(5)
    metas[lead].put(b"q/z", b"3").result(5)  # another prefix: not for this watcher
    metas[lead].node.stop()  # the metastore leader goes away
    survivor = metas[others[1]]
    # Wait for the survivors' new leader: a write forwarded to the stopped one would have
    # an unknown outcome, and retrying it could record the event twice.
    del metas[lead]
    _leader(metas)
    metas[others[0]].put(b"p/w", b"4").result(10)
    got = survivor.watch(b"p/", seen + 1, timeout=10).result(10)
    assert [(e.key, e.value) for e in got.events] == [(b"p/y", b"2"), (b"p/w", b"4")]
    revs = [e.revision for e in got.events]
    assert revs == sorted(revs) and revs[0] == seen + 1


def test_an_idle_watch_times_out_with_an_empty_batch(metas: dict[str, MetaService]) -> None:
    _leader(metas)
    batch = metas["n1"].watch(b"nothing/", 1, timeout=0.3).result(5)
    assert batch.events == [] or list(batch.events) == []
