"""One process per data directory: an exclusive fcntl lock on ``DATA_DIR/LOCK``.

A node holds its data directory for as long as it runs (``raftkv.node.stores.
claim_data_dir`` takes the lock, ``EmbeddedNode.close`` lets it go), and the offline tools
that write one (``raftkv recover unsafe-reset``, a backup restore) hold it while they do.
Everything else that would open the directory's files is refused with a message naming
the holder's pid. LMDB alone refuses nothing: its environments are meant to be shared
between processes.

fcntl record locks (not ``flock``) because they belong to the process: the kernel drops
them when it dies, SIGKILL included. Since the kernel would grant one again to the same
process, this module keeps the process's holds itself, and refuses a directory that a
node of this process still holds: a second node on it used to fail only at LMDB's own
refusal, and its cleanup then let go of the first node's lock (found from outside), so
that another process could run the directory beside it. A node stopped and opened again
in one process releases it in between. They are also why the
descriptor is kept open and the file never opened a second time while held: closing any
descriptor of the file drops the process's lock on it. A forked child does not inherit
them, so it starts holding nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os

from raftkv.storage.errors import StorageError
from raftkv.storage.layout import LOCK_FILE

# Data directories this process holds: real path -> (the lock file's descriptor, and the
# lock file's (st_dev, st_ino)). fcntl record locks belong to the process and vanish when
# it closes any descriptor of the file, so the descriptor is kept, and the file not
# opened again, while it is held.
_held: dict[str, tuple[int, tuple[int, int]]] = {}


def _forget_after_fork() -> None:
    # A forked child inherits the table and the descriptors but not the locks (fcntl
    # locks are not inherited): it holds nothing, and must take a lock to run a node.
    # Closing its copies releases nothing of the parent's.
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def lock_data_dir(data_dir: str) -> None:
    """An exclusive fcntl lock on ``data_dir/LOCK``, held until ``release_data_dir`` or
    the end of the process (a SIGKILL included: the kernel drops it), so a second
    ``raftkv serve``, embedded node or offline tool on a running node's directory is
    refused before it opens a file there. LMDB alone does not refuse it: its
    environments are meant to be shared between processes, so both would write the same
    log and state stores as the same node, and the running one can be left with damaged
    stores (found from outside: a duplicate ``serve`` on a live node's directory).

    A directory this process already holds is refused too, until ``release_data_dir``
    (a node stopped and opened again in one process, as tests and embedding apps do,
    releases it in between). A directory removed and made again while held is locked
    afresh: the old lock guards a file that is gone."""
    path = os.path.realpath(data_dir)
    lock_path = os.path.join(path, LOCK_FILE)
    held = _held.get(path)
    if held is not None:
        try:
            st = os.stat(lock_path)
            if (st.st_dev, st.st_ino) == held[1]:
                raise StorageError(
                    f"{data_dir} is in use by a node of this process: close that node "
                    "first")
        except FileNotFoundError:
            pass
        release_data_dir(path)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StorageError(f"cannot open {lock_path}: {e.strerror}") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise StorageError(
                f"{data_dir} is in use by another process"
                f"{f' (pid {holder})' if holder.isdigit() else ''}: a node is already "
                "running on it; stop it first") from None
        raise StorageError(f"cannot lock {lock_path}: {e.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above only
    st = os.fstat(fd)
    _held[path] = (fd, (st.st_dev, st.st_ino))


def release_data_dir(data_dir: str) -> None:
    """Let go of ``data_dir`` (``lock_data_dir``) once nothing of this process has its
    files open, so another process may run it."""
    held = _held.pop(os.path.realpath(data_dir), None)
    if held is not None:
        os.close(held[0])  # drops the lock
