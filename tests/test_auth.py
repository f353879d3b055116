"""Bearer tokens (``raftkv.server.auth``): the tokens file, the constant-time lookup,
reload on SIGHUP, the header, the route table, and the client side (``resolve_token``,
the CLI's ``--token-file``). ``tests/test_auth_routes.py`` calls every route of a real
cluster with and without the right token."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from raftkv.client import Client, ClientError, resolve_token
from raftkv.server import app as app_module
from raftkv.server.app import ROLES, Api
from raftkv.server.auth import Identity, Role, TokenFileError, Tokens, bearer, parse_tokens
from raftkv.testing.procs import ProcCluster, http_json

A = "a" * 16 + "Admin0"
W = "w" * 16 + "Write0"
R = "r" * 16 + "Read00"


def _file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


# -- the tokens file -------------------------------------------------------------------
def test_a_tokens_file_maps_each_token_to_its_holder_and_role(tmp_path: Path) -> None:
    path = _file(tmp_path, f"# role name token\nadmin ops {A}\n\n"
                           f"WRITE  spark   {W}   # trailing comment\nread grafana {R}\n")
    tokens = Tokens(path)
    assert tokens.identify(A) == Identity("ops", Role.ADMIN)
    assert tokens.identify(W) == Identity("spark", Role.WRITE)
    assert tokens.identify(R) == Identity("grafana", Role.READ)
    for wrong in (A[:-1], A + "x", "", A.upper(), " " + A, W[1:]):
        assert tokens.identify(wrong) is None, wrong


@pytest.mark.parametrize(("text", "why"), [
    (f"root ops {A}\n", "unknown role 'root'"),
    (f"admin ops {A} extra\n", "expected ROLE NAME TOKEN, found 4 fields"),
    (f"admin {A}\n", "expected ROLE NAME TOKEN, found 2 fields"),
    ("admin ops short\n", "the token of ops must be at least 16 characters"),
    ("admin ops " + "x" * 15 + "\n", "at least 16 characters"),
    ("admin ops " + "x" * 16 + "!\n", "at least 16 characters of A-Z"),
    (f"admin o/ps {A}\n", "a name is 1..64 letters"),
    (f"admin ops {A}\nread ops {R}\n", "the name ops is given twice"),
    (f"admin ops {A}\nread other {A}\n", "the token of other is also the token of ops"),
    ("# nothing\n\n", "no tokens"),
])
def test_a_bad_tokens_file_is_refused_with_its_line_and_without_the_token(
        tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(TokenFileError) as e:
        Tokens(_file(tmp_path, text))
    assert why in str(e.value)
    if "no tokens" not in why:
        assert f"{tmp_path / 'tokens'}:" in str(e.value)  # file:line
    assert A not in str(e.value) and R not in str(e.value)


def test_a_missing_tokens_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read the tokens file"):
        Tokens(str(tmp_path / "nope"))


def test_a_tokens_file_others_can_read_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raftkv.server.auth"):
        Tokens(_file(tmp_path, f"admin ops {A}\n", mode=0o644))
    assert "readable by other users (mode 644)" in caplog.text


def test_a_reload_takes_a_good_file_and_keeps_the_old_tokens_over_a_bad_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _file(tmp_path, f"admin ops {A}\nread grafana {R}\n")
    tokens = Tokens(path)
    _file(tmp_path, f"admin ops {A}\nwrite spark {W}\n")  # grafana out, spark in
    tokens.reload()
    assert tokens.identify(W) == Identity("spark", Role.WRITE)
    assert tokens.identify(R) is None
    _file(tmp_path, f"admin ops {A}\nwrite spark {W}\nread typo\n")
    with caplog.at_level(logging.ERROR, logger="raftkv.server.auth"):
        tokens.reload()
    assert "NOT reloaded" in caplog.text and ":3:" in caplog.text
    assert tokens.identify(W) == Identity("spark", Role.WRITE)  # still in force
    assert tokens.identify(A) == Identity("ops", Role.ADMIN)


def test_parse_tokens_keys_by_digest_never_by_the_token() -> None:
    known = parse_tokens(f"read r {R}\n", "f")
    assert all(len(k) == 32 and R.encode() not in k for k in known)


# -- the header ----------------------------------------------------------------------------
@pytest.mark.parametrize(("headers", "expected"), [
    ({}, None),
    ({"Authorization": f"Bearer {A}"}, A),
    ({"Authorization": f"bearer   {A} "}, A),  # the scheme is case-insensitive
])
def test_the_bearer_token_of_a_request(headers: dict[str, str], expected: str | None) -> None:
    assert bearer(make_mocked_request("GET", "/v1/kv/k", headers=headers)) == expected


@pytest.mark.parametrize("value", [f"Basic {A}", "Bearer", "Bearer ", f"Bearer {A} {A}",
                                   A, f"Token {A}"])
def test_an_authorization_header_that_is_not_one_bearer_token_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="Bearer TOKEN"):
        bearer(make_mocked_request("GET", "/", headers={"Authorization": value}))


def test_two_authorization_headers_are_refused() -> None:
    from multidict import CIMultiDict

    headers = CIMultiDict([("Authorization", f"Bearer {A}"), ("Authorization", f"Bearer {R}")])
    with pytest.raises(ValueError, match="one Authorization header"):
        bearer(make_mocked_request("GET", "/", headers=headers))


# -- the route table ---------------------------------------------------------------------
def _routes(api: Api) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in api.app().router.routes()
            if r.resource is not None}


def test_every_route_has_a_role_and_every_role_entry_a_route() -> None:
    """A stale entry would hide a route that was renamed without a decision."""
    routes = _routes(Api("n1", CollectorRegistry(), faults=True))
    assert {(m, p) for m, p in routes if m != "HEAD"} == set(ROLES)
    assert {("HEAD", p) for m, p in ROLES if m == "GET"} <= routes


def test_an_app_with_a_route_missing_from_the_role_table_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    roles = dict(ROLES)
    del roles[("POST", "/v1/cluster/transfer")]
    monkeypatch.setattr(app_module, "ROLES", roles)
    with pytest.raises(RuntimeError, match="POST /v1/cluster/transfer has no entry"):
        Api("n1", CollectorRegistry()).app()


def test_only_the_probes_are_public_and_changes_need_admin() -> None:
    assert {p for (m, p), role in ROLES.items() if role is None} == {"/health", "/ready"}
    for (method, path), role in ROLES.items():
        if path.startswith("/v1/cluster/") and method != "GET" or path == "/v1/test/partition":
            assert role is Role.ADMIN, (method, path)
        if method == "GET" and role is not None and not path.endswith("/snapshot"):
            assert role <= Role.READ, (method, path)
    # A backup is every key at once, for an operator to restore a cluster from.
    assert ROLES[("GET", "/v1/snapshot")] is Role.ADMIN
    assert ROLES[("GET", "/v1/tables/{table}/partitions/{p}/snapshot")] is Role.ADMIN


# -- the client side ---------------------------------------------------------------------
def test_resolve_token_takes_the_argument_then_the_file_then_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t"
    f.write_text(f"{W}\n")
    env = tmp_path / "env"
    env.write_text(R)
    monkeypatch.delenv("RAFTKV_TOKEN", raising=False)
    monkeypatch.delenv("RAFTKV_TOKEN_FILE", raising=False)
    assert resolve_token() is None
    monkeypatch.setenv("RAFTKV_TOKEN_FILE", str(env))
    assert resolve_token() == R
    monkeypatch.setenv("RAFTKV_TOKEN", A)
    assert resolve_token() == A
    assert resolve_token(token_file=str(f)) == W
    assert resolve_token(token=W + "x", token_file=str(f)) == W + "x"


@pytest.mark.parametrize(("content", "why"), [
    ("", "must hold one token"), ("two\nlines", "must hold one token"),
    ("a b", "must hold one token")])
def test_a_token_file_that_does_not_hold_one_token_is_refused(
        tmp_path: Path, content: str, why: str) -> None:
    f = tmp_path / "t"
    f.write_text(content)
    with pytest.raises(ValueError, match=why):
        resolve_token(token_file=str(f))
    with pytest.raises(ValueError, match="cannot read the token file"):
        resolve_token(token_file=str(tmp_path / "missing"))


# -- real processes: the CLI and SIGHUP ----------------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("auth")), size=1, tick=0.02,
                     auth=True) as c:
        c.start()
        c.wait_leader()
        yield c


def _cli(c: ProcCluster, *args: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAFTKV_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "--endpoints", c.nodes["n1"].endpoint,
         "--timeout", "5", *args],
        check=False, capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


def test_the_cli_sends_the_token_from_a_file_or_the_environment(node: ProcCluster) -> None:
    ok = _cli(node, "--token-file", node.token_file(Role.WRITE), "put", "cli-k", "v1")
    assert ok.returncode == 0 and '"index"' in ok.stdout, ok.stderr
    got = _cli(node, "get", "cli-k", env={"RAFTKV_TOKEN": node.tokens[Role.READ]})
    assert (got.returncode, got.stdout) == (0, "v1\n"), got.stderr
    got = _cli(node, "get", "cli-k", env={"RAFTKV_TOKEN_FILE": node.token_file(Role.READ)})
    assert (got.returncode, got.stdout) == (0, "v1\n"), got.stderr


@pytest.mark.parametrize(("args", "env", "why"), [
    ((), {}, "HTTP 401: authentication required"),
    ((), {"RAFTKV_TOKEN": "x" * 20}, "HTTP 401: unknown token"),
    ((), {"RAFTKV_TOKEN_FILE": "/nonexistent/token"}, "cannot read the token file"),
    (("--token-file", "READ"), {},
     "HTTP 403: PUT /v1/kv/cli-denied needs the write role; this token has read"),
])
def test_the_cli_refused_says_why_in_one_line(
        node: ProcCluster, args: tuple[str, ...], env: dict[str, str], why: str) -> None:
    args = tuple(node.token_file(Role.READ) if a == "READ" else a for a in args)
    res = _cli(node, *args, "put", "cli-denied", "v", env=env)
    assert res.returncode == 1 and why in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert node.client().get("cli-denied") is None  # nothing was written


def test_sighup_reloads_the_tokens_file(node: ProcCluster) -> None:
    ep = node.nodes["n1"].endpoint
    new = "n" * 16 + "NewToken"
    read_before = node.tokens[Role.READ]
    assert http_json(ep + "/v1/digest", token=new)[0] == 401
    lines = [f"{r.label} {r.label} {t}" for r, t in node.tokens.items() if r is not Role.READ]
    # A watch opened with the token that is about to be removed (found from outside: it
    # went on streaming new writes after the reload).
    ended: list[BaseException] = []
    seen: list[bytes] = []

    def watch() -> None:
        try:
            for _, events in Client([ep], 5.0, token=read_before).watch(prefix="rv/"):
                seen.extend(e["key"] for e in events)
        except ClientError as e:
            ended.append(e)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    writer = Client([ep], 5.0, token=node.tokens[Role.WRITE])
    node.wait_until(lambda: writer.put("rv/1", "v") > 0 and b"rv/1" in seen, 10,
                    what="the watch streaming")
    Path(node.tokens_file).write_text("\n".join([*lines, f"read newcomer {new}"]) + "\n")
    mark = len(node.nodes["n1"].log_text())
    assert node.nodes["n1"].proc is not None
    node.nodes["n1"].proc.send_signal(signal.SIGHUP)
    node.wait_until(lambda: "tokens file reloaded" in node.nodes["n1"].log_text()[mark:],
                    what="the reload")
    assert http_json(ep + "/v1/digest", token=new)[0] != 401
    assert http_json(ep + "/v1/digest", token=read_before)[0] == 401  # removed
    writer.put("rv/2", "after the reload")
    watcher.join(10)
    assert not watcher.is_alive() and ended and ended[0].status == 401, (ended, seen)
    assert "revoked" in str(ended[0])
    # A broken file leaves the reloaded tokens in force, and the node running.
    Path(node.tokens_file).write_text(f"read newcomer {new}\nwrite broken\n")
    node.nodes["n1"].proc.send_signal(signal.SIGHUP)
    node.wait_until(lambda: "NOT reloaded" in node.nodes["n1"].log_text()[mark:],
                    what="the refused reload")
    assert http_json(ep + "/v1/digest", token=new)[0] != 401
    assert node.nodes["n1"].alive
    assert "Traceback" not in node.nodes["n1"].log_text()
