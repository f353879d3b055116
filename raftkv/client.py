"""A Python client for a raftkv cluster's HTTP API (what the CLI uses).

Give it every endpoint you know, as with etcdctl. Requests go to the current endpoint
over one kept-alive connection; on a connection failure, a 503 (no leader yet) or a 504
it moves on to the next endpoint and retries until its deadline. A 421 names the leader:
the client learns each endpoint's node id from ``/v1/cluster`` and retries on the
leader's endpoint. Writes are safe to send to any node (followers forward them), so only
admin calls depend on finding the leader.

Table requests are partition-aware: the client caches each table's partition leaders,
read from the nodes' own views (``GET /v1/tables/{t}/leaders``), for ``ROUTE_TTL`` seconds,
or ``ROUTE_RETRY`` if some partition had no leader then (read during an election, the cache
would otherwise send that partition's requests through a proxy for the whole TTL). It
sends a key's request, or a partition's batch, straight to the endpoint of its partition's leader, saving the hop a
node that does not lead the partition would add (a proxy, or a forward to the leader).
The cache is only a hint: any node answers correctly, since the server computes the
partition itself. A 421, an error or a retry drops the table's entry, so the next request
looks again.

A write is never sent again after an attempt that may have applied (an answer lost to
a dropped connection, a 504), as etcd's client does not resend a put: a second copy
would apply twice (two revisions and two watch events for one put, and a value another
writer replaced in between would come back; found from outside). ``put``, ``delete``,
``cas``, ``txn``, ``batch``, a lease grant, a membership change and a leadership
transfer raise ``OutcomeUnknown`` instead; they retry only after a refused connection
or a 503 that says no leader took the request.
(A ``cas`` retried would also answer 412 for the swap its first attempt made.) A
partition batch with a ``batch_id`` applies at most once, so it is retried. Not
thread-safe: one client per thread.

Two timeouts, as etcdctl's ``--dial-timeout`` and ``--command-timeout``: ``timeout``
bounds a whole request, retries included. A request whose answer has not come after a
third of it (at least a second) checks that the node is alive with ``/health`` on another
connection, and gives up on a node that does not answer that either, so a node that
accepts connections but never answers (stopped, wedged) cannot take the whole deadline;
a request that may be sent again then tries the next endpoint, and after a write's
``OutcomeUnknown`` the next request starts there. ``connect_timeout`` bounds each
connection attempt and, when given, how long a request keeps trying to connect: once
every endpoint has been tried and none has accepted a connection by then, it fails with
``Unavailable`` instead of retrying refused connections until ``timeout`` (``None``:
until ``timeout``).

TLS: ``https://`` endpoints are verified against ``cacert`` (a PEM CA file; default
``$RAFTKV_CACERT``, else the system's CAs), host name included; ``cert`` and ``key``
(default ``$RAFTKV_CERT``, ``$RAFTKV_KEY``) are presented to a server that asks for a
client certificate (``raftkv serve --client-cert-auth``). An endpoint without a scheme
is ``https://`` when a CA file is given or another endpoint is ``https://`` (one cluster,
one scheme: a token never goes in clear to a cluster reached over TLS), else ``http://``. The names are etcdctl's
(``--cacert``, ``--cert``, ``--key``), so the Spark jobs and the CLI pick them up from
the environment too.

Credentials: a cluster that checks tokens (``raftkv serve --tokens-file``) wants
``Authorization: Bearer TOKEN`` on every request. The client sends ``token=``, else the
contents of ``token_file=``, else ``$RAFTKV_TOKEN``, else the contents of the file named
by ``$RAFTKV_TOKEN_FILE`` (``resolve_token``); with none of them it sends no header. A
401 or 403 is not retried: another node would say the same.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import select
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import msgpack

from raftkv.placement.assignments import partition_of
from raftkv.tls import client_context

RETRYABLE = {503, 504}
# A watch stream silent this long is broken: three of the server's progress intervals
# (raftkv.server.watch_ops.PROGRESS_SECONDS, 2 s), whatever the request timeout.
WATCH_SILENCE = 6.0
# A request whose answer has not come after timeout / ATTEMPTS seconds (at least
# MIN_ATTEMPT) checks that its node is alive (Client._await_answer); a lookup waits that
# long for one node before it asks the next.
ATTEMPTS = 3
MIN_ATTEMPT = 1.0
# A pooled connection idle longer than this is replaced before use: well inside the
# server's default --http-idle-timeout (30 s), after which it closes idle connections.
IDLE_REUSE = 10.0
ROUTE_TTL = 10.0  # seconds a table's cached partition leaders are trusted
ROUTE_RETRY = 0.5  # ... and a cache with a partition whose leader was unknown


KEY_NOT_FOUND = "key not found"  # the 404 of an absent key (raftkv.server.kv_ops)


class ClientError(Exception):
    """The cluster answered with an error; ``status`` and ``body`` say which."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body.get('error', body)}")
        self.status = status
        self.body = body


class Unavailable(Exception):
    """No endpoint gave an answer before the deadline."""


class BackupWriteFailed(OSError):
    """A backup could not be written where asked (a full disk, no permission): this
    side's failure, said as such (it read as "no node answered", found from outside)."""


def _write_backup(r: http.client.HTTPResponse, path: str) -> int:
    """Stream ``r`` into ``path.part``, sync it, then link it to ``path``: the bytes
    written. A failure leaves neither file behind (a full disk left a ``.part``)."""
    part = path + ".part"
    done = False

    def failed(e: OSError) -> BackupWriteFailed:
        return BackupWriteFailed(e.errno, f"cannot write the backup to {part}: {e.strerror}")

    try:
        try:
            # Unbuffered: a write that fails must fail in write(), not later in a close
            # whose plain OSError would read as the network's (a small backup's last
            # bytes stayed in the buffer, found in review).
            f = open(part, "wb", buffering=0)  # noqa: SIM115  # closed by the with below
        except OSError as e:
            raise failed(e) from e
        n = 0
        with f:
            while chunk := r.read(1 << 20):  # a network error here is not ours: as is
                view = memoryview(chunk)
                try:
                    while view:
                        view = view[f.write(view):]
                except OSError as e:
                    raise failed(e) from e
                n += len(chunk)
            try:
                os.fsync(f.fileno())  # durable before its name says it is whole
            except OSError as e:
                raise failed(e) from e
        # A link, not a rename: it fails if path exists, so no backup is ever replaced,
        # even one written while this one streamed.
        try:
            os.link(part, path)
        except FileExistsError:
            raise
        except OSError as e:
            raise failed(e) from e
        done = True
        os.unlink(part)
        return n
    finally:
        if not done and os.path.lexists(part):
            try:
                os.unlink(part)
            except OSError:
                pass


class NotConnected(ConnectionError):
    """No connection to the endpoint could be made: nothing was sent."""


class OutcomeUnknown(Unavailable):
    """A request that must not be sent twice (``cas``) reached a node and got no definite
    answer (a lost connection, a 504, a 503 that may follow a proposal): it may or may
    not have applied, and may still apply later (a stopped node proposes what it had
    unread when it resumes). ``raftkv.errors`` says how to settle it safely."""


def _raw(v: object, what: str) -> bytes:
    """A key or value as the API takes it: bytes, or a str (UTF-8). Anything else, None
    included, is the caller's mistake, said so before a request is sent (a None value
    was sent as an empty body, and stored an empty value: found from outside)."""
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bytes):
        return v
    raise TypeError(f"{what} must be bytes or str, not {type(v).__name__}")


def _readable(sock: Any, wait: float = 0.0) -> bool:
    """Whether ``sock`` has something to read, waiting up to ``wait`` seconds. For an
    idle kept-alive socket (no wait): the server closed it (or sent what no request
    asked for); either way it is not fit for the next request. poll, not select:
    select refuses descriptors from 1,024 on (found in review)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(1000 * wait))


def _nothing_proposed(status: int, info: dict[str, Any]) -> bool:
    """A 503 whose request provably never became a log entry: no leader was known, so
    nothing was proposed (``status_of``'s NotLeader answer), a leadership transfer
    refused it (ProposalDropped), or the node says so (``"proposed": false``: a table
    partition not hosted where the request arrived, or not yet anywhere known)."""
    return status == 503 and ("leader" in info and info["leader"] is None
                              or info.get("proposed") is False
                              or "transfer" in str(info.get("error", "")))


def resolve_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The bearer token to send (module docstring), or None. ``ValueError`` if a token
    file cannot be read, or the token is not one word."""
    where = "the token"
    if token is None and token_file is None:
        token = os.environ.get("RAFTKV_TOKEN") or None
        where = "$RAFTKV_TOKEN"
        if token is None:
            token_file = os.environ.get("RAFTKV_TOKEN_FILE") or None
    if token is None and token_file is not None:
        where = f"the token file {token_file}"
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the token file {token_file}: {e}") from None
    if token is not None and (not token or any(c.isspace() for c in token)):
        raise ValueError(f"{where} must hold one token: one word, no spaces or line breaks")
    return token


class Client:
    def __init__(self, endpoints: list[str] | str, timeout: float = 10.0,
                 connect_timeout: float | None = None, *,
                 cacert: str | None = None, cert: str | None = None,
                 key: str | None = None, token: str | None = None,
                 token_file: str | None = None) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        cacert = cacert or os.environ.get("RAFTKV_CACERT") or None
        cert = cert or os.environ.get("RAFTKV_CERT") or None
        key = key or os.environ.get("RAFTKV_KEY") or None
        # A bare host:port is HTTPS when a CA is given or any endpoint is https://: one
        # cluster serves one scheme, and a token must never go in clear to a node of a
        # cluster the caller reaches over TLS (found from outside: the Spark jobs did).
        tls = cacert is not None or any(e.startswith("https://") for e in endpoints)
        scheme = "https" if tls else "http"
        self.endpoints = [e if "://" in e else f"{scheme}://{e}" for e in endpoints]
        for e in self.endpoints:
            u = urlsplit(e)
            if u.scheme not in ("http", "https"):
                raise ValueError(f"bad endpoint {e!r}: expected http:// or https://")
            try:
                u.port  # noqa: B018 - parsed here so that a bad one names its endpoint
            except ValueError as err:
                raise ValueError(f"bad endpoint {e!r}: {err}") from None
            if u.path.strip("/") or u.query or u.fragment:
                # The API's paths are fixed (/v1/...): one given here was dropped without
                # a word (found from outside), as if a proxy's prefix had been honoured.
                raise ValueError(f"bad endpoint {e!r}: an endpoint is scheme://host:port, "
                                 "without a path")
        # Made once, up front: a missing CA or key file is a clear error now, and every
        # connection shares one context (and its TLS session cache).
        self.tls_files = (cacert, cert, key)  # for clients of other endpoints (discovery)
        self.scheme = scheme
        self.ssl: ssl.SSLContext | None = None
        if any(e.startswith("https://") for e in self.endpoints):
            self.ssl = client_context(cacert, cert, key)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._current = 0
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._used: dict[str, float] = {}  # endpoint -> when its connection last answered
        self._ids: dict[str, str] = {}  # node id -> endpoint
        # table -> (when fetched, partition count, each partition's leader or None)
        self._routes: dict[str, tuple[float, int, list[str | None]]] = {}
        self._detours = 0  # endpoint moves (a redirect or a retry elsewhere), ever
        self._attempts = 0  # requests sent, ever (a call that sent more than one retried)
        self._missing: dict[str, float] = {}  # node id -> until when not to look again
        # endpoint -> until when it is not asked for routes or ids, nor moved to first
        self._silent: dict[str, float] = {}
        bearer = resolve_token(token, token_file)
        self._auth = {"Authorization": f"Bearer {bearer}"} if bearer else {}

    # -- transport ----------------------------------------------------------------------
    def _conn(self, endpoint: str) -> http.client.HTTPConnection:
        c = self._conns.get(endpoint)
        if c is None:
            u = urlsplit(endpoint)
            host = u.hostname or "127.0.0.1"
            timeout = self.connect_timeout or self.timeout
            if u.scheme == "https":
                c = http.client.HTTPSConnection(host, u.port or 443, timeout=timeout,
                                                context=self.ssl)
            else:
                c = http.client.HTTPConnection(host, u.port or 80, timeout=timeout)
            self._conns[endpoint] = c
        return c

    def _stream(self, endpoint: str, timeout: float) -> http.client.HTTPConnection:
        """A connection of its own for a long answer (a watch, a backup): the pooled
        ones stay free for requests."""
        u = urlsplit(endpoint)
        host = u.hostname or "127.0.0.1"
        if u.scheme == "https":
            return http.client.HTTPSConnection(host, u.port or 443, timeout=timeout,
                                               context=self.ssl)
        return http.client.HTTPConnection(host, u.port or 80, timeout=timeout)

    def _once(
        self, endpoint: str, method: str, path: str, body: bytes | None,
        headers: dict[str, str] | None = None, wait: float | None = None,
        probe: bool = False, once: bool = False,
    ) -> tuple[int, bytes, str]:
        """One attempt, its answer waited for ``wait`` seconds (default ``timeout``).
        ``probe``: if none has come after ``_probe_wait`` seconds, ask the node's
        ``/health`` on another connection, and give up on it at once if that goes
        unanswered too (``_await_answer``; only when there is another endpoint to try:
        alone, a node that stalls after the write left may still answer it, and giving
        up early would only turn its answer into an unknown outcome). With ``once``, a
        new connection first asks ``/health`` itself, with one endpoint too: a stopped
        node accepts connections (its kernel does), and a write sent on one could only
        end in an unknown outcome, whereas
        a node found stopped before the write went out is simply not the one to ask
        (every ``raftkv put`` listing a stopped node first failed so; etcd's client,
        over HTTP/2, never sends on a connection whose handshake did not finish)."""
        wait = wait or self.timeout
        c = self._conn(endpoint)
        if c.sock is not None and (time.monotonic() - self._used.get(endpoint, 0.0) > IDLE_REUSE
                                   or _readable(c.sock)):
            # The server may close it any moment now (--http-idle-timeout), or has (it
            # restarted, or timed the connection out: the socket reads as closed). A
            # request sent on it would have an unknown outcome though it never arrived,
            # and a write is not sent twice.
            c.close()
        try:
            if c.sock is None:
                # A stopped node accepts the TCP connection (the kernel does) but never
                # completes a TLS handshake: bound it as a connection attempt.
                c.timeout = min(self.connect_timeout or self._probe_wait, wait)
                try:
                    c.connect()
                except ssl.SSLCertVerificationError:
                    raise  # not a connection that may come up later (request() says why)
                except OSError as e:
                    raise NotConnected(f"cannot connect: {e}") from e
                if once:
                    c.sock.settimeout(min(self._probe_wait, wait))  # type: ignore[attr-defined]
                    try:
                        c.request("GET", "/health")
                        health = c.getresponse()
                        health.read()
                    except (OSError, http.client.HTTPException) as e:
                        raise NotConnected(f"connected, but no answer to a health check "
                                           f"({e}): is the node stopped?") from e
                    if health.status != 200:
                        # Not a raftkv node (a proxy's error page, another server): the
                        # write goes to the next endpoint. A node answers 200 even while
                        # it starts (found from outside: a 501 that closed the connection
                        # ended the command in a traceback).
                        raise NotConnected(f"its health check answered HTTP {health.status}: "
                                           f"not a raftkv node, or not serving")
                    if c.sock is None:  # answered, then closed the connection
                        try:
                            c.connect()
                        except OSError as e:
                            raise NotConnected(f"cannot connect again: {e}") from e
            c.sock.settimeout(wait)  # type: ignore[attr-defined]
            c.request(method, path, body=body, headers={**self._auth, **(headers or {})})
            if probe:
                self._await_answer(endpoint, c, time.monotonic() + wait)
            r = c.getresponse()
            out = r.status, r.read(), r.getheader("Content-Type", "")
            self._used[endpoint] = time.monotonic()
            return out
        except (OSError, http.client.HTTPException):
            c.close()
            self._conns.pop(endpoint, None)
            raise

    def _await_answer(self, endpoint: str, c: http.client.HTTPConnection,
                      deadline: float) -> None:
        """Wait until ``c`` has an answer to read, or ``deadline``. Every
        ``_probe_wait`` seconds without one, check that the node is alive with a
        ``/health`` request on a connection of its own: a node that accepts connections
        but never answers (SIGSTOPped, wedged) otherwise held a request, and the client,
        for the whole timeout while other nodes were up (found from outside), whereas a
        slow answer from a live node is worth waiting for (gRPC's keepalive pings tell
        the two apart for etcd's client). ``TimeoutError`` if the node is not alive."""
        sock = c.sock
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or getattr(sock, "pending", lambda: 0)() or _readable(
                    sock, min(left, self._probe_wait)):
                return  # an answer (or the deadline: the read then times out)
            if time.monotonic() < deadline and not self._alive(endpoint):
                raise TimeoutError(f"no answer, nor to a health check within "
                                   f"{self._probe_wait:.1f}s (is the node stopped?)")

    def _alive(self, endpoint: str) -> bool:
        """Whether ``endpoint`` answers ``/health`` (any status) within ``_probe_wait``."""
        c = self._stream(endpoint, self._probe_wait)
        try:
            c.request("GET", "/health")
            c.getresponse().read()
            return True
        except (OSError, http.client.HTTPException):
            return False
        finally:
            c.close()

    def request(
        self, method: str, path: str, body: bytes | None = None, ok: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None, once: bool = False,
        route: tuple[str, bytes | int] | None = None,
    ) -> tuple[int, bytes]:
        """Send a request, retrying as the module docstring says. ``once``: the request
        must not apply twice; after an attempt that may have applied, raise
        ``OutcomeUnknown`` rather than send it again. ``route``: (table, key or
        partition): start at that partition's leader (the module docstring)."""
        if route is None:
            return self._request(method, path, body, ok, headers, once)
        leader = self._partition_leader(*route)
        if leader is not None:
            self._current = self.endpoints.index(leader)
        detours = self._detours
        try:
            return self._request(method, path, body, ok, headers, once)
        except (Unavailable, ClientError) as e:
            if not isinstance(e, ClientError) or e.status == 421:
                self._routes.pop(route[0], None)
            raise
        finally:
            if self._detours != detours:  # redirected or retried: look again next time
                self._routes.pop(route[0], None)

    def _request(self, method: str, path: str, body: bytes | None, ok: tuple[int, ...],
                 headers: dict[str, str] | None, once: bool) -> tuple[int, bytes]:
        start = time.monotonic()
        deadline = start + self.timeout
        connected = False
        tried: set[str] = set()
        gone: set[str] = set()  # endpoints removed from the group: they never serve it
        last = "no attempt"
        delay = 0.05
        while True:
            endpoint = self.endpoints[self._current]
            self._attempts += 1
            left = max(deadline - time.monotonic(), 0.001)
            try:
                status, data, ctype = self._once(endpoint, method, path, body, headers,
                                                 left, probe=len(self.endpoints) > 1,
                                                 once=once)
            except ssl.SSLCertVerificationError as e:
                # Not a passing fault: retrying until the deadline would only hide it.
                raise Unavailable(f"{endpoint}: TLS: {e.verify_message}: its certificate is "
                                  "not signed by the trusted CA (--cacert, RAFTKV_CACERT) "
                                  "or does not name that host") from e
            except (OSError, http.client.HTTPException) as e:
                if isinstance(e, TimeoutError | NotConnected):
                    # Not asked again for a while by lookups, nor moved to first.
                    self._silent[endpoint] = time.monotonic() + ROUTE_TTL
                if once and not isinstance(e, NotConnected):
                    # The next request starts elsewhere: this endpoint may be hung, and
                    # the client stayed on it for good (found from outside).
                    self._next()
                    raise OutcomeUnknown(f"{endpoint}: {e}, after the request may have "
                                         "been sent; it may or may not have applied") from e
                last = f"{endpoint}: {e}"
                self._next()
                tried.add(endpoint)
                if (isinstance(e, NotConnected) and not connected
                        and len(tried) == len(self.endpoints)
                        and self.connect_timeout is not None
                        and time.monotonic() + delay - start > self.connect_timeout):
                    raise Unavailable(f"could not connect to any endpoint within "
                                      f"{self.connect_timeout}s (last: {last})") from None
            else:
                connected = True
                if status in ok:
                    return status, data
                info = _json(data, ctype)
                hint = info.get("leader") or info.get("node")
                if status == 421 and hint:
                    target = self._endpoint_of(str(hint))
                    if target is not None and target != endpoint:
                        # Follow the hint, but within the deadline: around an election
                        # two nodes may each name the other.
                        self._current = self.endpoints.index(target)
                        self._detours += 1
                        last = f"{endpoint}: redirected to {hint}"
                        if time.monotonic() + delay > deadline:
                            raise Unavailable(f"no answer within {self.timeout}s (last: {last})")
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                # A 5xx that is not raftkv's JSON comes from something else on the way (a
                # proxy's error page, another server): another endpoint may serve.
                foreign = status >= 500 and "json" not in ctype
                if status not in RETRYABLE and not foreign:
                    raise ClientError(status, info)  # includes 421 for a leader we cannot reach
                if once and not _nothing_proposed(status, info):
                    self._next()
                    raise OutcomeUnknown(f"{endpoint}: HTTP {status} "
                                         f"{info.get('error', '')}: it may or may not have "
                                         "applied")
                last = f"{endpoint}: HTTP {status} {info.get('error', '')}"
                if info.get("removed"):
                    # A node removed from the group (NotAMember): asking it again is in
                    # vain, in this request (gone) and in the next ones (silent). On to
                    # the next endpoint not gone, even one that went silent: passing over
                    # silent ones could land back here and loop without a pause (review).
                    self._silent[endpoint] = time.monotonic() + ROUTE_TTL
                    gone.add(endpoint)
                    if len(gone) == len(self.endpoints):
                        raise ClientError(status, info)
                    n = len(self.endpoints)
                    self._current = next(j for j in ((self._current + k) % n
                                                     for k in range(1, n))
                                         if self.endpoints[j] not in gone)
                else:
                    self._next()
            if time.monotonic() + delay > deadline:
                if gone:  # said too: the likeliest reason nothing else answered
                    last += f"; removed from the group: {', '.join(sorted(gone))}"
                raise Unavailable(f"no answer within {self.timeout}s (last: {last})")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    @property
    def _probe_wait(self) -> float:
        """How long a lookup (a node's id, a table's leaders, the published endpoints)
        waits for one endpoint: as a retried request's attempt does."""
        return min(self.timeout, max(MIN_ATTEMPT, self.timeout / ATTEMPTS))

    def _next(self) -> None:
        """Move to the next endpoint, passing over those that went silent lately (if
        any other is left)."""
        self._detours += 1
        now = time.monotonic()
        n = len(self.endpoints)
        for step in range(1, n + 1):
            i = (self._current + step) % n
            if self._silent.get(self.endpoints[i], 0.0) <= now or step == n:
                self._current = i
                return

    def _partition_leader(self, table: str, where: bytes | int) -> str | None:
        """The endpoint of the leader of ``table``'s partition ``where`` (or the one
        holding key ``where``), from the cache or a fresh ``describe_table``; None when
        unknown (an election, a table the cluster does not know: the request finds out)."""
        now = time.monotonic()
        cached = self._routes.get(table)
        if (cached is None or now - cached[0] > ROUTE_TTL
                or (now - cached[0] > ROUTE_RETRY and not all(cached[2]))):
            cached = (now, *self._fetch_leaders(table))
            self._routes[table] = cached
        _, count, leaders = cached
        if not count:
            return None
        p = where if isinstance(where, int) else partition_of(where, count)
        leader = leaders[p] if 0 <= p < count else None
        return self._endpoint_of(leader) if leader else None

    def _endpoint_of(self, node_id: str) -> str | None:
        """The endpoint of node ``node_id``: one of ours (each asked its id once), else
        the HTTP address the node published in the metastore (``/v1/cluster``'s
        ``"http"``), which joins our endpoints, so a redirect or a partition's leader
        can be followed with only some nodes given. An id found nowhere is not looked for
        again for ``ROUTE_TTL`` seconds."""
        if node_id in self._ids or self._missing.get(node_id, 0.0) > time.monotonic():
            return self._ids.get(node_id)
        now = time.monotonic()
        for e in self.endpoints:
            if e in self._ids.values() or self._silent.get(e, 0.0) > now:
                continue  # a silent one cost a redirect its deadline (found from outside)
            try:
                status, data, ctype = self._once(e, "GET", "/health", None, wait=self._probe_wait)
            except (OSError, http.client.HTTPException):
                self._silent[e] = now + ROUTE_TTL
                continue
            if status in (200, 503):  # 503: up, but no leader known yet
                ident = _json(data, ctype).get("id")
                if ident is not None:
                    self._ids[str(ident)] = e
        if node_id not in self._ids:
            self._discover()
        if node_id not in self._ids:
            self._missing[node_id] = time.monotonic() + ROUTE_TTL
        return self._ids.get(node_id)

    def _fetch_leaders(self, table: str) -> tuple[int, list[str | None]]:
        """(partition count, each partition's leader or None) from the nodes' own views
        (``GET /v1/tables/{t}/leaders``: each knows the partitions it hosts), asking one
        endpoint after another until every partition has a leader, the nodes the cluster
        publishes too if ours do not host them all; (0, []) if none could say."""
        path = f"/v1/tables/{quote(table, safe='')}/leaders"
        count: int = 0
        leaders: list[str | None] = []
        asked: set[str] = set()
        now = time.monotonic()
        for pass_ in range(2):
            if pass_:
                self._discover()
            # The current endpoint first (it answers our requests); one that failed to
            # answer lately is not waited for again until ROUTE_TTL has passed.
            order = self.endpoints[self._current:] + self.endpoints[:self._current]
            for e in [e for e in order
                      if e not in asked and self._silent.get(e, 0.0) <= now]:
                asked.add(e)
                try:
                    status, data, ctype = self._once(e, "GET", path, None, wait=self._probe_wait)
                except (OSError, http.client.HTTPException):
                    self._silent[e] = now + ROUTE_TTL
                    continue
                try:
                    doc = _json(data, ctype) if status == 200 else {}
                    got = [x if isinstance(x, str) else None for x in doc["leaders"]]
                    n = int(doc["partitions"])
                except (KeyError, TypeError, ValueError):
                    continue
                if n != len(got) or (count and n != count):
                    continue
                count = n
                leaders = ([a or b for a, b in zip(leaders, got, strict=True)] if leaders
                           else got)
                if all(leaders):
                    return count, leaders
        return count, leaders

    def _discover(self) -> None:
        """Learn every node's endpoint from the HTTP addresses the nodes published in the
        metastore (``/v1/cluster``'s ``"http"``); new ones join our endpoints."""
        for e in list(self.endpoints):
            try:
                status, data, ctype = self._once(e, "GET", "/v1/cluster", None, wait=self._probe_wait)
            except (OSError, http.client.HTTPException):
                continue
            addrs = _json(data, ctype).get("http") if status == 200 else None
            if not isinstance(addrs, dict):
                continue
            scheme = urlsplit(e).scheme
            for node_id, addr in sorted(addrs.items()):
                if not isinstance(addr, str) or not addr or node_id in self._ids:
                    continue
                endpoint = addr if "://" in addr else f"{scheme}://{addr}"
                if urlsplit(endpoint).hostname in (None, "", "0.0.0.0", "::"):
                    continue  # a wildcard bind names no address a client can dial
                if endpoint not in self.endpoints:
                    self.endpoints.append(endpoint)
                self._ids[str(node_id)] = endpoint
            return

    @staticmethod
    def _route(table: str | None, key: bytes | str) -> tuple[str, bytes] | None:
        return None if table is None else (table, _raw(key, "a key"))

    @staticmethod
    def _kv(key: bytes | str, table: str | None = None) -> str:
        k = _raw(key, "a key")
        if table is not None:
            return f"/v1/tables/{quote(table, safe='')}/kv/" + quote(k, safe="")
        return "/v1/kv/" + quote(k, safe="")

    def get(self, key: bytes | str, stale: bool = False, table: str | None = None
            ) -> bytes | None:
        """The value, or None if absent. ``table``: a key of that table (else the
        default KV group)."""
        path = self._kv(key, table) + ("?stale=true" if stale else "")
        try:
            return self.request("GET", path, route=self._route(table, key))[1]
        except ClientError as e:
            # Only an absent key is None: an unknown or dropped table is a 404 too, and
            # must not read as "no such key".
            if e.status == 404 and e.body.get("error") == KEY_NOT_FOUND:
                return None
            raise

    def range_page(self, *, prefix: bytes | str | None = None, start: bytes | str | None = None,
                   end: bytes | str | None = None, limit: int | None = None,
                   after: str | None = None, keys_only: bool = False,
                   count_only: bool = False, stale: bool = False,
                   table: str | None = None, meta: bool = False) -> dict[str, Any]:
        """One page of a range read (``GET /v1/kv?...``; ``table``: over that table):
        ``{"revision", "kvs": [(key, value | None)], "count", "more", "continue"}`` with
        keys and values as bytes (with ``meta``, ``(key, value | None, {"create_revision",
        "mod_revision", "version"})``), or ``{"revision", "count"}`` with ``count_only``.
        ``after``: the previous page's ``continue``; no prefix, start or end: every key
        (as ``raftkv scan`` without a range)."""
        if prefix is None and start is None and end is None:
            prefix = b""

        q: list[str] = []
        for name, v in (("prefix", prefix), ("start", start), ("end", end)):
            if v is not None:
                q.append(f"{name}=" + quote(_raw(v, name), safe=""))
        for name, on in (("keys_only", keys_only), ("count_only", count_only),
                         ("stale", stale), ("meta", meta)):
            if on:
                q.append(f"{name}=true")
        if limit is not None:
            q.append(f"limit={int(limit)}")
        if after is not None:
            q.append("continue=" + quote(after, safe=""))
        base = f"/v1/tables/{quote(table, safe='')}/kv" if table is not None else "/v1/kv"
        doc = json.loads(self.request("GET", base + "?" + "&".join(q))[1])
        if "kvs" in doc:
            dec = base64.b64decode
            revs = ("create_revision", "mod_revision", "version")
            doc["kvs"] = [(dec(kv["key"]), dec(kv["value"]) if "value" in kv else None,
                           *([{r: kv[r] for r in revs}] if meta else []))
                          for kv in doc["kvs"]]
        return doc

    def scan(self, *, prefix: bytes | str | None = None, start: bytes | str | None = None,
             end: bytes | str | None = None, page: int = 1000, keys_only: bool = False,
             stale: bool = False, table: str | None = None
             ) -> Iterator[tuple[bytes, bytes | None]]:
        """Every ``(key, value)`` of a range in key order, page by page. Each page is
        consistent at its own revision; the pages together are not a snapshot (a key
        written during the scan is seen as of a later page, ``raftkv.server.range_ops``)."""
        after: str | None = None
        while True:
            doc = self.range_page(prefix=prefix, start=start, end=end, limit=page,
                                  after=after, keys_only=keys_only, stale=stale, table=table)
            yield from doc["kvs"]
            if not doc["more"]:
                return
            after = doc["continue"]

    def get_meta(self, key: bytes | str, stale: bool = False, table: str | None = None
                 ) -> dict[str, Any] | None:
        """The value and revisions, ``{"value", "create_revision", "mod_revision",
        "version"}`` (value as bytes), or None if absent."""
        path = self._kv(key, table) + "?meta=true" + ("&stale=true" if stale else "")
        try:
            doc = dict(json.loads(self.request("GET", path, route=self._route(table, key))[1]))
        except ClientError as e:
            if e.status == 404 and e.body.get("error") == KEY_NOT_FOUND:
                return None
            raise
        doc.pop("key", None)
        doc["value"] = base64.b64decode(doc["value"])
        return doc

    def watch(self, *, prefix: bytes | str | None = None, start: bytes | str | None = None,
              end: bytes | str | None = None, from_revision: int | None = None,
              table: str | None = None, partition: int | None = None,
              ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """The changes to a range, in revision order: ``(revision, events)``, each event
        ``{"type": "put" | "delete", "key": bytes, "value": bytes}`` (no value for a
        delete). A broken stream is resumed on the next endpoint from the last revision
        (or progress line) + 1, so nothing is missed or repeated
        (``raftkv.server.watch_ops``). ``table`` and ``partition``: a table partition's
        log (its own revisions). A revision already compacted raises ``ClientError``
        (410, ``oldest_revision`` in its body); so does any other refusal but a retryable
        one. Runs until the caller stops iterating, or until no node has served the
        watch for ``timeout`` seconds: ``Unavailable``, which names the revision to
        resume from (found from outside: ``raftkv watch`` against a node that accepted
        connections and never answered waited in silence for good). A node that answers
        neither the request nor a health check within ``_probe_wait`` is left, and a
        stream silent for ``WATCH_SILENCE`` (three of the server's progress intervals) is
        broken; a stream that broke after serving gives the failover the whole timeout.

        Without ``from_revision`` the watch starts with the changes after the first node
        to serve it answered; pass the revision of a read to miss nothing since."""
        q = [f"{n}=" + quote(_raw(v, n), safe="") for n, v in
             (("prefix", prefix), ("start", start), ("end", end)) if v is not None]
        base = ("/v1/watch" if table is None else
                f"/v1/tables/{quote(table, safe='')}/partitions/{int(partition or 0)}/watch")
        nxt = from_revision
        delay = 0.05
        served = time.monotonic()  # when a node last served the watch (or it began)
        last = "no attempt"
        while True:
            endpoint = self.endpoints[self._current]
            path = base + "?" + "&".join(q + ([f"from_revision={nxt}"] if nxt else []))
            conn = self._stream(endpoint, self._probe_wait)
            streaming = False
            try:
                conn.request("GET", path, headers=self._auth)
                # A slow node is waited for (it may first wait for its log to reach
                # from_revision), a hung one is left after a probe wait.
                self._await_answer(endpoint, conn, time.monotonic() + max(self.timeout, 10.0))
                r = conn.getresponse()
                if r.status != 200:
                    info = _json(r.read(), r.getheader("Content-Type", ""))
                    if r.status not in RETRYABLE and r.status != 421:
                        raise ClientError(r.status, info)
                    last = f"{endpoint}: HTTP {r.status} {info.get('error', '')}"
                else:
                    delay = 0.05
                    streaming = True
                    conn.sock.settimeout(WATCH_SILENCE)  # type: ignore[attr-defined]
                    for line in iter(r.readline, b""):
                        served = time.monotonic()
                        doc = json.loads(line)
                        if "error" in doc:
                            # 410: compacted past (oldest_revision); 401: the token
                            # was revoked while the watch ran.
                            raise ClientError(int(doc.get("status", 410)), doc)
                        if "progress" in doc:
                            nxt = max(nxt or 0, int(doc["progress"]) + 1)
                            continue
                        events = [{**e, "key": base64.b64decode(e["key"]),
                                   **({"value": base64.b64decode(e["value"])}
                                      if "value" in e else {})} for e in doc["events"]]
                        nxt = int(doc["revision"]) + 1
                        yield int(doc["revision"]), events
            except (OSError, http.client.HTTPException, ValueError) as e:
                last = f"{endpoint}: {e or type(e).__name__}"  # broke: resume from nxt
                if streaming:
                    # A stream that served until it broke: the failover gets the whole
                    # timeout from now, not from its last line (review).
                    served = time.monotonic()
            finally:
                conn.close()
            if time.monotonic() + delay - served > self.timeout:
                since = f"; resume with from_revision={nxt}" if nxt else ""
                raise Unavailable(f"no node served the watch for {self.timeout}s "
                                  f"(last: {last}){since}")
            self._next()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def snapshot_save(self, path: str, table: str | None = None,
                      partition: int | None = None) -> int:
        """Stream a backup of the default group (``GET /v1/snapshot``, ``raftkv.backup``),
        or of one table partition, from its leader into ``path`` (written to
        ``path.part`` first, then linked to ``path``, which must not exist:
        ``FileExistsError``); the bytes written."""
        url = ("/v1/snapshot" if table is None else
               f"/v1/tables/{quote(table, safe='')}/partitions/{int(partition or 0)}/snapshot")
        target = None
        for _ in range(2 * len(self.endpoints) + 2):
            endpoint = target or self.endpoints[self._current]
            conn = self._stream(endpoint, max(self.timeout, 30.0))
            try:
                conn.request("GET", url, headers=self._auth)
                r = conn.getresponse()
                if r.status == 200:
                    return _write_backup(r, path)
                info = _json(r.read(), r.getheader("Content-Type", ""))
                hint = info.get("leader")
                if r.status == 421 and hint:
                    target = self._endpoint_of(str(hint))
                    continue
                if r.status not in RETRYABLE:
                    raise ClientError(r.status, info)
            except (BackupWriteFailed, FileExistsError):
                raise  # this side's failure: another node would not help
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            target = None
            self._next()
            time.sleep(0.2)
        raise Unavailable("no node answered with a backup")

    def put(self, key: bytes | str, value: bytes | str, table: str | None = None,
            lease: int | None = None) -> int:
        """Write ``value``; the entry's index. ``lease``: attach the key to that lease
        (``ClientError`` 404 if it does not exist, and nothing is written)."""
        v = _raw(value, "a value")
        path = self._kv(key, table) + (f"?lease={int(lease)}" if lease is not None else "")
        return int(json.loads(self.request("PUT", path, v, once=True,
                                           route=self._route(table, key))[1])["index"])

    # -- leases (raftkv.server.leases) ---------------------------------------------------
    def lease_grant(self, ttl: int, lease: int | None = None) -> int:
        """A new lease of ``ttl`` seconds (id ``lease``, or a random one): its id."""
        body: dict[str, int] = {"ttl": ttl, **({"id": lease} if lease is not None else {})}
        _, data = self.request("POST", "/v1/leases", json.dumps(body).encode(), once=True)
        return int(json.loads(data)["id"])

    def lease_keepalive(self, lease: int) -> int:
        """Restart the lease's clock on the leader; its TTL."""
        return int(self._post(f"/v1/leases/{int(lease)}/keepalive")["ttl"])

    def lease_revoke(self, lease: int) -> int:
        """Revoke the lease now: how many keys it deleted."""
        return int(self._post(f"/v1/leases/{int(lease)}", method="DELETE")["deleted"])

    def lease_info(self, lease: int) -> dict[str, Any]:
        """``{"id", "ttl", "remaining"?, "keys"}`` (keys as bytes; ``remaining`` unless
        the leader could not be asked)."""
        doc = self._from_leader(f"/v1/leases/{int(lease)}", lambda d: [d])
        doc["keys"] = [base64.b64decode(k) for k in doc["keys"]]
        return doc

    def leases(self) -> list[dict[str, Any]]:
        """``[{"id", "ttl", "remaining"?}]``, as ``lease_info``."""
        return list(self._from_leader("/v1/leases", lambda d: d["leases"])["leases"])

    def _from_leader(self, path: str, leases: Callable[[dict[str, Any]], list[Any]]
                     ) -> dict[str, Any]:
        """A lease read, asked again of the leader when the node that answered named it
        instead of giving ``remaining`` (only the leader's lease clocks know it; found from
        outside: ``lease info`` had it or not depending on the node). ``leases(doc)``:
        the answer's per-lease parts. The hint is dropped from the answer."""
        doc = dict(json.loads(self.request("GET", path)[1]))
        hints = {str(p["leader"]) for p in leases(doc) if "leader" in p}
        target = self._endpoint_of(hints.pop()) if len(hints) == 1 else None
        if target is not None:
            self._current = self.endpoints.index(target)
            doc = dict(json.loads(self.request("GET", path)[1]))
        for p in leases(doc):
            p.pop("leader", None)
        return doc

    def delete(self, key: bytes | str, table: str | None = None) -> int:
        return int(json.loads(self.request("DELETE", self._kv(key, table), once=True,
                                           route=self._route(table, key))[1])["index"])

    def cas(
        self, key: bytes | str, expected: bytes | str | None, new: bytes | str | None,
        table: str | None = None, prev_index: int | None = None,
    ) -> tuple[bool, int]:
        """Set ``new`` (None: delete the key) if the value is ``expected`` (None: the
        key must be absent), or, with ``prev_index``, if the key's mod revision is that
        (0: absent; ``expected`` is then ignored): ``(swapped, index)``, as the embedded
        ``RaftKV.cas``. ``table``: a key of that table (else the default group)."""
        method, v = ("DELETE", None) if new is None else ("PUT", _raw(new, "a value"))
        if prev_index is not None:
            q = f"?prev_index={int(prev_index)}"
        elif expected is None:
            # "Must be absent" is ?prev_absent on a put; a delete says it as revision 0.
            q = "?prev_absent=true" if method == "PUT" else "?prev_index=0"
        else:
            q = "?prev_value=" + quote(_raw(expected, "the expected value"), safe="")
        _, data = self.request(method, self._kv(key, table) + q, v, ok=(200, 412),
                               once=True, route=self._route(table, key))
        body = json.loads(data)
        return bool(body["swapped"]), int(body["index"])

    def txn(self, compare: list[dict[str, Any]] | None = None,
            success: list[dict[str, Any]] | None = None,
            failure: list[dict[str, Any]] | None = None,
            table: str | None = None) -> dict[str, Any]:
        """A transaction as one log entry (``POST /v1/txn``; the body format is
        ``raftkv.server.txn_ops``'s): ``{"succeeded", "index", "responses"}``. Sent at
        most once: an answer lost in a failure raises ``OutcomeUnknown``."""
        body = json.dumps({"compare": compare or [], "success": success or [],
                           "failure": failure or []}).encode()
        path = (f"/v1/tables/{quote(table, safe='')}/txn" if table is not None
                else "/v1/txn")
        _, data = self.request("POST", path, body, once=True,
                               headers={"Content-Type": "application/json"})
        return dict(json.loads(data))

    def batch(self, ops: list[tuple[bytes | str, bytes | str | None]],
              table: str | None = None) -> Any:
        """Puts (and deletes, value None) as one log entry, atomically: the entry's index.
        With a ``table``: one atomic entry per partition, ``{partition: index}``."""
        pairs = []
        for op in ops:
            if not isinstance(op, tuple | list) or len(op) != 2:
                raise TypeError(f"a batch op is a (key, value) pair (value None: delete), "
                                f"not {op!r:.60}")
            k, v = op
            pairs.append([_raw(k, "a key"), None if v is None else _raw(v, "a value")])
        body = msgpack.packb(pairs, use_bin_type=True)
        path = "/v1/batch" if table is None else f"/v1/tables/{quote(table, safe='')}/batch"
        _, data = self.request("POST", path, body, once=True,
                               headers={"Content-Type": "application/x-msgpack"})
        answer = json.loads(data)
        if table is None:
            return int(answer["index"])
        return {int(p): i for p, i in answer["partitions"].items()}

    def batch_put(self, items: dict[str, str] | dict[bytes, bytes]) -> int:
        return self.batch(list(items.items()))

    # -- admin --------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None = None, method: str = "POST",
              once: bool = False) -> Any:
        raw = json.dumps(body).encode() if body is not None else None
        return json.loads(self.request(method, path, raw, once=once)[1])

    def status(self, endpoint: str | None = None) -> dict[str, Any]:
        if endpoint is None:
            return json.loads(self.request("GET", "/v1/cluster")[1])
        status, data, ctype = self._once(endpoint, "GET", "/v1/cluster", None)
        if status != 200:
            raise ClientError(status, _json(data, ctype))
        return json.loads(data)

    # A membership change or a transfer that timed out may still happen (a transfer's
    # target took over after the leader said it had not: found from outside), so each
    # is sent once: a second attempt elsewhere hid the leader's answer behind "no answer
    # in time" and asked again for a change already made.
    def add_learner(self, node_id: str, raft_addr: str) -> Any:
        return self._post("/v1/cluster/learners", {"id": node_id, "raft_addr": raft_addr},
                          once=True)

    def promote(self, node_id: str) -> Any:
        return self._post(f"/v1/cluster/members/{quote(node_id, safe='')}/promote",
                          once=True)

    def remove(self, node_id: str) -> Any:
        path = f"/v1/cluster/members/{quote(node_id, safe='')}"
        return json.loads(self.request("DELETE", path, ok=(200, 202), once=True)[1])

    def transfer(self, to: str) -> Any:
        return self._post("/v1/cluster/transfer", {"to": to}, once=True)

    # -- tables -------------------------------------------------------------------------
    def create_table(self, name: str, partitions: int, replicas: int,
                     storage: str = "persistent", allow_unsafe: bool = False) -> Any:
        """The descriptor, plus a ``"warning"`` when the replica count cannot survive one
        failure (two replicas in memory are refused unless ``allow_unsafe``)."""
        body: dict[str, Any] = {"name": name, "partitions": partitions, "replicas": replicas,
                                "storage": storage}
        if allow_unsafe:
            body["allow_unsafe"] = True
        raw = json.dumps(body).encode()
        sent = self._attempts
        try:
            return json.loads(self.request("POST", "/v1/tables", raw, ok=(201,))[1])
        except ClientError as e:
            if e.status != 409 or self._attempts - sent < 2:
                raise
            # Retried after an answer that left the outcome unknown (a 504, a dropped
            # connection): the 409 may be our own first attempt's table. If the table is
            # the one asked for, that is the create succeeding, as one answer would have
            # said; any other table of that name is a real conflict.
            found = [t for t in self.list_tables() if t.get("name") == name]
            if not found or (found[0].get("partitions"), found[0].get("replicas"),
                             found[0].get("storage")) != (partitions, replicas, storage):
                raise
            return found[0]

    def list_tables(self) -> list[dict[str, Any]]:
        return list(json.loads(self.request("GET", "/v1/tables")[1])["tables"])

    def describe_table(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.request("GET", f"/v1/tables/{quote(name, safe='')}")[1]))

    def drop_table(self, name: str) -> Any:
        return json.loads(self.request("DELETE", f"/v1/tables/{quote(name, safe='')}")[1])

    def set_replicas(self, name: str, replicas: int, allow_unsafe: bool = False) -> Any:
        body: dict[str, Any] = {"replicas": replicas}
        if allow_unsafe:
            body["allow_unsafe"] = True
        return self._post(f"/v1/tables/{quote(name, safe='')}/replicas", body, method="PUT")

    def partition_batch(self, table: str, partition: int,
                        ops: Sequence[tuple[bytes, bytes | None]],
                        batch_id: bytes | None = None) -> dict[str, Any]:
        """One batch into one partition as one Raft entry: ``{"index", "ops", "applied"}``.
        With a ``batch_id`` it applies at most once (``applied`` False: it had already), so
        a retry after a lost answer is safe, which is why the Spark loader always sets one."""
        body = msgpack.packb({"id": batch_id, "ops": [list(op) for op in ops]},
                             use_bin_type=True)
        path = f"/v1/tables/{quote(table, safe='')}/partitions/{partition}/batch"
        _, data = self.request("POST", path, body, route=(table, partition),
                               once=batch_id is None,
                               headers={"Content-Type": "application/x-msgpack"})
        return dict(json.loads(data))

    def table_partition_digest(self, table: str, partition: int) -> dict[str, Any]:
        """The digest of a partition read on its leader after a ReadIndex round, so it
        covers every write acknowledged before the call (``partition_digest``), found
        from ``describe_table`` and retried while leadership moves."""
        last: Exception | None = None
        for _ in range(20):
            parts = self.describe_table(table)["partitions"]
            leader = parts[partition]["leader"] if partition < len(parts) else None
            endpoint = self._endpoint_of(str(leader)) if leader else None
            if endpoint is not None:
                try:
                    return self.partition_digest(table, partition, endpoint,
                                                 linearizable=True)
                except (ClientError, OSError, http.client.HTTPException) as e:
                    last = e
            time.sleep(0.25)
        raise Unavailable(f"no leader of {table} partition {partition} gave its digest "
                          f"(last: {last})")

    def partition_digest(self, table: str, partition: int, endpoint: str, *,
                         min_index: int = 0, keys: int = 0, linearizable: bool = False,
                         timeout: float = 30.0) -> dict[str, Any]:
        """The digest of ONE replica (the node at ``endpoint``) of a partition, once it has
        applied ``min_index``; ``keys=N`` also lists rows when there are at most N."""
        path = (f"/v1/tables/{quote(table, safe='')}/partitions/{partition}/digest"
                f"?min_index={min_index}&keys={keys}&timeout={timeout}"
                f"&linearizable={'true' if linearizable else 'false'}")
        ep = endpoint if "://" in endpoint else f"http://{endpoint}"
        status, data, ctype = self._once(ep, "GET", path, None)
        if status != 200:
            raise ClientError(status, _json(data, ctype))
        return dict(json.loads(data))

    def add_node(self, node_id: str, raft_addr: str, http_addr: str | None = None) -> Any:
        """Add a node to the placement topology (metastore learner + ``placement.nodes``)."""
        body: dict[str, Any] = {"id": node_id, "raft_addr": raft_addr}
        if http_addr:
            body["http_addr"] = http_addr
        return self._post("/v1/cluster/nodes", body)

    def remove_node(self, node_id: str) -> Any:
        return self._post(f"/v1/cluster/nodes/{quote(node_id, safe='')}", method="DELETE")

    def drain(self, node_id: str) -> Any:
        """Decommission a placement node: its partitions move off it, then it leaves the
        topology and the metastore (progress: ``cluster_nodes``)."""
        return self._post(f"/v1/cluster/nodes/{quote(node_id, safe='')}/drain")

    def cluster_nodes(self) -> list[dict[str, Any]]:
        """Each placement node's liveness: state (alive, suspect, dead), seconds in it,
        epoch, whether it is in the topology and a data node."""
        return list(json.loads(self.request("GET", "/v1/cluster/nodes")[1])["nodes"])

    def settings(self) -> dict[str, Any]:
        return dict(json.loads(self.request("GET", "/v1/cluster/settings")[1]))

    def update_settings(self, **settings: float) -> dict[str, Any]:
        """``scale_down_timeout`` / ``scale_up_timeout`` in seconds (0 turns automatic
        removal off), ``metastore_voters`` (3 or 5), ``max_moves`` (partitions a leader
        adds replicas to at once, 0: no limit), ``catch_up_timeout`` (seconds)."""
        return dict(self._post("/v1/cluster/settings", settings, method="PUT"))

    def for_endpoint(self, endpoint: str) -> Client:
        """A client of ``endpoint`` alone, with this client's timeouts, TLS files and
        credentials (``raftkv cluster status`` asks every node through one)."""
        cacert, cert, key = self.tls_files
        other = Client([endpoint], timeout=self.timeout, connect_timeout=self.connect_timeout,
                       cacert=cacert, cert=cert, key=key)
        other._auth = dict(self._auth)  # the token as resolved here, not again
        return other

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()


def _json(data: bytes, ctype: str) -> dict[str, Any]:
    if "json" in ctype:
        try:
            body = json.loads(data)
            if isinstance(body, dict):
                return body
        except ValueError:
            pass
    # Not raftkv's JSON (an HTML error page, say): one line of it, for a one-line error.
    return {"error": " ".join(data[:400].decode(errors="replace").split())[:200]}
