"""A writer for the SIGKILL test: recover, then log and apply commands until killed.

Each entry i is ``cas(b"last", i-1, i)`` (a chain: a skipped or reordered entry breaks
it for good), and every fifth entry also puts ``k<i % 97>``. It writes as a leader's
driver does: a batch is saved with the commit index as it stood (one fsync), then it
prints ``durable <last index> <commit saved with it>``; the batch's own commit is saved
without a sync (``sync=False``, only the commit moved), and then it is applied. The
state store checkpoints in the background, its sync on another thread while applies go
on, as the driver's do. The parent kills it at random.

Restarting, it is a single-node group's new leader: the first commit of its term covers
its whole log, so after replay it commits and applies the rest of the log.
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

from raftkv.recovery.local import replay
from raftkv.storage.commands import encode_batch, encode_cas
from raftkv.storage.lmdb_log import LmdbLogStore
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.records import Entry, HardState


def command(i: int) -> bytes:
    if i % 5:
        return encode_cas(b"last", b"%d" % (i - 1) if i > 1 else None, b"%d" % i)
    return encode_batch([(b"k%02d" % (i % 97), b"v%d" % i), (b"last", b"%d" % i)])


def main(directory: str, seed: int) -> None:
    raft_log = LmdbLogStore(f"{directory}/log")
    state = LmdbStateStore(f"{directory}/state", checkpoint_entries=300,
                           checkpoint_seconds=0.05)
    report = replay(raft_log, state)
    last = raft_log.last_index()
    if state.applied_index() < last:
        raft_log.save(HardState(1, None, last), [], sync=False)
        state.apply(raft_log.payloads(state.applied_index() + 1, last + 1))
    print(f"recovered {report.replayed} {state.applied_index()}", flush=True)
    rng = random.Random(seed)
    i = last + 1
    syncing: Future[int] | None = None
    with ThreadPoolExecutor(1) as pool:
        while True:
            batch = [Entry(1, j, 0, command(j)) for j in range(i, i + rng.randint(1, 64))]
            commit = state.applied_index()
            raft_log.save(HardState(1, None, commit), batch)
            print(f"durable {batch[-1].index} {commit}", flush=True)
            raft_log.save(HardState(1, None, batch[-1].index), [], sync=False)
            state.apply([(e.index, e.data) for e in batch])
            if syncing is not None and syncing.done():
                state.checkpointed(syncing.result())
                syncing = None
            if syncing is None and state.checkpoint_due(time.monotonic()):
                job = state.background_checkpoint()
                if job is not None:
                    syncing = pool.submit(job)
            i = batch[-1].index + 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
