"""Messages, roles and the Ready batch: the vocabulary of the core's inputs and outputs.

``MessageType`` values go on the wire: never renumber them, only append.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from raftkv.storage.records import ConfState, Entry, HardState, Snapshot


class Role(IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3


class MessageType(IntEnum):
    # On the wire: never renumber, only append.
    APP = 1
    APP_RESP = 2
    VOTE = 3
    VOTE_RESP = 4
    PRE_VOTE = 5
    PRE_VOTE_RESP = 6
    HEARTBEAT = 7
    HEARTBEAT_RESP = 8
    SNAPSHOT = 9
    TIMEOUT_NOW = 10
    READ_INDEX = 11
    READ_INDEX_RESP = 12
    TRANSFER_LEADER = 13
    COMMIT = 14


class Message:
    """One Raft RPC. A plain slotted class: millions are built per benchmark run.

    Field use by type (etcd's conventions):
    - APP: ``index``/``log_term`` = prevLogIndex/prevLogTerm, ``entries``, ``commit``.
    - COMMIT: an APP without entries that needs no answer: the leader's broadcast of a
      new commit index to a follower it is replicating to and has nothing new for.
      Fields as for APP; the follower answers only a rejection.
    - APP_RESP: ``index`` = last index matched (accept) or rejected prevLogIndex
      (reject), with ``reject_hint``/``log_term`` giving the follower's conflict hint.
    - VOTE/PRE_VOTE: ``index``/``log_term`` = candidate's last index/term.
    - HEARTBEAT: ``commit``; ``context`` = the sequence number of the newest pending
      ReadIndex request (leader-local).
    - TIMEOUT_NOW: ``context`` = an encoded membership change the new leader must
      perform (set when the old leader is handing over in order to be removed).
    - READ_INDEX(_RESP): ``context`` = the request's context, ``index`` = read index.
    - TRANSFER_LEADER: ``context`` = the transferee id.

    Every message also carries ``inc``, the sender's incarnation. A vote request carries
    ``to_inc``, the incarnation the candidate records for the recipient (0: none, or
    identities are off), and ``to_inc_ok``, whether that record is committed in the
    candidate's log; a heartbeat carries in ``to_inc`` the incarnation its commit bound
    (the leader's match) describes. See "Incarnations" in ``raftkv.core.raft``.
    """

    __slots__ = (
        "commit",
        "context",
        "entries",
        "frm",
        "inc",
        "index",
        "log_term",
        "reject",
        "reject_hint",
        "snapshot",
        "term",
        "to",
        "to_inc",
        "to_inc_ok",
        "type",
    )

    def __init__(
        self,
        type: MessageType,
        to: str,
        frm: str,
        term: int,
        log_term: int = 0,
        index: int = 0,
        entries: list[Entry] | tuple[()] = (),
        commit: int = 0,
        reject: bool = False,
        reject_hint: int = 0,
        snapshot: Snapshot | None = None,
        context: Any = None,
        inc: int = 0,
        to_inc: int = 0,
        to_inc_ok: bool = False,
    ) -> None:
        self.type = type
        self.to = to
        self.frm = frm
        self.term = term
        self.log_term = log_term
        self.index = index
        self.entries = entries
        self.commit = commit
        self.reject = reject
        self.reject_hint = reject_hint
        self.snapshot = snapshot
        self.context = context
        self.inc = inc
        self.to_inc = to_inc
        self.to_inc_ok = to_inc_ok

    def __repr__(self) -> str:
        parts = [f"{self.type.name} {self.frm}->{self.to} t{self.term}"]
        if self.type in (MessageType.APP, MessageType.COMMIT, MessageType.VOTE,
                         MessageType.PRE_VOTE):
            parts.append(f"idx={self.index} lt={self.log_term}")
        if self.entries:
            parts.append(f"ents={self.entries[0].index}..{self.entries[-1].index}")
        if self.commit:
            parts.append(f"commit={self.commit}")
        if self.type in (MessageType.APP_RESP, MessageType.READ_INDEX_RESP):
            parts.append(f"idx={self.index}")
        if self.reject:
            parts.append(f"REJECT hint={self.reject_hint}/{self.log_term}")
        if self.snapshot is not None:
            parts.append(f"snap={self.snapshot.index}/{self.snapshot.term}")
        if self.context is not None:
            parts.append(f"ctx={self.context!r}")
        return "<" + " ".join(parts) + ">"


class SoftState(NamedTuple):
    """Volatile state worth reporting when it changes (never persisted)."""

    lead: str | None
    role: Role


class ReadState(NamedTuple):
    """A confirmed ReadIndex (§6.4): serve the read once applied >= ``index``."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, as in Entry
    context: Any


@dataclass
class Ready:
    """One output batch. The driver must, in this order:

    1. persist ``hard_state``, ``entries`` and ``snapshot`` (one sync when
       ``must_sync``);
    2. send ``messages``;
    3. install ``snapshot`` into the state machine (if any), then apply
       ``committed_entries`` (each entry's ``index`` is its proposedIndex);
    4. call ``advance(ready)``. No ``step``/``tick``/``propose`` may run between
       ``ready()`` and ``advance()``.

    Two relaxations are safe, and the node driver takes them (``raftkv.node.driver``,
    ``_send_first`` and ``_applies_first``): a leader whose Ready changes neither term
    nor vote may send its AppendEntries, commit notices and heartbeats before step 1
    if their commit index is below the Ready's first new entry (dissertation §10.2.1:
    a leader writes its log in parallel with replicating it. The core counts the
    leader's own entries at once, but a commit that needs a follower's answer to them
    is made when that answer is stepped, after this sync, and a single voter's, made
    at once, is what the commit-index bound holds back); and committed
    entries that were all durable before this Ready (below its first new entry, no
    snapshot) may be applied before step 1.
    """

    soft_state: SoftState | None = None
    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    committed_entries: list[Entry] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
    must_sync: bool = False


@dataclass(frozen=True)
class PeerStatus:
    match: int
    next: int
    state: str
    learner: bool
    recent_active: bool


@dataclass(frozen=True)
class Status:
    id: str
    role: Role
    term: int
    leader: str | None
    commit: int
    applied: int
    last_index: int
    conf: ConfState
    lead_transferee: str | None
    peers: dict[str, PeerStatus]
