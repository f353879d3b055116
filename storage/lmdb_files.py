"""Checks on LMDB data files that LMDB itself cannot make safely.

LMDB maps its data file into memory. A page past the end of a truncated file is not an
error it can return: touching it kills the process with SIGBUS. So every LMDB-backed
store checks the file's length against LMDB's own meta pages before opening it.
"""

from __future__ import annotations

import os
import struct

from raftkv.storage.errors import StorageError

_MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16  # MDB_page header before the MDB_meta in pages 0 and 1 (64-bit build)


def check_lmdb_file(path: str, what: str, error: type[StorageError] = StorageError) -> None:
    """Refuse a ``data.mdb`` shorter than its own meta page says it is.

    LMDB reads the data file through mmap, so a page past the end of a truncated file (a
    partial copy, a full disk, a machine crash that lost the file's growth) kills the process
    with SIGBUS instead of raising. MDB_meta (lmdb.h, 64-bit): magic u32, version u32, address
    u64, mapsize u64, two 48-byte MDB_db (the first one's pad holds the page size),
    last_pgno u64, txnid u64. The meta with the higher txnid is current, and the file must
    hold pages ``0..last_pgno``. ``what`` names the store in messages; ``error`` is the
    StorageError subclass to raise.
    """
    data = os.path.join(path, "data.mdb")
    try:
        size = os.path.getsize(data)
        with open(data, "rb") as f:
            head = f.read(2 * 65536)  # two meta pages at the largest page size LMDB uses
    except FileNotFoundError:
        return  # a new store
    except OSError as e:
        raise error(f"cannot open the {what} at {path}: {e}") from e
    if size == 0:
        return  # LMDB initializes an empty file itself
    best: tuple[int, int, int] | None = None  # (txnid, last_pgno, page_size)
    page_size = 0
    for page in (0, 1):
        if page == 1 and not page_size:
            break  # page 0 is unreadable, so page 1 cannot be located
        off = page * page_size + _PAGE_HEADER
        if len(head) < off + 136:
            break
        magic, _version = struct.unpack_from("<II", head, off)
        if magic != _MAGIC:
            continue
        psize = struct.unpack_from("<I", head, off + 24)[0]
        last_pgno, txnid = struct.unpack_from("<QQ", head, off + 24 + 96)
        page_size = page_size or psize
        if best is None or txnid > best[0]:
            best = (txnid, last_pgno, psize)
    if best is None:
        raise error(
            f"cannot open the {what} at {path}: {data} is not an LMDB file, "
            "or both of its meta pages are damaged"
        )
    need = (best[1] + 1) * best[2]
    if size < need:
        raise error(
            f"cannot open the {what} at {path}: {data} is truncated (its meta page needs "
            f"{need} bytes, the file has {size}); with other replicas, move the node's "
            "data directory away and start it again: it rejoins empty and gets the data "
            "from them (docs/operations.md, 'Recovering')"
        )
