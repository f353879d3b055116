"""A power-loss loop over raftkv's real LMDB stores (issue 22, part 2): the embedded path.

The worker (``python -m raftkv.testing.powerloss_workload DATA_DIR``) is a single-node,
Raft-shaped writer over the stores a ``raftkv serve`` node uses, opened the way the node
opens them (``claim_data_dir``, ``open_group_storage``, a shared ``LogEnv`` for table
partitions, ``GroupStorage.recover``):

- group ``default`` (a log environment of its own) and partitions ``t.p0`` and ``t.p1``
  (one shared ``partition-logs`` environment, saved together as the driver does);
- at start, for each group: open, report what was found (hard state, the log's open
  report, the state store's applied index and every key), win an election (term + 1,
  vote for itself, synced), commit the whole log and replay it into the state store;
- then, until killed: append batches of puts (the key is a function of the group and the
  index, the value says ``index:term``), save them (synced: that is the acknowledgement,
  printed as ``saved``), apply them, checkpoint the state stores (inline or on a
  background thread, as the driver does) and compact the logs.

``run_cycles`` (the parent) starts the worker on a ``PowerLossFS`` mount, lets it run for
a seeded while, SIGKILLs it, loses power (all unsynced data, or a seeded torn subset),
and restarts it, checking each time:

- **no acknowledged write is lost**: the log reaches every saved index, with the term it
  was saved in;
- **the vote and term are never forgotten**: the hard state is at least the last
  acknowledged one, with the same vote in the same term;
- **the state store is never used corrupt**: after recovery it holds exactly the state
  the log dictates at its applied index (every key's value is the one of the last put to
  it at or below that index), and it opened at all (a refusal, a crash or a hang is a
  failure with its seed).

``--broken`` builds a deliberately broken node (``log-nosync``: the Raft log skips its
fsync, which acknowledges before the data is durable) to show the harness catches it.
Every run prints its seed; a failure names the cycle and the power-loss seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

NKEYS = 48
GROUPS = ("default", "t.p0", "t.p1")
PARTITIONS = ("t.p0", "t.p1")
BROKEN = ("log-nosync",)


def key_of(group: str, index: int) -> bytes:
    """The key the entry at ``index`` of ``group`` puts (both sides compute it)."""
    return b"k%02d" % (zlib.crc32(f"{group}:{index}".encode()) % NKEYS)


def value_of(index: int, term: int) -> bytes:
    return b"%d:%d" % (index, term)


# -- the worker ----------------------------------------------------------------------------
def _say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def worker(data_dir: str, seed: int, broken: str | None, checkpoint_seconds: float) -> None:
    from raftkv.node.group_storage import GroupStorage
    from raftkv.node.stores import claim_data_dir, open_group_storage
    from raftkv.recovery.compaction import CompactionPolicy, maybe_compact
    from raftkv.storage.commands import encode_put
    from raftkv.storage.layout import partition_logs_path
    from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
    from raftkv.storage.records import ConfState, Entry, EntryType, HardState

    rng = random.Random(seed)
    durable = broken != "log-nosync"
    claim_data_dir(data_dir, "n1")
    policy = CompactionPolicy(max_entries=rng.choice([60, 200, 1000]), keep=rng.choice([0, 10]))
    shared = LogEnv(partition_logs_path(data_dir), durable=durable, shared=True)
    stores: dict[str, GroupStorage] = {}
    for g in GROUPS:
        stores[g] = open_group_storage(data_dir, g, durable=durable, compaction=policy,
                                       shared_log=shared if g in PARTITIONS else None,
                                       checkpoint_seconds=checkpoint_seconds)
    conf = ConfState(frozenset({"n1"}))
    terms: dict[str, int] = {}
    commits: dict[str, int] = {}
    for g, gs in stores.items():
        lg = gs.log
        assert isinstance(lg, LmdbLogStore)
        hard = lg.initial_state()[0]
        rep = lg.open_report
        st = gs.state
        _say("open", g, hard.term, hard.vote, hard.commit, lg.first_index(), lg.last_index(),
             rep.truncated_from, rep.truncated_entries, st.checkpoint_index(),
             st.applied_index())
        term = hard.term + 1
        last = lg.last_index()
        lg.save(HardState(term, "n1", last), [], sync=True)  # elected: commits its log
        _say("hard", g, term, "n1")
        terms[g], commits[g] = term, last
        report = gs.recover()
        rows = {k.decode(): v.decode() for k, v in st.scan()}
        _say("state", g, st.applied_index(), lg.last_index(), json.dumps(rows, sort_keys=True))
    _say("ready")
    pool = ThreadPoolExecutor(1)
    jobs: dict[str, Future[int]] = {}
    del report
    while True:
        chosen = rng.sample(GROUPS, rng.randint(1, 3))
        batches = {}
        for g in chosen:
            lg = stores[g].log
            first = lg.last_index() + 1
            n = rng.randint(1, 12)
            batches[g] = [Entry(terms[g], i, EntryType.NORMAL,
                                encode_put(key_of(g, i), value_of(i, terms[g])))
                          for i in range(first, first + n)]
        parts = [g for g in chosen if g in PARTITIONS]
        for g in chosen:
            if g not in parts:
                stores[g].log.save(HardState(terms[g], "n1", commits[g]), batches[g])
        if parts:
            shared.save_many([(stores[g].log, HardState(terms[g], "n1", commits[g]),  # type: ignore[misc]
                               batches[g], None) for g in parts])
        for g in chosen:
            es = batches[g]
            _say("saved", g, es[0].index, es[-1].index, terms[g])
            commits[g] = es[-1].index
            stores[g].apply(es)
        now = time.monotonic()
        for g in chosen:
            st = stores[g].state
            job = jobs.get(g)
            if job is not None and job.done():
                del jobs[g]
                st.checkpointed(job.result())
            if g not in jobs and st.checkpoint_due(now):
                sync = st.background_checkpoint() if rng.random() < 0.5 else None
                if sync is not None:
                    jobs[g] = pool.submit(sync)
                else:
                    st.checkpoint()
            if g not in jobs and rng.random() < 0.3:
                maybe_compact(stores[g].log, st, lambda i: conf, policy)
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.005)


# -- the parent ----------------------------------------------------------------------------
class Disk(Protocol):
    """What ``run_cycles`` needs of its filesystem: a ``PowerLossFS``, or ``SigkillOnly``."""

    mountpoint: Path

    def power_loss(self, *, torn: bool = False, seed: int | None = None,
                   keep: float = 0.5, kill_users: bool = False) -> Any: ...


class SigkillOnly:
    """A plain directory that never loses power: a "power loss" is only the SIGKILL the
    loop already did (the page cache keeps everything). The control for ``--broken``."""

    def __init__(self, path: Path) -> None:
        self.mountpoint = path
        path.mkdir(parents=True, exist_ok=True)

    def power_loss(self, *, torn: bool = False, seed: int | None = None,
                   keep: float = 0.5, kill_users: bool = False) -> Any:
        return None


@dataclasses.dataclass
class _Group:
    saved: dict[int, int] = dataclasses.field(default_factory=dict)  # index -> term, acked
    max_saved: int = 0
    hard: tuple[int, str | None] = (0, None)  # acknowledged (term, vote)


@dataclasses.dataclass
class Summary:
    seed: int
    cycles: int = 0
    power_losses: int = 0
    torn: int = 0
    acked_entries: int = 0
    rollbacks: int = 0  # state stores that reopened behind what they had applied
    truncated_tails: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (f"seed {self.seed}: {self.cycles} cycles, {self.power_losses} power losses "
                f"({self.torn} torn), {self.acked_entries} acknowledged entries, "
                f"{self.rollbacks} state stores rolled back and replayed, "
                f"{self.truncated_tails} log tails truncated, {len(self.failures)} failures")


class _Worker:
    def __init__(self, data_dir: Path, seed: int, broken: str | None, env: dict[str, str],
                 checkpoint_seconds: float) -> None:
        cmd = [sys.executable, "-m", "raftkv.testing.powerloss_workload", str(data_dir),
               "--seed", str(seed), "--checkpoint-seconds", str(checkpoint_seconds)]
        if broken:
            cmd += ["--broken", broken]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd="/")
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.rstrip("\n"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def _expected(group: str, applied: int) -> dict[str, int]:
    """key -> the index of the last put to it at or below ``applied``."""
    found: dict[str, int] = {}
    i = applied
    while i > 0 and len(found) < NKEYS:
        found.setdefault(key_of(group, i).decode(), i)
        i -= 1
    return found


def run_cycles(disk: Disk, seed: int, cycles: int, *, broken: str | None = None,
               run_seconds: tuple[float, float] = (0.05, 0.5), torn_share: float = 0.5,
               checkpoint_seconds: float = 0.05, log: Any = print,
               stop_on_failure: bool = True) -> Summary:
    """``cycles`` rounds of start, run, SIGKILL, power loss on ``disk``; checks every
    restart (module docstring). Returns the summary; failures name cycle and seeds."""
    rng = random.Random(seed)
    data_dir = disk.mountpoint / f"node-{seed}"
    model = {g: _Group() for g in GROUPS}
    summary = Summary(seed)
    env = dict(os.environ)
    for cycle in range(cycles + 1):
        w = _Worker(data_dir, rng.randrange(2**31), broken, env, checkpoint_seconds)
        problems: list[str] = []
        ready = _check_start(w, model, summary, problems)
        if ready and cycle < cycles:
            time.sleep(rng.uniform(*run_seconds))
        w.kill()
        _drain(w, model, summary)
        if problems:
            where = f"seed {seed} cycle {cycle}"
            for p in problems:
                summary.failures.append(f"{where}: {p}")
                log(f"FAILURE {where}: {p}")
            if w.err:
                log("worker stderr: " + " | ".join(w.err[-8:]))
            if stop_on_failure:
                break
        if cycle == cycles:
            break
        torn = rng.random() < torn_share
        pl_seed = rng.randrange(2**32)
        keep = rng.choice([0.1, 0.5, 0.9])
        report = disk.power_loss(torn=torn, seed=pl_seed, keep=keep, kill_users=True)
        summary.cycles += 1
        summary.power_losses += report is not None
        summary.torn += bool(torn and report is not None)
        if report is not None and (cycle % 25 == 0 or cycles <= 20):
            log(f"seed {seed} cycle {cycle}: {report.summary()}")
    return summary


def _check_start(w: _Worker, model: dict[str, _Group], summary: Summary,
                 problems: list[str]) -> bool:
    """Read the worker's start-up report and check it against the model."""
    deadline = time.monotonic() + 60
    opened: dict[str, list[str]] = {}
    while True:
        try:
            line = w.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            problems.append("the worker did not come up within 60 s (hung on open?)")
            return False
        if line is None:
            w.proc.wait()
            tail = " | ".join(w.err[-6:])
            problems.append(f"the worker died on start-up (exit {w.proc.returncode}): {tail}")
            return False
        kind, *rest = line.split(" ", 1)
        if kind == "ready":
            return True
        args = rest[0].split(" ") if rest else []
        if kind == "open":
            opened[args[0]] = args
            g = model[args[0]]
            term, vote = int(args[1]), (None if args[2] == "None" else args[2])
            commit, last = int(args[3]), int(args[5])
            truncated_from, checkpoint, applied_at_open = int(args[6]), int(args[8]), int(args[9])
            summary.truncated_tails += truncated_from > 0
            del commit, checkpoint, applied_at_open
            if (term, vote) < g.hard and term <= g.hard[0]:
                problems.append(f"{args[0]}: the hard state went back from term "
                                f"{g.hard[0]} (vote {g.hard[1]}) to term {term} (vote {vote})")
            elif term == g.hard[0] and vote != g.hard[1]:
                problems.append(f"{args[0]}: the vote of term {term} changed from "
                                f"{g.hard[1]} to {vote}")
            if last < g.max_saved:
                problems.append(f"{args[0]}: acknowledged entries lost: the log ends at "
                                f"{last}, entries up to {g.max_saved} were saved")
        elif kind == "hard":
            grp, term, vote = args[0], int(args[1]), args[2]
            model[grp].hard = (term, vote)
        elif kind == "state":
            grp, applied, last = args[0], int(args[1]), int(args[2])
            rows: dict[str, str] = json.loads(rest[0].split(" ", 3)[3])
            g = model[grp]
            if applied != last:
                problems.append(f"{grp}: replay stopped at {applied}, the log ends at {last}")
            want = _expected(grp, applied)
            for k, v in rows.items():
                idx, term = (int(x) for x in v.split(":"))
                if k not in want or want[k] != idx:
                    problems.append(f"{grp}: key {k} holds the put of entry {idx}, expected "
                                    f"{want.get(k)} (state store at {applied}): corrupt or "
                                    f"stale state")
                    break
                if idx in g.saved and g.saved[idx] != term:
                    problems.append(f"{grp}: entry {idx} was saved in term {g.saved[idx]}, "
                                    f"the state holds term {term}")
                    break
            missing = sorted(set(want) - set(rows))
            if missing:
                problems.append(f"{grp}: keys {missing[:5]} missing from the state store at "
                                f"{applied}")
            if grp in opened and int(opened[grp][9]) < int(opened[grp][5]) and applied > 0:
                summary.rollbacks += 1
            # What survives beyond the acknowledged is now the log: forget the rest.
            for i in [i for i in g.saved if i > last]:
                del g.saved[i]
            g.max_saved = min(g.max_saved, last) if problems else g.max_saved
    return False


def _drain(w: _Worker, model: dict[str, _Group], summary: Summary) -> None:
    while True:
        try:
            line = w.lines.get(timeout=10)
        except queue.Empty:
            return
        if line is None:
            return
        kind, *rest = line.split(" ")
        if kind == "saved":
            g = model[rest[0]]
            lo, hi, term = int(rest[1]), int(rest[2]), int(rest[3])
            for i in range(lo, hi + 1):
                g.saved[i] = term
            g.max_saved = max(g.max_saved, hi)
            summary.acked_entries += hi - lo + 1
        elif kind == "hard":
            model[rest[0]].hard = (int(rest[1]), rest[2])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--broken", choices=BROKEN)
    p.add_argument("--checkpoint-seconds", type=float, default=0.05)
    a = p.parse_args(argv)
    worker(a.data_dir, a.seed, a.broken, a.checkpoint_seconds)


if __name__ == "__main__":
    main()
