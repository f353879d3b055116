"""One process per data directory (``raftkv.storage.dir_lock``), with real processes:
what another process sees while this one holds a directory, and that a refused claim,
a fork, and a directory replaced under a hold all leave the lock where it belongs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from raftkv.storage.dir_lock import lock_data_dir, release_data_dir
from raftkv.storage.errors import StorageError

from raftkv.node.stores import claim_data_dir

_PROBE = """
import sys
from raftkv.storage.dir_lock import lock_data_dir
from raftkv.storage.errors import StorageError
try:
    lock_data_dir(sys.argv[1])
except StorageError as e:
    print(e)
    sys.exit(3)
print("locked")
"""


def _other_process_locks(d: str) -> bool:
    res = subprocess.run([sys.executable, "-c", _PROBE, d], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode in (0, 3), res.stderr
    if res.returncode == 3:
        assert "is in use by another process (pid " in res.stdout, res.stdout
    return res.returncode == 0


def test_a_held_directory_is_refused_to_another_process_until_released(
        tmp_path: Path) -> None:
    d = str(tmp_path / "n1")
    claim_data_dir(d, "n1")
    try:
        assert not _other_process_locks(d)
    finally:
        release_data_dir(d)
    assert _other_process_locks(d)
    claim_data_dir(d, "n1")  # a node stopped and opened again in one process
    release_data_dir(d)


def test_a_second_node_of_one_process_is_refused_and_the_first_keeps_its_hold(
        tmp_path: Path) -> None:
    """Found from outside: a second embedded node on a running node's directory, in the
    same process, got the process's lock again, failed only at LMDB's own refusal
    (reported as a CorruptLog), and its cleanup released the first node's lock: another
    process could then have run the directory beside the first node. It is refused
    before it opens anything, and the first node still holds the directory."""
    from raftkv.kv import RaftKV
    from raftkv.testing.procs import free_ports

    d = str(tmp_path / "n1")
    p1, p2 = free_ports(2)
    kv = RaftKV("n1", f"127.0.0.1:{p1}", {"n1": f"127.0.0.1:{p1}"}, "s", data_dir=d)
    try:
        kv.put("k", "v")
        with pytest.raises(StorageError, match="in use by a node of this process"):
            RaftKV("n1", f"127.0.0.1:{p2}", {"n1": f"127.0.0.1:{p2}"}, "s", data_dir=d)
        assert not _other_process_locks(d)
        assert kv.get("k") == b"v"
    finally:
        kv.close()
    assert _other_process_locks(d)
    kv = RaftKV("n1", f"127.0.0.1:{p1}", {"n1": f"127.0.0.1:{p1}"}, "s", data_dir=d)
    try:
        assert kv.get("k") == b"v"
    finally:
        kv.close()


def test_a_refused_claim_holds_nothing(tmp_path: Path) -> None:
    """Found in review: a claim refused for another node's directory kept the lock, so
    the right node could not start elsewhere."""
    d = str(tmp_path / "n1")
    claim_data_dir(d, "n1")
    release_data_dir(d)
    with pytest.raises(StorageError, match="holds the data of node 'n1', not of 'n2'"):
        claim_data_dir(d, "n2")
    assert _other_process_locks(d)


def test_data_without_its_node_id_is_refused_to_every_node(tmp_path: Path) -> None:
    """Found from outside: with node_id removed or emptied, another node started on the
    directory, rewrote node_id as its own and served with the first node's log. node_id
    is written before any data, so data without it is damage, and no node may take it;
    a node_id that is not text is named as damaged (it was a bare UnicodeDecodeError).
    A fresh directory, or one with only the lock and peers file, is still claimed."""
    d = str(tmp_path / "n1")
    claim_data_dir(d, "n1")
    release_data_dir(d)
    os.makedirs(os.path.join(d, "groups", "default", "log"))
    node_id = os.path.join(d, "node_id")
    for damage in (lambda: os.remove(node_id), lambda: open(node_id, "w").close()):
        damage()
        for who in ("n1", "n2"):
            with pytest.raises(StorageError, match="node_id file is missing or empty"):
                claim_data_dir(d, who)
            assert _other_process_locks(d)
    with open(node_id, "wb") as f:
        f.write(b"\xff\xfe n1")
    with pytest.raises(StorageError, match="node_id is damaged"):
        claim_data_dir(d, "n1")
    with open(node_id, "w") as f:
        f.write("n1\n")
    claim_data_dir(d, "n1")  # the owner's id written back: its own again
    release_data_dir(d)
    fresh = str(tmp_path / "fresh")
    os.makedirs(fresh)
    open(os.path.join(fresh, "peers.json"), "w").close()
    claim_data_dir(fresh, "n2")
    release_data_dir(fresh)


def test_a_forked_child_does_not_inherit_the_hold(tmp_path: Path) -> None:
    """fcntl locks are not inherited: a child that thought it held the directory could
    run a second node on it."""
    d = str(tmp_path / "n1")
    claim_data_dir(d, "n1")
    try:
        pid = os.fork()
        if pid == 0:  # the child: it must be refused
            try:
                lock_data_dir(d)
                os._exit(0)
            except StorageError:
                os._exit(3)
            except BaseException:  # noqa: BLE001 - a forked child must exit, never return into pytest
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3
    finally:
        release_data_dir(d)


def test_a_directory_made_again_under_a_hold_is_locked_afresh(tmp_path: Path) -> None:
    """A node abandoned in-process, its directory wiped and made again: the old hold is
    on a file that is gone, so the new directory is locked again."""
    d = str(tmp_path / "n1")
    claim_data_dir(d, "n1")
    try:
        shutil.rmtree(d)
        claim_data_dir(d, "n1")
        assert not _other_process_locks(d)
    finally:
        release_data_dir(d)
    assert _other_process_locks(d)


def test_unsafe_reset_refuses_a_directory_another_process_holds(tmp_path: Path) -> None:
    """The offline reset holds each survivor's directory while it reads and writes it; a
    directory another process holds (a node starting, or still running) is refused."""
    from raftkv.kv import RaftKV
    from raftkv.testing.procs import free_ports

    d = str(tmp_path / "n1")
    port = free_ports(1)[0]
    kv = RaftKV("n1", f"127.0.0.1:{port}", {"n1": f"127.0.0.1:{port}"}, "s", data_dir=d)
    kv.put("k", "v")
    kv.close()
    claim_data_dir(d, "n1")
    try:
        res = subprocess.run(
            [sys.executable, "-m", "raftkv.cli", "recover", "unsafe-reset", "--data-dir", d,
             "--members", "n1"], capture_output=True, text=True, timeout=60, check=False)
    finally:
        release_data_dir(d)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "is in use by another process" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "recover", "unsafe-reset", "--data-dir", d,
         "--members", "n1"], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 2, (res.stdout, res.stderr)  # released: the dry run reads it


def test_a_replicated_node_refused_at_construction_holds_nothing(tmp_path: Path) -> None:
    """A ``ReplicatedNode`` claims its directory before its state store reads the
    checkpoint files; refused afterwards (an id missing from peers), it lets go."""
    from raftkv.embedded import ReplicatedNode
    from raftkv.statemachine import ReplicatedObject

    d = str(tmp_path / "n1")
    with pytest.raises(ValueError, match="not in peers"):
        ReplicatedNode(ReplicatedObject(), "n9", "127.0.0.1:1", {"n1": "127.0.0.1:1"}, "s",
                       data_dir=d)
    assert _other_process_locks(d)
