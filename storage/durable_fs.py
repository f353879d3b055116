"""Making names durable: directory fsyncs, and small files replaced atomically.

An fsync of a file makes its data durable, not its *name*: a file created (or renamed)
since its directory was last fsynced may be gone after a power loss, on POSIX's minimum
and on ext4 without a journal commit in between. LMDB never fsyncs the directory it
creates ``data.mdb`` in, so every store fsyncs the directories it creates, and the
directory of each environment once its files exist (docs/durability.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` (its entries: names created, renamed, removed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, and every directory it created is durable:
    the parent of each new directory is fsynced after it, deepest last."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not missing:
        return
    os.makedirs(path, exist_ok=True)
    for d in reversed(missing):
        fsync_dir(os.path.dirname(d))


def write_durable(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably: a temporary file, fsynced,
    renamed over it, then the directory fsynced. After a crash at any point the file is
    the old one or the new one, never empty or torn."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        # The half-written file goes, and the error names it: a write or fsync error has
        # no file name (found from outside: a node started on a full disk said only
        # "[Errno 28] No space left on device", and left node_id.tmp behind).
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, tmp) from e
        raise
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def ensure_durable(path: str, data: bytes) -> bool:
    """``write_durable(path, data)`` unless ``path`` already holds ``data``; then the file
    and its directory are fsynced where they are. Returns whether it wrote.

    A file at its final name with the right bytes is at most not yet durable: its data
    (a writer that did not sync) or its name (a process that died between its rename and
    the directory fsync). Syncing both where they are covers either, without the
    temporary file, its write and the rename of a rewrite (a node restarting with hundreds
    of partitions rewrote each one's generation marker)."""
    try:
        with open(path, "rb") as f:
            same = f.read(len(data) + 1) == data
            if same:
                # Cheap when its pages are clean; it covers a file named by something
                # other than write_durable (an older release renamed it unsynced).
                os.fsync(f.fileno())
    except OSError:
        same = False
    if not same:
        write_durable(path, data)
        return True
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return False


# Below this much free space, a failed write is likely the disk's being full.
LOW_SPACE_BYTES = 64 << 20


def space_hint(path: str) -> str:
    """A note for a failed write's message when the file system holding ``path`` is
    (nearly) full, else "". LMDB reports a full disk as whatever its write or sync
    returned, often ``Input/output error`` (found from outside: nothing said "no space
    left on device")."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    if free >= LOW_SPACE_BYTES:
        return ""
    return f" (the file system holding {path} has only {free:,} bytes free: is it full?)"
