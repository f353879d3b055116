"""The request layer of the HTTP API: parsing, errors, and waiting for the driver.

Both the default group's handlers (``raftkv.server.app``) and the tables' handlers
(``raftkv.server.tables``) parse requests and report errors through this one module, so
the same bad input gets the same answer on ``/v1/kv`` and on ``/v1/tables/{t}/kv``. It
imports neither handler module; they import it.

Theory of operation
-------------------
A handler turns its request into typed values with the helpers here (``path_key``,
``flag``, ``query_bytes``, ``json_body``, ``decode_batch_body``). Each helper raises
``CommandError`` (a ``ValueError``) on bad input; ``errors_middleware`` turns that, and
every other failure, into a JSON ``{"error": ...}`` with the status ``status_of`` picks.
So no handler formats an error of its own for bad input, and none can forget to.

Query parameters are read strictly: a parameter a route does not know (``check_query``),
one given twice, or a flag that is neither true nor false is a 400. A typo such as
``?prev_valu=x`` would otherwise turn a compare-and-set into a plain put, silently.

Requests that never reach a handler get the same shape. A URL longer than
``MAX_URL_BYTES`` is a 414; aiohttp's parser reads request lines up to
``PARSER_LINE_LIMIT`` so that such a URL reaches ``errors_middleware`` to be told so.
A request aiohttp cannot parse at all (garbage, a bad header, a request line past the
parser's limit) is answered by ``JsonErrorsRunner``'s connections: a JSON 400, one
WARNING line in the log, no traceback.

Every 503 carries ``Retry-After: 1``: it means "no leader yet", "starting" or "moved",
all of which pass within an election timeout or two. A handler that needs a leader
calls ``require_leader`` first, so a node that knows none answers at once instead of
holding the request for the driver's full request timeout (a ``--join`` node not added
yet used to hold every request for 5 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

import msgpack
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from raftkv.core import (
    ConfChangeRejected,
    NotAMember,
    NotLeader,
    ProposalDropped,
    TransferRejected,
)
from raftkv.log_limits import RateLimitedLog
from raftkv.node.errors import (
    NodeStopped,
    RemoteError,
    ReplicaEmpty,
    RequestTimeout,
    UnknownGroup,
)
from raftkv.storage.commands import CommandError, check_key

if TYPE_CHECKING:
    from raftkv.node.driver import Node

log = logging.getLogger(__name__)

# Status codes for errors a leader reports on a forwarded write, by error kind.
_REMOTE_STATUS = {"CommandError": 400, "NotLeader": 503, "UnknownGroup": 404,
                  "RequestTimeout": 504, "NodeStopped": 503, "ProposalDropped": 503}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The longest URL (path and query) a request may have: aiohttp's own default request-line
# limit, which every request so far has met. The parser is let read up to
# PARSER_LINE_LIMIT so that a longer URL is answered 414, in JSON, by errors_middleware.
MAX_URL_BYTES = 8190
PARSER_LINE_LIMIT = 65536
RETRY_AFTER = "1"  # seconds: about one election timeout, the usual cause of a 503


class Starting(Exception):
    """The node is still being built (its log replayed); nothing can be served yet."""


def quoted(text: str, limit: int = 40) -> str:
    """``text`` as a repr for an error message, cut at ``limit`` characters with a
    visible "..." (a cut without one misquoted the request; found from outside)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def error(status: int, message: str, **extra: Any) -> web.Response:
    """The one shape of every error answer: JSON ``{"error": message, ...extra}``."""
    return web.json_response({"error": message, **extra}, status=status)


def status_of(e: BaseException) -> web.Response:
    """The answer for a failure: 400 bad input, 421/503 leadership, 409 refused change,
    504 no outcome in time, 404 unknown group; 500 only for a real fault."""
    if isinstance(e, CommandError):
        return error(400, str(e))
    if isinstance(e, NotAMember):
        return error(503, str(e), leader=None, removed={"by": e.by, "index": e.index})
    if isinstance(e, ReplicaEmpty):
        return error(503, str(e))
    if isinstance(e, NotLeader):
        if e.leader is not None:
            return error(421, f"not the leader; the leader is {e.leader}", leader=e.leader)
        return error(503, "no leader is known; retry shortly", leader=None)
    if isinstance(e, Starting):
        return error(503, f"starting: {e}; retry shortly", leader=None)
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
    if isinstance(e, web.RequestPayloadError | HttpProcessingError):
        # The body could not be read as sent: a Content-Encoding it does not decode
        # with, a truncated chunk. The client's fault, and nothing was proposed.
        return error(400, f"the request body cannot be read: {e.__cause__ or e}")
    log.error("request failed", exc_info=e)
    return error(500, f"internal error: {type(e).__name__}: {e}")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    answer = await _answer(request, handler)
    if answer.status == 503 and "Retry-After" not in answer.headers:
        answer.headers["Retry-After"] = RETRY_AFTER
    return answer


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    if len(request.raw_path) > MAX_URL_BYTES:
        return error(414, f"the URL is {len(request.raw_path)} bytes; at most "
                          f"{MAX_URL_BYTES} are accepted")
    coding = request.headers.get("Content-Encoding")
    if coding is not None and coding.strip().lower() != "identity" and request.body_exists:
        # aiohttp would inflate gzip and deflate bodies, but takes a truncated stream
        # as a shorter body: "x" sent as gzip was stored as an empty value. No client
        # of this API compresses, so a coded body is refused (RFC 9110 section 15.5.16).
        answer = error(415, f"a request body in Content-Encoding {coding!r} is not "
                            "accepted; send it uncompressed")
        answer.headers["Accept-Encoding"] = "identity"
        answer.force_close()
        await answer.prepare(request)
        await answer.write_eof()
        # Closed rather than drained: aiohttp would inflate the unread body to discard
        # it, and log a traceback when it does not inflate.
        request.protocol.force_close()
        return answer
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            answer = error(e.status, e.reason)
            if "Allow" in e.headers:  # a 405 says which methods the resource takes
                answer.headers["Allow"] = e.headers["Allow"]
            return answer
        raise
    except ConnectionError as e:
        transport = request.transport
        if not isinstance(e, ConnectionResetError) and (
                transport is not None and not transport.is_closing()):
            return status_of(e)  # not our client's connection (a peer's, say)
        # The client hung up mid-request or mid-stream (aiohttp says "Connection lost"
        # when a streamed answer's writer finds the transport gone: a watch closed early
        # logged a traceback and counted a 500; found outside-in): nothing was proposed
        # and nobody is listening.
        log.debug("client closed the connection during %s %s", request.method, request.path)
        return error(400, "client closed the connection")
    except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error, never a trace
        return status_of(e)


def require_leader(node: Node, group: str) -> None:
    """``NotLeader`` (a 503 with Retry-After, which says nothing was proposed) unless this
    node knows a leader of ``group`` (``NotAMember`` if it was told it was removed). Read from the HTTP thread without the driver's
    loop: a stale answer either way is harmless, since a leader lost a moment ago is
    caught by the driver as before, and one found a moment ago by the client's retry."""
    g = node.groups.get(group)
    if g is not None and g.leader is None:
        removed = g.raft.removed
        if removed is not None:
            raise NotAMember(node.id, *removed, group=group)
        raise NotLeader(node.id, None)


# A connection must send a whole request head within this, and may stay idle between
# requests this long (aiohttp's keep-alive timer runs from the connection's start too).
# aiohttp's own default is an hour: silent or one-header-line-a-second connections held
# descriptors until a node ran out of them (found from outside).
IDLE_SECONDS = 30.0
# Connections beyond this are closed at once: a flood is then a denial of service that
# ends with it, not a node left without descriptors for its own files.
MAX_CONNECTIONS = 4096
# The parser quotes the offending header bytes in its message: an Authorization header
# with a stray byte put a bearer token in the log and in the answer (found from outside).
_QUOTED = re.compile(r"""b(['"]).*""", re.DOTALL)


def _without_quoted_bytes(text: str) -> str:
    """The parser's message up to the bytes it quotes (which may hold a credential)."""
    return _QUOTED.sub("(the offending bytes are not shown)", text)


# A flood must not flood the log as well: connections over the cap are said at most once
# a minute, and a client's unparsable requests a few times per window (found from
# outside: 3,000 malformed requests added 3,000 lines).
_refused = RateLimitedLog(log, every=60.0, burst=1)
_bad_requests = RateLimitedLog(log)


class _JsonErrorsProtocol(RequestHandler):
    """aiohttp's connection handler, answering what never reaches the app (a request
    it cannot parse, or a failure past every middleware) in the API's JSON shape, and
    closing a connection beyond ``MAX_CONNECTIONS`` at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self._manager is not None
        cap = getattr(self._manager, "max_connections", MAX_CONNECTIONS)
        if len(self._manager.connections) > cap:
            _refused.log("", "cap", "more than %d HTTP connections open: refusing new ones "
                         "until some close", cap)
            self.force_close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            # The client's bad request: its 400 is the whole story, so one line, no trace.
            text = _without_quoted_bytes(" ".join(str(message or exc.message).split()))[:300]
            _bad_requests.log(str(request.remote), "bad request",
                              "bad HTTP request from %s: %s", request.remote, text)
        else:
            if exc is not None:
                log.error("request failed outside the handlers", exc_info=exc)
            text = "internal error" if status == 500 else f"HTTP {status}"
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun: no error answer can follow")
        answer = error(status, text)
        answer.force_close()
        return answer


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        # The only way to choose the connection class: aiohttp offers no public hook
        # for unparsable requests (aio-libs/aiohttp#3287). _loop and _kwargs are what
        # web.Server.__call__ passes to RequestHandler itself.
        return _JsonErrorsProtocol(self, loop=self._loop, **self._kwargs)


class JsonErrorsRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer unparsable requests with a JSON error
    (``_JsonErrorsProtocol``) instead of aiohttp's plain text."""

    def __init__(self, app: web.Application, idle_seconds: float | None = None,
                 max_connections: int | None = None, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=idle_seconds or IDLE_SECONDS, **kwargs)
        self._max_connections = max_connections or MAX_CONNECTIONS

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorsServer  # same state, its own __call__
        server.max_connections = self._max_connections  # type: ignore[attr-defined]
        return server


# Every driver future resolves or fails by the request timeout; this bound is a backstop so
# an HTTP request can never hang.
WAIT_LIMIT = 60.0


async def wait(fut: Future[Any]) -> Any:
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


# -- the path and the query ------------------------------------------------------------------
def path_key(request: web.Request, prefix: str) -> bytes:
    """The key in a path ``<prefix><percent-encoded key>``, as bytes (any 1..511 bytes).
    The raw path is used, so an encoded ``/`` or a non-UTF-8 byte stays what it was."""
    raw = request.rel_url.raw_path
    if not raw.startswith(prefix):
        raise web.HTTPNotFound()
    return check_key(_unquote_strictly(raw[len(prefix):], "the key"))


# A '%' that does not start two hex digits (unquote keeps such text as it is).
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _unquote_strictly(text: str, what: str) -> bytes:
    """Percent-decoded bytes; a malformed escape is a 400. Kept as literal text, ``x%zz``
    named the same key as ``x%25zz`` (found from outside)."""
    bad = _BAD_ESCAPE.search(text)
    if bad is not None:
        raise CommandError(f"{what} has a malformed percent-escape at "
                           f"{text[bad.start():bad.start() + 3]!r}: write '%' as %25")
    return unquote_to_bytes(text)


def _raw_query(request: web.Request) -> dict[str, bytes]:
    """The query parameters as bytes (``+`` is a space, as in a form), each given once."""
    out: dict[str, bytes] = {}
    for part in request.rel_url.raw_query_string.split("&"):
        if not part:
            continue
        name_raw, _, value_raw = part.partition("=")
        name = _unquote_strictly(name_raw.replace("+", " "), "a query parameter's name"
                                 ).decode("utf-8", "replace")
        if name in out:
            raise CommandError(f"?{name} is given more than once")
        out[name] = _unquote_strictly(value_raw.replace("+", " "), f"?{name}")
    return out


def check_query(request: web.Request, allowed: Iterable[str]) -> None:
    """400 if the query names a parameter outside ``allowed`` or repeats one."""
    known = set(allowed)
    unknown = sorted(set(_raw_query(request)) - known)
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise CommandError(f"unknown query parameter ?{unknown[0]} for {request.method} "
                           f"{request.path} (accepted: {accepted})")


def query_bytes(request: web.Request, name: str) -> bytes | None:
    """The raw bytes of ``?name=`` (percent-decoded, not UTF-8 decoded), or None."""
    return _raw_query(request).get(name)


def flag(request: web.Request, name: str) -> bool:
    """A boolean parameter: absent or ``false``/``0`` is False; ``true``/``1``/empty (a
    bare ``?stale``) is True, in any case; anything else is a 400 (a misspelt value must
    not read as false)."""
    raw = _raw_query(request).get(name)
    if raw is None:
        return False
    v = raw.decode("utf-8", "replace").lower()
    if v not in ("true", "false", "1", "0", ""):
        raise CommandError(f"?{name} must be true or false, not {v[:40]!r}")
    return v in ("true", "1", "")


# -- bodies ------------------------------------------------------------------------------------
async def json_body(request: web.Request) -> dict[str, Any]:
    return json_object(await request.read())


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a field given twice (which one would count is a guess)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise CommandError(f"the body gives the field {k!r} twice")
        out[k] = v
    return out


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; ``CommandError`` (400) for anything else."""
    try:
        body = json.loads(raw, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as e:
        raise CommandError(f"the body is not JSON ({e.msg} at line {e.lineno} column "
                           f"{e.colno}); it must be a JSON object") from None
    except UnicodeDecodeError:
        raise CommandError("the body is not UTF-8 text; it must be a JSON object") from None
    except RecursionError:
        raise CommandError("the body nests too deeply; it must be a JSON object") from None
    if not isinstance(body, dict):
        raise CommandError("the body must be a JSON object")
    return body


def str_field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v:
        raise CommandError(f'"{name}" must be a non-empty string')
    try:
        v.encode()
    except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate has no UTF-8
        raise CommandError(f'"{name}" is not valid Unicode') from None
    return v


def check_fields(doc: dict[str, Any], fields: tuple[str, ...], what: str = "",
                 note: str = "") -> None:
    """400 (``CommandError``) for a field outside ``fields``: a misspelt or foreign field
    must not be ignored as if the request had not said it (a ``"storgae": "memory"``
    creating a persistent table, etcd's ``range_end`` turning into a single-key delete, a
    batch ``"id"`` the client believes makes it idempotent: all found from outside)."""
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise CommandError(f"{what + ': ' if what else ''}unknown field {unknown[0]!r} "
                           f"(fields: {', '.join(fields)}{note})")


def decode_batch_body(raw: bytes, content_type: str) -> list[tuple[bytes, bytes | None]]:
    """A batch body: msgpack (``application/x-msgpack``) ``[[key, value|nil], ...]`` with
    binary keys and values, or JSON ``{"ops": [[key, value|null], ...]}`` with strings;
    at least one operation."""
    if content_type == "application/x-msgpack":
        try:
            ops = msgpack.unpackb(raw, raw=False, max_array_len=1 << 20, max_map_len=0)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as e:
            # Some decoders' errors have no text (found from outside: "not msgpack: ").
            raise CommandError(f"the body is not msgpack: {e or type(e).__name__}") from None
    else:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise CommandError('the body must be JSON {"ops": [[key, value], ...]}') from None
        if isinstance(body, dict):
            check_fields(body, ("ops",), "a batch")
        ops = body.get("ops") if isinstance(body, dict) else None
    if not isinstance(ops, list):
        # Say which form this content type takes (found from outside: a bare JSON list
        # was refused with a message that described the bare list).
        raise CommandError(
            "a msgpack batch is an array of [key, value|nil] pairs" if content_type ==
            "application/x-msgpack" else 'a JSON batch is {"ops": [[key, value], ...]} '
            "(value null deletes; send msgpack as application/x-msgpack for bytes)")
    out = []
    for op in ops:
        if not (isinstance(op, list) and len(op) == 2):
            raise CommandError(f"batch item {op!r:.60} is not a [key, value] pair")
        try:
            k, v = (x.encode() if isinstance(x, str) else x for x in op)
        except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate has no UTF-8
            raise CommandError(f"batch item {op!r:.60} is not valid Unicode") from None
        if not isinstance(k, bytes) or not (v is None or isinstance(v, bytes)):
            raise CommandError("batch keys and values must be strings or bytes")
        out.append((k, v))
    if not out:
        # Refused on every route alike: a table's batch always refused it, while the
        # default group's wrote an empty log entry (found outside-in).
        raise CommandError("a batch needs at least one operation")
    return out
