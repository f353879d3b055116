"""One PySyncObj program, run on PySyncObj 0.3.17 or on ``raftkv.compat.pysyncobj``.

Run by ``benchmarks.compat_pysyncobj`` in fresh subprocesses::

    python -m benchmarks._compat_peer IMPL MODE DIR N VALUE_SIZE WINDOW SELF [PARTNER...]

IMPL is ``pysyncobj`` or ``compat``: the only difference is where ``SyncObj``,
``SyncObjConf`` and ``ReplDict`` are imported from (``load``). The program is a
``SyncObj`` with a ``ReplDict`` consumer and ``SyncObjConf(journalFile=DIR/journal,
fullDumpFile=DIR/dump)``, everything else at PySyncObj's defaults (autoTick on, no
password: the compat layer then uses its public development secret and says so).

MODE:

- ``write``: a member of a cluster that drives the load once a leader is known: N
  ``ReplDict.set(key, value, callback=)`` calls (asynchronous), at most WINDOW
  outstanding, and prints one JSON line (ops/s over the time from the first call to the
  last callback, failures by code). ``serve``: the other members, until stdin closes.
- ``fill``: a single node (no partners) loads N keys the same way, waits 1.5 s (PySyncObj
  stores its commit index on a one-second timer) and until no full dump is being
  written (``dump.tmp``, see ``DUMP_SETTLE_S``), destroys the node and prints JSON.
- ``restart``: a single node restarts from DIR; the time from just before the
  constructor until the dict holds N keys and the last one reads back. If no key is
  applied for ``STALL_S`` seconds before that, it reports ``restart_s: null``, the
  number of keys that came back and when the last of them did (``partial_s``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


def load(impl: str) -> tuple[Any, Any, Any]:
    if impl == "pysyncobj":
        from pysyncobj import SyncObj, SyncObjConf
        from pysyncobj.batteries import ReplDict
    elif impl == "compat":
        from raftkv.compat.pysyncobj import SyncObj, SyncObjConf  # type: ignore[assignment]
        from raftkv.compat.pysyncobj.batteries import ReplDict  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown implementation {impl!r}")
    return SyncObj, SyncObjConf, ReplDict


STALL_S = 30.0  # restart: give up when no key was applied for this long
# fill: PySyncObj writes its full dump in a forked child (``dump.tmp``, then renamed) and
# truncates its journal only once the parent sees the child succeed. A node destroyed
# in between leaves a dump newer than its journal's start, and its restart then drops
# the journal after the dump: twice at 1,000,000 keys, a restart brought back 952,813 and
# 939,134 keys, with PySyncObj's warning "raftCommitIndex (1000002) exceeds journal end
# (939136) after loading dump". The fill waits until no dump has been in progress for
# this long, so that the restart measures a restart.
DUMP_SETTLE_S = 2.0


def key(i: int) -> str:
    return f"k{i:08d}"


def value(i: int, size: int) -> str:
    return (f"v{i:08d}" + "x" * size)[:size]


def start(impl: str, directory: str, me: str, partners: list[str]) -> tuple[Any, Any]:
    sync_obj, conf_cls, repl_dict = load(impl)
    d = repl_dict()
    conf = conf_cls(journalFile=os.path.join(directory, "journal"),
                    fullDumpFile=os.path.join(directory, "dump"))
    return sync_obj(me, partners, conf, consumers=[d]), d


def drive(d: Any, n: int, size: int, window: int) -> dict[str, Any]:
    slots = threading.Semaphore(window)
    done = threading.Event()
    failures: dict[int, int] = {}
    count = [0]
    lock = threading.Lock()

    def callback(_result: Any, error: int) -> None:
        with lock:
            if error != 0:
                failures[error] = failures.get(error, 0) + 1
            count[0] += 1
            if count[0] == n:
                done.set()
        slots.release()

    t0 = time.perf_counter()
    for i in range(1, n + 1):
        slots.acquire()
        d.set(key(i), value(i, size), callback=callback)
    done.wait()
    seconds = time.perf_counter() - t0
    ok = n - sum(failures.values())
    return {"ops": n, "ok": ok, "seconds": seconds, "ops_s": ok / seconds,
            "failures": failures}


def wait_leader(node: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while node._getLeader() is None:
        if time.monotonic() > deadline:
            raise SystemExit("no leader")
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    impl, mode, directory, n, size, window, me, *partners = argv
    os.makedirs(directory, exist_ok=True)
    if mode in ("write", "serve"):
        node, d = start(impl, directory, me, partners)
        print(json.dumps({"started": me}), flush=True)
        if mode == "write":
            wait_leader(node)
            time.sleep(0.5)  # every member connected
            out = drive(d, int(n), int(size), int(window))
            print(json.dumps(out), flush=True)
        else:
            sys.stdin.read()
        node.destroy()
    elif mode == "fill":
        node, d = start(impl, directory, me, [])
        wait_leader(node)
        out = drive(d, int(n), int(size), int(window))
        time.sleep(1.5)
        settled = time.monotonic()
        while time.monotonic() - settled < DUMP_SETTLE_S:
            if os.path.exists(os.path.join(directory, "dump.tmp")):
                settled = time.monotonic()
            time.sleep(0.05)
        out["keys"] = len(d)
        node.destroy()
        print(json.dumps(out), flush=True)
    elif mode == "restart":
        load(impl)  # the imports are the process's, not the node's restart: not timed
        t0 = time.perf_counter()
        node, d = start(impl, directory, me, [])
        t_open = time.perf_counter()
        last, want = key(int(n)), value(int(n), int(size))
        seen, since, t_seen = -1, time.monotonic(), time.perf_counter()
        while len(d) < int(n) or d.get(last) != want:
            if len(d) != seen:
                seen, since, t_seen = len(d), time.monotonic(), time.perf_counter()
            elif time.monotonic() - since > STALL_S:
                # Nothing applied for STALL_S seconds: report what came back, and say so.
                print(json.dumps({"restart_s": None, "partial_s": t_seen - t0,
                                  "open_s": t_open - t0, "keys": len(d),
                                  "stalled_s": STALL_S}), flush=True)
                node.destroy()
                return 0
            time.sleep(0.001)
        t1 = time.perf_counter()
        print(json.dumps({"restart_s": t1 - t0, "open_s": t_open - t0, "keys": len(d)}),
              flush=True)
        node.destroy()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
