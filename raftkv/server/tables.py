"""Tables in ``raftkv serve``: the metastore group, a ``PlacementManager`` and their HTTP API.

Every node hosts the metastore group (``meta``; the founding peers are its voters, a
``--join``ed node is admitted as a non-voting learner) and a ``PlacementManager``, which
hosts the partition groups (``t.<table>.<p>``) this node is assigned, and a
``LeaderBalancer``, which hands each partition's leadership to its preferred voter.

Endpoints (JSON; errors are ``{"error": ...}``):

- ``POST /v1/tables`` ``{"name", "partitions", "replicas", "storage", "allow_unsafe"}``:
  201 with the descriptor; 400 bad name/numbers or replicas above the topology's node
  count; 409 if it exists. One or two replicas cannot survive one failure
  (``replica_risk``): for an in-memory table that is a 400 unless ``"allow_unsafe":
  true``; otherwise the answer carries a ``"warning"``.
- ``GET /v1/tables``: ``{"tables": [{"name", "partitions", "replicas", "storage"}]}``.
- ``GET /v1/tables/{t}``: the descriptor, its ``generation`` (the descriptor's create
  revision: another for a table dropped and created again under the name) and, per
  partition, ``stable``/``pending``/``planned`` assignments, the IGNITE-16668
  ``switch_reduce``/``switch_append``, ``leader``, ``voters``, ``learners`` (merged from
  every node's own view: ``?local=true`` gives just this node's), plus ``errors``
  (rebalance errors recorded by any node's manager, and for an in-memory table each
  partition that lost a majority of its replicas to restarts) and ``under_replicated``:
  the partitions whose configuration has fewer voters than the table's replicas, a voter
  that does not host the partition, or no known leader, and ``restarted_empty``: the
  partitions of an in-memory table whose every replica restarted at once, so that they
  started again empty (IGNITE-16668's full-partition restart). 404 unknown table.
- ``DELETE /v1/tables/{t}``: ``{"dropped", "revision"}``; 404 unknown table. Every node
  stops the table's partition groups and deletes their files (``PlacementManager.
  drop_table``); a table re-created under the name starts empty. A KV request on the
  table that was in flight answers 404 ``table <t> was dropped``; later ones 404
  ``unknown table``.
- ``PUT /v1/tables/{t}/replicas`` ``{"replicas": n, "allow_unsafe"}``: ``{"revision"}``;
  400 if n exceeds the node count, or is 1 or 2 for an in-memory table without
  ``allow_unsafe`` (and a ``"warning"`` with 1 or 2, as for create).
- ``POST /v1/tables/{t}/batch``: puts and deletes (``requests.decode_batch_body``'s formats)
  split by partition, one atomic entry per partition, the partitions concurrently:
  ``{"ops", "partitions": {p: index}}``; at most ``MAX_BATCH_OPS`` operations in all (400).
  Not atomic across partitions: on a failure the error lists ``applied`` and ``failed``
  partitions.
- ``POST /v1/tables/{t}/partitions/{p}/batch``: msgpack ``{"id", "ops"}``, one idempotent
  batch into partition p (the Spark loader's): ``{"index", "ops", "applied"}``.
- ``GET /v1/tables/{t}/partitions/{p}/digest``: this node's replica's user rows, count and
  digest (``?min_index``, ``?linearizable``, ``?keys``; the Spark verifier's); 503 from a
  replica that started empty and has not caught up, unless ``min_index`` is given.
- ``GET /v1/tables/{t}/leaders``: the leader this node knows of each partition it hosts
  (itself while it knows none; null where it hosts none): what a routing client reads.
- ``GET /v1/tables/{t}/partitions/{p}/snapshot`` (admin): a backup file of the partition,
  streamed by its leader (``raftkv.server.backup_ops``; ``raftkv.backup`` saves a table's).
- ``GET|PUT|DELETE /v1/tables/{t}/kv/{key}``: exactly the semantics of ``/v1/kv/{key}``
  (``raftkv.server.kv_ops``: linearizable reads, ``?stale``, compare-and-set with
  ``?prev_value``/``?prev_absent`` and 412, the same 4xx for the same bad input), on the
  key's partition, ``partition_of(key, partitions)``. A node hosting that partition's group serves it (reads linearizable, writes
  forwarded to the group leader by the driver); any other node proxies the request to a
  stable node of the partition (HTTP addresses are published under
  ``placement.http.<id>``), or answers 421 ``{"node": id}`` if none answers. It moves on
  to the next stable node only when it could not connect, or that node answered 503 "not
  hosted here" (nothing proposed; the last such answer is passed on if no node serves
  it): a write whose connection broke after it was sent may have applied there, so it
  answers 504 (outcome unknown) rather than send the write twice (a second
  compare-and-set would compare against the first one's value). A proxied request carries ``X-Raftkv-Forwarded``; a node that receives
  one for a partition it does not host (it just moved) answers 503 with ``"proposed":
  false``, as does a node that knows no host of the partition: nothing was proposed, so
  the client retries even a write it sends at most once.
- ``GET /v1/tables/{t}/kv?prefix=P`` (or ``start``/``end``, with ``limit``, ``continue``,
  ``keys_only``, ``count_only``, ``stale``): a range read over the table
  (``raftkv.server.range_ops``): one page of every partition, asked concurrently (served
  here or by a host through ``GET /v1/tables/{t}/partitions/{p}/kv``), merged in key
  order; ``revision`` maps each partition to the index its page was read at.
- ``POST /v1/cluster/nodes`` ``{"id", "raft_addr", "http_addr"?}``: add a node to the
  placement topology: admit it to the metastore as a learner (on the metastore leader;
  another node proxies there) and add it to ``placement.nodes``, which rebalances every
  table. Addresses that do not parse as ``host:port`` are a 400.
  ``DELETE /v1/cluster/nodes/{id}`` takes it out of the topology (its partitions move
  away; it stays a metastore learner). The default KV group is not touched: use
  ``/v1/cluster/learners`` for that.

Errors of the table KV endpoints: those of ``/v1/kv`` (``kv_ops``), plus 400 for a bad
table name and 404 for an unknown (or dropped) table. A node that knows no metastore
leader answers 503 at once to a request that needs the metastore (a table it has not
cached, table administration), as one that knows no leader of a partition it hosts does
to a request for that partition.

A request proxied to another node carries the caller's ``Authorization`` header: the
other node checks the caller's token as this one did (``raftkv.server.auth``). It goes
over HTTPS when this node serves HTTPS (``Placement.http_ssl``: the node's CA and
certificate), so the token is never sent in clear to a node the caller reached securely.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from raftkv.core import NotAMember, NotLeader, Role
from raftkv.kv import RaftKV
from raftkv.node.errors import (
    NodeStopped,
    RemoteError,
    ReplicaEmpty,
    RequestTimeout,
    UnknownGroup,
)
from raftkv.placement.assignments import decode_nodes, encode_nodes, partition_of, partitions_of
from raftkv.placement.catalog import (
    ADDRESS_PREFIX,
    DRAINING_KEY,
    MEMORY,
    TABLES_PREFIX,
    TOPOLOGY_KEY,
    TableDescriptor,
    check_node_id,
    check_table_name,
    partition_group,
    table_key,
)
from raftkv.placement.leader_balance import LeaderBalancer
from raftkv.placement.liveness import ClusterSettings
from raftkv.placement.manager_base import ADMIN_ATTEMPTS
from raftkv.placement.meta_commands import Cond, InvokeResult, Op
from raftkv.placement.partition_state import UnknownNode
from raftkv.placement.rebalance import (
    PlacementManager,
    TableExists,
    UnknownTable,
    join_metastore_as_learner,
)
from raftkv.placement.retry import RetryPolicy
from raftkv.placement.service import MetaService
from raftkv.server.backup_ops import stream_backup
from raftkv.server.kv_ops import REVISION_HEADERS, KvRequest, parse_kv, serve_kv
from raftkv.server.range_ops import (
    RangeRequest,
    merge_pages,
    page_from_json,
    page_json,
    parse_range,
    read_page,
)
from raftkv.server.requests import (
    Starting,
    check_fields,
    check_query,
    decode_batch_body,
    error,
    json_body,
    json_object,
    require_leader,
    wait,
)
from raftkv.server.txn_ops import parse_txn, serve_txn, txn_keys
from raftkv.server.watch_ops import parse_watch, serve_watch
from raftkv.storage.commands import MAX_BATCH_OPS, CommandError, encode_batch, user_key
from raftkv.storage.digest import DigestBuilder, row_hash
from raftkv.transport.tcp import parse_addr

log = logging.getLogger(__name__)
# What a node that does not host a proxied request's partition answers; a range read
# prefers any other host's failure to it (``_partition_page``).
NOT_HOSTED = "is not hosted here"

HTTP_PREFIX = b"placement.http."
FORWARDED = "X-Raftkv-Forwarded"
# On a proxied table request: the table's generation as the proxying node knows it. A
# node that lags a drop and re-creation (or is ahead of it) must not serve the request
# from a partition of the other table of that name.
GENERATION = "X-Raftkv-Table-Generation"
ADMIN_TIMEOUT = 10.0
RANGE_FANOUT = 32  # partitions a table range read asks at once


def http_key(node: str) -> bytes:
    return HTTP_PREFIX + check_node_id(node).encode()


class Placement:
    """The metastore replica and placement manager of one ``raftkv serve`` node."""

    def __init__(self, kv: RaftKV, data_dir: str | None, meta_dir: str, http_addr: str,
                 founders: list[str] | None, durable: bool,
                 http_ssl: ssl.SSLContext | None = None) -> None:
        """``founders``: the metastore's voters (None: this node joins as a learner).
        ``http_ssl``: the other nodes serve HTTPS; proxy to them with this context."""
        self.kv = kv
        self.http_ssl = http_ssl
        self.scheme = "https" if http_ssl is not None else "http"
        self.node = kv.node
        self.id = kv.node_id
        self.http_addr = http_addr
        self.founders = founders
        self.meta: MetaService = self.node.call(
            lambda: MetaService(self.node, meta_dir, founders, durable=durable)).result(10)
        self.mgr = PlacementManager(
            self.meta, data_dir, durable=durable,
            retry=RetryPolicy(base=0.05, cap=1.0, max_attempts=30), watch_timeout=2.0)
        self.balancer = LeaderBalancer(self.node)
        self._stop = threading.Event()
        self._http: dict[str, str] = {}
        self._http_at = 0.0

    def start(self) -> None:
        self.mgr.start()
        self.balancer.start()
        threading.Thread(target=self._publish, name=f"placement-publish-{self.id}",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.balancer.stop()
        self.mgr.stop()

    # -- background: publish this node's HTTP address (and the founders' topology) --------
    def _publish(self) -> None:
        key, addr = http_key(self.id), self.http_addr.encode()
        todo: list[Callable[[], Any]] = [
            lambda: self.meta.invoke([Cond.value(key).eq(addr)], [],
                                     [Op.put(key, addr)]).result(5)]
        if self.founders:
            todo.append(self.ensure_topology)
        while todo and not self._stop.is_set():
            try:
                todo[0]()
                todo.pop(0)
            except NodeStopped:
                return
            except Exception as e:  # noqa: BLE001 - no metastore leader yet, or not admitted
                log.debug("placement publish: %s", e)
                self._stop.wait(0.2)

    def ensure_topology(self) -> None:
        """Founders: the logical topology starts as the founding nodes (once)."""
        if self.founders:
            self.meta.invoke([Cond.not_exists(TOPOLOGY_KEY)],
                             [Op.put(TOPOLOGY_KEY, encode_nodes(self.founders))]).result(5)

    # -- metastore helpers (blocking: call from an executor) ------------------------------
    def topology(self) -> list[str]:
        v = self.meta.get(TOPOLOGY_KEY).result(ADMIN_TIMEOUT)
        return decode_nodes(v.value) if v is not None else []

    def change_topology(self, fn: Callable[[list[str]], list[str]]) -> list[str]:
        for _ in range(10):
            cur = self.meta.get(TOPOLOGY_KEY).result(ADMIN_TIMEOUT)
            nodes = decode_nodes(cur.value) if cur is not None else []
            new = sorted(set(fn(nodes)))
            if not new:
                raise CommandError("the topology needs at least one node")
            if new == nodes:
                return nodes
            guard = Cond.revision(TOPOLOGY_KEY).eq(cur.mod_revision if cur else 0)
            res = self.meta.invoke([guard], [Op.put(TOPOLOGY_KEY, encode_nodes(new))]).result(
                ADMIN_TIMEOUT)
            assert isinstance(res, InvokeResult)
            if res.succeeded:
                return new
        raise RuntimeError("the topology kept changing")

    def descriptor(self, name: str) -> TableDescriptor | None:
        row = self.descriptor_row(name)
        return row[0] if row is not None else None

    def descriptor_row(self, name: str) -> tuple[TableDescriptor, int] | None:
        """The table's descriptor and generation (its row's create revision), from one
        linearizable metastore read, or None."""
        v = self.meta.get(table_key(name)).result(ADMIN_TIMEOUT)
        return (TableDescriptor.decode(v.value), v.create_revision) if v is not None else None

    def http_addrs(self, fresh: bool = False) -> dict[str, str]:
        if fresh or time.monotonic() - self._http_at > 1.0:
            res = self.meta.range(HTTP_PREFIX, stale=True).result(ADMIN_TIMEOUT)
            self._http = {k[len(HTTP_PREFIX):].decode(): v.value.decode() for k, v in res.items}
            self._http_at = time.monotonic()
        return dict(self._http)

    def meta_role(self) -> tuple[bool, str | None]:
        def look() -> tuple[bool, str | None]:
            g = self.node.groups[self.meta.group]
            return g.raft.role == Role.LEADER, g.leader
        result: tuple[bool, str | None] = self.node.call(look).result(5)
        return result

    def meta_members(self) -> set[str]:
        """The metastore's voters and learners, as this node's replica has them (none
        when it hosts no replica)."""
        def look() -> set[str]:
            g = self.node.groups.get(self.meta.group)
            if g is None:
                return set()
            return set(g.raft.conf.voters) | set(g.raft.conf.learners)
        result: set[str] = self.node.call(look).result(5)
        return result

    def draining(self, stale: bool = False) -> list[str]:
        dr = self.meta.get(DRAINING_KEY, stale=stale).result(ADMIN_TIMEOUT)
        return decode_nodes(dr.value) if dr is not None else []

    def known_nodes(self, stale: bool = False, draining: list[str] | None = None) -> set[str]:
        """The nodes the cluster still knows: in the topology, draining, or in the
        metastore. A drained or removed node is none of them, though the addresses it
        published stay in the metastore. ``stale``: from this node's replica, without a
        metastore leader (a status must answer during an outage)."""
        topo = self.meta.get(TOPOLOGY_KEY, stale=stale).result(ADMIN_TIMEOUT)
        return (set(decode_nodes(topo.value) if topo is not None else [])
                | set(self.draining(stale) if draining is None else draining)
                | self.meta_members())


class TablesApi:
    def __init__(self, placement: Placement | None = None) -> None:
        """``placement`` may come later (``attach``): until then every handler answers
        503 "starting"."""
        self._placement = placement
        self.session: aiohttp.ClientSession | None = None

    def attach(self, placement: Placement) -> None:
        self._placement = placement

    @property
    def attached(self) -> bool:
        return self._placement is not None

    @property
    def p(self) -> Placement:
        if self._placement is None:
            raise Starting("opening the metastore")
        return self._placement

    def _meta_leader(self) -> None:
        """503 at once unless a metastore leader is known (module docstring)."""
        require_leader(self.p.node, self.p.meta.group)

    async def _require_meta_member(self) -> None:
        """503 unless this node's metastore replica is a member: drained or removed (its
        replica stopped with the configuration that dropped it), or not added yet, its
        view is frozen or empty, not the cluster's (found from outside: a drained node
        answered a frozen view, then 200 and no nodes; and every table request whose
        table it had not cached with a 504 after 5 s)."""
        if self.p.id not in await self._run(self.p.meta_members):
            raise web.HTTPServiceUnavailable(text=json.dumps({
                "error": f"{self.p.id} is not a member of the metastore (drained, removed, "
                         "or not added yet): ask another node", "proposed": False}),
                content_type="application/json")

    def install(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/tables", self.create)
        r.add_get("/v1/tables", self.list)
        r.add_get("/v1/tables/{table}", self.describe)
        r.add_delete("/v1/tables/{table}", self.drop)
        r.add_put("/v1/tables/{table}/replicas", self.set_replicas)
        r.add_get("/v1/tables/{table}/leaders", self.leaders)
        r.add_get("/v1/tables/{table}/kv", self.range)
        r.add_get("/v1/tables/{table}/kv/{key:[\\s\\S]*}", self.kv)
        r.add_put("/v1/tables/{table}/kv/{key:[\\s\\S]*}", self.kv)
        r.add_delete("/v1/tables/{table}/kv/{key:[\\s\\S]*}", self.kv)
        r.add_post("/v1/tables/{table}/batch", self.table_batch)
        r.add_post("/v1/tables/{table}/txn", self.table_txn)
        r.add_post("/v1/tables/{table}/partitions/{p}/batch", self.partition_batch)
        r.add_get("/v1/tables/{table}/partitions/{p}/digest", self.partition_digest)
        r.add_get("/v1/tables/{table}/partitions/{p}/kv", self.partition_range)
        r.add_get("/v1/tables/{table}/partitions/{p}/watch", self.partition_watch)
        r.add_get("/v1/tables/{table}/partitions/{p}/snapshot", self.partition_snapshot)
        r.add_post("/v1/cluster/nodes", self.add_node)
        r.add_get("/v1/cluster/nodes", self.nodes)
        r.add_delete("/v1/cluster/nodes/{id}", self.remove_node)
        r.add_post("/v1/cluster/nodes/{id}/drain", self.drain)
        r.add_get("/v1/cluster/settings", self.get_settings)
        r.add_put("/v1/cluster/settings", self.put_settings)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=15),
                connector=aiohttp.TCPConnector(ssl=self.p.http_ssl or True))
            # aiohttp sends a PUT or DELETE a second time when the connection breaks
            # after it went out (RFC 9110 calls them idempotent). A compare-and-set is
            # not: the second copy compares against what the first one wrote. Whether a
            # proxied write may go out again is decided in _elsewhere, not here.
            # (aiohttp has no public switch; its own test client sets this attribute.)
            self.session._retry_connection = False
        return self.session

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    @staticmethod
    def _name(request: web.Request) -> str:
        try:
            return check_table_name(request.match_info["table"])
        except ValueError as e:
            raise CommandError(str(e)) from None

    async def _desc(self, name: str) -> TableDescriptor:
        return (await self._desc_row(name))[0]

    async def _desc_row(self, name: str) -> tuple[TableDescriptor, int]:
        """The descriptor and generation (``Placement.descriptor_row``); 404 if none. 503
        if this node's metastore replica cannot read it: a read proposes nothing, so it
        is not the 504 "outcome unknown" of a write (found from outside: a drained node,
        still running, answered every table request so after 5 s, an unknown table's
        too, where the others answered 404 at once)."""
        self._meta_leader()
        await self._require_meta_member()
        try:
            row = await self._run(lambda: self.p.descriptor_row(name))
        except (RequestTimeout, TimeoutError):
            raise _meta_behind(self.p.id) from None
        if row is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"unknown table {name}"}),
                                   content_type="application/json")
        assert isinstance(row[0], TableDescriptor)
        return row

    # -- admin ----------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        check_query(request, ())
        body = await json_body(request)
        check_fields(body, ("name", "partitions", "replicas", "storage", "allow_unsafe"))
        name = body.get("name")
        parts: Any = body.get("partitions")
        replicas: Any = body.get("replicas")
        storage = body.get("storage", "persistent")
        try:
            check_table_name(name)
            TableDescriptor.new(str(name), parts, replicas, storage, ["-"])  # validation
            warning = _check_replicas(replicas, storage, body)
        except ValueError as e:
            return error(400, str(e))
        assert isinstance(name, str) and isinstance(replicas, int) and isinstance(parts, int)
        self._meta_leader()

        def run() -> TableDescriptor:
            self.p.ensure_topology()
            nodes = self.p.topology()
            if replicas > len(nodes):
                raise CommandError(f"replicas ({replicas}) exceeds the number of nodes in "
                                   f"the topology ({len(nodes)}: {', '.join(nodes)})")
            return self.p.mgr.create_table(name, parts, replicas, storage)

        try:
            desc = await self._run(run)
        except TableExists:
            return error(409, f"table {name} already exists")
        except CommandError:
            raise
        except ValueError as e:
            return error(400, str(e))
        out = _desc_json(desc)
        if warning is not None:
            out["warning"] = warning
        return web.json_response(out, status=201)

    async def list(self, request: web.Request) -> web.Response:
        check_query(request, ())
        self._meta_leader()
        res = await self._run(lambda: self.p.meta.range(TABLES_PREFIX).result(ADMIN_TIMEOUT))
        tables = []
        for _, v in res.items:
            try:
                tables.append(_desc_json(TableDescriptor.decode(v.value)))
            except ValueError:
                continue
        return web.json_response({"tables": tables})

    async def drop(self, request: web.Request) -> web.Response:
        check_query(request, ())
        name = self._name(request)
        self._meta_leader()
        try:
            rev = await self._run(lambda: self.p.mgr.drop_table(name))
        except UnknownTable:
            return error(404, f"unknown table {name}")
        return web.json_response({"dropped": name, "revision": rev})

    async def set_replicas(self, request: web.Request) -> web.Response:
        check_query(request, ())
        name = self._name(request)
        body = await json_body(request)
        check_fields(body, ("replicas", "allow_unsafe"))
        replicas = body.get("replicas")
        if type(replicas) is not int or replicas < 1:
            return error(400, f'"replicas" must be an integer >= 1, got {replicas!r}')
        desc = await self._desc(name)
        try:
            warning = _check_replicas(replicas, desc.storage, body)
        except ValueError as e:
            return error(400, str(e))

        def run() -> int:
            nodes = self.p.topology()
            if replicas > len(nodes):
                raise CommandError(f"replicas ({replicas}) exceeds the number of nodes in "
                                   f"the topology ({len(nodes)})")
            return self.p.mgr.set_replicas(name, replicas)

        try:
            rev = await self._run(run)
        except UnknownTable:
            return error(404, f"unknown table {name}")
        out: dict[str, Any] = {"table": name, "replicas": replicas, "revision": rev}
        if warning is not None:
            out["warning"] = warning
        return web.json_response(out)

    async def describe(self, request: web.Request) -> web.Response:
        check_query(request, ("local",))
        name = self._name(request)
        desc, generation = await self._desc_row(name)
        local = await self._run(lambda: self._local_view(name))
        if request.query.get("local", "").lower() in ("true", "1"):
            return web.json_response(local)
        views = [local]
        # The addresses of the nodes the cluster still knows, as /v1/cluster gives them:
        # a removed node's stays published (found from outside: listed after it left).
        addrs, known = await self._run(lambda: (self.p.http_addrs(),
                                                self.p.known_nodes(stale=True)))
        addrs = {n: a for n, a in addrs.items() if n in known}
        # The metastore's members only: a drained or removed node keeps its published
        # address, and a drained one that still runs cannot answer (its metastore replica
        # is frozen), so every describe waited out its 3 s timeout (found from outside).
        members = await self._run(self.p.meta_members) or set(addrs)
        peers = [(n, a) for n, a in addrs.items() if n != self.p.id and n in members]
        results = await asyncio.gather(*(self._fetch(a, f"/v1/tables/{name}?local=true",
                                                     request) for _, a in peers))
        views += [v for v in results if isinstance(v, dict)]
        parts = []
        for i in range(desc.partitions):
            gid = partition_group(name, i)
            entries = [v["partitions"][gid] for v in views if gid in v.get("partitions", {})]
            # Assignments: the view with the newest metastore revision.
            newest = max((v for v in views if gid in v.get("partitions", {})),
                         key=lambda v: v.get("revision", 0), default=None)
            base = newest["partitions"][gid] if newest else {}
            hosted = [e for e in entries if e.get("hosted")]
            leaders = [e for e in hosted if e.get("role") == "leader"]
            lead = max(leaders, key=lambda e: e.get("term", 0)) if leaders else None
            hints = {e.get("leader") for e in hosted if e.get("leader")}
            parts.append({
                "partition": i, "group": gid,
                "stable": base.get("stable", []), "pending": base.get("pending", []),
                "planned": base.get("planned"),
                "switch_reduce": base.get("switch_reduce", []),
                "switch_append": base.get("switch_append", []),
                "leader": lead["node"] if lead else (hints.pop() if len(hints) == 1 else None),
                "term": lead.get("term") if lead else None,
                "voters": lead.get("voters") if lead else None,
                "learners": lead.get("learners") if lead else None,
                "hosted_on": sorted(e["node"] for e in hosted),
                "change": lead.get("change") if lead else None,
            })
        errors = [err for v in views for err in v.get("errors", [])]
        # Said outright: a partition left with two voters of three (a drain begun while
        # another node was only suspect, a remove-node) looked healthy here, with no
        # error and no change under way (found outside-in). So is one with a voter that
        # does not host it (its node down, or not started yet): a table created while a
        # topology node was down had it as a voter of 7 partitions of 8 for 30 s, and
        # looked fully replicated (found from outside).
        short = [p["partition"] for p in parts if p["leader"] is None or (
            p["voters"] is not None and (len(p["voters"]) < desc.replicas
                                         or not set(p["voters"]) <= set(p["hosted_on"])))]
        if desc.storage == MEMORY:
            # Whatever leader it names: one whose quorum restarted empty commits nothing
            # (and a quiet one can go on claiming the leadership: an xfail scenario in
            # tests/test_core_quiesce.py).
            errors += [why for p in parts if (why := _lost_majority(name, p, views))]
        else:
            # On disk a replica is lost only with its files (wiped, or its partition logs
            # deleted): said while no leader is known, since a persistent replica is also
            # briefly unhosted as its node starts (found from outside: two replicas of
            # three with their logs deleted left every partition leaderless, errors: []).
            errors += [why for p in parts if p["leader"] is None
                       and (why := _lost_majority(name, p, views, on_disk=True))]
        # Said outright too: a partition whose every replica restarted at once came back
        # empty and writable, which describe did not show (found from outside).
        empty = [p["partition"] for p in parts if any(
            v.get("partitions", {}).get(p["group"], {}).get("restarted_empty") for v in views)]
        return web.json_response({**_desc_json(desc), "generation": generation,
                                  "partitions": parts, "errors": errors,
                                  "under_replicated": short, "restarted_empty": empty,
                                  "nodes_answered": sorted(v["node"] for v in views),
                                  "http": addrs})

    async def leaders(self, request: web.Request) -> web.Response:
        """``{"partitions": n, "leaders": [id or null, ...]}``: the leader this node knows
        of each partition it hosts (itself while it knows none, as a host forwards a
        write to the leader without another HTTP hop), null for the others. Read from
        its own groups, with no fan-out, so that clients can route each key cheaply
        (``raftkv.client``; a describe asks every node for a full view)."""
        name = self._name(request)
        check_query(request, ())
        desc = self.p.mgr.table(name) or await self._desc(name)
        groups = self.p.node.groups
        out = []
        for p in range(desc.partitions):
            g = groups.get(partition_group(name, p))
            out.append(None if g is None else g.leader or self.p.id)
        return web.json_response({"partitions": desc.partitions, "leaders": out})

    def _local_view(self, name: str) -> dict[str, Any]:
        st = self.p.mgr.status()
        prefix = f"t.{name}."
        parts = {gid: {**e, "node": self.p.id} for gid, e in st["partitions"].items()
                 if gid.startswith(prefix)}
        errors = [{**e, "node": self.p.id} for e in st["errors"]
                  if str(e.get("partition", "")).startswith(prefix)]
        return {"node": self.p.id, "revision": st["revision"], "partitions": parts,
                "errors": errors}

    async def _fetch(self, addr: str, path: str, request: web.Request) -> Any:
        try:
            async with self._session().get(f"{self.p.scheme}://{addr}{path}",
                                           headers=_caller(request),
                                           timeout=aiohttp.ClientTimeout(total=3)) as r:
                if r.status == 200:
                    return await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return None

    # -- topology -------------------------------------------------------------------------
    async def add_node(self, request: web.Request) -> web.Response:
        check_query(request, ())
        body = await json_body(request)
        check_fields(body, ("id", "raft_addr", "http_addr"))
        node, addr, http = body.get("id"), body.get("raft_addr"), body.get("http_addr")
        try:
            check_node_id(node)
        except ValueError as e:
            return error(400, str(e))
        for field, value, required in (("raft_addr", addr, True), ("http_addr", http, False)):
            if value is None and not required:
                continue
            if not isinstance(value, str):
                return error(400, f'"{field}" must be a string host:port')
            try:
                value.encode()  # a lone surrogate from JSON has no UTF-8 (it was a 500)
                parse_addr(value)
            except (ValueError, UnicodeEncodeError) as e:
                return error(400, f'"{field}": {e}')
        assert isinstance(node, str) and isinstance(addr, str)
        leads, leader = await self._run(self.p.meta_role)
        if not leads:
            if request.headers.get(FORWARDED) or leader is None:
                return error(503 if leader is None else 421,
                              "not the metastore leader", leader=leader)
            target = (await self._run(self.p.http_addrs)).get(leader)
            if target is None:
                return error(421, "not the metastore leader", leader=leader)
            return await self._proxy(request, target, await request.read())

        def published() -> tuple[dict[str, str], dict[str, str], list[str]]:
            """The raft and HTTP addresses of the nodes the cluster still knows (in the
            topology, draining, or in the metastore: a removed node's address may be
            reused), and who is draining."""
            raft = self.p.meta.range(ADDRESS_PREFIX).result(ADMIN_TIMEOUT)
            draining = self.p.draining()
            known = self.p.known_nodes(draining=draining)  # read once, just above
            return ({n: a for n, a in ((k[len(ADDRESS_PREFIX):].decode(errors="replace"),
                                        v.value.decode(errors="replace"))
                                       for k, v in raft.items) if n in known},
                    {n: a for n, a in self.p.http_addrs(fresh=True).items() if n in known},
                    draining)

        raft_of, http_of, draining = await self._run(published)
        # A node's addresses are its own to publish (it does at every start): add-node
        # may name them again, not change them, and never give one node's to another.
        if node in raft_of and raft_of[node] != addr:
            return error(409, f"{node} is already a node at {raft_of[node]}; add-node "
                              f"cannot move it to {addr} (restart it with --raft-addr)")
        if node in http_of and isinstance(http, str) and http_of[node] != http:
            return error(409, f"{node} already serves HTTP at {http_of[node]}; add-node "
                              f"cannot move it to {http}")
        taken = sorted(n for n, a in raft_of.items() if a == addr and n != node)
        if taken:
            return error(409, f"raft address {addr} is {taken[0]}'s")
        # The same for HTTP (found outside-in: another node's HTTP address was taken, and
        # status then showed that node twice and the new one never).
        wildcard = isinstance(http, str) and parse_addr(http)[0] in ("0.0.0.0", "::", "")
        taken = sorted(n for n, a in http_of.items()
                       if a == http and n != node and not wildcard)  # a bind, not an address
        if taken:
            return error(409, f"HTTP address {http} is {taken[0]}'s")

        def run() -> list[str]:
            if node in draining:
                # First: the metastore leader removes a drained node's metastore replica
                # once it hosts nothing, and must not do so under the re-add.
                self._cancel_drain(node)
            if node not in self.p.meta_members():
                join_metastore_as_learner(self.p.meta, node, addr).result(ADMIN_TIMEOUT)
            if isinstance(http, str) and node not in http_of:
                self.p.meta.put(http_key(node), http.encode()).result(ADMIN_TIMEOUT)
            return self.p.change_topology(lambda nodes: [*nodes, node])

        try:
            nodes = await self._run(run)
        except NotLeader as e:
            return error(421, "not the metastore leader", leader=e.leader)
        out: dict[str, Any] = {"id": node, "topology": nodes}
        n = self.p.node
        heard = await wait(n.call(lambda: n.heard_from(node, n.lease_seconds())))
        if not heard:
            # Accepted (a node may be started after it is added), but said: partitions
            # placed on a node that never starts stay under-replicated until it is
            # declared dead (found from outside: a mistyped add-node took 6 of 8
            # partitions' replicas without a word).
            out["warning"] = (f"{node} has not been heard from at {addr}: the partitions "
                              "placed on it stay under-replicated until it runs (started "
                              "with --join), or until it is declared dead")
        return web.json_response(out)

    def _cancel_drain(self, node: str) -> None:
        """A node added back while draining is no longer leaving: out of
        ``placement.draining`` (guarded by its revision, as the metastore leader's
        liveness writes are), so status stops saying it is."""
        meta = self.p.meta
        for _ in range(ADMIN_ATTEMPTS):
            cur = meta.get(DRAINING_KEY).result(ADMIN_TIMEOUT)
            nodes = decode_nodes(cur.value) if cur is not None else []
            if node not in nodes:
                return
            res = meta.invoke([Cond.revision(DRAINING_KEY).eq(cur.mod_revision if cur else 0)],
                              [Op.put(DRAINING_KEY, encode_nodes(
                                  [n for n in nodes if n != node]))]).result(ADMIN_TIMEOUT)
            if res.succeeded:
                return
        raise RuntimeError("placement.draining kept changing")

    async def nodes(self, request: web.Request) -> web.Response:
        """Each placement node's liveness (``raftkv.placement.liveness``), as this node's
        metastore replica has it once it has applied everything committed before the
        request, with the seconds it has been in its state."""
        check_query(request, ())
        await self._require_meta_member()
        # A linearizable read first, so this replica has applied everything committed
        # before the request: a node removed without hearing it (a drained one often
        # is) cannot complete it, and fails instead of answering its frozen view.
        try:
            await self._run(lambda: self.p.meta.get(TOPOLOGY_KEY).result(ADMIN_TIMEOUT))
        except (RequestTimeout, TimeoutError):
            raise _meta_behind(self.p.id) from None
        rows = await self._run(self.p.mgr.cluster_nodes)
        now = time.time()
        for r in rows:
            since = r.pop("since")
            r["seconds_in_state"] = None if since is None else round(max(0.0, now - since), 1)
        return web.json_response({"nodes": rows})

    async def drain(self, request: web.Request) -> web.Response:
        """Decommission a node (``PlacementManager.drain``): 404 for a node the topology
        does not name, 400 for its last node; progress in ``GET /v1/cluster/nodes``."""
        check_query(request, ())
        raw = await request.read()
        if raw.strip():  # none, or {}: a body that says anything else is not ignored
            check_fields(json_object(raw), ())  # (found from outside: "garbage" drained)
        node = request.match_info["id"]
        try:
            check_node_id(node)
        except ValueError as e:
            return error(400, str(e))
        self._meta_leader()
        try:
            rest = await self._run(lambda: self.p.mgr.drain(node))
        except UnknownNode as e:
            return error(404, str(e.args[0]))
        except ValueError as e:
            return error(400, str(e))
        return web.json_response({"draining": node, "topology": rest})

    async def get_settings(self, request: web.Request) -> web.Response:
        check_query(request, ())
        self._meta_leader()
        s = await self._run(self.p.mgr.settings)
        return web.json_response(json.loads(s.encode()))

    async def put_settings(self, request: web.Request) -> web.Response:
        """``{"scale_down_timeout"?, "scale_up_timeout"?, "catch_up_timeout"?}`` in seconds
        (0 <= t <= a week; ``scale_down_timeout: 0`` turns automatic removal of dead nodes
        off), ``"metastore_voters"?`` (3 or 5), ``"max_moves"?`` (0: no limit)."""
        check_query(request, ())
        body = await json_body(request)
        try:
            ClusterSettings().update(body)  # validated before anything is sent
        except ValueError as e:
            return error(400, str(e))
        self._meta_leader()
        s = await self._run(lambda: self.p.mgr.update_settings(body))
        return web.json_response(json.loads(s.encode()))

    async def remove_node(self, request: web.Request) -> web.Response:
        """Take a node out of the topology: a drain without ``drain``'s replica-count
        refusal (the node may be lost for good), so the metastore leader also moves its
        vote and removes its metastore replica once nothing is placed on it (found from
        outside: a removed node stayed a metastore learner, tracked by the leader, for
        good). 404 for a node the topology does not name, 400 for its last node."""
        check_query(request, ())
        node = request.match_info["id"]
        try:
            check_node_id(node)
        except ValueError as e:
            return error(400, str(e))
        self._meta_leader()
        try:
            nodes = await self._run(lambda: self.p.mgr.drain(node, check_replicas=False))
        except UnknownNode as e:
            return error(404, str(e.args[0]), topology=await self._run(self.p.topology))
        except ValueError as e:
            return error(400, str(e))
        return web.json_response({"removed": node, "topology": nodes})

    # -- table KV -------------------------------------------------------------------------
    async def kv(self, request: web.Request) -> web.StreamResponse:
        """A single-key request on a table: ``kv_ops``'s semantics, on the key's partition."""
        name = self._name(request)
        req = await parse_kv(request, f"/v1/tables/{request.match_info['table']}/kv/")
        if req.lease:
            raise CommandError("leases are for the default KV group: a table's key cannot "
                               "be attached to one")
        desc = self.p.mgr.table(name)
        if desc is None:
            desc = await self._desc(name)  # 404 if absent; else this node's cache lags
        self._same_generation(request, name)
        p = partition_of(req.key, desc.partitions)
        gid = partition_group(name, p)
        return await self._here_or_elsewhere(request, name, p, req.value,
                                             lambda: self._local(name, gid, req))

    async def _here_or_elsewhere(self, request: web.Request, name: str, p: int, body: bytes,
                                 local: Callable[[], Awaitable[web.Response]]
                                 ) -> web.Response:
        """``local()`` if this node serves partition ``p`` (``_here``); otherwise, or if
        it failed here before proposing anything (``NotAMember``: removed meanwhile;
        ``ReplicaEmpty``: a stale read of a replica that started empty), the request
        goes where the partition is (``_elsewhere``)."""
        if self._here(partition_group(name, p)):
            try:
                return await local()
            except (NotAMember, ReplicaEmpty):
                pass
        return await self._elsewhere(request, name, p, body)

    async def _elsewhere(self, request: web.Request, name: str, p: int,
                         body: bytes) -> web.Response:
        """Proxy a request for partition ``p`` that this node does not host to a node that
        does: its leader first, then its other stable nodes. A node that answers that it
        does not host the partition either (a stable node whose in-memory replica
        restarted empty and was not yet re-added, say) proposed nothing, so the next one
        is asked: a stale read of such a partition was refused on every node but its
        survivors, whose stale scans served it (found from outside)."""
        gid = partition_group(name, p)
        if request.headers.get(FORWARDED):
            return error(503, f"{gid} {NOT_HOSTED} (it may have just moved); retry",
                         proposed=False)
        candidates = self._hosts(name, p)
        if not candidates:
            return error(503, f"no known host of {gid} yet; retry", proposed=False)
        addrs = await self._run(self.p.http_addrs)
        not_hosted: web.Response | None = None
        for n in dict.fromkeys(candidates):
            if n not in addrs:
                continue
            try:
                answer = await self._proxy(request, addrs[n], body)
                data = answer.body  # bytes: ``_proxy`` read it whole
                if (answer.status == 503 and isinstance(data, bytes)
                        and NOT_HOSTED.encode() in data):
                    not_hosted = answer
                    continue
                return answer
            except aiohttp.ClientConnectorError as e:  # no connection: nothing was sent
                log.info("proxying %s to %s failed: %s", gid, n, e)
            except (aiohttp.ClientError, TimeoutError) as e:
                # The request may have reached n and been applied (n was killed before
                # it answered). A read may be asked again; a write must not be sent
                # twice: a CAS would compare against its own first copy's value.
                log.info("proxying %s to %s failed after sending: %s", gid, n, e)
                if request.method != "GET":
                    return error(504, f"proxying to {n} failed after the request was "
                                      f"sent ({type(e).__name__}); the outcome is unknown",
                                  group=gid)
        if not_hosted is not None:
            return not_hosted
        return error(421, f"{gid} is hosted on {', '.join(candidates)}; ask there",
                      node=candidates[0], group=gid)

    def _same_generation(self, request: web.Request, name: str) -> None:
        """503 for a proxied request whose sender knew another generation of the table
        than this node does: one of the two has not yet seen it dropped and created again,
        and whichever it is, the request must not reach the other table (retried, it
        finds the caches agreeing)."""
        sent = request.headers.get(GENERATION)
        if sent is not None and sent != str(self.p.mgr.generation(name)):
            raise web.HTTPServiceUnavailable(text=json.dumps({
                "error": f"table {name} was dropped and created again (generation {sent} "
                         f"there, {self.p.mgr.generation(name)} here); retry"}),
                content_type="application/json")

    def _generation_header(self, name: str) -> dict[str, str]:
        gen = self.p.mgr.generation(name)
        return {GENERATION: str(gen)} if gen is not None else {}

    def _here(self, gid: str) -> bool:
        """Whether this node serves partition group ``gid``: it hosts a replica that was
        not removed from it. A replica removed by a set-replicas or a move stays until the
        placement manager stops it, and a request for it answered 503 "not a member any
        more ... will not serve" (found from outside, on healthy nodes during a routine
        set-replicas); it is now served where the partition is, as for one not hosted
        here. Read off the loop thread, and a replica learns of its removal only when a
        member tells it (its forwarded write refused, say), so the handlers also send a
        request that failed here with ``NotAMember`` (nothing was proposed) on to the
        partition's hosts."""
        g = self.p.node.groups.get(gid)
        return g is not None and g.raft.removed is None

    def _hosts(self, name: str, p: int) -> Sequence[str]:
        """Other nodes hosting partition ``p``: its leader first, then its other stable
        nodes (possibly repeating the leader)."""
        try:
            route = self.p.mgr.partition_route(name, p)
        except UnknownTable:
            return []
        return [n for n in ([route.leader] if route.leader else []) + list(route.nodes)
                if n != self.p.id]

    async def _local(self, name: str, gid: str, req: KvRequest) -> web.Response:
        return await self._served(name, gid, serve_kv(self.p.node, gid, req))

    async def _served(self, name: str, gid: str, work: Awaitable[web.Response]) -> web.Response:
        """``work`` on partition group ``gid`` here, its failures as ``_local`` answers them."""
        try:
            return await work
        except (NodeStopped, UnknownGroup, RemoteError) as e:
            # The group stopped under the request (here or on the leader it was forwarded
            # to): if the table is gone, say so; otherwise it moved (503: retry).
            if isinstance(e, RemoteError) and e.kind not in ("NodeStopped", "UnknownGroup"):
                raise
            if await self._run(lambda: self.p.descriptor(name)) is None:
                return error(404, f"table {name} was dropped", group=gid)
            if isinstance(e, UnknownGroup) or (isinstance(e, RemoteError)
                                               and e.kind == "UnknownGroup"):
                # Not proposed (the group was gone here, or on the leader it was sent
                # to). A 404 would read as "no such key" to a GET (Client.get: None).
                return error(503, f"{gid} moved ({e}); retry", group=gid, proposed=False)
            raise

    async def range(self, request: web.Request) -> web.Response:
        """A range read over a table (``range_ops``): a page of every partition, asked
        concurrently with the same query, merged in key order (``merge_pages``)."""
        name = self._name(request)
        req = parse_range(request, name)
        desc = self.p.mgr.table(name) or await self._desc(name)
        self._same_generation(request, name)
        caller, gate = _caller(request), asyncio.Semaphore(RANGE_FANOUT)

        async def one(p: int) -> dict[str, Any]:
            async with gate:
                return await self._partition_page(name, p, req, request.query_string, caller)

        got = await asyncio.gather(*(one(p) for p in range(desc.partitions)),
                                   return_exceptions=True)
        for p, r in enumerate(got):
            if isinstance(r, _PartitionFailed):
                return error(r.status, f"partition {p}: {r}", partition=p)
            if isinstance(r, BaseException):
                raise r
        pages = {p: r for p, r in enumerate(got) if not isinstance(r, BaseException)}
        return web.json_response(page_json(merge_pages(pages, req.limit), req))

    async def partition_range(self, request: web.Request) -> web.Response:
        """One page of a range read on one partition (``range_ops``), served here or by
        a node that hosts it (the table range read's fan-out)."""
        name, _, p, gid = await self._partition(request)
        req = parse_range(request, name)

        async def local() -> web.Response:
            try:
                return web.json_response(page_json(await self._local_page(name, gid, req),
                                                   req))
            except _PartitionFailed as e:
                return error(e.status, str(e), group=gid)

        return await self._here_or_elsewhere(request, name, p, b"", local)

    async def partition_watch(self, request: web.Request) -> web.StreamResponse:
        """A watch of one partition (``watch_ops``; revisions are that partition's log
        indexes), served by a node that hosts it: any other answers 421 naming one."""
        name, _, p, gid = await self._partition(request)
        req = parse_watch(request)
        if not self._here(gid):
            hosts = self._hosts(name, p)
            return error(421, f"{gid} is not hosted here; watch it on a node that hosts it",
                          node=hosts[0] if hosts else None, group=gid)
        return await serve_watch(self.p.node, gid, req, request)

    async def partition_snapshot(self, request: web.Request) -> web.StreamResponse:
        """A backup file of one partition (``backup_ops``), streamed by its leader: a node
        that does not host it answers 421 naming one that does, and a follower 421
        naming the leader."""
        name, _, p, gid = await self._partition(request)
        check_query(request, ())
        if not self._here(gid):
            hosts = self._hosts(name, p)
            return error(421, f"{gid} is not hosted here; ask a node that hosts it",
                         leader=hosts[0] if hosts else None, group=gid)
        # The generation is read with the image, on the loop thread: a node creates a
        # partition's group only after its cache holds the descriptor that asks for it,
        # so an image of a re-created table's group never carries the older generation.
        return await stream_backup(self.p.node, gid, request,
                                   f"raftkv-{name}-p{p}-{{index}}.snap",
                                   lambda: {"table_generation": self.p.mgr.generation(name)})

    async def _local_page(self, name: str, gid: str, req: RangeRequest) -> dict[str, Any]:
        if not req.stale:
            require_leader(self.p.node, gid)
        try:
            page: dict[str, Any] = await wait(self.p.node.read_kv(
                gid, lambda s: read_page(s, req), linearizable=not req.stale))
            return page
        except (NodeStopped, UnknownGroup) as e:
            if await self._run(lambda: self.p.descriptor(name)) is None:
                raise _PartitionFailed(404, f"table {name} was dropped") from e
            raise _PartitionFailed(503, f"{gid} moved ({e}); retry") from e

    async def _partition_page(self, name: str, p: int, req: RangeRequest, query: str,
                              caller: dict[str, str]) -> dict[str, Any]:
        """Partition ``p``'s page of a table range read: read here if this node hosts it,
        else asked of its hosts in turn (a read may be asked again anywhere)."""
        gid = partition_group(name, p)
        if self._here(gid):
            try:
                return await self._local_page(name, gid, req)
            except (NotAMember, ReplicaEmpty):  # as in ``_here_or_elsewhere``: ask its hosts
                pass
        addrs = await self._run(self.p.http_addrs)
        last = _PartitionFailed(503, f"no known host of {gid} yet; retry")
        failed: list[_PartitionFailed] = []
        for n in dict.fromkeys(self._hosts(name, p)):
            if n not in addrs:
                continue
            url = f"{self.p.scheme}://{addrs[n]}/v1/tables/{name}/partitions/{p}/kv?{query}"
            try:
                async with self._session().get(url, headers={
                        FORWARDED: self.p.id, **caller, **self._generation_header(name)}) as r:
                    answer = await r.json(content_type=None)
                    if r.status == 200:
                        return page_from_json(answer)
                    why = answer.get("error", answer) if isinstance(answer, dict) else answer
                    last = _PartitionFailed(r.status, f"{n}: {why}")
                    if r.status not in (421, 503):
                        raise last
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
                last = _PartitionFailed(503, f"{n}: {e!r}")
            failed.append(last)
        # The most telling failure, not the last: a stable node whose replica is not
        # started (one of an in-memory partition's restarted majority) says only that it
        # does not host it, where another host said no leader is known (found from
        # outside: a count of a partition that lost its majority said it "may have just
        # moved").
        raise next((f for f in failed if NOT_HOSTED not in str(f)), last)

    async def table_txn(self, request: web.Request) -> web.Response:
        """A transaction inside one partition of a table (``txn_ops``): every key it names
        must belong to one partition, which serves it here or through a host."""
        check_query(request, ())
        name = self._name(request)
        desc = self.p.mgr.table(name) or await self._desc(name)
        self._same_generation(request, name)
        raw = await request.read()
        txn = parse_txn(json_object(raw))
        keys = txn_keys(txn)
        if not keys:
            raise CommandError("a table's transaction needs at least one key (it runs in "
                               "the partition of its keys)")
        parts = sorted(set(partitions_of(keys, desc.partitions)))
        if len(parts) > 1:
            raise CommandError(f"a transaction runs in one partition; its keys are in "
                               f"partitions {', '.join(map(str, parts))} of table {name} "
                               f"(each partition is its own Raft group)")
        gid = partition_group(name, parts[0])
        return await self._here_or_elsewhere(
            request, name, parts[0], raw,
            lambda: self._served(name, gid, serve_txn(self.p.node, gid, txn)))

    async def table_batch(self, request: web.Request) -> web.Response:
        """Puts and deletes across a table's partitions: one atomic ``BATCH`` entry per
        partition, all partitions concurrently. Not atomic across partitions (each is its
        own Raft group): on a failure the answer lists what was applied where."""
        check_query(request, ())
        name = self._name(request)
        desc = self.p.mgr.table(name) or await self._desc(name)
        ops = decode_batch_body(await request.read(), request.content_type)
        # Checked whole first, as /v1/batch checks it: its limits (10,000 operations,
        # 16 MiB) hold for the batch, and an error names the operation by its place in
        # the request, not in a partition's share (found from outside).
        encode_batch(ops)
        per: dict[int, list[tuple[bytes, bytes | None]]] = {}
        for op, p in zip(ops, partitions_of([k for k, _ in ops], desc.partitions),
                         strict=True):
            per.setdefault(p, []).append(op)
        cmds = {p: encode_batch(o) for p, o in per.items()}  # every op checked up front
        caller = _caller(request)
        got = await asyncio.gather(*(self._batch_into(name, p, cmds[p], per[p], caller)
                                     for p in sorted(per)), return_exceptions=True)
        applied = {p: r for p, r in zip(sorted(per), got, strict=True)
                   if not isinstance(r, BaseException)}
        failed = {p: r for p, r in zip(sorted(per), got, strict=True)
                  if isinstance(r, BaseException)}
        if not failed:
            return web.json_response({"ops": len(ops), "partitions": applied})
        first = next(iter(failed.values()))
        status = first.status if isinstance(first, _PartitionFailed) else 503
        return error(status, f"{len(failed)} of {len(per)} partitions failed: {first}",
                      applied=applied, failed={p: str(e) for p, e in failed.items()})

    async def _batch_into(self, name: str, p: int, cmd: bytes,
                          ops: Sequence[tuple[bytes, bytes | None]],
                          caller: dict[str, str]) -> int:
        """Apply one partition's share of a table batch; its log index. ``caller``: the
        credentials to send if another node must apply it."""
        gid = partition_group(name, p)
        if self._here(gid):
            try:
                require_leader(self.p.node, gid)
                index: int = await wait(self.p.node.propose(gid, cmd, lambda i, r: i))
                return index
            except NotAMember:
                pass  # removed meanwhile, nothing proposed: as ``_here_or_elsewhere``
        addrs = await self._run(self.p.http_addrs)
        body = msgpack.packb({"id": None, "ops": [[k, v] for k, v in ops]}, use_bin_type=True)
        last: Exception = _PartitionFailed(503, f"no known host of {gid} yet; retry")
        for n in dict.fromkeys(self._hosts(name, p)):
            if n not in addrs:
                continue
            url = f"{self.p.scheme}://{addrs[n]}/v1/tables/{name}/partitions/{p}/batch"
            try:
                async with self._session().post(
                        url, data=body, headers={FORWARDED: self.p.id, **caller,
                                                 **self._generation_header(name),
                                                 "Content-Type": "application/x-msgpack"}) as r:
                    answer = await r.json(content_type=None)
                    if r.status == 200:
                        return int(answer["index"])
                    failed = _PartitionFailed(r.status, str(answer.get("error", answer)))
                    if r.status != 421 and not (r.status == 503
                                                and answer.get("proposed") is False):
                        # Only a 421, or a 503 that says so, says nothing was proposed.
                        # After a 504 (or another 503: the group stopped under a pending
                        # entry) the batch may still apply on n, so it must not go to
                        # another host as well.
                        raise failed
                    last = failed
            except aiohttp.ClientConnectorError as e:  # no connection: nothing was sent
                last = _PartitionFailed(503, f"{n}: {e}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                raise _PartitionFailed(504, f"{n} failed after the batch was sent ({e!r}); "
                                            "the outcome is unknown") from e
        raise last

    # -- partition batches and replica digests (the Spark loader's and verifier's API) --------
    async def _partition(self, request: web.Request) -> tuple[str, int, int, str]:
        """(table, its partition count, partition, group) of a partition URL; 404s."""
        name = self._name(request)
        desc = self.p.mgr.table(name) or await self._desc(name)
        self._same_generation(request, name)
        raw = request.match_info["p"]
        if not (raw.isascii() and raw.isdigit()) or int(raw) >= desc.partitions:
            raise web.HTTPNotFound(text=json.dumps(
                {"error": f"table {name} has no partition {raw!r} "
                          f"(it has partitions 0..{desc.partitions - 1})"}),
                content_type="application/json")
        p = int(raw)
        return name, desc.partitions, p, partition_group(name, p)

    async def partition_batch(self, request: web.Request) -> web.Response:
        """One idempotent batch into one partition: one Raft entry (``BATCH`` with an id).
        Every key must belong to the partition, so a loader that split its rows with a
        different partition function fails loudly instead of writing rows where no read
        will find them."""
        check_query(request, ())
        name, count, p, gid = await self._partition(request)
        body = await request.read()
        batch_id, ops = decode_partition_batch(body)
        keys = [k for k, _ in ops]
        for k, got in zip(keys, partitions_of(keys, count), strict=True):
            if got != p:
                raise CommandError(f"key {k[:64]!r} belongs to partition {got}, not {p}")
        cmd = encode_batch(ops, batch_id)

        async def local() -> web.Response:
            require_leader(self.p.node, gid)
            try:
                index, applied = await wait(
                    self.p.node.propose(gid, cmd, lambda i, r: (i, r is not False)))
            except (NodeStopped, UnknownGroup) as e:
                if await self._run(lambda: self.p.descriptor(name)) is None:
                    return error(404, f"table {name} was dropped", group=gid)
                return error(503, f"{gid} stopped here ({e}); retry")
            return web.json_response({"index": index, "ops": len(ops), "applied": applied})

        return await self._here_or_elsewhere(request, name, p, body, local)

    async def partition_digest(self, request: web.Request) -> web.Response:
        """THIS replica's ``{"node", "count", "digest", "applied"}`` of the partition's user
        rows (batch markers left out), once it has applied ``?min_index=`` (504 if it does
        not within ``?timeout=`` seconds). ``?linearizable=true`` reads after a ReadIndex
        round instead, so its ``applied`` covers every write acknowledged before the call.
        With ``?keys=N`` and at most N rows, ``"rows"`` maps each key (hex) to its row hash
        (hex), so a verifier can name missing, extra and altered keys. A replica that
        started empty and has not caught up answers 503 unless ``min_index`` says what it
        must have applied."""
        _, _, p, gid = await self._partition(request)
        if not self._here(gid):
            return error(404, f"{gid} has no replica on {self.p.id}", node=self.p.id)
        q = request.query
        try:
            min_index = int(q.get("min_index", "0"))
            limit = int(q.get("keys", "0"))
            timeout = min(float(q.get("timeout", "30")), 120.0)
            if not timeout >= 0:  # NaN too: a deadline of NaN never passes
                raise ValueError
        except ValueError:
            raise CommandError("min_index and keys are integers, timeout is seconds "
                               "(at least 0)") from None
        linearizable = q.get("linearizable", "").lower() in ("true", "1")
        if linearizable:
            require_leader(self.p.node, gid)
        # Without a ``min_index`` to meet, a stale digest is checked as a stale read is
        # (``Node.read_kv``): a replica that started empty and has not caught up answers
        # ReplicaEmpty (503), not the digest of no rows (found from outside: a pending
        # replica that never received data answered ``count: 0`` with 200).
        read = (self.p.node.read_kv if min_index == 0 and not linearizable
                else self.p.node.read)
        deadline = time.monotonic() + timeout
        while True:
            rows, applied = await wait(read(
                gid, lambda s: (s.scan(), s.applied_index()), linearizable=linearizable))
            if applied >= min_index:
                break
            if time.monotonic() > deadline:
                return error(504, f"{gid} on {self.p.id} applied {applied}, not yet "
                                   f"{min_index}", applied=applied)
            await asyncio.sleep(0.05)
        # The scan is a consistent view taken on the loop; hashing it is slow, so off it.
        out = await self._run(lambda: _digest_rows(rows, limit))
        return web.json_response({"node": self.p.id, "partition": p,
                                  "applied": applied, **out})

    async def _proxy(self, request: web.Request, addr: str, body: bytes) -> web.Response:
        url = f"{self.p.scheme}://{addr}{request.rel_url.raw_path_qs}"
        headers = {FORWARDED: self.p.id, **_caller(request)}
        if "table" in request.match_info:
            headers.update(self._generation_header(request.match_info["table"]))
        if request.content_type:
            headers["Content-Type"] = request.content_type
        async with self._session().request(request.method, url, data=body or None,
                                           headers=headers) as r:
            data = await r.read()
            # The answer's own headers that carry meaning (a value's revisions).
            passed = {h: r.headers[h] for h in REVISION_HEADERS if h in r.headers}
            return web.Response(status=r.status, body=data, headers=passed,
                                content_type=r.content_type or "application/octet-stream")


def _meta_behind(node: str) -> web.HTTPServiceUnavailable:
    """The 503 for a metastore read that timed out here. A read proposes nothing, so it
    is not the 504 "outcome unknown" of a write."""
    return web.HTTPServiceUnavailable(text=json.dumps({
        "error": f"{node}'s metastore replica cannot catch up with the cluster (no quorum, "
                 "or was this node drained or removed?): ask another node",
        "proposed": False}), content_type="application/json")


def _caller(request: web.Request) -> dict[str, str]:
    """The caller's credentials, for a request made on its behalf to another node."""
    value = request.headers.get("Authorization")
    return {"Authorization": value} if value is not None else {}


class _PartitionFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def decode_partition_batch(raw: bytes) -> tuple[bytes | None, list[list[Any]]]:
    """The body of a partition batch: msgpack ``{"id": bin | nil, "ops": [[key, value | nil],
    ...]}`` (binary keys and values; nil value deletes). Raises ``CommandError``."""
    try:
        body = msgpack.unpackb(raw, raw=False, max_array_len=MAX_BATCH_OPS, max_map_len=4)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        raise CommandError(f'a partition batch is msgpack {{"id", "ops"}}: {e}') from None
    if not isinstance(body, dict) or not isinstance(body.get("ops"), list) or not body["ops"]:
        raise CommandError('a partition batch is msgpack {"id": bytes, "ops": [[key, value]]}'
                           " with at least one op")
    batch_id = body.get("id")
    if batch_id is not None and not isinstance(batch_id, bytes):
        raise CommandError("the batch id must be bytes")
    ops = body["ops"]
    for op in ops:
        if not (type(op) is list and len(op) == 2 and type(op[0]) is bytes):
            raise CommandError(f"batch item {op!r:.60} is not a [key bytes, value bytes|nil] pair")
    return batch_id, ops  # values (bytes or nil) and every limit: encode_batch checks


def _digest_rows(rows: Iterable[tuple[bytes, bytes]], limit: int) -> dict[str, Any]:
    b = DigestBuilder()
    listed: dict[str, str] | None = {} if limit > 0 else None
    for k, v in rows:
        if not user_key(k):
            continue
        b.add(k, v)
        if listed is not None:
            if b.count > limit:
                listed = None
            else:
                listed[k.hex()] = f"{row_hash(k, v):016x}"
    d = b.result()
    return {"count": d.count, "digest": d.digest, "rows": listed}


def replica_risk(replicas: int, storage: str) -> str | None:
    """Why ``replicas`` copies of a table stored as ``storage`` cannot survive one
    failure, or None. Two is the count that looks redundant and is not: a majority of two
    is two, so while either node is down its partitions take no writes; and an in-memory
    partition whose replica restarted continues on the other alone (see "The lone holder
    of a two-voter configuration" in ``raftkv.placement.safe_restart``) until the replica is
    re-added, so one more loss in that window loses acknowledged writes. One replica is
    plainer: in memory, every row goes with any restart of its node; on disk, with its
    disk."""
    if replicas == 1:
        if storage == MEMORY:
            return ("1 in-memory replica loses every row of its partitions whenever its "
                    "node restarts. Use 3 replicas, or pass allow_unsafe to accept this")
        return ("1 replica cannot survive any failure: while its node is down its "
                "partitions are unavailable, and losing its disk loses them. 3 replicas "
                "survive one failure")
    if replicas != 2:
        return None
    if storage == MEMORY:
        return ("2 in-memory replicas cannot survive one failure: while either node is "
                "down its partitions accept no writes (a majority of 2 is 2), and after a "
                "restart the other replica holds the only copy until the restarted one is "
                "re-added, so a second loss then loses acknowledged writes. Use 3 "
                "replicas, or pass allow_unsafe to accept this")
    return ("2 replicas cannot survive one failure: while either node is down, the "
            "partitions it holds accept no writes (a majority of 2 is 2). 3 replicas "
            "survive one failure")


def _check_replicas(replicas: object, storage: object, body: dict[str, Any]) -> str | None:
    """The warning for a replica count that cannot survive one failure, or ValueError:
    refused for an in-memory table unless ``"allow_unsafe": true``. In memory the risk is
    losing acknowledged writes, so it takes an explicit choice; on disk it is only
    availability (nothing is lost), so a warning in the answer is enough."""
    allow = body.get("allow_unsafe", False)
    if type(allow) is not bool:
        raise ValueError(f'"allow_unsafe" must be true or false, got {allow!r}')
    if not isinstance(replicas, int) or not isinstance(storage, str):
        return None
    risk = replica_risk(replicas, storage)
    if risk is not None and storage == MEMORY and not allow:
        raise ValueError(risk)
    return risk


def _desc_json(d: TableDescriptor) -> dict[str, Any]:
    return {"name": d.name, "partitions": d.partitions, "replicas": d.replicas,
            "storage": d.storage}


def _lost_majority(table: str, part: dict[str, Any], views: list[dict[str, Any]],
                   on_disk: bool = False) -> str:
    """Why an in-memory partition cannot commit (empty if it may): so many of its voters
    run but host nothing, having restarted empty (their managers say so: they hosted it
    before this start, which a replica not started yet did not), that the others are not
    a majority. It must not elect from what is left, since a write acknowledged by a
    majority may exist nowhere else; found from outside, where the partition sat at "no
    leader" with no error for good (3 replicas of which 2 restarted; later 4 of which 2,
    half, which the first rule missed). The voters are the leader's configuration, else
    the stable assignment. While no leader is known, a voter whose node did not answer
    counts out too (with one restarted replica, it can be what leaves no majority: errors
    stayed empty until the silent node restarted too), and may still hold the rows. The
    holders named are voters that host it: a pending replica may never have received a
    row. docs/operations.md gives the ways out. ``on_disk``: a persistent partition,
    whose lost replicas lost their files, and whose way out is ``unsafe-reset``."""
    voters = part["voters"] if part["voters"] is not None else part["stable"]
    gid = part["group"]
    lost = sorted(v["node"] for v in views if v["node"] in voters
                  and v.get("partitions", {}).get(gid, {}).get("lost"))
    silent = ([] if part["leader"] is not None
              else sorted(set(voters) - {v["node"] for v in views}))
    left = len(voters) - len(lost) - len(silent)
    if not lost or left >= len(voters) // 2 + 1:
        return ""
    holders = ", ".join(n for n in part["hosted_on"] if n in voters and n not in lost)
    if silent:
        holders = (f"{holders or 'no node that answered'} "
                   f"(and {', '.join(silent)}, if still running)")
    pending = [n for n in part["hosted_on"] if n not in voters]
    also = f" ({', '.join(pending)}, pending, may hold part of it)" if pending else ""
    unheard = f" and {', '.join(silent)} did not answer" if silent else ""
    if on_disk:
        # Also the state of every replica for a moment in a whole-cluster restart, before
        # its node hosts it again (review): said as such, and the way out only if it lasts.
        return (f"{table} partition {part['partition']}: {len(lost)} of its {len(voters)} "
                f"replicas ({', '.join(lost)}) are not hosted by their running nodes (their "
                f"files lost, or their nodes still starting){unheard}, leaving {left}, not a "
                f"majority: no leader can be elected, and its data may survive only on "
                f"{holders or 'no node'}{also}. If this lasts, see \"A majority lost for "
                f"good\" (raftkv recover unsafe-reset --group {gid}) in docs/operations.md")
    return (f"{table} partition {part['partition']}: {len(lost)} of its {len(voters)} "
            f"in-memory replicas ({', '.join(lost)}) restarted empty{unheard}, leaving "
            f"{left}, not a majority: it cannot commit or elect a leader, and its data may "
            f"survive only on {holders or 'no node'}{also}; see \"In-memory tables\" in "
            "docs/operations.md")
