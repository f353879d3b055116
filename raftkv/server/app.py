"""The HTTP API of ``raftkv serve`` (aiohttp), over an embedded ``RaftKV``.

Endpoints (JSON bodies and errors; values travel raw as the body), with the role a
token needs for each when authentication is on (``ROLES``, ``raftkv.server.auth``):

- ``GET /v1/kv/{key}`` (read): the value (linearizable; ``?stale=true`` reads the local
  replica). 404 if absent. The key is the percent-decoded path segment, as bytes: any
  1..511 bytes.
- ``PUT /v1/kv/{key}`` (write): the body is the value; ``{"index": N}``. With
  ``?prev_value=V`` (or ``?prev_absent=true``) it is a compare-and-set: 200 with
  ``{"index", "swapped": true}``, or 412 with ``"swapped": false``.
- ``DELETE /v1/kv/{key}`` (write): ``{"index": N}`` (deleting an absent key is not an
  error).
- ``GET /v1/kv?prefix=P`` or ``?start=A&end=B`` (read): one page of a range read, with
  ``limit``, ``continue``, ``keys_only``, ``count_only`` and ``stale``
  (``raftkv.server.range_ops``).
- ``POST /v1/batch`` (write): many puts/deletes as ONE log entry, atomically
  (``decode_batch_body`` gives the body formats); ``{"index", "ops"}``.
- ``GET /v1/watch?prefix=P&from_revision=R`` (read): the changes to a range, streamed as
  NDJSON revision lines read from the Raft log (``raftkv.server.watch_ops``); 410 with
  ``oldest_revision`` below the compaction point.
- ``/v1/leases`` (grant, keepalive, revoke, list) and ``PUT /v1/kv/{key}?lease=ID``:
  leases, expired by the leader (``raftkv.server.leases``).
- ``POST /v1/txn`` (write): compares, then one of two lists of puts, deletes and gets, as
  ONE log entry (``raftkv.server.txn_ops``).
- ``GET /v1/digest`` (read): ``{"count", "digest", "applied"}`` of this replica
  (``?stale=true`` for the local state as is), for comparing replicas.
- ``GET /v1/snapshot`` (admin): a backup file of the default group (``raftkv.backup``),
  streamed; ``raftkv snapshot save`` writes it and ``raftkv snapshot restore`` makes a new
  cluster's data directories from it.
- ``GET /v1/cluster`` (read): this node's status of every group it hosts, and
  ``"http"``: the HTTP address each node published in the metastore, for the nodes the
  cluster still knows (in the topology, draining, in the metastore or in a group here).
- ``POST /v1/cluster/learners`` ``{"id", "raft_addr"}``;
  ``POST /v1/cluster/members/{id}/promote``; ``DELETE /v1/cluster/members/{id}`` (202
  with the new leader when the leader removes itself: its successor completes it);
  ``POST /v1/cluster/transfer`` ``{"to"}`` (admin).
- ``GET /health`` (no token): liveness. 200 while the node runs, with its id, role and
  leader (``"leader": null`` is not a failure: an election, or a minority partition,
  passes without a restart); ``"status": "starting"`` while its log is replayed (and the
  metastore opened); 503
  only when the driver loop failed, which a restart is the cure for.
- ``GET /ready`` (no token): readiness. 200 once this node knows a leader of the default
  group and of the metastore; 503 while it is replaying its log or knows no leader of
  either. ``docs/operations.md`` shows both as Kubernetes probes.
- ``GET /metrics`` (metrics): Prometheus text format.
- Tables (``/v1/tables...``, ``/v1/cluster/nodes``): see ``raftkv.server.tables``.
- ``POST /v1/test/partition`` ``{"block": [ids]}`` (admin): only with
  ``--enable-test-faults``.

Writes sent to a follower are forwarded to the leader by the node (over the peer
link), so clients need not find the leader for KV traffic. Admin changes must run on
the leader: a follower answers 421 with ``{"leader": id}`` and the Python client retries
there. Errors: 400 bad input, 401 no or unknown token, 403 a token without the route's
role, 404 unknown key, 409 refused membership change, 412 failed compare, 413 oversized
body, 414 oversized URL, 421 not the leader, 503 no leader known / starting / stopping
(with ``Retry-After``; a node that knows no leader says so at once), 504 no outcome in
time (a write may still apply), 500 only for a real fault, always with a message.

The node is attached after the server starts (``Api.attach``): ``raftkv serve`` opens
its HTTP port first, so the probes answer while the log is replayed, and every other
route answers 503 "starting" until then. The placement manager (tables, the topology,
``/ready``'s metastore leader) is attached once built, right after: its routes answer
503 "starting" a little longer, while the default group already serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector

from raftkv.core import NotAMember, TransferRejected
from raftkv.kv import RaftKV
from raftkv.server import auth
from raftkv.server.auth import Role
from raftkv.server.backup_ops import stream_backup
from raftkv.server.kv_ops import parse_kv, serve_kv
from raftkv.server.leases import LeasesApi
from raftkv.server.metrics import HttpMetrics, StatusCollector, exposition
from raftkv.server.range_ops import parse_range, serve_range
from raftkv.server.requests import (
    PARSER_LINE_LIMIT,
    Starting,
    check_fields,
    check_query,
    decode_batch_body,
    error,
    errors_middleware,
    flag,
    json_body,
    require_leader,
    str_field,
    wait,
)
from raftkv.server.tables import Placement, TablesApi
from raftkv.server.txn_ops import parse_txn, serve_txn
from raftkv.server.watch_ops import parse_watch, serve_watch
from raftkv.storage.commands import MAX_COMMAND_BYTES, CommandError
from raftkv.transport.tcp import parse_addr

log = logging.getLogger(__name__)

KV_PREFIX = "/v1/kv/"


# The role each route needs, by (method, route pattern): None means no token at all.
# ``Api.app`` refuses to build an app with a route missing here, so a new endpoint
# cannot ship without someone deciding who may call it. HEAD is GET's (aiohttp adds a
# HEAD route for every GET). ``tests/test_auth_routes.py`` calls every one of them.
ROLES: dict[tuple[str, str], Role | None] = {
    ("GET", "/health"): None,
    ("GET", "/ready"): None,
    # Operational numbers, no data; their own role so a scraper's token reads nothing else.
    ("GET", "/metrics"): Role.METRICS,
    ("GET", "/v1/kv/{key}"): Role.READ,
    ("PUT", "/v1/kv/{key}"): Role.WRITE,
    ("DELETE", "/v1/kv/{key}"): Role.WRITE,
    ("GET", "/v1/kv"): Role.READ,
    ("GET", "/v1/watch"): Role.READ,
    ("POST", "/v1/leases"): Role.WRITE,
    ("GET", "/v1/leases"): Role.READ,
    ("GET", "/v1/leases/{id}"): Role.READ,
    ("POST", "/v1/leases/{id}/keepalive"): Role.WRITE,
    ("DELETE", "/v1/leases/{id}"): Role.WRITE,
    ("GET", "/v1/tables/{table}/partitions/{p}/watch"): Role.READ,
    ("POST", "/v1/batch"): Role.WRITE,
    ("POST", "/v1/txn"): Role.WRITE,
    ("POST", "/v1/tables/{table}/txn"): Role.WRITE,
    ("GET", "/v1/digest"): Role.READ,
    ("GET", "/v1/snapshot"): Role.ADMIN,
    ("GET", "/v1/tables/{table}/partitions/{p}/snapshot"): Role.ADMIN,
    ("GET", "/v1/cluster"): Role.READ,
    ("POST", "/v1/cluster/learners"): Role.ADMIN,
    ("POST", "/v1/cluster/members/{id}/promote"): Role.ADMIN,
    ("DELETE", "/v1/cluster/members/{id}"): Role.ADMIN,
    ("POST", "/v1/cluster/transfer"): Role.ADMIN,
    ("POST", "/v1/test/partition"): Role.ADMIN,
    # raftkv.server.tables
    ("POST", "/v1/tables"): Role.ADMIN,
    ("GET", "/v1/tables"): Role.READ,
    ("GET", "/v1/tables/{table}"): Role.READ,
    ("GET", "/v1/tables/{table}/leaders"): Role.READ,
    ("DELETE", "/v1/tables/{table}"): Role.ADMIN,
    ("PUT", "/v1/tables/{table}/replicas"): Role.ADMIN,
    ("GET", "/v1/tables/{table}/kv/{key}"): Role.READ,
    ("GET", "/v1/tables/{table}/kv"): Role.READ,
    ("GET", "/v1/tables/{table}/partitions/{p}/kv"): Role.READ,
    ("PUT", "/v1/tables/{table}/kv/{key}"): Role.WRITE,
    ("DELETE", "/v1/tables/{table}/kv/{key}"): Role.WRITE,
    ("POST", "/v1/tables/{table}/batch"): Role.WRITE,
    ("POST", "/v1/tables/{table}/partitions/{p}/batch"): Role.WRITE,
    ("GET", "/v1/tables/{table}/partitions/{p}/digest"): Role.READ,
    ("POST", "/v1/cluster/nodes"): Role.ADMIN,
    ("GET", "/v1/cluster/nodes"): Role.READ,
    ("DELETE", "/v1/cluster/nodes/{id}"): Role.ADMIN,
    ("POST", "/v1/cluster/nodes/{id}/drain"): Role.ADMIN,
    ("GET", "/v1/cluster/settings"): Role.READ,
    ("PUT", "/v1/cluster/settings"): Role.ADMIN,
}


def role_of(method: str, canonical: str) -> Role | None:
    """The role a route needs (``KeyError`` for a route ``ROLES`` does not list)."""
    return ROLES[("GET" if method == "HEAD" else method, canonical)]


def required_role(request: web.Request) -> Role | None:
    """The role ``request`` needs (None: none). A request that matched no route (a 404
    or 405 to come) needs a valid token of any role before it is told so."""
    route = request.match_info.route
    if request.match_info.http_exception is not None or route.resource is None:
        return Role.METRICS
    return role_of(route.method, route.resource.canonical)


class Api:
    def __init__(self, node_id: str, registry: CollectorRegistry, faults: bool = False,
                 tokens: auth.Tokens | None = None) -> None:
        """The API of node ``node_id``, which ``attach`` provides once it is built.
        ``tokens``: check bearer tokens (None: the API is open)."""
        self.node_id = node_id
        self.registry = registry
        self.faults = faults
        self.tokens = tokens
        self.tables = TablesApi()
        self.leases = LeasesApi()
        self._kv: RaftKV | None = None
        registry.register(StatusCollector(self._status_sync))
        ProcessCollector(registry=registry)
        self.http_metrics = HttpMetrics(registry)

    def attach(self, kv: RaftKV) -> None:
        """Serve ``kv``: the node's log is replayed and it runs. The default group's
        routes serve from here on; the tables' and the metastore's wait for
        ``attach_placement``, which is built after (its metastore replayed) so that a
        restarted node's first write does not wait for it."""
        self.leases.attach(kv.node, kv.group)
        self._kv = kv

    def attach_placement(self, placement: Placement) -> None:
        """Serve the tables and the cluster's topology through ``placement``."""
        self.tables.attach(placement)

    @property
    def kv(self) -> RaftKV:
        if self._kv is None:
            raise Starting("replaying the log")
        return self._kv

    def _status_sync(self) -> dict[str, Any]:
        return self.kv.node.status().result(timeout=5)

    def app(self) -> web.Application:
        # The request metrics are outermost, so they count what the client got: errors
        # the errors middleware shaped, and the auth middleware's 401s and 403s (it
        # answers them itself, inside both).
        middlewares: list[Middleware] = [self.http_metrics.middleware, errors_middleware]
        if self.tokens is not None:
            middlewares.append(auth.middleware(self.tokens, required_role))
        # The body limit lets a maximal value through and refuses more with a 413.
        app = web.Application(
            client_max_size=MAX_COMMAND_BYTES + 4096, middlewares=middlewares,
            handler_args={"max_line_size": PARSER_LINE_LIMIT},
        )
        r = app.router
        # Any characters, a newline too (".*" stops at one), so every key is routed and
        # an empty one reaches check_key and gets a 400, not a 404.
        r.add_get("/v1/kv", self.kv_range)
        r.add_get("/v1/watch", self.watch)
        r.add_get("/v1/kv/{key:[\\s\\S]*}", self.kv_op)
        r.add_put("/v1/kv/{key:[\\s\\S]*}", self.kv_op)
        r.add_delete("/v1/kv/{key:[\\s\\S]*}", self.kv_op)
        r.add_post("/v1/batch", self.batch)
        r.add_post("/v1/txn", self.txn)
        r.add_get("/v1/digest", self.digest)
        r.add_get("/v1/snapshot", self.snapshot)
        r.add_get("/v1/cluster", self.cluster)
        r.add_post("/v1/cluster/learners", self.add_learner)
        r.add_post("/v1/cluster/members/{id}/promote", self.promote)
        r.add_delete("/v1/cluster/members/{id}", self.remove)
        r.add_post("/v1/cluster/transfer", self.transfer)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/metrics", self.metrics)
        if self.faults:
            r.add_post("/v1/test/partition", self.partition)
        self.tables.install(app)
        self.leases.install(app)
        for route in r.routes():
            assert route.resource is not None
            try:
                role_of(route.method, route.resource.canonical)
            except KeyError:
                raise RuntimeError(f"{route.method} {route.resource.canonical} has no entry "
                                   "in raftkv.server.app.ROLES: decide who may call it") from None
        return app

    # -- KV ---------------------------------------------------------------------------
    async def kv_op(self, request: web.Request) -> web.Response:
        return await serve_kv(self.kv.node, self.kv.group, await parse_kv(request, KV_PREFIX))

    async def watch(self, request: web.Request) -> web.StreamResponse:
        return await serve_watch(self.kv.node, self.kv.group, parse_watch(request), request)

    async def kv_range(self, request: web.Request) -> web.Response:
        return await serve_range(self.kv.node, self.kv.group, parse_range(request))

    async def txn(self, request: web.Request) -> web.Response:
        check_query(request, ())
        return await serve_txn(self.kv.node, self.kv.group,
                               parse_txn(await json_body(request)))

    async def batch(self, request: web.Request) -> web.Response:
        check_query(request, ())
        ops = decode_batch_body(await request.read(), request.content_type)
        require_leader(self.kv.node, self.kv.group)
        index = await wait(self.kv.batch_async(ops))
        return web.json_response({"index": index, "ops": len(ops)})

    async def digest(self, request: web.Request) -> web.Response:
        check_query(request, ("stale",))
        stale = flag(request, "stale")
        if not stale:
            require_leader(self.kv.node, self.kv.group)
        return web.json_response(await wait(self.kv.digest_async(stale)))

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        """A backup file of the default group (``raftkv.server.backup_ops``)."""
        check_query(request, ())
        group = self.kv.group
        return await stream_backup(self.kv.node, group, request, f"raftkv-{group}-{{index}}.snap")

    # -- admin ------------------------------------------------------------------------
    async def cluster(self, request: web.Request) -> web.Response:
        check_query(request, ())
        st = await wait(self.kv.node.status())
        # Every member's HTTP address, for `raftkv cluster status` and the client's
        # discovery: not a drained or removed node's, which stays published and was
        # reported unreachable for ever, failing status (found outside-in).
        p = self.tables.p
        try:
            addrs, known = await self._admin(lambda: (p.http_addrs(),
                                                      p.known_nodes(stale=True)))
        except NotAMember as e:
            # Drained (its metastore replica removed) but still running, and maybe still
            # a member, even the leader, of the default group: its groups' status
            # stands, without the cluster's addresses (found from outside: a 503 here
            # left the default group's leader out of `cluster status`).
            st["http"], st["note"] = {}, f"no cluster addresses: {e}"
            return web.json_response(st)
        known |= {m for g in st["groups"].values() for m in g["members"]}
        st["http"] = {n: a for n, a in addrs.items() if n in known}
        return web.json_response(st)

    async def _admin(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def add_learner(self, request: web.Request) -> web.Response:
        check_query(request, ())
        body = await json_body(request)
        check_fields(body, ("id", "raft_addr"))
        node, addr = str_field(body, "id"), str_field(body, "raft_addr")
        try:
            parse_addr(addr)
        except ValueError as e:
            raise CommandError(f'"raft_addr": {e}') from None
        try:
            index = await self._admin(lambda: self.kv.add_learner(node, addr))
        except ValueError as e:  # a bad id, or another member's address
            raise CommandError(str(e)) from None
        return web.json_response({"index": index, "id": node, "kind": "pre-follower"})

    async def promote(self, request: web.Request) -> web.Response:
        check_query(request, ())
        node = request.match_info["id"]
        index = await self._admin(lambda: self.kv.promote(node))
        return web.json_response({"index": index, "id": node, "kind": "voter"})

    async def remove(self, request: web.Request) -> web.Response:
        check_query(request, ())
        node = request.match_info["id"]
        via = await self._admin(lambda: self.kv.remove(node))
        if via is not None:  # the leader removed itself: its successor completes it
            return web.json_response({"removed": node, "leader": via}, status=202)
        return web.json_response({"removed": node})

    async def transfer(self, request: web.Request) -> web.Response:
        check_query(request, ())
        body = await json_body(request)
        check_fields(body, ("to",))
        to = str_field(body, "to")
        node, gid = self.kv.node, self.kv.group
        voters = await wait(node.call(lambda: set(node.groups[gid].raft.conf.voters)))
        if to not in voters:
            # The leader refuses it too, but a follower that passes the request on never
            # hears so: it would answer 504 after two election timeouts.
            raise TransferRejected(f"{to} is not a voter")
        await self._admin(lambda: self.kv.transfer_leadership(to))
        return web.json_response({"leader": to})

    async def partition(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        check_fields(body, ("block",), "a partition request")
        if "block" not in body:  # an empty body cleared the partition without a word
            raise CommandError('give "block": a list of node ids ([] heals)')
        block = body["block"]
        if not isinstance(block, list) or not all(isinstance(b, str) for b in block):
            raise CommandError('"block" must be a list of node ids')
        transport = self.kv.node.transport
        await wait(self.kv.node.call(lambda: transport.block(set(block))))
        return web.json_response({"blocked": sorted(block)})

    # -- observability ----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Liveness (module docstring): is this process worth keeping?"""
        if self._kv is None or not self.tables.attached:  # built a piece at a time
            return web.json_response({"status": "starting", "id": self.node_id,
                                      "leader": None})
        node, gid = self._kv.node, self._kv.group
        if node.failure is not None:
            return error(503, f"driver loop failed: {node.failure!r}", id=self.node_id)
        # A call through the loop, so a loop that hangs fails the probe by its timeout.
        role, term, leader = await wait(node.call(
            lambda: (node.groups[gid].raft.role.name.lower(), node.groups[gid].raft.term,
                     node.groups[gid].leader)))
        return web.json_response({"status": "ok", "id": self.node_id, "leader": leader,
                                  "role": role, "term": term})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness (module docstring): should a load balancer send requests here?"""
        if self._kv is None:
            return error(503, "starting: replaying the log", id=self.node_id, ready=False)
        node = self._kv.node
        if node.failure is not None:
            return error(503, f"driver loop failed: {node.failure!r}", id=self.node_id,
                         ready=False)
        if not self.tables.attached:  # the placement manager is still being built
            return error(503, "starting: opening the metastore", id=self.node_id,
                         ready=False)
        groups = (self._kv.group, self.tables.p.meta.group)
        leaders, removed, refused = await wait(node.call(lambda: (
            {g: node.groups[g].leader for g in groups},
            {g: node.groups[g].raft.removed for g in groups if node.groups[g].raft.removed},
            dict(node.transport.cluster_refusals))))
        if removed:
            by, index = next(iter(removed.values()))
            return error(503, f"removed from {' and '.join(removed)}: {by} applied a "
                         f"configuration without this node at index {index}; it will not "
                         "serve unless added back", id=self.node_id, ready=False)
        missing = [g for g in groups if leaders[g] is None]
        if missing:
            # Refused by its peers as another cluster's node, it would wait for ever, and
            # said only "no leader" (found from outside: the reason was in the log alone).
            why = ("; nodes of another cluster, refused at the handshake: " + ", ".join(
                f"{p} ({c})" for p, c in sorted(refused.items())) if refused else "")
            return error(503, f"no leader known for {' and '.join(missing)}{why}",
                         id=self.node_id, ready=False, leaders=leaders)
        return web.json_response({"ready": True, "id": self.node_id, "leaders": leaders})

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(
            None, exposition, self.registry
        )
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
