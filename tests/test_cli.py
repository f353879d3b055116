"""The ``raftkv`` command as a newcomer meets it (issue 17 item 5): ``--version``, help on
every subcommand and option, one-line errors, a refused connection that fails on the
connect timeout, ``-w table|json``, and a ``cluster status`` that finds every member from
one endpoint. The cluster tests run real ``raftkv serve`` processes and the real command.

(``tests/test_http_semantics.py`` covers two earlier defects with real processes too:
``get --table nosuch`` says "unknown table", and ``cluster status`` with every endpoint
down reports each one instead of crashing.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from raftkv.cli import format_table, main, parser, render_table, serve_parser
from raftkv.testing.procs import ProcCluster, free_ports


def raftkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raftkv.cli", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# -- no cluster needed ------------------------------------------------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"raftkv {metadata.version('raftkv')}"


def _walk(p: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                yield f"{path} {name}", argparse.Action([], name, help=helps.get(name))
                yield from _walk(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_subcommand_and_option_has_help() -> None:
    missing = [(where, a.dest) for where, a in _walk(parser(), "raftkv")
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, missing


def test_help_on_a_subcommand_describes_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cas", "--help"]) == 0
    out = capsys.readouterr().out
    assert "compare-and-set" in out and "--prev-absent" in out and "the key must be absent" in out


def test_a_usage_error_is_one_line_and_exits_1_not_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 is a compare-and-set that did not swap: argparse's own exit 2 would read
    as one."""
    for argv, says in ((["put", "k"], "raftkv put: error: the following arguments are required"),
                       (["--timeout", "-1", "get", "k"], "must be more than 0 seconds"),
                       (["cas", "k", "v"],
                        "give exactly one of --prev-value, --prev-absent or --prev-index"),
                       (["frobnicate"], "invalid choice"),
                       (["watch", "--count", "0"], "--count must be at least 1"),
                       (["watch", "--count", "-1"], "--count must be at least 1"),
                       (["serve", "--id", "n1"], "raftkv serve: error: the following arguments"),
                       (["--endpoints", "http://127.0.0.1:99999", "get", "k"],
                        "bad endpoint 'http://127.0.0.1:99999': Port out of range")):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (argv, err)


def test_serve_parses_its_own_arguments_alone() -> None:
    """A node starts through ``serve_parser``: the same options and help as ``raftkv serve``
    in the full parser, without loading the other commands' modules (Spark's), which a
    whole cluster restarted on one machine would pay for in every process."""
    full = parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert ({a.dest for a in serve_parser()._actions} - {"cmd"}
            == {a.dest for a in full._actions})
    code = ("import sys, raftkv.cli; raftkv.cli.serve_parser().parse_args(['--id', 'n1', "
            "'--raft-addr', 'a:1', '--http-addr', 'a:2']); "
            "print(sorted(m for m in sys.modules if m.startswith('raftkv.spark')))")
    res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=60)
    assert res.stdout.strip() == "[]", res.stdout


def test_a_refused_connection_fails_on_the_connect_timeout_not_the_request_timeout() -> None:
    """With nothing listening, the command gives up once every endpoint has been tried
    for --connect-timeout, saying so, and does not retry until --timeout (600 s here;
    the subprocess timeout would fire long before). A cas too: a refused connection
    sent nothing, so its outcome is known."""
    eps = ",".join(f"http://127.0.0.1:{p}" for p in free_ports(2))
    for cmd in (["get", "k"], ["cas", "k", "v", "--prev-absent"]):
        res = raftkv("--endpoints", eps, "--timeout", "600", "--connect-timeout", "1", *cmd)
        line = _one_line_error(res)
        assert "could not connect to any endpoint within 1.0s" in line, line
        assert "Connection refused" in line and "may or may not" not in line, line


# -- a real cluster ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path_factory.mktemp("cli")), size=3, faults=False) as c:
        c.start()
        c.wait_leader()
        yield c


def _status(c: ProcCluster, *args: str, via: str = "n1") -> tuple[int, list[dict]]:
    res = raftkv("--endpoints", c.nodes[via].endpoint, "-w", "json", "cluster", "status",
                 *args)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout)


def _status_settled(c: ProcCluster, *args: str, via: str = "n1") -> tuple[int, list[dict]]:
    """``_status`` once every member has published its HTTP address in the view of the
    node asked. Each node publishes its address once it runs; until then status names it
    as a member with no published address (on a loaded machine that can take seconds),
    and each node learns the others' from its own metastore replica, so two nodes may
    see a late one at different moments."""
    deadline = time.monotonic() + 20
    while True:
        code, rows = _status(c, *args, via=via)
        if all("note" not in r for r in rows) or time.monotonic() > deadline:
            return code, rows
        time.sleep(0.2)


def test_status_finds_every_member_from_one_endpoint(cluster: ProcCluster) -> None:
    code, rows = _status_settled(cluster, "--group", "default", via="n2")
    assert code == 0
    assert sorted(r["node"] for r in rows) == ["n1", "n2", "n3"]
    assert {r["endpoint"] for r in rows} == {n.endpoint for n in cluster.nodes.values()}
    assert sum(r["role"] == "leader" for r in rows) == 1
    code, rows = _status(cluster, "--group", "default", "--only-endpoints", via="n2")
    assert code == 0 and [r["node"] for r in rows] == ["n2"]
    # Every group by default: the metastore too.
    code, rows = _status_settled(cluster)
    assert {(r["node"], r.get("group")) for r in rows} >= {
        (n, g) for n in ("n1", "n2", "n3") for g in ("default", "meta")}
    # A group no node hosts is an error, not an empty table and exit 0.
    res = raftkv("--endpoints", cluster.nodes["n1"].endpoint, "cluster", "status",
                 "--group", "nosuch")
    assert res.returncode == 1 and "no node hosts group 'nosuch'" in res.stderr, res


def test_write_out_table_and_json(cluster: ProcCluster) -> None:
    ep = ["--endpoints", cluster.nodes["n1"].endpoint]
    assert raftkv(*ep, "put", "greeting", "hello").returncode == 0
    assert raftkv(*ep, "get", "greeting").stdout == "hello\n"
    assert json.loads(raftkv(*ep, "-w", "json", "get", "greeting").stdout) == {
        "key": "greeting", "value": "hello"}
    table = raftkv(*ep, "-w", "table", "get", "greeting").stdout.splitlines()
    assert table[0].split() == ["KEY", "VALUE"] and table[1].split() == ["greeting", "hello"]
    put = raftkv(*ep, "-w", "table", "put", "greeting", "again").stdout.splitlines()
    assert put[0] == "INDEX" and int(put[1]) > 0
    status = raftkv(*ep, "cluster", "status", "--group", "default").stdout.splitlines()
    assert status[0].split()[:4] == ["NODE", "GROUP", "ROLE", "KIND"]
    assert sorted(line.split()[0] for line in status[1:4]) == ["n1", "n2", "n3"]


def test_status_with_a_member_down_shows_it_and_exits_1(cluster: ProcCluster,
                                                         tmp_path: Path) -> None:
    """A SIGKILLed member that is not among the endpoints given still gets its row."""
    victim = next(n for n in ("n3", "n2") if n != cluster.wait_leader())
    cluster.kill(victim)
    try:
        via = next(n for n in ("n1", "n2", "n3") if n != victim)
        code, rows = _status(cluster, "--group", "default", via=via)
        assert code == 1
        down = [r for r in rows if r["node"] == victim]
        assert len(down) == 1 and "unreachable" in down[0]["error"], rows
        assert sorted(r["node"] for r in rows if "error" not in r) == sorted(
            n for n in cluster.nodes if n != victim)
        text = raftkv("--endpoints", cluster.nodes[via].endpoint, "cluster", "status")
        assert text.returncode == 1 and f"{victim}: unreachable" in text.stdout
        # The leader's replication rows no longer present the dead follower as healthy
        # without a word (found from outside: "match=N lag=0 replicate").
        assert any(line.strip().startswith(victim) and "its node did not answer" in line
                   for line in text.stdout.splitlines()), text.stdout
    finally:
        cluster.start(victim)


def test_input_the_api_would_refuse_is_refused_before_anything_is_sent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found from outside: ``raftkv txn`` dropped unknown top-level fields, so a misspelt
    "compares" ran the success branch unconditionally (the API answers 400); a deeply
    nested file ended in a RecursionError traceback, and ``--timeout 1e300`` in an
    OverflowError one. Each is a one-line usage error now; nothing is sent (the
    endpoint does not exist)."""
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"compares": [{"key": "g", "target": "value", "op": "==",
                                              "operand": "x"}],
                                "success": [{"put": {"key": "v", "value": "W"}}]}))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    nowhere = ["--endpoints", "http://127.0.0.1:1", "--timeout", "1"]
    for argv, says in (([*nowhere, "txn", str(typo)], "unknown field 'compares'"),
                       ([*nowhere, "txn", str(deep)], "nests too deeply"),
                       (["--timeout", "1e300", "get", "k"], "must be at most 1,000,000")):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (argv, err)


def test_an_endpoint_that_is_not_raftkv_is_passed_over(cluster: ProcCluster) -> None:
    """Found from outside: a first endpoint answering a 5xx and closing the connection
    (a proxy's error page, another server) ended ``raftkv put`` in an AttributeError
    traceback, and the write never reached the next endpoint; a read ended in "HTTP
    501". Its health check's answer now rules it out for a write, and a 5xx that is not
    raftkv's JSON sends a read to the next endpoint."""
    import http.server
    import threading

    class NotRaftkv(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(501)
            self.send_header("Connection", "close")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotRaftkv)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fake = f"http://127.0.0.1:{server.server_address[1]}"
        endpoints = ",".join([fake, *(n.endpoint for n in cluster.nodes.values())])
        for cmd in (["put", "via-fake", "one"], ["del", "via-fake"], ["put", "via-fake", "two"]):
            res = raftkv("--endpoints", endpoints, *cmd)
            assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        res = raftkv("--endpoints", endpoints, "get", "via-fake")
        assert res.stdout.strip() == "two", (res.returncode, res.stdout, res.stderr)
    finally:
        server.shutdown()


def test_flags_of_another_mode_are_refused_not_ignored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found from outside: ``snapshot restore --table`` with ``--members``/``--data-dirs``
    loaded the table and ignored them; ``--replicas`` without ``--table`` was ignored;
    ``serve --memory --data-dir D`` ran in memory and ignored the directory."""
    backup = str(tmp_path / "b.rkv")
    for argv, says in (
            (["snapshot", "restore", backup, "--table", "t", "--members", "n1=127.0.0.1:1",
              "--data-dirs", str(tmp_path / "d")], "give one or the other"),
            (["snapshot", "restore", backup, "--replicas", "3", "--members", "n1=127.0.0.1:1",
              "--data-dirs", str(tmp_path / "d")], "--replicas goes with --table"),
            (["serve", "--id", "n1", "--memory", "--data-dir", str(tmp_path / "d"),
              "--raft-addr", "127.0.0.1:1", "--http-addr", "127.0.0.1:2"],
             "give --data-dir or --memory, not both")):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (argv, err)
    assert not (tmp_path / "d").exists()


def test_describe_and_cluster_refuse_unknown_query_parameters(cluster: ProcCluster) -> None:
    """Found from outside: ``GET /v1/tables/T?x=1`` and ``GET /v1/cluster?x=1`` answered
    200, where every other route answers a parameter it does not know with a 400."""
    import http.client

    n1 = cluster.nodes["n1"]
    for path in ("/v1/cluster?x=1", "/v1/tables/nosuch?x=1"):
        conn = http.client.HTTPConnection("127.0.0.1", n1.http_port, timeout=30)
        conn.request("GET", path)
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == 400 and "unknown query parameter ?x" in body["error"], (path, body)


def test_a_removed_endpoint_is_asked_once_per_request() -> None:
    """Found in review: an answer saying the node was removed from the group sent the
    client on to the next endpoint without a pause; with the other one silent (it refused
    a connection) that was the removed one again, about 2,000 times a second, and the
    error named neither. It is asked once, and the error says it was removed."""
    import http.server
    import threading

    from raftkv.client import Client, ClientError, Unavailable
    from raftkv.testing.procs import free_port

    hits = []

    class Removed(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            hits.append(self.path)
            body = json.dumps({"error": "node n3 is not a member of this group",
                               "leader": None, "removed": {"by": "n1", "index": 9}}).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Removed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        removed = f"http://127.0.0.1:{server.server_address[1]}"
        dead = f"http://127.0.0.1:{free_port()}"  # refuses connections
        c = Client([dead, removed], timeout=1.0)
        with pytest.raises(Unavailable, match=f"removed from the group: {removed}"):
            c.get(b"k")
        assert len([p for p in hits if p.startswith("/v1/kv")]) == 1, hits
        with pytest.raises(ClientError, match="not a member"):
            Client([removed], timeout=1.0).get(b"k")
    finally:
        server.shutdown()


def test_a_table_row_stays_on_one_line_and_nested_answers_print_as_json() -> None:
    """Found from outside: ``-w table txn`` printed a transaction's responses as Python
    reprs, and ``-w table scan`` split a value with a newline across two rows."""
    out = render_table([
        {"succeeded": False, "responses": [{"get": {"key": "k", "value": None}}]},
        {"key": "a", "value": "line1\nline2\tend"},
        {"key": "b", "value": ["x", "y"]},
    ])
    lines = out.splitlines()
    assert len(lines) == 4, out
    assert '{"get":{"key":"k","value":null}}' in lines[1] and "'get'" not in out
    assert "line1\\nline2\\tend" in lines[2]
    assert lines[3].split()[-1] == "x,y"


def test_status_says_a_member_answering_as_a_replaced_incarnation_is_ignored() -> None:
    """Found from outside: a voter whose node answered as an incarnation the group had
    replaced (its old files put back) showed as an ordinary follower a little behind,
    while the group ignored it for good and ran on two voters of three."""
    peer = {"match": 41, "next": 42, "state": "replicate", "learner": False, "active": False}
    row = {"node": "n1", "endpoint": "e1", "group": "default", "role": "leader",
           "kind": "voter", "removed": None, "term": 4, "leader": "n1", "commit": 43,
           "applied": 43, "checkpoint": 40, "last": 43,
           "peers": {"n2": peer, "n3": {**peer, "match": 43, "active": True}},
           "members": {"n1": "voter", "n2": "voter", "n3": "voter"},
           "retired": {"n2": "12345"}}
    out = format_table([row])
    n2 = next(line for line in out.splitlines() if line.strip().startswith("n2 "))
    n3 = next(line for line in out.splitlines() if line.strip().startswith("n3 "))
    assert "incarnation the group replaced: ignored for good" in n2
    assert "ignored" not in n3
