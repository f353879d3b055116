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

Two changes concern a member's *incarnation* (the identity of its storage, see
``raftkv.core.raft``, "Incarnations") rather than who votes:

- ``RECORD``: note which incarnation of a member the group counts on. It changes no
  voter set, so it cannot break quorum overlap.
- ``READMIT``: a member came back with a different incarnation (its files were wiped,
  or it runs in memory and restarted). A voter becomes an automatically promoted
  learner, recorded under its new incarnation: a demotion, so as safe as ``DEMOTE``.
  A learner is just recorded anew.

Both carry the incarnation in ``context`` (decimal ASCII).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import msgpack

from raftkv.core.errors import ConfChangeRejected
from raftkv.storage.records import ConfState

# A membership record lists node ids; nothing legitimate comes near this size.
MAX_CONF_BYTES = 1 << 20


class ConfChangeOp(IntEnum):
    # Written into the log: never renumber, only append.
    ADD_LEARNER = 0
    PROMOTE = 1
    DEMOTE = 2
    REMOVE = 3
    RECORD = 4
    READMIT = 5


class ConfChange(NamedTuple):
    op: ConfChangeOp
    node: str
    # Opaque to Raft: the driver stores a member's address here.
    context: bytes = b""
    # For ADD_LEARNER: should the leader promote the learner once it has caught up?
    auto_promote: bool = True

    def describe(self) -> str:
        if self.op == ConfChangeOp.RECORD and not self.context:
            return f"record the voters of {self.node}'s election"  # a leader's first entry
        if self.op in (ConfChangeOp.RECORD, ConfChangeOp.READMIT):
            inc = self.context.decode("ascii", "replace")
            return f"{self.op.name.lower()} {self.node} as incarnation {inc}"
        return f"{self.op.name.lower()} {self.node}"

    def incarnation(self) -> int:
        """The incarnation a RECORD or READMIT names; ValueError if the context is not one."""
        ctx = self.context
        if not (ctx.isdigit() and 0 < len(ctx) <= 20):
            raise ValueError(f"{self.op.name.lower()} {self.node} carries no incarnation")
        return int(ctx)

    @classmethod
    def identity(cls, op: ConfChangeOp, node: str, incarnation: int) -> ConfChange:
        """A RECORD or READMIT of ``node`` as ``incarnation``."""
        return cls(op, node, str(incarnation).encode(), auto_promote=False)


def _with_record(records: frozenset[tuple[str, int]], node: str,
                 inc: int | None) -> frozenset[tuple[str, int]]:
    kept = {(n, i) for n, i in records if n != node}
    if inc is not None:
        kept.add((node, inc))
    return frozenset(kept)


def apply_change(conf: ConfState, cc: ConfChange) -> ConfState:
    """The configuration after ``cc``, or ``ConfChangeRejected`` saying why not."""
    voters, learners, auto = set(conf.voters), set(conf.learners), set(conf.auto_promote)
    records = conf.incarnations
    node = cc.node
    if cc.op in (ConfChangeOp.RECORD, ConfChangeOp.READMIT):
        try:
            inc = cc.incarnation()
        except ValueError as e:
            raise ConfChangeRejected(str(e)) from None
        if node not in voters and node not in learners:
            raise ConfChangeRejected(f"{node} is not a member")
        if cc.op == ConfChangeOp.READMIT and node in voters:
            if len(voters) == 1:
                raise ConfChangeRejected(f"{node} is the last voter")
            voters.discard(node)
            learners.add(node)
            auto.add(node)
        records = _with_record(records, node, inc)
    elif cc.op == ConfChangeOp.ADD_LEARNER:
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
        records = _with_record(records, node, None)
    else:  # pragma: no cover - the enum is closed
        raise ConfChangeRejected(f"unknown change {cc.op!r}")
    return ConfState(frozenset(voters), frozenset(learners), frozenset(auto), records)


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


def encode_records(records: frozenset[tuple[str, int]]) -> list[list[object]]:
    return [[n, i] for n, i in sorted(records)]


def decode_records(raw: object) -> frozenset[tuple[str, int]]:
    """``[[node, incarnation], ...]``; ValueError, and only ValueError, if malformed."""
    if not isinstance(raw, list):
        raise ValueError("malformed membership record: incarnations must be a list")  # noqa: TRY004
    out = set()
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and pair[0] and type(pair[1]) is int and pair[1] > 0):
            raise ValueError(f"malformed incarnation record {pair!r:.80}")
        out.add((pair[0], pair[1]))
    if len({n for n, _ in out}) != len(out):
        raise ValueError("malformed membership record: two incarnations for one member")
    return frozenset(out)


def encode_conf_entry(cc: ConfChange | None, conf: ConfState) -> bytes:
    """The data of a CONF_CHANGE entry: the change (None for the bootstrap
    configuration) and the configuration it produces. The incarnations, a fifth field,
    are written only when there are some, so a log that never recorded one reads the
    same to an older version."""
    fields: list[object] = [
        _change_fields(cc) if cc is not None else None,
        sorted(conf.voters), sorted(conf.learners), sorted(conf.auto_promote),
    ]
    if conf.incarnations:
        fields.append(encode_records(conf.incarnations))
    return msgpack.packb(fields, use_bin_type=True)


def decode_conf_entry(data: object) -> tuple[ConfChange | None, ConfState]:
    """Raises ValueError, and only ValueError, on anything malformed (peer input)."""
    fields = _unpack(data)
    if not (isinstance(fields, list) and len(fields) in (4, 5)):
        raise ValueError("malformed configuration entry: expected [change, voters, learners, "
                         "auto, incarnations?]")
    change, voters, learners, auto = fields[:4]
    records = decode_records(fields[4]) if len(fields) == 5 else frozenset()
    cc = None if change is None else _change(change)
    return cc, ConfState(_members(voters), _members(learners), _members(auto), records)
