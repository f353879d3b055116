"""The PySyncObj side of ``benchmarks.recovery``: fill a journal, then restart from it.

Run by ``benchmarks.recovery`` in fresh subprocesses; each prints one JSON line on stdout::

    python -m benchmarks._pysyncobj_peer fill    JOURNAL PORT N VALUE_SIZE MAX_FILL_S
    python -m benchmarks._pysyncobj_peer restart JOURNAL PORT N VALUE_SIZE SPAWN_TIME

The node is a single-member ``SyncObj`` (bound to 127.0.0.1:PORT, no other nodes) with a
``ReplDict`` consumer and a ``FileJournal`` (``journalFile``), configured so that it can
only come back by replaying its journal:

- no ``fullDumpFile``, and log compaction pushed out of reach (``logCompactionMinEntries``
  and ``logCompactionMinTime`` huge): with no dump file PySyncObj "compacts" into memory
  and drops the journal prefix, which would leave nothing to replay;
- ``autoTick=False``: the benchmark calls ``doTick()`` itself, so no tick thread competes
  for the GIL and the restart is measured on one thread, as raftkv's is;
- ``appendEntriesUseBatch=True`` (the default), ``dynamicMembershipChange=False``.

**fill** waits until the node has elected itself, then issues ``set(key, value)`` for
keys ``k00000001..`` with ``sync=False`` (no callback, so nothing waits per command),
keeping at most ``WINDOW`` commands queued (under ``commandsQueueSize``, otherwise
PySyncObj drops them with QUEUE_FULL) and ticking until every one is applied. It stops
issuing new commands after ``MAX_FILL_S`` seconds, and reports how many it filled. Then it
ticks for another ~1.2 s: FileJournal stores the commit index in ``JOURNAL.meta`` only on
its one-second timer, and a restart applies the journal up to that commit index without
waiting for an election.

**restart** measures from just before ``SyncObj(...)`` is constructed (which reads the
whole journal into memory) until the ``ReplDict`` holds all N keys (``doTick`` applies the
journal from index 1 up to the stored commit index) and a read of the last key returns
its value.

Note that FileJournal writes through ``mmap`` and never fsyncs an entry, so PySyncObj's
journal is not durable per entry the way raftkv's Raft log is (one fsync per batch).
"""

from __future__ import annotations

import json
import sys
import time

from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.batteries import ReplDict

WINDOW = 50_000  # commands in flight; PySyncObj's commandsQueueSize defaults to 100,000


def key(i: int) -> bytes:
    return b"k%08d" % i


def value(i: int, size: int) -> bytes:
    head = b"v%08d" % i
    return (head + b"x" * size)[:size]


def conf(journal: str) -> SyncObjConf:
    return SyncObjConf(
        journalFile=journal,
        autoTick=False,
        appendEntriesUseBatch=True,
        dynamicMembershipChange=False,
        fullDumpFile=None,
        logCompactionMinEntries=1 << 62,
        logCompactionMinTime=1e12,
        commandsQueueSize=2 * WINDOW,
    )


def fill(journal: str, port: int, n: int, value_size: int, max_fill_s: float) -> dict[str, object]:
    d = ReplDict()
    node = SyncObj(f"127.0.0.1:{port}", [], conf(journal), consumers=[d])
    t_elect = time.perf_counter()
    while not node._isLeader():
        node.doTick(0.01)
    elect_s = time.perf_counter() - t_elect
    t0 = time.perf_counter()
    deadline = t0 + max_fill_s
    issued = 0
    target = n
    while len(d) < target:
        while issued < target and issued - len(d) < WINDOW:
            issued += 1
            d.set(key(issued), value(issued, value_size))
        node.doTick(0)
        if issued < target and time.perf_counter() > deadline:
            target = issued  # out of time: finish what is in flight, issue nothing more
    fill_s = time.perf_counter() - t0
    # Let FileJournal's one-second timer store the commit index in JOURNAL.meta.
    t_flush = time.perf_counter()
    while time.perf_counter() - t_flush < 1.2:
        node.doTick(0.05)
    result = {
        "entries": len(d),
        "fill_s": fill_s,
        "fill_rate": len(d) / fill_s,
        "elect_s": elect_s,
        "commit_index": node.raftCommitIndex,
        "last_applied": node.raftLastApplied,
        "truncated_by_deadline": target < n,
    }
    node.destroy()  # autoTick=False: closes the transport and flushes the journal's mmap
    return result


def restart(journal: str, port: int, n: int, value_size: int, spawn: float) -> dict[str, object]:
    d = ReplDict()
    t0 = time.perf_counter()
    node = SyncObj(f"127.0.0.1:{port}", [], conf(journal), consumers=[d])
    t_open = time.perf_counter()
    while len(d) < n:
        node.doTick(0)
    ok = d.get(key(n)) == value(n, value_size)
    t1 = time.perf_counter()
    wall = time.time()
    result = {
        "restart_s": t1 - t0,
        "open_s": t_open - t0,  # constructor: reads the whole journal into a list
        "apply_s": t1 - t_open,
        "keys": len(d),
        "last_applied": node.raftLastApplied,
        "read_ok": ok,
        "spawn_to_serving_s": wall - spawn,
    }
    node.destroy()
    return result


def main(argv: list[str]) -> int:
    cmd, journal, port, n, value_size, extra = argv
    if cmd == "fill":
        out = fill(journal, int(port), int(n), int(value_size), float(extra))
    elif cmd == "restart":
        out = restart(journal, int(port), int(n), int(value_size), float(extra))
    else:
        raise SystemExit(f"unknown command {cmd!r} (fill or restart)")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
