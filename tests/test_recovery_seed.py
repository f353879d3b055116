"""IGNITE-16907's worked example (issues.apache.org/jira/browse/IGNITE-16907), step by step,
then the same protocol on real LMDB files: replay from the checkpoint, IndexMismatch,
compaction after a forced checkpoint, and restart from an old copy of the state store."""

from __future__ import annotations

import shutil

import pytest
from raftkv.recovery.compaction import CompactionPolicy, compact, maybe_compact
from raftkv.recovery.local import replay
from raftkv.storage.commands import encode_put
from raftkv.storage.errors import IndexMismatch, StorageError
from raftkv.storage.lmdb_log import LmdbLogStore
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.records import ConfState, Entry, HardState
from raftkv.storage.state_store import MemoryStateStore

CONF = ConfState(frozenset({"n1"}))


def raft_put(raft_log, state, index: int, key: bytes, value: bytes) -> None:
    """What the driver does per command: log it (durably), commit, apply with its
    proposedIndex."""
    e = Entry(1, index, 0, encode_put(key, value))
    raft_log.save(HardState(1, "n1", index), [e])
    state.apply([(index, e.data)])


def kv(state) -> dict[bytes, bytes]:
    return dict(state.scan())


def test_seed_worked_example_checkpoint_buffer_3() -> None:
    raft_log, state = MemoryLogStore(), MemoryStateStore()

    # 1. raft.put(k1,v1): log [1], storage [(k1,v1)] index 1, appliedIndex 1
    raft_put(raft_log, state, 1, b"k1", b"v1")
    assert raft_log.last_index() == 1
    assert (kv(state), state.applied_index(), state.checkpoint_index()) == ({b"k1": b"v1"}, 1, 0)

    # 2. raft.put(k2,v2)
    raft_put(raft_log, state, 2, b"k2", b"v2")
    assert (state.applied_index(), state.checkpoint_index()) == (2, 0)

    # 3. raft.put(k3,v3), then the inner storage checkpoint (checkpointBuffer = 3)
    raft_put(raft_log, state, 3, b"k3", b"v3")
    assert state.checkpoint() == 3
    assert (state.applied_index(), state.checkpoint_index()) == (3, 3)

    # 4. raft.put(k4,v4): applied 4, checkpointedData still at 3
    raft_put(raft_log, state, 4, b"k4", b"v4")
    assert (state.applied_index(), state.checkpoint_index()) == (4, 3)

    # 5. node failure: the unsynced (k4,v4) is lost; the log keeps all four
    state.crash()
    assert kv(state) == {b"k1": b"v1", b"k2": b"v2", b"k3": b"v3"}
    assert (state.applied_index(), state.checkpoint_index()) == (3, 3)
    assert raft_log.last_index() == 4

    # 6. restart: raft does not know the checkpoint and applies from index 1 ...
    with pytest.raises(IndexMismatch) as mismatch:
        state.apply([(1, raft_log.entries(1, 2)[0].data)])
    assert mismatch.value.checkpoint_index == 3
    assert kv(state) == {b"k1": b"v1", b"k2": b"v2", b"k3": b"v3"}  # nothing applied

    # ... and replay resolves it by skipping to 3 + 1.
    report = replay(raft_log, state, start=1)
    assert (report.skipped, report.from_index, report.to_index, report.replayed) == (1, 4, 4, 1)

    # 7. recovery result: storage holds k1..k4 at index 4, checkpoint still 3
    assert kv(state) == {b"k1": b"v1", b"k2": b"v2", b"k3": b"v3", b"k4": b"v4"}
    assert (state.applied_index(), state.checkpoint_index()) == (4, 3)

    # 8. raft log truncation: forceCheckpoint, then the log keeps only what follows it
    assert compact(raft_log, state, lambda _: CONF) == 4
    assert state.checkpoint_index() == 4
    assert (raft_log.first_index(), raft_log.last_index(), raft_log.term(4)) == (5, 4, 1)


def _fill(raft_log, state, lo: int, hi: int) -> None:
    entries = [Entry(1, i, 0, encode_put(b"k%05d" % (i % 700), b"v%d" % i)) for i in range(lo, hi)]
    raft_log.save(HardState(1, "n1", hi - 1), entries)
    state.apply([(e.index, e.data) for e in entries])


def test_lmdb_reopen_after_a_clean_close_replays_nothing(tmp_path) -> None:
    """Unsynced LMDB commits survive a process exit (only an OS crash loses them), and
    data and applied index are written in one transaction, so the store reopens at its
    last applied index and replay has nothing to do."""
    log_dir, st_dir = str(tmp_path / "log"), str(tmp_path / "state")
    raft_log, state = LmdbLogStore(log_dir), LmdbStateStore(st_dir)
    _fill(raft_log, state, 1, 2001)
    state.checkpoint()
    _fill(raft_log, state, 2001, 2501)
    live = state.digest()
    raft_log.close()
    state.close()

    raft_log = LmdbLogStore(log_dir, verify_from=2001)
    state = LmdbStateStore(st_dir)
    report = replay(raft_log, state)
    assert (report.replayed, state.applied_index(), state.checkpoint_index()) == (0, 2500, 2500)
    assert state.digest() == live
    assert "nothing to replay" in report.describe()


def test_restart_from_an_old_copy_recovers_the_live_state(tmp_path) -> None:
    """A copy of the state store taken at an old checkpoint, plus the log, recovers to
    exactly the live state (the log is the WAL for everything after the copy)."""
    log_dir, st_dir, old = (str(tmp_path / n) for n in ("log", "state", "old"))
    raft_log, state = LmdbLogStore(log_dir), LmdbStateStore(st_dir)
    _fill(raft_log, state, 1, 1001)
    state.checkpoint()
    state.close()
    shutil.copytree(st_dir, old)  # the copy at checkpoint 1000
    state = LmdbStateStore(st_dir)
    _fill(raft_log, state, 1001, 3001)
    live = state.digest()
    state.close()

    restored = LmdbStateStore(old)
    assert restored.checkpoint_index() == 1000
    report = replay(raft_log, restored)
    assert (report.from_index, report.to_index, report.replayed) == (1001, 3000, 2000)
    assert restored.digest() == live


def test_compaction_never_passes_the_checkpoint_and_the_policy_triggers(tmp_path) -> None:
    raft_log = LmdbLogStore(str(tmp_path / "log"))
    state = LmdbStateStore(str(tmp_path / "state"))
    _fill(raft_log, state, 1, 501)
    policy = CompactionPolicy(max_entries=1000, keep=50)
    assert maybe_compact(raft_log, state, lambda _: CONF, policy) is None
    _fill(raft_log, state, 501, 1201)
    assert maybe_compact(raft_log, state, lambda _: CONF, policy) == 1200
    assert raft_log.first_index() == 1151  # kept 50 entries below the checkpoint
    assert raft_log.snapshot().index == 1200 == state.checkpoint_index()


def test_state_store_behind_the_compacted_log_needs_a_snapshot(tmp_path) -> None:
    raft_log = MemoryLogStore()
    state = MemoryStateStore()
    _fill(raft_log, state, 1, 101)
    compact(raft_log, state, lambda _: CONF)
    fresh = MemoryStateStore()  # a wiped replica: behind the log's first index
    # ... and says what to do about it (found from outside: the node exited saying it
    # needed a snapshot from the leader, and nothing more).
    with pytest.raises(StorageError, match="needs a snapshot.*data directory away.*"
                                           "docs/wiped-nodes.md"):
        replay(raft_log, fresh)


def test_replay_batches_by_bytes_as_well_as_by_entries(
    tmp_path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replay read 10,000 entries per batch whatever their size: 10,000 of a bulk load's
    4 MiB batches would be 40 GB in memory at once. It now stops a batch about where its
    commands pass ``BATCH_BYTES``, and still replays every entry, in order."""
    from raftkv.recovery import local

    monkeypatch.setattr(local, "BATCH_BYTES", 1 << 20)
    raft_log = LmdbLogStore(str(tmp_path / "log"))
    big = [Entry(1, i, 0, encode_put(b"k%03d" % i, b"x" * 300_000)) for i in range(1, 41)]
    raft_log.save(HardState(1, "n1", 40), big)
    state = MemoryStateStore()
    sizes: list[int] = []
    apply = state.apply

    def counted(entries):  # type: ignore[no-untyped-def]
        sizes.append(len(entries))
        return apply(entries)

    monkeypatch.setattr(state, "apply", counted)
    report = replay(raft_log, state)
    assert report.replayed == 40 and state.applied_index() == 40
    assert max(sizes) <= 4 and sum(sizes) == 40  # 4 x 300 KB passes 1 MB
    assert state.get(b"k040") == b"x" * 300_000
    raft_log.close()
