"""Transactions over HTTP (``POST /v1/txn``, ``POST /v1/tables/{t}/txn``): the JSON form of
``raftkv.storage.txn``, one atomic log entry.

Request::

    {"compare": [{"key": K, "target": "value" | "mod" | "create" | "version" | "exists",
                  "op": "==" | "!=" | "<" | ">", "operand": V}, ...],
     "success": [{"put": {"key": K, "value": V}} | {"delete": {"key": K}}
                 | {"get": {"key": K}}, ...],
     "failure": [...]}

Keys and values are strings (UTF-8); give ``"key_b64"``, ``"value_b64"`` or
``"operand_b64"`` instead for bytes that are not. A value compare's operand is a value, a
revision or version compare's an integer (0 for an absent key), an existence compare's a
boolean. Answer (200 whichever branch ran)::

    {"succeeded": bool, "index": N,
     "responses": [{"put": {}} | {"delete": {"deleted": bool}}
                   | {"get": {"key", "value" (base64), "create_revision", "mod_revision",
                              "version"} | null}, ...]}

A table's transaction must keep every key in one partition (each partition is its own
Raft group, and an entry belongs to one log): otherwise a 400 names the partitions.
Malformed input is a 400 that says what is wrong, and nothing is proposed.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import web

from raftkv.node.driver import Node
from raftkv.server.kv_ops import meta_json
from raftkv.server.requests import check_fields, require_leader, wait
from raftkv.storage.commands import CommandError, encode_txn
from raftkv.storage.revisions import KeyMeta
from raftkv.storage.txn import CmpOp, Kind, Target, Txn, TxnResult, check_txn

_TARGETS = {t.name.lower(): t for t in Target}
_OPS = {"==": CmpOp.EQ, "!=": CmpOp.NE, "<": CmpOp.LT, ">": CmpOp.GT}
_KINDS = {k.name.lower(): k for k in Kind}


def _bytes(doc: dict[str, Any], field: str, what: str) -> bytes:
    """``doc[field]`` as UTF-8, or ``doc[field + "_b64"]`` decoded."""
    plain, b64 = doc.get(field), doc.get(field + "_b64")
    if (plain is None) == (b64 is None):
        raise CommandError(f"{what}: give exactly one of {field!r} or {field + '_b64'!r}")
    if plain is not None:
        if not isinstance(plain, str):
            raise CommandError(f"{what}: {field!r} must be a string")
        try:
            return plain.encode()
        except UnicodeEncodeError:
            raise CommandError(f"{what}: {field!r} is not valid UTF-8 text") from None
    if not isinstance(b64, str):
        raise CommandError(f"{what}: {field + '_b64'!r} must be a base64 string")
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise CommandError(f"{what}: {field + '_b64'!r} is not base64") from None


def _obj(x: object, what: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise CommandError(f"{what} must be a JSON object")
    return x


def parse_txn(body: dict[str, Any]) -> Txn:
    """The ``Txn`` of a request body; ``CommandError`` (400) for anything malformed."""
    check_fields(body, ("compare", "success", "failure"), "a transaction")
    compares = []
    for i, c in enumerate(_list(body, "compare")):
        c = _obj(c, f"compare {i}")
        what = f"compare {i}"
        _only(c, ("key", "key_b64", "target", "op", "operand", "operand_b64"), what)
        target = _TARGETS.get(str(c.get("target")))
        op = _OPS.get(str(c.get("op")))
        if target is None:
            raise CommandError(f"{what}: target must be one of {', '.join(_TARGETS)}")
        if op is None:
            raise CommandError(f"{what}: op must be one of {', '.join(_OPS)}")
        if target is Target.VALUE:
            operand: object = _bytes(c, "operand", what)
        elif "operand_b64" in c:
            # Only a value is bytes (found from outside: it was accepted and ignored).
            raise CommandError(f"{what}: 'operand_b64' is for a value compare; a "
                               f"{c.get('target')} compare takes 'operand'")
        else:
            operand = c.get("operand")
        compares.append([_bytes(c, "key", what), int(target), int(op), operand])
    branches = []
    for name in ("success", "failure"):
        ops = []
        for i, o in enumerate(_list(body, name)):
            o = _obj(o, f"{name} op {i}")
            if len(o) != 1 or next(iter(o)) not in _KINDS:
                raise CommandError(f"{name} op {i} must be one of {{\"put\": ...}}, "
                                   f"{{\"delete\": ...}}, {{\"get\": ...}}")
            kind = next(iter(o))
            arg = _obj(o[kind], f"{name} op {i}")
            _only(arg, ("key", "key_b64", "value", "value_b64") if kind == "put"
                  else ("key", "key_b64"), f"{name} op {i} ({kind})")
            value = _bytes(arg, "value", f"{name} op {i}") if kind == "put" else None
            ops.append([int(_KINDS[kind]), _bytes(arg, "key", f"{name} op {i}"), value])
        branches.append(ops)
    return check_txn(compares, branches[0], branches[1])


def _only(doc: dict[str, Any], fields: tuple[str, ...], what: str) -> None:
    """400 for a field outside ``fields``: an etcd field raftkv does not have (a
    ``range_end``) must not turn into a single-key operation silently."""
    check_fields(doc, fields, what, "; a transaction's operations are on single keys")


def _list(body: dict[str, Any], field: str) -> list[Any]:
    got = body.get(field, [])
    if not isinstance(got, list):
        raise CommandError(f"a transaction's {field!r} must be a list")
    return got


def txn_keys(txn: Txn) -> list[bytes]:
    """Every key the transaction names (compares and both branches)."""
    return ([c.key for c in txn.compares] + [o.key for o in txn.success]
            + [o.key for o in txn.failure])


def as_result(result: object) -> TxnResult:
    """``result`` as a ``TxnResult``: a write forwarded to the leader comes back as the
    msgpack arrays of one (``[succeeded, [None | bool | [value, create, mod, version,
    lease]]]``)."""
    if isinstance(result, TxnResult):
        return result
    if not isinstance(result, list | tuple) or len(result) != 2:
        raise ValueError(f"not a transaction's result: {result!r:.80}")
    ok, responses = result
    return TxnResult(bool(ok), tuple(KeyMeta(*r) if isinstance(r, list | tuple) else r
                                     for r in responses))


def result_json(txn: Txn, index: int, result: object) -> dict[str, Any]:
    """The answer to a transaction applied at ``index`` with ``result``."""
    result = as_result(result)
    ops = txn.success if result.succeeded else txn.failure
    out: list[dict[str, Any]] = []
    for op, r in zip(ops, result.responses, strict=True):
        if op.kind is Kind.PUT:
            out.append({"put": {}})
        elif op.kind is Kind.DELETE:
            out.append({"delete": {"deleted": bool(r)}})
        else:
            out.append({"get": None if not isinstance(r, KeyMeta) else meta_json(op.key, r)})
    return {"succeeded": result.succeeded, "index": index, "responses": out}


async def serve_txn(node: Node, group: str, txn: Txn) -> web.Response:
    """Propose ``txn`` to ``group`` on ``node`` and answer with its outcome."""
    cmd = encode_txn(txn)
    require_leader(node, group)
    answer = await wait(node.propose(group, cmd, lambda i, r: result_json(txn, i, r)))
    return web.json_response(answer)
