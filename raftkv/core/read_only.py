"""ReadIndex bookkeeping (Raft dissertation §6.4).

A linearizable read must not be served by a deposed leader. The leader records its
commit index as the read index, then proves it is still leader by getting a heartbeat
acknowledgement for that read from a majority of voters. An acknowledgement of a later
read also proves every earlier one (the heartbeats are answered in order of
leadership), so confirming one read releases all requests queued before it.

Requests are keyed by a leader-local sequence number, not by the caller's context:
two nodes may forward reads with equal contexts, and each must get its own answer at
its own read index.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ReadRequest(NamedTuple):
    index: int  # type: ignore[assignment]  # shadows tuple.index, as in Entry
    frm: str  # who asked: the leader itself, or the follower that forwarded it
    context: Any  # the caller's context, echoed back in its ReadState
    acks: set[str]


class ReadOnly:
    __slots__ = ("_pending", "_seq")

    def __init__(self) -> None:
        # Insertion order is request order, which release_through relies on.
        self._pending: dict[int, ReadRequest] = {}
        self._seq = 0

    def add(self, context: Any, index: int, frm: str) -> int:
        """Queue a read; returns the sequence number its heartbeats carry."""
        self._seq += 1
        self._pending[self._seq] = ReadRequest(index, frm, context, set())
        return self._seq

    def ack(self, seq: Any, frm: str) -> set[str] | None:
        req = self._pending.get(seq)
        if req is None:
            return None
        req.acks.add(frm)
        return req.acks

    def release_through(self, seq: int) -> list[ReadRequest]:
        """Pop every request queued up to and including ``seq``."""
        out = []
        for s in [s for s in self._pending if s <= seq]:
            out.append(self._pending.pop(s))
        return out

    def last_seq(self) -> int | None:
        return self._seq if self._seq in self._pending else None

    def __len__(self) -> int:
        return len(self._pending)
