"""The ``raftkv`` command: run a node, talk to a cluster, recover one.

    raftkv serve --id n1 --data-dir DIR --raft-addr H:P --http-addr H:P --peers ...
    raftkv [GLOBAL OPTIONS] put KEY VALUE | get KEY [--stale] | del KEY   [--table T]
    raftkv cas KEY NEW (--prev-value V | --prev-absent) [--table T]
    raftkv cluster status [--only-endpoints] [--group G ...]
    raftkv cluster add-learner ID RAFT_ADDR | promote ID | remove ID | transfer ID
    raftkv cluster add-node ID RAFT_ADDR [--http-addr H:P] | remove-node ID   (placement topology)
    raftkv cluster nodes | drain ID | settings [--scale-down-timeout S] [--scale-up-timeout S]
                   [--metastore-voters 3|5] [--max-moves N] [--catch-up-timeout S]
    raftkv table create NAME --partitions N --replicas R [--storage persistent|memory]
                 [--allow-unsafe]   (1 or 2 in-memory replicas are refused without it)
    raftkv table list | describe NAME | drop NAME | set-replicas NAME N [--allow-unsafe]
    raftkv recover unsafe-reset --data-dir DIR ... --members ... --yes-i-understand-data-may-be-lost
    raftkv spark load|verify --table T --input PATH --key COL [--master URL]   (raftkv.spark.cli)
    raftkv admin --conn H:P status | add ID [ADDR] | remove ID | ...   (embedded nodes: raftkv.admin)

Global options come before the subcommand, as etcdctl's do:

- ``--endpoints URL,...`` (or ``RAFTKV_ENDPOINTS``): any nodes' HTTP addresses. Requests
  go to the first that answers, and follow the leader when an admin call needs it.
- ``--timeout S`` (10): a command's whole budget, retries included (etcdctl's
  ``--command-timeout``).
- ``--connect-timeout S`` (2): each connection attempt, and how long a command keeps
  trying when no endpoint accepts a connection at all (etcdctl's ``--dial-timeout``), so
  a cluster that is down fails in seconds instead of after the whole ``--timeout``.
- ``-w/--write-out table|json``: how answers are printed. Without it, ``cluster status``
  is a table, ``get`` prints the raw value, ``scan`` and ``get --prefix`` print a key and
  its value per line, ``watch`` a line per event, and every other command prints the JSON
  answer. ``json`` prints JSON for every command (``get``: ``{"key", "value"}``, with
  ``"value_base64"`` instead for a value that is not UTF-8); ``table`` prints a table
  (one row per item of a list: nodes, tables, a table's partitions; one row otherwise).
- ``--cacert F``, ``--cert F``, ``--key F`` (or ``RAFTKV_CACERT``, ``RAFTKV_CERT``,
  ``RAFTKV_KEY``): TLS, as etcdctl names them; with a CA file an endpoint without a scheme
  is ``https://``. ``raftkv admin`` takes them too (before or after ``admin``), for the
  raft port's TLS, but not from the environment (``raftkv.admin``).
- ``--token-file F``: the bearer token for a cluster that checks tokens; without it
  ``RAFTKV_TOKEN``, else the file named by ``RAFTKV_TOKEN_FILE``
  (``raftkv.client.resolve_token``). There is no ``--token``: a command line is visible
  to every user of the machine.
- ``--version``.

``cluster status`` shows every member, as ``etcdctl endpoint status --cluster`` does:
it asks the given endpoints in turn until one answers, takes the member lists of that
node's groups and the HTTP addresses every node publishes in the metastore
(``GET /v1/cluster``'s ``"http"``), and asks every node at once for its own view. A node
that does not answer is a row saying so. ``--only-endpoints`` asks just the given ones.

Exit status: 0 done; 1 an error, with one line on stderr (a usage error, an unreachable
cluster, a refused request), or a ``cluster status`` in which some node did not answer
(the table still shows the others); 2 a compare-and-set that did not swap; 3 a Spark
verify that found a mismatch.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

from raftkv.client import MIN_ATTEMPT, Client, ClientError, Unavailable, resolve_token
from raftkv.server import serve
from raftkv.storage.errors import StorageError
from raftkv.storage.layout import DEFAULT_GROUP
from raftkv.transport.handshake import JOINING
from raftkv.transport.tcp import parse_addr

if TYPE_CHECKING:
    from raftkv.backup import BackupInfo

# The backup tools (raftkv.backup) are imported where a snapshot command runs: ``raftkv
# serve`` starts through this module, and every import before its node opens is time a
# restarted cluster waits for its first answer.

DEFAULT_ENDPOINTS = "http://127.0.0.1:8001"
STATUS_COLUMNS = ["node", "group", "role", "kind", "term", "leader", "commit", "applied",
                  "checkpoint", "last"]
NODE_COLUMNS = ["id", "state", "seconds_in_state", "epoch", "in_topology", "data_node",
                "metastore", "replicas", "draining"]


class UsageError(Exception):
    """A command line argparse refused; its message is the one line to print."""


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line and exit 1: exit 2 is a compare-and-set that did not
    swap, and a script must be able to tell the two apart."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# -- cluster status ---------------------------------------------------------------------
def _group_order(gid: str) -> tuple[int, str]:
    return ({DEFAULT_GROUP: 0, "meta": 1}.get(gid, 2), gid)


def _fetch_status(endpoint: str, like: Client) -> dict[str, Any] | str:
    """One node's own ``/v1/cluster`` answer, or why there is none (no retry: a node
    that does not answer is what the status reports). ``like``: the timeouts, TLS
    files and token to use."""
    client = like.for_endpoint(endpoint)
    try:
        return client.status(endpoint)
    except ClientError as e:  # it answered: a 401 or 403 (the token), say, is no outage
        return f"refused ({e})"
    except (OSError, http.client.HTTPException, ValueError) as e:
        return f"unreachable ({e})"
    finally:
        client.close()


def status_rows(client: Client, discover: bool = True,
                groups: Collection[str] | None = None) -> list[dict[str, Any]]:
    """One row per (node, group) from that node's own view, and one row with an
    ``error`` per node that did not answer. ``discover``: every member and every node
    that published an HTTP address, found from the first endpoint that answers (see the
    module docstring); otherwise just ``client.endpoints``. ``groups``: only these."""
    views: dict[str, dict[str, Any]] = {}  # node id -> its answer
    endpoint_of: dict[str, str] = {}  # node id -> the endpoint that answered for it
    failed: dict[str, str] = {}  # endpoint -> why it did not answer
    asked: set[str] = set()

    def ask(endpoints: Iterable[str]) -> None:
        todo = [e for e in dict.fromkeys(endpoints) if e not in asked]
        asked.update(todo)
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            answers = pool.map(
                lambda e: _fetch_status(e, client), todo)
            for e, got in zip(todo, answers):
                if isinstance(got, str):
                    failed[e] = got
                else:
                    views.setdefault(str(got["id"]), got)
                    endpoint_of.setdefault(str(got["id"]), e)

    published: dict[str, str] = {}  # node id -> its published HTTP endpoint
    silent: list[str] = []  # members that published no HTTP address
    if discover:
        for e in client.endpoints:  # any one node's view names every member
            ask([e])
            if views:
                break
        if views:
            seed = next(iter(views.values()))
            published = {n: a if "://" in a else f"{client.scheme}://{a}"
                         for n, a in (seed.get("http") or {}).items()}
            members = {m for g in seed["groups"].values() for m in g["members"]}
            silent = sorted(members - published.keys() - views.keys())
            ask(published[n] for n in sorted(published) if n not in views)
    ask(client.endpoints)
    names = {e: n for n, e in published.items()}

    rows: list[dict[str, Any]] = []
    # A node of another cluster (one started on files from before a restore: its peers
    # refuse it) answers with its own view, which read as a member's row with a commit
    # index above the real leader's (found from outside). It is named apart instead.
    # The cluster most nodes name is this one's; a node still joining names none yet.
    named = Counter(st.get("cluster") for st in views.values()
                    if st.get("cluster") not in (None, JOINING.hex()))
    ours = named.most_common(1)[0][0] if named else None
    for nid, st in list(views.items()):
        theirs = st.get("cluster")
        if ours is not None and theirs not in (None, JOINING.hex(), ours):
            del views[nid]
            rows.append({"node": nid, "endpoint": endpoint_of[nid],
                         "error": f"a node of another cluster (id {theirs or 'none'}, this "
                                  f"cluster's {ours or 'none'}): its peers refuse it"})
    for nid, st in sorted(views.items()):
        for gid, g in sorted(st["groups"].items(), key=lambda kv: _group_order(kv[0])):
            if groups is not None and gid not in groups:
                continue
            removed = g.get("removed")
            rows.append({
                "node": nid, "endpoint": endpoint_of[nid], "group": gid, "role": g["role"],
                # A node told it was removed says so here, where an operator looks (found
                # from outside: only GET /v1/cluster had it).
                "kind": "removed" if removed else g["members"].get(nid, "-"),
                "removed": removed, "term": g["term"],
                "leader": g["leader"] or "-", "commit": g["commit"],
                "applied": g["applied"], "checkpoint": g["checkpoint"],
                "last": g["last_index"], "peers": g["peers"], "members": g["members"],
                "retired": g.get("retired", {}),
            })
    for e, why in failed.items():
        name = names.get(e)
        if name is None or name not in views:  # not reached through another address
            rows.append({"node": name or e, "endpoint": e, "error": why})
    for nid in silent:
        rows.append({"node": nid, "note": "member with no published HTTP address (it "
                                          "publishes one once in the placement topology: "
                                          "cluster add-node)"})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """``status_rows`` as a table, then the nodes that did not answer, then each
    leader's view of its followers' replication."""
    lines = [render_table([r for r in rows if "group" in r], STATUS_COLUMNS)]
    lines += [f"{r['node']}: {r.get('error') or r.get('note')}" for r in rows
              if "group" not in r]
    # A leader of a quiet group keeps a dead follower's last progress (and may call it
    # active while quiesced): say when that follower's node did not answer this status.
    silent = {r["node"] for r in rows if "error" in r}
    for r in rows:
        if r.get("role") == "leader" and r["peers"]:
            lines.append(f"replication from leader {r['node']} ({r['group']}):")
            for peer, p in sorted(r["peers"].items()):
                kind = r["members"].get(peer, "?")
                lag = r["last"] - p["match"]
                retired = (" (answers as an incarnation the group replaced: ignored for "
                           "good; docs/wiped-nodes.md)" if peer in r["retired"] else "")
                lines.append(f"  {peer:<8} {kind:<13} match={p['match']:<8} lag={lag:<8} "
                             f"{p['state']}{'' if p['active'] else ' (inactive)'}"
                             f"{' (its node did not answer)' if peer in silent else ''}"
                             f"{retired}")
    return "\n".join(lines)


# -- output -----------------------------------------------------------------------------
def _cell(v: Any) -> str:
    """One table cell on one line: a list's items joined by commas, anything nested as
    JSON (found from outside: a transaction's responses printed as Python reprs), and a
    text with a line break or another control character escaped as JSON escapes it (a
    value with a newline split its row in two)."""
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(_cell(x) if not isinstance(x, dict | list) else
                        json.dumps(x, separators=(",", ":")) for x in v) or "-"
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"))
    text = str(v)
    if any(c < " " or c == "\x7f" for c in text):
        return json.dumps(text, ensure_ascii=False)[1:-1]
    return text


def render_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Rows as aligned columns under an upper-case header; ``columns`` default to every
    key, in order of first appearance."""
    cols = columns or list(dict.fromkeys(k for r in rows for k in r))
    body = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(lines)


PARTITION_COLUMNS = ["partition", "leader", "term", "stable", "pending", "hosted_on"]


def emit(args: argparse.Namespace, answer: Any, indent: int | None = None) -> None:
    """Print a command's answer as ``-w`` asks (JSON unless it asks for a table)."""
    if args.write_out != "table":
        print(json.dumps(answer, indent=indent))
    elif isinstance(answer, list):
        print(render_table(answer))
    elif isinstance(answer, dict) and isinstance(answer.get("tables"), list):
        print(render_table(answer["tables"]))
    elif isinstance(answer, dict) and isinstance(answer.get("partitions"), list):
        print(render_table(answer["partitions"], PARTITION_COLUMNS))  # table describe
        for err in answer.get("errors") or []:
            print(f"rebalance error: {_cell(err)}")
    else:
        print(render_table([answer]))


# -- commands ---------------------------------------------------------------------------
def _kv_commands(args: argparse.Namespace, client: Client) -> int:
    table = getattr(args, "table", None)
    # Keys and values as bytes: an argument that is not UTF-8 reaches argv as surrogates,
    # which os.fsencode turns back into the bytes given.
    for name in ("key", "value", "new", "prev_value"):
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, os.fsencode(getattr(args, name)))
    if args.cmd == "put":
        emit(args, {"index": client.put(args.key, args.value, table=table, lease=args.lease)})
    elif args.cmd == "lease":
        return _lease_command(args, client)
    elif args.cmd == "scan" or (args.cmd == "get" and args.prefix is not None):
        return _range_command(args, client)
    elif args.cmd == "get":
        if args.key is None:
            raise UsageError("raftkv get: error: give a KEY, or --prefix P")
        if args.meta:
            doc = client.get_meta(args.key, stale=args.stale, table=table)
            if doc is None:
                print(f"error: key {os.fsdecode(args.key)!r} not found", file=sys.stderr)
                return 1
            emit(args, {**_text(args.key, "key"), **_text(doc.pop("value"), "value"), **doc},
                 indent=1)
            return 0
        v = client.get(args.key, stale=args.stale, table=table)
        if v is None:
            print(f"error: key {os.fsdecode(args.key)!r} not found", file=sys.stderr)
            return 1
        if args.write_out is None:
            sys.stdout.buffer.write(v + b"\n")
            return 0
        emit(args, {**_text(args.key, "key"), **_text(v, "value")})
    elif args.cmd == "snapshot" and args.table:
        from raftkv.backup import BackupError, restore_table, save_table

        try:
            if args.action == "save":
                doc = save_table(client, args.table, args.file)
            else:
                doc = restore_table(client, args.file, args.table, args.replicas)
        except BackupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        emit(args, {"directory": args.file, **doc}, indent=1)
        return 0
    elif args.cmd == "snapshot":
        parent = os.path.dirname(os.path.abspath(args.file))
        if os.path.lexists(args.file) or not os.path.isdir(parent):
            # An existing file is never replaced: it may be the only copy of an older
            # backup, or a table backup's manifest (found from outside).
            print(f"error: cannot write a backup to {args.file}: "
                  + ("it is a directory" if os.path.isdir(args.file)
                     else "it exists; remove it or choose another name"
                     if os.path.lexists(args.file) else f"{parent} is not a directory"),
                  file=sys.stderr)
            return 1
        size = client.snapshot_save(args.file)
        from raftkv.backup import BackupError, verify

        try:
            info = verify(args.file)
        except BackupError as e:
            print(f"error: the backup written to {args.file} does not verify: {e}",
                  file=sys.stderr)
            return 1
        emit(args, {"file": args.file, "bytes": size, **_info_json(info)}, indent=1)
        return 0
    elif args.cmd == "watch":
        return _watch_command(args, client)
    elif args.cmd == "txn":
        raw = (sys.stdin.read() if args.file == "-" else _read_text(args.file))
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UsageError(f"raftkv txn: error: {args.file} is not JSON: {e}") from None
        except RecursionError:
            raise UsageError(f"raftkv txn: error: {args.file} nests too deeply") from None
        if not isinstance(body, dict):
            raise UsageError(f"raftkv txn: error: {args.file} must hold a JSON object")
        # As strict as the API: a misspelt "compare" must not turn the transaction into
        # unconditional writes (found from outside: "compares" ran the success branch).
        unknown = sorted(set(body) - {"compare", "success", "failure"})
        if unknown:
            raise UsageError(f"raftkv txn: error: {args.file}: unknown field {unknown[0]!r} "
                             "(a transaction has \"compare\", \"success\" and \"failure\")")
        answer = client.txn(body.get("compare"), body.get("success"), body.get("failure"),
                            table=table)
        emit(args, answer, indent=1)
        return 0 if answer["succeeded"] else 2
    elif args.cmd == "del":
        emit(args, {"index": client.delete(args.key, table=table)})
    elif args.cmd == "cas":
        given = (args.prev_value is not None) + args.prev_absent + (args.prev_index is not None)
        if given != 1:
            raise UsageError("raftkv cas: error: give exactly one of --prev-value, "
                             "--prev-absent or --prev-index")
        if args.prev_index is not None and args.prev_index < 0:
            raise UsageError("raftkv cas: error: --prev-index is a mod revision, 0 or more")
        swapped, index = client.cas(args.key, args.prev_value, args.new, table=table,
                                    prev_index=args.prev_index)
        emit(args, {"swapped": swapped, "index": index})
        return 0 if swapped else 2
    return 0


def _info_json(info: BackupInfo) -> dict[str, Any]:
    return {"index": info.index, "term": info.term, "keys": info.count,
            "revisions_digest": info.digest, "voters": info.voters, "node": info.node}


def _check_restore_mode(args: argparse.Namespace) -> None:
    """``snapshot restore`` is one of two things: a new cluster from a group backup
    (``--members``, ``--data-dirs``) or a table backup into a running cluster
    (``--table``, ``--replicas``). Flags of the other mode were ignored without a word
    (found from outside)."""
    if args.table and (args.members or args.data_dirs):
        raise UsageError("raftkv snapshot restore: error: --table loads a table into a "
                         "running cluster; --members and --data-dirs make a new cluster: "
                         "give one or the other")
    if args.replicas is not None and not args.table:
        raise UsageError("raftkv snapshot restore: error: --replicas goes with --table")


def _snapshot_offline(args: argparse.Namespace) -> int:
    """``snapshot status`` and ``snapshot restore``: files only, no cluster."""
    from raftkv.backup import BackupError, restore, verify, verify_table

    try:
        if args.action == "status":
            if os.path.isdir(args.file):
                emit(args, {"directory": args.file, **verify_table(args.file)}, indent=1)
                return 0
            info = verify(args.file)
            emit(args, {"file": args.file, **_info_json(info)}, indent=1)
            return 0
        if not args.members or not args.data_dirs:
            raise BackupError("restore needs --members and --data-dirs (a new cluster from "
                              "a group backup), or --table (a table backup into a running "
                              "cluster)")
        members = _parse_members(args.members)
        dirs = [d for d in args.data_dirs.split(",") if d]
        info = restore(args.file, members, dirs)
    except BackupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    emit(args, {"restored": dict(zip(members, dirs, strict=True)), **_info_json(info),
                "start": [f"raftkv serve --id {n} --data-dir {d} --raft-addr {a} "
                          f"--http-addr HOST:PORT --secret-file FILE --peers "
                          + ",".join(f"{m}={b}" for m, b in members.items())
                          for (n, a), d in zip(members.items(), dirs, strict=True)]},
         indent=1)
    return 0


def _parse_members(text: str) -> dict[str, str]:
    """``--members``, checked as ``serve --peers`` will check it (so a restore never
    makes directories that cannot start)."""
    from raftkv.backup import BackupError
    from raftkv.placement.catalog import check_node_id

    out: dict[str, str] = {}
    for item in text.split(","):
        nid, sep, addr = item.partition("=")
        if not sep or not nid or not addr:
            raise BackupError(f"--members takes id=host:port,...; not {item!r}")
        try:
            check_node_id(nid)
            parse_addr(addr)
        except ValueError as e:
            raise BackupError(f"--members: {e}") from None
        if nid in out:
            raise BackupError(f"--members names {nid} twice")
        if addr in out.values():
            raise BackupError(f"--members gives the address {addr} to two members")
        out[nid] = addr
    return out


def _lease_command(args: argparse.Namespace, client: Client) -> int:
    """``raftkv lease grant|keepalive|revoke|info|list``."""
    if args.action == "grant":
        emit(args, {"id": client.lease_grant(args.ttl, args.id), "ttl": args.ttl})
    elif args.action == "keepalive":
        _keep_alive(args, client)
    elif args.action == "revoke":
        emit(args, {"id": args.id, "deleted": client.lease_revoke(args.id)})
    elif args.action == "info":
        doc = client.lease_info(args.id)
        doc["keys"] = [_text(k, "key") for k in doc["keys"]]
        emit(args, doc, indent=1)
    else:
        emit(args, client.leases())
    return 0


def _keep_alive(args: argparse.Namespace, client: Client) -> None:
    """etcdctl lease keep-alive: one keepalive every TTL/3 seconds until interrupted
    (or ``--once``). A keepalive that fails for want of an answer is tried again, on the
    next endpoint, until the lease is reported gone: the first failure used to end the
    command, and each attempt could wait the whole ``--timeout`` on a stopped leader, so
    the lease it kept expired while two healthy nodes were up (found from outside). Each
    keepalive is bounded by a third of the TTL."""
    ttl = client.lease_keepalive(args.id)  # a lease that does not exist is an error now
    while True:
        emit(args, {"id": args.id, "ttl": ttl})
        sys.stdout.flush()
        if args.once:
            return
        client.timeout = min(client.timeout, max(ttl / 3, MIN_ATTEMPT))
        time.sleep(max(ttl / 3, 0.5))
        while True:
            try:
                ttl = client.lease_keepalive(args.id)
                break
            except Unavailable as e:  # no answer (a stopped node, an election): again
                print(f"warning: keepalive of lease {args.id}: {e}; retrying",
                      file=sys.stderr)
                time.sleep(0.1)


def _watch_command(args: argparse.Namespace, client: Client) -> int:
    """``raftkv watch``: one line per event, ``REVISION PUT KEY VALUE`` or ``REVISION
    DELETE KEY`` (``-w json``: one JSON object per event), until interrupted or
    ``--count`` events."""
    if args.from_revision is not None and args.from_revision < 1:
        raise UsageError("raftkv watch: error: --from-revision is a log index, 1 or more")
    if args.count is not None and args.count < 1:
        # 0 or less read as "no count" and watched for ever (found outside-in).
        raise UsageError("raftkv watch: error: --count must be at least 1")
    if (args.table is None) != (args.partition is None):
        raise UsageError("raftkv watch: error: a table's changes are watched one partition "
                         "at a time: give --table and --partition together")
    prefix, start, end = (None if a is None else os.fsencode(a)
                          for a in (args.prefix, args.start, args.end))
    if prefix is None and start is None and end is None:
        prefix = b""
    seen = 0
    out = sys.stdout.buffer
    for revision, events in client.watch(prefix=prefix, start=start, end=end,
                                         from_revision=args.from_revision,
                                         table=args.table, partition=args.partition):
        for e in events:
            if args.write_out is None:
                value = b" " + e["value"] if "value" in e else b""
                out.write(b"%d %s %s%s\n" % (revision, e["type"].upper().encode(), e["key"],
                                              value))
            else:
                print(json.dumps({"revision": revision, "type": e["type"],
                                  **_text(e["key"], "key"),
                                  **(_text(e["value"], "value") if "value" in e else {})}))
            seen += 1
            if args.count and seen >= args.count:
                break
        out.flush()
        sys.stdout.flush()
        if args.count and seen >= args.count:
            return 0
    return 0


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"raftkv: error: cannot read {path}: {e}") from None


def _text(b: bytes, field: str) -> dict[str, str]:
    try:
        return {field: b.decode()}
    except UnicodeDecodeError:
        return {f"{field}_base64": base64.b64encode(b).decode()}


def _range_command(args: argparse.Namespace, client: Client) -> int:
    """``get --prefix`` and ``scan``: every key of a range in key order, page by page
    (``Client.scan``; the pages are not one snapshot). Text: each key and then its value
    on a line of their own, as ``etcdctl get --prefix`` prints them; ``-w json``: a list
    of ``{"key", "value"}`` (``*_base64`` for bytes that are not UTF-8)."""
    if args.cmd == "get" and args.key is not None:
        raise UsageError("raftkv get: error: give a KEY or --prefix, not both")
    if getattr(args, "meta", False):
        raise UsageError("raftkv get: error: --meta reads one key (a range's revisions: "
                         "GET /v1/kv?prefix=P&meta=true)")
    # os.fsencode: a key given in bytes that are not UTF-8 reaches argv as surrogates
    prefix, start, end = (None if a is None else os.fsencode(a) for a in
                          (args.prefix, getattr(args, "start", None), getattr(args, "end", None)))
    limit = getattr(args, "limit", None)
    if limit is not None and limit < 1:
        raise UsageError(f"raftkv {args.cmd}: error: --limit must be at least 1")
    if getattr(args, "count", False):
        doc = client.range_page(prefix=prefix, start=start, end=end, count_only=True,
                                stale=args.stale, table=args.table)
        emit(args, {"count": doc["count"], "revision": doc["revision"]})
        return 0
    keys_only = getattr(args, "keys_only", False)
    rows = client.scan(prefix=prefix, start=start, end=end, keys_only=keys_only,
                       stale=args.stale, table=args.table,
                       page=min(limit, 1000) if limit else 1000)
    out: list[dict[str, str]] = []
    for n, (k, v) in enumerate(rows):
        if limit is not None and n >= limit:
            break
        if args.write_out is None:
            sys.stdout.buffer.write(k + b"\n" + (b"" if v is None else v + b"\n"))
        else:
            out.append({**_text(k, "key"), **({} if v is None else _text(v, "value"))})
    if args.write_out is not None:
        emit(args, out)
    return 0


def _cluster_commands(args: argparse.Namespace, client: Client) -> int:
    if args.action == "status":
        start = time.monotonic()
        rows = status_rows(client, discover=not args.only_endpoints,
                           groups=set(args.group) or None)
        unknown = sorted(set(args.group) - {r["group"] for r in rows if "group" in r})
        # Only when every member answered: with --only-endpoints, a node that did not,
        # or one with no published address, the group may be there.
        if (unknown and not args.only_endpoints
                and not any("error" in r or "note" in r for r in rows)):
            # An empty table and exit 0 read as "nothing wrong" (found from outside).
            print(f"error: no node hosts group {unknown[0]!r}", file=sys.stderr)
            return 1
        if args.write_out == "json":
            print(json.dumps(rows, indent=1))
        else:
            print(format_table(rows))
            # --timeout bounds the whole command: the placement nodes get what is left,
            # and are not asked of nodes that have just not answered (found from outside:
            # against a stopped node the command took twice --timeout).
            left = client.timeout - (time.monotonic() - start)
            nodes = []  # no placement answer: the groups above are the status
            if left > 0 and any("error" not in r for r in rows):
                client.timeout = left
                try:
                    nodes = client.cluster_nodes()
                except (ClientError, Unavailable, OSError, http.client.HTTPException,
                        ValueError):
                    pass
            if nodes:
                print("placement nodes:")
                print(render_table(nodes, NODE_COLUMNS))
        return 1 if any("error" in r for r in rows) else 0
    if args.action == "nodes":
        nodes = client.cluster_nodes()
        if args.write_out == "json":
            print(json.dumps(nodes, indent=1))
        else:
            print(render_table(nodes, NODE_COLUMNS))
        return 0
    if args.action == "settings":
        change = {k: v for k, v in (("scale_down_timeout", args.scale_down_timeout),
                                    ("scale_up_timeout", args.scale_up_timeout),
                                    ("metastore_voters", args.metastore_voters),
                                    ("max_moves", args.max_moves),
                                    ("catch_up_timeout", args.catch_up_timeout))
                  if v is not None}
        emit(args, client.update_settings(**change) if change else client.settings())
        return 0
    if args.action == "add-learner":
        emit(args, client.add_learner(args.node, args.raft_addr))
    elif args.action == "promote":
        emit(args, client.promote(args.node))
    elif args.action == "remove":
        emit(args, client.remove(args.node))
    elif args.action == "transfer":
        emit(args, client.transfer(args.node))
    elif args.action == "add-node":
        emit(args, client.add_node(args.node, args.raft_addr, args.http_addr))
    elif args.action == "remove-node":
        emit(args, client.remove_node(args.node))
    elif args.action == "drain":
        emit(args, client.drain(args.node))
    return 0


def _table_commands(args: argparse.Namespace, client: Client) -> int:
    out: Any
    if args.action == "create":
        out = client.create_table(args.name, args.partitions, args.replicas, args.storage,
                                  allow_unsafe=args.allow_unsafe)
    elif args.action == "list":
        out = client.list_tables()
    elif args.action == "describe":
        out = client.describe_table(args.name)
    elif args.action == "drop":
        out = client.drop_table(args.name)
    else:
        out = client.set_replicas(args.name, args.replicas, allow_unsafe=args.allow_unsafe)
    if isinstance(out, dict) and out.get("warning"):
        print(f"warning: {out['warning']}", file=sys.stderr)
    emit(args, out, indent=1)
    return 0


# -- the parser -------------------------------------------------------------------------
def _seconds(text: str, zero: bool = False) -> float:
    """A finite number of seconds, more than 0 (or ``zero``: 0 or more)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (0 <= v if zero else 0 < v) or v == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be 0 seconds or more, not {text}" if zero
            else f"must be more than 0 seconds, not {text}")
    return v


# The longest wait a socket and poll() take (poll's milliseconds are a C int): found
# from outside, --timeout 1e300 ended in an OverflowError traceback.
MAX_WAIT = 1_000_000.0


def _wait(text: str) -> float:
    """``_seconds``, at most ``MAX_WAIT``."""
    v = _seconds(text)
    if v > MAX_WAIT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WAIT:,.0f} seconds, not {text}")
    return v


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("raftkv")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _sub(group: Any, name: str, text: str, **kw: Any) -> argparse.ArgumentParser:
    """A subcommand whose help (in its parent's list) and description are ``text``."""
    parser: argparse.ArgumentParser = group.add_parser(name, help=text, description=text, **kw)
    return parser


SERVE_HELP = "run a node: Raft on --raft-addr, the HTTP API on --http-addr"


def serve_parser() -> argparse.ArgumentParser:
    """``raftkv serve`` alone. A node starts through this parser, not ``parser()``: the
    other commands' parsers (Spark's among them) cost a restarted node CPU before its
    first answer, and a whole cluster restarted on one machine shares the cores."""
    p = _Parser(prog="raftkv serve", description=SERVE_HELP)
    serve.add_arguments(p)
    p.set_defaults(cmd="serve")
    return p


def parser() -> argparse.ArgumentParser:
    from raftkv.spark.cli import add_arguments as add_spark_arguments

    p = _Parser(prog="raftkv", description="raftkv: a replicated key-value store. Run a "
                "node (serve), read and write keys, manage the cluster and its tables.")
    p.add_argument("--version", action="version", version=f"raftkv {_version()}")
    p.add_argument("--endpoints", default=os.environ.get("RAFTKV_ENDPOINTS", DEFAULT_ENDPOINTS),
                   help="comma-separated HTTP endpoints of any nodes (default: "
                        "$RAFTKV_ENDPOINTS, else %(default)s)")
    p.add_argument("--timeout", type=_wait, default=10.0,
                   help="seconds a command may take, retries included (default: %(default)s)")
    p.add_argument("--connect-timeout", type=_wait, default=2.0,
                   help="seconds to connect to an endpoint, and to keep trying when none "
                        "accepts a connection (default: %(default)s)")
    p.add_argument("-w", "--write-out", choices=("table", "json"), default=None,
                   help="print answers as a table or as JSON (default: a table for "
                        "cluster status, the raw value for get, a line per key for "
                        "scan and get --prefix, a line per event for watch, JSON "
                        "otherwise)")
    p.add_argument("--cacert", help="verify HTTPS endpoints with this CA file "
                                    "(default $RAFTKV_CACERT; endpoints without a scheme "
                                    "are then https)")
    p.add_argument("--cert", help="client certificate for mutual TLS (default $RAFTKV_CERT)")
    # dest: ``key`` is the data key of get/put/del/cas (the TLS key was read as it).
    p.add_argument("--key", dest="tls_key", help="its private key (default $RAFTKV_KEY)")
    p.add_argument("--token-file",
                   help="file holding the bearer token to send (default: $RAFTKV_TOKEN, "
                        "else the file named by $RAFTKV_TOKEN_FILE)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    serve.add_arguments(_sub(sub, "serve", SERVE_HELP))
    table_help = "a table's key (default: the default KV group's)"
    put = _sub(sub, "put", "write a key")
    put.add_argument("key", help="the key (1..511 bytes)")
    put.add_argument("value", help="the value (at most 1 MiB)")
    put.add_argument("--table", help=table_help)
    put.add_argument("--lease", type=int, metavar="ID",
                     help="attach the key to this lease: it is deleted when the lease "
                          "expires or is revoked (`raftkv lease grant`)")
    get = _sub(sub, "get", "read a key (linearizable unless --stale); exit 1 if absent. "
                           "With --prefix, every key that starts with it")
    get.add_argument("key", nargs="?", help="the key")
    get.add_argument("--prefix", help="read every key with this prefix instead (each key "
                                      "and its value on lines of their own)")
    get.add_argument("--stale", action="store_true",
                     help="read the answering node's local replica, which may lag")
    get.add_argument("--meta", action="store_true",
                     help="print the value with the key's create and mod revisions and "
                          "version (JSON)")
    get.add_argument("--table", help=table_help)
    scan = _sub(sub, "scan", "every key of a range in key order (default: every key), "
                             "read page by page; each page is linearizable unless "
                             "--stale, the pages together are not one snapshot")
    scan.add_argument("--prefix", help="keys that start with this")
    scan.add_argument("--start", help="the first key (inclusive)")
    scan.add_argument("--end", help="the end key (exclusive)")
    scan.add_argument("--limit", type=int, help="at most this many keys")
    scan.add_argument("--keys-only", action="store_true", help="print keys only")
    scan.add_argument("--count", action="store_true",
                      help="print only how many keys the range holds")
    scan.add_argument("--stale", action="store_true",
                      help="read the answering node's local replica, which may lag")
    scan.add_argument("--table", help="a table's keys (default: the default KV group's)")
    delete = _sub(sub, "del", "delete a key (deleting an absent key is not an error)")
    delete.add_argument("key", help="the key")
    delete.add_argument("--table", help=table_help)
    cas = _sub(sub, "cas", "compare-and-set: write NEW only if the key holds --prev-value "
                           "(or is absent, --prev-absent); exit 2 if it did not swap")
    cas.add_argument("key", help="the key")
    cas.add_argument("new", help="the value to write")
    cas.add_argument("--prev-value", help="the value the key must hold")
    cas.add_argument("--prev-absent", action="store_true", help="the key must be absent")
    cas.add_argument("--prev-index", type=int, metavar="REVISION",
                     help="the key's mod revision must be this (0: absent; "
                          "`raftkv get --meta` shows it)")
    cas.add_argument("--table", help=table_help)

    lease = _sub(sub, "lease", "leases: keys that are deleted together when the lease "
                               "expires (the leader expires it after TTL seconds without "
                               "a keepalive) or is revoked")
    leasea = lease.add_subparsers(dest="action", required=True, metavar="ACTION")
    grant = _sub(leasea, "grant", "a new lease of TTL seconds; prints its id")
    grant.add_argument("ttl", type=int, help="seconds (1..10,000,000)")
    grant.add_argument("--id", type=int, help="the lease's id (default: a random one)")
    for name, text in (("keepalive", ("keep a lease alive: every TTL/3 seconds until "
                                      "interrupted (--once: just once)")),
                       ("revoke", "revoke a lease now, deleting its keys"),
                       ("info", "a lease's TTL, remaining seconds and keys")):
        one = _sub(leasea, name, text)
        one.add_argument("id", type=int, help="the lease's id")
        if name == "keepalive":
            one.add_argument("--once", action="store_true", help="one keepalive, then exit")
    _sub(leasea, "list", "every lease")

    watch = _sub(sub, "watch", "stream the changes to a range (default: every key), read "
                               "from the Raft log, resuming on another node if one fails")
    watch.add_argument("--prefix", help="keys that start with this")
    watch.add_argument("--start", help="the first key (inclusive)")
    watch.add_argument("--end", help="the end key (exclusive)")
    watch.add_argument("--from-revision", type=int, metavar="R",
                       help="from this revision (a log index) on; default: new changes")
    watch.add_argument("--count", type=int, help="stop after this many events")
    watch.add_argument("--table", help="a table partition's changes (with --partition)")
    watch.add_argument("--partition", type=int,
                       help="the table partition (with --table; its own revisions)")

    snap = _sub(sub, "snapshot", "backups of the default group or of a table: save one from "
                                 "a running cluster, check one, restore one")
    snapa = snap.add_subparsers(dest="action", required=True, metavar="ACTION")
    save = _sub(snapa, "save", "stream a backup from the leader into FILE (verified after); "
                               "with --table, every partition into the directory FILE")
    save.add_argument("file", help="where to write the backup (a .part file first); with "
                                   "--table a new or empty directory")
    save.add_argument("--table", help="back up this table: one file per partition and a "
                                      "manifest")
    status = _sub(snapa, "status", "check a backup file (or a table backup's directory) "
                                   "completely and print what it holds")
    status.add_argument("file", help="the backup file, or a table backup's directory")
    rest = _sub(snapa, "restore", "make the data directories of a NEW cluster from a backup, "
                                  "one per member, in one run (then start each with "
                                  "raftkv serve and the same --peers); with --table, load "
                                  "a table backup into a new table of a running cluster")
    rest.add_argument("file", help="the backup file, or a table backup's directory (verified "
                                   "before anything is written)")
    rest.add_argument("--members",
                      help="the new cluster: id=raft_host:port,... (becomes --peers)")
    rest.add_argument("--data-dirs",
                      help="one new, empty directory per member, comma-separated, in the "
                           "order of --members")
    rest.add_argument("--table", help="a table backup: the NEW table to create and load "
                                      "(same partition count; rows get new revisions)")
    rest.add_argument("--replicas", type=int,
                      help="with --table: replicas of the new table (default: the backup's)")

    txn = _sub(sub, "txn", "a transaction: compares, then one of two lists of puts, deletes "
                           "and gets, as one log entry; exit 2 if the compares failed")
    txn.add_argument("file", help="a JSON file with {\"compare\", \"success\", "
                                  "\"failure\"} (README), or - for stdin")
    txn.add_argument("--table", help="run in the partition of this table that holds "
                                     "every key it names")

    cl = _sub(sub, "cluster", "membership (of the default group, of the placement topology) "
                                 "and every node's status")
    cla = cl.add_subparsers(dest="action", required=True, metavar="ACTION")
    status = _sub(cla, "status", "one row per node and group, from each node's own view; "
                                 "every member is found from any one endpoint")
    status.add_argument("--only-endpoints", action="store_true",
                        help="ask only the given endpoints, not every member")
    status.add_argument("--group", action="append", default=[], metavar="GROUP",
                        help="show only this group (repeat for more; default: every "
                             "group; 'default' is the KV group, 'meta' the metastore, "
                             "t.<table>.<p> a table partition)")
    learner = _sub(cla, "add-learner", "add a node to the default group as a PRE_FOLLOWER; "
                                       "the leader promotes it once it has caught up")
    learner.add_argument("node", help="the new node's id")
    learner.add_argument("raft_addr", help="its host:port for Raft traffic")
    for action, text in (("promote", "make a learner of the default group a voter"),
                         ("remove", ("remove a member of the default group (a leader "
                                    "hands over first)")),
                         ("transfer", "hand the default group's leadership to a voter"),
                         ("remove-node", ("take a node out of the placement topology (its "
                                         "table partitions move away, then it leaves the "
                                         "metastore); for a node lost for good")),
                         ("drain", ("decommission a node: its partitions move away, then "
                                    "it leaves the topology and the metastore (progress: "
                                    "cluster nodes)"))):
        _sub(cla, action, text).add_argument("node", help="the node's id")
    add_node = _sub(cla, "add-node", "add a node to the placement topology (tables "
                                     "rebalance onto it)")
    add_node.add_argument("node", help="the node's id")
    add_node.add_argument("raft_addr", help="its host:port for Raft traffic")
    add_node.add_argument("--http-addr", help="its host:port for HTTP, published so that "
                                              "other nodes can proxy to it")
    _sub(cla, "nodes", "each placement node's liveness: alive, suspect or dead, for how "
                       "long, and whether partitions are placed on it")
    settings = _sub(cla, "settings", "show the cluster's placement settings, or change "
                                     "them")
    settings.add_argument("--scale-down-timeout", type=partial(_seconds, zero=True), metavar="SECONDS",
                          help="silence after which a node is dead and its partitions "
                               "move to live nodes (0: never)")
    settings.add_argument("--scale-up-timeout", type=partial(_seconds, zero=True), metavar="SECONDS",
                          help="how long a dead node must be back before partitions are "
                               "placed on it again")
    settings.add_argument("--metastore-voters", type=int, choices=(3, 5),
                          help="how many voters the metastore keeps (a dead or drained "
                               "voter is replaced by a spare node)")
    settings.add_argument("--max-moves", type=int, metavar="N",
                          help="how many partitions each leader adds replicas to at once "
                               "(0: no limit)")
    settings.add_argument("--catch-up-timeout", type=partial(_seconds, zero=True),
                          metavar="SECONDS",
                          help="how long a new replica may take to catch up before it is "
                               "dropped and tried again later (0: no limit)")

    tb = _sub(sub, "table", "create, inspect and drop tables (partitioned, each partition "
                            "its own Raft group)")
    tba = tb.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = _sub(tba, "create", "create a table")
    create.add_argument("name", help="the table's name")
    create.add_argument("--partitions", type=int, required=True, help="number of partitions")
    create.add_argument("--replicas", type=int, required=True,
                        help="replicas of each partition")
    create.add_argument("--storage", choices=("persistent", "memory"), default="persistent",
                        help="LMDB on disk, or memory only (default: %(default)s)")
    unsafe = ("accept a replica count that cannot survive one failure (1 or 2 replicas of "
              "an in-memory table are refused without it)")
    create.add_argument("--allow-unsafe", action="store_true", help=unsafe)
    _sub(tba, "list", "list the tables")
    _sub(tba, "describe", "a table's partitions: assignments, leaders, replicas, "
                          "rebalance errors").add_argument("name", help="the table's name")
    _sub(tba, "drop", "drop a table and delete its data").add_argument(
        "name", help="the table's name")
    sr = _sub(tba, "set-replicas", "change a table's replica count (it rebalances)")
    sr.add_argument("name", help="the table's name")
    sr.add_argument("replicas", type=int, help="the new replica count")
    sr.add_argument("--allow-unsafe", action="store_true", help=unsafe)

    rec = _sub(sub, "recover", "offline recovery of a stopped node's data")
    reca = rec.add_subparsers(dest="action", required=True, metavar="ACTION")
    _sub(reca, "unsafe-reset", "make the stopped survivors of a lost majority the group's "
                               "only voters (may lose data; see its --help)", add_help=False)
    _sub(sub, "admin", "administer an embedded node over its raft port, like PySyncObj's "
                       "syncobj_admin (see its --help)", add_help=False)
    add_spark_arguments(_sub(sub, "spark", "bulk-load or verify a table with Spark (the "
                                           "spark extra)"))
    return p


def _leading_tls_options(argv: list[str]) -> int:
    """How many leading arguments are --cacert/--cert/--key options with their values."""
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name not in ("--cacert", "--cert", "--key"):
            break
        i += 1 if "=" in argv[i] else 2
    return min(i, len(argv))


def _reader_gone() -> int:
    """The reader of our output went away (``raftkv ... | head``): stop quietly, as a Unix
    tool does. stdout goes to devnull so the interpreter's final flush cannot complain."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout replaced by a caller: nothing to redirect
        pass
    return 141


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The recovery tool owns its own arguments (and its own refusals).
    if len(argv) >= 2 and argv[0] == "recover" and argv[1] == "unsafe-reset":
        from raftkv.recovery.unsafe_reset import main as unsafe_reset

        try:
            return unsafe_reset(argv[2:])
        except BrokenPipeError:  # `... | head`: its work is done (or refused) already
            return _reader_gone()
    tls_first = _leading_tls_options(argv)
    if len(argv) > tls_first and argv[tls_first] == "admin":
        # So does the admin tool (and syncobj_admin's syntax); the global TLS options,
        # if they come first, are its own (the raft port's TLS).
        from raftkv.admin import main as admin

        return admin(argv[:tls_first] + argv[tls_first + 1:])
    try:
        args = (serve_parser().parse_args(argv[1:]) if argv[:1] == ["serve"]
                else parser().parse_args(argv))
        if args.cmd == "serve":
            return serve.run(args)
        if args.cmd == "snapshot" and args.action == "restore":
            _check_restore_mode(args)
        if args.cmd == "snapshot" and args.action != "save" and not (
                args.action == "restore" and args.table):
            return _snapshot_offline(args)
        if args.cmd == "spark":
            from raftkv.spark.cli import run as spark_job

            # The jobs' clients (in Spark's workers too) read the TLS files from here.
            for var, value in (("RAFTKV_CACERT", args.cacert), ("RAFTKV_CERT", args.cert),
                               ("RAFTKV_KEY", args.tls_key)):
                if value:
                    os.environ[var] = value
            return spark_job(args, args.endpoints, resolve_token(token_file=args.token_file))
        client = Client(args.endpoints, timeout=args.timeout,
                        connect_timeout=args.connect_timeout, cacert=args.cacert,
                        cert=args.cert, key=args.tls_key, token_file=args.token_file)
        try:
            if args.cmd == "cluster":
                return _cluster_commands(args, client)
            if args.cmd == "table":
                return _table_commands(args, client)
            return _kv_commands(args, client)
        except BrokenPipeError:
            return _reader_gone()
        finally:
            client.close()
    except UsageError as e:
        print(e, file=sys.stderr)
        return 1
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `... | head` (found from outside: "error: [Errno 32] ...")
        return _reader_gone()
    except (ClientError, Unavailable, ValueError, OSError, http.client.HTTPException,
            StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
