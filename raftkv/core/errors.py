"""Errors the core raises at its API boundary. Each says what happened and what to do."""

from __future__ import annotations

from raftkv.storage.errors import Rebuildable


class RaftError(Exception):
    pass


class NotLeader(Rebuildable, RaftError):
    """The proposal must go to the leader. ``leader`` is the best hint, or None."""

    _fields: tuple[str, ...] = ("node", "leader")

    def __init__(self, node: str, leader: str | None) -> None:
        hint = f"leader is {leader}" if leader is not None else "leader unknown"
        super().__init__(f"node {node} is not the leader ({hint})")
        self.node = node
        self.leader = leader


class NotAMember(NotLeader):
    """This node is not a member of the group: ``by``, a member, applied a configuration
    that leaves it out, at ``index``, beyond this node's whole log (it was removed while
    down or cut off). It never serves the group again unless it is added back."""

    _fields: tuple[str, ...] = ("node", "by", "index")

    def __init__(self, node: str, by: str, index: int, group: str = "") -> None:
        # ``group``: named in the message where the caller knows it (found from outside:
        # a drained node's metastore replica answered /v1/cluster with "this group" while
        # it still served, and led, the default group).
        which = f"group {group}" if group else "this group"
        RaftError.__init__(
            self, f"node {node} is not a member of {which} any more: {by} applied a "
            f"configuration without it (index {index}); it will not serve {which} unless "
            "it is added back")
        self.node, self.leader, self.by, self.index = node, None, by, index


class ProposalDropped(RaftError):
    """The leader refused a proposal (for example, a leadership transfer is pending)."""


class ConfChangeRejected(RaftError):
    """A membership change broke a rule of one-by-one change (Raft dissertation ch. 4)."""


class TransferRejected(RaftError):
    pass


class CampaignRejected(RaftError):
    """A survivor election (``Raft.campaign_without``) was refused: the configuration is
    not one the rule covers (see "The lone survivor of two voters" in ``raftkv.core.raft``)."""


class LeaderStepping(Rebuildable, ConfChangeRejected):
    """The change removes or demotes the leader. Leadership is being transferred to
    ``transferee``, which performs the change once it leads (Kudu design, "removing a node")."""

    _fields = ("message", "transferee")

    def __init__(self, message: str, transferee: str) -> None:
        super().__init__(message)
        self.message = message
        self.transferee = transferee
