"""What bearer tokens cost the HTTP API (``raftkv serve --tokens-file``).

What is measured
----------------
1. **The lookup** (``raftkv.server.auth.Tokens.identify``): microseconds per call with
   4, 100 and 1,000 tokens in the file. It hashes the presented token once and compares
   the hash with every known token's (constant time), so it grows with the file.
2. **A PUT end to end**: a 3-node cluster of ``raftkv serve`` processes (fsync on),
   ``--clients`` threads each PUTting ``--ops / --clients`` keys of ``--value-size``
   bytes sequentially through ``raftkv.client.Client`` to the leader, with tokens on
   (the write token; a 4-token file) and off, alternating for ``--repeat`` rounds, each
   round on fresh clusters. Reported per mode, as the median over rounds: PUTs/s, and
   the leader process's CPU time per PUT (user + system, from ``/proc``), the figure
   the middleware adds to. The client threads share this process's GIL alike in both
   modes.

Usage::

    python -m benchmarks.auth_overhead [--ops 6000] [--clients 8] [--repeat 3]
                                       [--value-size 100] [--json FILE] [--dir DIR]

Results: a table on stdout and ``--json`` (default
``benchmarks/results/auth_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import timeit
from pathlib import Path
from typing import Any

from raftkv.server.auth import Role, Tokens
from raftkv.testing.procs import ProcCluster

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "auth_overhead.json"


def lookup_cost(directory: str, count: int) -> float:
    """Microseconds per ``identify`` of a valid token, with ``count`` tokens known."""
    path = os.path.join(directory, f"tokens-{count}")
    with open(path, "w") as f:
        f.writelines(f"read r{i} token-{i:06d}-{'x' * 20}\n" for i in range(count))
    os.chmod(path, 0o600)
    tokens = Tokens(path)
    probe = f"token-{count // 2:06d}-{'x' * 20}"
    assert tokens.identify(probe) is not None
    number = max(100, 200_000 // count)
    return min(timeit.repeat(lambda: tokens.identify(probe), number=number, repeat=5)) \
        / number * 1e6


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def put_run(directory: str, auth: bool, ops: int, clients: int, size: int) -> dict[str, Any]:
    cluster = ProcCluster(directory, size=3, faults=False, auth=auth,
                          extra_args=["--log-level", "WARNING"])
    try:
        cluster.start()
        lead = cluster.wait_leader()
        proc = cluster.nodes[lead].proc
        assert proc is not None
        conns = [cluster.client([lead], timeout=30, role=Role.WRITE) for _ in range(clients)]
        for i, c in enumerate(conns):  # open each kept-alive connection
            c.put(f"warm-{i}", "x")
        value = b"v" * size
        errors = [0] * clients
        barrier = threading.Barrier(clients + 1)

        def work(t: int) -> None:
            barrier.wait()
            for i in range(ops // clients):
                try:
                    conns[t].put(f"k-{t}-{i}", value)
                except Exception:  # noqa: BLE001 - counted; the run goes on
                    errors[t] += 1

        threads = [threading.Thread(target=work, args=(t,)) for t in range(clients)]
        for th in threads:
            th.start()
        cpu0 = _cpu_seconds(proc.pid)
        barrier.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - t0
        cpu = _cpu_seconds(proc.pid) - cpu0
        done = (ops // clients) * clients - sum(errors)
        for c in conns:
            c.close()
        return {"auth": auth, "ops": done, "errors": sum(errors), "seconds": seconds,
                "ops_s": done / seconds, "leader_cpu_us_per_op": cpu / done * 1e6}
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.auth_overhead",
                                description="The cost of bearer tokens on the HTTP API.")
    p.add_argument("--ops", type=int, default=6000, help="PUTs per run (default 6,000)")
    p.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of on and off (default 3)")
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--dir", default=None, help="parent of the temp dir (default /tmp)")
    args = p.parse_args(argv)
    if args.ops < args.clients or args.clients < 1 or args.repeat < 1:
        p.error("--ops must be at least --clients, both and --repeat positive")
    base = tempfile.mkdtemp(prefix="raftkv-auth-", dir=args.dir)
    doc: dict[str, Any] = {"ops": args.ops, "clients": args.clients,
                           "value_size": args.value_size, "lookup_us": {}}
    for count in (4, 100, 1000):
        doc["lookup_us"][count] = lookup_cost(base, count)
        print(f"identify() with {count:>4} tokens: {doc['lookup_us'][count]:7.2f} us",
              flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(args.repeat):
        for mode in ("off", "on"):  # alternating: background load hits both alike
            one = put_run(os.path.join(base, f"{mode}{r}"), mode == "on", args.ops,
                          args.clients, args.value_size)
            runs[mode].append(one)
            print(f"[{r + 1}/{args.repeat}] tokens {mode:>3}: {one['ops_s']:7,.0f} PUTs/s, "
                  f"leader CPU {one['leader_cpu_us_per_op']:6.0f} us/PUT, "
                  f"{one['errors']} errors", flush=True)
    for mode, samples in runs.items():
        doc[mode] = {k: statistics.median(s[k] for s in samples)
                     for k in ("ops_s", "leader_cpu_us_per_op")}
        doc[mode]["samples"] = samples
    off, on = doc["off"], doc["on"]
    print(f"median: tokens off {off['ops_s']:,.0f} PUTs/s, {off['leader_cpu_us_per_op']:.0f} "
          f"us CPU/PUT; on {on['ops_s']:,.0f} PUTs/s, {on['leader_cpu_us_per_op']:.0f} us "
          f"CPU/PUT; throughput ratio on/off {on['ops_s'] / off['ops_s']:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
