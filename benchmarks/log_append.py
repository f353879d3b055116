"""Append throughput of the Raft log: entries/s saved into ``LmdbLogStore``.

What is measured
----------------
``--entries`` log entries (PUT commands of a ``--value-size`` value under distinct keys,
encoded with ``raftkv.storage.commands.encode_put``) are appended to a fresh ``LmdbLogStore``
with ``save(hard_state, batch)``: one Ready batch of ``--batch`` entries per call, the
hard state's commit index moving with every batch, exactly what a leader persists
between two Ready rounds. Each ``save`` is one LMDB write transaction, and with
``durable=True`` one fsync (group commit). The figure reported is

    entries / wall-clock seconds of the save() calls

The entries are built before the clock starts (building them is the core's work, not
the store's), so the figure is the store's cost alone: CRC and framing of every entry,
the cursor ``putmulti``, the hard-state put and the commit (and sync).

Against what
------------
The same number of (key, value) pairs of the same sizes (8-byte big-endian index, the
framed entry bytes) written by a plain loop over a bare LMDB environment: one write
transaction per batch, ``cursor.putmulti(append=True)``, with ``sync`` on or off. That
is the ceiling for anything that stores the log in LMDB from Python; the ratio says how
much the store's framing, checksums and bookkeeping cost on top of it.

Runs
----
1. the headline batch (``--batch``, default 1000) with fsync on and off, store and raw;
2. a sweep of small batches with fsync on (1, 10, 100, 1000 by default) on fewer
   entries (a batch of 1 is one fsync per entry, so each point runs ``batch * 300``
   entries, at most ``--entries``), which shows how group commit amortizes the sync.

Usage::

    python -m benchmarks.log_append [--entries N] [--batch B] [--value-size 100]
                                    [--sweep 1,10,100,1000] [--json FILE] [--dir DIR]

Results go to a table on stdout and to ``--json`` (default
``benchmarks/results/log_append.json``); a PNG of entries/s against batch size is drawn
next to it if matplotlib is importable.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb
from raftkv.storage.commands import encode_put
from raftkv.storage.lmdb_log import LmdbLogStore, _record
from raftkv.storage.records import Entry, EntryType, HardState

from benchmarks._plot import pyplot

DEFAULT_ENTRIES = 200_000
DEFAULT_BATCH = 1000
DEFAULT_SWEEP = (1, 10, 100, 1000)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "log_append.json"
_KEY = struct.Struct(">Q")


@dataclass
class Run:
    target: str  # "LmdbLogStore" or "raw LMDB"
    durable: bool
    batch: int
    entries: int
    seconds: float
    entries_per_s: float
    syncs: int  # commits with a sync (0 when durable is off)
    ms_per_batch: float


def make_entries(n: int, value_size: int, term: int = 1, first: int = 1) -> list[Entry]:
    value = bytes(range(256)) * (value_size // 256 + 1)
    value = value[:value_size]
    return [
        tuple.__new__(Entry, (term, i, EntryType.NORMAL, encode_put(b"k%08d" % i, value)))
        for i in range(first, first + n)
    ]


def _chunks(entries: list[Entry], batch: int) -> list[list[Entry]]:
    return [entries[i : i + batch] for i in range(0, len(entries), batch)]


def bench_store(path: str, entries: list[Entry], batch: int, durable: bool) -> Run:
    """Time ``save(hard_state, batch)`` calls into a fresh LmdbLogStore at ``path``."""
    shutil.rmtree(path, ignore_errors=True)
    store = LmdbLogStore(path, durable=durable)
    batches = _chunks(entries, batch)
    states = [HardState(1, "n1", b[-1].index) for b in batches]
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for hs, b in zip(states, batches):
            store.save(hs, b)
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    if store.last_index() != entries[-1].index:
        raise AssertionError(f"log ends at {store.last_index()}, want {entries[-1].index}")
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    n = len(entries)
    return Run("LmdbLogStore", durable, batch, n, seconds, n / seconds,
               len(batches) if durable else 0, seconds * 1000 / len(batches))


def bench_raw(path: str, entries: list[Entry], batch: int, durable: bool) -> Run:
    """The ceiling: the same keys and framed values, one putmulti per write transaction."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    env = lmdb.open(path, map_size=1 << 36, max_dbs=3, subdir=True,
                    sync=durable, metasync=durable, readahead=False)
    db = env.open_db(b"entries")
    # Pre-framed, so the raw loop pays for none of the store's work.
    batches = [[_record(e) for e in b] for b in _chunks(entries, batch)]
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for items in batches:
            with env.begin(write=True, db=db) as txn:
                txn.cursor().putmulti(items, append=True)
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    env.close()
    shutil.rmtree(path, ignore_errors=True)
    n = len(entries)
    return Run("raw LMDB", durable, batch, n, seconds, n / seconds,
               len(batches) if durable else 0, seconds * 1000 / len(batches))


SWEEP_SYNCS = 300


def sweep_entries(batch: int, entries: int) -> int:
    """Fewer entries for small batches: an fsync costs milliseconds, and ~300 syncs per
    point give a stable rate without spending minutes on batch 1."""
    return min(entries, batch * SWEEP_SYNCS)


def machine() -> dict[str, object]:
    return {"machine": platform.machine(), "cpu_count": os.cpu_count(),
            "system": platform.system(), "release": platform.release(),
            "python": platform.python_version(), "lmdb": lmdb.__version__}


def print_table(runs: list[Run]) -> None:
    header = (f"{'target':<13} {'fsync':>5} {'batch':>6} {'entries':>9} {'seconds':>8} "
              f"{'entries/s':>11} {'ms/batch':>9}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r.target:<13} {'on' if r.durable else 'off':>5} {r.batch:>6} {r.entries:>9} "
              f"{r.seconds:>8.3f} {r.entries_per_s:>11,.0f} {r.ms_per_batch:>9.3f}")


def _find(runs: list[Run], target: str, durable: bool, batch: int) -> Run | None:
    for r in runs:
        if r.target == target and r.durable == durable and r.batch == batch:
            return r
    return None


def ratios(runs: list[Run]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    seen = set()
    for r in runs:
        key = (r.durable, r.batch)
        if r.target != "LmdbLogStore" or key in seen:
            continue
        seen.add(key)
        raw = _find(runs, "raw LMDB", r.durable, r.batch)
        if raw is not None:
            out.append({"durable": r.durable, "batch": r.batch,
                        "store_entries_per_s": r.entries_per_s,
                        "raw_entries_per_s": raw.entries_per_s,
                        "store_over_raw": r.entries_per_s / raw.entries_per_s})
    return out


def write_json(path: Path, args: argparse.Namespace, runs: list[Run]) -> None:
    head_on = _find(runs, "LmdbLogStore", True, args.batch)
    head_off = _find(runs, "LmdbLogStore", False, args.batch)
    doc: dict[str, object] = {
        "entries": args.entries,
        "batch": args.batch,
        "value_size": args.value_size,
        "store_fsync_on_entries_per_s": head_on.entries_per_s if head_on else None,
        "store_fsync_off_entries_per_s": head_off.entries_per_s if head_off else None,
        "ratios": ratios(runs),
        "machine": machine(),
        "runs": [asdict(r) for r in runs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def plot(path: Path, runs: list[Run]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for target in ("LmdbLogStore", "raw LMDB"):
        for durable in (True, False):
            rs = sorted((r for r in runs if r.target == target and r.durable == durable),
                        key=lambda r: r.batch)
            if rs:
                ax.plot([r.batch for r in rs], [r.entries_per_s for r in rs], marker="o",
                        linestyle="-" if target == "LmdbLogStore" else "--",
                        label=f"{target}, fsync {'on' if durable else 'off'}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("entries per save (one transaction)")
    ax.set_ylabel("entries/s appended")
    ax.set_title("Raft log append: LmdbLogStore vs raw LMDB")
    ax.legend(fontsize="small")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.log_append",
        description="Entries/s appended into LmdbLogStore (fsync on/off) vs a raw LMDB loop.",
    )
    p.add_argument("--entries", type=int, default=DEFAULT_ENTRIES,
                   help=f"entries for the headline runs (default {DEFAULT_ENTRIES})")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"entries per save for the headline runs (default {DEFAULT_BATCH})")
    p.add_argument("--value-size", type=int, default=100, help="value bytes (default 100)")
    p.add_argument("--sweep", default=",".join(map(str, DEFAULT_SWEEP)),
                   help="batch sizes for the fsync-on sweep, comma-separated ('' to skip)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON,
                   help="where to write the results (default benchmarks/results/log_append.json)")
    p.add_argument("--dir", default=None,
                   help="directory for the LMDB files (default: a temp dir, removed at the end)")
    args = p.parse_args(argv)
    try:
        sweep = [int(b) for b in args.sweep.split(",") if b.strip()]
    except ValueError:
        p.error("--sweep takes comma-separated integers")
    if args.entries <= 0 or args.batch <= 0 or args.value_size < 0 or any(b <= 0 for b in sweep):
        p.error("--entries, --batch and sweep batches must be positive, --value-size >= 0")

    base = tempfile.mkdtemp(prefix="raftkv-log-append-", dir=args.dir)
    print(f"raftkv log append: {args.entries} entries of a {args.value_size}-byte put, "
          f"batch {args.batch}; files in {base}; Python {platform.python_version()} on "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    try:
        entries = make_entries(args.entries, args.value_size)
        runs: list[Run] = []
        for durable in (True, False):
            runs.append(bench_store(os.path.join(base, "log"), entries, args.batch, durable))
            runs.append(bench_raw(os.path.join(base, "raw"), entries, args.batch, durable))
        for b in sweep:
            if b == args.batch:
                continue  # already measured with fsync on
            n = sweep_entries(b, args.entries)
            runs.append(bench_store(os.path.join(base, "log"), entries[:n], b, True))
            runs.append(bench_raw(os.path.join(base, "raw"), entries[:n], b, True))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    runs.sort(key=lambda r: (not r.durable, r.batch, r.target))
    print_table(runs)
    print()
    for r in ratios(runs):
        print(f"fsync {'on ' if r['durable'] else 'off'} batch {r['batch']:>5}: LmdbLogStore is "
              f"{r['store_over_raw']:.0%} of raw LMDB "
              f"({r['store_entries_per_s']:,.0f} vs {r['raw_entries_per_s']:,.0f} entries/s)")
    write_json(args.json, args, runs)
    plot(args.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
