"""Who may call the HTTP API: bearer tokens, each mapped to a role, checked per route.

Theory of operation
-------------------
``raftkv serve --tokens-file F`` reads ``F``: one token a line, ``ROLE NAME TOKEN``
(``#`` starts a comment). Roles are ordered, each granting what the one below grants:

- ``metrics``: ``GET /metrics`` only (a Prometheus scraper's token);
- ``read``: KV and table reads, digests, cluster and table status;
- ``write``: also writes (puts, deletes, compare-and-set, batches);
- ``admin``: also membership, leadership transfer, tables and placement (create, drop,
  replicas, topology), and the test fault switch.

``/health`` and ``/ready`` need no token: they are the probes of a load balancer or of
Kubernetes, which must work before anyone hands out credentials, and they say nothing
a caller could act on. Every other route needs a token: the table of which route needs
which role is ``raftkv.server.app.ROLES``, and the app refuses to start with a route
missing from it. A path that matches no route needs a valid token too (of any role)
before it is told 404, so an anonymous caller learns nothing about the routes.

A request carries ``Authorization: Bearer TOKEN`` (RFC 6750). Without one it is a 401;
with a token that is not in the file, or a header that is not a single bearer token, a
401; with a token whose role is below the route's, a 403. Each is a JSON error in the
API's usual shape, with a ``WWW-Authenticate`` header saying which (RFC 6750 §3).

The presented token is hashed (SHA-256) and compared with the hash of every known token
with ``hmac.compare_digest``, all of them, every time: how long the check takes does not
depend on how much of a token an attacker guessed right, nor on which token matched.

``SIGHUP`` reloads the file (``Tokens.reload``): a new token works, a removed one is
refused, from the next request on. A file that fails to parse is refused as a whole
and the tokens already loaded stay in force, so a typo can neither lock every client out
nor open the API.

Without ``--tokens-file`` the API is open, as before tokens existed, and ``serve`` logs a
warning saying so. Every node of a cluster should have the same file: a node that
proxies a table request to another one forwards the caller's own ``Authorization``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raftkv.log_limits import RateLimitedLog

if TYPE_CHECKING:
    from aiohttp import web
    from aiohttp.typedefs import Handler, Middleware

# aiohttp is imported where the middleware is made: ``raftkv serve`` checks the tokens
# file, then opens its node while the HTTP stack is still being imported.

log = logging.getLogger(__name__)


class Role(enum.IntEnum):
    """What a token may do; each role includes the ones below it."""

    METRICS = 0
    READ = 1
    WRITE = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


# RFC 6750's b64token: what may follow "Bearer " in a header, so any token in the file
# can be sent. At least 16 characters: a short token can be guessed over the network.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]{16,}=*")
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class TokenFileError(ValueError):
    """The tokens file cannot be used; the message names the file and line, never a
    token."""


@dataclass(frozen=True)
class Identity:
    """Whom a valid token names: its holder (for the log) and role."""

    name: str
    role: Role


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, path: str) -> dict[bytes, Identity]:
    """The tokens in ``text`` (a tokens file's contents), keyed by their SHA-256.
    ``TokenFileError`` names the first bad line: an unknown role, a name or token that
    is malformed, a token or name given twice."""
    out: dict[bytes, Identity] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        parts = line.split()
        if len(parts) != 3:
            raise TokenFileError(f"{where}: expected ROLE NAME TOKEN, found {len(parts)} "
                                 "fields")
        role_text, name, token = parts
        try:
            role = Role[role_text.upper()]
        except KeyError:
            raise TokenFileError(
                f"{where}: unknown role {role_text[:20]!r} (roles: "
                f"{', '.join(r.label for r in Role)})") from None
        if not _NAME.fullmatch(name):
            raise TokenFileError(f"{where}: a name is 1..64 letters, digits or _.@-")
        if not _TOKEN.fullmatch(token):
            raise TokenFileError(f"{where}: the token of {name} must be at least 16 "
                                 "characters of A-Z a-z 0-9 - . _ ~ + / (then any '=')")
        if name in names:
            raise TokenFileError(f"{where}: the name {name} is given twice")
        key = _digest(token)
        if key in out:
            raise TokenFileError(f"{where}: the token of {name} is also the token of "
                                 f"{out[key].name}")
        names.add(name)
        out[key] = Identity(name, role)
    if not out:
        raise TokenFileError(f"{path}: no tokens (expected lines of ROLE NAME TOKEN); to "
                             "run without authentication, give no tokens file")
    return out


class Tokens:
    """The tokens file of a running server: loaded at start, reloaded on ``reload()``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._known = self._load()
        log.info("authentication on: %s", self._describe())

    def _load(self) -> dict[bytes, Identity]:
        try:
            with open(self.path, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenFileError(f"cannot read the tokens file {self.path}: {e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            # Not refused (a container may mount it 0644), but anyone on the machine who
            # can read it holds every role in it.
            log.warning("the tokens file %s is readable by other users (mode %o): "
                        "chmod 600 it", self.path, stat.S_IMODE(mode))
        return parse_tokens(text, self.path)

    def _describe(self) -> str:
        counts = {r: 0 for r in Role}
        for ident in self._known.values():
            counts[ident.role] += 1
        return f"{len(self._known)} tokens from {self.path} (" + ", ".join(
            f"{r.label} {n}" for r, n in counts.items()) + ")"

    def reload(self) -> None:
        """Read the file again (on SIGHUP). A file that cannot be used leaves the
        tokens in force as they were, and says so in the log."""
        try:
            self._known = self._load()
        except TokenFileError as e:
            log.error("tokens file NOT reloaded, the previous tokens stay in force: %s", e)
            return
        log.info("tokens file reloaded: %s", self._describe())

    def identify(self, token: str) -> Identity | None:
        """Whose token this is, or None. Compares with every known token in constant
        time (module docstring)."""
        presented = _digest(token)
        found: Identity | None = None
        for key, ident in self._known.items():
            if hmac.compare_digest(presented, key):
                found = ident
        return found


def bearer(request: web.Request) -> str | None:
    """The token of the request's single ``Authorization: Bearer`` header; None if there
    is no such header; ``ValueError`` if it is not exactly one bearer token."""
    values = request.headers.getall("Authorization", [])
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("give one Authorization header")
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise ValueError("the Authorization header must be 'Bearer TOKEN'")
    if not _B64TOKEN.fullmatch(token):
        # No token in the file can look like this (RFC 6750's b64token), and bytes that
        # are not ASCII would fail to hash: a 500 and a traceback for anyone (found from
        # outside).
        raise ValueError("the bearer token has characters a token cannot have")
    return token


def _challenge(status: int, message: str, code: str | None, **extra: object) -> web.Response:
    """A 401/403 in the API's error shape, with RFC 6750's ``WWW-Authenticate``."""
    from raftkv.server.requests import error

    answer = error(status, message, **extra)
    value = 'Bearer realm="raftkv"'
    if code is not None:
        value += f', error="{code}"'
    answer.headers["WWW-Authenticate"] = value
    return answer


# The request key of "is its token still good for it?" (a callable), set by the
# middleware for a request that needed a token: a long-lived answer (a watch) asks it
# as it goes, since a token removed from the file must stop what it opened (found from
# outside: a watch opened with a revoked read token went on streaming new writes).
# (aiohttp's typed request key where it has one: a plain string key warns.)
_STILL_ALLOWED: Any = "raftkv.auth.still_allowed"


def still_allowed(request: web.Request) -> bool:
    """Whether the token ``request`` came with still has the role it needed (True for
    a request that needed none, or a server without tokens)."""
    check = request.get(_STILL_ALLOWED)
    return check is None or bool(check())


def middleware(tokens: Tokens, required: Callable[[web.Request], Role | None]) -> Middleware:
    """The aiohttp middleware that lets a request through only with a token whose role
    is at least ``required(request)`` (None: a public route, no token needed). Its
    refusals are logged within ``raftkv.log_limits``' bounds for each client address (an
    unknown token) or token holder (a role too low): found from outside, 3,000 requests
    with a bad token added 3,000 log lines."""
    from aiohttp import web

    global _STILL_ALLOWED
    if hasattr(web, "RequestKey") and isinstance(_STILL_ALLOWED, str):
        _STILL_ALLOWED = web.RequestKey(_STILL_ALLOWED, object)
    refusals = RateLimitedLog(log, logging.INFO)

    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        need = required(request)
        if need is None:
            return await handler(request)
        try:
            token = bearer(request)
        except ValueError as e:
            return _challenge(401, str(e), "invalid_request")
        if token is None:
            return _challenge(401, "authentication required: send 'Authorization: "
                                   "Bearer TOKEN'", None)
        who = tokens.identify(token)
        if who is None:
            refusals.log(str(request.remote), "unknown token",
                         "refused %s %s from %s: unknown token", request.method,
                         request.path[:200], request.remote)
            return _challenge(401, "unknown token", "invalid_token")
        if who.role < need:
            refusals.log(who.name, need.label,
                         "refused %s %s to %s (%s): it needs the %s role", request.method,
                         request.path[:200], who.name, who.role.label, need.label)
            return _challenge(403, f"{request.method} {request.path[:200]} needs the "
                                   f"{need.label} role; this token has {who.role.label}",
                              "insufficient_scope", role=need.label)
        if need is Role.ADMIN:  # rare and consequential: leave a trace of who did it
            log.info("admin request by %s: %s %s", who.name, request.method,
                     request.path[:200])

        def allowed() -> bool:
            now = tokens.identify(token)
            return now is not None and now.role >= need

        request[_STILL_ALLOWED] = allowed
        return await handler(request)

    return authorize
