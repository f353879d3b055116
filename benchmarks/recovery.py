"""Restart time of a raftkv node: reopen the Raft log and the state store, replay the tail.

What is measured
----------------
Setup (not timed): a durable ``LmdbLogStore`` holding ``--entries`` N committed entries
(PUT commands, distinct keys ``k00000001..``, ``--value-size`` byte values, saved in
batches of 10,000, one fsync each, hard-state commit = N), and for every lag L in
``--lags`` an ``LmdbStateStore`` with entries 1..N-L applied, checkpointed (synced) and
closed, so its files hold exactly N-L applied: a node that crashed L entries after its
last checkpoint. The state stores are built once, incrementally (apply up to the
smallest checkpoint, checkpoint, close, copy the directory; reopen, apply up to the next
one, ...), not once per lag.

Timed, for each lag, in a FRESH SUBPROCESS (nothing cached in the Python process; the
OS page cache is warm, as after a process crash or kill, and the copied state files are
fsynced first, as a checkpoint leaves them):

    restart_s = open LmdbStateStore (its checkpointIndex C)
              + open LmdbLogStore (checks the uncommitted tail; replay verifies
                each entry's checksum as it reads it, before applying it)
              + recovery.local.replay(log, state)
              + until serving: applied_index() == N and a get() of the last key works

``replay_rate`` is RecoveryReport.rate (replayed / replay seconds). Each lag runs
``--repeat`` times on a fresh copy of its state store; the median by restart_s is
reported, every sample is in the JSON. ``--cold`` also runs each lag once after
dropping the log and state files from the page cache (fsync + posix_fadvise DONTNEED on
our own files only), which models a machine reboot rather than a process restart.

Against what
------------
- **PySyncObj 0.3.17**, restarting from a FileJournal of the same N puts (a single-node
  ``SyncObj`` with a ``ReplDict``; no full dump, compaction out of reach, so it replays
  its whole journal). See ``benchmarks/_pysyncobj_peer.py`` for the configuration. The
  fill (N ``set`` calls through the Raft path) is timed separately; if it would pass
  ``--pysyncobj-max-fill`` seconds it stops early and ``pysyncobj_entries`` says how many.
- **The plain LMDB limit**: a batched write loop of the same N (key, value) pairs into a
  bare env opened like the state store (``sync=False, metasync=False``): 10,000
  ``txn.put`` per write transaction. ``lmdb_limit_rate`` is entries/s. (A C-level
  ``putmulti`` of the same pairs is reported too, as ``lmdb_putmulti_rate``.) Both are
  the median of ``--repeat`` runs.

Targets checked: replay >= 250,000 entries/s and >= 50% of the LMDB limit (at the
largest lag, where fixed costs matter least); restart at lag 10,000 <= 0.3 s and
>= 10x faster than PySyncObj's.

Usage::

    python -m benchmarks.recovery [--entries N] [--lags 0,1000,10000,100000]
                                  [--value-size 100] [--repeat 3] [--cold]
                                  [--json FILE] [--dir DIR] [--profile]
                                  [--pysyncobj-max-fill 300] [--no-pysyncobj]

Results: a table on stdout, ``--json`` (default ``benchmarks/results/recovery.json``),
and a PNG of restart time against lag next to it if matplotlib is importable.
``--profile`` also runs replay at the largest lag under cProfile (on a fresh copy, in
this process) and prints the top 25 functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lmdb
from raftkv.recovery.local import replay
from raftkv.storage.commands import encode_put
from raftkv.storage.lmdb_log import LmdbLogStore
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.records import Entry, EntryType, HardState

from benchmarks._plot import pyplot
from raftkv.testing.procs import free_port

DEFAULT_ENTRIES = 1_000_000
DEFAULT_LAGS = (0, 1_000, 10_000, 100_000)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "recovery.json"
BUILD_BATCH = 10_000  # entries per log save / state apply / raw LMDB transaction
TARGET_RATE = 250_000
TARGET_LIMIT_SHARE = 0.5
TARGET_RESTART_S = 0.3
TARGET_LAG = 10_000
TARGET_SPEEDUP = 10.0
ROOT = Path(__file__).resolve().parent.parent


# -- the data: the same keys and values everywhere (log, state store, LMDB, PySyncObj) ------
def key(i: int) -> bytes:
    return b"k%08d" % i


def value(i: int, size: int) -> bytes:
    head = b"v%08d" % i  # distinct per key, so the final get() checks the right row
    return (head + b"x" * size)[:size]


def make_entries(lo: int, hi: int, size: int) -> list[Entry]:
    """Entries ``lo..hi-1``, term 1, each a PUT of ``key(i) = value(i)``."""
    return [
        tuple.__new__(Entry, (1, i, EntryType.NORMAL, encode_put(key(i), value(i, size))))
        for i in range(lo, hi)
    ]


def fsync_tree(path: str, drop_cache: bool = False) -> None:
    """fsync every file under ``path``; optionally drop it from the page cache."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                if drop_cache:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- setup ----------------------------------------------------------------------------------
def build_log(path: str, n: int, size: int) -> float:
    t0 = time.perf_counter()
    log = LmdbLogStore(path, durable=True)
    for lo in range(1, n + 1, BUILD_BATCH):
        hi = min(lo + BUILD_BATCH, n + 1)
        log.save(HardState(1, "n1", hi - 1), make_entries(lo, hi, size))
    if log.last_index() != n or log.initial_state()[0].commit != n:
        raise AssertionError(f"log ends at {log.last_index()}, want {n}")
    log.close()
    return time.perf_counter() - t0


def build_states(base: str, n: int, lags: list[int], size: int) -> tuple[dict[int, str], float]:
    """One state store per checkpoint N-L, each closed right after its checkpoint."""
    t0 = time.perf_counter()
    work = os.path.join(base, "state-build")
    dirs: dict[int, str] = {}
    applied = 0
    for ckpt in sorted({n - lag for lag in lags}):
        state = LmdbStateStore(work)
        for lo in range(applied + 1, ckpt + 1, BUILD_BATCH):
            hi = min(lo + BUILD_BATCH, ckpt + 1)
            state.apply([(e[1], e[3]) for e in make_entries(lo, hi, size)])
        applied = ckpt
        if state.checkpoint() != ckpt or state.applied_index() != ckpt:
            raise AssertionError(f"state store checkpointed at {state.checkpoint_index()}, "
                                 f"want {ckpt}")
        state.close()
        dirs[ckpt] = os.path.join(base, f"state-{ckpt}")
        shutil.copytree(work, dirs[ckpt])
        fsync_tree(dirs[ckpt])
    shutil.rmtree(work)
    return dirs, time.perf_counter() - t0


def lmdb_limit(path: str, n: int, size: int, multi: bool) -> float:
    """entries/s of a plain batched LMDB write loop, env opened like the state store."""
    shutil.rmtree(path, ignore_errors=True)
    env = lmdb.open(path, subdir=True, create=True, map_size=1 << 34, max_dbs=2,
                    sync=False, metasync=False, readahead=False)
    db = env.open_db(b"data")
    batches = [[(key(i), value(i, size)) for i in range(lo, min(lo + BUILD_BATCH, n + 1))]
               for lo in range(1, n + 1, BUILD_BATCH)]
    gc.collect()
    t0 = time.perf_counter()
    for items in batches:
        with env.begin(write=True, db=db) as txn:
            if multi:
                txn.cursor().putmulti(items)
            else:
                put = txn.put
                for k, v in items:
                    put(k, v)
    seconds = time.perf_counter() - t0
    env.close()
    shutil.rmtree(path, ignore_errors=True)
    return n / seconds


# -- the measured restart (runs in a fresh subprocess) --------------------------------------
def child_restart(log_dir: str, state_dir: str, n: int, size: int, spawn: float) -> dict:
    t0 = time.perf_counter()
    state = LmdbStateStore(state_dir)
    checkpoint = state.checkpoint_index()
    raft_log = LmdbLogStore(log_dir)
    t_open = time.perf_counter()
    report = replay(raft_log, state)
    t_replay = time.perf_counter()
    serving = state.applied_index() == n and state.get(key(n)) == value(n, size)
    t1 = time.perf_counter()
    wall = time.time()
    out = {
        "checkpoint": checkpoint,
        "restart_s": t1 - t0,
        "open_s": t_open - t0,
        "replay_s": t_replay - t_open,
        "replayed": report.replayed,
        "replay_seconds": report.seconds,
        "replay_rate": report.rate if report.replayed else None,
        "serving": serving,
        "spawn_to_serving_s": wall - spawn,
    }
    raft_log.close()
    state.close()
    return out


def run_child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_restart(log_dir: str, ckpt_dir: str, run_dir: str, n: int, size: int,
                    cold: bool) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(ckpt_dir, run_dir)
    fsync_tree(run_dir, drop_cache=cold)  # a checkpoint leaves the files synced
    if cold:
        fsync_tree(log_dir, drop_cache=True)
    out = run_child(["-m", "benchmarks.recovery", "--child-restart", log_dir, run_dir,
                     str(n), str(size), repr(time.time())])
    if not out["serving"]:
        raise AssertionError(f"restart from {ckpt_dir} is not serving: {out}")
    return out


# -- PySyncObj ------------------------------------------------------------------------------
def pysyncobj(base: str, n: int, size: int, max_fill: float, repeat: int) -> dict:
    journal = os.path.join(base, "pysyncobj", "journal")
    os.makedirs(os.path.dirname(journal))
    port = free_port()
    peer = "benchmarks._pysyncobj_peer"
    filled = run_child(["-m", peer, "fill", journal, str(port), str(n), str(size),
                        str(max_fill)])
    entries = int(filled["entries"])
    restarts = [
        run_child(["-m", peer, "restart", journal, str(port), str(entries), str(size),
                   repr(time.time())])
        for _ in range(repeat)
    ]
    for r in restarts:
        if not r["read_ok"] or r["keys"] != entries:
            raise AssertionError(f"PySyncObj restart did not recover every key: {r}")
    best = sorted(restarts, key=lambda r: r["restart_s"])[len(restarts) // 2]
    return {"entries": entries, "fill": filled, "restart": best, "samples": restarts,
            "journal_bytes": os.path.getsize(journal)}


# -- report ---------------------------------------------------------------------------------
def machine() -> dict[str, object]:
    return {"machine": platform.machine(), "cpu_count": os.cpu_count(),
            "system": platform.system(), "release": platform.release(),
            "python": platform.python_version(), "lmdb": lmdb.__version__}


def median_sample(samples: list[dict]) -> dict:
    return sorted(samples, key=lambda s: s["restart_s"])[len(samples) // 2]


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f}"


def print_table(rows: list[dict]) -> None:
    header = (f"{'lag':>8} {'log':>9} {'ckpt':>9} {'replayed':>9} {'open_s':>7} "
              f"{'replay_s':>8} {'restart_s':>9} {'replay/s':>10} {'cold_s':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        cold = "-" if r.get("restart_cold_s") is None else f"{r['restart_cold_s']:.3f}"
        print(f"{r['lag']:>8} {r['log_entries']:>9} {r['checkpoint']:>9} {r['replayed']:>9} "
              f"{r['open_s']:>7.3f} {r['replay_s']:>8.3f} {r['restart_s']:>9.3f} "
              f"{fmt_rate(r['replay_rate']):>10} {cold:>7}")


def plot(path: Path, doc: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    lags = [max(r["lag"], 1) for r in rows]  # lag 0 drawn at 1 on the log axis
    ax.plot(lags, [r["restart_s"] for r in rows], marker="o", label="raftkv (warm cache)")
    if any(r.get("restart_cold_s") is not None for r in rows):
        ax.plot(lags, [r.get("restart_cold_s") for r in rows], marker="s", linestyle=":",
                label="raftkv (cold cache)")
    if doc.get("pysyncobj_restart_s"):
        ax.axhline(doc["pysyncobj_restart_s"], color="red", linestyle="--",
                   label=f"PySyncObj, {doc['pysyncobj_entries']:,} entries")
    ax.axhline(TARGET_RESTART_S, color="grey", linestyle=":", label="target 0.3 s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("lag: entries after the checkpoint (0 drawn at 1)")
    ax.set_ylabel("restart to serving (s)")
    ax.set_title(f"restart with {doc['entries']:,} entries in the log")
    ax.legend(fontsize="small")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def targets(doc: dict) -> list[tuple[str, bool | None, str]]:
    rows = doc["rows"]
    out: list[tuple[str, bool | None, str]] = []
    big = max((r for r in rows if r["replayed"]), key=lambda r: r["lag"], default=None)
    if big is not None:
        rate = big["replay_rate"]
        out.append((f"replay >= {TARGET_RATE:,} entries/s (lag {big['lag']:,})",
                    rate >= TARGET_RATE, f"{rate:,.0f} entries/s"))
        share = rate / doc["lmdb_limit_rate"]
        out.append((f"replay >= {TARGET_LIMIT_SHARE:.0%} of the LMDB limit (lag {big['lag']:,})",
                    share >= TARGET_LIMIT_SHARE,
                    f"{share:.0%} of {doc['lmdb_limit_rate']:,.0f} entries/s"))
    at = next((r for r in rows if r["lag"] == TARGET_LAG), None)
    if at is not None:
        full = doc["entries"] == 1_000_000
        out.append((f"restart at lag {TARGET_LAG:,} <= {TARGET_RESTART_S} s"
                    + ("" if full else f" (N={doc['entries']:,}, target is for 1,000,000)"),
                    at["restart_s"] <= TARGET_RESTART_S, f"{at['restart_s']:.3f} s"))
        ps = doc.get("pysyncobj_restart_s")
        if ps:
            speedup = ps / at["restart_s"]
            same = doc["pysyncobj_entries"] == doc["entries"]
            out.append((f">= {TARGET_SPEEDUP:.0f}x faster than PySyncObj at lag {TARGET_LAG:,}"
                        + ("" if same else " (PySyncObj on fewer entries)"),
                        speedup >= TARGET_SPEEDUP,
                        f"{speedup:,.1f}x ({ps:.3f} s vs {at['restart_s']:.3f} s)"))
    return out


def profile_replay(log_dir: str, ckpt_dir: str, run_dir: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(ckpt_dir, run_dir)
    fsync_tree(run_dir)
    state = LmdbStateStore(run_dir)
    raft_log = LmdbLogStore(log_dir)
    prof = cProfile.Profile()
    prof.enable()
    report = replay(raft_log, state)
    prof.disable()
    print(f"\n{report.describe()} (under cProfile: read the shares, not the rate)")
    pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats(
        pstats.SortKey.TIME).print_stats(25)
    raft_log.close()
    state.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.recovery",
        description="Restart time (open log + state store, replay the tail) vs lag, "
                    "against PySyncObj's journal replay and a plain LMDB write loop.",
    )
    p.add_argument("--entries", type=int, default=DEFAULT_ENTRIES,
                   help=f"committed entries in the log (default {DEFAULT_ENTRIES:,})")
    p.add_argument("--lags", default=",".join(map(str, DEFAULT_LAGS)),
                   help="entries after the checkpoint, comma-separated (default %(default)s)")
    p.add_argument("--value-size", type=int, default=100, help="value bytes (default 100)")
    p.add_argument("--repeat", type=int, default=3,
                   help="restarts per lag, each on a fresh copy; the median is reported")
    p.add_argument("--cold", action="store_true",
                   help="also restart each lag once with our files dropped from the page cache")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON,
                   help="where to write the results (default benchmarks/results/recovery.json)")
    p.add_argument("--dir", default=None,
                   help="parent directory for the files (default: /tmp); a fresh temp dir "
                        "is created in it and removed at the end")
    p.add_argument("--pysyncobj-max-fill", type=float, default=300.0,
                   help="stop filling PySyncObj's journal after this many seconds (default 300)")
    p.add_argument("--no-pysyncobj", action="store_true", help="skip the PySyncObj comparison")
    p.add_argument("--profile", action="store_true",
                   help="also profile replay at the largest lag (cProfile, top 25 by tottime)")
    p.add_argument("--child-restart", nargs=5, metavar="ARG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child_restart:
        log_dir, state_dir, n, size, spawn = args.child_restart
        print(json.dumps(child_restart(log_dir, state_dir, int(n), int(size), float(spawn))))
        return 0

    try:
        lags = sorted({int(x) for x in args.lags.split(",") if x.strip()})
    except ValueError:
        p.error("--lags takes comma-separated integers")
    n, size = args.entries, args.value_size
    if n <= 0 or size < 10 or args.repeat <= 0 or not lags:
        p.error("--entries and --repeat must be positive, --value-size >= 10, --lags non-empty")
    if any(lag < 0 or lag > n for lag in lags):
        p.error("every lag must be within 0..--entries")

    base = tempfile.mkdtemp(prefix="raftkv-recovery-", dir=args.dir or "/tmp")
    print(f"raftkv recovery: {n:,} entries ({size}-byte values), lags {lags}, "
          f"{args.repeat} restart(s) per lag; files in {base}; Python "
          f"{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    t_all = time.perf_counter()
    try:
        log_dir = os.path.join(base, "log")
        build_log_s = build_log(log_dir, n, size)
        print(f"built the log: {n:,} entries in {build_log_s:.1f} s")
        ckpt_dirs, build_state_s = build_states(base, n, lags, size)
        print(f"built {len(ckpt_dirs)} state stores in {build_state_s:.1f} s")

        rows = []
        run_dir = os.path.join(base, "state-run")
        for lag in lags:
            ckpt = n - lag
            samples = [measure_restart(log_dir, ckpt_dirs[ckpt], run_dir, n, size, False)
                       for _ in range(args.repeat)]
            for s in samples:
                if s["checkpoint"] != ckpt or s["replayed"] != lag:
                    raise AssertionError(f"lag {lag}: reopened at {s['checkpoint']}, "
                                         f"replayed {s['replayed']}")
            m = median_sample(samples)
            cold = (measure_restart(log_dir, ckpt_dirs[ckpt], run_dir, n, size, True)
                    if args.cold else None)
            rows.append({
                "lag": lag, "log_entries": n, "checkpoint": ckpt,
                "restart_s": m["restart_s"], "replayed": m["replayed"],
                "replay_rate": m["replay_rate"], "open_s": m["open_s"],
                "replay_s": m["replay_s"], "spawn_to_serving_s": m["spawn_to_serving_s"],
                "restart_cold_s": cold["restart_s"] if cold else None,
                "replay_rate_cold": cold["replay_rate"] if cold else None,
                "samples": samples,
            })
            print(f"lag {lag:>8,}: restart {m['restart_s']:.3f} s, replayed {m['replayed']:,}"
                  + (f" at {m['replay_rate']:,.0f} entries/s" if m["replayed"] else ""))

        # The median of --repeat runs each, like the restarts.
        limit_dir = os.path.join(base, "lmdb-limit")
        limit_samples = [lmdb_limit(limit_dir, n, size, multi=False) for _ in range(args.repeat)]
        multi_samples = [lmdb_limit(limit_dir, n, size, multi=True) for _ in range(args.repeat)]
        limit = sorted(limit_samples)[len(limit_samples) // 2]
        limit_multi = sorted(multi_samples)[len(multi_samples) // 2]
        print(f"plain LMDB write loop: {limit:,.0f} entries/s (txn.put), "
              f"{limit_multi:,.0f} entries/s (putmulti)")

        pso = None
        if not args.no_pysyncobj:
            print("PySyncObj: filling the journal ...", flush=True)
            pso = pysyncobj(base, n, size, args.pysyncobj_max_fill, args.repeat)
            f = pso["fill"]
            print(f"PySyncObj: filled {pso['entries']:,} entries in {f['fill_s']:.1f} s "
                  f"({f['fill_rate']:,.0f} entries/s); restart "
                  f"{pso['restart']['restart_s']:.3f} s")

        if args.profile:
            big = max(lags)
            profile_replay(log_dir, ckpt_dirs[n - big], run_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    doc: dict = {
        "entries": n,
        "value_size": size,
        "rows": rows,
        "pysyncobj_restart_s": pso["restart"]["restart_s"] if pso else None,
        "pysyncobj_entries": pso["entries"] if pso else None,
        "pysyncobj_fill_s": pso["fill"]["fill_s"] if pso else None,
        "pysyncobj_fill_rate": pso["fill"]["fill_rate"] if pso else None,
        "pysyncobj": pso,
        "lmdb_limit_rate": limit,
        "lmdb_putmulti_rate": limit_multi,
        "lmdb_limit_samples": limit_samples,
        "repeat": args.repeat,
        "build_log_s": build_log_s,
        "build_state_s": build_state_s,
        "total_s": time.perf_counter() - t_all,
        "machine": machine(),
    }
    big = max((r for r in rows if r["replayed"]), key=lambda r: r["lag"], default=None)
    at = next((r for r in rows if r["lag"] == TARGET_LAG), None)
    doc["ratios"] = {
        "replay_rate_over_lmdb_limit": big["replay_rate"] / limit if big else None,
        "replay_rate_lag": big["lag"] if big else None,
        "pysyncobj_over_restart_at_lag_10000": (
            doc["pysyncobj_restart_s"] / at["restart_s"] if at and pso else None),
    }
    doc["targets"] = [{"target": t, "met": ok, "value": v} for t, ok, v in targets(doc)]

    print()
    print_table(rows)
    print()
    print(f"plain LMDB limit (txn.put loop, {BUILD_BATCH:,} per txn, sync off): "
          f"{limit:,.0f} entries/s")
    if pso:
        print(f"PySyncObj {pso['entries']:,} entries: restart {doc['pysyncobj_restart_s']:.3f} s "
              f"(journal read {pso['restart']['open_s']:.3f} s + apply "
              f"{pso['restart']['apply_s']:.3f} s); fill {doc['pysyncobj_fill_s']:.1f} s")
    r = doc["ratios"]
    if r["replay_rate_over_lmdb_limit"] is not None:
        print(f"replay_rate / lmdb_limit_rate (lag {r['replay_rate_lag']:,}): "
              f"{r['replay_rate_over_lmdb_limit']:.2f}")
    if r["pysyncobj_over_restart_at_lag_10000"] is not None:
        print(f"pysyncobj_restart_s / restart_s (lag 10,000): "
              f"{r['pysyncobj_over_restart_at_lag_10000']:.1f}")
    print()
    for t in doc["targets"]:
        print(f"[{verdict(t['met'])}] {t['target']}: {t['value']}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    plot(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
