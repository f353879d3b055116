"""Unsafe reset (Kudu's configuration-change design, "Restoring availability after
catastrophic data loss"): after a group permanently loses a majority of its voters, the
survivors are forced into a new configuration of their own, over real LMDB files, and the
restarted cores elect a leader and commit again.

Each test is named after the rule it checks; the module docstring of
``raftkv.recovery.unsafe_reset`` argues why each rule holds."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import msgpack
import pytest
import raftkv.recovery.unsafe_reset as unsafe_reset_module
from raftkv.recovery.unsafe_reset import (
    CONFIRM_FLAG,
    UnsafeResetError,
    group_paths,
    main,
    unsafe_reset,
)
from raftkv.storage.commands import encode_put
from raftkv.storage.layout import partition_logs_path
from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
from raftkv.storage.lmdb_state import LmdbStateStore

from raftkv.core import Config, ConfState, Entry, EntryType, HardState, Message, Raft, Role
from raftkv.core import bootstrap as bootstrap_log
from raftkv.core.errors import NotLeader
from raftkv.core.membership import encode_conf_entry
from raftkv.node.group_storage import GroupStorage

FIVE = ["n1", "n2", "n3", "n4", "n5"]


def key(name: str) -> bytes:
    return name.encode()


class LmdbGroup:
    """Raft cores over LmdbLogStore + LmdbStateStore in per-node data directories laid
    out as the server lays them out; messages delivered synchronously (persist -> send ->
    apply -> advance), as in tests/test_lmdb_cluster.py."""

    def __init__(self, dirs: dict[str, Path], voters: Iterable[str] | None = None) -> None:
        self.dirs = dirs
        self.nodes: dict[str, tuple[Raft, GroupStorage]] = {}
        self.cut: set[str] = set()
        self.deaf: str | None = None
        self.incarnation = 0
        for nid in dirs:
            self.open(nid, voters)

    def open(self, nid: str, voters: Iterable[str] | None = None) -> None:
        d = self.dirs[nid]
        d.mkdir(parents=True, exist_ok=True)
        (d / "node_id").write_text(nid + "\n")
        log_path, state_path = group_paths(str(d), "default")
        state = LmdbStateStore(state_path)
        raft_log = LmdbLogStore(log_path, verify_from=state.checkpoint_index() + 1)
        if voters is not None:
            bootstrap_log(raft_log, voters)
        gs = GroupStorage(raft_log, state)
        gs.recover()
        self.incarnation += 1
        ident = raft_log.identity()  # as the driver does: identities on
        config = Config(id=nid, applied=state.applied_index(), vote_floor=gs.vote_floor,
                        incarnation=ident.incarnation, newborn=ident.newborn)
        self.nodes[nid] = (Raft(config, raft_log, random.Random(f"{nid}/{self.incarnation}")), gs)

    def close(self, nid: str) -> None:
        """Stop using a node for good (a lost voter) or until reopened."""
        _, gs = self.nodes.pop(nid)
        gs.log.close()  # type: ignore[attr-defined]
        gs.state.close()

    def close_all(self) -> None:
        for nid in list(self.nodes):
            self.close(nid)

    def raft(self, nid: str) -> Raft:
        return self.nodes[nid][0]

    def state(self, nid: str) -> LmdbStateStore:
        return self.nodes[nid][1].state  # type: ignore[return-value]

    def stabilize(self) -> None:
        for _ in range(10_000):
            msgs: list[Message] = []
            for raft, gs in self.nodes.values():
                if not raft.has_ready():
                    continue
                rd = raft.ready()
                gs.persist(rd)
                msgs += [gs.outgoing(m) for m in rd.messages]
                gs.apply(rd.committed_entries)
                raft.advance(rd)
            if not msgs:
                return
            for m in msgs:
                if (m.to not in self.nodes or m.to in self.cut or m.frm in self.cut
                        or m.to == self.deaf):
                    continue  # a lost node, a cut link, or a node that hears nothing
                raft, gs = self.nodes[m.to]
                if gs.accept(m):
                    raft.step(m)
        raise AssertionError("did not stabilize")

    def elect_at_birth(self, nid: str) -> None:
        """Elect ``nid`` in a newborn group. A newborn voter grants a vote only once enough
        others have shown it, in their vote requests, that they hold no record of it
        ("Incarnations" in raftkv.core.raft): the others campaign first, each with every
        answer to it dropped so that none wins, then ``nid``."""
        for other in self.nodes:
            if other != nid:
                self.deaf = other
                self.nodes[other][0].campaign()
                self.stabilize()
        self.deaf = None
        self.nodes[nid][0].campaign()
        self.stabilize()

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            for raft, _ in self.nodes.values():
                raft.tick()
            self.stabilize()

    def leader(self) -> str | None:
        leaders = [(r.term, nid) for nid, (r, _) in self.nodes.items() if r.role == Role.LEADER]
        return max(leaders)[1] if leaders else None

    def tick_until_leader(self, max_ticks: int = 300) -> str:
        for _ in range(max_ticks):
            lead = self.leader()
            if lead is not None:
                return lead
            self.tick()
        raise AssertionError(f"no leader within {max_ticks} ticks")

    def put(self, leader: str, items: dict[str, bytes]) -> int:
        index = self.raft(leader).propose_batch(
            [encode_put(key(k), v) for k, v in items.items()]
        )
        self.stabilize()
        return index

    def get(self, nid: str, k: str) -> bytes | None:
        return self.state(nid).get(key(k))


def data_mdb_hashes(dirs: Iterable[Path]) -> dict[str, str]:
    out = {}
    for d in dirs:
        for p in group_paths(str(d), "default"):
            with open(os.path.join(p, "data.mdb"), "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


def batch(prefix: str, n: int) -> dict[str, bytes]:
    return {f"{prefix}{i}": f"{prefix}-value-{i}".encode() for i in range(n)}


# ============================================================= the whole story ========
def test_survivors_of_a_lost_majority_regain_availability_keeping_what_they_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    dirs = {nid: tmp_path / nid for nid in FIVE}
    g = LmdbGroup(dirs, voters=FIVE)
    g.elect_at_birth("n1")
    assert g.leader() == "n1"

    a, b, c = batch("a", 10), batch("b", 10), batch("c", 10)
    g.put("n1", a)  # everywhere
    g.cut = {"n5"}
    b_index = g.put("n1", b)  # n1..n4: n5 falls behind
    g.cut = {"n4", "n5"}
    c_index = g.put("n1", c)  # committed by n1..n3 alone, then lost with them
    assert g.raft("n1").log.committed == c_index
    assert g.raft("n4").log.committed == b_index  # n4 learned b committed, not c

    # The majority is lost for good: the leader and two followers.
    for nid in ("n1", "n2", "n3"):
        g.close(nid)
    g.cut = set()
    assert g.raft("n4").log.last_index() == b_index
    assert g.raft("n5").log.last_index() < b_index

    # Two of five voters can never elect a leader, so nothing commits again.
    g.tick(60)
    g.raft("n4").campaign()
    g.stabilize()
    assert g.leader() is None
    for nid in ("n4", "n5"):
        with pytest.raises(NotLeader):
            g.raft(nid).propose(encode_put(b"never", b"x"))
    assert g.raft("n4").log.committed == b_index
    n5_commit = g.raft("n5").log.committed
    g.close_all()

    # Without the confirmation flag the tool only says what it would do.
    survivors = [str(dirs["n4"]), str(dirs["n5"])]
    before = data_mdb_hashes([dirs["n4"], dirs["n5"]])
    argv = ["--data-dir", survivors[0], "--data-dir", survivors[1], "--members", "n4,n5"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "DRY RUN" in out and "chosen survivor: n4" in out
    assert f"after index {b_index} may be lost" in out
    assert "refused" in err and CONFIRM_FLAG in err
    assert data_mdb_hashes([dirs["n4"], dirs["n5"]]) == before

    # With it, the reset is performed.
    assert main([*argv, CONFIRM_FLAG]) == 0
    out, _ = capsys.readouterr()
    assert "PERFORMED" in out and "chosen survivor: n4" in out

    n4_log = LmdbLogStore(group_paths(survivors[0], "default")[0])
    hard, _ = n4_log.initial_state()
    forced = n4_log.entries(b_index + 1, b_index + 2)[0]
    n4_log.close()
    assert forced.type == EntryType.CONF_CHANGE and forced.index == b_index + 1
    assert hard == HardState(forced.term, "n4", b_index + 1)
    n5_log = LmdbLogStore(group_paths(survivors[1], "default")[0])
    n5_hard = n5_log.initial_state()[0]
    n5_log.close()
    assert n5_hard.commit == n5_commit and n5_hard.term < forced.term  # untouched

    # Restart the survivors: they elect the chosen one and commit again.
    g = LmdbGroup({"n4": dirs["n4"], "n5": dirs["n5"]})
    assert g.tick_until_leader() == "n4"
    g.tick(3)
    # The survivors are recorded as the incarnations they are (see unsafe_reset._reset).
    records = frozenset((nid, g.nodes[nid][1].log.identity().incarnation)
                        for nid in ("n4", "n5"))
    for nid in ("n4", "n5"):
        assert g.raft(nid).conf == ConfState(voters=frozenset({"n4", "n5"}),
                                             incarnations=records)
    d = batch("d", 10)
    d_index = g.put("n4", d)
    for nid in ("n4", "n5"):
        assert g.raft(nid).log.committed == d_index
        for k, v in {**a, **b, **d}.items():
            assert g.get(nid, k) == v, (nid, k)
        # What only the lost majority held is gone: this is why the reset is unsafe.
        assert all(g.get(nid, k) is None for k in c)
    assert g.state("n4").digest() == g.state("n5").digest()

    # The forced configuration and votes survive another restart of both.
    g.close_all()
    g = LmdbGroup({"n4": dirs["n4"], "n5": dirs["n5"]})
    g.tick_until_leader()
    lead = g.leader()
    assert lead is not None
    e_index = g.put(lead, {"e": b"after-restart"})
    assert all(g.raft(nid).log.committed == e_index for nid in ("n4", "n5"))
    assert g.get("n5", "e") == b"after-restart"
    g.close_all()


# ============================================================ hand-made logs ==========
def conf(term: int, index: int, voters: Iterable[str]) -> Entry:
    return Entry(term, index, EntryType.CONF_CHANGE,
                 encode_conf_entry(None, ConfState(voters=frozenset(voters))))


def put(term: int, index: int, k: str, v: str) -> Entry:
    return Entry(term, index, EntryType.NORMAL, encode_put(key(k), v.encode()))


def write_survivor(
    root: Path, nid: str, entries: list[Entry], hard: HardState, applied: int = 0,
) -> Path:
    """A stopped node's data directory holding ``entries`` and ``hard``; its state store
    has applied the first ``applied`` entries."""
    d = root / nid
    d.mkdir()
    (d / "node_id").write_text(nid + "\n")
    log_path, state_path = group_paths(str(d), "default")
    raft_log = LmdbLogStore(log_path)
    raft_log.save(hard, entries)
    raft_log.close()
    state = LmdbStateStore(state_path)
    state.apply([(e.index, e.data if e.type == EntryType.NORMAL else b"")
                 for e in entries[:applied]])
    state.close()
    return d


def prefix(term: int = 1, n: int = 5) -> list[Entry]:
    """The bootstrap configuration of five voters, then puts k2..kn, all in ``term``."""
    return [conf(1, 1, FIVE)] + [put(term, i, f"k{i}", f"v{i}") for i in range(2, n + 1)]


def restart_and_write(dirs: dict[str, Path]) -> LmdbGroup:
    g = LmdbGroup(dirs)
    lead = g.tick_until_leader()
    g.tick(3)
    index = g.put(lead, {"new": b"write"})
    for nid in dirs:
        assert g.raft(nid).log.committed == index, nid
        assert g.get(nid, "new") == b"write"
    return g


def test_the_most_up_to_date_survivor_is_chosen_and_its_uncommitted_tail_commits_by_fiat(
    tmp_path: Path,
) -> None:
    ahead = prefix() + [put(2, 6, "k6", "v6"), put(2, 7, "k7", "v7"), put(2, 8, "k8", "v8")]
    d4 = write_survivor(tmp_path, "n4", ahead, HardState(2, "n1", 6), applied=6)
    d5 = write_survivor(tmp_path, "n5", prefix(), HardState(2, "n1", 5), applied=5)

    report = unsafe_reset([str(d5), str(d4)], ["n5", "n4"])
    assert report.chosen == "n4"
    assert (report.chosen_last_index, report.chosen_last_term) == (8, 2)
    assert (report.config_index, report.new_term, report.known_committed) == (9, 3, 6)
    assert report.by_fiat == (7, 8)
    assert report.lost_voters == {"n1", "n2", "n3"}
    assert {s.node_id: s.replaced_from for s in report.survivors} == {"n4": None, "n5": None}
    text = report.describe()
    assert "after index 6 may be lost" in text and "Entries 7..8 (2) on n4" in text

    g = restart_and_write({"n4": d4, "n5": d5})
    assert g.leader() == "n4"
    for nid in ("n4", "n5"):
        assert [g.get(nid, f"k{i}") for i in (6, 7, 8)] == [b"v6", b"v7", b"v8"]
    g.close_all()


def test_a_newer_log_that_lacks_an_entry_known_committed_is_passed_over(
    tmp_path: Path,
) -> None:
    """n4's 6@3 came from a term-3 leader that died at once; a term-4 leader then
    committed 6@2 on the lost voters and on n5, and n5 learned it. §5.4.1 prefers n4, but
    choosing it would drop an acknowledged write a survivor still holds, and n5 could not
    rejoin: it never lets a leader overwrite its committed 6@2."""
    d4 = write_survivor(tmp_path, "n4", prefix() + [put(3, 6, "k6", "from-term-3")],
                        HardState(3, "n4", 5), applied=5)
    d5 = write_survivor(tmp_path, "n5", prefix() + [put(2, 6, "k6", "committed")],
                        HardState(4, "n2", 6), applied=6)

    report = unsafe_reset([str(d4), str(d5)], ["n4", "n5"])
    assert report.chosen == "n5" and report.passed_over == ("n4",)
    assert (report.config_index, report.new_term, report.known_committed) == (7, 5, 6)
    assert {s.node_id: s.replaced_from for s in report.survivors} == {"n4": 6, "n5": None}
    assert "passed over: n4" in report.describe()

    g = restart_and_write({"n4": d4, "n5": d5})
    assert g.leader() == "n5"
    assert g.get("n4", "k6") == g.get("n5", "k6") == b"committed"
    g.close_all()


def test_choosing_by_section_5_4_1_alone_would_strand_the_survivor_that_knows_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The counterfactual of the test above: force the §5.4.1 maximum and n5 never
    catches up, because it will not let n4 overwrite its committed 6@2. (The leader's
    probes may go on forever or stop with n5 behind; either way n5 is stranded.)"""
    d4 = write_survivor(tmp_path, "n4", prefix() + [put(3, 6, "k6", "from-term-3")],
                        HardState(3, "n4", 5), applied=5)
    d5 = write_survivor(tmp_path, "n5", prefix() + [put(2, 6, "k6", "committed")],
                        HardState(4, "n2", 6), applied=6)
    choose = unsafe_reset_module._choose

    def newest_log(opened: list, states: list) -> tuple[int, list[int], int]:
        _, _, x = choose(opened, states)
        return max(range(2), key=lambda i: (states[i].last_term, states[i].last_index)), [], x

    monkeypatch.setattr(unsafe_reset_module, "_choose", newest_log)
    assert unsafe_reset([str(d4), str(d5)], ["n4", "n5"]).chosen == "n4"
    g = LmdbGroup({"n4": d4, "n5": d5})
    try:
        g.tick_until_leader()
        g.tick(3)
    except AssertionError as e:
        assert "did not stabilize" in str(e)
    n4, n5 = g.nodes["n4"][0], g.nodes["n5"][0]
    assert n5.log.last_index() < n4.log.last_index()
    assert (g.get("n4", "k6"), g.get("n5", "k6")) == (b"from-term-3", b"committed")
    g.close_all()


def test_a_table_partition_is_reset_in_the_shared_log_environment(tmp_path: Path) -> None:
    """A partition's log lives in the node's shared environment (partition-logs): the
    reset writes the new configuration there, for that group only, and clears the vote
    floor under the group's own key."""
    gid, other = "t.x.0", "t.x.1"
    dirs = {}
    for nid, entries, hard in (("n4", prefix(n=8), HardState(2, "n1", 6)),
                               ("n5", prefix(n=6), HardState(2, "n1", 5))):
        d = tmp_path / nid
        d.mkdir()
        (d / "node_id").write_text(nid + "\n")
        env = LogEnv(partition_logs_path(str(d)), shared=True)
        mine, theirs = env.store(gid), env.store(other)
        env.save_many([(mine, hard, entries, None), (theirs, hard, entries, None)])
        for st in (mine, theirs):  # what storage records when it truncated a damaged tail
            st._write(lambda txn, st=st: txn.put(st._mkey(b"floor"), msgpack.packb([9, 2]),
                                                 db=st._meta), "test")
        theirs.close()
        mine.close()
        env.close()
        state = LmdbStateStore(group_paths(str(d), gid)[1])
        state.apply([(e.index, e.data if e.type == EntryType.NORMAL else b"")
                     for e in entries[:hard.commit]])
        state.close()
        dirs[nid] = d

    report = unsafe_reset([str(dirs["n4"]), str(dirs["n5"])], ["n4", "n5"], group=gid)
    assert report.chosen == "n4" and report.floors_cleared == ("n4", "n5")
    for nid, d in dirs.items():
        env = LogEnv(partition_logs_path(str(d)), shared=True)
        mine, theirs = env.store(gid), env.store(other)
        assert mine.vote_floor() is None and theirs.vote_floor() is not None
        assert theirs.last_index() == (8 if nid == "n4" else 6)  # untouched
        if nid == "n4":
            last = mine.entries(mine.last_index(), mine.last_index() + 1)[0]
            assert last.type == EntryType.CONF_CHANGE and last.index == report.config_index
            assert mine.initial_state()[0].term == report.new_term
        mine.close()
        theirs.close()
        env.close()


def write_vote_floor(data_dir: Path, floor: tuple[int, int]) -> None:
    """What storage records when it truncated a damaged tail at open (VoteFloor)."""
    raft_log = LmdbLogStore(group_paths(str(data_dir), "default")[0])
    raft_log._write(
        lambda txn: txn.put(b"floor", msgpack.packb(list(floor)), db=raft_log._meta), "test"
    )
    raft_log.close()


def vote_floor(data_dir: Path) -> object:
    raft_log = LmdbLogStore(group_paths(str(data_dir), "default")[0])
    try:
        return raft_log.vote_floor()
    finally:
        raft_log.close()


def test_vote_floors_are_cleared_or_the_pair_could_never_elect(tmp_path: Path) -> None:
    """A survivor whose damaged tail was truncated refuses every vote until it catches up
    (VoteFloor); with two survivors the chosen one needs exactly that vote."""
    d4 = write_survivor(tmp_path, "n4", prefix(n=8), HardState(2, "n1", 6), applied=6)
    d5 = write_survivor(tmp_path, "n5", prefix(n=6), HardState(2, "n1", 5), applied=5)
    write_vote_floor(d4, (10, 2))
    write_vote_floor(d5, (9, 2))
    assert vote_floor(d5) is not None

    report = unsafe_reset([str(d4), str(d5)], ["n4", "n5"])
    assert report.chosen == "n4" and report.floors_cleared == ("n4", "n5")
    assert "may have acknowledged entries up to 9" in report.describe()
    assert vote_floor(d4) is None and vote_floor(d5) is None
    restart_and_write({"n4": d4, "n5": d5}).close_all()


def test_a_survivor_named_by_node_id_gets_its_node_id_file_back_and_starts(
        tmp_path: Path) -> None:
    """Found in review: a survivor whose node_id file was lost is named with --node-id,
    and a node refuses to start on data without node_id (claim_data_dir); the reset
    wrote none, so that survivor could never start. The reset writes it now; a dry run
    writes nothing."""
    d4 = write_survivor(tmp_path, "n4", prefix(n=8), HardState(2, "n1", 6), applied=6)
    d5 = write_survivor(tmp_path, "n5", prefix(n=6), HardState(2, "n1", 5), applied=5)
    os.remove(os.path.join(d5, "node_id"))
    unsafe_reset([str(d4), str(d5)], ["n4", "n5"], node_ids=["n4", "n5"], dry_run=True)
    assert not os.path.exists(os.path.join(d5, "node_id"))
    unsafe_reset([str(d4), str(d5)], ["n4", "n5"], node_ids=["n4", "n5"])
    with open(os.path.join(d5, "node_id")) as f:
        assert f.read() == "n5\n"
    from raftkv.storage.dir_lock import release_data_dir

    from raftkv.node.stores import claim_data_dir

    claim_data_dir(str(d5), "n5")  # what a node does first when it starts
    release_data_dir(str(d5))
    restart_and_write({"n4": d4, "n5": d5}).close_all()


def test_without_clearing_the_floor_the_pair_never_elects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    d4 = write_survivor(tmp_path, "n4", prefix(n=8), HardState(2, "n1", 6), applied=6)
    d5 = write_survivor(tmp_path, "n5", prefix(n=6), HardState(2, "n1", 5), applied=5)
    write_vote_floor(d5, (9, 2))
    monkeypatch.setattr(unsafe_reset_module, "_clear_vote_floor", lambda raft_log: None)
    unsafe_reset([str(d4), str(d5)], ["n4", "n5"])
    g = LmdbGroup({"n4": d4, "n5": d5})
    with pytest.raises(AssertionError, match="no leader"):
        g.tick_until_leader(max_ticks=200)
    g.close_all()


def test_three_survivors_of_five_need_no_leader_they_lack(tmp_path: Path) -> None:
    """Members may be any number of survivors; the reset also works, with a note, when
    the survivors were a majority already."""
    dirs = {
        "n1": write_survivor(tmp_path, "n1", prefix(n=7), HardState(1, None, 7), applied=7),
        "n2": write_survivor(tmp_path, "n2", prefix(n=7), HardState(1, None, 6), applied=6),
        "n3": write_survivor(tmp_path, "n3", prefix(n=5), HardState(1, None, 5), applied=5),
    }
    report = unsafe_reset([str(d) for d in dirs.values()], ["n1", "n2", "n3"])
    assert report.chosen == "n1" and report.by_fiat is None
    assert any("majority" in n for n in report.notes)
    restart_and_write(dirs).close_all()


# ============================================================ refusals ================
@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    d4 = write_survivor(tmp_path, "n4", prefix(n=6), HardState(1, None, 6), applied=6)
    d5 = write_survivor(tmp_path, "n5", prefix(n=5), HardState(1, None, 5), applied=5)
    return d4, d5


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_clear_error(err: str, *needles: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("raftkv recover unsafe-reset: error: "), err
    for n in needles:
        assert n in err, (n, err)


def test_dry_run_refuses_with_status_2_and_writes_nothing(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
) -> None:
    before = data_mdb_hashes(pair)
    argv = ["recover", "unsafe-reset", "--data-dir", str(pair[0]), "--data-dir", str(pair[1]),
            "--members", "n4, n5"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert "WOULD" in err and "nothing was written" in err
    assert "chosen survivor: n4" in out and "What may be lost" in out
    assert "after index 6 may be lost" in out
    assert data_mdb_hashes(pair) == before


@pytest.mark.parametrize(
    ("members", "needles"),
    [
        ("n4,n9", ["exactly the survivors", "n5 (at", "n9"]),
        ("n4", ["n5 (at"]),
        ("n4,n5,n5", ["twice"]),
        ("n4,,n5", ["empty id"]),
    ],
)
def test_members_must_be_exactly_the_survivors(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
    members: str, needles: list[str],
) -> None:
    before = data_mdb_hashes(pair)
    argv = ["--data-dir", str(pair[0]), "--data-dir", str(pair[1]), "--members", members,
            CONFIRM_FLAG]
    code, _, err = run_cli(argv, capsys)
    assert code == 1
    assert_clear_error(err, *needles)
    assert data_mdb_hashes(pair) == before


def test_bad_data_directories_are_refused_with_one_clear_line(
    tmp_path: Path, pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
) -> None:
    d4, d5 = str(pair[0]), str(pair[1])
    missing = str(tmp_path / "nope")

    def refused(argv: list[str], *needles: str) -> None:
        code, _, err = run_cli([*argv, CONFIRM_FLAG], capsys)
        assert code == 1, err
        assert_clear_error(err, *needles)

    refused(["--data-dir", d4, "--data-dir", missing, "--members", "n4,n5",
             "--node-id", "n4", "--node-id", "n5"], missing, "no such data directory")
    refused(["--data-dir", d4, "--data-dir", d5, "--members", "n4,n5", "--group", "t1"],
            "unknown group 't1'", "groups present: default")
    refused(["--data-dir", d4, "--data-dir", d5, "--members", "n4,n5",
             "--node-id", "n4", "--node-id", "n6"], "belongs to node 'n5'")
    refused(["--data-dir", d4, "--data-dir", d4, "--members", "n4"], "given twice")
    refused(["--data-dir", d4], "--members")  # a usage error is an error too

    os.remove(os.path.join(d5, "node_id"))
    refused(["--data-dir", d4, "--data-dir", d5, "--members", "n4,n5"], "--node-id")

    log5 = group_paths(d5, "default")[0]
    with open(os.path.join(log5, "data.mdb"), "r+b") as f:
        f.write(b"\0" * 8192)  # both LMDB meta pages destroyed
    refused(["--data-dir", d4, "--data-dir", d5, "--members", "n4,n5",
             "--node-id", "n4", "--node-id", "n5"], "cannot open the Raft log of n5")
    os.remove(os.path.join(log5, "data.mdb"))
    refused(["--data-dir", d4, "--data-dir", d5, "--members", "n4,n5",
             "--node-id", "n4", "--node-id", "n5"], "the Raft log of n5", "is missing")


def test_a_running_node_is_refused(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
) -> None:
    log5 = group_paths(str(pair[1]), "default")[0]
    hold_open = (
        "import lmdb, sys; e = lmdb.open(sys.argv[1], max_dbs=3); print('open', flush=True);"
        " sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold_open, log5],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        before = data_mdb_hashes(pair)
        code, _, err = run_cli(["--data-dir", str(pair[0]), "--data-dir", str(pair[1]),
                                "--members", "n4,n5", CONFIRM_FLAG], capsys)
        assert code == 1
        assert_clear_error(err, "open in another process", "stop that node")
        assert data_mdb_hashes(pair) == before
    finally:
        holder.communicate("")
    assert main(["--data-dir", str(pair[0]), "--data-dir", str(pair[1]),
                 "--members", "n4,n5", CONFIRM_FLAG]) == 0


def test_a_state_store_ahead_of_its_own_log_and_every_known_commit_is_refused(
    tmp_path: Path,
) -> None:
    """Its image came from a snapshot that no survivor's log records: nothing shows
    whether the chosen log agrees with what it applied."""
    d4 = write_survivor(tmp_path, "n4", prefix(n=5), HardState(1, None, 5), applied=5)
    d5 = write_survivor(tmp_path, "n5", prefix(n=5), HardState(1, None, 4), applied=5)
    state = LmdbStateStore(group_paths(str(d5), "default")[1])
    state.apply([(6, put(1, 6, "k6", "v6").data)])  # entry 6 reached it in an image
    state.close()
    with pytest.raises(UnsafeResetError, match="n5's state store has applied entries up to 6"):
        unsafe_reset([str(d4), str(d5)], ["n4", "n5"])


def test_an_applied_index_past_the_logs_commit_record_is_a_commit_the_survivor_knows(
    tmp_path: Path,
) -> None:
    """After a SIGKILL a node's log records an older commit index than its state store
    applied (a Ready that only moves the commit index is not written; the state store
    checkpoints every second). An outside-in run found every SIGKILLed survivor refused as
    if it had installed a snapshot. Its applied entries were committed: here n4 applied
    6@1, so n5's §5.4.1-newer log, whose entry 6 is from term 2, is passed over instead
    of overwriting a write n4 applied."""
    d4 = write_survivor(tmp_path, "n4", prefix() + [put(1, 6, "k6", "applied")],
                        HardState(1, None, 4), applied=6)
    d5 = write_survivor(tmp_path, "n5", prefix() + [put(2, 6, "k6", "never-committed")],
                        HardState(2, "n5", 4), applied=4)

    report = unsafe_reset([str(d4), str(d5)], ["n4", "n5"])
    assert report.chosen == "n4" and report.passed_over == ("n5",)
    assert report.known_committed == 6
    assert {s.node_id: s.replaced_from for s in report.survivors} == {"n4": None, "n5": 6}

    g = restart_and_write({"n4": d4, "n5": d5})
    assert g.get("n4", "k6") == g.get("n5", "k6") == b"applied"
    g.close_all()


def test_an_image_installed_just_before_a_crash_is_not_taken_for_this_logs_commits(
    tmp_path: Path,
) -> None:
    """Found by a review of the applied-index rule: a node installs a newer leader's image
    into its state store first and records the snapshot in its log second (by design). A
    crash in between leaves a store that applied 8 and a log that still holds its own
    uncommitted term-2 suffix at 6..8. Counting 8 as committed in that log chose it and
    committed the divergent entries by fiat over the image's history (the replicas then
    disagreed at index 6). The store records the index of the image it installed
    (``image_index``), above the log's snapshot base here, so its applied index says
    nothing about this log: refused, as before the rule."""
    history = prefix() + [put(3, i, f"k{i}", "committed-3") for i in (6, 7, 8)]
    src = LmdbStateStore(str(tmp_path / "leader-state"))
    src.apply([(e.index, e.data if e.type == EntryType.NORMAL else b"") for e in history])
    image = list(src.snapshot_chunks())
    src.close()
    divergent = prefix() + [put(2, i, f"k{i}", "uncommitted-2") for i in (6, 7, 8)]
    d4 = write_survivor(tmp_path, "n4", divergent, HardState(3, None, 5), applied=5)
    state = LmdbStateStore(group_paths(str(d4), "default")[1])
    assert state.install_snapshot(image) == 8
    state.close()
    d5 = write_survivor(tmp_path, "n5", prefix(), HardState(3, None, 5), applied=5)
    with pytest.raises(UnsafeResetError, match="n4's state store has applied entries up to 8"):
        unsafe_reset([str(d4), str(d5)], ["n4", "n5"])


def test_survivors_with_no_log_at_all_are_refused(tmp_path: Path) -> None:
    d = write_survivor(tmp_path, "n4", [], HardState())
    with pytest.raises(UnsafeResetError, match="nothing to recover"):
        unsafe_reset([str(d)], ["n4"])


# ============================================================ real processes ==========
def test_real_servers_refuse_while_running_then_recover_from_a_lost_majority(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Five ``raftkv serve`` processes; the leader and two followers are SIGKILLed for good.
    The tool refuses the survivors while they run, then resets them once stopped, through
    the ``raftkv`` command's dispatch; restarted, they elect a leader and take writes."""
    from raftkv.cli import main as raftkv_main
    from raftkv.testing.procs import ProcCluster

    with ProcCluster(str(tmp_path / "cluster"), size=5, faults=False) as c:
        c.start()
        lead = c.wait_leader()
        client = c.client()
        for i in range(10):
            client.put(f"k{i}", f"v{i}")
        client.close()
        c.wait_caught_up()
        survivors = [nid for nid in c.nodes if nid != lead][:2]
        for nid in c.nodes:
            if nid not in survivors:
                c.kill(nid)
        argv = ["recover", "unsafe-reset", "--members", ",".join(survivors), CONFIRM_FLAG]
        for nid in survivors:
            argv += ["--data-dir", c.nodes[nid].data_dir]  # node ids from DIR/node_id

        assert raftkv_main(argv) == 1
        # The nodes' own lock refuses it (LMDB's is the check for an older release's).
        assert "is in use by another process" in capsys.readouterr().err
        for nid in survivors:
            c.stop(nid)
        assert raftkv_main(argv) == 0
        assert "PERFORMED" in capsys.readouterr().out

        for nid in survivors:
            c.start(nid)
        c.wait_leader(among=survivors)
        client = c.client(survivors)
        client.put("after", "reset")
        assert [client.get(f"k{i}") for i in range(10)] == [f"v{i}".encode() for i in range(10)]
        client.close()
        c.wait_caught_up(survivors)
        digests = [c.digest(nid) for nid in survivors]
        assert digests[0]["count"] == 11 and digests[0] == digests[1]
        members = c.group_status(survivors[0])["members"]  # type: ignore[index]
        assert set(members) == set(survivors)


def test_the_metastore_of_real_servers_is_reset_after_two_founders_are_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--group meta``: three ``raftkv serve`` founders, a table; two are SIGKILLed for good,
    so the metastore (and the default group) lost their majority. The dry run refuses and
    writes nothing; the reset opens the metastore's own state store, and the restarted
    survivor serves the catalog again: the table is still listed, the lost nodes can be
    removed from the topology, and a new table takes writes.

    The survivor is SIGKILLed too, after its state stores' once-a-second checkpoints: its
    logs then record an older commit index than its state stores applied, and an
    outside-in run found the tool refusing every such survivor as if it had installed a
    snapshot (for the metastore and the default group alike)."""
    from raftkv.cli import main as raftkv_main
    from raftkv.testing.procs import ProcCluster

    with ProcCluster(str(tmp_path / "cluster"), size=3, faults=False) as c:
        c.start()
        c.wait_leader()
        client = c.client()
        client.create_table("kept", 2, 3)
        client.put("k", "v")
        client.close()
        c.wait_caught_up()
        time.sleep(2.5)  # every state store checkpoints (once a second)
        for nid in ("n1", "n2", "n3"):
            c.kill(nid)
        meta_log = os.path.join(c.nodes["n3"].data_dir, "groups", "meta", "log")
        before = LmdbLogStore(meta_log)
        last = before.last_index()
        before.close()
        base = ["recover", "unsafe-reset", "--data-dir", c.nodes["n3"].data_dir,
                "--members", "n3"]

        assert raftkv_main([*base, "--group", "meta"]) == 2  # a dry run
        out = capsys.readouterr()
        assert "DRY RUN" in out.out and "voters lost: n1, n2" in out.out
        after = LmdbLogStore(meta_log)
        assert after.last_index() == last  # nothing written
        after.close()
        for group in ("meta", "default"):
            assert raftkv_main([*base, "--group", group, CONFIRM_FLAG]) == 0
            assert "PERFORMED" in capsys.readouterr().out

        c.start("n3")
        client = c.client(["n3"])
        try:
            assert [t["name"] for t in client.list_tables()] == ["kept"]
            assert client.get("k") == b"v"
            for nid in ("n1", "n2"):
                client.remove_node(nid)
            client.create_table("fresh", 2, 1)
            c.wait_until(lambda: all(p["leader"] == "n3" for p in
                                     client.describe_table("fresh")["partitions"]),
                         30, "the new table's partitions led by n3")
            client.put("x", "y", table="fresh")
            assert client.get("x", table="fresh") == b"y"
            meta = {r["id"]: r["metastore"] for r in client.cluster_nodes()}
            assert meta["n3"] == "voter"
        finally:
            client.close()
