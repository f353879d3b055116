"""``TcpUtility``: PySyncObj's programmatic admin client, over ``raftkv.admin``.

    from raftkv.compat.pysyncobj.utility import TcpUtility, UtilityException
    TcpUtility(password="PW").executeCommand("127.0.0.1:4321", ["status"])   # a dict
    TcpUtility(password="PW").executeCommand("127.0.0.1:4321", ["add", "127.0.0.1:4324"])
    # 'SUCCESS ADD 127.0.0.1:4324' or 'FAIL ADD 127.0.0.1:4324'

Commands and answers are PySyncObj's: ``['status']`` gives ``getStatus()`` (nodes as
their addresses), ``['add', node]``, ``['remove', node]``, ``['set_version', n]`` and
``['transfer', node or '']`` give ``'SUCCESS <COMMAND> <args>'`` or ``'FAIL ...'``, and
an exception the node's API raised gives its message. A node that cannot be reached or
refuses the password raises ``UtilityException``. Underneath, the request travels on
the node's authenticated raft port (``raftkv.admin``), never pickled; ``password`` is
the nodes' ``SyncObjConf.password`` (None: the layer's no-password secret).
"""

from __future__ import annotations

from typing import Any

from raftkv.admin import AdminClient, AdminError, outcome_line
from raftkv.compat.pysyncobj.config import DEV_SECRET
from raftkv.compat.pysyncobj.node import Node, TCPNode

__all__ = ["TcpUtility", "Utility", "UtilityException"]


class UtilityException(Exception):
    pass


class Utility:
    def __init__(self, password: str | bytes | None = None, timeout: float = 900.0) -> None:
        """``password``: the cluster's; ``timeout``: seconds for one command."""

    def executeCommand(self, node: Node | str, command: list[Any]) -> Any:
        """Execute ``command`` on ``node``; ``UtilityException`` when it cannot."""
        raise NotImplementedError


class TcpUtility(Utility):
    def __init__(self, password: str | bytes | None = None, timeout: float = 900.0) -> None:
        super().__init__(password, timeout)
        if password is None:
            self._secret = DEV_SECRET
        else:
            self._secret = password.encode() if isinstance(password, str) else bytes(password)
        self._timeout = timeout

    def executeCommand(self, node: Node | str, command: list[Any]) -> Any:
        try:
            address = node.id if isinstance(node, Node) else TCPNode(node).id
        except (TypeError, ValueError):
            raise UtilityException("invalid address to connect") from None
        if not isinstance(command, list | tuple) or not command:
            raise UtilityException(f"a command is a non-empty list, not {command!r}")
        name, args = str(command[0]), list(command[1:])
        # PySyncObj's ['transfer', ''] means "the most up-to-date voter".
        wire = [a for a in args if a not in ("", None)] if name == "transfer" else args
        try:
            result = AdminClient(address, self._secret, self._timeout).request(name, wire)
        except AdminError as e:
            if e.kind == "Unreachable":
                raise UtilityException(str(e)) from None
            if e.kind == "CommandFailed":
                return outcome_line(False, name, args)
            return str(e)
        except ValueError as e:
            raise UtilityException(str(e)) from None
        if name == "status" and isinstance(result, dict):
            # As PySyncObj's: 'self' and 'leader' are TCPNode objects (as getStatus()
            # gives them), not the address text the admin link carries (found from
            # outside: status['leader'].address failed).
            for key in ("self", "leader"):
                if isinstance(result.get(key), str):
                    result[key] = TCPNode(result[key])
            return result
        return outcome_line(True, name, args)
