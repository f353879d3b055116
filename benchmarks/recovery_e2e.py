"""Recovery time end to end: from a crash to the first acknowledged write (and to a
restarted node caught up), raftkv against etcd and PySyncObj in the same run.

What is measured (3 nodes of each system on 127.0.0.1, each at its defaults unless said)
-----------------------------------------------------------------------------------------
The same data for all: ``--keys`` K keys of 100-byte values, loaded in batches (raftkv
``POST /v1/batch``, 1,000 puts an entry; etcd ``POST /v3/kv/txn``, 128 puts a txn, its
default ``--max-txn-ops``; PySyncObj ``ReplDict.update`` of 1,000 keys an entry), then
until every raftkv node's checkpoint has caught up with its applied index.

A **probe** is a PUT sent to every node every 20 ms (one attempt each, 1 s timeout, a
fresh connection) until one is acknowledged. Times start when the processes are spawned
(or, for a failover, when the leader is killed), so they include process start
(imports), opening the stores, replay, the first election and the first commit.

- **whole** (scenario ``whole``; ``lag`` adds the non-zero ``--lags``): SIGKILL all
  three, spawn all three, probe: ``first write``.
  *Checkpoint lag L*: raftkv has no knob that makes its state store lag (the policy is
  fixed: a checkpoint every 10,000 applied entries or 1 s, ``storage.state_store.
  CheckpointPolicy``, and a SIGKILL loses nothing anyway: the state store's un-synced
  commits live in the page cache, which survives a process crash, so a killed node
  replays nothing). The lag a machine crash can leave is emulated from outside: each
  node's state directory is copied with its checkpoint current, L single-put entries
  are written (and checkpointed), and before each restart the copies are put back, so
  each node reopens L entries behind its log and replays them (its ``recovery:`` log
  line is kept as evidence). The log is never compacted in these runs
  (``--compact-entries 1e9``), else it could not replay 100K entries.
  etcd's analogue is the entries since its last snapshot, which it reads back from its
  WAL on every start: each lag row first makes every member snapshot at its current
  index (a restart with ``--snapshot-count 1`` and two puts), then restarts them with a
  count too large to reach and writes L single puts; the measured entries since the
  snapshot are in the JSON. PySyncObj (FileJournal, no dump: see
  ``benchmarks/_recovery_pysyncobj.py``) always replays its whole journal.
- **leader** / **follower**: SIGKILL the leader (or a follower) alone. ``first_write``:
  for the leader, from the kill (the failover, probing the two others); for the
  follower, from its restart. ``caught_up``: from its restart until its applied index
  reaches the leader's commit index (raftkv ``GET /v1/cluster``; etcd endpoint status
  ``raftAppliedIndex`` against the leader's ``raftIndex``). Run at the smallest --keys.
- **catchup**: a follower SIGKILLed, ``--catchup-writes`` M keys written (batches of
  ``--catchup-batch`` keys, one entry each) while it is down, then restarted: seconds
  from its restart until caught up. ``log``: raftkv never compacts; etcd at its
  defaults. ``snapshot``: raftkv ``--compact-entries 64 --compact-keep 16`` (the
  leader's first index is checked to be past the follower's last); etcd
  ``--snapshot-count 100`` (etcd 3.4 still keeps 5,000 entries behind a snapshot for
  slow followers, so below that it catches up from the log; its log says whether it got
  a snapshot).
- **table** (raftkv): a ``--partitions`` x 3 table, whole cluster SIGKILLed and
  restarted: seconds from the spawn until a PUT into every partition has been
  acknowledged (one key per partition, sent to the node each node's
  ``/v1/tables/t/leaders`` names for it, as the partition-aware client routes, and
  retried after 20 ms, doubling to 100 ms: ``_recovery_common.every_partition_writable``).
- **pysyncobj**: the whole-cluster row for PySyncObj, at each --keys, capped at
  ``--pso-timeout`` seconds.

raftkv runs as installed: its bytecode is compiled first (``compile_bytecode``; an
editable install under ``PYTHONDONTWRITEBYTECODE`` would otherwise compile the package in
every node at every start).
raftkv's nodes log ``startup: imported X, opened X, elected X, committed X, http X``;
those phases (median over restarts and nodes) are in the JSON and the table.

Each figure is the median of ``--repeat`` runs with min and max. Prints tables, writes
``benchmarks/results/recovery_e2e.json`` and ``recovery_e2e.png``.

Usage::

    python -m benchmarks.recovery_e2e [--scenarios whole,lag,leader,follower,catchup,table,pysyncobj]
        [--keys 100000,1000000] [--lags 0,10000,100000] [--catchup-writes 10000,100000,1000000]
        [--catchup-modes log,snapshot] [--partitions 256] [--repeat 3] [--systems raftkv,etcd]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _recovery_systems as S
from benchmarks._plot import pyplot
from benchmarks._recovery_common import compile_bytecode
from benchmarks.http_vs_etcd import ensure

RESULTS = Path(__file__).resolve().parent / "results"
SCENARIOS = ("whole", "lag", "leader", "follower", "catchup", "table", "pysyncobj")


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x]


def _find(rows: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Other system's median / raftkv's, for every row both have."""
    out: dict[str, float] = {}
    for r in rows:
        if r["system"] == "raftkv" or r.get("median_s") is None:
            continue
        keys = {k: r[k] for k in ("scenario", "keys", "lag", "what", "mode", "writes")
                if k in r}
        if r["system"] == "pysyncobj":
            keys["lag"] = 0
        mine = _find(rows, system="raftkv", **keys)
        if mine and mine["median_s"]:
            label = "/".join(f"{k}={v}" for k, v in keys.items())
            out[f"{r['system']}/raftkv {label}"] = r["median_s"] / mine["median_s"]
    return out


def _fmt(r: dict[str, Any]) -> str:
    if r.get("median_s") is None:
        return f"{'timeout':>9} {'':>7} {'':>7}"
    return f"{r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f}"


def print_tables(doc: dict[str, Any]) -> None:
    rows = doc["rows"]
    print(f"\n{'system':10} {'scenario':9} {'parameters':34} {'median s':>9} {'min s':>7} "
          f"{'max s':>7}")
    for r in rows:
        params = ", ".join(f"{k}={r[k]:,}" if isinstance(r[k], int) else f"{k}={r[k]}"
                           for k in ("keys", "lag", "what", "mode", "writes", "partitions")
                           if k in r and r[k] is not None)
        print(f"{r['system']:10} {r['scenario']:9} {params:34} {_fmt(r)}")
    print("\nraftkv start-up phases (s after process start, median [min..max] over nodes):")
    for r in rows:
        if r.get("phases"):
            ph = "  ".join(f"{k} {v['median_s']:.3f} [{v['min_s']:.2f}..{v['max_s']:.2f}]"
                           for k, v in r["phases"].items())
            print(f"  {r['scenario']} keys={r.get('keys', '-')} lag={r.get('lag', '-')}: {ph}")
    print("\nratios (other / raftkv, medians):")
    for k, v in doc["ratios"].items():
        print(f"  {k}: {v:.2f}")


COLORS = {"raftkv": "tab:blue", "etcd": "tab:orange", "pysyncobj": "tab:green"}


def _line(ax: Any, rows: list[dict[str, Any]], x: str, label: str, **style: Any) -> None:
    rows = sorted((r for r in rows if r.get("median_s") is not None), key=lambda r: r[x])
    if not rows:
        return
    xs = [r[x] for r in rows]
    med = [r["median_s"] for r in rows]
    ax.errorbar(xs, med, yerr=[[m - r["min_s"] for m, r in zip(med, rows, strict=True)],
                               [r["max_s"] - m for m, r in zip(med, rows, strict=True)]],
                marker="o", capsize=3, label=label, **style)


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = doc["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    for system, color in COLORS.items():
        _line(ax, [r for r in rows if r["system"] == system and r["scenario"] == "whole"
                   and r.get("lag") in (0, None)], "keys", system, color=color)
    ax.set(xscale="log", yscale="log", xlabel="keys", ylabel="s",
           title="whole-cluster SIGKILL + restart → first write (checkpoint current)")
    ax = axes[0][1]
    for system in ("raftkv", "etcd"):
        for i, keys in enumerate(sorted({r["keys"] for r in rows if r["scenario"] == "whole"
                                         and r["system"] == system})):
            _line(ax, [r for r in rows if r["system"] == system and r["scenario"] == "whole"
                       and r.get("keys") == keys and r.get("lag") is not None],
                  "lag", f"{system} {keys:,} keys", color=COLORS[system],
                  linestyle=("-", "--", ":")[i % 3])
    ax.set(xscale="symlog", xlabel="checkpoint lag (entries since checkpoint/snapshot)",
           ylabel="s", title="whole-cluster restart → first write, against lag")
    ax = axes[1][0]
    for system in ("raftkv", "etcd"):
        for mode, style in (("log", "-"), ("snapshot", "--")):
            _line(ax, [r for r in rows if r["system"] == system and r["scenario"] == "catchup"
                       and r["mode"] == mode], "writes", f"{system} ({mode})",
                  color=COLORS[system], linestyle=style)
    ax.set(xscale="log", yscale="log", xlabel="keys written while the follower was down",
           ylabel="s", title="follower restart → caught up")
    ax = axes[1][1]
    labels, values, colors = [], [], []
    for r in rows:
        if r["scenario"] in ("leader", "follower", "table") and r.get("median_s") is not None:
            what = r.get("what", "all partitions writable")
            labels.append(f"{r['system']}\n{r['scenario']}\n{what}")
            values.append(r["median_s"])
            colors.append(COLORS[r["system"]])
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set(ylabel="s", title="one node restarted; 256x3 table restarted whole")
    for a in axes.flat[:3]:
        if a.lines:
            a.legend(fontsize=7)
    fig.suptitle(f"Recovery end to end, 3 nodes on loopback ({doc['cpus']} CPUs, shared)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="whole,lag,leader,follower,catchup,table,pysyncobj")
    ap.add_argument("--systems", default="raftkv,etcd")
    ap.add_argument("--keys", default="100000,1000000")
    ap.add_argument("--lags", default="0,10000,100000")
    ap.add_argument("--catchup-writes", default="10000,100000,1000000")
    ap.add_argument("--catchup-modes", default="log,snapshot")
    ap.add_argument("--catchup-batch", type=int, default=100)
    ap.add_argument("--catchup-repeat", type=int, default=None,
                    help="repeats of the catch-up rows (default --repeat)")
    ap.add_argument("--catchup-systems", default=None,
                    help="systems of the catch-up rows (default --systems)")
    ap.add_argument("--catchup-timeout", type=float, default=180.0)
    ap.add_argument("--merge", action="store_true",
                    help="add this run's rows to those already in --out")
    ap.add_argument("--partitions", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pso-timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(RESULTS / "recovery_e2e.json"))
    args = ap.parse_args(argv)
    scen = set(args.scenarios.split(","))
    unknown = scen - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    systems = args.systems.split(",")
    keys = _ints(args.keys)
    lags = [lag for lag in _ints(args.lags) if (lag == 0 and "whole" in scen)
            or (lag and "lag" in scen)]
    single = bool(scen & {"leader", "follower"})
    if "etcd" in systems and not ensure("etcd", "etcd-server"):
        systems.remove("etcd")
    compile_bytecode()
    doc: dict[str, Any] = {"params": vars(args), "cpus": os.cpu_count(), "rows": [],
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and out.exists():
        before = json.loads(out.read_text())
        doc["rows"] = before["rows"]
        doc["earlier_runs"] = [*before.get("earlier_runs", []),
                               {k: v for k, v in before.items()
                                if k not in ("rows", "ratios", "earlier_runs")}]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    def save() -> None:
        doc["ratios"] = ratios(doc["rows"])
        doc["wall_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(doc, indent=1))

    def add(rows: list[dict[str, Any]]) -> None:
        doc["rows"] += [r for r in rows if r["scenario"] in scen or r["system"] == "pysyncobj"
                        or (r["scenario"] == "whole" and r["lag"])]
        save()

    with tempfile.TemporaryDirectory(prefix="recovery-e2e-") as base:
        for i, k in enumerate(keys):
            if lags or (single and i == 0):
                for system in systems:
                    fn = S.raftkv_whole if system == "raftkv" else S.etcd_whole
                    add(fn(os.path.join(base, f"{system}-{k}"), k, lags, args.repeat,
                           single and i == 0, log))
        if "catchup" in scen:
            writes = _ints(args.catchup_writes)
            modes = args.catchup_modes.split(",")
            rep = args.catchup_repeat or args.repeat
            for system in (args.catchup_systems or ",".join(systems)).split(","):
                cfn = S.raftkv_catchup if system == "raftkv" else S.etcd_catchup
                add(cfn(os.path.join(base, f"{system}-catchup"), writes, modes,
                        args.catchup_batch, rep, log, args.catchup_timeout))
        if "table" in scen and "raftkv" in systems:
            add(S.raftkv_table(os.path.join(base, "table"), args.partitions, args.repeat, log))
        if "pysyncobj" in scen:
            for k in keys:
                add(S.pysyncobj_whole(os.path.join(base, f"pso-{k}"), k, args.repeat,
                                      args.pso_timeout, log))
    save()
    print_tables(doc)
    plot(out.with_suffix(".png"), doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
