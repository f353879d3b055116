"""A writer for the SIGKILL test: recover, then log and apply commands until killed.

Each entry i is ``cas(b"last", i-1, i)`` (a chain: a skipped or reordered entry breaks
it for good), and every fifth entry also puts ``k<i % 97>``. After each log batch is
durable (one fsync) it prints ``durable <last index>``; the parent kills it at random.
"""

from __future__ import annotations

import random
import sys
import time

from recovery.local import replay
from storage.commands import encode_batch, encode_cas
from storage.lmdb_log import LmdbLogStore
from storage.lmdb_state import LmdbStateStore
from storage.records import Entry, HardState


def command(i: int) -> bytes:
    if i % 5:
        return encode_cas(b"last", b"%d" % (i - 1) if i > 1 else None, b"%d" % i)
    return encode_batch([(b"k%02d" % (i % 97), b"v%d" % i), (b"last", b"%d" % i)])


def main(directory: str, seed: int) -> None:
    raft_log = LmdbLogStore(f"{directory}/log")
    state = LmdbStateStore(f"{directory}/state", checkpoint_entries=300,
                           checkpoint_seconds=0.05)
    report = replay(raft_log, state)
    print(f"recovered {report.replayed} {state.applied_index()}", flush=True)
    rng = random.Random(seed)
    i = raft_log.last_index() + 1
    while True:
        batch = [Entry(1, j, 0, command(j)) for j in range(i, i + rng.randint(1, 64))]
        raft_log.save(HardState(1, None, batch[-1].index), batch)
        print(f"durable {batch[-1].index}", flush=True)
        state.apply([(e.index, e.data) for e in batch])
        state.maybe_checkpoint(time.monotonic())
        i = batch[-1].index + 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
