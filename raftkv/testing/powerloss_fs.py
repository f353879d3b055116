"""A filesystem that can lose power: the test harness for fsync discipline (issue 22).

A SIGKILL keeps the operating system's page cache, so a crash test built on it cannot
tell a program that fsyncs from one that does not. ``PowerLossFS`` mounts a FUSE
passthrough (in the style of Jepsen's LazyFS) over a backing directory, remembers
every change not yet made durable by ``fsync``/``fdatasync``, and on command forgets
them, as a power failure would:

    with PowerLossFS(tmp / "disk", tmp / "mnt") as fs:
        proc = subprocess.Popen([...program writing under tmp / "mnt"...])
        ...                               # let it work
        proc.kill(); proc.wait()          # the machine dies: its processes first
        report = fs.power_loss()          # unmount, forget the unsynced, remount
        ...                               # restart the program, check what it kept
        fs.power_loss(torn=True, seed=7)  # or: a seeded subset of pages survives

Theory of operation
-------------------
**Three pieces.** ``powerloss_undo`` is the model (the undo log: old bytes of each page
first changed since the file's last sync, its durable size, and a journal of namespace
operations). ``powerloss_daemon`` is the filesystem, a separate process (mfusepy over
libfuse 3) so that a test can SIGKILL every user of the mount and still command it.
This module is the controller the test holds.

**A power loss is a reboot.** Forgetting cannot happen under a live mount: the kernel's
page cache would go on serving the forgotten bytes. So ``power_loss()`` is: every
process using the mount must already be dead (the caller SIGKILLs them, or passes
``kill_users=True``); unmount (that drops the page cache with the superblock); the
daemon applies the undo log to the backing directory and exits; a new daemon mounts
again. The backing directory then holds exactly what a disk would after the power came
back, and locks, open files and caches start empty, as after a reboot. ``reboot()``
is the same with nothing forgotten (a clean shutdown); ``close()`` ends with one.

**Data.** Kept until synced, at page (4096 B) granularity, per file: ``write``,
``pwrite``, writes back from a shared writable ``mmap``, ``truncate``/``ftruncate``
(down and up), ``fallocate`` that grows the file, and ``O_TRUNC``. ``fsync`` and
``fdatasync`` of a file make all of that file durable (both; no distinction is made
for metadata). ``power_loss()`` forgets everything unsynced; ``power_loss(torn=True,
seed=N, keep=p)`` keeps each unsynced page (and each file's size change) with
probability ``p``, reproducibly for one seed and one sequence of operations: the
model of a disk that reorders writes and of a cache that wrote some pages back
early. A page is never torn inside.

**Names** (create, unlink, rename, mkdir, rmdir, link, symlink, mknod) follow the
``metadata`` policy:

- ``"strict"`` (default, POSIX's minimum): an operation is durable once a directory is
  fsynced after it. The operations form one ordered journal, as on a journaling
  filesystem, so fsyncing any directory commits every operation before it, in any
  directory; an fsync of a file commits none. A file created, written and fsynced
  but whose directory was never fsynced is gone after a power loss. (LMDB itself never
  fsyncs the directory it creates ``data.mdb`` in; a program that needs its new
  environment to survive must.)
- ``"journal"``: as ``strict``, and an fsync of any file also commits the journal, as
  ext4 and xfs do in practice (the file's own data is all that fsync makes durable,
  but the journal commit carries every earlier namespace operation with it).
- ``"durable"``: every namespace operation is durable when it returns (LazyFS's model,
  or a filesystem mounted ``dirsync``).

Not modelled: attribute changes (mode, owner, times, xattrs) are kept as set;
``O_SYNC``/``O_DSYNC`` writes make their whole file durable, not only the written
range (the kernel follows each with an FSYNC of the file; more generous than real,
never stricter); rename flags are dropped by the library (a RENAME_NOREPLACE rename
replaces). Undone namespace operations may leave stale entries in a program's own
memory: it does not matter, the program is dead.

**What LMDB needs, and gets.** ``pread``/``pwrite``; the read-only shared ``mmap`` of
``data.mdb`` and the writable one of ``lock.mdb`` (no ``direct_io``: the mount keeps a
coherent page cache); ``fdatasync`` and ``O_DSYNC`` (its meta page, with sync on);
``ftruncate``; and ``fcntl`` locks, which the *kernel* keeps for the mount, because
the filesystem implements no lock operation (``powerloss_daemon`` explains). LMDB
does not call ``fallocate``. Locks are process-local to this machine and vanish at a
power loss, which is what a reboot does too, so nothing needs compensating.

**Counters.** ``stats()`` returns operation counts since the last mount (writes,
fsyncs, fdatasyncs, directory fsyncs) and what is unsynced now (files, pages,
namespace operations), plus how many mounts and power losses this instance has been
through: enough for a test to assert that a program synced at all, and for its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from raftkv.testing.powerloss_undo import PAGE_SIZE, FileLoss

__all__ = [
    "PAGE_SIZE",
    "FileLoss",
    "MountBusy",
    "PowerLossError",
    "PowerLossFS",
    "PowerLossReport",
    "Stats",
    "unavailable_reason",
]

_MOUNT_TIMEOUT = 20.0


class PowerLossError(RuntimeError):
    """The filesystem could not be mounted, commanded or unmounted."""


class MountBusy(PowerLossError):
    """The mount is still in use: ``pids`` hold files, maps or a directory on it."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counts since the last mount, what is unsynced now, and this instance's history."""

    writes: int
    bytes_written: int
    truncates: int
    fsyncs: int
    fdatasyncs: int
    dir_fsyncs: int
    dsync_opens: int
    namespace_ops: int
    unsynced_files: int
    unsynced_pages: int
    pending_namespace_ops: int
    mounts: int
    power_losses: int

    @property
    def unsynced_bytes(self) -> int:
        """An upper bound: the unsynced pages times the page size."""
        return self.unsynced_pages * PAGE_SIZE

    @property
    def syncs(self) -> int:
        """Every fsync and fdatasync of a file or directory."""
        return self.fsyncs + self.fdatasyncs + self.dir_fsyncs


@dataclasses.dataclass(frozen=True)
class PowerLossReport:
    """What one ``power_loss`` did. ``seed`` is None for a plain loss (nothing drawn)."""

    torn: bool
    seed: int | None
    keep: float
    files: list[FileLoss]
    namespace_undone: list[str]
    before: Stats

    @property
    def pages_forgotten(self) -> int:
        return sum(len(f.pages_forgotten) for f in self.files)

    @property
    def pages_kept(self) -> int:
        return sum(len(f.pages_kept) for f in self.files)

    def summary(self) -> str:
        """One line for a test's log."""
        kind = f"torn (seed {self.seed}, keep {self.keep})" if self.torn else "full"
        return (f"power loss, {kind}: {self.pages_forgotten} pages forgotten and "
                f"{self.pages_kept} kept in {len(self.files)} files, "
                f"{len(self.namespace_undone)} namespace operations undone")


def unavailable_reason() -> str | None:
    """Why ``PowerLossFS`` cannot run here, or None if it can (Linux, ``/dev/fuse``
    openable, libfuse 3 and mfusepy importable, and root or ``fusermount3``)."""
    if not sys.platform.startswith("linux"):
        return "the power-loss filesystem needs Linux (FUSE)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse cannot be opened ({e.strerror}): FUSE is not available here"
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        return "not root and no fusermount3: install fuse3 (apt-get install fuse3)"
    probe = ("import ctypes.util, os, sys\n"
             "if not ctypes.util.find_library('fuse3'):\n"
             "    sys.exit('libfuse 3 is missing: apt-get install fuse3')\n"
             "os.environ.setdefault('FUSE_LIBRARY_NAME', 'fuse3')\n"
             "try:\n    import mfusepy\n"
             "except ImportError:\n"
             "    sys.exit(\"mfusepy is missing: pip install 'raftkv[powerloss]'\")\n"
             "except Exception as e:\n    sys.exit(f'mfusepy cannot load libfuse: {e}')\n")
    # In a child: importing mfusepy loads libfuse into the process for good.
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=False)
    if res.returncode != 0:
        return (res.stderr.strip().splitlines() or ["mfusepy cannot be imported"])[-1]
    return None


def _mount_type(mountpoint: str) -> str | None:
    """The filesystem type mounted at ``mountpoint`` (``fuse.powerloss`` for ours), or
    None. mountinfo escapes blanks and backslashes in paths as octal."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if path == mountpoint:
                return fields[fields.index("-") + 1]
    return None


def _is_mounted(mountpoint: str) -> bool:
    return _mount_type(mountpoint) is not None


_libc = ctypes.CDLL(None, use_errno=True)


def _umount(mountpoint: str, lazy: bool = False) -> int:
    """umount2(2) as root; fusermount3 otherwise. Returns 0 or an errno."""
    if _libc.umount2(mountpoint.encode(), 2 if lazy else 0) == 0:  # 2 = MNT_DETACH
        return 0
    err = ctypes.get_errno()
    if err != errno.EPERM:
        return err
    res = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint],
                         capture_output=True, text=True, check=False)
    if res.returncode == 0:
        return 0
    return errno.EBUSY if "busy" in res.stderr.lower() else errno.EIO


class PowerLossFS:
    """A power-loss filesystem mounted at ``mountpoint`` over ``backing`` (module
    docstring). ``state_dir`` (default: ``<backing>.powerloss``, beside it) holds the
    trash of undoable removals, which must be on the backing directory's filesystem
    (removals are renames into it), and the daemon's log, ``daemon.log``. ``metadata``
    is ``"strict"``, ``"journal"`` or ``"durable"``.

    Mounted by ``start()`` or ``with``; unmounted cleanly by ``close()``. Not
    thread-safe: one thread commands one instance."""

    def __init__(self, backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str],
                 *, metadata: str = "strict", state_dir: str | os.PathLike[str] | None = None,
                 debug: bool = False) -> None:
        if metadata not in ("strict", "journal", "durable"):
            raise ValueError(f"metadata must be strict, journal or durable, not {metadata!r}")
        self.backing = Path(backing).resolve()
        self.mountpoint = Path(mountpoint).resolve()
        self.state_dir = Path(state_dir or f"{self.backing}.powerloss").resolve()
        self.metadata = metadata
        self.debug = debug
        self.log_path = self.state_dir / "daemon.log"
        self.mounts = 0
        self.power_losses = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._buf = b""

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Self:
        """Mount. Leftovers of an earlier run (a stale mount of ours) are detached."""
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        kind = _mount_type(str(self.mountpoint))
        if kind == "fuse.powerloss":
            _umount(str(self.mountpoint), lazy=True)  # a dead run's: detach it
        elif kind is not None:
            raise PowerLossError(f"{self.mountpoint} is already a mount point ({kind})")
        self._boot()
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if et is None:
            self.close()
            return
        # The test failed: clean up without hiding its exception.
        try:
            self.close(kill_users=True)
        except PowerLossError:
            self.detach()

    def detach(self) -> None:
        """Last resort: lazy-unmount and kill the daemon, whatever still uses the mount
        (its users get ENOTCONN). The undo log is lost with the daemon."""
        if self._proc is None:
            return
        _umount(str(self.mountpoint), lazy=True)
        self._abandon()

    @property
    def mounted(self) -> bool:
        return self._proc is not None

    def close(self, *, kill_users: bool = False) -> None:
        """A clean shutdown: unmount, nothing forgotten. Idempotent."""
        if self._proc is None:
            return
        self._shutdown("commit", {}, kill_users=kill_users)

    def reboot(self, *, kill_users: bool = False) -> None:
        """A clean restart: everything written so far is kept (as a clean shutdown's
        sync would), and the mount starts afresh: no open files, locks or cache."""
        self._shutdown("commit", {}, kill_users=kill_users)
        self._boot()

    def power_loss(self, *, torn: bool = False, seed: int | None = None,
                   keep: float = 0.5, kill_users: bool = False) -> PowerLossReport:
        """The power fails and comes back: unmount, forget, remount.

        Plain (``torn=False``): every change not covered by an fsync is lost.
        ``torn=True``: each unsynced page, and each file's size change, survives with
        probability ``keep``, drawn from ``random.Random(seed)`` (a seed is chosen and
        reported if none is given). Namespace operations not yet committed are undone
        in both. Every process using the mount must be dead first; ``kill_users=True``
        SIGKILLs them (never this process: it gets ``MountBusy`` instead)."""
        if torn and not 0.0 <= keep <= 1.0:
            raise ValueError(f"keep must be within [0, 1], not {keep}")
        if torn and seed is None:
            seed = random.SystemRandom().randrange(2**32)
        before = self.stats()
        reply = self._shutdown("forget", {"keep": keep if torn else 0.0,
                                          "seed": seed if torn else None},
                               kill_users=kill_users)
        self.power_losses += 1
        self._boot()
        files = [FileLoss(**f) for f in reply["files"]]
        return PowerLossReport(torn, seed if torn else None, keep if torn else 0.0, files,
                               reply["namespace_undone"], before)

    # -- while mounted -----------------------------------------------------------------
    def stats(self) -> Stats:
        """Counters since the last mount and what is unsynced now."""
        raw = self._request({"cmd": "stats"})["stats"]
        return Stats(**raw, mounts=self.mounts, power_losses=self.power_losses)

    def sync_all(self) -> None:
        """Make everything written so far durable, as ``sync(1)`` would (a test's
        baseline before the part under test)."""
        self._request({"cmd": "sync_all"})

    def users(self) -> list[int]:
        """The processes (other than the daemon) with a file, a mapping, a working or
        root directory on the mount."""
        mp = str(self.mountpoint)
        daemon = self._proc.pid if self._proc else -1

        def on_mount(p: str) -> bool:
            return p == mp or p.startswith(mp + "/")

        def readlink(path: str) -> str:
            try:
                return os.readlink(path)
            except OSError:  # closed meanwhile (listdir's own descriptor, for one)
                return ""

        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == daemon:
                continue
            base = f"/proc/{entry}"
            try:
                links = [readlink(f"{base}/cwd"), readlink(f"{base}/root")]
                links += [readlink(f"{base}/fd/{fd}") for fd in os.listdir(f"{base}/fd")]
                if any(on_mount(link) for link in links):
                    found.append(int(entry))
                    continue
                with open(f"{base}/maps") as f:
                    if any(on_mount(line.split(maxsplit=5)[-1].strip())
                           for line in f if line.count(" ") >= 5):
                        found.append(int(entry))
            except OSError:
                continue  # gone meanwhile, or a zombie: it holds nothing
        return found

    def kill_users(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every other user of the mount and wait until none is left. Returns
        their pids. This process is never killed: if it uses the mount, MountBusy."""
        pids = self.users()
        if os.getpid() in pids:
            raise MountBusy(f"this process ({os.getpid()}) has files open on "
                            f"{self.mountpoint}: close them first", pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while (left := self.users()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if left:
            raise MountBusy(f"still using {self.mountpoint} after SIGKILL: {left}", left)
        return pids

    # -- the daemon ---------------------------------------------------------------------
    def _boot(self) -> None:
        parent, child = socket.socketpair()
        cmd = [sys.executable, "-m", "raftkv.testing.powerloss_daemon",
               "--backing", str(self.backing), "--mountpoint", str(self.mountpoint),
               "--trash", str(self.state_dir / "trash"), "--metadata", self.metadata,
               "--control-fd", str(child.fileno())]
        if self.debug:
            cmd.append("--debug")
        with open(self.log_path, "ab") as log:
            # Its own session: a test that kills its process group leaves the disk alone.
            self._proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], stdout=log,
                                          stderr=log, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        child.close()
        self._sock = parent
        self._buf = b""
        try:
            msg = self._recv(_MOUNT_TIMEOUT)
        except PowerLossError:
            self._abandon()
            raise
        if msg.get("event") != "mounted":
            self._abandon()
            raise PowerLossError(f"unexpected message from the daemon: {msg}")
        self.mounts += 1

    def _shutdown(self, cmd: str, args: dict[str, Any], kill_users: bool) -> dict[str, Any]:
        if self._proc is None:
            raise PowerLossError("not mounted")
        if kill_users:
            self.kill_users()
        self._unmount()
        try:
            reply = self._request({"cmd": cmd, **args})
            assert self._proc is not None
            self._proc.wait(timeout=30)
        finally:
            self._abandon()
        return reply

    def _unmount(self, timeout: float = 10.0) -> None:
        """Unmount, retrying while just-killed processes finish exiting."""
        mp = str(self.mountpoint)
        deadline = time.monotonic() + timeout
        while True:
            err = _umount(mp)
            if err == 0 or (err == errno.EINVAL and not _is_mounted(mp)):
                return
            if err != errno.EBUSY or time.monotonic() > deadline:
                users = self.users()
                if err == errno.EBUSY:
                    raise MountBusy(f"{mp} is busy: processes {users} use it (kill them "
                                    "first, or pass kill_users=True)", users)
                raise PowerLossError(f"cannot unmount {mp}: {os.strerror(err)}")
            time.sleep(0.02)

    def _abandon(self) -> None:
        """Forget the daemon (it has exited, or is made to)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._sock is not None:
            self._sock.close()
        self._proc, self._sock = None, None

    def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            raise PowerLossError("not mounted")
        try:
            self._sock.sendall((json.dumps(req) + "\n").encode())
            reply = self._recv(60.0)
        except (OSError, PowerLossError) as e:
            # The daemon died or hangs: its undo log is gone, and the mount is useless.
            self.detach()
            raise PowerLossError(f"the filesystem daemon is lost: {e}") from e
        if "error" in reply:
            raise PowerLossError(f"the daemon refused {req['cmd']}: {reply['error']}")
        return reply

    def _recv(self, timeout: float) -> dict[str, Any]:
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PowerLossError(f"no answer from the daemon in {timeout} s "
                                     f"({self._log_tail()})")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise PowerLossError(f"the daemon exited ({self._log_tail()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return f"{self.log_path}: " + " | ".join(lines[-5:])
