"""Single-key operations over HTTP, for any group: the one definition of what
``GET|PUT|DELETE /v1/kv/{key}`` and ``/v1/tables/{t}/kv/{key}`` mean.

``parse_kv`` reads a request into a ``KvRequest``; ``serve_kv`` runs it against one Raft
group of the node (the default group, or a table partition's) and answers. The default
group's handler and the table handler both go through these two functions, so a table
key has exactly the semantics of a default-group key:

- ``GET``: the value, linearizable (a ReadIndex round through the leader, Raft §6.4);
  ``?stale=true`` reads the local replica. 404 if absent. The key's revisions
  (``raftkv.storage.revisions``) come as headers ``X-Raftkv-Create-Revision``,
  ``X-Raftkv-Mod-Revision`` and ``X-Raftkv-Version``; ``?meta=true`` answers JSON instead:
  ``{"key", "value"`` (both base64), ``"create_revision", "mod_revision", "version"}``.
- ``PUT``: the body is the value; ``{"index": N}`` (N is the key's new mod revision). With
  ``?prev_value=V`` (the value must be V), ``?prev_absent=true`` (the key must be absent)
  or ``?prev_index=R`` (the key's mod revision must be R; 0: absent) it is a
  compare-and-set, decided by the state machine at the entry's place in the log: 200
  ``{"index", "swapped": true}`` or 412 ``{"index", "swapped": false}``. Giving more than
  one is a 400. ``?lease=ID`` attaches the key to a lease (``raftkv.server.leases``; 404
  if it does not exist, and nothing is written).
- ``DELETE``: ``{"index": N}``; with ``?prev_value=V`` or ``?prev_index=R`` a
  compare-and-delete (200/412 as above). Deleting an absent key is not an error.

Any other query parameter is a 400 (``requests.check_query``): a misspelt
``?prev_valeu=`` must not turn a compare-and-set into a blind overwrite. Everything but
a stale read needs a leader: a node that knows none answers 503 at once
(``requests.require_leader``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from raftkv.client import KEY_NOT_FOUND
from raftkv.node.driver import Node
from raftkv.server.requests import (
    check_query,
    error,
    flag,
    path_key,
    query_bytes,
    quoted,
    require_leader,
    wait,
)
from raftkv.storage.commands import (
    MAX_VALUE_BYTES,
    CommandError,
    encode_cas,
    encode_cas_index,
    encode_delete,
    encode_put,
    encode_put_lease,
)
from raftkv.storage.leases import check_lease_id
from raftkv.storage.revisions import KeyMeta

_ACCEPTED = {"GET": ("stale", "meta"),
             "PUT": ("prev_value", "prev_absent", "prev_index", "lease"),
             "DELETE": ("prev_value", "prev_index")}
REVISION_HEADERS = ("X-Raftkv-Create-Revision", "X-Raftkv-Mod-Revision", "X-Raftkv-Version")


@dataclass(frozen=True)
class KvRequest:
    """One parsed single-key request. ``compare``: the write is conditional, on
    ``expected`` (None: the key must be absent), or on the mod revision ``expected_index``
    if that is set."""

    method: str
    key: bytes
    value: bytes = b""
    stale: bool = False
    meta: bool = False
    compare: bool = False
    expected: bytes | None = None
    expected_index: int | None = None
    lease: int = 0


async def parse_kv(request: web.Request, prefix: str) -> KvRequest:
    """The ``KvRequest`` for ``request``, whose path is ``<prefix><key>``; ``CommandError``
    (400) or a 413 for bad input. Reads the body of a PUT."""
    method = request.method
    if method not in _ACCEPTED:
        raise web.HTTPMethodNotAllowed(method, list(_ACCEPTED))
    key = path_key(request, prefix)
    check_query(request, _ACCEPTED[method])
    if method == "GET":
        return KvRequest("GET", key, stale=flag(request, "stale"), meta=flag(request, "meta"))
    raw_index = query_bytes(request, "prev_index")
    expected_index = None
    if raw_index is not None:
        text = raw_index.decode("ascii", "replace")
        if not text.isdigit() or len(text) > 18:
            raise CommandError(f"?prev_index is a mod revision (an integer, 0: the key must "
                               f"be absent), not {quoted(text)}")
        expected_index = int(text)
    expected = query_bytes(request, "prev_value")
    absent = method == "PUT" and flag(request, "prev_absent")
    if method == "PUT" and not absent and query_bytes(request, "prev_absent") is not None:
        # etcd v2's prevExist=false means "must be absent": read either way, a false
        # here would silently turn a compare-and-set into an unconditional put.
        raise CommandError("?prev_absent takes only true (the key must be absent); leave "
                           "it out for an unconditional put, or give ?prev_value=V")
    if (expected is not None) + absent + (expected_index is not None) > 1:
        raise CommandError("give one of prev_value, prev_absent or prev_index")
    compare = expected is not None or absent or expected_index is not None
    if method == "DELETE":
        return KvRequest("DELETE", key, compare=compare, expected=expected,
                         expected_index=expected_index)
    if (request.content_length or 0) > MAX_VALUE_BYTES:
        raise web.HTTPRequestEntityTooLarge(
            MAX_VALUE_BYTES, request.content_length or 0, content_type="application/json",
            text=json.dumps({"error": f"a value may hold at most {MAX_VALUE_BYTES} bytes"}))
    value = await request.read()
    lease = 0
    raw_lease = query_bytes(request, "lease")
    if raw_lease is not None:
        text = raw_lease.decode("ascii", "replace")
        if not text.isdigit() or len(text) > 19:
            raise CommandError(f"?lease is a lease id (a positive integer), not {quoted(text)}")
        if compare:
            raise CommandError("a put to a lease cannot also compare (use a transaction)")
        lease = check_lease_id(int(text))
    return KvRequest("PUT", key, value=value, compare=compare, expected=expected,
                     expected_index=expected_index, lease=lease)


def _index(index: int, result: object) -> int:
    return index


def _swapped(index: int, result: object) -> tuple[bool, int]:
    return bool(result), index


def meta_json(key: bytes, m: KeyMeta) -> dict[str, Any]:
    """A key's value and revisions as JSON (``?meta=true``, a transaction's get)."""
    return {"key": base64.b64encode(key).decode(), "value": base64.b64encode(m.value).decode(),
            "create_revision": m.create_revision, "mod_revision": m.mod_revision,
            "version": m.version}


async def serve_kv(node: Node, group: str, req: KvRequest) -> web.Response:
    """Run ``req`` against ``group`` on ``node`` and answer (module docstring)."""
    if not req.stale:
        require_leader(node, group)
    if req.method == "GET":
        key = req.key
        got: KeyMeta | None = await wait(node.read_kv(group, lambda s: s.get_meta(key),
                                                   linearizable=not req.stale))
        if got is None:
            return error(404, KEY_NOT_FOUND)
        if req.meta:
            return web.json_response(meta_json(key, got))
        revs = (got.create_revision, got.mod_revision, got.version)
        return web.Response(body=got.value, content_type="application/octet-stream",
                            headers={h: str(v) for h, v in zip(REVISION_HEADERS, revs,
                                                               strict=True)})
    new = req.value if req.method == "PUT" else None
    if req.compare:
        cmd = (encode_cas(req.key, req.expected, new) if req.expected_index is None
               else encode_cas_index(req.key, req.expected_index, new))
        swapped, index = await wait(node.propose(group, cmd, _swapped))
        return web.json_response({"index": index, "swapped": swapped},
                                 status=200 if swapped else 412)
    if req.lease:
        ok, index = await wait(node.propose(
            group, encode_put_lease(req.key, req.value, req.lease), _swapped))
        if not ok:
            return error(404, f"lease {req.lease} not found: nothing was written",
                         index=index)
        return web.json_response({"index": index})
    cmd = encode_put(req.key, req.value) if new is not None else encode_delete(req.key)
    return web.json_response({"index": await wait(node.propose(group, cmd, _index))})
