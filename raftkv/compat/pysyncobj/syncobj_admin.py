"""PySyncObj's ``syncobj_admin`` command, with its arguments and its output::

    python -m raftkv.compat.pysyncobj.syncobj_admin -conn 127.0.0.1:4321 -pass PW -status
    raftkv admin -conn 127.0.0.1:4321 -pass PW -add 127.0.0.1:4324      (the same)

``-status``, ``-add NODE``, ``-remove NODE``, ``-set_version N``, ``-transfer [NODE]``;
the answer is printed as PySyncObj's tool prints it (``key: value`` lines, ``SUCCESS
ADD ...``, ``FAIL ADD ...``). One difference: the exit status is 1 when the command
failed or the node could not be reached (PySyncObj's tool exits 0 whatever happened).
The request travels through ``utility.TcpUtility`` (``raftkv.admin`` underneath).
"""

from __future__ import annotations

import os
import sys
from argparse import ArgumentParser

from raftkv.admin import format_status
from raftkv.compat.pysyncobj.utility import TcpUtility, UtilityException

__all__ = ["checkCorrectAddress", "executeAdminCommand", "main"]


def checkCorrectAddress(address: object) -> bool:
    try:
        host, port = str(address).rsplit(":", 1)
        return bool(host) and 0 < int(port) < 65536
    except ValueError:
        return False


def _parser() -> ArgumentParser:
    from raftkv.cli import _Parser  # a usage error is one line, exit 1, as raftkv's

    parser = _Parser(prog="syncobj_admin")
    parser.add_argument("-conn", action="store", dest="connection", help="address to connect")
    parser.add_argument("-pass", action="store", dest="password", help="cluster's password")
    parser.add_argument("-status", action="store_true", help="send command 'status'")
    parser.add_argument("-add", action="store", dest="add", help="send command 'add'")
    parser.add_argument("-remove", action="store", dest="remove", help="send command 'remove'")
    parser.add_argument("-set_version", action="store", dest="version", type=int,
                        help="set cluster code version")
    parser.add_argument("-transfer", action="store", dest="transfer", nargs="?", const="",
                        default=None, help="transfer leadership to the given node (or the "
                                           "most up-to-date one if omitted)")
    return parser


def _execute(args: list[str]) -> tuple[str, bool]:
    """(what to print, whether the command succeeded)."""
    data = _parser().parse_args(args)
    if not checkCorrectAddress(data.connection):
        return "invalid address to connect", False
    if data.status:
        message: list[object] = ["status"]
    elif data.add:
        if not checkCorrectAddress(data.add):
            return "invalid address to command add", False
        message = ["add", data.add]
    elif data.remove:
        if not checkCorrectAddress(data.remove):
            return "invalid address to command remove", False
        message = ["remove", data.remove]
    elif data.version is not None:
        message = ["set_version", data.version]
    elif data.transfer is not None:
        message = ["transfer", data.transfer]
    else:
        return "invalid command", False
    try:
        result = TcpUtility(data.password).executeCommand(data.connection, message)
    except UtilityException as e:
        return str(e), False
    if isinstance(result, dict):
        return format_status(result), True
    return str(result), str(result).startswith("SUCCESS")


def executeAdminCommand(args: list[str]) -> str:
    """What PySyncObj's ``syncobj_admin`` prints for ``args``."""
    return _execute(args)[0]


def main(args: list[str] | None = None) -> int:
    from raftkv.cli import UsageError

    try:
        out, ok = _execute(sys.argv[1:] if args is None else args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(out)
    sys.stdout.write(os.linesep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
