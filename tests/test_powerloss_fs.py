"""The power-loss filesystem (raftkv.testing.powerloss_fs, issue 22): what is not synced
is gone after a power loss, what is synced stays, a torn loss forgets a seeded subset of
pages, and LMDB (and raftkv's LMDB stores) run on it.

The undo model is checked on a plain file first (no FUSE needed). Everything else mounts
the filesystem and skips, saying why, where FUSE, libfuse 3 or mfusepy are missing
(``make`` installs them: ``apt-get install fuse3`` as root, ``pip install
'raftkv[powerloss]'``).
"""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest
from raftkv.storage.durable_fs import ensure_durable, fsync_dir
from raftkv.storage.lmdb_log import LmdbLogStore
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.records import Entry, EntryType, HardState

from raftkv.testing.powerloss_fs import (
    PAGE_SIZE,
    MountBusy,
    PowerLossFS,
)
from raftkv.testing.powerloss_undo import DataUndo, Journal

P = PAGE_SIZE


def page(tag: bytes, i: int) -> bytes:
    """A page that says what it is (``tag`` and its number), so a mixed file can be read
    back page by page."""
    return (tag + b"%05d" % i).ljust(P, tag[:1])


def write_file(path: Path, data: bytes, sync: Callable[[int], None] | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            sync(f.fileno())


# -- the undo model on a plain file ------------------------------------------------------------
def test_the_undo_log_gives_back_the_durable_bytes_and_size(tmp_path: Path) -> None:
    """Writes, a cut and an extension after the last sync are all taken back: the file is
    byte for byte what it was at the sync (powerloss_undo's invariant)."""
    path = tmp_path / "f"
    durable = b"".join(page(b"o", i) for i in range(5)) + b"tail"
    path.write_bytes(durable)
    undo = DataUndo()
    fd = os.open(path, os.O_RDWR)
    try:
        undo.before_write(fd, "f", P + 10, 3 * P)
        os.pwrite(fd, b"n" * 3 * P, P + 10)
        undo.before_truncate(fd, "f", P // 2)
        os.ftruncate(fd, P // 2)
        undo.before_write(fd, "f", 9 * P, 100)
        os.pwrite(fd, b"x" * 100, 9 * P)
        assert undo.unsynced() == (1, 7)  # pages 0-5 (the tail shares page 5) and 9
        losses = undo.forget(0.0, random.Random(0))
    finally:
        os.close(fd)
    assert path.read_bytes() == durable
    assert losses[0].size_after == len(durable) and not losses[0].pages_kept
    assert undo.unsynced() == (0, 0)


def test_the_journal_undoes_names_newest_first_and_commits_a_prefix(tmp_path: Path) -> None:
    """An atomic replace, a removal and a new directory are undone in reverse order; after
    a commit nothing is undone and the trash is empty."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_bytes(b"old")
    (root / "gone").write_bytes(b"kept by the trash")
    journal = Journal(str(tmp_path / "trash"))
    (root / "a.tmp").write_bytes(b"new")
    journal.created(str(root / "a.tmp"))
    journal.rename(str(root / "a.tmp"), str(root / "a"))
    journal.remove(str(root / "gone"), is_dir=False)
    os.mkdir(root / "d")
    journal.created(str(root / "d"))
    with pytest.raises(IsADirectoryError):
        journal.remove(str(root / "d"), is_dir=False)
    assert len(journal.undo()) == 4
    assert sorted(p.name for p in root.iterdir()) == ["a", "gone"]
    assert (root / "a").read_bytes() == b"old"
    assert (root / "gone").read_bytes() == b"kept by the trash"
    journal.remove(str(root / "gone"), is_dir=False)
    assert journal.commit() == 1 and journal.undo() == []
    assert not (root / "gone").exists() and not list((tmp_path / "trash").iterdir())


# -- the filesystem ------------------------------------------------------------------------------
@pytest.fixture
def make_fs(fuse_ok: None, tmp_path: Path) -> Iterator[Callable[..., PowerLossFS]]:
    made: list[PowerLossFS] = []

    def make(metadata: str = "strict") -> PowerLossFS:
        fs = PowerLossFS(tmp_path / f"disk{len(made)}", tmp_path / f"mnt{len(made)}",
                         metadata=metadata).start()
        made.append(fs)
        return fs

    yield make
    for fs in made:
        fs.close(kill_users=True)


@pytest.fixture
def fs(make_fs: Callable[..., PowerLossFS]) -> PowerLossFS:
    return make_fs()


def test_a_write_without_fsync_is_gone_after_a_power_loss(fs: PowerLossFS) -> None:
    mnt = fs.mountpoint
    write_file(mnt / "old", b"durable", os.fsync)
    fsync_dir(mnt)
    write_file(mnt / "old", b"overwritten, never synced")
    write_file(mnt / "new", b"in a new file, never synced")
    fsync_dir(mnt)  # the name is durable, its data is not
    assert (mnt / "old").read_bytes() == b"overwritten, never synced"  # the cache has it
    report = fs.power_loss()
    assert (mnt / "old").read_bytes() == b"durable"
    assert (mnt / "new").read_bytes() == b""  # ext4's classic empty file
    assert {f.name for f in report.files} == {"/old", "/new"}
    assert fs.stats().power_losses == 1 and fs.stats().mounts == 2


@pytest.mark.parametrize("sync", [os.fsync, os.fdatasync], ids=["fsync", "fdatasync"])
def test_a_synced_write_survives(fs: PowerLossFS, sync: Callable[[int], None]) -> None:
    mnt = fs.mountpoint
    write_file(mnt / "f", b"synced", sync)
    fsync_dir(mnt)
    stats = fs.stats()
    assert stats.unsynced_pages == 0 and stats.pending_namespace_ops == 0
    assert (stats.fsyncs, stats.fdatasyncs) == ((1, 0) if sync is os.fsync else (0, 1))
    fs.power_loss()
    assert (mnt / "f").read_bytes() == b"synced"


def test_only_the_pages_written_since_the_last_sync_are_lost(fs: PowerLossFS) -> None:
    """Written in two rounds: the first synced, the second (new pages and an overwrite of
    a synced one) not. The first round is back whole, the second gone, the size too."""
    path = fs.mountpoint / "f"
    first = b"".join(page(b"a", i) for i in range(4))
    write_file(path, first, os.fdatasync)
    fsync_dir(fs.mountpoint)
    with open(path, "r+b") as f:
        f.seek(P)
        f.write(page(b"b", 1))
        f.seek(4 * P)
        f.write(b"".join(page(b"b", i) for i in range(4, 8)))
    assert fs.stats().unsynced_pages == 5
    fs.power_loss()
    assert path.read_bytes() == first


def _torn_round(fs: PowerLossFS, seed: int) -> tuple[set[int], set[int]]:
    """Sync 32 old pages, overwrite them all and add 8 without syncing, lose power torn
    with ``seed``: which pages kept their new bytes, as read and as reported."""
    path = fs.mountpoint / "f"
    write_file(path, b"".join(page(b"o", i) for i in range(32)), os.fsync)
    fsync_dir(fs.mountpoint)
    with open(path, "r+b") as f:
        f.write(b"".join(page(b"n", i) for i in range(40)))
    report = fs.power_loss(torn=True, seed=seed)
    data = path.read_bytes()
    (loss,) = report.files
    assert report.seed == seed and sorted(loss.pages_kept + loss.pages_forgotten) == list(range(40))
    read_new = set()
    for i in range(len(data) // P):
        chunk = data[i * P:(i + 1) * P]
        if chunk == page(b"n", i):
            read_new.add(i)
        elif i < 32:
            assert chunk == page(b"o", i), f"page {i} is neither old nor new: torn inside"
        else:
            assert chunk == bytes(P), f"page {i} (never synced) is neither new nor zeros"
    # The size change is one draw: kept, the file has 40 pages; forgotten, 32, and the
    # pages past 32 are gone whatever their draw said.
    assert len(data) in (32 * P, 40 * P) and len(data) == loss.size_after
    kept = {i for i in loss.pages_kept if i * P < len(data)}
    return read_new, kept


def test_a_torn_power_loss_forgets_a_seeded_subset_of_pages(fs: PowerLossFS) -> None:
    new, kept = _torn_round(fs, seed=11)
    assert new == kept and 0 < len(new) < 32
    again, _ = _torn_round(fs, seed=11)
    assert again == new  # one seed, one set of pages
    other, _ = _torn_round(fs, seed=12)
    assert other != new


def test_truncate_down_and_up_and_o_trunc_are_undone(fs: PowerLossFS) -> None:
    mnt = fs.mountpoint
    durable = b"".join(page(b"o", i) for i in range(5))
    for name in ("cut", "grown", "otrunc"):
        write_file(mnt / name, durable, os.fsync)
    fsync_dir(mnt)
    os.truncate(mnt / "cut", P + 100)
    with open(mnt / "cut", "r+b") as f:
        f.truncate(9 * P)  # up again, over the bytes the cut zeroed
        f.seek(8 * P)
        f.write(b"end")
    os.truncate(mnt / "grown", 20 * P)
    write_file(mnt / "otrunc", b"short")  # open(O_TRUNC): the kernel passes it inside open
    fs.power_loss()
    for name in ("cut", "grown", "otrunc"):
        assert (mnt / name).read_bytes() == durable, name


@pytest.mark.parametrize("metadata", ["strict", "journal", "durable"])
def test_namespace_operations_follow_the_metadata_policy(
        make_fs: Callable[..., PowerLossFS], metadata: str) -> None:
    """strict: names change durably only with a directory fsync; journal: a file's fsync
    commits them too; durable: at once. Data always needs its own sync."""
    fs = make_fs(metadata)
    mnt = fs.mountpoint
    write_file(mnt / "a", b"old a", os.fsync)
    write_file(mnt / "gone", b"removed", os.fsync)
    fsync_dir(mnt)
    write_file(mnt / "a.tmp", b"new a", os.fsync)  # the atomic-replace pattern, minus
    os.rename(mnt / "a.tmp", mnt / "a")            # the directory fsync
    os.unlink(mnt / "gone")
    os.mkdir(mnt / "d")
    write_file(mnt / "d" / "new", b"data never synced")
    write_file(mnt / "synced", b"synced data", os.fsync)
    report = fs.power_loss()
    names = sorted(p.name for p in mnt.iterdir())
    if metadata == "strict":
        assert names == ["a", "gone"]
        assert (mnt / "a").read_bytes() == b"old a"
        assert (mnt / "gone").read_bytes() == b"removed"
        assert len(report.namespace_undone) == 6
    else:
        assert names == ["a", "d", "synced"]
        assert (mnt / "a").read_bytes() == b"new a"
        assert (mnt / "synced").read_bytes() == b"synced data"
        # journal: the last fsync committed "d/new"'s creation, not its data.
        assert (mnt / "d" / "new").read_bytes() == b""
        assert report.namespace_undone == []
    assert not list(fs.state_dir.joinpath("trash").iterdir())


@pytest.mark.parametrize("ensured", [True, False], ids=["ensured", "control"])
def test_ensure_durable_makes_a_name_left_by_a_crash_durable(fs: PowerLossFS,
                                                             ensured: bool) -> None:
    """A marker written as ``write_durable`` does, by a process that died between the
    rename and the directory fsync: its bytes are synced, its name is not. A restart
    that finds the right bytes (``ensure_durable``) does not rewrite the file but syncs
    the directory, so the name survives a power loss; without it (the control) it does
    not. A marker with other bytes is replaced, durably."""
    mnt = fs.mountpoint
    write_file(mnt / "gen.tmp", b"11\n", os.fsync)
    os.rename(mnt / "gen.tmp", mnt / "gen")
    inode = os.stat(mnt / "gen").st_ino
    if ensured:
        assert ensure_durable(str(mnt / "gen"), b"11\n") is False
        assert os.stat(mnt / "gen").st_ino == inode  # not rewritten
    fs.power_loss()
    assert (mnt / "gen").exists() is ensured
    assert ensure_durable(str(mnt / "gen"), b"12\n") is True
    fs.power_loss()
    assert (mnt / "gen").read_bytes() == b"12\n"


def test_mmap_reads_see_writes_and_mmap_writes_are_tracked(fs: PowerLossFS) -> None:
    """LMDB reads its data file through a shared read-only map while writing it with
    pwrite, and writes its lock file through a shared writable map."""
    path = fs.mountpoint / "f"
    write_file(path, b"".join(page(b"o", i) for i in range(4)), os.fsync)
    fsync_dir(fs.mountpoint)
    with open(path, "r+b") as f:
        ro = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        os.pwrite(f.fileno(), page(b"w", 2), 2 * P)
        assert ro[2 * P:3 * P] == page(b"w", 2)
        ro.close()
        rw = mmap.mmap(f.fileno(), 0)
        rw[0:P] = page(b"m", 0)
        # msync(MS_SYNC) reaches the filesystem as a write and an fsync of the file,
        # which makes the pwrite of page 2 durable too.
        rw.flush()
        rw[P:2 * P] = page(b"m", 1)  # written back at close, never synced
        rw.close()
    fs.power_loss()
    data = path.read_bytes()
    assert data[:P] == page(b"m", 0) and data[2 * P:3 * P] == page(b"w", 2)
    assert data[P:2 * P] == page(b"o", 1)


def test_fcntl_and_flock_locks_are_enforced_by_the_kernel(fs: PowerLossFS) -> None:
    """No lock operation is implemented, so the kernel keeps the locks of the mount
    itself: another process is refused, as on a local filesystem."""
    import fcntl

    path = fs.mountpoint / "lock"
    probe = textwrap.dedent(f"""
        import fcntl
        f = open({str(path)!r}, "r+")
        for name, take in (("fcntl", fcntl.lockf), ("flock", fcntl.flock)):
            try:
                take(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                print(name, "taken")
            except OSError:
                print(name, "refused")
    """)
    with open(path, "w") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        fcntl.flock(f, fcntl.LOCK_EX)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split("\n")
    assert out[:2] == ["fcntl refused", "flock refused"]


def test_a_power_loss_refuses_while_this_process_uses_the_mount(fs: PowerLossFS) -> None:
    with open(fs.mountpoint / "f", "w"):
        with pytest.raises(MountBusy) as e:
            fs.power_loss(kill_users=True)
        assert os.getpid() in e.value.pids
    assert fs.mounted
    fs.power_loss()


# -- LMDB on the mount -------------------------------------------------------------------------
_WRITER = """
import sys, lmdb
sync = sys.argv[2] == "sync"
env = lmdb.open(sys.argv[1], map_size=1 << 24, sync=sync, metasync=sync)
with env.begin(write=True) as txn:
    for i in range(500):
        txn.put(b"k%03d" % i, b"v" * 100)
print("committed", flush=True)
sys.stdin.read()  # alive, env open, until the power goes
"""


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_lmdb_commits_survive_a_power_loss_only_when_synced(
        fs: PowerLossFS, sync: bool) -> None:
    """The harness tells a missing fsync from a present one, which a SIGKILL cannot: the
    writer is killed in both cases, after a commit that is in the page cache either
    way; only the synced one is there after the power loss."""
    env_dir = fs.mountpoint / "env"
    with lmdb.open(str(env_dir), map_size=1 << 24) as env, env.begin(write=True) as txn:
        txn.put(b"base", b"line")
    fsync_dir(env_dir)  # LMDB never fsyncs the directory it creates its files in
    fsync_dir(fs.mountpoint)
    syncs_before = fs.stats().fdatasyncs
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(env_dir),
                               "sync" if sync else "nosync"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "committed\n"
        assert (fs.stats().fdatasyncs > syncs_before) == sync
        report = fs.power_loss(kill_users=True)
    finally:
        writer.kill()
        writer.wait()
    # lock.mdb (the reader table, written through its map) is never synced: no matter.
    lost = {f.name: f.pages_forgotten for f in report.files}
    assert bool(lost.get("/env/data.mdb")) != sync
    with lmdb.open(str(env_dir), map_size=1 << 24) as env, env.begin() as txn:
        assert txn.get(b"base") == b"line"
        assert txn.stat()["entries"] == (501 if sync else 1)


def test_raftkv_lmdb_stores_open_on_the_mount(make_fs: Callable[..., PowerLossFS]) -> None:
    """The Raft log (synced per save) keeps its entries; the state store (MDB_NOSYNC)
    rolls back to its last checkpoint, consistent, with its applied index. (A clean
    close checkpoints; here the writer dies without one, in a child process.)"""
    fs = make_fs("journal")  # LMDB fsyncs its data file but never the directory
    log_dir, state_dir = fs.mountpoint / "log", fs.mountpoint / "state"
    log = LmdbLogStore(str(log_dir))
    log.save(HardState(3, "n1", 2),
             [Entry(3, i, EntryType.NORMAL, b"e%d" % i) for i in range(1, 6)])
    log.close()
    child = textwrap.dedent(f"""
        import os
        from raftkv.storage.commands import encode_put
        from raftkv.storage.lmdb_state import LmdbStateStore
        state = LmdbStateStore({str(state_dir)!r})
        state.apply([(1, encode_put(b"k", b"checkpointed"))])
        state.checkpoint()
        state.apply([(2, encode_put(b"k", b"after the checkpoint"))])
        assert state.get(b"k") == b"after the checkpoint"
        os._exit(0)  # no close: no checkpoint
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    report = fs.power_loss()
    assert report.pages_forgotten > 0  # the state store's unsynced commit
    log = LmdbLogStore(str(log_dir))
    try:
        assert log.initial_state()[0] == HardState(3, "n1", 2)
        assert [e.data for e in log.entries(1, 6)] == [b"e%d" % i for i in range(1, 6)]
    finally:
        log.close()
    state = LmdbStateStore(state_dir)
    try:
        assert state.applied_index() == 1 and state.get(b"k") == b"checkpointed"
    finally:
        state.close()
