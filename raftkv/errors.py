"""Every exception a raftkv user may catch, in one place.

Each class is defined next to the code that raises it (the core, the node, the storage
layer, the HTTP client, ...) and is re-exported here unchanged, so ``except
raftkv.errors.NotLeader`` and ``except raftkv.core.NotLeader`` catch the same thing and
the older import paths keep working. Grouped by where they come from:

The embedded API (``RaftKV``, ``ReplicatedNode``): the synchronous calls raise, and the
``*_async`` futures fail with,

- ``RequestTimeout``: no outcome within ``request_timeout``. A write may still commit
  later; use ``cas`` or an idempotent command when that matters.
- ``NodeStopped``: the node was closed while the request was pending.
- ``NotLeader``: a membership call ran on a follower (a leadership transfer on a
  follower is forwarded to the leader; a write too), or no leader is known; ``leader`` is the
  best hint (None while no leader is known). ``NotAMember``, a ``NotLeader``: this node
  was removed from the group while it was down or cut off, and a member told it so
  (``by``, ``index``); it fails every request at once rather than wait for a leader.
- ``ProposalDropped``: the leader refused the proposal (a leadership transfer is under way).
- ``ReplicaEmpty``: a stale read of a replica that started empty and has not caught up
  yet, whose "absent" would be wrong, not stale.
- ``ConfChangeRejected``: a membership change broke a rule of one-by-one change (one
  change at a time, after an entry of the leader's own term); ``LeaderStepping`` is the
  case where the change removes the leader, which hands leadership over first.
- ``TransferRejected``: a leadership transfer named a node that is not a voter (a
  follower refuses one that is no member of the configuration it knows, and forwards
  the rest). Naming the current leader is done at once, as etcd's move-leader is.
- ``RemoteError``: the leader refused a write a follower forwarded; ``kind`` names
  the leader-side error. Also what a follower's replicated call raises when the
  method's exception cannot be rebuilt here (``kind`` is its class's qualified name).
- ``CommandError`` (a ``ValueError``): a key, value or batch breaks a limit (``limit`` and
  ``size`` say which) or is malformed. Raised before anything is proposed.
- ``RaftError`` and ``NodeError``: the bases of the above.

A replicated object (``raftkv.statemachine``):

- ``NotAttachedError``: a ``@replicated`` method was called on an object no node hosts.
- ``MalformedCommand``, ``UnknownMethod``: the result of an entry that does not decode
  or names no replicated method (a log written by another version of the class).
- ``ResultNotSent`` (a ``TypeError``): a follower's call was applied, but its result is
  not plain data and could not come back from the leader.

Storage, when a node opens its data directory:

- ``StorageError``, and ``CorruptLog`` for damage at or below the commit index: the
  store refuses to open rather than serve wrong data, with a message naming the file.

The HTTP client (``raftkv.client.Client``, what the ``raftkv`` command uses):

- ``ClientError``: the cluster answered with an error; ``status`` and ``body`` say which.
  A 401 (no token, or one the cluster does not know) or 403 (a token whose role is too
  low) is one, raised at once: another node would answer the same.
- ``Unavailable``: no endpoint answered before the deadline. (``raftkv.storage.errors``
  has an unrelated ``Unavailable``, a log index past the end, which users never see.)
- ``OutcomeUnknown`` (an ``Unavailable``): a write (``put``, ``delete``, ``cas``,
  ``txn``, ``batch``), a membership change or a leadership transfer reached a node and
  got no definite answer; it may or may not have applied, and it is not sent again (it
  would apply twice). It may also apply *later*: a node that was stopped with the
  request unread proposes it when it resumes, after a read said it had not applied
  (found from outside). So a read tells what holds now, not what will; where a late
  copy would matter, write with ``cas`` (or ``txn``) conditioned on what the read
  returned, so that whichever copy comes second fails its compare.

Tools:

- ``SparkJobError``: a Spark load or verify cannot run (bad input, unknown table,
  unreachable cluster, the ``spark`` extra not installed); raised before any write.
- ``UnsafeResetError``: ``raftkv recover unsafe-reset`` refused; nothing was written.
- ``AdminError``: a ``raftkv admin`` command (``raftkv.admin.AdminClient``) failed:
  ``kind`` is the node's error, or ``Unreachable`` when the node could not be reached or
  refused the secret.
"""

from __future__ import annotations

from raftkv.admin import AdminError
from raftkv.client import ClientError, OutcomeUnknown, Unavailable
from raftkv.core.errors import (
    ConfChangeRejected,
    LeaderStepping,
    NotAMember,
    NotLeader,
    ProposalDropped,
    RaftError,
    TransferRejected,
)
from raftkv.node.errors import (
    NodeError,
    NodeStopped,
    RemoteError,
    ReplicaEmpty,
    RequestTimeout,
)
from raftkv.recovery.unsafe_reset import UnsafeResetError
from raftkv.spark.cluster import SparkJobError
from raftkv.statemachine import MalformedCommand, NotAttachedError, ResultNotSent, UnknownMethod
from raftkv.storage.commands import CommandError
from raftkv.storage.errors import CorruptLog, StorageError

__all__ = [
    "AdminError",
    "ClientError",
    "CommandError",
    "ConfChangeRejected",
    "CorruptLog",
    "LeaderStepping",
    "MalformedCommand",
    "NodeError",
    "NodeStopped",
    "NotAMember",
    "NotAttachedError",
    "NotLeader",
    "OutcomeUnknown",
    "ProposalDropped",
    "RaftError",
    "RemoteError",
    "ReplicaEmpty",
    "RequestTimeout",
    "ResultNotSent",
    "SparkJobError",
    "StorageError",
    "TransferRejected",
    "Unavailable",
    "UnknownMethod",
    "UnsafeResetError",
]
