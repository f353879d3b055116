"""What a power loss would take back: the undo log of the power-loss filesystem.

Theory of operation
-------------------
``raftkv.testing.powerloss_fs`` is a passthrough: every write lands in the backing
directory at once, so the backing files always hold the *newest* bytes, as the page
cache of a running machine does. What a power failure would lose is kept here, as the
bytes to put back:

**File data (``DataUndo``).** Per file (keyed by the backing inode, so renames and
unlinks do not lose track of it) the first change to each 4096-byte page since the
file's last ``fsync``/``fdatasync`` saves that page's *durable* bytes (``FileUndo.old``),
and the file remembers its durable size. Later writes to the same page save nothing:
the first copy is the one a power loss restores. A page past the durable size saves
the part below it (possibly nothing): the rest was not in the file, and reads as
zeros if the file keeps its new size. A truncate is a change like a write: the pages it
cuts (or zeroes, for the partial one) are saved before it cuts them. A sync of the file
drops its entry: everything in it is now durable.

Invariant: within the durable size, a page's current bytes differ from its durable
bytes only if the page is in ``old``. So restoring ``old`` and the durable size gives
back exactly the file as of its last sync.

**Forgetting.** ``forget(keep, rng)`` decides, for each unsynced page, whether the new
bytes reached the disk (probability ``keep``) or the old ones stay; likewise once per
file for a size change. ``keep=0`` is a plain power loss (everything unsynced is lost,
no randomness drawn); ``0 < keep < 1`` is a *torn* loss (a seeded subset survives, in
any order, which models a disk that reorders writes and a page cache that wrote some
pages back before the power went). Pages are forgotten whole: no torn sectors within a
page. A page with no new data in the file left (cut by a truncate) always gets its old
bytes back when the size rolls back over it. Files are visited in a fixed order (their
path when first changed, then first-change order) and pages in offset order, so one
seed over one sequence of operations forgets the same pages every time.

**Names (``Journal``).** Creates, unlinks, renames, mkdir/rmdir, links and symlinks
are kept in one ordered journal, the model of a journaling filesystem (ext4, xfs): a
commit makes every operation before it durable, never a later one without an earlier
one. Removing a name moves the inode into a trash directory (beside the backing
directory, on the same filesystem) instead of deleting it, so that undoing the removal
is a rename back; a commit empties the trash. What commits the journal is the
filesystem's metadata policy (``powerloss_fs`` explains the modes); undo goes through
the journal newest first.

Not modelled: attribute changes (mode, owner, times) and extended attributes, which
stay as they were set; the link count seen through the mount while a removed name sits
in the trash; rename flags (RENAME_NOREPLACE, RENAME_EXCHANGE: the library drops them).
"""

from __future__ import annotations

import errno
import os
import random
import stat
from dataclasses import dataclass, field

PAGE_SIZE = 4096


def _pages(offset: int, length: int) -> range:
    """The pages ``[offset, offset + length)`` touches (none for an empty range)."""
    if length <= 0:
        return range(0)
    return range(offset // PAGE_SIZE, (offset + length - 1) // PAGE_SIZE + 1)


@dataclass
class FileUndo:
    """One file's unsynced changes. ``fd`` is the undo log's own read-write descriptor of
    the backing inode, held until the file is synced: it reaches the inode after renames
    and unlinks, and it keeps the inode number from being reused while the entry lives."""

    name: str
    seq: int
    fd: int
    durable_size: int
    old: dict[int, bytes] = field(default_factory=dict)

    def save(self, page: int) -> None:
        """Save ``page``'s durable bytes, unless they are saved already."""
        if page in self.old:
            return
        start = page * PAGE_SIZE
        want = min(PAGE_SIZE, self.durable_size - start)
        self.old[page] = os.pread(self.fd, want, start) if want > 0 else b""


@dataclass
class FileLoss:
    """What a power loss did to one file: pages given their old bytes back, pages whose
    new bytes stayed, and the size before and after."""

    name: str
    pages_forgotten: list[int]
    pages_kept: list[int]
    size_before: int
    size_after: int
    durable_size: int


class DataUndo:
    """The unsynced data of every file (module docstring). Not thread-safe: the
    filesystem calls it under its own lock, around the write it describes."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, int], FileUndo] = {}
        self._seq = 0

    def _entry(self, fd: int, name: str) -> FileUndo:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        entry = self.files.get(key)
        if entry is None:
            # Our own descriptor: the caller's may be O_APPEND (pwrite would then append)
            # or be closed before the power goes.
            own = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            self._seq += 1
            entry = FileUndo(name, self._seq, own, st.st_size)
            self.files[key] = entry
        return entry

    def before_write(self, fd: int, name: str, offset: int, length: int) -> None:
        """Call before writing ``length`` bytes at ``offset`` through ``fd``."""
        if length <= 0:
            return
        entry = self._entry(fd, name)
        for page in _pages(offset, length):
            entry.save(page)

    def before_truncate(self, fd: int, name: str, new_size: int) -> None:
        """Call before cutting or extending the file to ``new_size`` bytes."""
        size = os.fstat(fd).st_size
        if new_size == size and not self._tracked(fd):
            return
        entry = self._entry(fd, name)
        if new_size < size:
            # Only pages holding durable bytes need saving; above the durable size
            # nothing durable is cut.
            top = min(size, entry.durable_size)
            for page in _pages(new_size, top - new_size):
                entry.save(page)

    def _tracked(self, fd: int) -> bool:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) in self.files

    def synced(self, fd: int) -> bool:
        """``fd``'s file was fsynced or fdatasynced: all of it is durable now. True if it
        had anything unsynced."""
        st = os.fstat(fd)
        entry = self.files.pop((st.st_dev, st.st_ino), None)
        if entry is None:
            return False
        os.close(entry.fd)
        return True

    def commit_all(self) -> None:
        """Everything is durable (a clean shutdown, or ``sync(1)``)."""
        for entry in self.files.values():
            os.close(entry.fd)
        self.files.clear()

    def unsynced(self) -> tuple[int, int]:
        """(files, pages) with unsynced changes."""
        return len(self.files), sum(len(e.old) for e in self.files.values())

    def forget(self, keep: float, rng: random.Random) -> list[FileLoss]:
        """Power loss: put back what did not reach the disk, each page with probability
        ``1 - keep`` (module docstring), and drop the log. Call it only with the
        filesystem unmounted: the kernel's page cache would otherwise still show the
        new bytes."""
        losses = []
        for entry in sorted(self.files.values(), key=lambda e: (e.name, e.seq)):
            losses.append(self._forget_file(entry, keep, rng))
            os.close(entry.fd)
        self.files.clear()
        return losses

    @staticmethod
    def _forget_file(entry: FileUndo, keep: float, rng: random.Random) -> FileLoss:
        fd = entry.fd
        size = os.fstat(fd).st_size
        final = size
        if size != entry.durable_size and not (keep > 0 and rng.random() < keep):
            final = entry.durable_size
        # Decide every page and read the new bytes before the size changes under them.
        chosen: dict[int, bytes] = {}
        forgotten, kept = [], []
        for page in sorted(entry.old):
            start = page * PAGE_SIZE
            has_new_data = start < size
            if has_new_data and keep > 0 and rng.random() < keep:
                kept.append(page)
                data = os.pread(fd, PAGE_SIZE, start)
            else:
                forgotten.append(page)
                data = entry.old[page]
            chosen[page] = data.ljust(PAGE_SIZE, b"\0")
        os.ftruncate(fd, final)
        for page, data in chosen.items():
            start = page * PAGE_SIZE
            clip = min(PAGE_SIZE, final - start)
            if clip > 0:
                os.pwrite(fd, data[:clip], start)
        return FileLoss(entry.name, forgotten, kept, size, final, entry.durable_size)


@dataclass
class NameOp:
    """One journaled namespace operation, with what undoing it needs.

    ``kind`` is ``created`` (a file, directory, link or symlink now at ``path``),
    ``removed`` (``path`` moved to ``trash``) or ``renamed`` (``path`` to ``path2``;
    ``trash`` holds what ``path2`` named before, if anything)."""

    kind: str
    path: str
    path2: str = ""
    trash: str = ""

    def describe(self) -> str:
        if self.kind == "renamed":
            return f"rename {self.path} -> {self.path2}"
        return f"{'create' if self.kind == 'created' else 'remove'} {self.path}"


def _remove(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        os.rmdir(path)
    else:
        os.unlink(path)


class Journal:
    """The ordered journal of namespace operations (module docstring). Paths are
    backing paths. ``durable=True`` keeps no journal: every operation is durable when it
    returns (the model of LazyFS and of a filesystem mounted ``dirsync``)."""

    def __init__(self, trash_dir: str, durable: bool = False) -> None:
        self.trash_dir = trash_dir
        self.durable = durable
        self.ops: list[NameOp] = []
        self._n = 0
        os.makedirs(trash_dir, exist_ok=True)

    def _trash_name(self) -> str:
        self._n += 1
        return os.path.join(self.trash_dir, f"{os.getpid()}-{self._n}")

    def created(self, path: str) -> None:
        """``path`` was just created (file, directory, link, symlink, node)."""
        if not self.durable:
            self.ops.append(NameOp("created", path))

    def remove(self, path: str, is_dir: bool) -> None:
        """Unlink ``path`` (or rmdir it: it must be empty), undoably."""
        # unlink(2)'s and rmdir(2)'s own checks: a rename to the trash would not make them.
        if stat.S_ISDIR(os.lstat(path).st_mode) != is_dir:
            code = errno.EISDIR if not is_dir else errno.ENOTDIR
            raise OSError(code, os.strerror(code), path)
        if is_dir and os.listdir(path):
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
        if self.durable:
            (os.rmdir if is_dir else os.unlink)(path)
            return
        trash = self._trash_name()
        os.rename(path, trash)
        self.ops.append(NameOp("removed", path, trash=trash))

    def rename(self, old: str, new: str) -> None:
        """Rename ``old`` to ``new``, replacing what ``new`` names, undoably."""
        if self.durable:
            os.rename(old, new)
            return
        trash = ""
        try:
            target = os.lstat(new)
        except FileNotFoundError:
            target = None
        if target is not None:
            if os.path.samestat(os.lstat(old), target):
                return  # two names of one inode: rename(2) does nothing
            if stat.S_ISDIR(target.st_mode):
                # rename(2)'s own checks, done before the target moves to the trash.
                if not stat.S_ISDIR(os.lstat(old).st_mode):
                    raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), new)
                if os.listdir(new):
                    raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), new)
                trash = self._trash_name()
                os.rename(new, trash)
            else:
                # A second name keeps the replaced inode, and the rename stays atomic
                # for anyone looking at ``new``.
                trash = self._trash_name()
                os.link(new, trash, follow_symlinks=False)
        try:
            os.rename(old, new)
        except OSError:
            if trash:
                if os.path.lexists(new):
                    os.unlink(trash)
                else:
                    os.rename(trash, new)
            raise
        self.ops.append(NameOp("renamed", old, new, trash))

    def pending(self) -> int:
        return len(self.ops)

    def commit(self) -> int:
        """Every operation so far is durable; empties the trash. Returns how many."""
        n = len(self.ops)
        for op in self.ops:
            if op.trash:
                _remove(op.trash)
        self.ops.clear()
        return n

    def undo(self) -> list[str]:
        """Power loss: take back every uncommitted operation, newest first."""
        done = []
        for op in reversed(self.ops):
            if op.kind == "created":
                _remove(op.path)
            elif op.kind == "removed":
                os.rename(op.trash, op.path)
            else:
                os.rename(op.path2, op.path)
                if op.trash:
                    os.rename(op.trash, op.path2)
            done.append(op.describe())
        self.ops.clear()
        return done
