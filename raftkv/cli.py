"""The ``raftkv`` command: run a node, talk to a cluster, recover one.

    raftkv serve --id n1 --data-dir DIR --raft-addr H:P --http-addr H:P --peers ...
    raftkv [--endpoints URL,...] put KEY VALUE | get KEY [--stale] | del KEY
    raftkv cas KEY NEW (--prev-value V | --prev-absent) [--table T]
    raftkv cluster status | add-learner ID RAFT_ADDR | promote ID | remove ID | transfer ID
    raftkv cluster add-node ID RAFT_ADDR [--http-addr H:P] | remove-node ID   (placement topology)
    raftkv table create NAME --partitions N --replicas R [--storage persistent|memory]
                 [--allow-unsafe]   (2 in-memory replicas are refused without it)
    raftkv table list | describe NAME | drop NAME | set-replicas NAME N [--allow-unsafe]
    raftkv put|get|del --table T KEY ...   (a table's key instead of the default group's)
    raftkv recover unsafe-reset --data-dir DIR ... --members ... --yes-i-understand-data-may-be-lost
    raftkv spark load|verify --table T --input PATH --key COL [--master URL]   (raftkv.spark.cli)

Endpoints come from ``--endpoints`` or ``RAFTKV_ENDPOINTS``. A cluster that checks tokens
gets one from ``--token-file F``, else ``RAFTKV_TOKEN``, else the file named by
``RAFTKV_TOKEN_FILE`` (``raftkv.client.resolve_token``; there is no ``--token``: a
command line is visible to every user of the machine). Errors print one line on stderr
and exit 1; a failed compare-and-set exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from raftkv.client import Client, ClientError, Unavailable, resolve_token
from raftkv.server import serve
from raftkv.storage.errors import StorageError

DEFAULT_ENDPOINTS = "http://127.0.0.1:8001"


def status_rows(client: Client) -> list[dict[str, Any]]:
    """One row per (endpoint, group), each from that node's own view."""
    rows = []
    for e in client.endpoints:
        try:
            st = client.status(e)
        except (OSError, ClientError) as err:
            rows.append({"node": e, "error": str(err)})
            continue
        for gid, g in st["groups"].items():
            rows.append({
                "node": st["id"], "group": gid, "role": g["role"],
                "kind": g["members"].get(st["id"], "-"), "term": g["term"],
                "leader": g["leader"] or "-", "commit": g["commit"],
                "applied": g["applied"], "checkpoint": g["checkpoint"],
                "last": g["last_index"], "peers": g["peers"],
                "members": g["members"],
            })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = ["node", "group", "role", "kind", "term", "leader", "commit", "applied",
            "checkpoint", "last"]
    body = [[str(r.get(c, "")) for c in cols] for r in rows if "error" not in r]
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip() for b in body]
    lines += [f"{r['node']}: unreachable ({r['error']})" for r in rows if "error" in r]
    for r in rows:
        if r.get("role") == "leader" and r["peers"]:
            lines.append(f"replication from leader {r['node']} ({r['group']}):")
            for peer, p in sorted(r["peers"].items()):
                kind = r["members"].get(peer, "?")
                lag = r["last"] - p["match"]
                lines.append(f"  {peer:<8} {kind:<13} match={p['match']:<8} lag={lag:<8} "
                             f"{p['state']}{'' if p['active'] else ' (inactive)'}")
    return "\n".join(lines)


def _kv_commands(args: argparse.Namespace, client: Client) -> int:
    table = getattr(args, "table", None)
    if args.cmd == "put":
        print(json.dumps({"index": client.put(args.key, args.value, table=table)}))
    elif args.cmd == "get":
        v = client.get(args.key, stale=args.stale, table=table)
        if v is None:
            print(f"error: key {args.key!r} not found", file=sys.stderr)
            return 1
        sys.stdout.buffer.write(v + b"\n")
    elif args.cmd == "del":
        print(json.dumps({"index": client.delete(args.key, table=table)}))
    elif args.cmd == "cas":
        if (args.prev_value is None) == (not args.prev_absent):
            print("error: give exactly one of --prev-value or --prev-absent", file=sys.stderr)
            return 1
        swapped, index = client.cas(args.key, args.prev_value, args.new, table=table)
        print(json.dumps({"swapped": swapped, "index": index}))
        return 0 if swapped else 2
    return 0


def _cluster_commands(args: argparse.Namespace, client: Client) -> int:
    if args.action == "status":
        rows = status_rows(client)
        print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    elif args.action == "add-learner":
        print(json.dumps(client.add_learner(args.node, args.raft_addr)))
    elif args.action == "promote":
        print(json.dumps(client.promote(args.node)))
    elif args.action == "remove":
        print(json.dumps(client.remove(args.node)))
    elif args.action == "transfer":
        print(json.dumps(client.transfer(args.node)))
    elif args.action == "add-node":
        print(json.dumps(client.add_node(args.node, args.raft_addr, args.http_addr)))
    elif args.action == "remove-node":
        print(json.dumps(client.remove_node(args.node)))
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
    print(json.dumps(out, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raftkv", description="raftkv: a replicated KV store")
    p.add_argument("--endpoints", default=os.environ.get("RAFTKV_ENDPOINTS", DEFAULT_ENDPOINTS),
                   help="comma-separated HTTP endpoints")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--token-file",
                   help="file holding the bearer token to send (else RAFTKV_TOKEN, else the "
                        "file named by RAFTKV_TOKEN_FILE)")
    sub = p.add_subparsers(dest="cmd", required=True)
    serve.add_arguments(sub.add_parser("serve", help="run a node"))
    put = sub.add_parser("put")
    put.add_argument("--table", help="a table's key (default: the default KV group)")
    put.add_argument("key")
    put.add_argument("value")
    get = sub.add_parser("get")
    get.add_argument("key")
    get.add_argument("--stale", action="store_true", help="read the local replica")
    get.add_argument("--table")
    delete = sub.add_parser("del")
    delete.add_argument("key")
    delete.add_argument("--table")
    cas = sub.add_parser("cas")
    cas.add_argument("key")
    cas.add_argument("new")
    cas.add_argument("--prev-value")
    cas.add_argument("--prev-absent", action="store_true")
    cas.add_argument("--table", help="a table's key (default: the default KV group)")
    cl = sub.add_parser("cluster").add_subparsers(dest="action", required=True)
    cl.add_parser("status").add_argument("--json", action="store_true")
    learner = cl.add_parser("add-learner")
    learner.add_argument("node")
    learner.add_argument("raft_addr")
    for action in ("promote", "remove", "transfer", "remove-node"):
        cl.add_parser(action).add_argument("node")
    add_node = cl.add_parser("add-node", help="add a node to the placement topology")
    add_node.add_argument("node")
    add_node.add_argument("raft_addr")
    add_node.add_argument("--http-addr")
    tb = sub.add_parser("table").add_subparsers(dest="action", required=True)
    create = tb.add_parser("create")
    create.add_argument("name")
    create.add_argument("--partitions", type=int, required=True)
    create.add_argument("--replicas", type=int, required=True)
    create.add_argument("--storage", choices=("persistent", "memory"), default="persistent")
    unsafe = ("accept a replica count that cannot survive one failure (2 replicas of an "
              "in-memory table are refused without it)")
    create.add_argument("--allow-unsafe", action="store_true", help=unsafe)
    tb.add_parser("list")
    for action in ("describe", "drop"):
        tb.add_parser(action).add_argument("name")
    sr = tb.add_parser("set-replicas")
    sr.add_argument("name")
    sr.add_argument("replicas", type=int)
    sr.add_argument("--allow-unsafe", action="store_true", help=unsafe)
    rec = sub.add_parser("recover").add_subparsers(dest="action", required=True)
    rec.add_parser("unsafe-reset", add_help=False)
    sp = sub.add_parser("spark", help="bulk-load or verify a table with Spark")
    jobs = sp.add_subparsers(dest="action", required=True)
    for action in ("load", "verify"):
        a = jobs.add_parser(action)
        a.add_argument("--table", required=True)
        a.add_argument("--input", required=True, help="a .parquet or .csv (with a header)")
        a.add_argument("--key", required=True, help="the key column")
        a.add_argument("--value-cols", default="", help="comma-separated (default: the rest)")
        a.add_argument("--master", default="local[*]", help="Spark master URL")
        if action == "load":
            a.add_argument("--batch-rows", type=int, default=1000)
            a.add_argument("--load-id", default=None,
                           help="reuse to resume a load: applied batches are skipped")
        else:
            a.add_argument("--diff-limit", type=int, default=1000,
                           help="name differing keys of partitions up to this many rows")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The recovery tool owns its own arguments (and its own refusals).
    if len(argv) >= 2 and argv[0] == "recover" and argv[1] == "unsafe-reset":
        from raftkv.recovery.unsafe_reset import main as unsafe_reset

        return unsafe_reset(argv[2:])
    args = parser().parse_args(argv)
    try:
        if args.cmd == "serve":
            return serve.run(args)
        if args.cmd == "spark":
            from raftkv.spark.cli import run as spark_job  # pyspark only when asked for

            return spark_job(args, args.endpoints, resolve_token(token_file=args.token_file))
        client = Client(args.endpoints, timeout=args.timeout, token_file=args.token_file)
        try:
            if args.cmd == "cluster":
                return _cluster_commands(args, client)
            if args.cmd == "table":
                return _table_commands(args, client)
            return _kv_commands(args, client)
        finally:
            client.close()
    except (ClientError, Unavailable, ValueError, OSError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
