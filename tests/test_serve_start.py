"""How ``raftkv serve`` starts: arguments that would split a cluster are refused before
anything is written. (``/health`` and ``/ready`` at start: ``tests/test_ready.py``.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raftkv.testing.procs import free_ports


def test_an_id_missing_from_peers_is_refused_without_join(tmp_path: Path) -> None:
    """A mistyped --id used to bootstrap a configuration of the peers plus itself: a
    4-voter group no other node shares."""
    ports = free_ports(5)
    peers = ",".join(f"n{i}=127.0.0.1:{ports[i - 1]}" for i in (1, 2, 3))
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    data = tmp_path / "n7"
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n7", "--data-dir", str(data),
         "--raft-addr", f"127.0.0.1:{ports[3]}", "--http-addr", f"127.0.0.1:{ports[4]}",
         "--peers", peers, "--secret-file", str(secret)],
        check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "n7 is not among --peers (n1, n2, n3)" in res.stderr
    assert "Traceback" not in res.stderr
    assert not data.exists() or not os.listdir(data)  # nothing written



def test_a_second_serve_on_a_running_nodes_directory_is_refused(tmp_path: Path) -> None:
    """Found from outside: a second ``raftkv serve`` on a running node's data directory
    (same id, other ports) used to open its LMDB files too, answer reads from them, and
    could damage the running node's stores. Now it exits with a clear error before it
    opens a file, and the running node keeps serving."""
    from raftkv.testing.procs import ProcCluster

    with ProcCluster(str(tmp_path / "c"), size=3) as c:
        c.start()
        c.wait_leader()
        n2 = c.nodes["n2"]
        ports = free_ports(2, [n.raft_port for n in c.nodes.values()]
                           + [n.http_port for n in c.nodes.values()])
        res = subprocess.run(
            [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n2",
             "--data-dir", n2.data_dir, "--raft-addr", f"127.0.0.1:{ports[0]}",
             "--http-addr", f"127.0.0.1:{ports[1]}",
             "--peers", ",".join(f"{i}={n.raft_addr if i != 'n2' else f'127.0.0.1:{ports[0]}'}"
                                 for i, n in c.nodes.items()),
             "--secret-file", c.secret_file],
            check=False, capture_output=True, text=True, timeout=60)
        assert res.returncode != 0
        assert "is in use by another process" in res.stderr, res.stderr
        assert f"(pid {n2.proc.pid})" in res.stderr if n2.proc else True
        assert "Traceback" not in res.stderr
        client = c.client()
        client.put("after", "still-served")
        assert client.get("after", stale=False) == b"still-served"
        assert n2.alive
        # A SIGKILLed node's lock goes with it: restarted, it takes its directory again.
        c.kill("n2")
        c.start("n2")
        c.wait_until(lambda: c.client(["n2"]).get("after", stale=True) == b"still-served")


def test_an_embedded_node_holds_its_directory_until_closed(tmp_path: Path) -> None:
    """The same lock for an embedded node: another process is refused while it runs, and
    may open the directory once it is closed (the lock is per process, so reopening in
    the same process works at once)."""
    from raftkv.kv import RaftKV

    port, other = free_ports(2)  # the probe listens elsewhere: the lock is what it meets
    data = str(tmp_path / "n1")
    probe = ("import sys\nfrom raftkv.kv import RaftKV\n"
             "from raftkv.storage.errors import StorageError\n"
             "try:\n"
             f"    RaftKV('n1', '127.0.0.1:{other}', {{'n1': '127.0.0.1:{other}'}}, "
             f"'s', data_dir={data!r}).close()\n"
             "except StorageError as e:\n    print(e); sys.exit(3)\n")
    kv = RaftKV("n1", f"127.0.0.1:{port}", {"n1": f"127.0.0.1:{port}"}, "s", data_dir=data)
    try:
        kv.put("k", "v")
        res = subprocess.run([sys.executable, "-c", probe], check=False,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 3, res.stdout + res.stderr
        assert "is in use by another process" in res.stdout
    finally:
        kv.close()
    kv = RaftKV("n1", f"127.0.0.1:{port}", {"n1": f"127.0.0.1:{port}"}, "s", data_dir=data)
    assert kv.get("k") == b"v"
    kv.close()
    res = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def _serve(tmp_path: Path, *extra: str, raft: int | None = None) -> tuple[
        subprocess.CompletedProcess[str], Path]:
    """``raftkv serve`` of a one-node cluster with ``extra`` arguments, expected to
    refuse to start: (the finished process, its data directory)."""
    ports = free_ports(2)
    raft_port = ports[0] if raft is None else raft
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    data = tmp_path / "n1"
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n1", "--data-dir", str(data),
         "--raft-addr", f"127.0.0.1:{raft_port}", "--http-addr", f"127.0.0.1:{ports[1]}",
         "--peers", f"n1=127.0.0.1:{raft_port}", "--secret-file", str(secret), *extra],
        check=False, capture_output=True, text=True, timeout=60)
    return res, data


@pytest.mark.parametrize("args,says", [
    (["--tick", "0"], "--tick: must be more than 0 seconds"),
    (["--tick", "-1"], "--tick: must be more than 0 seconds"),
    (["--tick", "1e-300"], "--tick: must be at least 0.001 seconds"),
    (["--election-ticks", "²"], "--election-ticks: must be a whole number of at least 3"),
    (["--election-ticks", "0"], "--election-ticks: must be a whole number of at least 3"),
    (["--election-ticks", "2"], "--election-ticks: must be a whole number of at least 3"),
    (["--compact-entries", "0"], "--compact-entries: must be a whole number of at least 1"),
    (["--compact-keep", "-5"], "--compact-keep: must be a whole number of at least 0"),
])
def test_timing_and_compaction_arguments_out_of_range_are_refused(
        tmp_path: Path, args: list[str], says: str) -> None:
    """Found from outside: ``--tick 0`` was accepted and the node spun a core at 99%;
    ``--election-ticks 0`` created the data directory and then failed in randrange;
    ``--election-ticks 1``, ``--compact-entries 0`` and ``--compact-keep -5`` were
    accepted. Each is now a one-line usage error, before anything is written."""
    res, data = _serve(tmp_path, *args)
    assert res.returncode != 0
    assert says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not data.exists()


def test_a_raft_address_in_use_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Found from outside: with its raft port taken, a node claimed its data directory
    (LOCK, node_id, groups/) and then exited with a bare "Address already in use" that
    did not say which address. It now names the raft address and writes nothing."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        res, data = _serve(tmp_path, raft=taken.getsockname()[1])
    finally:
        taken.close()
    assert res.returncode != 0
    assert "cannot listen on the raft address 127.0.0.1:" in res.stderr, res.stderr
    assert "Address already in use" in res.stderr
    assert "Traceback" not in res.stderr
    assert not data.exists() or not os.listdir(data)


def test_the_heartbeat_interval_serve_assumes_is_the_drivers() -> None:
    """``--election-ticks`` is checked against the heartbeat interval without importing
    the driver (it loads on the node's thread while the HTTP stack imports)."""
    from raftkv.node.driver import NodeConfig
    from raftkv.server.serve import HEARTBEAT_TICKS

    assert NodeConfig("n1", "127.0.0.1:1", b"s").heartbeat_tick == HEARTBEAT_TICKS


def test_a_replicated_node_with_its_raft_port_taken_writes_nothing(tmp_path: Path) -> None:
    """Review finding: a ReplicatedNode claims its directory before its state store
    opens, so it checks its raft address first, as the embedded node does."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    addr = f"127.0.0.1:{taken.getsockname()[1]}"
    d = tmp_path / "n1"
    probe = ("from raftkv.embedded import ReplicatedNode\n"
             "from raftkv.statemachine import ReplicatedObject\n"
             f"ReplicatedNode(ReplicatedObject(), 'n1', {addr!r}, {{'n1': {addr!r}}}, 's', "
             f"data_dir={str(d)!r})\n")
    try:
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60, check=False)
    finally:
        taken.close()
    assert "cannot listen on the raft address" in res.stderr, res.stderr
    assert not d.exists(), sorted(p.name for p in d.iterdir())
