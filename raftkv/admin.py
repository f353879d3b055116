"""``raftkv admin``: PySyncObj's ``syncobj_admin`` for embedded nodes, over the peer port.

An embedded node (``RaftKV``, ``ReplicatedNode``, a ``raftkv.compat.pysyncobj``
``SyncObj``) has no HTTP API; what it has is its Raft port. ``raftkv admin`` talks to a
node there, as PySyncObj's ``syncobj_admin`` does::

    raftkv admin --conn 127.0.0.1:7001 --secret-file secret status
    raftkv admin --conn 127.0.0.1:7001 --secret-file secret add n4 127.0.0.1:7004
    raftkv admin --conn 127.0.0.1:7001 --secret-file secret remove n4 | promote n4
    raftkv admin --conn 127.0.0.1:7001 --secret-file secret transfer [n2]
    raftkv admin --conn 127.0.0.1:4321 --password PW set-version 2    (a compat SyncObj)
    raftkv admin -conn 127.0.0.1:4321 -pass PW -status                (syncobj_admin's syntax)
    raftkv admin --conn 127.0.0.1:7001 --secret-file secret --cacert ca.pem status  (TLS)

The secret is ``--secret-file``, ``--password`` (a compat ``SyncObjConf.password``) or
``RAFTKV_SECRET``; with none of them, the compat layer's public no-password secret.
``--cacert``/``--cert``/``--key`` are for a raft port under TLS (below). ``status``
prints ``key: value`` lines as ``syncobj_admin`` does, the other commands
``SUCCESS ADD n4`` (or ``FAIL ADD n4`` with the reason on stderr and exit status 1:
PySyncObj's tool exits 0 either way). ``--json`` prints the answer as JSON instead.

Theory of operation
-------------------
- **The channel is the peer port's.** The tool dials the node's Raft address and
  does exactly what a dialing peer does, with the transport's own code
  (``raftkv.transport.blocking.PeerLink``): TLS first if the port runs it, the
  cluster-secret handshake (``raftkv.transport.handshake``) announcing an empty node
  id, then frames tagged under the connection's keys both ways (or carried by TLS). The
  empty id makes the transport treat the connection as a tool's, never as a peer's
  (``raftkv.transport.tcp``), and hand its frames to the driver's ``admin_handler``.
  Requests and answers are msgpack items in the node's ordinary frames (``[ADMIN, id,
  command, args]``, ``[ADMIN_REPLY, id, ok, result]``, ``raftkv.transport.codec``).
  Nothing is ever unpickled, and without the secret (and, under
  ``--peer-client-cert-auth``, a certificate signed by the peers' CA) a tool gets no
  further than a peer would: the handshake, then a closed connection. Anyone holding
  what it takes could join the cluster as a peer anyway, so the admin commands give
  them nothing new.
- **TLS.** A node whose raft port runs TLS (``raftkv serve --peer-cert-file ...``,
  ``EmbeddedNode(peer_tls=...)``) is administered with ``--cacert`` (the CA that signs
  the nodes' certificates; the node's certificate must name the host in ``--conn``), and
  ``--cert``/``--key`` when it requires client certificates. The flags are the
  ``raftkv`` command's; the node's own names (``--peer-trusted-ca-file``,
  ``--peer-cert-file``, ``--peer-key-file``) work too, so a node's files do. They are
  not read from ``$RAFTKV_CACERT`` and the like, which are the HTTP API's: a node may
  serve HTTPS on a plain raft port. A compat ``SyncObj`` has no TLS.
- **Who answers.** ``EmbeddedNode`` serves ``NodeAdmin`` (raftkv's own view and
  membership commands on its group), and so does a ``raftkv serve`` node, for its
  default group (tables and the placement topology are ``raftkv cluster``'s, over
  HTTP); a compat ``SyncObj`` serves ``raftkv.compat.pysyncobj.admin.SyncObjAdmin``
  (PySyncObj's ``getStatus()`` keys and semantics). A node built on the driver alone
  (``admin_handler`` None) answers that it serves none.
- **The leader.** Membership changes and transfers run on the leader. A follower answers
  ``NotLeader`` with the leader's id and address, and the client asks the leader
  instead (at most ``MAX_REDIRECTS`` times), as ``raftkv.client.Client`` follows 421s.
- **Blocking work off the loop.** The driver calls a handler on its loop thread, which
  must not block; ``NodeAdmin`` runs each command on a thread of its own (admin
  requests are rare) and the driver sends the answer when it is done.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import ssl
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from raftkv.tls import client_context
from raftkv.transport import codec
from raftkv.transport.blocking import LinkError, PeerLink
from raftkv.transport.tcp import parse_addr

if TYPE_CHECKING:
    from raftkv.embedded import EmbeddedNode

__all__ = ["AdminClient", "AdminError", "CommandFailed", "NodeAdmin", "in_thread", "main"]

DEFAULT_TIMEOUT = 30.0
MAX_REDIRECTS = 3


class AdminError(Exception):
    """A command failed: the node refused it (``kind`` names the node's error, ``leader``
    and ``leader_addr`` the leader when only it may run the command), or the node could
    not be reached or authenticated (``kind`` is ``Unreachable``)."""

    def __init__(self, kind: str, message: str, leader: str | None = None,
                 leader_addr: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.leader = leader
        self.leader_addr = leader_addr


class CommandFailed(Exception):
    """A service's answer that a command was tried and failed; ``leader`` names the
    leader when the command must run there."""

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


# -- the client ----------------------------------------------------------------------------
class AdminClient:
    """Sends one command at a time to the node at ``address`` ("host:port"), proving
    ``secret`` first; follows a follower's redirection to the leader. ``tls``: for a
    node whose raft port runs TLS, a client context that trusts its CA (and presents a
    certificate, if the node requires one): ``raftkv.tls.client_context(ca, cert, key)``.
    """

    def __init__(self, address: str, secret: bytes, timeout: float = DEFAULT_TIMEOUT,
                 tls: ssl.SSLContext | None = None) -> None:
        parse_addr(address)  # ValueError now, not at the first request
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self.address = address
        self.secret = secret
        self.timeout = timeout
        self.tls = tls  # a client context (raftkv.tls.client_context): the port runs TLS
        self.answered_by = address  # the node that answered the last request

    def request(self, command: str, args: list[Any] | None = None) -> Any:
        """The command's result; ``AdminError`` if the node refused it or cannot be
        reached, ``ValueError`` for an address that is not host:port."""
        address = self.address
        for _ in range(MAX_REDIRECTS + 1):
            try:
                result = self._exchange(address, command, list(args or []))
            except AdminError as e:
                if e.leader_addr is None or e.leader_addr == address:
                    raise
                address = e.leader_addr  # a follower: ask the leader it named
                continue
            self.answered_by = address
            return result
        raise AdminError("NotLeader", f"no leader answered after {MAX_REDIRECTS} redirections")

    def _exchange(self, address: str, command: str, args: list[Any]) -> Any:
        try:
            with PeerLink(address, self.secret, "", "", timeout=self.timeout,
                          tls=self.tls) as link:
                rid = random.getrandbits(62)
                link.send_items([codec.encode_admin(rid, command, args)])
                while True:
                    for frame in link.read_frames("answer"):
                        got = _answer(frame, rid, address)
                        if got is not None:
                            return got[0]
        except LinkError as e:
            raise AdminError("Unreachable", str(e)) from None


def _answer(frame: object, rid: int, address: str) -> tuple[Any] | None:
    """The answer to request ``rid`` in ``frame``, if it holds it (``AdminError`` if it
    is a refusal)."""
    for item in frame if type(frame) is list else []:
        try:
            got, ok, result = codec.decode_admin_reply(item)
        except codec.WireError:
            continue
        if got != rid:
            continue
        if ok:
            return (result,)
        if not (type(result) is list and len(result) == 4):
            raise AdminError("WireError", f"{address}: malformed error answer")
        kind, message, leader, leader_addr = result
        raise AdminError(str(kind), str(message), leader, leader_addr)
    return None


# -- the service for an EmbeddedNode ------------------------------------------------------
def in_thread(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` on a thread of its own; its outcome lands on the Future."""
    fut: Future[Any] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - the caller's to report
            fut.set_exception(e)

    threading.Thread(target=run, name="raftkv-admin", daemon=True).start()
    return fut


def check_args(command: str, args: list[Any], least: int, most: int) -> None:
    """``ValueError`` unless ``args`` are ``least``..``most`` non-empty strings."""
    if not least <= len(args) <= most or not all(type(a) is str and a for a in args):
        want = f"{least}" if least == most else f"{least} to {most}"
        raise ValueError(f"{command} takes {want} non-empty string argument(s), got {args!r}")


class NodeAdmin:
    """Answers admin requests for an ``EmbeddedNode``'s group (module docstring).

    ``status``: this node's view of its group. ``add NODE [RAFT_ADDR]`` adds a learner
    (PRE_FOLLOWER) that the leader promotes once it has caught up (RAFT_ADDR defaults to
    NODE, for nodes named by their address); ``promote NODE``, ``remove NODE``;
    ``transfer [NODE]`` hands leadership to NODE, or to the most up-to-date voter.
    """

    def __init__(self, node: EmbeddedNode) -> None:
        self.node = node

    def __call__(self, command: str, args: list[Any]) -> Future[Any]:
        if command == "status":
            check_args(command, args, 0, 0)
            return in_thread(self.status)
        if command == "add":
            check_args(command, args, 1, 2)
            return in_thread(self.add, *args)
        if command in ("remove", "promote"):
            check_args(command, args, 1, 1)
            return in_thread(self.remove if command == "remove" else self.promote, *args)
        if command == "transfer":
            check_args(command, args, 0, 1)
            return in_thread(self.transfer, *args)
        raise ValueError(f"unknown admin command {command!r} (this node serves status, "
                         "add, remove, promote and transfer)")

    def status(self) -> dict[str, Any]:
        node = self.node
        st = node.status()
        g = st["groups"][node.group]
        out = {"id": st["id"], "raft_addr": st["raft_addr"], "group": node.group}
        out.update((k, g[k]) for k in ("role", "term", "leader", "commit", "applied",
                                        "checkpoint", "first_index", "last_index",
                                        "members", "peers", "quiesced"))
        out["leader_addr"] = (st["raft_addr"] if g["leader"] == st["id"]
                              else st["addresses"].get(g["leader"]))
        out["connected"] = st["connected"]
        return out

    def add(self, node_id: str, raft_addr: str | None = None) -> dict[str, Any]:
        addr = node_id if raft_addr is None else raft_addr
        try:
            parse_addr(addr)
        except ValueError:
            raise ValueError(f"add {node_id}: give the node's raft address (host:port) "
                             "after its id") from None
        return {"index": self.node.add_learner(node_id, addr)}

    def promote(self, node_id: str) -> dict[str, Any]:
        return {"index": self.node.promote(node_id)}

    def remove(self, node_id: str) -> dict[str, Any]:
        return {"leader": self.node.remove(node_id)}

    def transfer(self, node_id: str | None = None) -> dict[str, Any]:
        to = node_id if node_id is not None else self.node.most_up_to_date_voter()
        if to is None:
            leader = self.node.leader()
            if leader != self.node.node_id:
                raise CommandFailed("transfer must run on the leader", leader)
            raise CommandFailed("no connected voter to transfer leadership to")
        self.node.transfer_leadership(to)
        return {"leader": to}


# -- the command line ----------------------------------------------------------------------
def _format(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else str(value)


def format_status(status: dict[str, Any]) -> str:
    """``key: value`` lines, sorted, as PySyncObj's ``syncobj_admin`` prints a status."""
    return "\n".join(f"{k}: {_format(v)}" for k, v in sorted(status.items()))


def outcome_line(success: bool, command: str, args: list[Any]) -> str:
    """``SUCCESS ADD n4`` / ``FAIL ADD n4``: syncobj_admin's answer to a command."""
    return " ".join(["SUCCESS" if success else "FAIL", command.upper(), *map(str, args)])


def secret_from(args: argparse.Namespace) -> bytes:
    """The secret the options name: a file, a compat password, ``RAFTKV_SECRET``, or the
    compat layer's public no-password secret."""
    if args.secret_file is not None:
        from raftkv.server.serve import read_secret

        return read_secret(args.secret_file)
    if args.password is not None:
        if not args.password:
            raise ValueError("--password must not be empty")
        return str(args.password).encode()
    env = os.environ.get("RAFTKV_SECRET", "").encode()
    if env:
        return env
    from raftkv.compat.pysyncobj.config import DEV_SECRET

    return DEV_SECRET


def parser() -> argparse.ArgumentParser:
    """The ``raftkv`` command's parser conventions: a usage error is one line, exit 1."""
    from raftkv.cli import _Parser  # the raftkv command's own (usage errors: one line)

    p = _Parser(
        prog="raftkv admin",
        description="administer an embedded raftkv node (or a raftkv.compat.pysyncobj "
                    "SyncObj) over its raft port, like PySyncObj's syncobj_admin")
    p.add_argument("--conn", required=True, metavar="HOST:PORT", help="the node's raft address")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--secret-file", help="file holding the cluster secret")
    secret.add_argument("--password", help="a compat SyncObj's SyncObjConf.password")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds (default 30)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    # The raft port's TLS (a node's --peer-* flags): the raftkv command's names, or the
    # node's own. Not read from $RAFTKV_CACERT etc.: those are the HTTP API's, and a node
    # may serve HTTPS with a plain raft port.
    p.add_argument("--cacert", "--peer-trusted-ca-file", dest="cacert", metavar="FILE",
                   help="the raft port runs TLS: verify the node against this CA file")
    p.add_argument("--cert", "--peer-cert-file", dest="cert", metavar="FILE",
                   help="the raft port runs TLS: present this certificate (a node with "
                        "--peer-client-cert-auth requires one signed by its CA)")
    p.add_argument("--key", "--peer-key-file", dest="key", metavar="FILE",
                   help="the certificate's private key")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="the node's view of its cluster")
    add = sub.add_parser("add", help="add a node (a learner, promoted once caught up)")
    add.add_argument("node")
    add.add_argument("raft_addr", nargs="?", help="default: NODE (compat nodes are addresses)")
    for name in ("remove", "promote"):
        sub.add_parser(name).add_argument("node")
    sub.add_parser("transfer", help="hand leadership over (default: the most up-to-date "
                                    "voter)").add_argument("node", nargs="?")
    sub.add_parser("set-version", help="a compat SyncObj's setCodeVersion").add_argument(
        "version", type=int)
    return p


def run(client: AdminClient, command: str, args: list[Any], as_json: bool) -> int:
    """Send one command and print its outcome; the exit status."""
    try:
        result = client.request(command, args)
    except AdminError as e:
        if e.kind == "Unreachable" or command == "status":
            raise
        if as_json:
            print(json.dumps({"ok": False, "error": e.kind, "message": str(e),
                              "leader": e.leader}))
        else:
            print(outcome_line(False, command, args))
        print(f"error: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"ok": True, "node": client.answered_by, "result": result},
                         sort_keys=True))
    elif command == "status":
        print(format_status(result) if isinstance(result, dict) else result)
    else:
        print(outcome_line(True, command, args))
    return 0


def main(argv: list[str]) -> int:
    """``raftkv admin ...``; PySyncObj's own arguments (``-conn``, ``-status``, ...) go
    to ``raftkv.compat.pysyncobj.syncobj_admin``."""
    if argv and argv[0] in ("-conn", "-pass", "-status", "-add", "-remove", "-set_version",
                            "-transfer"):
        from raftkv.compat.pysyncobj.syncobj_admin import main as syncobj_admin

        return syncobj_admin(argv)
    from raftkv.cli import UsageError

    try:
        args = parser().parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 1
    command = args.command.replace("-", "_")
    rest: list[Any] = []
    if command == "add":
        rest = [args.node] + ([args.raft_addr] if args.raft_addr else [])
    elif command in ("remove", "promote"):
        rest = [args.node]
    elif command == "transfer":
        rest = [args.node] if args.node else []
    elif command == "set_version":
        rest = [args.version]
    try:
        tls = None
        if args.cacert or args.cert or args.key:
            tls = client_context(args.cacert, args.cert, args.key)
        client = AdminClient(args.conn, secret_from(args), args.timeout, tls)
        return run(client, command, rest, args.json)
    except (AdminError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
