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
- ``GET /v1/cluster``: this node's status of every group it hosts, and ``"http"``: the
  HTTP address each node published in the metastore.
- ``POST /v1/cluster/learners`` ``{"id", "raft_addr"}``;
  ``POST /v1/cluster/members/{id}/promote``; ``DELETE /v1/cluster/members/{id}`` (202
  with the new leader when the leader removes itself: its successor completes it);
  ``POST /v1/cluster/transfer`` ``{"to"}``.
- ``GET /health``: 200 with the node's id, role and leader; 503 when no leader is known
  or the driver loop failed. ``GET /metrics`` (Prometheus text format).
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
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector

from raftkv.kv import RaftKV
from raftkv.server.kv_ops import parse_kv, serve_kv
from raftkv.server.metrics import HttpMetrics, StatusCollector, exposition
from raftkv.server.requests import (
    check_query,
    decode_batch_body,
    error,
    errors_middleware,
    flag,
    json_body,
    str_field,
    wait,
)
from raftkv.server.tables import Placement, TablesApi
from raftkv.storage.commands import MAX_COMMAND_BYTES, CommandError
from raftkv.transport.tcp import parse_addr

log = logging.getLogger(__name__)

KV_PREFIX = "/v1/kv/"


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
        ProcessCollector(registry=registry)
        self.http_metrics = HttpMetrics(registry)

    def _status_sync(self) -> dict[str, Any]:
        return self.kv.node.status().result(timeout=5)

    def app(self) -> web.Application:
        # The body limit lets a maximal value through and refuses more with a 413.
        app = web.Application(
            client_max_size=MAX_COMMAND_BYTES + 4096,
            middlewares=[self.http_metrics.middleware, errors_middleware],
        )
        r = app.router
        # ".*" so an empty key reaches check_key and gets a 400, not a 404.
        r.add_get("/v1/kv/{key:.*}", self.kv_op)
        r.add_put("/v1/kv/{key:.*}", self.kv_op)
        r.add_delete("/v1/kv/{key:.*}", self.kv_op)
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
    async def kv_op(self, request: web.Request) -> web.Response:
        return await serve_kv(self.kv.node, self.kv.group, await parse_kv(request, KV_PREFIX))

    async def batch(self, request: web.Request) -> web.Response:
        ops = decode_batch_body(await request.read(), request.content_type)
        index = await wait(self.kv.batch_async(ops))
        return web.json_response({"index": index, "ops": len(ops)})

    async def digest(self, request: web.Request) -> web.Response:
        check_query(request, ("stale",))
        return web.json_response(await wait(self.kv.digest_async(flag(request, "stale"))))

    # -- admin ------------------------------------------------------------------------
    async def cluster(self, request: web.Request) -> web.Response:
        st = await wait(self.kv.node.status())
        if self.tables is not None:  # every node's HTTP address, for `raftkv cluster status`
            st["http"] = await self._admin(self.tables.p.http_addrs)
        return web.json_response(st)

    async def _admin(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def add_learner(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        node, addr = str_field(body, "id"), str_field(body, "raft_addr")
        try:
            parse_addr(addr)
        except ValueError as e:
            raise CommandError(f'"raft_addr": {e}') from None
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
        to = str_field(await json_body(request), "to")
        await self._admin(lambda: self.kv.transfer_leadership(to))
        return web.json_response({"leader": to})

    async def partition(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        block = body.get("block", [])
        if not isinstance(block, list) or not all(isinstance(b, str) for b in block):
            raise CommandError('"block" must be a list of node ids')
        transport = self.kv.node.transport
        await wait(self.kv.node.call(lambda: transport.block(set(block))))
        return web.json_response({"blocked": sorted(block)})

    # -- observability ----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.kv.node.failure is not None:
            return error(503, f"driver loop failed: {self.kv.node.failure!r}")
        st = await wait(self.kv.node.status())
        g = st["groups"][self.kv.group]
        # No known leader: the node runs but cannot serve a write or a linearizable
        # read, which is what a load balancer asks /health (etcd answers the same way).
        ok = g["leader"] is not None
        return web.json_response({"status": "ok" if ok else "no leader", "id": st["id"],
                                  "leader": g["leader"], "role": g["role"],
                                  "term": g["term"]}, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(
            None, exposition, self.registry
        )
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
