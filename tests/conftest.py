"""Small shared helpers for the core scenario tests (tests/test_core_*.py).

Two ways to drive the core:

- ``Cluster`` (raftkv.testing.cluster) for whole-group scenarios, plus the helpers below to
  seed its nodes with hand-made logs (``cluster_from_logs``) and to hold or count messages.
- A bare ``Raft`` over a ``MemoryLogStore`` (``make_raft`` + ``drain``) when a test needs to
  hand-craft every message a node sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.state_store import KVStateStore, MemoryStateStore

from raftkv.core import (
    Config,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    Raft,
    Ready,
    Role,
)
from raftkv.core.membership import ConfChange, encode_conf_entry
from raftkv.testing.cluster import Cluster
from raftkv.testing.node import SimNode, encode_command
from raftkv.testing.procs import ProcCluster

MT = MessageType


def cmd(i: int, key: str | None = None) -> bytes:
    """A put command the simulator's KV state machine understands."""
    return encode_command(1, i, "put", key if key is not None else f"k{i}", i)


def conf_entry(
    term: int,
    index: int,
    voters: Iterable[str],
    learners: Iterable[str] = (),
    change: ConfChange | None = None,
    auto_promote: Iterable[str] = (),
) -> Entry:
    """A CONF_CHANGE entry carrying the resulting configuration (bootstrap when no change)."""
    conf = ConfState(frozenset(voters), frozenset(learners), frozenset(auto_promote))
    return Entry(term, index, EntryType.CONF_CHANGE, encode_conf_entry(change, conf))


def log_of(spec: Iterable[tuple[int, int]], voters: Iterable[str]) -> list[Entry]:
    """Entries from (index, term) pairs; index 1 becomes the bootstrap configuration."""
    out = []
    for index, term in spec:
        if index == 1:
            out.append(conf_entry(term, 1, voters))
        else:
            out.append(Entry(term, index, EntryType.NORMAL, cmd(index)))
    return out


def terms_log(terms: list[int], voters: Iterable[str]) -> list[Entry]:
    """``terms[i]`` is the term of entry ``i + 1``."""
    return log_of(((i + 1, t) for i, t in enumerate(terms)), voters)


class MaxRng:
    """Always the longest randomized election timeout: ticks never trigger a campaign early."""

    def randrange(self, n: int) -> int:
        return n - 1


def make_raft(
    nid: str,
    voters: Iterable[str] = ("n1", "n2", "n3"),
    entries: list[Entry] | None = None,
    hard: HardState | None = None,
    rng: Any = None,
    **cfg: Any,
) -> Raft:
    """A bare core over a fresh memory store (bootstrapped unless ``entries`` are given)."""
    voters = list(voters)
    store = MemoryLogStore()
    if entries is None:
        entries = [conf_entry(1, 1, voters)]
        hard = hard or HardState(1, None, 1)
    store.save(hard or HardState(), entries)
    return Raft(Config(id=nid, **cfg), store, rng if rng is not None else MaxRng())


def drain(r: Raft) -> Ready:
    """Carry out one Ready for a bare core: persist, (caller sends), advance."""
    rd = r.ready()
    if rd.hard_state is not None or rd.entries or rd.snapshot is not None:
        r.log.storage.save(rd.hard_state, rd.entries, rd.snapshot)
    r.advance(rd)
    return rd


def msg(type: MessageType, frm: str, to: str, term: int, **kw: Any) -> Message:
    return Message(type, to, frm, term, **kw)


def cluster_from_logs(
    spec: dict[str, tuple[HardState, list[Entry]]], seed: int = 0, **config: Any
) -> Cluster:
    """A Cluster whose nodes start from the given hard states and logs (Figure 8 style)."""
    c = Cluster(list(spec), seed=seed, **config)
    for nid, (hard, entries) in spec.items():
        store = MemoryLogStore()
        store.save(hard, entries)
        c.nodes[nid] = SimNode(nid, store, c.seed, **c.config)
    return c


def leaders(c: Cluster) -> list[str]:
    return [nid for nid, n in c.nodes.items() if n.alive and n.raft.role == Role.LEADER]


def tick_until(
    c: Cluster,
    pred: Callable[[], bool],
    nodes: Iterable[str] | None = None,
    max_ticks: int = 200,
) -> int:
    """Tick ``nodes`` one at a time until ``pred()``; returns the number of ticks used."""
    nodes = list(nodes) if nodes is not None else None
    for i in range(max_ticks):
        if pred():
            return i
        c.tick(nodes)
    assert pred(), f"condition not reached within {max_ticks} ticks"
    return max_ticks


class Hold:
    """A Cluster filter that captures (drops now, keeps for later) matching messages."""

    def __init__(self, pred: Callable[[Message], bool]) -> None:
        self.pred = pred
        self.held: list[Message] = []

    def __call__(self, m: Message) -> bool:
        if self.pred(m):
            self.held.append(m)
            return False
        return True

    def release(self, c: Cluster, n: int | None = None) -> list[Message]:
        """Deliver the first ``n`` held messages (all by default), bypassing this filter."""
        n = len(self.held) if n is None else n
        out, self.held = self.held[:n], self.held[n:]
        was = self in c.filters
        if was:
            c.filters.remove(self)
        c.deliver(out)
        if was:
            c.filters.append(self)
        return out


@pytest.fixture(params=["memory", "lmdb"])
def kv_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStateStore]:
    """A fresh KV state store of each kind (``MemoryStateStore``, ``LmdbStateStore``)."""
    s: KVStateStore = (MemoryStateStore() if request.param == "memory"
                       else LmdbStateStore(tmp_path / "kv-store"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def fuse_ok() -> None:
    """Skip, saying why, where the power-loss filesystem cannot mount (no FUSE, no
    mfusepy): tests/test_powerloss_fs.py and tests/test_powerloss.py."""
    from raftkv.testing.powerloss_fs import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"power-loss filesystem unavailable: {reason}")


def read_request_head(conn: Any) -> bytes:
    """The request line of the HTTP request arriving on socket ``conn`` (read up to the
    end of its headers): for tests that play a node answering by hand."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


class RowsHashed:
    """How many rows the state stores' digest builder has hashed since ``n`` was last
    set (the ``rows_hashed`` fixture)."""

    n = 0


@pytest.fixture
def rows_hashed(monkeypatch: pytest.MonkeyPatch) -> RowsHashed:
    """Counts the rows ``raftkv.storage.state_store`` hashes (encoding, checking or
    installing a snapshot image, a memory store's digest)."""
    from raftkv.storage import state_store

    counter = RowsHashed()
    real = state_store.DigestBuilder

    class Counting(real):  # type: ignore[misc, valid-type]
        def add(self, key: bytes, value: bytes) -> None:
            counter.n += 1
            super().add(key, value)

    monkeypatch.setattr(state_store, "DigestBuilder", Counting)
    return counter


@pytest.fixture
def proc_cluster(tmp_path: Path) -> Iterator[ProcCluster]:
    """Three ``raftkv serve`` processes (20 ms ticks) with a leader elected, stopped on
    the way out."""
    with ProcCluster(str(tmp_path), size=3, tick=0.02) as c:
        c.start()
        c.wait_leader()
        yield c
