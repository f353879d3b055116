"""Wire records: what travels inside a frame, and strict decoding of what peers send.

A frame's payload is a list of items, everything one loop turn has for that peer (the
heartbeats of every group it hosts with us included: that is the coalescing). Items:

- ``[RAFT, group, type, to, frm, term, log_term, index, entries, commit, reject,
  reject_hint, snapshot, context, inc, to_inc, to_inc_ok]``: one Raft message. ``entries`` is a
  list of ``[term, index, type, data]``; ``snapshot`` is None or
  ``[index, term, voters, learners, auto_promote, data, incarnations]``. A record
  without the last two fields (or a snapshot without incarnations) comes from a peer
  that predates incarnations: it reads as 0 (none) and False.
- ``[FORWARD, request_id, group, data]``: a follower forwarding a client's write command
  to the leader.
- ``[FORWARD_REPLY, request_id, ok, result]``: the leader's answer. ``result`` is
  ``[index, value]`` on success, ``[error_kind, message, leader_hint]`` on failure.
- ``[ADMIN, request_id, command, args]``: an admin tool's request (``raftkv.admin``),
  only on a connection whose dialer announced no node id (see ``raftkv.transport.tcp``).
- ``[ADMIN_REPLY, request_id, ok, result]``: the node's answer to it: ``result`` is the
  command's on success, ``[error_kind, message, leader, leader_address]`` on failure
  (leader and its address, when known, for a command only the leader can run).

Decoding trusts nothing beyond the handshake: every field's type is checked, and any
mismatch raises ``WireError`` (the connection is closed; the node carries on).
"""

from __future__ import annotations

from typing import Any

from raftkv.core.membership import decode_records, encode_records
from raftkv.core.types import Message, MessageType
from raftkv.storage.records import ConfState, Entry, Snapshot, SnapshotMeta
from raftkv.transport.frames import FrameError

RAFT = 0
FORWARD = 1
FORWARD_REPLY = 2
ADMIN = 3
ADMIN_REPLY = 4

_MT = {int(t): t for t in MessageType}
_CONTEXT_TYPES = (type(None), int, str, bytes)


class WireError(FrameError):
    """A peer sent a record that is not well-formed (closes the connection, like a bad frame)."""


def encode_message(group: str, m: Message) -> list[Any]:
    snap = m.snapshot
    return [
        RAFT, group, int(m.type), m.to, m.frm, m.term, m.log_term, m.index,
        [list(e) for e in m.entries], m.commit, m.reject, m.reject_hint,
        None if snap is None else [
            snap.meta.index, snap.meta.term, sorted(snap.meta.conf.voters),
            sorted(snap.meta.conf.learners), sorted(snap.meta.conf.auto_promote), snap.data,
            encode_records(snap.meta.conf.incarnations),
        ],
        m.context, m.inc, m.to_inc, m.to_inc_ok,
    ]


def _int(v: object, what: str) -> int:
    if type(v) is not int or v < 0:
        raise WireError(f"{what}: expected a non-negative integer, got {v!r:.80}")
    return v


def _str(v: object, what: str) -> str:
    if type(v) is not str or not v:
        raise WireError(f"{what}: expected a non-empty string, got {v!r:.80}")
    return v


def _ids(v: object, what: str) -> frozenset[str]:
    if type(v) is not list:
        raise WireError(f"{what}: expected a list of node ids")
    return frozenset(_str(n, what) for n in v)


def _entries(raw: object) -> list[Entry]:
    if type(raw) is not list:
        raise WireError("entries: expected a list")
    new = tuple.__new__
    out = []
    for e in raw:
        # One combined test keeps the per-entry cost low on the replication hot path.
        if not (
            type(e) is list and len(e) == 4 and type(e[0]) is int and type(e[1]) is int
            and type(e[2]) is int and type(e[3]) is bytes and e[0] >= 0 and e[1] > 0
        ):
            raise WireError(f"malformed entry {e!r:.80}")
        out.append(new(Entry, e))
    return out


def _snapshot(raw: object) -> Snapshot | None:
    if raw is None:
        return None
    if type(raw) is not list or len(raw) not in (6, 7) or type(raw[5]) is not bytes:
        raise WireError("malformed snapshot record")
    try:
        records = decode_records(raw[6]) if len(raw) == 7 else frozenset()
    except ValueError as e:
        raise WireError(str(e)) from None
    conf = ConfState(_ids(raw[2], "voters"), _ids(raw[3], "learners"), _ids(raw[4], "auto"),
                     records)
    meta = SnapshotMeta(_int(raw[0], "snapshot index"), _int(raw[1], "snapshot term"), conf)
    return Snapshot(meta, raw[5])


def decode_message(item: list[Any]) -> tuple[str, Message]:
    if len(item) == 17:
        inc, to_inc, to_inc_ok = _int(item[14], "inc"), _int(item[15], "to_inc"), item[16]
        if type(to_inc_ok) is not bool:
            raise WireError("to_inc_ok: expected a bool")
    elif len(item) == 14:
        inc, to_inc, to_inc_ok = 0, 0, False
    else:
        raise WireError(f"raft record: expected 17 fields, got {len(item)}")
    (_, group, mtype, to, frm, term, log_term, index, entries, commit, reject,
     reject_hint, snap, context) = item[:14]
    t = _MT.get(mtype) if type(mtype) is int else None
    if t is None:
        raise WireError(f"unknown message type {mtype!r:.40}")
    if type(reject) is not bool:
        raise WireError("reject: expected a bool")
    if not isinstance(context, _CONTEXT_TYPES):
        raise WireError("context: expected nil, int, str or bytes")
    msg = Message(
        t, _str(to, "to"), _str(frm, "from"), _int(term, "term"),
        log_term=_int(log_term, "log_term"), index=_int(index, "index"),
        entries=_entries(entries) if entries else (), commit=_int(commit, "commit"),
        reject=reject, reject_hint=_int(reject_hint, "reject_hint"),
        snapshot=_snapshot(snap), context=context, inc=inc, to_inc=to_inc,
        to_inc_ok=to_inc_ok,
    )
    return _str(group, "group"), msg


def encode_forward(request_id: int, group: str, data: bytes) -> list[Any]:
    return [FORWARD, request_id, group, data]


def decode_forward(item: list[Any]) -> tuple[int, str, bytes]:
    if len(item) != 4 or type(item[3]) is not bytes:
        raise WireError("malformed forward record")
    return _int(item[1], "request id"), _str(item[2], "group"), item[3]


def encode_reply(request_id: int, ok: bool, result: list[Any]) -> list[Any]:
    return [FORWARD_REPLY, request_id, ok, result]


def decode_reply(item: list[Any]) -> tuple[int, bool, list[Any]]:
    if len(item) != 4 or type(item[2]) is not bool or type(item[3]) is not list:
        raise WireError("malformed forward reply")
    return _int(item[1], "request id"), item[2], item[3]


def encode_admin(request_id: int, command: str, args: list[Any]) -> list[Any]:
    return [ADMIN, request_id, command, args]


def decode_admin(item: list[Any]) -> tuple[int, str, list[Any]]:
    if len(item) != 4 or type(item[3]) is not list or item[0] != ADMIN:
        raise WireError("malformed admin request")
    return _int(item[1], "request id"), _str(item[2], "admin command"), item[3]


def encode_admin_reply(request_id: int, ok: bool, result: Any) -> list[Any]:
    return [ADMIN_REPLY, request_id, ok, result]


def decode_admin_reply(item: list[Any]) -> tuple[int, bool, Any]:
    if len(item) != 4 or item[0] != ADMIN_REPLY or type(item[2]) is not bool:
        raise WireError("malformed admin reply")
    return _int(item[1], "request id"), item[2], item[3]


def item_kind(item: object) -> int:
    if type(item) is not list or not item or type(item[0]) is not int:
        raise WireError(f"malformed item {item!r:.80}")
    return item[0]
