"""Range reads over HTTP, for any group: the one definition of what ``GET /v1/kv?...`` and
``GET /v1/tables/{t}/kv?...`` mean.

A range is a half-open key interval ``[start, end)``, given as ``?prefix=P`` (every key
that starts with P; an empty P is every key) or as ``?start=A`` and/or ``?end=B`` (either
bound may be left out: unbounded). Parameters are percent-decoded to raw bytes, as keys
in the path are. An answer is one *page*::

    {"revision": R, "kvs": [{"key": b64, "value": b64}, ...], "more": bool,
     "continue": token | null}

Keys and values are base64 (standard alphabet), as in etcd's JSON gateway: they are
arbitrary bytes. ``revision`` is the Raft index the page was read at: the state after
applying exactly the log up to R. Options:

- ``limit``: at most this many keys (1..10,000; default 1,000). A page also stops once it
  holds ``PAGE_BYTES`` of keys and values (at least one key), so one request cannot pin
  the node's memory or stall its loop.
- ``continue``: the ``continue`` token of the previous page; the request must repeat the
  same range (a token names its range: another range's is a 400). The next page starts just after the last key of the previous one.
- ``meta=true``: each key also carries its ``create_revision``, ``mod_revision`` and
  ``version`` (``raftkv.storage.revisions``).
- ``keys_only=true``: no values. ``count_only=true``: only ``{"revision", "count"}``, the
  number of keys in the range (from ``continue`` on, if given), with no limit.
- ``stale=true``: read the local replica; otherwise the read is linearizable (a ReadIndex
  round through the leader, Raft §6.4), as a single-key GET is.

*Pages are not a snapshot.* Each page is consistent in itself (one read of the state
machine at its revision), and a key that does not change during a scan is returned
exactly once; but a key written between two pages is seen as of the later page's
revision (or not at all, if it sorts before the continuation point). The revisions in
the answers say which state each page saw. etcd keeps old revisions to read every page
at the first one's; raftkv's state machine keeps only the latest state.

The state machine's own rows (batch markers, under ``RESERVED_PREFIX``) are never
returned or counted. Bad input is a 400: an inverted range (end below start), a prefix
with start or end, a limit out of bounds, a token that is not one, an unknown parameter.
"""

from __future__ import annotations

import base64
import binascii
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
from aiohttp import web

from raftkv.node.driver import Node
from raftkv.server.requests import check_query, flag, query_bytes, require_leader, wait
from raftkv.storage.commands import MAX_KEY_BYTES, RESERVED_PREFIX, CommandError
from raftkv.storage.revisions import meta_of
from raftkv.storage.state_store import KVStateStore, prefix_end

DEFAULT_LIMIT = 1_000
MAX_LIMIT = 10_000
PAGE_BYTES = 4 << 20  # etcd's default max request/response size is 1.5 MiB; values here reach 1 MiB
ACCEPTED = ("prefix", "start", "end", "limit", "continue", "keys_only", "count_only", "stale",
            "meta")


_RESERVED_END = prefix_end(RESERVED_PREFIX) or b""  # never empty: the prefix ends in "."


@dataclass(frozen=True)
class RangeRequest:
    """A parsed range read: keys in ``[start, end)`` (``end`` None: unbounded), from
    ``after`` exclusive on if set."""

    start: bytes
    end: bytes | None
    limit: int = DEFAULT_LIMIT
    after: bytes | None = None
    keys_only: bool = False
    count_only: bool = False
    stale: bool = False
    meta: bool = False
    space: str = ""  # what is read: "" the default group, else a table's name

    def lo(self) -> bytes:
        """The first key this page may hold."""
        if self.after is not None and self.after >= self.start:
            return self.after + b"\x00"  # the least key above ``after``
        return self.start


def is_range(request: web.Request) -> bool:
    """Whether a GET of the keyspace names a range (any range parameter given)."""
    return any(query_bytes(request, p) is not None for p in ("prefix", "start", "end"))


def key_range(request: web.Request, what: str) -> tuple[bytes, bytes | None]:
    """``[start, end)`` of ``?prefix=`` or ``?start=``/``?end=`` (``end`` None: no bound);
    ``CommandError`` (400) for neither, both, or an inverted range. ``what``: "a range
    read", "a watch", for the message."""
    prefix = query_bytes(request, "prefix")
    start, end = query_bytes(request, "start"), query_bytes(request, "end")
    if prefix is not None:
        if start is not None or end is not None:
            raise CommandError("give ?prefix= or ?start=/?end=, not both")
        start, end = prefix, prefix_end(prefix)
    elif start is None and end is None:
        raise CommandError(f"{what} needs ?prefix= (empty: every key), or ?start= and/or "
                           f"?end=")
    start = start or b""
    end = end or None  # ?end= (empty) is no bound, as a left-out one
    if end is not None and end < start:
        raise CommandError(f"inverted range: end {end[:64]!r} sorts below start "
                           f"{start[:64]!r}")
    return start, end


def parse_range(request: web.Request, space: str = "") -> RangeRequest:
    """The ``RangeRequest`` of ``request``'s query over ``space`` (the default group, or
    a table's name); ``CommandError`` (400) for bad input."""
    check_query(request, ACCEPTED)
    start, end = key_range(request, "a range read")
    raw_limit = query_bytes(request, "limit")
    limit = DEFAULT_LIMIT
    if raw_limit is not None:
        text = raw_limit.decode("ascii", "replace")
        if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
            raise CommandError(f"?limit must be an integer from 1 to {MAX_LIMIT}, "
                               f"not {text[:20]!r}")
        limit = int(text)
    token = query_bytes(request, "continue")
    after = decode_token(token, start, end, space) if token is not None else None
    keys_only, count_only = flag(request, "keys_only"), flag(request, "count_only")
    if keys_only and count_only:
        raise CommandError("give keys_only or count_only, not both")
    return RangeRequest(start, end, limit, after, keys_only, count_only,
                        flag(request, "stale"), flag(request, "meta"), space)


def encode_token(req: RangeRequest, last_key: bytes) -> str:
    """The ``continue`` token after ``last_key`` in ``req``'s range: opaque to clients
    (base64url of the range, the key and what was read: a table's token on another table
    or on the default group skipped keys without a word, found from outside)."""
    return base64.urlsafe_b64encode(msgpack.packb(
        [req.start, req.end, last_key, req.space], use_bin_type=True)).decode()


def decode_token(token: bytes, start: bytes, end: bytes | None, space: str = "") -> bytes:
    """The last key a ``continue`` token names; ``CommandError`` if it is not one, or is
    another range's, or another table's (``space``)."""
    try:
        got = msgpack.unpackb(base64.urlsafe_b64decode(token), max_bin_len=4 * MAX_KEY_BYTES)
    except (binascii.Error, ValueError, msgpack.UnpackException):
        got = None
    if (not isinstance(got, list) or len(got) != 4 or type(got[2]) is not bytes
            or not 0 < len(got[2]) <= MAX_KEY_BYTES or type(got[3]) is not str):
        raise CommandError("?continue is not a continuation token of this API (give the "
                           "\"continue\" of the previous page)")
    if got[0] != start or got[1] != end:
        raise CommandError("?continue is the token of another range: repeat the range of "
                           "the page it came from")
    if got[3] != space:
        whose = f"table {got[3]!r}" if got[3] else "the default key space"
        raise CommandError(f"?continue is a token of {whose}: give it to the range read of "
                           "the page it came from")
    return bytes(got[2])


def _user_scans(state: KVStateStore, lo: bytes, hi: bytes | None,
                rows: bool = False) -> list[Iterator[tuple[bytes, bytes]]]:
    """Scans of ``[lo, hi)`` around the state machine's own rows, all opened now, in one
    call on the loop thread with nothing applied in between: one view. ``rows``: of
    (key, row) (``raftkv.storage.revisions``) instead of (key, value)."""
    scan = state.scan_rows if rows else state.scan
    scans = []
    if lo < RESERVED_PREFIX:
        scans.append(scan(lo, RESERVED_PREFIX if hi is None else min(hi, RESERVED_PREFIX)))
    rest = max(lo, _RESERVED_END)
    if hi is None or rest < hi:
        scans.append(scan(rest, hi))
    return scans


def read_page(state: KVStateStore, req: RangeRequest) -> dict[str, Any]:
    """One page of ``req`` from ``state`` (on the loop thread): the answer's fields, keys
    and values still raw (``"kvs"``: ``[(key, value | None)]``, with ``meta`` ``[(key,
    value | None, (create, mod, version))]``)."""
    lo, hi = req.lo(), req.end
    revision = state.applied_index()
    if hi is not None and lo >= hi:
        return ({"revision": revision, "count": 0} if req.count_only else
                {"revision": revision, "kvs": [], "more": False})
    meta = req.meta and not req.count_only
    scans = _user_scans(state, lo, hi, rows=meta)
    try:
        rows = itertools.chain.from_iterable(scans)
        if req.count_only:
            return {"revision": revision, "count": sum(1 for _ in rows)}
        kvs: list[tuple[Any, ...]] = []
        size, more = 0, False
        for k, v in rows:
            if len(kvs) >= req.limit or (kvs and size + len(k) + len(v) > PAGE_BYTES):
                more = True
                break
            if meta:
                m = meta_of(v)
                kvs.append((k, None if req.keys_only else m.value,
                            (m.create_revision, m.mod_revision, m.version)))
            else:
                kvs.append((k, None if req.keys_only else v))
            size += len(k) + (0 if req.keys_only else len(v))
    finally:
        for scan in scans:
            close = getattr(scan, "close", None)
            if close is not None:
                close()  # an LMDB scan stopped early holds a read transaction
    return {"revision": revision, "kvs": kvs, "more": more}


def page_json(page: dict[str, Any], req: RangeRequest) -> dict[str, Any]:
    """The JSON answer of a page ``read_page`` (or ``merge_pages``) made for ``req``."""
    if "kvs" not in page:
        return page
    b64 = base64.b64encode
    kvs = []
    for kv in page["kvs"]:
        doc = {"key": b64(kv[0]).decode()}
        if kv[1] is not None:
            doc["value"] = b64(kv[1]).decode()
        if len(kv) == 3:
            doc.update(zip(("create_revision", "mod_revision", "version"), kv[2], strict=True))
        kvs.append(doc)
    last = page["kvs"][-1][0] if page["kvs"] and page["more"] else None
    return {**page, "kvs": kvs,
            "continue": encode_token(req, last) if last is not None else None}


def page_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    """A page as ``read_page`` returns it, from its JSON answer (a proxied partition's)."""
    if "kvs" not in doc:
        return {"revision": int(doc["revision"]), "count": int(doc["count"])}
    dec = base64.b64decode
    kvs = [(dec(kv["key"]), dec(kv["value"]) if "value" in kv else None,
            (int(kv["create_revision"]), int(kv["mod_revision"]), int(kv["version"])))
           if "mod_revision" in kv else
           (dec(kv["key"]), dec(kv["value"]) if "value" in kv else None)
           for kv in doc["kvs"]]
    return {"revision": int(doc["revision"]), "kvs": kvs, "more": bool(doc["more"])}


def merge_pages(pages: dict[int, dict[str, Any]], limit: int) -> dict[str, Any]:
    """One page of a table from one page of each of its partitions (each read with
    ``limit``): the first ``limit`` keys of all of them in key order. A partition page
    that stopped early (``more``) bounds the merged page at its last key, or a key it
    did not return could be skipped. ``revision`` maps each partition to its own (each
    partition is its own Raft group, with its own log)."""
    revisions = {str(p): page["revision"] for p, page in sorted(pages.items())}
    if any("kvs" not in page for page in pages.values()):
        return {"revision": revisions, "count": sum(page["count"] for page in pages.values())}
    bound: bytes | None = None
    for page in pages.values():
        if page["more"] and page["kvs"]:
            last = page["kvs"][-1][0]
            bound = last if bound is None else min(bound, last)
    rows = sorted((kv for page in pages.values() for kv in page["kvs"]
                   if bound is None or kv[0] <= bound), key=lambda kv: kv[0])
    more = bound is not None or len(rows) > limit
    rows = rows[:limit]
    return {"revision": revisions, "kvs": rows, "more": more}


async def serve_range(node: Node, group: str, req: RangeRequest) -> web.Response:
    """Read one page of ``req`` from ``group`` on ``node`` and answer it."""
    if not req.stale:
        require_leader(node, group)
    page = await wait(node.read_kv(group, lambda s: read_page(s, req),
                                linearizable=not req.stale))
    return web.json_response(page_json(page, req))
