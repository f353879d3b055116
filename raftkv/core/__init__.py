"""raftkv's pure Raft core. The public surface is re-exported here.

The core imports no clock, socket, thread, OS or global randomness (a test enforces it):
time is ``tick()``, I/O is the driver's job, and randomness is an injected RNG.
"""

from raftkv.core.errors import (
    CampaignRejected,
    ConfChangeRejected,
    LeaderStepping,
    NotAMember,
    NotLeader,
    ProposalDropped,
    RaftError,
    TransferRejected,
)
from raftkv.core.membership import ConfChange, ConfChangeOp, decode_conf_entry
from raftkv.core.raft import Config, Raft, bootstrap
from raftkv.core.types import Message, MessageType, ReadState, Ready, Role, SoftState, Status
from raftkv.storage.records import ConfState, Entry, EntryType, HardState, Snapshot, SnapshotMeta

__all__ = [
    "CampaignRejected", "ConfChange", "ConfChangeOp", "ConfChangeRejected", "ConfState",
    "Config", "Entry", "EntryType", "HardState", "LeaderStepping", "Message", "MessageType",
    "NotAMember", "NotLeader", "ProposalDropped", "Raft", "RaftError", "ReadState", "Ready", "Role",
    "Snapshot", "SnapshotMeta", "SoftState", "Status", "TransferRejected", "bootstrap",
    "decode_conf_entry",
]
