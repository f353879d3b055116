"""Majority arithmetic over the voter set. Learners never appear here.

Kept apart, and tiny, so a test can check it against a deliberately dumb
implementation over many random cases (etcd's quorum test habit).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def majority(n_voters: int) -> int:
    return n_voters // 2 + 1


def committed_index(voters: Collection[str], match: Mapping[str, int]) -> int:
    """The highest index stored on a majority of ``voters`` (0 for missing voters)."""
    if not voters:
        return 0
    acked = sorted((match.get(v, 0) for v in voters), reverse=True)
    return acked[majority(len(voters)) - 1]


def vote_result(voters: Collection[str], votes: Mapping[str, bool]) -> bool | None:
    """True if a majority of ``voters`` granted, False if a majority refused, None if pending.

    Votes from non-voters (learners, removed nodes) are ignored.
    """
    need = majority(len(voters))
    granted = sum(1 for v in voters if votes.get(v) is True)
    rejected = sum(1 for v in voters if votes.get(v) is False)
    if granted >= need:
        return True
    if rejected > len(voters) - need:
        return False
    return None


def has_quorum(voters: Collection[str], acked: Collection[str]) -> bool:
    return sum(1 for v in voters if v in acked) >= majority(len(voters))
