"""The HTTP API of ``raftkv serve`` (aiohttp), over an embedded ``RaftKV``.

Endpoints (JSON bodies and errors; values travel raw as the body):

- ``GET /v1/kv/{key}``: the value (linearizable; ``?stale=true`` reads the local replica).
  404 if absent. The key is the percent-decoded path segment, as bytes: any 1..511 bytes.
- ``PUT /v1/kv/{key}``: the body is the value; ``{"index": N}``. With
  ``?prev_value=V`` (or ``?prev_absent=true``) it is a compare-and-set: 200 with
  ``{"index", "swapped": true}``, or 412 with ``"swapped": false``.
- ``DELETE /v1/kv/{key}``: ``{"index": N}`` (deleting an absent key is not an error).
- ``POST /v1/batch``: many puts/deletes as ONE log entry, atomically (``decode_batch_body``
  gives the body formats); ``{"index", "ops"}``.
- ``GET /v1/digest``: ``{"count", "digest", "applied"}`` of this replica (``?stale=true``
  for the local state as is), for comparing replicas.
- ``GET /v1/cluster``; ``POST /v1/cluster/learners`` ``{"id", "raft_addr"}``;
  ``POST /v1/cluster/members/{id}/promote``; ``DELETE /v1/cluster/members/{id}`` (202
  with the new leader when the leader removes itself: its successor completes it);
  ``POST /v1/cluster/transfer`` ``{"to"}``.
- ``GET /health``, ``GET /metrics`` (Prometheus text format).
- Tables (``/v1/tables...``, ``/v1/cluster/nodes``): see ``raftkv.server.tables``.
- ``POST /v1/test/partition`` ``{"block": [ids]}``: only with ``--enable-test-faults``.

Writes sent to a follower are forwarded to the leader by the node (over the peer
link), so clients need not find the leader for KV traffic. Admin changes must run on
the leader: a follower answers 421 with ``{"leader": id}`` and the Python client retries
there. Errors: 400 bad input, 404 unknown key, 409 refused membership change, 412 failed
compare, 413 oversized body, 421 not the leader, 503 no leader / stopping, 504 no outcome
in time (a write may still apply), 500 only for a real fault, always with a message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any
from urllib.parse import unquote_to_bytes

import msgpack
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from raftkv.core import ConfChangeRejected, NotLeader, ProposalDropped, TransferRejected
from raftkv.kv import RaftKV
from raftkv.node.errors import NodeStopped, RemoteError, RequestTimeout, UnknownGroup
from raftkv.server.metrics import StatusCollector
from raftkv.server.tables import Placement, TablesApi
from storage.commands import MAX_COMMAND_BYTES, MAX_VALUE_BYTES, CommandError, check_key

log = logging.getLogger(__name__)

KV_PREFIX = "/v1/kv/"
# Status codes for errors a leader reports on a forwarded write, by error kind.
_REMOTE_STATUS = {"CommandError": 400, "NotLeader": 503, "UnknownGroup": 404,
                  "RequestTimeout": 504, "NodeStopped": 503, "ProposalDropped": 503}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def _status_of(e: BaseException) -> web.Response:
    if isinstance(e, CommandError):
        return error(400, str(e))
    if isinstance(e, NotLeader):
        if e.leader is not None:
            return error(421, f"not the leader; the leader is {e.leader}", leader=e.leader)
        return error(503, "no leader is known; retry shortly", leader=None)
    if isinstance(e, ConfChangeRejected | TransferRejected):
        return error(409, str(e))
    if isinstance(e, ProposalDropped):  # a leadership transfer is under way: nothing applied
        return error(503, str(e))
    if isinstance(e, RequestTimeout | TimeoutError):
        return error(504, str(e) or "timed out")
    if isinstance(e, UnknownGroup):
        return error(404, str(e))
    if isinstance(e, NodeStopped):
        return error(503, str(e))
    if isinstance(e, RemoteError):
        return error(_REMOTE_STATUS.get(e.kind, 502), f"leader: {e}", kind=e.kind)
    log.error("request failed", exc_info=e)
    return error(500, f"internal error: {type(e).__name__}: {e}")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            return error(e.status, e.reason)
        raise
    except ConnectionResetError:
        # The client hung up mid-request: nothing was proposed and nobody is listening.
        log.debug("client closed the connection during %s %s", request.method, request.path)
        return error(400, "client closed the connection")
    except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error, never a trace
        return _status_of(e)


# Every driver future resolves or fails by the request timeout; this bound is a backstop so
# an HTTP request can never hang.
WAIT_LIMIT = 60.0


async def _wait(fut: Future[Any]) -> Any:
    """The outcome of a driver future, awaited on the event loop, within WAIT_LIMIT.

    One loop future and one timer: ``wait_for(shield(wrap_future(fut)))`` did the same
    with three futures and their callbacks, a measurable share of a request at thousands
    a second. Cancelling the wait (the client hung up) leaves the driver's future alone,
    as shield did: the write may still commit, and the driver resolves it."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(f: Future[Any]) -> None:  # on the loop thread
        if waiter.done():
            return
        if f.cancelled():
            waiter.cancel()
        elif (exc := f.exception()) is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(f.result())

    def done(f: Future[Any]) -> None:  # on whichever thread resolved it
        try:
            loop.call_soon_threadsafe(settle, f)
        except RuntimeError:
            pass  # the loop closed (the server stopped): nobody is waiting

    def expire() -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError(f"no outcome within {WAIT_LIMIT:.0f}s"))

    timer = loop.call_later(WAIT_LIMIT, expire)
    fut.add_done_callback(done)
    try:
        return await waiter
    finally:
        timer.cancel()


def _key(request: web.Request) -> bytes:
    raw = request.rel_url.raw_path
    if not raw.startswith(KV_PREFIX):
        raise web.HTTPNotFound()
    return check_key(unquote_to_bytes(raw[len(KV_PREFIX):]))


def _flag(request: web.Request, name: str) -> bool:
    v = request.query.get(name, "false").lower()
    if v not in ("true", "false", "1", "0", ""):
        raise CommandError(f"?{name} must be true or false")
    return v in ("true", "1", "")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CommandError("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise CommandError("the body must be a JSON object")
    return body


def decode_batch_body(raw: bytes, content_type: str) -> list[tuple[bytes, bytes | None]]:
    """A batch body: msgpack (``application/x-msgpack``) ``[[key, value|nil], ...]`` with
    binary keys and values, or JSON ``{"ops": [[key, value|null], ...]}`` with strings."""
    if content_type == "application/x-msgpack":
        try:
            ops = msgpack.unpackb(raw, raw=False, max_array_len=1 << 20, max_map_len=0)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as e:
            raise CommandError(f"the body is not msgpack: {e}") from None
    else:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise CommandError('the body must be JSON {"ops": [[key, value], ...]}') from None
        ops = body.get("ops") if isinstance(body, dict) else None
    if not isinstance(ops, list):
        raise CommandError("a batch is a list of [key, value] pairs (value null deletes)")
    out = []
    for op in ops:
        if not (isinstance(op, list) and len(op) == 2):
            raise CommandError(f"batch item {op!r:.60} is not a [key, value] pair")
        k, v = (x.encode() if isinstance(x, str) else x for x in op)
        if not isinstance(k, bytes) or not (v is None or isinstance(v, bytes)):
            raise CommandError("batch keys and values must be strings or bytes")
        out.append((k, v))
    return out


def _str_field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v:
        raise CommandError(f'"{name}" must be a non-empty string')
    return v


class QuietBadRequests(logging.Filter):
    """aiohttp logs every unparsable request at ERROR with a traceback, so any client
    could fill a node's log. Such a request already got its 400: log one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args, record.exc_info = "bad HTTP request: %s", (exc,), None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class Api:
    def __init__(self, kv: RaftKV, registry: CollectorRegistry, faults: bool = False,
                 placement: Placement | None = None) -> None:
        self.kv = kv
        self.registry = registry
        self.faults = faults
        self.tables = TablesApi(placement) if placement is not None else None
        registry.register(StatusCollector(self._status_sync))

    def _status_sync(self) -> dict[str, Any]:
        return self.kv.node.status().result(timeout=5)

    def app(self) -> web.Application:
        # The body limit lets a maximal value through and refuses more with a 413.
        app = web.Application(
            client_max_size=MAX_COMMAND_BYTES + 4096, middlewares=[errors_middleware]
        )
        r = app.router
        # ".*" so an empty key reaches check_key and gets a 400, not a 404.
        r.add_get("/v1/kv/{key:.*}", self.get)
        r.add_put("/v1/kv/{key:.*}", self.put)
        r.add_delete("/v1/kv/{key:.*}", self.delete)
        r.add_post("/v1/batch", self.batch)
        r.add_get("/v1/digest", self.digest)
        r.add_get("/v1/cluster", self.cluster)
        r.add_post("/v1/cluster/learners", self.add_learner)
        r.add_post("/v1/cluster/members/{id}/promote", self.promote)
        r.add_delete("/v1/cluster/members/{id}", self.remove)
        r.add_post("/v1/cluster/transfer", self.transfer)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        if self.faults:
            r.add_post("/v1/test/partition", self.partition)
        if self.tables is not None:
            self.tables.install(app)
        return app

    # -- KV ---------------------------------------------------------------------------
    async def get(self, request: web.Request) -> web.Response:
        value = await _wait(self.kv.get_async(_key(request), stale=_flag(request, "stale")))
        if value is None:
            return error(404, "key not found")
        return web.Response(body=value, content_type="application/octet-stream")

    async def put(self, request: web.Request) -> web.Response:
        key = _key(request)
        if (request.content_length or 0) > MAX_VALUE_BYTES:
            return error(413, f"a value may hold at most {MAX_VALUE_BYTES} bytes")
        value = await request.read()
        q = request.query
        if "prev_index" in q:
            raise CommandError("prev_index is not supported: compare on prev_value")
        if "prev_value" in q or _flag(request, "prev_absent"):
            expected = q["prev_value"].encode() if "prev_value" in q else None
            swapped, index = await _wait(self.kv.cas_async(key, expected, value))
            return web.json_response(
                {"index": index, "swapped": swapped}, status=200 if swapped else 412
            )
        index = await _wait(self.kv.put_async(key, value))
        return web.json_response({"index": index})

    async def batch(self, request: web.Request) -> web.Response:
        ops = decode_batch_body(await request.read(), request.content_type)
        index = await _wait(self.kv.batch_async(ops))
        return web.json_response({"index": index, "ops": len(ops)})

    async def delete(self, request: web.Request) -> web.Response:
        index = await _wait(self.kv.delete_async(_key(request)))
        return web.json_response({"index": index})

    async def digest(self, request: web.Request) -> web.Response:
        return web.json_response(await _wait(self.kv.digest_async(_flag(request, "stale"))))

    # -- admin ------------------------------------------------------------------------
    async def cluster(self, request: web.Request) -> web.Response:
        return web.json_response(await _wait(self.kv.node.status()))

    async def _admin(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def add_learner(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        node, addr = _str_field(body, "id"), _str_field(body, "raft_addr")
        index = await self._admin(lambda: self.kv.add_learner(node, addr))
        return web.json_response({"index": index, "id": node, "kind": "pre-follower"})

    async def promote(self, request: web.Request) -> web.Response:
        node = request.match_info["id"]
        index = await self._admin(lambda: self.kv.promote(node))
        return web.json_response({"index": index, "id": node, "kind": "voter"})

    async def remove(self, request: web.Request) -> web.Response:
        node = request.match_info["id"]
        via = await self._admin(lambda: self.kv.remove(node))
        if via is not None:  # the leader removed itself: its successor completes it
            return web.json_response({"removed": node, "leader": via}, status=202)
        return web.json_response({"removed": node})

    async def transfer(self, request: web.Request) -> web.Response:
        to = _str_field(await _json_body(request), "to")
        await self._admin(lambda: self.kv.transfer_leadership(to))
        return web.json_response({"leader": to})

    async def partition(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        block = body.get("block", [])
        if not isinstance(block, list) or not all(isinstance(b, str) for b in block):
            raise CommandError('"block" must be a list of node ids')
        transport = self.kv.node.transport
        await _wait(self.kv.node.call(lambda: transport.block(set(block))))
        return web.json_response({"blocked": sorted(block)})

    # -- observability ----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.kv.node.failure is not None:
            return error(503, f"driver loop failed: {self.kv.node.failure!r}")
        st = await _wait(self.kv.node.status())
        g = st["groups"][self.kv.group]
        return web.json_response({"status": "ok", "id": st["id"], "leader": g["leader"],
                                  "role": g["role"], "term": g["term"]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(
            None, generate_latest, self.registry
        )
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
