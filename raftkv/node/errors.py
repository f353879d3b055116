"""Errors the node hands to callers (on futures), beyond the core's own."""

from __future__ import annotations

from raftkv.core.errors import RaftError


class NodeError(RaftError):
    pass


class RequestTimeout(NodeError):
    """No outcome within the deadline. A write may still commit later: retry with CAS or
    an idempotent command if that matters."""


class NodeStopped(NodeError):
    pass


class UnknownGroup(NodeError):
    pass


class ReplicaEmpty(NodeError):
    """A stale read of a replica that started empty (an in-memory partition after its
    node restarted, a new learner) and has not yet reached what the first leader it heard
    from had committed: until then it holds no state of its group's history, so "absent"
    would be a wrong answer, not a stale one."""


class RemoteError(NodeError):
    """The leader refused a forwarded command; ``kind`` names the leader-side error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
