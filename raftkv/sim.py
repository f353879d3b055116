"""``python -m raftkv.sim``: run the randomized simulator over a range of seeds.

    python -m raftkv.sim --seeds 0:500 --nodes 5 [--steps 2000] [--faults drop,crash,...]
        [--state-store] [--no-quiesce] [--jobs N] [-v]
    python -m raftkv.sim --seeds 0:500 --nodes 2 \
        --faults drop,dup,delay,partition,crash,membership,compact,idle,survive

Quiescence of idle groups is on by default (the ``idle`` fault makes the clients pause
so groups go quiet while crashes and partitions go on); a line before the last reports
how many node ticks found a node quiesced.

Each failing seed prints its violations and the tail of its trace; rerunning that seed
alone reproduces it exactly. The last line is always
``seeds=<count> violations=<count> nonlinearizable=<count>``, and the exit status is
non-zero if either count is.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor

from raftkv.testing.simulator import (
    ALL_FAULTS,
    OPT_IN_FAULTS,
    SimConfig,
    SimResult,
    run_seed,
)


def parse_seeds(text: str) -> range:
    """``A:B`` is the half-open range [A, B); a single number is one seed."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            return range(int(a), int(b))
        return range(int(text), int(text) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be A:B or N, not {text!r}") from None


def parse_faults(text: str) -> tuple[str, ...]:
    if text in ("", "none"):
        return ()
    faults = tuple(f.strip() for f in text.split(",") if f.strip())
    known = ALL_FAULTS + OPT_IN_FAULTS
    unknown = sorted(set(faults) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return faults


def _run(args: tuple[int, SimConfig]) -> SimResult:
    return run_seed(*args)


def report(result: SimResult, flags: str = "") -> None:
    print(f"--- seed {result.seed} FAILED")
    for v in result.violations:
        print(f"  violation: {v}")
    if not result.linearizable and result.linearizability is not None:
        print("  nonlinearizable history:")
        for line in result.linearizability.detail.splitlines():
            print(f"    {line}")
    print("  trace (most recent last):")
    for line in result.trace:
        print(f"    {line}")
    print(f"  reproduce: python -m raftkv.sim --seeds {result.seed}{flags}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raftkv.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=parse_seeds, default=range(100))
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--steps", type=int, default=SimConfig.steps)
    ap.add_argument("--faults", type=parse_faults, default=ALL_FAULTS,
                    help=f"comma-separated subset of {','.join(ALL_FAULTS + OPT_IN_FAULTS)}, "
                    "or none (default: all but the opt-in "
                    f"{','.join(OPT_IN_FAULTS)})")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--state-store", action="store_true",
                    help="run nodes on the real storage path (GroupStorage + MemoryStateStore)")
    ap.add_argument("--no-quiesce", dest="quiesce", action="store_false",
                    help="run without quiescence of idle groups (Config.quiesce)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per seed")
    args = ap.parse_args(argv)
    if args.nodes < 1:
        ap.error("--nodes must be at least 1")
    cfg = SimConfig(nodes=args.nodes, steps=args.steps, faults=args.faults,
                    state_store=args.state_store, quiesce=args.quiesce)
    work = [(seed, cfg) for seed in args.seeds]
    # What a failing seed's replay command needs besides the seed (the defaults aside).
    flags = "".join([
        f" --nodes {args.nodes}" if args.nodes != 5 else "",
        f" --steps {args.steps}" if args.steps != SimConfig.steps else "",
        f" --faults {','.join(args.faults) or 'none'}" if args.faults != ALL_FAULTS else "",
        " --state-store" if args.state_store else "",
        " --no-quiesce" if not args.quiesce else "",
    ])
    violations = nonlinear = 0
    ticks = [0, 0, 0, 0, 0, 0]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = pool.map(_run, work, chunksize=4)
            violations, nonlinear = _tally(results, args.verbose, ticks, flags)
    else:
        violations, nonlinear = _tally(map(_run, work), args.verbose, ticks, flags)
    # How much quiescence the schedules exercised (node ticks that found a quiet node).
    print(f"quiesced ticks: {ticks[1]} of {ticks[0]} "
          f"({100.0 * ticks[1] / max(ticks[0], 1):.1f}%); "
          f"quiet nodes woken by liveness reports: {ticks[2]}")
    if "survive" in args.faults:
        print(f"survive: voters lost {ticks[3]}, survivor elections {ticks[4]}, won {ticks[5]}")
    print(f"seeds={len(work)} violations={violations} nonlinearizable={nonlinear}")
    return 1 if violations or nonlinear else 0


def _tally(results, verbose: bool, ticks: list[int], flags: str = "") -> tuple[int, int]:
    violations = nonlinear = 0
    for r in results:
        ticks[0] += r.ticks
        ticks[1] += r.quiet_ticks
        ticks[2] += r.liveness_wakes
        ticks[3] += r.losses
        ticks[4] += r.survivor_elections
        ticks[5] += r.survivor_wins
        if r.violations:
            violations += 1
        elif not r.linearizable:
            nonlinear += 1
        if r.violations or not r.linearizable:
            report(r, flags)
        elif verbose:
            extra = (f" lost={r.losses} survivor={r.survivor_wins}/{r.survivor_elections}"
                     if r.losses else "")
            print(f"seed {r.seed}: ok ops={r.ops} committed={r.committed} terms={r.leaders} "
                  f"quiet={r.quiet_ticks}/{r.ticks}{extra}")
        sys.stdout.flush()
    return violations, nonlinear


if __name__ == "__main__":
    sys.exit(main())
