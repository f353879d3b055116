"""The pinned checkpoint of the MDB_NOSYNC state stores (raftkv.storage.lmdb_checkpoint),
without FUSE: what a crash leaves is made by hand (a child that exits without closing,
meta pages overwritten, a record at 0); tests/test_powerloss.py does it with real power
losses."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from raftkv.storage.commands import encode_put
from raftkv.storage.errors import StorageError
from raftkv.storage.lmdb_checkpoint import RECORD_FILE, CheckpointFile, read_metas
from raftkv.storage.lmdb_state import LmdbStateStore

from raftkv.placement.metastore import MetaStore


def _crash_after(path: Path, script: str) -> None:
    """Run ``script`` on an open store at ``path`` in a child that dies without closing."""
    code = textwrap.dedent(f"""
        import os
        from raftkv.storage.commands import encode_put
        from raftkv.storage.lmdb_state import LmdbStateStore
        s = LmdbStateStore({str(path)!r})
    """) + textwrap.dedent(script) + "\nos._exit(0)\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_unclean_shutdown_rolls_back_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _crash_after(path, """
        s.apply([(1, encode_put(b"k", b"one"))])
        s.checkpoint()
        for i in range(2, 40):
            s.apply([(i, encode_put(b"k%d" % i, b"x" * 3000))])
    """)
    _, metas = read_metas(str(path / "data.mdb"))
    rec = CheckpointFile(str(path), "t").read()
    assert rec is not None and rec.applied == 1 and max(metas)[0] > rec.txnid
    s = LmdbStateStore(path)
    try:
        assert s.applied_index() == s.checkpoint_index() == 1
        assert dict(s.scan()) == {b"k": b"one"}
        s.apply([(2, encode_put(b"k", b"two"))])  # and it goes on from there
    finally:
        s.close()
    s = LmdbStateStore(path)  # a clean close checkpointed: nothing rolled back
    try:
        assert s.applied_index() == 2 and s.get(b"k") == b"two"
    finally:
        s.close()


def test_a_torn_meta_page_is_replaced_by_the_recorded_one(tmp_path: Path) -> None:
    """The disk kept a later transaction's meta page and not its data (a torn power
    loss): the record's meta page is written back before LMDB maps the file."""
    path = tmp_path / "s"
    s = LmdbStateStore(path)
    s.apply([(1, encode_put(b"k", b"one"))])
    s.close()
    data = str(path / "data.mdb")
    psize, metas = read_metas(data)
    txnid, meta = max(metas)
    forged = bytearray(meta)
    struct.pack_into("<QQ", forged, 120, 10**6, txnid + 7)  # last_pgno far away, newer
    with open(data, "r+b") as f:
        f.seek(((txnid + 7) % 2) * psize + 16)
        f.write(forged)
    s = LmdbStateStore(path)
    try:
        assert s.applied_index() == 1 and s.get(b"k") == b"one"
    finally:
        s.close()


def test_an_interrupted_creation_is_made_again(tmp_path: Path) -> None:
    path = tmp_path / "s"
    LmdbStateStore(path).close()
    raw = (path / RECORD_FILE).read_bytes()
    (path / RECORD_FILE).write_bytes(raw[:4096] + bytes(4096))  # only the "creating" slot
    (path / "data.mdb").write_bytes(b"half made")
    s = LmdbStateStore(path)
    try:
        assert s.applied_index() == 0
        s.apply([(1, encode_put(b"k", b"v"))])
    finally:
        s.close()


def test_a_damaged_record_or_a_mismatch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = LmdbStateStore(path)
    s.apply([(1, encode_put(b"k", b"v"))])
    s.close()
    good = (path / RECORD_FILE).read_bytes()
    (path / RECORD_FILE).write_bytes(b"\xff" * len(good))
    with pytest.raises(StorageError, match="checkpoint record .* is damaged"):
        LmdbStateStore(path)
    (path / RECORD_FILE).write_bytes(good)
    LmdbStateStore(path).close()


def test_a_store_without_a_record_is_trusted_and_gets_one(tmp_path: Path) -> None:
    """Written before checkpoint records existed."""
    path = tmp_path / "s"
    s = LmdbStateStore(path)
    s.apply([(1, encode_put(b"k", b"v"))])
    s.close()
    os.unlink(path / RECORD_FILE)
    s = LmdbStateStore(path)
    try:
        assert s.applied_index() == 1
    finally:
        s.close()
    assert (path / RECORD_FILE).exists()


def test_the_metastore_rolls_back_too(tmp_path: Path) -> None:
    path = tmp_path / "m"
    m = MetaStore(path)
    applied = m.applied_index()
    m.close()
    rec = CheckpointFile(str(path), "metastore").read()
    assert rec is not None and rec.applied == applied and rec.txnid > 0


def test_a_data_file_put_back_from_an_older_copy_is_trusted(tmp_path: Path) -> None:
    """Older than its checkpoint record: a restore, not a crash (benchmarks put state
    files back this way to emulate a lag). Trusted, and recorded anew."""
    path = tmp_path / "s"
    s = LmdbStateStore(path)
    s.apply([(1, encode_put(b"k", b"old"))])
    s.close()
    old = (path / "data.mdb").read_bytes()
    s = LmdbStateStore(path)
    for i in range(2, 6):
        s.apply([(i, encode_put(b"k", b"new"))])
    s.close()
    (path / "data.mdb").write_bytes(old)
    for _ in range(2):  # and again: the new record stands
        s = LmdbStateStore(path)
        try:
            assert s.applied_index() == 1 and s.get(b"k") == b"old"
        finally:
            s.close()
    _crash_after(path, """
        s.apply([(2, encode_put(b"k", b"after"))])
    """)
    s = LmdbStateStore(path)
    try:
        assert s.applied_index() == 1 and s.get(b"k") == b"old"
    finally:
        s.close()
