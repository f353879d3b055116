"""One-by-one membership change (Raft dissertation ch. 4; Kudu's configuration-change design).

A change is exactly one of: add a PRE_FOLLOWER (learner), promote a learner to voter,
demote a voter to learner, or remove a member. One-by-one changes are safe because any
majority of the old voter set and any majority of the new one overlap; that is what lets
a configuration take effect the moment it is *appended* (§4.1) rather than committed.
The price is that at most one change may be uncommitted at a time, and that a new leader
must first commit an entry of its own term before changing anything (the known fix for
the single-server-change bug).

Config entries carry the full resulting ``ConfState`` as well as the change, so a store
can hand back the membership at any index without replaying change logic, and a
truncated entry is rolled back simply by forgetting it.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import msgpack

from raftkv.core.errors import ConfChangeRejected
from storage.records import ConfState

# A membership record lists node ids; nothing legitimate comes near this size.
MAX_CONF_BYTES = 1 << 20


class ConfChangeOp(IntEnum):
    # Written into the log: never renumber, only append.
    ADD_LEARNER = 0
    PROMOTE = 1
    DEMOTE = 2
    REMOVE = 3


class ConfChange(NamedTuple):
    op: ConfChangeOp
    node: str
    # Opaque to Raft: the driver stores a member's address here.
    context: bytes = b""
    # For ADD_LEARNER: should the leader promote the learner once it has caught up?
    auto_promote: bool = True

    def describe(self) -> str:
        return f"{self.op.name.lower()} {self.node}"


def apply_change(conf: ConfState, cc: ConfChange) -> ConfState:
    """The configuration after ``cc``, or ``ConfChangeRejected`` saying why not."""
    voters, learners, auto = set(conf.voters), set(conf.learners), set(conf.auto_promote)
    node = cc.node
    if cc.op == ConfChangeOp.ADD_LEARNER:
        if node in voters or node in learners:
            raise ConfChangeRejected(f"{node} is already a member")
        learners.add(node)
        if cc.auto_promote:
            auto.add(node)
    elif cc.op == ConfChangeOp.PROMOTE:
        if node not in learners:
            raise ConfChangeRejected(f"{node} is not a learner, so it cannot be promoted")
        learners.discard(node)
        auto.discard(node)
        voters.add(node)
    elif cc.op == ConfChangeOp.DEMOTE:
        if node not in voters:
            raise ConfChangeRejected(f"{node} is not a voter, so it cannot be demoted")
        if len(voters) == 1:
            raise ConfChangeRejected(f"{node} is the last voter")
        voters.discard(node)
        learners.add(node)
    elif cc.op == ConfChangeOp.REMOVE:
        if node not in voters and node not in learners:
            raise ConfChangeRejected(f"{node} is not a member")
        if node in voters and len(voters) == 1:
            raise ConfChangeRejected(f"{node} is the last voter")
        voters.discard(node)
        learners.discard(node)
        auto.discard(node)
    else:  # pragma: no cover - the enum is closed
        raise ConfChangeRejected(f"unknown change {cc.op!r}")
    return ConfState(frozenset(voters), frozenset(learners), frozenset(auto))


def _change_fields(cc: ConfChange) -> list:
    return [int(cc.op), cc.node, cc.context, cc.auto_promote]


def encode_change(cc: ConfChange) -> bytes:
    return msgpack.packb(_change_fields(cc), use_bin_type=True)


def _unpack(data: object) -> object:
    if not isinstance(data, bytes) or len(data) > MAX_CONF_BYTES:
        raise ValueError("malformed membership record: not bytes, or too large")
    try:
        return msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as e:  # msgpack errors, bad UTF-8, unhashable keys
        raise ValueError(f"malformed membership record: {e}") from None


def _change(fields: object) -> ConfChange:
    if not (isinstance(fields, list) and len(fields) == 4):
        raise ValueError("malformed membership change: expected [op, node, context, auto]")
    op, node, context, auto_promote = fields
    if (
        not isinstance(op, int) or op not in ConfChangeOp._value2member_map_
        or not isinstance(node, str) or not node
        or not isinstance(context, bytes) or not isinstance(auto_promote, bool)
    ):
        raise ValueError(f"malformed membership change: {fields!r:.200}")
    return ConfChange(ConfChangeOp(op), node, context, auto_promote)


def _members(names: object) -> frozenset[str]:
    if not (isinstance(names, list) and all(isinstance(n, str) and n for n in names)):
        raise ValueError("malformed membership record: member lists must hold node ids")
    return frozenset(names)


def decode_change(data: object) -> ConfChange:
    """Raises ValueError, and only ValueError, on anything malformed (peer input)."""
    return _change(_unpack(data))


def encode_conf_entry(cc: ConfChange | None, conf: ConfState) -> bytes:
    """The data of a CONF_CHANGE entry: the change (None for the bootstrap
    configuration) and the configuration it produces."""
    return msgpack.packb(
        [
            _change_fields(cc) if cc is not None else None,
            sorted(conf.voters), sorted(conf.learners), sorted(conf.auto_promote),
        ],
        use_bin_type=True,
    )


def decode_conf_entry(data: object) -> tuple[ConfChange | None, ConfState]:
    """Raises ValueError, and only ValueError, on anything malformed (peer input)."""
    fields = _unpack(data)
    if not (isinstance(fields, list) and len(fields) == 4):
        raise ValueError("malformed configuration entry: expected [change, voters, learners, auto]")
    change, voters, learners, auto = fields
    cc = None if change is None else _change(change)
    return cc, ConfState(_members(voters), _members(learners), _members(auto))
