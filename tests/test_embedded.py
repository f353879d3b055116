"""The embedded API in one process: three nodes on real TCP over 127.0.0.1.

``RaftKV`` (LMDB files and in-memory), forwarding from followers, CAS and batches,
restart from the data directory, and a PySyncObj-style ``ReplicatedObject``.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from raftkv.storage.commands import CommandError
from raftkv.storage.errors import StorageError
from raftkv.storage.lmdb_checkpoint import CheckpointFile

import raftkv
from raftkv.core import NotLeader
from raftkv.errors import ReplicaEmpty
from raftkv.examples.counter import Counter
from raftkv.kv import RaftKV
from raftkv.testing.procs import free_ports

SECRET = b"embedded-test"


def peers(n: int = 3) -> dict[str, str]:
    return {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(n))}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[RaftKV]]:
    ps = peers()
    kvs = [RaftKV(n, a, ps, SECRET, data_dir=str(tmp_path / n)) for n, a in ps.items()]
    yield kvs
    for kv in kvs:
        kv.close()


def test_writes_on_any_node_are_forwarded_and_reads_are_linearizable(
    cluster: list[RaftKV],
) -> None:
    """Followers forward writes to the leader; a ReadIndex read on any node (§6.4) sees
    every write acknowledged before it started."""
    lead = cluster[0].wait_for_leader()
    for i, kv in enumerate(cluster):
        kv.put(f"k{i}", f"v{i}")
    for kv in cluster:
        assert [kv.get(f"k{i}") for i in range(3)] == [b"v0", b"v1", b"v2"]
    follower = next(kv for kv in cluster if kv.node_id != lead)
    assert follower.cas("k0", "v0", "w0")[0] is True
    assert follower.cas("k0", "v0", "x0")[0] is False
    assert follower.cas("new", None, "1")[0] is True
    follower.batch([("b1", "1"), ("b2", "2"), ("k1", None)])
    assert cluster[0].get("b2") == b"2" and cluster[0].get("k1") is None
    follower.delete("b1")
    assert cluster[2].get("b1") is None
    assert len({(d["count"], d["digest"]) for d in
                (kv.digest() for kv in cluster)}) == 1


def test_bad_keys_and_values_are_refused_before_proposing(cluster: list[RaftKV]) -> None:
    cluster[0].wait_for_leader()
    with pytest.raises(CommandError):
        cluster[0].put("", "x")
    with pytest.raises(CommandError):
        cluster[0].put("k" * 600, "x")
    with pytest.raises(CommandError):
        cluster[0].put("k", b"x" * (1 << 20 + 1))
    # The message names both types a key or value may be (found outside-in: it said
    # "must be bytes" of an int key, though a str works).
    with pytest.raises(CommandError, match="key must be bytes or str, not int"):
        cluster[0].put(7, "x")  # type: ignore[arg-type]
    with pytest.raises(CommandError, match="value must be bytes or str, not float"):
        cluster[0].put("k", 1.5)  # type: ignore[arg-type]
    # Text UTF-8 cannot encode was a bare UnicodeEncodeError (found from outside); a
    # bytes subclass was refused where a str subclass was taken.
    with pytest.raises(CommandError, match="key is not valid text .*pass bytes"):
        cluster[0].put("a\udc80", "x")
    with pytest.raises(CommandError, match="value is not valid text"):
        cluster[0].put("k", "\ud800")

    class Raw(bytes):
        pass

    cluster[0].put(Raw(b"raw"), Raw(b"v"))
    assert cluster[0].get(b"raw") == b"v"
    # A malformed batch operation is refused as the others are (it was a bare unpacking
    # error; found from outside), and nothing of the batch is applied.
    for bad in ([("a",)], [("a", "1"), ("b", "2", "3")], ["ab"], [None]):
        with pytest.raises(CommandError, match="a batch operation is a"):
            cluster[0].batch(bad)
    assert cluster[0].get("a") is None
    # An empty batch wrote an empty entry, where the HTTP API refuses one (found from
    # outside): refused here too.
    last = cluster[0].put("z", "1")
    with pytest.raises(CommandError, match="at least one operation"):
        cluster[0].batch([])
    assert cluster[0].put("z", "2") == last + 1


def test_settings_that_would_spin_or_fail_every_call_are_refused(tmp_path: Path) -> None:
    """Found from outside: tick_seconds=0 was taken and an idle node spun its loop (1.2 s
    of CPU in 2 s); request_timeout=-1 failed every call at once though its write could
    apply; a raft address other than the one peers lists for the node was listened on
    while the others dialled the listed one. Refused before a file is written, as
    ``raftkv serve``'s flags refuse them."""
    ps = peers()
    d = str(tmp_path / "n1")
    for kwargs, msg in (({"tick_seconds": 0}, "tick_seconds must be at least 0.001"),
                        ({"tick_seconds": float("nan")}, "tick_seconds"),
                        ({"request_timeout": -1}, "request_timeout must be a positive"),
                        ({"request_timeout": 0}, "request_timeout"),
                        ({"request_timeout": "5"}, "request_timeout")):
        with pytest.raises(ValueError, match=msg):
            RaftKV("n1", ps["n1"], ps, SECRET, data_dir=d, **kwargs)  # type: ignore[arg-type]
    other = ps["n2"].rsplit(":", 1)[0] + ":1"
    with pytest.raises(ValueError, match="peers gives n1 the address .* but its raft address"):
        RaftKV("n1", other, ps, SECRET, data_dir=d)
    with pytest.raises(ValueError, match="tick_seconds"):  # it reads its files first
        raftkv.ReplicatedNode(Counter(), "n1", ps["n1"], ps, SECRET, data_dir=d,
                              tick_seconds=0)
    assert not os.path.exists(d)


def test_a_peers_map_that_gives_one_address_to_two_ids_is_refused(tmp_path: Path) -> None:
    """Found from outside: n3 given n2's address by mistake was accepted, and the node
    never elected, its dials to n3 answered by n2. ``raftkv serve --peers`` refused
    it already; the embedded API now does too, before it opens a file."""
    ps = peers()
    ps["n3"] = ps["n2"]
    with pytest.raises(ValueError, match="gives the address .* to n2 and n3"):
        RaftKV("n1", ps["n1"], ps, SECRET, data_dir=str(tmp_path / "n1"))
    assert not (tmp_path / "n1").exists()


def test_a_restarted_node_recovers_from_its_data_dir(tmp_path: Path) -> None:
    """IGNITE-16907: the state store reopens at its checkpoint and replays the log."""
    ps = peers()
    kvs = {n: RaftKV(n, a, ps, SECRET, data_dir=str(tmp_path / n)) for n, a in ps.items()}
    try:
        kvs["n1"].wait_for_leader()
        for i in range(100):
            kvs["n2"].put(f"k{i}", str(i))
        kvs["n3"].close()
        # If n3 led, a write forwarded to it as it stopped has an unknown outcome: wait
        # for a leader among the others first.
        deadline = time.monotonic() + 10
        while kvs["n1"].leader() in (None, "n3"):
            assert time.monotonic() < deadline, "no new leader"
            time.sleep(0.02)
        kvs["n1"].put("late", "yes")
        kvs["n3"] = RaftKV("n3", ps["n3"], ps, SECRET, data_dir=str(tmp_path / "n3"))
        assert kvs["n3"].get("late") == b"yes"
        assert kvs["n3"].get("k99", stale=True) == b"99"
        assert "recovery" in kvs["n3"].status()["groups"]["default"]["recovery"]
    finally:
        for kv in kvs.values():
            kv.close()


def test_a_node_whose_log_directory_was_lost_refuses_to_open(tmp_path: Path) -> None:
    """Found from outside: a single node's log directory deleted (its state store kept,
    at checkpoint 22). It opened with a new, empty log: the 20 writes after the checkpoint
    were gone while linearizable reads answered, and new writes took indexes the store
    counted as applied, so they were skipped (each ended "outcome unknown"). The open
    is refused, saying what was lost and what to do; the files are left as they were."""
    import shutil

    (port,) = free_ports(1)
    ps = {"n1": f"127.0.0.1:{port}"}
    d = tmp_path / "n1"
    kv = RaftKV("n1", ps["n1"], ps, SECRET, data_dir=str(d))
    for i in range(20):
        kv.put(f"k{i}", "v")
    kv.close()  # checkpoints what it applied
    shutil.rmtree(d / "groups" / "default" / "log")
    with pytest.raises(StorageError, match="the state store is at index 2[0-9], but the "
                                           "Raft log .* is new .empty.: the log's files "
                                           "were lost"):
        RaftKV("n1", ps["n1"], ps, SECRET, data_dir=str(d))
    # Refused without a trace: the directory can be claimed again (moved away, say).
    with pytest.raises(StorageError, match="is new"):
        RaftKV("n1", ps["n1"], ps, SECRET, data_dir=str(d))


def test_every_replica_checkpoints_what_it_applied_once_the_policy_is_due(
    tmp_path: Path,
) -> None:
    """The loop checkpoints only groups that applied something since their last
    checkpoint (it no longer scans every group each tick): followers and the leader
    alike reach checkpoint == applied within the default one-second policy, with
    nothing else happening."""
    ps = peers()
    kvs = {n: RaftKV(n, a, ps, SECRET, data_dir=str(tmp_path / n)) for n, a in ps.items()}
    try:
        kvs["n1"].wait_for_leader()

        def all_checkpointed(applied_at_least: int) -> None:
            deadline = time.monotonic() + 15
            while True:
                groups = [kv.status()["groups"]["default"] for kv in kvs.values()]
                if all(g["checkpoint"] == g["applied"] >= applied_at_least for g in groups):
                    return
                assert time.monotonic() < deadline, groups
                time.sleep(0.1)

        kvs["n2"].put("first", "1")
        all_checkpointed(1)
        # Every group is now fully checkpointed: these applies must put it back on the
        # loop's list of groups to checkpoint.
        for i in range(50):
            kvs["n2"].put(f"k{i}", str(i))
        all_checkpointed(51)
    finally:
        for kv in kvs.values():
            kv.close()


def test_a_checkpoint_out_of_file_descriptors_is_deferred_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found from outside: a flood of idle HTTP connections ran a node out of file
    descriptors, the next checkpoint failed to open its data file (EMFILE), and the
    driver loop died for good. Nothing had been written or synced, so the checkpoint is
    deferred instead: the node goes on serving and checkpoints once descriptors are
    back."""
    ps = peers(1)
    kv = RaftKV("n1", ps["n1"], ps, SECRET, data_dir=str(tmp_path / "n1"))
    failing = [True]
    real = CheckpointFile.capture

    def capture(self: CheckpointFile, txnid: int) -> bytes:
        if failing[0]:
            raise OSError(errno.EMFILE, "Too many open files", self.path)
        return real(self, txnid)

    monkeypatch.setattr(CheckpointFile, "capture", capture)
    try:
        kv.wait_for_leader()
        for i in range(5):
            kv.put(f"k{i}", str(i))
        time.sleep(2.5)  # the one-second policy came due, and deferred, at least once
        group = kv.status()["groups"]["default"]
        assert group["checkpoint"] < group["applied"]
        kv.put("still", "serving")
        failing[0] = False
        deadline = time.monotonic() + 15
        while (g := kv.status()["groups"]["default"])["checkpoint"] < g["applied"]:
            assert time.monotonic() < deadline, g
            time.sleep(0.1)
        assert kv.get("still") == b"serving"
    finally:
        kv.close()


def test_a_data_dir_belongs_to_one_node(tmp_path: Path) -> None:
    ps = peers(1)
    RaftKV("n1", ps["n1"], ps, SECRET, data_dir=str(tmp_path)).close()
    with pytest.raises(StorageError, match="n1"):
        RaftKV("n2", ps["n1"], {"n2": ps["n1"]}, SECRET, data_dir=str(tmp_path))


def test_in_memory_nodes_and_a_learner_that_is_promoted() -> None:
    """Kudu's add-server flow on memory storage: a joining node is added as a
    PRE_FOLLOWER with its address, catches up, and the leader promotes it."""
    ps = peers(4)
    founders = {k: v for k, v in ps.items() if k != "n4"}
    kvs = [RaftKV(n, a, founders, SECRET) for n, a in founders.items()]
    joiner = RaftKV("n4", ps["n4"], {"n4": ps["n4"]}, SECRET, join=True)
    try:
        kvs[0].wait_for_leader()
        for i in range(20):
            kvs[1].put(f"k{i}", "v")
        # Not added yet, it holds nothing of the group: a stale read is an error, not
        # "absent" (found from outside, on a restarted in-memory table replica).
        with pytest.raises(ReplicaEmpty, match="started empty and has not caught up"):
            joiner.get("k19", stale=True)
        lead = next(kv for kv in kvs if kv.leader() == kv.node_id)
        lead.add_learner("n4", ps["n4"])
        deadline = 200
        while kvs[0].members().get("n4") != "voter" and deadline:
            deadline -= 1
            kvs[0]._sleep()
        assert kvs[0].members().get("n4") == "voter"
        assert joiner.get("k19") == b"v"
        assert joiner.get("k19", stale=True) == b"v"
    finally:
        for kv in [*kvs, joiner]:
            kv.close()


def test_an_in_memory_founder_restarted_serves_no_stale_read_before_it_caught_up() -> None:
    """Found in review: an in-memory founder started again with the same arguments
    applies its bootstrap entry (index 1) at once, and one catching up over several
    appends has applied a prefix: either way a stale read said "absent" for keys the
    group had committed long before. Until it reaches what the first leader it heard
    from had committed, it answers ReplicaEmpty; after, the value."""
    ps = peers()
    kvs = {n: RaftKV(n, a, ps, SECRET) for n, a in ps.items()}
    try:
        lead = kvs["n1"].wait_for_leader()
        big = b"x" * 8192
        for i in range(400):  # over 3 MB of log: the catch-up takes several appends
            kvs[lead].put(f"k{i:03d}", big)
        victim = next(n for n in ps if n != lead)
        kvs[victim].close()
        kvs[victim] = RaftKV(victim, ps[victim], ps, SECRET)
        answers: list[object] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                got = (kvs[victim].get("k010", stale=True), kvs[victim].get("k399", stale=True))
            except ReplicaEmpty:
                answers.append("empty")
                time.sleep(0.002)
                continue
            answers.append(got)
            break
        assert answers[-1] == (big, big), answers[-5:]
        assert all(a == "empty" for a in answers[:-1])
    finally:
        for kv in kvs.values():
            kv.close()


def test_membership_changes_on_a_follower_name_the_leader(cluster: list[RaftKV]) -> None:
    lead = cluster[0].wait_for_leader()
    follower = next(kv for kv in cluster if kv.node_id != lead)
    with pytest.raises(NotLeader) as e:
        follower.add_learner("n9", "127.0.0.1:1")
    assert e.value.leader == lead


def test_a_replicated_object_behaves_like_pysyncobj(tmp_path: Path) -> None:
    """``@replicated`` methods propose and return the value computed at apply; every
    replica's object holds the same state; a restart restores from checkpoint + log."""
    ps = peers()
    objs = {n: Counter() for n in ps}
    nodes = {n: raftkv.ReplicatedNode(objs[n], n, a, ps, SECRET, data_dir=str(tmp_path / n))
             for n, a in ps.items()}
    try:
        nodes["n1"].wait_for_leader()
        assert objs["n2"].incr(5) == 5
        assert objs["n3"].incr() == 6
        fut = objs["n1"].incr(4, sync=False)
        assert fut.result(timeout=5) == 10
        nodes["n1"].node.read("default", lambda s: None).result(timeout=5)
        for n in ps:  # a read round on each makes sure it has applied index >= 10's
            nodes[n].node.read("default", lambda s: None).result(timeout=5)
        assert {o.get() for o in objs.values()} == {10}
        nodes["n3"].close()
        deadline = time.monotonic() + 10  # see test_a_restarted_node_recovers_from_its_data_dir
        while nodes["n1"].leader() in (None, "n3"):
            assert time.monotonic() < deadline, "no new leader"
            time.sleep(0.02)
        objs["n3"] = Counter()
        nodes["n3"] = raftkv.ReplicatedNode(objs["n3"], "n3", ps["n3"], ps, SECRET,
                                            data_dir=str(tmp_path / "n3"))
        assert objs["n1"].incr() == 11
        nodes["n3"].node.read("default", lambda s: None).result(timeout=5)
        assert objs["n3"].get() == 11
    finally:
        for node in nodes.values():
            node.close()


def test_a_cancelled_request_does_not_stop_the_node(cluster: list[RaftKV]) -> None:
    """A caller that gives up (asyncio.wait_for, a cancelled handler) cancels its future;
    the loop resolving it later must shrug, not die."""
    cluster[0].wait_for_leader()
    futs = [cluster[0].put_async(f"c{i}", "v") for i in range(50)]
    for f in futs[::2]:
        f.cancel()
    cluster[0].put("after", "cancel")
    assert cluster[1].get("after") == b"cancel"
    assert cluster[0].node.failure is None


def test_transfer_to_a_closed_voter_times_out(tmp_path: Path) -> None:
    """A leadership transfer whose target never takes over fails with RequestTimeout,
    even on a group with nothing else pending (review finding: the tick had stopped
    expiring groups without proposals, reads or parked calls, transfers included)."""
    from raftkv.node.errors import RequestTimeout

    ps = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}
    kvs = {n: RaftKV(n, a, ps, b"secret", data_dir=str(tmp_path / n)) for n, a in ps.items()}
    try:
        lead = kvs["n1"].wait_for_leader()
        kvs[lead].put("k", "v")
        dead = next(n for n in kvs if n != lead)
        kvs[dead].close()
        time.sleep(0.5)
        kv = kvs[lead]
        with pytest.raises(RequestTimeout):
            kv.node.transfer_leadership(kv.group, dead).result(timeout=15)
    finally:
        for kv in kvs.values():
            kv.close()


def test_a_callback_may_make_synchronous_calls_and_bad_timeouts_are_refused(
    tmp_path: Path,
) -> None:
    """Found by an outside-in check: ``callback=`` ran on the node's loop thread, so a
    synchronous replicated call inside it waited for that very thread and the node hung
    for good (PySyncObj users write exactly that). Callbacks now run on a thread of their
    own, in completion order. A negative timeout was accepted and reported as "may still
    be applied later"; it is refused before anything is proposed."""
    ps = {"n1": f"127.0.0.1:{free_ports(1)[0]}"}
    obj = Counter()
    node = raftkv.ReplicatedNode(obj, "n1", ps["n1"], ps, SECRET, data_dir=str(tmp_path))
    try:
        node.wait_for_leader()
        seen: list[tuple[object, object, int]] = []

        def nested(result: object, error: object) -> None:
            seen.append((result, error, obj.incr(100, timeout=5)))  # synchronous

        obj.incr(1, callback=nested)
        deadline = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < deadline, "the callback never ran (the node hung?)"
            time.sleep(0.02)
        assert seen == [(1, None, 101)]
        assert obj.incr(1, timeout=5) == 102  # the node is alive
        for bad in (-1, float("nan"), float("inf"), 1e300, "5", True):
            with pytest.raises(ValueError, match="timeout must be"):
                obj.incr(1, timeout=bad)  # type: ignore[arg-type]
        assert obj.get() == 102  # none of them was proposed
    finally:
        node.close()


@pytest.mark.parametrize("secret", [12345, None, 1.5, ["s"]])
def test_a_secret_that_is_not_bytes_or_text_is_refused_before_anything_starts(
    tmp_path: Path, secret: object,
) -> None:
    """Found from outside: an int was accepted, and the node's loop died with a
    TypeError at its first handshake, leaving a node that refused every call."""
    (port,) = free_ports(1)
    peers = {"n1": f"127.0.0.1:{port}"}
    for make in (lambda: RaftKV("n1", peers["n1"], peers, secret, data_dir=str(tmp_path / "kv")),  # type: ignore[arg-type]
                 lambda: raftkv.ReplicatedNode(Counter(), "n1", peers["n1"], peers, secret,  # type: ignore[arg-type]
                                               data_dir=str(tmp_path / "obj"))):
        with pytest.raises(TypeError, match="cluster secret is bytes or str"):
            make()
    assert not (tmp_path / "kv").exists() and not (tmp_path / "obj").exists()
    # The port was never bound: a node with a good secret starts on it.
    with RaftKV("n1", peers["n1"], peers, "text secret", data_dir=str(tmp_path / "ok")) as kv:
        kv.wait_for_leader()


def test_stale_must_be_a_bool(cluster: list[RaftKV]) -> None:
    """Found from outside: ``get("k", stale="yes")`` was taken as true, so a string such as
    "false" gave a stale read where a linearizable one was asked for."""
    kv = cluster[0]
    kv.put("k", "v")
    assert kv.get("k", stale=False) == b"v"
    for bad in ("yes", "false", 1, None):
        with pytest.raises(TypeError, match="stale must be True or False"):
            kv.get("k", stale=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="stale must be True or False"):
            kv.get_meta("k", stale=bad)  # type: ignore[arg-type]
