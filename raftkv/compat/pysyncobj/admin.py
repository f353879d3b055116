"""What a compat ``SyncObj`` answers to ``raftkv admin`` and ``syncobj_admin``.

PySyncObj's node answers its admin tool's ``status``, ``add``, ``remove``,
``set_version`` and ``transfer`` by calling its own public API with a callback
(``getStatus``, ``addNodeToCluster``, ...); ``SyncObjAdmin`` does the same on the
compat ``SyncObj``, so the semantics are the layer's: ``add`` needs
``dynamicMembershipChange`` and adds a learner that the leader promotes, a node
refuses to ``remove`` itself (PySyncObj's ``REQUEST_DENIED``: ask another node), and
``transfer`` must reach the leader (a follower names it and the client goes there).
The channel and the client are ``raftkv.admin``'s.

A command's outcome is the callback's ``FAIL_REASON``: ``SUCCESS`` answers
``{"code": 0}``, another code fails the command with ``CommandFailed`` naming it. An
exception the API raises (``dynamicMembershipChange is disabled``, a wrong code version)
fails it with that exception. Callbacks run where the layer runs them, on the tick
thread or inside the program's ``doTick``, as PySyncObj's do: with ``autoTick=False``
a command waits for the program's next ``doTick``, and fails with ``UNKNOWN_OUTCOME``
after ``CALLBACK_TIMEOUT`` seconds without one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from raftkv.admin import CommandFailed, check_args, in_thread
from raftkv.compat.pysyncobj.config import FAIL_REASON
from raftkv.compat.pysyncobj.node import Node, node_id

if TYPE_CHECKING:
    from raftkv.compat.pysyncobj.syncobj import SyncObj

CALLBACK_TIMEOUT = 60.0
_NAMES = {v: k for k, v in vars(FAIL_REASON).items() if not k.startswith("_")}


def fail_reason_name(code: int) -> str:
    return _NAMES.get(code, str(code))


class SyncObjAdmin:
    """The admin service of one ``SyncObj`` (module docstring)."""

    def __init__(self, owner: SyncObj) -> None:
        self.owner = owner

    def __call__(self, command: str, args: list[Any]) -> Future[Any]:
        if command == "status":
            check_args(command, args, 0, 0)
            return in_thread(self.status)
        if command in ("add", "remove"):
            check_args(command, args, 1, 1)
            return in_thread(self.add if command == "add" else self.remove, args[0])
        if command == "transfer":
            check_args(command, args, 0, 1)
            return in_thread(self.transfer, *args)
        if command == "set_version":
            if len(args) != 1 or type(args[0]) is not int:
                raise ValueError(f"set_version takes one integer, got {args!r}")
            return in_thread(self.set_version, args[0])
        raise ValueError(f"unknown admin command {command!r} (a raftkv.compat.pysyncobj "
                         "node serves status, add, remove, set_version and transfer)")

    def status(self) -> dict[str, Any]:
        """``getStatus()``, its ``TCPNode`` values as their addresses."""
        return {k: str(v) if isinstance(v, Node) else v
                for k, v in self.owner.getStatus().items()}

    def add(self, node: str) -> dict[str, Any]:
        if node in self._members():
            raise CommandFailed(f"{fail_reason_name(FAIL_REASON.REQUEST_DENIED)}: {node} is "
                                "already a member of the cluster")
        return self._outcome(lambda cb: self.owner.addNodeToCluster(node, callback=cb))

    def remove(self, node: str) -> dict[str, Any]:
        if self.owner.selfNode is not None and node == self.owner.selfNode.id:
            raise CommandFailed(
                f"{fail_reason_name(FAIL_REASON.REQUEST_DENIED)}: a node does not remove "
                "itself (it would never hear of its removal); ask another node")
        if node not in self._members():
            raise CommandFailed(f"{fail_reason_name(FAIL_REASON.REQUEST_DENIED)}: {node} is "
                                "not a member of the cluster (as this node knows it)")
        return self._outcome(lambda cb: self.owner.removeNodeFromCluster(node, callback=cb))

    def _members(self) -> set[str]:
        """Every member of the configuration this node knows, itself included. The API's
        add and remove are idempotent, as PySyncObj's are (a retried call succeeds); the
        admin tool is an operator's, who is told when a node already is, or is not, a
        member (found from outside: removing a mistyped address printed SUCCESS)."""
        me = self.owner.selfNode
        return ({node_id(n) for n in self.owner.otherNodes | self.owner.readonlyNodes}
                | ({me.id} if me is not None else set()))

    def set_version(self, version: int) -> dict[str, Any]:
        return self._outcome(lambda cb: self.owner.setCodeVersion(version, callback=cb))

    def transfer(self, node: str | None = None) -> dict[str, Any]:
        return self._outcome(lambda cb: self.owner.transferLeadership(node, callback=cb))

    def _outcome(self, start: Any) -> dict[str, Any]:
        """Start a call that reports through ``callback(result, FAIL_REASON)`` and wait
        for its code."""
        done = threading.Event()
        codes: list[int] = []

        def callback(_result: Any, code: int) -> None:
            codes.append(code)
            done.set()

        start(callback)
        if not done.wait(CALLBACK_TIMEOUT):
            raise CommandFailed(f"{fail_reason_name(FAIL_REASON.UNKNOWN_OUTCOME)}: no outcome "
                                f"within {CALLBACK_TIMEOUT:.0f} s (does the program tick?)")
        code = codes[0]
        if code != FAIL_REASON.SUCCESS:
            leader = None
            if code == FAIL_REASON.NOT_LEADER:
                lead = self.owner._getLeader()
                leader = None if lead is None else lead.id
            raise CommandFailed(f"{fail_reason_name(code)} (FAIL_REASON {code})", leader)
        return {"code": code}
