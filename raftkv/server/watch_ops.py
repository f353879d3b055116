"""Watch: the changes to a key range, read from the Raft log (``GET /v1/watch``).

The Raft log is already the ordered, checksummed history of every write, so a watch is a
read of it, not a second copy. From ``from_revision`` R (a log index) on, each applied
entry whose command writes a key in the range becomes one *revision line* of the stream::

    {"revision": R, "events": [{"type": "put", "key": b64, "value": b64}
                               | {"type": "delete", "key": b64}, ...]}

A line holds every event of its entry (a batch or a transaction writes several keys at one
revision), so a line is the unit a watcher resumes after: having read revision R whole, it
asks again from R + 1, on any node, and gets exactly the rest, without a gap or a
duplicate. Every replica holds the same committed entries, and the outcome of a
conditional one (whether a compare-and-set or a transaction's compares held) is recorded
by its apply (``StateStore.outcome``), deterministically, so every node derives the same
events. A delete is an event whether or not the key existed (the log says a delete was
written; etcd leaves out deletes of absent keys). A lease's expiry (or revoke) is a
delete event for each key it removed. While nothing new is applied, a
progress line ``{"progress": A}`` (A: the node's applied index) comes about every
``PROGRESS_SECONDS``: every change up to A has been sent, so a watcher may resume from
A + 1. The stream opens with one (``from_revision - 1``), so a watcher always knows where
it stands.

The log is compacted up to the last checkpoint, keeping a tail (``CompactionPolicy``), so
history is finite: a ``from_revision`` below the oldest entry this node still holds answers
410 ``{"error", "oldest_revision"}``, as etcd's "required revision has been compacted"
does. The watcher then reads the range (``GET /v1/kv?prefix=``, which says the revision it
read at) and watches from that revision + 1. A ``from_revision`` up to one past the
group's commit index waits for it; one further in the future is a 400 (a revision from
another cluster, or a typo), after ``FUTURE_WAIT_SECONDS`` for a lagging follower to learn
the commit index. Without ``from_revision`` the watch starts after the node's applied
index (only new changes).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from aiohttp import web

from raftkv.node.driver import Node
from raftkv.server.auth import still_allowed
from raftkv.server.range_ops import key_range
from raftkv.server.requests import check_query, error, query_bytes, quoted, wait
from raftkv.storage.commands import (
    Batch,
    Cas,
    CasIndex,
    CommandError,
    Delete,
    LeaseRevoke,
    Put,
    PutLease,
    decode,
    split_put,
    user_key,
)
from raftkv.storage.errors import Compacted
from raftkv.storage.state_store import KVStateStore
from raftkv.storage.txn import Kind, Txn

PROGRESS_SECONDS = 2.0
POLL_SECONDS = 0.02
BATCH_ENTRIES = 1_000
# ... and about this many bytes of them: the read runs on the Raft loop, and 1,000 of a
# bulk load's 4 MiB entries would hold it for seconds.
BATCH_BYTES = 4 << 20
FUTURE_WAIT_SECONDS = 2.0


class HistoryCompacted(Exception):
    def __init__(self, oldest: int) -> None:
        super().__init__(f"revisions below {oldest} have been compacted")
        self.oldest = oldest


@dataclass(frozen=True)
class WatchRequest:
    start: bytes
    end: bytes | None
    from_revision: int | None


def parse_watch(request: web.Request) -> WatchRequest:
    check_query(request, ("prefix", "start", "end", "from_revision"))
    start, end = key_range(request, "a watch")
    raw = query_bytes(request, "from_revision")
    rev = None
    if raw is not None:
        text = raw.decode("ascii", "replace")
        if not text.isdigit() or len(text) > 18 or int(text) < 1:
            raise CommandError(f"?from_revision is a revision (a log index from 1), not "
                               f"{quoted(text)}")
        rev = int(text)
    return WatchRequest(start, end, rev)


def _writes(data: bytes, outcome: Callable[[], bool | list[bytes]]
            ) -> Iterator[tuple[bytes, bytes | None]]:
    """The ``(key, value | None)`` writes of one entry's command; ``outcome()`` says
    whether a conditional one wrote, or which keys a lease revoke deleted (asked only
    for those)."""
    kv = split_put(data)
    if kv is not None:
        yield kv
        return
    try:
        cmd = decode(data)
    except CommandError:
        return  # skipped by every replica: no write
    if isinstance(cmd, Put):
        yield cmd.key, cmd.value
    elif isinstance(cmd, Delete):
        yield cmd.key, None
    elif isinstance(cmd, Cas | CasIndex):
        if outcome():
            yield cmd.key, cmd.new
    elif isinstance(cmd, Batch):
        if cmd.id is None or outcome():
            yield from cmd.ops
    elif isinstance(cmd, Txn):
        for op in (cmd.success if outcome() else cmd.failure):
            if op.kind is not Kind.GET:
                yield op.key, op.value if op.kind is Kind.PUT else None
    elif isinstance(cmd, PutLease):
        if outcome():
            yield cmd.key, cmd.value
    elif isinstance(cmd, LeaseRevoke):
        deleted = outcome()
        if isinstance(deleted, list):
            for key in deleted:
                yield key, None


def read_log(node: Node, group: str, req: WatchRequest, frm: int,
             limit: int = BATCH_ENTRIES) -> tuple[int, list[dict[str, Any]]]:
    """On the loop thread: the revision lines of ``[frm, frm + limit)`` up to the applied
    index, and the applied index. Raises ``HistoryCompacted``."""
    g = node.groups[group]
    # The default group's and a partition's state stores are KV stores (read_kv's rule).
    state, log = cast(KVStateStore, g.state), g.storage.log
    applied = state.applied_index()
    oldest = max(log.first_index(), state.outcomes_from())
    if frm < oldest:
        raise HistoryCompacted(oldest)
    hi = min(applied, log.last_index(), frm + limit - 1)
    if frm > hi:
        return applied, []
    try:
        rows = log.payloads(frm, hi + 1, BATCH_BYTES)
    except Compacted as e:  # not expected on the loop thread, which compacts
        raise HistoryCompacted(max(e.first_index, oldest)) from e
    hi = rows[-1][0]  # the budget may have ended the read early
    lines = []
    b64 = base64.b64encode
    lo_key, hi_key = req.start, req.end
    for index, data in rows:
        if not data:
            continue
        events = []
        for key, value in _writes(data, partial(_outcome_of, state, index)):
            if key < lo_key or (hi_key is not None and key >= hi_key) or not user_key(key):
                continue
            if value is None:
                events.append({"type": "delete", "key": b64(key).decode()})
            else:
                events.append({"type": "put", "key": b64(key).decode(),
                               "value": b64(value).decode()})
        if events:
            lines.append({"revision": index, "events": events})
    return hi, lines


def _outcome_of(state: KVStateStore, index: int) -> bool | list[bytes]:
    outcome = state.outcome(index)
    if outcome is None:  # outcomes_from() said it is kept: a store that lost it
        raise HistoryCompacted(index + 1)
    return outcome


def _applied_hint(node: Node, group: str) -> int:
    """The group's applied index, read off the loop thread: an int the loop only ever
    raises, good enough to tell "nothing new" (any doubt reads the log)."""
    g = node.groups.get(group)
    try:
        return g.state.applied_index() if g is not None else 1 << 62
    except Exception:  # noqa: BLE001 - a closed store: let the real read say so
        return 1 << 62


async def serve_watch(node: Node, group: str, req: WatchRequest,
                      request: web.Request) -> web.StreamResponse:
    """Stream the watch (module docstring) until the client goes away."""
    def applied_and_commit() -> tuple[int, int]:
        g = node.groups[group]
        return g.state.applied_index(), g.raft.log.committed

    applied, commit = await wait(node.call(applied_and_commit))
    frm = req.from_revision if req.from_revision is not None else applied + 1
    deadline = time.monotonic() + FUTURE_WAIT_SECONDS
    while frm > commit + 1 and time.monotonic() < deadline:
        # A lagging follower may not know yet what the watcher saw on another node.
        await asyncio.sleep(POLL_SECONDS)
        applied, commit = await wait(node.call(applied_and_commit))
    if frm > commit + 1:
        return error(400, f"from_revision {frm} is in the future: this group's commit "
                          f"index is {commit} (watch from at most {commit + 1})",
                     commit_revision=commit)
    try:  # a first read before answering, so a compacted revision gets a plain 410
        upto, lines = await wait(node.call(lambda: read_log(node, group, req, frm)))
    except HistoryCompacted as e:
        return error(410, str(e), oldest_revision=e.oldest)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    # Where the stream starts: a watcher that loses it at once resumes from here.
    await resp.write(json.dumps({"progress": frm - 1}).encode() + b"\n")
    last_progress = last_check = time.monotonic()
    while True:
        for line in lines:
            await resp.write(json.dumps(line).encode() + b"\n")
        if lines:
            last_progress = time.monotonic()
        frm = max(frm, upto + 1)
        if time.monotonic() - last_check >= PROGRESS_SECONDS:
            last_check = time.monotonic()
            if not still_allowed(request):  # a token revoked (SIGHUP) ends what it opened
                await resp.write(json.dumps({
                    "error": "the token this watch was opened with was revoked",
                    "status": 401}).encode() + b"\n")
                return resp
        if not lines:
            if time.monotonic() - last_progress >= PROGRESS_SECONDS:
                await resp.write(json.dumps({"progress": frm - 1}).encode() + b"\n")
                last_progress = time.monotonic()
            await asyncio.sleep(POLL_SECONDS)
            if _applied_hint(node, group) < frm:
                upto, lines = frm - 1, []
                continue  # nothing new: no need to wake the Raft loop
        try:
            upto, lines = await wait(node.call(partial(read_log, node, group, req, frm)))
        except HistoryCompacted as e:  # fell behind compaction while streaming
            await resp.write(json.dumps({"error": str(e),
                                         "oldest_revision": e.oldest}).encode() + b"\n")
            return resp
