"""ReadIndex bookkeeping (Raft dissertation §6.4).

A linearizable read must not be served by a deposed leader. The leader records its
commit index as the read index, then proves it is still leader by getting a heartbeat
acknowledgement for that read's context from a majority of voters. An acknowledgement
of a later context also proves every earlier one (the heartbeats are answered in order
of leadership), so confirming one context releases all requests queued before it.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ReadRequest(NamedTuple):
    index: int
    frm: str  # who asked: the leader itself, or the follower that forwarded it
    context: Any
    acks: set[str]


class ReadOnly:
    __slots__ = ("_pending", "_queue")

    def __init__(self) -> None:
        self._pending: dict[Any, ReadRequest] = {}
        self._queue: list[Any] = []

    def add(self, context: Any, index: int, frm: str) -> bool:
        if context in self._pending:
            return False
        self._pending[context] = ReadRequest(index, frm, context, set())
        self._queue.append(context)
        return True

    def ack(self, context: Any, frm: str) -> set[str] | None:
        req = self._pending.get(context)
        if req is None:
            return None
        req.acks.add(frm)
        return req.acks

    def release_through(self, context: Any) -> list[ReadRequest]:
        """Pop every request queued up to and including ``context``."""
        if context not in self._pending:
            return []
        out = []
        while self._queue:
            ctx = self._queue.pop(0)
            out.append(self._pending.pop(ctx))
            if ctx == context:
                break
        return out

    def last_context(self) -> Any:
        return self._queue[-1] if self._queue else None

    def __len__(self) -> int:
        return len(self._queue)
