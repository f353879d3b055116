"""Leases over HTTP, and the leader's expiry of them (``raftkv.storage.leases`` has the
state machine's side).

Endpoints (the default KV group; JSON):

- ``POST /v1/leases`` ``{"ttl": seconds, "id"?: n}``: grant a lease (a random id unless
  given): ``{"id", "ttl", "index"}``; 409 if the id is taken.
- ``PUT /v1/kv/{key}?lease=ID``: a put attached to the lease; 404 if it does not exist
  (nothing written). Any other write of the key detaches it.
- ``POST /v1/leases/{id}/keepalive``: restart the lease's clock: ``{"id", "ttl"}``. Only
  the leader keeps the clocks, so a follower answers 421 naming it (the Python client
  follows); 404 if the lease does not exist.
- ``DELETE /v1/leases/{id}``: revoke it now: its keys are deleted in the same entry
  (``{"id", "deleted", "index"}``); 404 if it does not exist.
- ``GET /v1/leases`` and ``GET /v1/leases/{id}``: the leases (and one lease's keys,
  base64), with ``remaining`` seconds when asked of the leader.

**Expiry.** Time is not part of the replicated state: each replica would read its own
clock. The leader keeps every lease's deadline in memory (``LeaseKeeper``, with the
bookkeeping in ``raftkv.server.lease_clocks``) and, when one passes, proposes the
revoke, which deletes the keys on every replica at one index. A keepalive moves the
deadline on the leader, and is answered after a ReadIndex round that confirms the
leadership and that the lease still exists (``LeaseKeeper.keepalive``). **Across a leader
change** the new leader
does not know the old one's clocks: it gives every lease its full TTL again from the
moment it takes over (etcd extends leases on a leader change in the same way), so a lease
is never cut short by a failover, and one nobody keeps alive expires at most one TTL
(plus the election) after the change. Leases live in the default group only; a table's
key cannot be attached to one (400).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from raftkv.core import NotLeader, Role
from raftkv.node.driver import Node
from raftkv.server.lease_clocks import TICK_SECONDS, LeaseClocks, read_leases
from raftkv.server.requests import (
    check_fields,
    check_query,
    error,
    json_body,
    quoted,
    require_leader,
    wait,
)
from raftkv.storage.commands import (
    CommandError,
    encode_lease_grant,
    encode_lease_revoke,
)
from raftkv.storage.leases import (
    attach_prefix,
    check_lease_id,
    check_ttl,
    lease_key,
)
from raftkv.storage.state_store import KVStateStore, prefix_end

log = logging.getLogger(__name__)


def lease_keys(state: KVStateStore, lease: int) -> list[bytes]:
    prefix = attach_prefix(lease)
    return [k[len(prefix):] for k, _ in state.scan_rows(prefix, prefix_end(prefix))]


class LeaseKeeper:
    """The leader's lease clocks (``LeaseClocks``; the module docstring) on a node: the
    state read every ``RELOAD_SECONDS`` while this node leads, a revoke proposed as each
    clock falls due."""

    def __init__(self, node: Node, group: str, clock: Any = time.monotonic) -> None:
        self.node, self.group = node, group
        self.clocks = LeaseClocks(clock)
        # One tick at a time: the keeper's task and a keepalive that finds a new term.
        self._lock = asyncio.Lock()

    async def _leading(self) -> int:
        def look() -> int:
            g = self.node.groups.get(self.group)
            return g.raft.term if g is not None and g.raft.role == Role.LEADER else 0
        term: int = await wait(self.node.call(look))
        return term

    async def reload(self) -> None:
        ttls: dict[int, int] = await wait(self.node.read_kv(self.group, read_leases,
                                                         linearizable=False))
        self.clocks.reload(ttls)

    async def tick(self) -> None:
        async with self._lock:
            await self._tick()

    async def _tick(self) -> None:
        term = await self._leading()
        if self.clocks.take_over(term):
            if term:
                await self.reload()
                log.info("lease keeper: leading term %d with %d leases", term,
                         len(self.clocks.ttls))
            return
        if not term:
            return
        if self.clocks.reload_due():
            await self.reload()
        for lease in self.clocks.due():
            asyncio.get_running_loop().create_task(self._expire(lease))

    async def _expire(self, lease: int) -> None:
        try:
            await wait(self.node.propose(self.group, encode_lease_revoke(lease)))
        except Exception as e:  # noqa: BLE001 - retried at the next tick
            log.info("lease %d: revoke failed (%s); retrying", lease, e)
            self.clocks.retry(lease)
        else:
            self.clocks.revoked(lease)
            log.info("lease %d expired: revoked", lease)

    def forget(self, lease: int) -> None:
        """``lease`` was revoked (here, or found gone at a reload)."""
        self.clocks.revoked(lease)

    def granted(self, lease: int, ttl: int) -> None:
        self.clocks.granted(lease, ttl)

    async def keepalive(self, lease: int) -> int:
        """Restart ``lease``'s clock; its TTL. ``NotLeader`` off the leader, ``KeyError``
        for an unknown lease."""
        term = await self._leading()
        if not term:
            g = self.node.groups[self.group]
            raise NotLeader(self.node.id, g.leader)
        if term != self.clocks.term:  # elected since the last tick: take over the clocks now
            await self.tick()
        if lease not in self.clocks.revoking and not self.clocks.knows(lease):
            async with self._lock:
                await self.reload()
        ttl = self.clocks.keepalive(lease)
        # Confirm the leadership after moving the deadline (a ReadIndex round, Raft §6.4):
        # a leader deposed without knowing it would otherwise acknowledge a keepalive its
        # successor never saw, whose clocks, started at its election, may then expire the
        # lease before the TTL the client was promised. Once a quorum acknowledges this
        # term, any successor is elected later, so its full TTL ends after ours.
        # The same round tells whether the lease still exists at that point: a revoke
        # committed meanwhile (by a client, or an expiry its predecessor proposed, which
        # our first entry committed) must not be answered as alive.
        alive = await wait(self.node.read_kv(
            self.group, lambda s: s.get_meta(lease_key(lease)) is not None))
        if await self._leading() != term:
            g = self.node.groups[self.group]
            raise NotLeader(self.node.id, g.leader)
        if not alive:
            self.clocks.revoked(lease)
            raise KeyError(lease)
        return ttl

    def remaining(self, lease: int) -> float | None:
        return self.clocks.remaining(lease)

    async def ensure_known(self, leases: Iterable[int]) -> None:
        """On the leader, start the clocks of ``leases`` now if it lacks them: a lease
        granted through another node gets its clock at the next reload, and until then
        ``remaining`` had no answer even on the leader (a test, 1 run in 4)."""
        if all(self.clocks.knows(lease) for lease in leases):
            return
        term = await self._leading()
        if not term:
            return
        if term != self.clocks.term:  # elected since the last tick: take over the clocks now
            await self.tick()
        if not all(self.clocks.knows(lease) for lease in leases):
            async with self._lock:
                await self.reload()


REPEAT_WARNING_SECONDS = 60.0


class LeasesApi:
    """The endpoints, and the keeper's ticks from the server's start (the node is attached
    later: ``attach``)."""

    def __init__(self) -> None:
        self._keeper: LeaseKeeper | None = None

    def attach(self, node: Node, group: str) -> None:
        self._keeper = LeaseKeeper(node, group)

    @property
    def keeper(self) -> LeaseKeeper:
        if self._keeper is None:
            raise web.HTTPServiceUnavailable(text='{"error": "starting"}',
                                             content_type="application/json")
        return self._keeper

    @property
    def node(self) -> Node:
        return self.keeper.node

    @property
    def group(self) -> str:
        return self.keeper.group

    def install(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/leases", self.grant)
        r.add_get("/v1/leases", self.list)
        r.add_get("/v1/leases/{id}", self.info)
        r.add_post("/v1/leases/{id}/keepalive", self.keepalive)
        r.add_delete("/v1/leases/{id}", self.revoke)
        app.on_startup.append(self._start)

    async def _start(self, app: web.Application) -> None:
        task = asyncio.get_running_loop().create_task(self._run())
        app.on_cleanup.append(lambda _: self._cancel(task))

    @staticmethod
    async def _cancel(task: asyncio.Task[None]) -> None:
        task.cancel()

    async def _run(self) -> None:
        said, said_at = "", 0.0
        while True:
            if self._keeper is not None:
                try:
                    await self._keeper.tick()
                    said = ""  # the same failure coming back is news again
                except Exception as e:  # noqa: BLE001 - the keeper must outlive a bad tick
                    # Once per distinct failure a minute: a node whose loop died failed
                    # every tick, four warnings a second (found from outside).
                    now = time.monotonic()
                    if str(e) != said or now - said_at >= REPEAT_WARNING_SECONDS:
                        said, said_at = str(e), now
                        log.warning("lease keeper: %s", e)
            await asyncio.sleep(TICK_SECONDS)

    @staticmethod
    def _id(request: web.Request) -> int:
        raw = request.match_info["id"]
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
            raise CommandError(f"a lease id is a positive integer, not {quoted(raw)}")
        return check_lease_id(int(raw))

    async def grant(self, request: web.Request) -> web.Response:
        check_query(request, ())
        body = await json_body(request)
        check_fields(body, ("ttl", "id"))
        ttl = check_ttl(body.get("ttl"))
        lease = check_lease_id(body["id"]) if "id" in body else secrets.randbelow(1 << 62) + 1
        require_leader(self.node, self.group)
        index, ok = await wait(self.node.propose(self.group, encode_lease_grant(lease, ttl)))
        if not ok:
            return error(409, f"lease {lease} already exists", id=lease)
        self.keeper.granted(lease, ttl)
        return web.json_response({"id": lease, "ttl": ttl, "index": index})

    async def keepalive(self, request: web.Request) -> web.Response:
        check_query(request, ())
        lease = self._id(request)
        try:
            ttl = await self.keeper.keepalive(lease)
        except KeyError:
            return error(404, f"lease {lease} not found", id=lease)
        return web.json_response({"id": lease, "ttl": ttl})

    async def revoke(self, request: web.Request) -> web.Response:
        check_query(request, ())
        lease = self._id(request)
        require_leader(self.node, self.group)
        index, deleted = await wait(self.node.propose(self.group, encode_lease_revoke(lease)))
        if deleted is False:
            return error(404, f"lease {lease} not found", id=lease)
        self.keeper.forget(lease)
        return web.json_response({"id": lease, "deleted": len(deleted), "index": index})

    async def list(self, request: web.Request) -> web.Response:
        check_query(request, ())
        require_leader(self.node, self.group)  # a linearizable read: 503 at once without one
        ttls = await wait(self.node.read_kv(self.group, read_leases))
        await self.keeper.ensure_known(ttls)
        return web.json_response({"leases": [
            {"id": lease, "ttl": ttl, **self._remaining(lease)}
            for lease, ttl in sorted(ttls.items())]})

    async def info(self, request: web.Request) -> web.Response:
        check_query(request, ())
        lease = self._id(request)
        require_leader(self.node, self.group)

        def look(s: KVStateStore) -> tuple[int | None, list[bytes]]:
            return read_leases(s).get(lease), lease_keys(s, lease)

        ttl, keys = await wait(self.node.read_kv(self.group, look))
        if ttl is None:
            return error(404, f"lease {lease} not found", id=lease)
        await self.keeper.ensure_known([lease])
        return web.json_response({"id": lease, "ttl": ttl, **self._remaining(lease),
                                  "keys": [base64.b64encode(k).decode() for k in keys]})

    def _remaining(self, lease: int) -> dict[str, Any]:
        """``remaining`` seconds, which only the leader's lease clocks know; elsewhere the
        leader's id, where a client may ask for them (found from outside: ``lease info``
        had them or not depending on the node that answered)."""
        left = self.keeper.remaining(lease)
        if left is not None:
            return {"remaining": round(left, 3)}
        leader = self.node.groups[self.group].leader
        return {"leader": leader} if leader and leader != self.node.id else {}
