"""The scenarios of ``benchmarks.recovery_e2e``, one function per system and scenario
group. Each returns rows: ``{"system", "scenario", ...parameters, "median_s", "min_s",
"max_s", "samples", ...evidence}``. See ``recovery_e2e``'s docstring for what is timed."""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Self

from raftkv.storage.layout import group_paths

from benchmarks._recovery_common import (
    Seq,
    etcd_batches,
    etcd_put,
    etcd_puts,
    etcd_status,
    every_partition_writable,
    first_write,
    last_recovery_line,
    phase_summary,
    pso_put,
    raftkv_batches,
    raftkv_group,
    raftkv_put,
    raftkv_puts,
    startup_phases,
    summary,
    table_probe_keys,
    wait_for,
)
from benchmarks.kv_api import Etcd
from raftkv.testing.procs import ProcCluster

NO_COMPACTION = ["--compact-entries", str(10**9)]
Log = Callable[[str], None]


def _row(system: str, scenario: str, samples: list[float], **kw: Any) -> dict[str, Any]:
    return {"system": system, "scenario": scenario, **kw, **summary(samples)}


# -- raftkv ----------------------------------------------------------------------------------
class Raftkv:
    """A 3-node ``ProcCluster`` at INFO (for the ``startup:`` lines) with extra flags."""

    def __init__(self, base: str, extra: list[str]) -> None:
        self.c = ProcCluster(base, size=3, faults=False,
                             extra_args=["--log-level", "INFO", *extra])
        self.seq = Seq()

    def __enter__(self) -> Self:
        self.c.start()
        self.c.wait_leader(timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.c.__exit__(*exc)

    def port(self, nid: str) -> int:
        return self.c.nodes[nid].http_port

    def ports(self) -> list[int]:
        return [n.http_port for n in self.c.nodes.values()]

    def http_ports(self) -> dict[str, int]:
        return {node_id: n.http_port for node_id, n in self.c.nodes.items()}

    def leader(self) -> str:
        return self.c.wait_leader(timeout=60)

    def checkpoints_current(self, timeout: float = 120) -> None:
        def current() -> bool:
            gs = [self.c.group_status(n) for n in self.c.nodes]
            return all(g and g["checkpoint"] >= g["applied"] for g in gs) and \
                len({g["applied"] for g in gs if g}) == 1
        self.c.wait_until(current, timeout, "every checkpoint caught up")

    def kill_all(self) -> None:
        for n in self.c.nodes:
            self.c.kill(n)

    def restart_all(self, limit: float = 120) -> tuple[float, list[dict[str, float]], list[str]]:
        """SIGKILLed already: spawn all three and probe; (first write s, each node's
        startup phases, each node's recovery line)."""
        t0 = time.perf_counter()
        starter = threading.Thread(target=self.c.start, daemon=True)
        starter.start()
        fw = first_write([(p, raftkv_put(self.seq)) for p in self.ports()], t0, limit)
        starter.join(limit)
        return fw, *self.phases()

    def phases(self, timeout: float = 10) -> tuple[list[dict[str, float]], list[str]]:
        """Each node's last ``startup:`` phases (waiting until every node has logged one
        for its latest start) and its last ``recovery:`` line."""
        nodes = list(self.c.nodes.values())
        try:
            wait_for(lambda: all(n.log_text().count("startup:") >= n.starts for n in nodes),
                     timeout, "a startup line from every node", 0.1)
        except TimeoutError:
            pass
        out, rec = [], []
        for n in nodes:
            text = n.log_text()
            ph = startup_phases(text)
            if ph:
                out.append(ph)
            rec.append(last_recovery_line(text) or "")
        return out, rec

    def caught_up_after_start(self, victim: str, t1: float, limit: float = 600) -> float:
        """Seconds from ``t1`` until ``victim`` has applied the leader's commit index."""
        others = [n for n in self.c.nodes if n != victim]

        def done() -> bool:
            lead = None
            for o in others:
                g = raftkv_group(self.port(o))
                if g and g["role"] == "leader":
                    lead = g
            mine = raftkv_group(self.port(victim))
            return bool(lead and mine and mine["applied"] >= lead["commit"])
        wait_for(done, limit, f"{victim} caught up")
        return time.perf_counter() - t1


def raftkv_whole(base: str, keys: int, lags: list[int], repeat: int, single: bool,
                 log: Log) -> list[dict[str, Any]]:
    """Whole-cluster SIGKILL and restart at ``keys`` keys, for each checkpoint lag; then,
    if ``single``, a leader and a follower SIGKILLed and restarted."""
    rows: list[dict[str, Any]] = []
    with Raftkv(base, NO_COMPACTION) as r:
        c = r.c
        load_s = raftkv_batches(r.port(r.leader()), "k", keys, 1000, threads=2)
        log(f"raftkv: loaded {keys:,} keys in {load_s:.1f}s")
        r.checkpoints_current()
        du = sum(_du(n.data_dir) for n in c.nodes.values()) / 3
        for lag in lags:
            saved = os.path.join(base, f"saved-{lag}")
            if lag:
                # Emulate a state store that lost everything after its last checkpoint
                # (what a machine crash may do; a process crash loses nothing, since the
                # page cache survives it): copy each node's state files now, write `lag`
                # single-put entries, let them checkpoint, and before each restart put
                # the copies back. The log (never compacted here) holds every entry.
                r.checkpoints_current()
                r.kill_all()
                for nid, n in c.nodes.items():
                    shutil.copytree(group_paths(n.data_dir, "default")[1],
                                    os.path.join(saved, nid))
                c.start()
                w = raftkv_puts(r.port(r.leader()), f"lag{lag}-", lag)
                log(f"raftkv: {lag:,} single puts in {w:.1f}s ({lag / w:,.0f}/s)")
                r.checkpoints_current()
            samples, phases, replayed, lagged = [], [], [], []
            for _ in range(repeat):
                applied = (raftkv_group(r.port(r.leader())) or {}).get("applied", 0)
                r.kill_all()
                if lag:
                    for nid, n in c.nodes.items():
                        state = group_paths(n.data_dir, "default")[1]
                        shutil.rmtree(state)
                        shutil.copytree(os.path.join(saved, nid), state)
                fw, ph, rec = r.restart_all()
                samples.append(fw)
                phases += ph
                replayed += [_replayed(x) for x in rec]
                lagged += [applied - _reopened(x) for x in rec]
                log(f"raftkv whole keys={keys:,} lag={lag:,}: {fw:.3f}s  {rec}")
                r.leader()
            rows.append(_row("raftkv", "whole", samples, keys=keys, lag=lag,
                             state_lag_entries=statistics.median(lagged),
                             replayed_entries=statistics.median(replayed),
                             data_mb_per_node=du / 1e6, phases=phase_summary(phases),
                             phase_samples=phases))
        if single:
            rows += raftkv_single(r, keys, repeat, log)
    return rows


def _replayed(line: str) -> int:
    # "recovery: replayed entries a..b (N entries) from checkpoint C in ..."
    if "(" in line and " entries)" in line:
        return int(line.split("(")[1].split(" entries)")[0])
    return 0


def _reopened(line: str) -> int:
    # "... from checkpoint C in ..." or "recovery: state store at checkpoint C; ..."
    return int(line.split("checkpoint ")[1].split()[0].rstrip(";"))


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def raftkv_single(r: Raftkv, keys: int, repeat: int, log: Log) -> list[dict[str, Any]]:
    """A leader, then a follower, SIGKILLed and restarted: first write (from the kill for
    the leader, the failover; from the restart for the follower) and the restarted node's
    catch-up (from its restart until it has applied the leader's commit index)."""
    c = r.c
    rows = []
    for role in ("leader", "follower"):
        fws, cus = [], []
        for _ in range(repeat):
            lead = r.leader()
            victim = lead if role == "leader" else next(n for n in c.nodes if n != lead)
            c.kill(victim)
            if role == "leader":
                t0 = time.perf_counter()
                fws.append(first_write([(r.port(n), raftkv_put(r.seq)) for n in c.nodes
                                        if n != victim], t0))
            t1 = time.perf_counter()
            starter = threading.Thread(target=c.start, args=(victim,), daemon=True)
            starter.start()
            if role == "follower":
                fws.append(first_write([(p, raftkv_put(r.seq)) for p in r.ports()], t1))
            cus.append(r.caught_up_after_start(victim, t1))
            starter.join(60)
            log(f"raftkv {role}: first write {fws[-1]:.3f}s, caught up {cus[-1]:.3f}s")
        rows.append(_row("raftkv", role, fws, keys=keys, what="first_write"))
        rows.append(_row("raftkv", role, cus, keys=keys, what="caught_up"))
    return rows


def raftkv_catchup(base: str, writes: list[int], modes: list[str], per: int, repeat: int,
                   log: Log, limit: float = 180) -> list[dict[str, Any]]:
    """A follower down while M keys are written (batches of ``per``), then restarted:
    seconds from its restart until it has applied the leader's commit index. ``log``:
    the log is never compacted, so it catches up from the leader's log; ``snapshot``:
    ``--compact-entries 64 --compact-keep 16``, so the leader has compacted past it and
    must send a snapshot (checked: the leader's first index > the follower's last)."""
    rows = []
    for mode in modes:
        extra = NO_COMPACTION if mode == "log" else ["--compact-entries", "64",
                                                     "--compact-keep", "16"]
        with Raftkv(os.path.join(base, mode), extra) as r:
            c = r.c
            for m in writes:
                samples, evidence, failed = [], [], []
                for i in range(repeat):
                    lead = r.leader()
                    victim = next(n for n in c.nodes if n != lead)
                    c.wait_caught_up()
                    before = raftkv_group(r.port(victim)) or {}
                    c.kill(victim)
                    w = raftkv_batches(r.port(lead), f"c{m}-{i}-", m, per, threads=4)
                    if mode == "snapshot":  # compaction is looked at once a second
                        _wait_compacted(r.port(lead), before.get("last_index", 0))
                    lg = raftkv_group(r.port(lead)) or {}
                    t1 = time.perf_counter()
                    starter = threading.Thread(target=c.start, args=(victim,), daemon=True)
                    starter.start()
                    try:
                        samples.append(r.caught_up_after_start(victim, t1, limit))
                    except TimeoutError:
                        failed.append(_frame_limit_evidence(c, limit))
                        log(f"raftkv catchup {mode} M={m:,}: not caught up: {failed[-1]}")
                        starter.join(60)
                        break  # the state only grows: the next repeat would fail too
                    starter.join(60)
                    ev = {"behind_entries": lg.get("commit", 0) - before.get("last_index", 0),
                          "leader_first_index": lg.get("first_index"),
                          "follower_last_index": before.get("last_index"),
                          "write_s": w}
                    ev["needs_snapshot"] = (ev["leader_first_index"] or 0) > \
                        (ev["follower_last_index"] or 0) + 1
                    evidence.append(ev)
                    log(f"raftkv catchup {mode} M={m:,}: {samples[-1]:.3f}s {ev}")
                rows.append(_catchup_row("raftkv", samples, mode=mode, writes=m,
                                         per_entry=per, evidence=evidence, failed=failed))
    return rows


def _catchup_row(system: str, samples: list[float], **kw: Any) -> dict[str, Any]:
    if samples:
        return _row(system, "catchup", samples, **kw)
    return {"system": system, "scenario": "catchup", **kw, "median_s": None, "min_s": None,
            "max_s": None, "samples": []}


def _frame_limit_evidence(c: ProcCluster, limit: float) -> str:
    """Why a follower did not catch up: the leaders' log lines about the snapshot."""
    lines = [ln for n in c.nodes.values() for ln in n.log_text().splitlines()
             if "snapshot image exceeds" in ln]
    return (f"not caught up within {limit}s" +
            (f"; {len(lines)} times: {lines[-1].split('ERROR ')[-1]}" if lines else ""))


def _wait_compacted(port: int, past: int) -> None:
    """Until the leader's log starts after ``past`` + 1 (compaction runs once a second)."""
    def done() -> bool:
        return bool((raftkv_group(port) or {}).get("first_index", 0) > past + 1)
    wait_for(done, 30, "the leader compacted", 0.1)


def raftkv_table(base: str, partitions: int, repeat: int, log: Log) -> list[dict[str, Any]]:
    """A ``partitions`` x 3 table, the whole cluster SIGKILLed and restarted: seconds from
    the spawn until a PUT into every partition has been acknowledged."""
    with Raftkv(base, []) as r:
        c = r.c
        t = time.perf_counter()
        c.create_table("t", partitions, 3, timeout=600)
        log(f"raftkv: table {partitions}x3 created in {time.perf_counter() - t:.1f}s")
        keys = table_probe_keys(partitions)
        every_partition_writable("t", keys, r.http_ports(), time.perf_counter())
        time.sleep(2)
        last, med, phases = [], [], []
        for _ in range(repeat):
            r.kill_all()
            t0 = time.perf_counter()
            starter = threading.Thread(target=c.start, daemon=True)
            starter.start()
            all_s, med_s = every_partition_writable("t", keys, r.http_ports(), t0)
            starter.join(120)
            ph, _ = r.phases()
            phases += ph
            last.append(all_s)
            med.append(med_s)
            log(f"raftkv table {partitions}x3: every partition writable {all_s:.3f}s "
                f"(median partition {med_s:.3f}s)")
            time.sleep(2)
        return [_row("raftkv", "table", last, partitions=partitions,
                     median_partition=summary(med), phases=phase_summary(phases))]


# -- etcd ------------------------------------------------------------------------------------
class EtcdRun:
    """``benchmarks.kv_api.Etcd`` with its members' logs kept (``<base>/eN.log``) and a
    way to change flags between restarts (a member restarted on its data directory
    ignores the ``--initial-*`` flags)."""

    def __init__(self, base: str, extra: list[str] | None = None) -> None:
        self.base = base
        self.e = Etcd(base)
        self.seq = Seq()
        self.flags: list[str] = []
        if extra:
            self.set_flags(extra)

    def close(self) -> None:
        self.e.close()

    def set_flags(self, flags: list[str]) -> None:
        self.kill_all()
        self.flags = flags
        self.start()
        self.e.leader()

    def start(self, only: int | None = None) -> None:
        for i, cmd in enumerate(self.e.cmds):
            if only is not None and i != only:
                continue
            with open(os.path.join(self.base, f"e{i}.log"), "ab") as f:
                self.e.procs[i] = subprocess.Popen(cmd + self.flags, stdout=f,
                                                   stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
        p = self.e.procs[i]
        if p.poll() is None:
            p.kill()
            p.wait()

    def kill_all(self) -> None:
        for i in range(len(self.e.procs)):
            self.kill(i)

    def log_text(self, i: int) -> str:
        try:
            with open(os.path.join(self.base, f"e{i}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def snap_index(self, i: int) -> int:
        """The index of member ``i``'s newest snapshot file (0: none)."""
        names = glob.glob(os.path.join(self.base, f"e{i}", "member", "snap", "*.snap"))
        return max((int(os.path.basename(n).split("-")[1].split(".")[0], 16)
                    for n in names), default=0)

    def snapshot_now(self) -> None:
        """Make every member snapshot at its current index: restart with
        ``--snapshot-count 1``, write two keys, wait for the snapshot files, and restart
        with a snapshot count too large to be reached (the lag then grows only by what
        the benchmark writes)."""
        self.set_flags(["--snapshot-count", "1"])
        lead = self.e.leader()
        for _ in range(3):
            etcd_puts(self.e.client_ports[lead], "snap-", 1, threads=1)
            time.sleep(0.2)

        def done() -> bool:
            sts = [etcd_status(p) for p in self.e.client_ports]
            return all(s and self.snap_index(i) >= s["raftIndex"] - 2
                       for i, s in enumerate(sts))
        wait_for(done, 30, "etcd snapshots", 0.1)
        self.set_flags(["--snapshot-count", str(10**9)])

    def lags(self) -> list[int]:
        return [(etcd_status(p) or {}).get("raftIndex", 0) - self.snap_index(i)
                for i, p in enumerate(self.e.client_ports)]

    def restart_all(self, limit: float = 120) -> float:
        t0 = time.perf_counter()
        self.start()
        return first_write([(p, etcd_put(self.seq)) for p in self.e.client_ports], t0, limit)

    def caught_up_after_start(self, victim: int, t1: float, limit: float = 600) -> float:
        ports = self.e.client_ports

        def done() -> bool:
            lead = None
            for i, p in enumerate(ports):
                if i != victim:
                    s = etcd_status(p)
                    if s and s["leader"] == s["member_id"]:
                        lead = s
            mine = etcd_status(ports[victim])
            return bool(lead and mine and mine["raftAppliedIndex"] >= lead["raftIndex"])
        wait_for(done, limit, f"etcd member {victim} caught up")
        return time.perf_counter() - t1


def etcd_whole(base: str, keys: int, lags: list[int], repeat: int, single: bool,
               log: Log) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    r = EtcdRun(base)
    try:
        e = r.e
        load_s = etcd_batches(e.client_ports[e.leader()], "k", keys, 128, threads=4)
        log(f"etcd: loaded {keys:,} keys in {load_s:.1f}s")
        du = sum(_du(os.path.join(base, f"e{i}")) for i in range(3)) / 3
        for lag in lags:
            r.snapshot_now()
            if lag:
                w = etcd_puts(e.client_ports[e.leader()], f"lag{lag}-", lag)
                log(f"etcd: {lag:,} single puts in {w:.1f}s ({lag / w:,.0f}/s)")
            samples, measured = [], []
            for _ in range(repeat):
                measured.append(statistics.median(r.lags()))
                r.kill_all()
                fw = r.restart_all()
                samples.append(fw)
                log(f"etcd whole keys={keys:,} lag={lag:,} (entries since snapshot "
                    f"{measured[-1]}): {fw:.3f}s")
                e.leader()
            rows.append(_row("etcd", "whole", samples, keys=keys, lag=lag,
                             entries_since_snapshot=measured, data_mb_per_node=du / 1e6))
        if single:
            rows += etcd_single(r, keys, repeat, log)
    finally:
        r.close()
    return rows


def etcd_single(r: EtcdRun, keys: int, repeat: int, log: Log) -> list[dict[str, Any]]:
    e = r.e
    rows = []
    for role in ("leader", "follower"):
        fws, cus = [], []
        for _ in range(repeat):
            lead = e.leader()
            victim = lead if role == "leader" else (lead + 1) % 3
            r.kill(victim)
            if role == "leader":
                t0 = time.perf_counter()
                fws.append(first_write([(p, etcd_put(r.seq)) for i, p in
                                        enumerate(e.client_ports) if i != victim], t0))
            t1 = time.perf_counter()
            r.start(victim)
            if role == "follower":
                fws.append(first_write([(p, etcd_put(r.seq)) for p in e.client_ports], t1))
            cus.append(r.caught_up_after_start(victim, t1))
            log(f"etcd {role}: first write {fws[-1]:.3f}s, caught up {cus[-1]:.3f}s")
        rows.append(_row("etcd", role, fws, keys=keys, what="first_write"))
        rows.append(_row("etcd", role, cus, keys=keys, what="caught_up"))
    return rows


def etcd_catchup(base: str, writes: list[int], modes: list[str], per: int, repeat: int,
                 log: Log, limit: float = 180) -> list[dict[str, Any]]:
    """etcd's member in the same scenario. ``log``: its defaults (``--snapshot-count
    100000``); ``snapshot``: ``--snapshot-count 100``. etcd 3.4 keeps 5,000 entries in
    memory behind each snapshot for slow followers, so a member fewer than that behind
    catches up from the log whatever the count; whether it got a snapshot is read from
    its log ("incoming snapshot")."""
    rows = []
    for mode in modes:
        r = EtcdRun(os.path.join(base, mode),
                    None if mode == "log" else ["--snapshot-count", "100"])
        try:
            e = r.e
            for m in writes:
                samples, evidence, failed = [], [], []
                for i in range(repeat):
                    lead = e.leader()
                    victim = (lead + 1) % 3
                    before = etcd_status(e.client_ports[victim]) or {}
                    r.kill(victim)
                    w = etcd_batches(e.client_ports[lead], f"c{m}-{i}-", m, per, threads=4)
                    ls = etcd_status(e.client_ports[lead]) or {}
                    n_snap = r.log_text(victim).count("incoming snapshot")
                    t1 = time.perf_counter()
                    r.start(victim)
                    try:
                        samples.append(r.caught_up_after_start(victim, t1, limit))
                    except TimeoutError:
                        failed.append(f"not caught up within {limit}s")
                        log(f"etcd catchup {mode} M={m:,}: {failed[-1]}")
                        break
                    time.sleep(0.3)
                    ev = {"behind_entries": ls.get("raftIndex", 0) - before.get("raftIndex", 0),
                          "got_snapshot": r.log_text(victim).count("incoming snapshot") > n_snap,
                          "write_s": w}
                    evidence.append(ev)
                    log(f"etcd catchup {mode} M={m:,}: {samples[-1]:.3f}s {ev}")
                rows.append(_catchup_row("etcd", samples, mode=mode, writes=m,
                                         per_entry=per, evidence=evidence, failed=failed))
        finally:
            r.close()
    return rows


# -- PySyncObj -------------------------------------------------------------------------------
def pysyncobj_whole(base: str, keys: int, repeat: int, limit: float,
                    log: Log) -> list[dict[str, Any]]:
    from benchmarks._recovery_pysyncobj import PsoCluster

    p = PsoCluster(base)
    seq = Seq()
    try:
        p.start()
        load_s = p.load(keys)
        p.settle(keys)
        log(f"pysyncobj: loaded {keys:,} keys in {load_s:.1f}s")
        du = sum(_du(os.path.join(base, f"p{i}")) for i in range(3)) / 3
        samples: list[float] = []
        timed_out = 0
        for _ in range(repeat):
            p.kill()
            t0 = time.perf_counter()
            p.start()
            try:
                fw = first_write([(port, pso_put(seq)) for port in p.http_ports], t0, limit)
            except RuntimeError:
                timed_out += 1
                log(f"pysyncobj whole keys={keys:,}: no write within {limit}s")
                break  # the next would time out too
            samples.append(fw)
            log(f"pysyncobj whole keys={keys:,}: {fw:.3f}s")
            p.settle(keys, timeout=limit * 2)
        if not samples:
            return [{"system": "pysyncobj", "scenario": "whole", "keys": keys, "lag": None,
                     "median_s": None, "min_s": None, "max_s": None, "samples": [],
                     "timed_out_after_s": limit, "data_mb_per_node": du / 1e6}]
        return [_row("pysyncobj", "whole", samples, keys=keys, lag=None,
                     timed_out=timed_out, data_mb_per_node=du / 1e6)]
    finally:
        p.kill()
