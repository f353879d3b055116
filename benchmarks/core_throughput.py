"""Throughput of the pure Raft core: entries/s committed and applied on a 3-node cluster.

What is measured
----------------
Three ``Raft`` cores (``n1``, ``n2``, ``n3``) run in one process, each on its own
``MemoryLogStore``. ``n1`` is elected before the clock starts. Then a driver loop runs
turns until every node has applied ``--entries`` client entries; the figure reported is

    entries / wall-clock seconds, counting an entry once it is applied on *all three*
    nodes (so it has been proposed, replicated, persisted, committed and applied).

One turn of the loop is the Ready/advance contract carried out for each node in turn:

1. the client proposes ``--batch`` entries with one ``leader.propose_batch`` call, as long
   as the entries in flight (last proposed index - leader's commit index) stay below
   ``--window`` batches;
2. for each node with ``has_ready()``: ``rd = ready()``; ``store.save(hard_state,
   entries, snapshot)`` when there is anything to persist ("durability" is the memory
   store's save: no fsync); collect ``rd.messages``; apply ``rd.committed_entries``
   (one dict assignment per entry, keyed by ``index % 1024``, so the per-entry apply
   cost is paid, not skipped); ``advance(rd)``;
3. deliver every collected message with ``step()`` on its destination.

Why an instant network
----------------------
Messages go straight from one core's Ready into another core's ``step``: no
serialization, no sockets, no threads, no clock, no fsync. What remains is the core's
own CPU cost per entry (building entries and messages, the log and progress
bookkeeping, the commit computation, the Ready batches) plus a minimal driver. This is
the upper bound of the whole stack: a real deployment adds encoding, a transport, disk
syncs and a real state machine on top, and can only be slower. If the core alone cannot
reach the target, nothing above it can, which is why the target (>= 200,000 entries/s)
is checked here first.

Usage::

    python -m benchmarks.core_throughput [--entries N] [--batch B] [--value-size 100]
                                         [--window W] [--sweep] [--json FILE] [--profile]

``--sweep`` runs batch sizes 100, 500, 1000 and 5000. Results go to a table on stdout
and to ``--json`` (default ``benchmarks/results/core_throughput.json``); a PNG of
entries/s against batch size is drawn next to it if matplotlib is importable.
``--profile`` runs one configuration under cProfile and prints the top 25 functions by
own time (cProfile roughly doubles the run time: read the shares, not the rate).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from raftkv.storage.log_store import MemoryLogStore

from benchmarks._plot import pyplot
from raftkv.core import Config, Message, Raft, Role, bootstrap

NODE_IDS = ("n1", "n2", "n3")
SWEEP_BATCHES = (100, 500, 1000, 5000)
DEFAULT_ENTRIES = 500_000
DEFAULT_BATCH = 1000
DEFAULT_WINDOW = 4  # in batches: the client keeps at most window * batch entries in flight
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "core_throughput.json"
APPLY_SLOTS = 1024  # the trivial state machine: sm[index % 1024] = data


@dataclass
class Result:
    entries: int
    batch: int
    window: int
    value_size: int
    seconds: float
    entries_per_s: float
    messages: int
    turns: int
    ms_per_turn: float


class Cluster:
    """Three cores, their memory stores and a trivial state machine per node."""

    def __init__(self, seed: int = 0) -> None:
        self.stores: dict[str, MemoryLogStore] = {}
        self.nodes: dict[str, Raft] = {}
        self.sms: dict[str, dict[int, bytes]] = {}
        self.applied: dict[str, int] = {}
        for i, nid in enumerate(NODE_IDS):
            store = MemoryLogStore()
            bootstrap(store, NODE_IDS)
            self.stores[nid] = store
            self.nodes[nid] = Raft(Config(id=nid), store, random.Random(seed * 31 + i))
            self.sms[nid] = {}
            self.applied[nid] = 0
        self.messages = 0

    def turn(self) -> list[Message]:
        """One Ready/advance round over every node; returns the messages to deliver."""
        out: list[Message] = []
        for nid, raft in self.nodes.items():
            if not raft.has_ready():
                continue
            rd = raft.ready()
            if rd.hard_state is not None or rd.entries or rd.snapshot is not None:
                self.stores[nid].save(rd.hard_state, rd.entries, rd.snapshot)
            if rd.messages:
                out.extend(rd.messages)
            ents = rd.committed_entries
            if ents:
                sm = self.sms[nid]
                for e in ents:
                    sm[e.index % APPLY_SLOTS] = e.data
                self.applied[nid] = ents[-1].index
            raft.advance(rd)
        return out

    def deliver(self, msgs: list[Message]) -> None:
        self.messages += len(msgs)
        nodes = self.nodes
        for m in msgs:
            nodes[m.to].step(m)

    def settle(self, max_turns: int = 1000) -> None:
        """Run turns until no node has anything left to do."""
        for _ in range(max_turns):
            msgs = self.turn()
            if not msgs and not any(r.has_ready() for r in self.nodes.values()):
                return
            self.deliver(msgs)
        raise RuntimeError("cluster did not settle")

    def elect(self, nid: str = "n1") -> Raft:
        leader = self.nodes[nid]
        leader.campaign()
        self.settle()
        if leader.role != Role.LEADER:
            raise RuntimeError(f"{nid} did not become leader (role {leader.role.name})")
        # The leader's no-op is committed and applied everywhere before timing starts.
        last = leader.log.last_index()
        if any(a != last for a in self.applied.values()):
            raise RuntimeError(f"no-op not applied everywhere: {self.applied} vs {last}")
        return leader


def run(entries: int, batch: int, window: int, value_size: int, seed: int = 0) -> Result:
    cluster = Cluster(seed)
    leader = cluster.elect("n1")
    base = leader.log.last_index()
    target = base + entries
    cap = window * batch
    value = b"v" * value_size
    payload = [value] * batch
    applied = cluster.applied
    log = leader.log
    proposed = base
    turns = 0
    cluster.messages = 0

    t0 = time.perf_counter()
    while min(applied.values()) < target:
        turns += 1
        # One batch per turn at most: a client that batches B requests per round trip of
        # the loop, with at most `window` batches waiting for their commit.
        proposed_now = proposed < target and proposed - log.committed < cap
        if proposed_now:
            n = target - proposed
            proposed = leader.propose_batch(payload if n >= batch else [value] * n)
        msgs = cluster.turn()
        if msgs:
            cluster.deliver(msgs)
        elif not proposed_now and not any(r.has_ready() for r in cluster.nodes.values()):
            # Nothing to send, propose or process: without ticks this never moves again.
            raise RuntimeError(f"stalled after {turns} turns: applied {applied}, target {target}")
    seconds = time.perf_counter() - t0

    _check(cluster, target)
    return Result(
        entries=entries,
        batch=batch,
        window=window,
        value_size=value_size,
        seconds=seconds,
        entries_per_s=entries / seconds,
        messages=cluster.messages,
        turns=turns,
        ms_per_turn=seconds * 1000 / turns,
    )


def _check(cluster: Cluster, target: int) -> None:
    """Outside the timed region: every node applied exactly the same log."""
    if set(cluster.applied.values()) != {target}:
        raise AssertionError(f"applied indexes differ: {cluster.applied} (target {target})")
    first = cluster.sms[NODE_IDS[0]]
    for nid in NODE_IDS[1:]:
        if cluster.sms[nid] != first:
            raise AssertionError(f"state machine of {nid} differs from {NODE_IDS[0]}")
    for nid, store in cluster.stores.items():
        if store.last_index() != target:
            raise AssertionError(f"{nid} stored {store.last_index()} entries, want {target}")


def _machine() -> dict[str, object]:
    return {"machine": platform.machine(), "cpu_count": os.cpu_count()}


def print_table(results: list[Result]) -> None:
    header = f"{'batch':>6} {'entries':>9} {'seconds':>8} {'entries/s':>11} " \
             f"{'messages':>9} {'turns':>7} {'ms/turn':>8}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.batch:>6} {r.entries:>9} {r.seconds:>8.2f} {r.entries_per_s:>11,.0f} "
              f"{r.messages:>9} {r.turns:>7} {r.ms_per_turn:>8.3f}")


def write_json(path: Path, results: list[Result]) -> None:
    best = max(results, key=lambda r: r.entries_per_s)
    doc: dict[str, object] = {
        # The headline run (the only one, or the fastest of a sweep).
        "entries": best.entries,
        "batch": best.batch,
        "seconds": best.seconds,
        "entries_per_s": best.entries_per_s,
        "messages": best.messages,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "machine": _machine(),
        "runs": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def plot(path: Path, results: list[Result]) -> None:
    plt = pyplot()
    if plt is None:
        return
    rs = sorted(results, key=lambda r: r.batch)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.batch for r in rs], [r.entries_per_s for r in rs], marker="o")
    ax.axhline(200_000, linestyle="--", color="grey", label="target 200k entries/s")
    ax.set_xscale("log")
    ax.set_xlabel("batch size (entries per propose_batch)")
    ax.set_ylabel("entries/s applied on all 3 nodes")
    ax.set_title(f"raftkv core, 3 nodes, instant network ({platform.python_version()})")
    ax.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")


def profile(entries: int, batch: int, window: int, value_size: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    result = run(entries, batch, window, value_size)
    prof.disable()
    print_table([result])
    print("(under cProfile: rates are deflated; compare the shares below)\n")
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.strip_dirs().sort_stats(pstats.SortKey.TIME).print_stats(25)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.core_throughput",
        description="Entries/s committed and applied on a 3-node in-process cluster "
                    "(core only, instant network, memory stores).",
    )
    p.add_argument("--entries", type=int, default=DEFAULT_ENTRIES,
                   help=f"client entries to apply on every node (default {DEFAULT_ENTRIES})")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"entries per propose_batch call (default {DEFAULT_BATCH})")
    p.add_argument("--value-size", type=int, default=100, help="bytes per entry (default 100)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="max entries in flight, in batches (default %(default)s)")
    p.add_argument("--sweep", action="store_true",
                   help=f"run batch sizes {', '.join(map(str, SWEEP_BATCHES))}")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON,
                   help="where to write the results (default benchmarks/results/"
                        "core_throughput.json)")
    p.add_argument("--profile", action="store_true",
                   help="run one configuration under cProfile; print the top 25 by tottime")
    args = p.parse_args(argv)
    if args.entries <= 0 or args.batch <= 0 or args.window <= 0 or args.value_size < 0:
        p.error("--entries, --batch and --window must be positive, --value-size >= 0")

    print(f"raftkv core throughput: 3 nodes, instant network, MemoryLogStore, "
          f"value {args.value_size} B, window {args.window} batches; "
          f"Python {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    if args.profile:
        profile(args.entries, args.batch, args.window, args.value_size)
        return 0

    batches = SWEEP_BATCHES if args.sweep else (args.batch,)
    results = []
    for b in batches:
        gc.collect()  # start each run from the same heap, not the previous run's garbage
        results.append(run(args.entries, b, args.window, args.value_size))
    print_table(results)
    best = max(results, key=lambda r: r.entries_per_s)
    verdict = "meets" if best.entries_per_s >= 200_000 else "misses"
    print(f"best: {best.entries_per_s:,.0f} entries/s at batch {best.batch} "
          f"({verdict} the 200,000 entries/s target)")
    write_json(args.json, results)
    plot(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
