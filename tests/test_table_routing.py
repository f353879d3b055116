"""How a node answers a table key it cannot serve itself (``raftkv.server.tables``).

The proxy (``TablesApi._elsewhere``) never sends a write twice. A node that does not
host a key's partition proxies the request over HTTP to a node that does: the
partition's leader first, then its other stable nodes. Moving on to the next one is
safe only if the request never reached the previous one. If the connection broke after
the request went out (the target was SIGKILLed after it applied the write, before it
answered), the write may have been applied: sending it again turns a compare-and-set
that swapped into a 412 from the second node (which compares against the value the
first one wrote), and applies a put twice. The proxy must then answer 504 (no outcome),
as a node answers a write whose outcome it does not know. Before the fix both aiohttp
(which resends a PUT or DELETE once on a broken connection, as RFC 9110 allows for
idempotent methods) and the proxy's loop over hosts sent it again, and the client got
the second node's 412.

A partition that moves away while a request is on it (``TablesApi._local``): the group
is gone here or on its leader, nothing was proposed, and the answer is a 503 to retry.
It used to be a 404, which ``Client.get`` reads as "no such key".

In-process: raw asyncio servers play the upstream nodes, so the broken connection comes
exactly where the test wants it; stubs play the placement and the node.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from raftkv.node.errors import RemoteError, UnknownGroup
from raftkv.server.kv_ops import KvRequest
from raftkv.server.requests import errors_middleware
from raftkv.server.tables import GENERATION, TablesApi, _PartitionFailed

Upstream = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def _dies_after_reading(log: list[str], name: str) -> Upstream:
    """Reads the whole request (it may have applied it), then the process is gone."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        log.append(f"{name} {head.split(b' ')[0].decode()}")
        writer.transport.abort()  # no answer: a SIGKILL resets the connection
    return serve


def _answers(log: list[str], name: str, status: int, body: dict[str, Any],
             heads: list[bytes] | None = None) -> Upstream:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, _ = await _read_request(reader)
                log.append(f"{name} {head.split(b' ')[0].decode()}")
                if heads is not None:
                    heads.append(head)
                data = json.dumps(body).encode()
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
    return serve


async def _listen(serve: Upstream) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"127.0.0.1:{port}"


async def _closed_port() -> str:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return f"127.0.0.1:{port}"


def _api(addrs: dict[str, str]) -> TablesApi:
    """A TablesApi whose placement routes partition 0 of table t to n1 (leader), then n2."""
    route = SimpleNamespace(leader="n1", nodes=["n1", "n2"])
    placement = SimpleNamespace(id="n9", mgr=SimpleNamespace(partition_route=lambda name, p: route,
                                                             generation=lambda name: 7),
                                http_addrs=lambda: dict(addrs),
                                node=SimpleNamespace(groups={}), scheme="http", http_ssl=None)
    return TablesApi(placement)  # type: ignore[arg-type]


async def _through_proxy(first: Upstream | None, method: str, query: str = ""
                         ) -> tuple[int, Any, list[str]]:
    """Send one request to a front node that hosts nothing; n1 behaves as ``first``
    (None: nobody listens), n2 answers 412 ``{"swapped": false}`` (or 200 to a GET)."""
    log: list[str] = []
    servers = []
    if first is None:
        a1 = await _closed_port()
    else:
        s1, a1 = await _listen(first)
        servers.append(s1)
    status, body = (200, {"value": "from n2"}) if method == "GET" else (
        412, {"index": 7, "swapped": False})
    s2, a2 = await _listen(_answers(log, "n2", status, body))
    servers.append(s2)
    api = _api({"n1": a1, "n2": a2})

    async def handler(request: web.Request) -> web.StreamResponse:
        return await api._elsewhere(request, "t", 0, await request.read())

    app = web.Application(middlewares=[errors_middleware])
    app.router.add_route("*", "/v1/tables/t/kv/{key}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as s, s.request(
                method, f"http://127.0.0.1:{port}/v1/tables/t/kv/k{query}",
                data=b"new" if method == "PUT" else None) as r:
            got = await r.json(content_type=None)
            return r.status, got, log
    finally:
        if api.session is not None:
            await api.session.close()
        await runner.cleanup()
        for server in servers:
            server.close()
            await server.wait_closed()


@pytest.mark.parametrize(("method", "query"), [("PUT", "?prev_value=old"), ("PUT", ""),
                                               ("DELETE", "?prev_value=old")])
def test_a_write_whose_proxied_connection_broke_is_not_sent_again(method: str,
                                                                 query: str) -> None:
    """n1 read the write and died without answering: the outcome is unknown (504), and
    n2 never sees it (it would answer 412 for a CAS n1 may have applied, or apply a put
    a second time)."""
    log: list[str] = []
    status, body, n2_log = asyncio.run(
        _through_proxy(_dies_after_reading(log, "n1"), method, query))
    assert log == [f"n1 {method}"]
    assert n2_log == [], "the proxy sent the write to a second node"
    assert status == 504, (status, body)
    assert "unknown" in body["error"]


def test_a_write_that_never_reached_the_leader_goes_to_the_next_host() -> None:
    """Nobody listens on n1's address (a refused connect: nothing was sent), so n2 gets
    the write and its answer is the answer."""
    status, body, n2_log = asyncio.run(_through_proxy(None, "PUT", "?prev_value=old"))
    assert n2_log == ["n2 PUT"]
    assert (status, body) == (412, {"index": 7, "swapped": False})


def test_a_read_whose_proxied_connection_broke_is_asked_of_the_next_host() -> None:
    """A read changes nothing, so asking the next host again is safe."""
    log: list[str] = []
    status, body, n2_log = asyncio.run(
        _through_proxy(_dies_after_reading(log, "n1"), "GET"))
    assert log == ["n1 GET"] and n2_log == ["n2 GET"]
    assert (status, body) == (200, {"value": "from n2"})


async def _batch_through_proxy(first: Upstream) -> tuple[int, list[str]]:
    """A table batch's share for partition 0 from a node that hosts nothing: n1 behaves
    as ``first``, n2 would apply it (200). The status the share failed with."""
    log: list[str] = []
    s1, a1 = await _listen(first)
    s2, a2 = await _listen(_answers(log, "n2", 200, {"index": 9, "ops": 1, "applied": True}))
    api = _api({"n1": a1, "n2": a2})
    try:
        await api._batch_into("t", 0, b"cmd", [(b"k", b"v")], {})
    except _PartitionFailed as e:
        return e.status, log
    finally:
        if api.session is not None:
            await api.session.close()
        for server in (s1, s2):
            server.close()
            await server.wait_closed()
    return 200, log


@pytest.mark.parametrize("n1", ["dies", "504"])
def test_a_table_batch_share_with_an_unknown_outcome_is_not_sent_again(n1: str) -> None:
    """The same rule for a table batch's share of one partition (``_batch_into``): once
    n1 may have applied it (it died after reading it, or answered 504), it is not sent to
    n2 as well; the share fails with an unknown outcome."""
    log: list[str] = []
    first = (_dies_after_reading(log, "n1") if n1 == "dies"
             else _answers(log, "n1", 504, {"error": "timed out"}))
    status, n2_log = asyncio.run(_batch_through_proxy(first))
    assert log == ["n1 POST"] and n2_log == []
    assert status == 504


def test_a_table_batch_share_refused_with_a_421_goes_to_the_next_host() -> None:
    """A 421 says nothing was proposed: the share goes on to n2, which applies it."""
    log: list[str] = []
    status, n2_log = asyncio.run(_batch_through_proxy(
        _answers(log, "n1", 421, {"error": "not the leader", "leader": "n2"})))
    assert log == ["n1 POST"] and n2_log == ["n2 POST"] and status == 200


def _failed(e: Exception) -> Future[object]:
    fut: Future[object] = Future()
    fut.set_exception(e)
    return fut


async def _local(req: KvRequest, e: Exception, table_exists: bool) -> tuple[int, Any]:
    """``_local``'s answer when the node's read or write fails with ``e``."""
    node = SimpleNamespace(groups={},  # hosts nothing here: require_leader lets it through
                           read=lambda group, fn, linearizable=True: _failed(e),
                           read_kv=lambda group, fn, linearizable=True: _failed(e),
                           propose=lambda group, data, shape=None: _failed(e))
    placement = SimpleNamespace(id="n1", node=node,
                                descriptor=lambda name: object() if table_exists else None)
    api = TablesApi(placement)  # type: ignore[arg-type]
    try:
        resp = await api._local("t", "t.t.0", req)
    except Exception as raised:  # noqa: BLE001 - what the middleware would answer
        from raftkv.server.requests import status_of
        resp = status_of(raised)
    return resp.status, json.loads(resp.body)  # type: ignore[arg-type]


MOVED = [UnknownGroup("node n1 does not host group 't.t.0'"),
         RemoteError("UnknownGroup", "n2 does not host group 't.t.0'")]
REQUESTS = [KvRequest("GET", b"k"), KvRequest("PUT", b"k", b"v"),
            KvRequest("PUT", b"k", b"v", compare=True, expected=b"old")]


@pytest.mark.parametrize("e", MOVED, ids=["here", "on-the-leader"])
@pytest.mark.parametrize("req", REQUESTS, ids=["get", "put", "cas"])
def test_a_partition_that_moved_away_mid_request_is_a_503_not_a_404(
        e: Exception, req: KvRequest) -> None:
    """The group is gone (here, or on the leader the write went to), the table is not:
    nothing was proposed, so 503 (retry); a 404 would read as "no such key"."""
    status, body = asyncio.run(_local(req, e, table_exists=True))
    assert status == 503, body
    assert "retry" in body["error"]


@pytest.mark.parametrize("e", MOVED, ids=["here", "on-the-leader"])
def test_a_request_on_a_dropped_table_is_still_a_404(e: Exception) -> None:
    status, body = asyncio.run(_local(KvRequest("GET", b"k"), e, table_exists=False))
    assert (status, body["error"]) == (404, "table t was dropped")


def test_a_proxied_batch_share_names_the_table_generation_and_a_mismatch_is_a_503() -> None:
    """Partition groups of a table dropped and created again share their ids; a proxied
    request names the generation the proxying node knows (``X-Raftkv-Table-Generation``,
    issue 14 item 4), and a node that knows another one refuses it with a 503 (retry)
    rather than serve it from the other table's partition."""
    log: list[str] = []
    heads: list[bytes] = []
    status, _ = asyncio.run(_batch_through_proxy(
        _answers(log, "n1", 200, {"index": 3}, heads)))
    assert status == 200 and b"X-Raftkv-Table-Generation: 7" in heads[0]

    api = _api({})
    for sent, refused in (("7", False), ("6", True), (None, False)):
        request = SimpleNamespace(headers={} if sent is None else {GENERATION: sent})
        if refused:
            with pytest.raises(web.HTTPServiceUnavailable):
                api._same_generation(request, "t")  # type: ignore[arg-type]
        else:
            api._same_generation(request, "t")  # type: ignore[arg-type]


NOT_HOSTED_503 = {"error": "t.t.0 is not hosted here (it may have just moved); retry",
                  "proposed": False}


@pytest.mark.parametrize(("method", "query"), [("GET", "?stale=true"), ("PUT", "?prev_value=old")])
def test_a_host_that_does_not_host_the_partition_passes_the_request_on(method: str,
                                                                      query: str) -> None:
    """Found from outside: n1, a stable node whose in-memory replica restarted empty,
    answered 503 "not hosted here", and that was the answer, though n2 served the
    partition. Nothing was proposed on n1, so the request goes on to n2, write or read."""
    log: list[str] = []
    status, body, n2_log = asyncio.run(
        _through_proxy(_answers(log, "n1", 503, NOT_HOSTED_503), method, query))
    assert log == [f"n1 {method}"] and n2_log == [f"n2 {method}"]
    assert status == (200 if method == "GET" else 412), body


def test_a_table_batch_share_refused_as_not_proposed_goes_to_the_next_host() -> None:
    """A 503 marked ``"proposed": false`` says nothing was proposed, as a 421 does."""
    log: list[str] = []
    status, n2_log = asyncio.run(_batch_through_proxy(_answers(log, "n1", 503, NOT_HOSTED_503)))
    assert log == ["n1 POST"] and n2_log == ["n2 POST"] and status == 200


@pytest.mark.parametrize("member", [False, True])
def test_a_table_lookup_on_a_node_left_out_of_the_metastore_is_a_503(member: bool) -> None:
    """Found from outside: a drained node, still running and never told of its removal,
    answered every request for a table it had not cached with a 504 ("outcome unknown")
    after 5 s, an unknown table's too. Not a member: 503 at once; a member whose read
    times out: 503, since a read proposes nothing."""
    from raftkv.node.errors import RequestTimeout

    def timed_out(name: str) -> None:
        raise RequestTimeout("no read index confirmed in time (no quorum?)")

    placement = SimpleNamespace(id="n4", node=SimpleNamespace(groups={}),
                                meta=SimpleNamespace(group="meta"),
                                meta_members=lambda: {"n1", "n2", "n3"} | ({"n4"} if member
                                                                           else set()),
                                descriptor_row=timed_out)
    api = TablesApi(placement)  # type: ignore[arg-type]
    with pytest.raises(web.HTTPServiceUnavailable) as e:
        asyncio.run(api._desc_row("t"))
    body = json.loads(e.value.text or "")
    assert body["proposed"] is False
    assert ("cannot catch up" if member else "not a member of the metastore") in body["error"]
