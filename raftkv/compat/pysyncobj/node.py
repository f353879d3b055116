"""``Node`` and ``TCPNode``: PySyncObj's node identities. A node's id is its address."""

from __future__ import annotations

import socket
from typing import Any


class Node:
    """A node of the cluster, equal to any other ``Node`` with the same id."""

    def __init__(self, id: str, **kwargs: Any) -> None:
        object.__setattr__(self, "_id", id)
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "id":
            raise AttributeError("Node id is not mutable")
        super().__setattr__(name, value)

    @property
    def id(self) -> str:
        return str(self._id)  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and self.id == other.id

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.id)

    def __str__(self) -> str:
        return self.id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def _destroy(self) -> None:
        pass


class TCPNode(Node):
    """A node reached over TCP; its id is its address, ``host:port``."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        host, sep, port = str(address).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bad node address {address!r}: expected host:port")
        super().__init__(str(address), **kwargs)
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "_port", int(port))

    @property
    def address(self) -> str:
        return self.id

    @property
    def host(self) -> str:
        host: str = self._host  # type: ignore[attr-defined]
        return host

    @property
    def port(self) -> int:
        port: int = self._port  # type: ignore[attr-defined]
        return port

    @property
    def ip(self) -> str | None:
        try:
            return socket.gethostbyname(self.host)
        except OSError:
            return None


def node_id(node: Node | str) -> str:
    """The id of ``node``: a ``Node``'s id, or the address string itself."""
    if isinstance(node, Node):
        return node.id
    if isinstance(node, str):
        TCPNode(node)  # checks the form
        return node
    raise TypeError(f"a node is a 'host:port' string or a Node, not {type(node).__name__}")
