"""The power-loss filesystem's own process: a FUSE passthrough that records what is not
yet durable, and the control channel its controller (``powerloss_fs.PowerLossFS``)
drives it through.

Theory of operation
-------------------
``python -m raftkv.testing.powerloss_daemon`` mounts ``--mountpoint`` over
``--backing`` with mfusepy (libfuse 3's high-level, path-based API) and serves until
it is unmounted. Every operation goes straight to the backing directory; before a
change, the undo log (``powerloss_undo``) saves what a power loss would restore.

**What reaches us.** Without ``direct_io`` and without the writeback cache (libfuse 3
leaves it off unless asked for), the kernel sends every ``write(2)`` to us before the
call returns, and keeps its page cache coherent with what it sent, so shared read-only
``mmap`` (LMDB's data file) and shared writable ``mmap`` (LMDB's lock file; its dirty
pages come to us as writes when the kernel writes them back) both work. ``fsync`` and
``fdatasync`` arrive as FSYNC with the datasync flag; ``fsync`` of a directory as
FSYNCDIR. A write on an ``O_SYNC``/``O_DSYNC`` descriptor is followed by the kernel's
own FSYNC of the whole file (``generic_write_sync``), so it makes the whole file
durable, where a disk filesystem would promise only the written range: more generous
than real, never stricter.

**Locks are the kernel's.** The operations class implements neither ``lock`` nor
``flock``, so libfuse does not ask the kernel for FUSE_POSIX_LOCKS or FUSE_FLOCK_LOCKS,
and the kernel then keeps ``fcntl`` and ``flock`` locks itself, per inode of the mount,
exactly as for a local filesystem. All of LMDB's users are processes of this machine,
so that is the behaviour it needs (its reader-table liveness checks and exclusive-open
test use ``fcntl`` locks on ``lock.mdb``). Locks do not survive a remount, as they do
not survive a reboot.

**Unlinked open files.** ``hard_remove``: an unlinked file that is still open is
removed at once (into the undo journal's trash) instead of being renamed to
``.fuse_hidden*``; its later operations arrive by handle with no path, which every
handler here supports.

**Control.** A socket (``--control-fd``, one end of a socketpair) carries JSON lines.
The daemon says ``{"event": "mounted"}`` when the kernel's INIT arrives. Requests:
``stats``; ``sync_all`` (everything durable now, as ``sync(1)``); then, after the
controller has unmounted the filesystem, exactly one of ``forget`` (``keep``,
``seed``: apply the undo log, reply with the report) or ``commit`` (a clean shutdown:
nothing is lost); the daemon then exits. If the controller goes away, the daemon
detaches the mount (lazy unmount) and exits cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import dataclasses
import errno
import json
import os
import random
import resource
import socket
import subprocess
import sys
import threading
from typing import Any

from raftkv.testing.powerloss_undo import DataUndo, Journal

METADATA_MODES = ("strict", "journal", "durable")

# Flags of the user's open that must not reach the backing descriptor: O_APPEND would
# make pwrite append (the kernel already chose the offset), and sync/direct flags only
# slow the backing store (its durability is not what is being tested).
_STRIP = os.O_APPEND | os.O_DSYNC | os.O_SYNC | getattr(os, "O_DIRECT", 0) | os.O_TRUNC

_SYNC_FLAGS = os.O_DSYNC | os.O_SYNC


@dataclasses.dataclass
class Counters:
    """Operation counts since this mount (``powerloss_fs.Stats`` adds the undo log's)."""

    writes: int = 0
    bytes_written: int = 0
    truncates: int = 0
    fsyncs: int = 0
    fdatasyncs: int = 0
    dir_fsyncs: int = 0
    dsync_opens: int = 0
    namespace_ops: int = 0


def _load_mfusepy() -> Any:
    """mfusepy, bound to libfuse 3 where both 2 and 3 are installed (it would otherwise
    take libfuse 2 first)."""
    if "FUSE_LIBRARY_PATH" not in os.environ and ctypes.util.find_library("fuse3"):
        os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    import mfusepy

    return mfusepy


class _State:
    """Everything the handlers share. One lock orders every change to the backing
    directory with its undo record (the handlers run on libfuse's threads)."""

    def __init__(self, root: str, trash: str, metadata: str) -> None:
        self.root = root
        self.metadata = metadata
        self.lock = threading.Lock()
        self.data = DataUndo()
        self.journal = Journal(trash, durable=metadata == "durable")
        self.counters = Counters()

    def stats(self) -> dict[str, Any]:
        files, pages = self.data.unsynced()
        out = dataclasses.asdict(self.counters)
        out.update(unsynced_files=files, unsynced_pages=pages,
                   pending_namespace_ops=self.journal.pending())
        return out


def make_operations(state: _State, on_mounted: Any) -> Any:
    """The mfusepy ``Operations`` subclass over ``state`` (built here so that importing
    this module does not need mfusepy, nor libfuse)."""
    fuse = _load_mfusepy()
    FuseOSError = fuse.FuseOSError

    # mypy sees ``fuse`` as a variable, not a module.
    class PowerLossOps(fuse.Operations):  # type: ignore[name-defined]
        use_ns = True

        def __init__(self) -> None:
            self.root = state.root

        def _path(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        # -- lifecycle ---------------------------------------------------------------
        def init(self, path: str) -> None:
            on_mounted()

        # -- attributes and lookups --------------------------------------------------
        def getattr(self, path: str | None, fh: int | None = None) -> dict[str, int]:
            if fh is not None:  # an open file, perhaps unlinked (no path then)
                st = os.fstat(fh)
            else:
                st = os.lstat(self._path(path or "/"))
            out = {k: getattr(st, k) for k in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev",
                "st_rdev", "st_blocks", "st_blksize")}
            # use_ns: mfusepy takes the times in nanoseconds under the plain names.
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns,
                       st_ctime=st.st_ctime_ns)
            return out

        def readlink(self, path: str) -> str:
            return os.readlink(self._path(path))

        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self._path(path))
            return {k: getattr(sv, k) for k in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")}

        def chmod(self, path: str | None, mode: int) -> None:
            os.chmod(self._path(path or "/"), mode, follow_symlinks=False)

        def chown(self, path: str | None, uid: int, gid: int) -> None:
            os.chown(self._path(path or "/"), uid, gid, follow_symlinks=False)

        def utimens(self, path: str | None, times: Any = None) -> None:
            full = self._path(path or "/")
            if times is None:
                os.utime(full, follow_symlinks=False)
            else:
                os.utime(full, ns=(int(times[0]), int(times[1])), follow_symlinks=False)

        # -- directories ---------------------------------------------------------------
        def opendir(self, path: str) -> int:
            return os.open(self._path(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

        def releasedir(self, path: str | None, fh: int) -> None:
            os.close(fh)

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._path(path))]

        def fsyncdir(self, path: str | None, datasync: int, fh: int) -> None:
            with state.lock:
                state.counters.dir_fsyncs += 1
                if state.metadata != "durable":
                    state.journal.commit()

        # -- the namespace (journaled) -------------------------------------------------
        def _created(self, full: str) -> None:
            state.counters.namespace_ops += 1
            state.journal.created(full)

        def mkdir(self, path: str, mode: int) -> None:
            with state.lock:
                os.mkdir(self._path(path), mode)
                self._created(self._path(path))

        def mknod(self, path: str, mode: int, dev: int) -> None:
            with state.lock:
                os.mknod(self._path(path), mode, dev)
                self._created(self._path(path))

        def symlink(self, target: str, source: str) -> None:
            with state.lock:
                os.symlink(source, self._path(target))
                self._created(self._path(target))

        def link(self, target: str, source: str) -> None:
            with state.lock:
                os.link(self._path(source), self._path(target))
                self._created(self._path(target))

        def unlink(self, path: str) -> None:
            with state.lock:
                state.counters.namespace_ops += 1
                state.journal.remove(self._path(path), is_dir=False)

        def rmdir(self, path: str) -> None:
            with state.lock:
                state.counters.namespace_ops += 1
                state.journal.remove(self._path(path), is_dir=True)

        def rename(self, old: str, new: str) -> None:
            with state.lock:
                state.counters.namespace_ops += 1
                state.journal.rename(self._path(old), self._path(new))

        # -- files ---------------------------------------------------------------------
        def _open(self, full: str, flags: int, path: str, mode: int = 0o666) -> int:
            fd = os.open(full, (flags & ~_STRIP) | os.O_CLOEXEC, mode)
            if flags & _SYNC_FLAGS:
                state.counters.dsync_opens += 1
            if flags & os.O_TRUNC and os.fstat(fd).st_size:
                # The kernel sends O_TRUNC inside the open (FUSE_ATOMIC_O_TRUNC): cut
                # the file here, through the undo log, not in the backing open.
                self._truncate(fd, path, 0)
            return fd

        def open(self, path: str, flags: int) -> int:
            with state.lock:
                return self._open(self._path(path), flags, path)

        def create(self, path: str, mode: int, flags: int) -> int:
            full = self._path(path)
            with state.lock:
                existed = os.path.lexists(full)
                fd = self._open(full, flags | os.O_CREAT, path, mode)
                if not existed:
                    self._created(full)
                return fd

        def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
            with state.lock:
                state.data.before_write(fh, path or f"<fd {fh}>", offset, len(data))
                n = os.pwrite(fh, data, offset)
                state.counters.writes += 1
                state.counters.bytes_written += n
                return n

        def _truncate(self, fd: int, path: str | None, length: int) -> None:
            state.data.before_truncate(fd, path or f"<fd {fd}>", length)
            os.ftruncate(fd, length)
            state.counters.truncates += 1

        def truncate(self, path: str | None, length: int, fh: int | None = None) -> None:
            with state.lock:
                if fh is not None:
                    self._truncate(fh, path, length)
                    return
                fd = os.open(self._path(path or "/"), os.O_RDWR | os.O_CLOEXEC)
                try:
                    self._truncate(fd, path, length)
                finally:
                    os.close(fd)

        def fallocate(self, path: str | None, mode: int, offset: int, length: int,
                      fh: int) -> None:
            # Plain allocation only (mode 0, or FALLOC_FL_KEEP_SIZE = 1): it can grow the
            # file, which the undo log records like a truncate up. Punching holes and
            # the other modes are refused; glibc's posix_fallocate then writes zeros.
            if mode & ~1:
                raise FuseOSError(errno.EOPNOTSUPP)
            if mode & 1:
                return  # KEEP_SIZE: blocks only, nothing a reader can see changes
            with state.lock:
                end = offset + length
                if end > os.fstat(fh).st_size:
                    state.data.before_truncate(fh, path or f"<fd {fh}>", end)
                os.posix_fallocate(fh, offset, length)

        def fsync(self, path: str | None, datasync: int, fh: int) -> None:
            with state.lock:
                if datasync:
                    state.counters.fdatasyncs += 1
                else:
                    state.counters.fsyncs += 1
                state.data.synced(fh)
                if state.metadata == "journal":
                    state.journal.commit()

        def flush(self, path: str | None, fh: int) -> None:
            """close(2) of one descriptor: not a sync (nothing becomes durable)."""

        def release(self, path: str | None, fh: int) -> None:
            os.close(fh)

    return PowerLossOps()


class _Control:
    """The daemon's end of the control socket (module docstring)."""

    def __init__(self, sock: socket.socket, state: _State, mountpoint: str) -> None:
        self.sock = sock
        self.state = state
        self.mountpoint = mountpoint
        self.unmounted = threading.Event()
        self._send_lock = threading.Lock()
        self._rfile = sock.makefile("r", encoding="utf-8")

    def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._send_lock:
            self.sock.sendall(data)

    def serve(self) -> None:
        """Answer requests until the final one (``forget``/``commit``) or EOF."""
        for line in self._rfile:
            req = json.loads(line)
            try:
                reply, final = self._handle(req)
            except Exception as e:  # noqa: BLE001  # the controller's to raise
                reply, final = {"error": f"{type(e).__name__}: {e}"}, False
            self.send(reply)
            if final:
                return
        # The controller went away: do not leave a mount behind with nobody to drive it.
        if not self.unmounted.is_set():
            for cmd in (["umount", "-l"], ["fusermount3", "-u", "-z"]):
                with contextlib.suppress(OSError):
                    if subprocess.run([*cmd, self.mountpoint], check=False,
                                      capture_output=True).returncode == 0:
                        break
            self.unmounted.wait(10)
        with self.state.lock:
            self.state.data.commit_all()
            self.state.journal.commit()

    def _handle(self, req: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        cmd = req.get("cmd")
        st = self.state
        if cmd == "stats":
            with st.lock:
                return {"stats": st.stats()}, False
        if cmd == "sync_all":
            with st.lock:
                st.data.commit_all()
                st.journal.commit()
                return {"ok": True}, False
        if cmd in ("forget", "commit"):
            if not self.unmounted.wait(float(req.get("timeout", 30))):
                return {"error": "still mounted: unmount before forgetting"}, False
            with st.lock:
                stats = st.stats()
                if cmd == "commit":
                    st.data.commit_all()
                    st.journal.commit()
                    return {"ok": True, "stats": stats}, True
                rng = random.Random(req.get("seed"))
                files = st.data.forget(float(req["keep"]), rng)
                names = st.journal.undo()
                return {"ok": True, "stats": stats,
                        "files": [dataclasses.asdict(f) for f in files],
                        "namespace_undone": names}, True
        return {"error": f"unknown command {cmd!r}"}, False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backing", required=True)
    p.add_argument("--mountpoint", required=True)
    p.add_argument("--trash", required=True)
    p.add_argument("--metadata", choices=METADATA_MODES, default="strict")
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)

    # One descriptor per file with unsynced data, besides the open ones.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    state = _State(os.path.realpath(args.backing), os.path.realpath(args.trash),
                   args.metadata)
    control = _Control(socket.socket(fileno=args.control_fd), state, args.mountpoint)
    ops = make_operations(state, lambda: control.send({"event": "mounted"}))
    server = threading.Thread(target=control.serve, name="control", daemon=True)
    server.start()
    fuse = _load_mfusepy()
    try:
        fuse.FUSE(ops, args.mountpoint, foreground=True, debug=args.debug,
                  fsname="powerloss", subtype="powerloss", hard_remove=True)
    except Exception as e:  # noqa: BLE001  # reported, and the exit status says it
        print(f"powerloss_daemon: mount failed: {e}", file=sys.stderr)
        return 1
    finally:
        control.unmounted.set()
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
