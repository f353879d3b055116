"""Fuzzed HTTP requests against a real 3-node cluster that checks tokens: whatever the
method, path, query, headers, credentials and body, the answer is never a 5xx, an error
is always JSON in the API's shape, and no node logs a traceback or an ERROR.

Requests go over raw sockets, so nothing a client library would refuse is left out.
Paths are built from the app's own routes (read from its router, as in
``tests/test_auth_routes.py``) with fuzzed segments, or are fuzzed text; queries mix the
parameters the routes know with others; credentials are none, garbage, or the tokens of
the metrics, read and write roles. Not admin: a valid admin call may legitimately
change the cluster (drop the table, move leadership) under the next examples; the admin
routes' refusals of bad input are covered by ``tests/test_auth_routes.py`` and
``tests/test_proc_faults.py``.

``RAFTKV_FUZZ_EXAMPLES`` (default 300) is the number of examples per strategy; the last
test prints the volume: requests sent and distinct paths.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from raftkv.server.app import Api
from raftkv.server.auth import Role
from raftkv.testing.procs import ProcCluster

EXAMPLES = int(os.environ.get("RAFTKV_FUZZ_EXAMPLES", "300"))
TABLE = "ft"
# Written before the fuzz and read after it: a key no example will draw (a write token's
# fuzzed writes may hit any short key).
CANARY = "canary-" + uuid.uuid4().hex
SENT: list[str] = []  # the path of every request sent, for the volume
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("fuzz")), size=3, tick=0.02,
                     auth=True, faults=False) as c:
        c.start()
        c.wait_leader()
        admin = c.client(timeout=30)
        admin.create_table(TABLE, 3, 1)  # one replica: a table key is often proxied
        c.wait_until(lambda: all(p["leader"] for p in admin.describe_table(TABLE)["partitions"]),
                     30, "a leader for every partition")
        admin.put(CANARY, "v")
        yield c


TEMPLATES = sorted({r.resource.canonical for r in Api("n1", CollectorRegistry(), faults=True)
                    .app().router.routes() if r.resource is not None})
PARAMS = ["stale", "prev_value", "prev_absent", "prev_index", "local", "min_index", "keys",
          "timeout", "linearizable"]
# Printable ASCII: a request line with control bytes never reaches a handler (the
# malformed-request test sends those).
URL_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x7e, exclude_characters="#")


def _segment() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(["k", TABLE, "n1", "n9", "0", "2", "99", "-1", "", ".", "..", "%",
                         "%zz", "%00", "%ff%fe", "a%2Fb", "x" * 600]),
        st.text(URL_CHARS, max_size=20).map(lambda s: s.replace("/", "%2F")),
        st.binary(max_size=40).map(lambda b: quote(b, safe="")),
    )


@st.composite
def paths(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:
        path = "/" + draw(st.text(URL_CHARS, max_size=60))
    else:
        template = draw(st.sampled_from(TEMPLATES))
        path = re.sub(r"\{\w+\}", lambda m: draw(_segment()), template)
    if draw(st.booleans()):
        names = st.one_of(st.sampled_from(PARAMS), st.text(URL_CHARS, max_size=8))
        values = st.one_of(st.sampled_from(["true", "false", "1", "0", "", "maybe", "v", "-3",
                                            "99999999", "1e309", "nan", "inf", "-inf"]),
                           st.binary(max_size=20).map(lambda b: quote(b, safe="")))
        pairs = draw(st.lists(st.tuples(names, values), max_size=4))
        path += "?" + "&".join(f"{n.replace('&', '')}={v}" for n, v in pairs)
    return path


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.binary(max_size=30)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
bodies = st.one_of(
    st.none(),
    st.binary(max_size=256),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(st.tuples(st.text(max_size=12), st.one_of(st.none(), st.text(max_size=12))),
             max_size=5).map(lambda ops: json.dumps({"ops": ops}).encode()),
    msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.builds(lambda i, ops: msgpack.packb({"id": i, "ops": ops}, use_bin_type=True),
              st.one_of(st.none(), st.binary(max_size=8), st.integers(-2**63, 2**63)),
              st.lists(st.lists(st.one_of(st.binary(max_size=10), st.none()), max_size=3),
                       max_size=4)),
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff,
                                      exclude_characters="\x7f"), max_size=40)


@st.composite
def credentials(draw: st.DrawFn, tokens: dict[Role, str]) -> list[tuple[str, str]]:
    usable = [tokens[r] for r in (Role.METRICS, Role.READ, Role.WRITE)]
    choice = draw(st.integers(0, 6))
    if choice == 0:
        return []
    if choice <= 3:
        return [("Authorization", f"Bearer {draw(st.sampled_from(usable))}")]
    value = draw(st.one_of(
        st.sampled_from(["Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "bearer x",
                         f"Bearer {usable[0]} {usable[1]}", f"Token {usable[2]}",
                         f"Bearer {usable[2][:-1]}", f"Bearer {usable[2]}x"]),
        header_values))
    auth = [("Authorization", value)]
    if draw(st.booleans()):  # and a second one, as a confused proxy might add
        auth.append(("Authorization", f"Bearer {draw(st.sampled_from(usable))}"))
    return auth


def exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        chunks = []
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            chunks.append(got)
    return b"".join(chunks)


def check_answer(method: str, raw_answer: bytes, what: Any) -> int:
    """The status of a well-formed answer; fails on a 5xx or an error not in JSON (a
    failed compare-and-set's 412 is ``{"index", "swapped": false}``)."""
    head, _, body = raw_answer.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", head)
    assert m, (what, raw_answer[:200])
    status = int(m.group(1))
    assert status < 500, (what, status, body[:300])
    if status >= 400 and method != "HEAD":
        ctype = re.search(rb"(?im)^content-type: *([^\r;]+)", head)
        assert ctype and ctype.group(1) == b"application/json", (what, status, head)
        answer = json.loads(body)
        assert isinstance(answer, dict), answer
        if status == 412:
            assert answer["swapped"] is False, answer
        else:
            assert isinstance(answer.get("error"), str), answer
    return status


def request(cluster: ProcCluster, node: str, method: str, path: str,
            headers: list[tuple[str, str]], body: bytes | None) -> int:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             *(f"{k}: {v}" for k, v in headers)]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
    SENT.append(path.partition("?")[0])
    answer = exchange(cluster.nodes[node].http_port, raw)
    return check_answer(method, answer, (node, method, path, headers, (body or b"")[:80]))


@FUZZ
@given(data=st.data())
def test_fuzzed_requests_get_no_5xx_and_json_errors(cluster: ProcCluster, data: Any) -> None:
    node = data.draw(st.sampled_from(sorted(cluster.nodes)))
    method = data.draw(st.one_of(
        st.sampled_from(["GET", "PUT", "POST", "DELETE", "HEAD", "PATCH", "OPTIONS"]),
        st.from_regex(r"[A-Z]{1,10}", fullmatch=True)))
    path = data.draw(paths())
    headers = data.draw(credentials(cluster.tokens))
    ctype = data.draw(st.one_of(st.none(), st.sampled_from(
        ["application/json", "application/x-msgpack", "text/plain",
         "application/json; charset=latin-1", "multipart/form-data; boundary=x"]),
        header_values))
    if ctype is not None:
        headers.append(("Content-Type", ctype))
    extra = data.draw(st.lists(st.tuples(st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}",
                                                       fullmatch=True), header_values),
                               max_size=3))
    headers += [(k, v) for k, v in extra if k.lower() not in ("content-length", "host",
                                                              "transfer-encoding")]
    request(cluster, node, method, path, headers, data.draw(bodies))


@FUZZ
@given(data=st.data())
def test_fuzzed_requests_with_a_write_token_on_every_route(cluster: ProcCluster,
                                                           data: Any) -> None:
    """Past the token check: the route handlers' own parsing of what the fuzzer sends."""
    node = data.draw(st.sampled_from(sorted(cluster.nodes)))
    method = data.draw(st.sampled_from(["GET", "PUT", "POST", "DELETE"]))
    path = data.draw(paths())
    headers = [("Authorization", f"Bearer {cluster.tokens[Role.WRITE]}")]
    if data.draw(st.booleans()):
        headers.append(("Content-Type", data.draw(st.sampled_from(
            ["application/json", "application/x-msgpack"]))))
    request(cluster, node, method, path, headers, data.draw(bodies))


@FUZZ
@given(raw=st.one_of(
    st.binary(min_size=1, max_size=300),
    st.builds(lambda line, hs: line + b"\r\n" + b"\r\n".join(hs) + b"\r\n\r\n",
              st.binary(max_size=100).filter(lambda b: b"\r\n" not in b),
              st.lists(st.binary(max_size=60).filter(lambda b: b"\r\n" not in b),
                       max_size=4)),
    st.builds(lambda n: b"GET /v1/kv/" + b"k" * n + b" HTTP/1.1\r\nHost: x\r\n\r\n",
              st.integers(8000, 70000)),
    st.builds(lambda n: b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * n
              + b"\r\n\r\n", st.integers(8000, 20000)),
))
def test_malformed_requests_get_a_json_400_or_no_answer(cluster: ProcCluster,
                                                        raw: bytes) -> None:
    """Bytes that are not a request aiohttp can parse: a JSON 4xx (or, for bytes that
    never end a request, the connection closed unanswered), never a plain-text page."""
    SENT.append("(malformed)")
    with socket.create_connection(("127.0.0.1", cluster.nodes["n1"].http_port),
                                  timeout=30) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)  # the end of what this client says
        chunks = []
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            chunks.append(got)
    answer = b"".join(chunks)
    if answer:
        check_answer("GET", answer, raw[:100])


@pytest.mark.parametrize(("raw", "status", "why"), [
    (b"GET /v1/kv/" + b"k" * 9000 + b" HTTP/1.1\r\n", 414, "the URL is 9007 bytes"),
    (b"GET /v1/kv/k?stale=" + b"1" * 9000 + b" HTTP/1.1\r\n", 414, "the URL is 9015 bytes"),
    (b"GET /" + b"k" * 70000 + b" HTTP/1.1\r\n", 400, "Got more than 65536 bytes"),
    (b"GET /health HTTP/1.1\r\nX-Big: " + b"v" * 9000 + b"\r\n", 400,
     "Got more than 8190 bytes"),
])
def test_oversized_urls_and_headers_get_a_json_error(
        cluster: ProcCluster, raw: bytes, status: int, why: str) -> None:
    """A 9,000-byte URL used to get aiohttp's plain-text 400."""
    answer = exchange(cluster.nodes["n2"].http_port,
                      raw + b"Host: x\r\nConnection: close\r\n\r\n")
    assert check_answer("GET", answer, raw[:40]) == status
    assert why in json.loads(answer.partition(b"\r\n\r\n")[2])["error"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
@pytest.mark.parametrize("path", ["PUT /v1/kv/enc-k", "POST /v1/batch",
                                  f"POST /v1/tables/{TABLE}/batch"])
@pytest.mark.parametrize("body", [b"notgzip", b"x", b"\x1f\x8b\x08\x00garbage"])
def test_a_compressed_body_is_refused_with_a_415(
        cluster: ProcCluster, encoding: str, path: str, body: bytes) -> None:
    """Found from outside: a body sent with ``Content-Encoding: gzip`` (or deflate) that
    is not gzip was answered 500 "internal error: RequestPayloadError", with tracebacks
    in the node's log (the last test checks there are none), and a truncated one ("x")
    was stored as an empty value. No client compresses, so a coded body is refused."""
    method, target = path.split(" ")
    raw = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
           f"Authorization: Bearer {cluster.tokens[Role.WRITE]}\r\n"
           f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    answer = exchange(cluster.nodes["n1"].http_port, raw)
    # aiohttp's parser refuses some first, with a 400: brotli (not installed), and a
    # deflate stream it fails to inflate as it arrives. The rest reach the API: 415.
    status = check_answer(method, answer, raw[:60])
    assert status in (400, 415), answer[:300]
    assert status == 400 or b"Accept-Encoding: identity" in answer
    assert cluster.client().get("enc-k") is None


def test_a_body_that_cannot_be_read_is_a_400(cluster: ProcCluster) -> None:
    """A malformed chunked body fails while the handler reads it (aiohttp's
    RequestPayloadError): the client's fault, a 400, not a 500 with a traceback."""
    raw = (f"PUT /v1/kv/chunk-k HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
           f"Authorization: Bearer {cluster.tokens[Role.WRITE]}\r\n"
           "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n").encode()
    answer = exchange(cluster.nodes["n1"].http_port, raw)
    assert check_answer("PUT", answer, raw[:60]) == 400, answer[:300]
    assert cluster.client().get("chunk-k") is None


@pytest.mark.parametrize("timeout", ["nan", "-1", "x"])
def test_a_digest_wait_with_a_timeout_that_never_passes_is_refused(
        cluster: ProcCluster, timeout: str) -> None:
    """A NaN deadline never passed: the request polled its replica until the node
    stopped (a read token was enough to leave any number of them running)."""
    host = cluster.client().describe_table(TABLE)["partitions"][0]["hosted_on"][0]
    conn = http.client.HTTPConnection("127.0.0.1", cluster.nodes[host].http_port, timeout=30)
    conn.request("GET", f"/v1/tables/{TABLE}/partitions/0/digest?min_index=999999999"
                        f"&timeout={timeout}",
                 headers={"Authorization": f"Bearer {cluster.tokens[Role.READ]}"})
    r = conn.getresponse()
    assert r.status == 400 and "timeout is seconds" in json.loads(r.read())["error"]
    conn.close()


def test_after_the_fuzz_every_node_is_whole_and_no_log_has_a_traceback(
        cluster: ProcCluster) -> None:
    for n in cluster.nodes.values():
        assert n.alive, n.id
        text = n.log_text()
        for bad in ("Traceback", " ERROR ", " CRITICAL "):
            assert bad not in text, (n.id, bad, text[text.find(bad) - 2000:][:4000])
    admin = cluster.client()
    assert admin.get(CANARY) == b"v"
    cluster.wait_caught_up()
    digests = {n: cluster.digest(n) for n in cluster.nodes}
    assert len({(d["count"], d["digest"]) for d in digests.values()}) == 1, digests
    print(f"\nfuzz volume: {len(SENT)} requests, {len(set(SENT))} distinct paths")
    assert len(SENT) >= 3 * EXAMPLES * 0.9
