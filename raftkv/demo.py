"""``make demo``: a real 3-node cluster of ``raftkv serve`` processes on 127.0.0.1.

Data lives under ``demo-data/`` (wiped at the start). Every port runs TLS: the demo
makes a throw-away CA and a certificate per node in ``demo-data/tls/`` (``raftkv.certs``;
docs/security.md does the same with openssl), the HTTP API is HTTPS and peers use
mutual TLS. The nodes check bearer tokens too: the demo writes a tokens file there, one
token per role, and uses the admin token. The demo:

1. starts three nodes, writes sample data and prints the cluster table; shows a request
   without a token refused (401) and a write with the read token refused (403);
2. SIGKILLs the leader, shows the new leader, and that writes continue;
3. restarts the old leader, shows its recovery report (entries replayed from its
   checkpoint) and its catch-up;
4. starts a fourth node with ``--join``, adds it as a PRE_FOLLOWER and shows the leader
   promoting it once it has caught up.

Every process is stopped at the end, on an error, and on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from types import FrameType
from typing import TextIO

from raftkv.cli import format_table, status_rows
from raftkv.client import Client, OutcomeUnknown
from raftkv.server.auth import Role
from raftkv.testing.procs import ProcCluster, http_json

DEMO_DIR = "demo-data"


def put_surely(client: Client, key: str, value: str) -> None:
    """Write ``key`` until it holds ``value``. A write caught by the leader's death may
    have applied or not (``OutcomeUnknown``): the client does not send it again on its
    own, since a second copy would apply twice. Reading the key tells, as an etcdctl
    user would check; the demo's values are its own, so "holds it" means "it applied"."""
    while True:
        try:
            client.put(key, value)
            return
        except OutcomeUnknown:
            if client.get(key) == value.encode():
                return


class Demo:
    def __init__(self, cluster: ProcCluster, out: TextIO) -> None:
        self.c = cluster
        self.out = out
        self.t0 = time.monotonic()

    def say(self, text: str = "") -> None:
        stamp = f"[{time.monotonic() - self.t0:6.2f}s] " if text else ""
        print(stamp + text, file=self.out, flush=True)

    def table(self) -> None:
        client = self.c.client([n for n in self.c.alive_ids()])
        print(format_table(status_rows(client)), file=self.out, flush=True)
        client.close()

    def act1(self) -> str:
        self.say("== 1. Start three nodes and write sample data")
        self.say(f"TLS on: HTTPS and mutual TLS between peers, certificates signed by a "
                 f"throw-away CA ({os.path.relpath(self.c.tls_dir)}/ca.pem)")
        self.c.start()
        lead = self.c.wait_leader()
        self.say(f"leader elected: {lead}")
        client = self.c.client()
        for i in range(1, 201):
            client.put(f"user:{i:04d}", f"name-{i}")
        swapped, index = client.cas("user:0001", "name-1", "renamed")
        self.say(f"wrote 200 keys; cas user:0001 -> renamed: swapped={swapped} at index {index}")
        self.say(f"get user:0001 (linearizable) = {client.get('user:0001')!r}")
        ep = self.c.nodes[lead].endpoint + "/v1/kv/user:0001"
        for who, token, method in (("no token", None, "GET"),
                                   ("the read token", self.c.tokens[Role.READ], "PUT")):
            status, body = http_json(ep, {}, method=method, token=token,
                                     context=self.c.ssl_context)
            self.say(f"{method} /v1/kv/user:0001 with {who}: {status} {body['error']}")
        self.say(f"(tokens, one per role: {self.c.tokens_file}; the demo uses the admin one)")
        self.table()
        return lead

    def act2(self, old: str) -> None:
        self.say(f"== 2. SIGKILL the leader {old}")
        killed = time.monotonic()
        self.c.kill(old)
        rest = [n for n in self.c.nodes if n != old]
        client = self.c.client(rest)
        put_surely(client, "after-failover", "still-writing")
        took = time.monotonic() - killed
        new = self.c.wait_leader(among=rest)
        self.say(f"new leader: {new}; first write acknowledged {took:.2f}s after the kill")
        for i in range(201, 301):
            put_surely(client, f"user:{i:04d}", f"name-{i}")
        self.say("100 more writes while the old leader is down")
        self.table()

    def act3(self, old: str) -> None:
        self.say(f"== 3. Restart {old}: it replays its log from its checkpoint, then catches up")
        self.c.start(old)
        log = self.c.nodes[old].log_text().splitlines()
        reports = [line for line in log if "raftkv.serve: recovery:" in line]
        if reports:
            self.say(re.sub(r"^.*raftkv\.serve: ", f"{old} ", reports[-1]))
            self.say("(a killed process loses nothing LMDB committed: the OS still holds "
                     "its pages; replay covers what a machine crash loses after the last "
                     "checkpoint)")
        self.c.wait_caught_up()
        value = self.c.client([old]).get("user:0300", stale=True)
        self.say(f"{old} caught up; its local copy of user:0300 = {value!r}")
        self.table()

    def act4(self) -> None:
        self.say("== 4. Add n4 as a PRE_FOLLOWER (learner); the leader promotes it once caught up")
        client = self.c.client()
        for b in range(40):
            client.batch_put({f"bulk:{b:02d}:{i:04d}": "x" * 100 for i in range(500)})
        self.say("loaded 20,000 more keys (40 batch entries) so that n4 has work to catch up")
        n4 = self.c.add_node("n4")
        client = self.c.client([n for n in self.c.nodes if n != "n4"])
        client.add_learner("n4", n4.raft_addr)
        self.say("n4 added as pre-follower")
        kind = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            g = self.c.group_status("n4") or {}
            now = g.get("members", {}).get("n4")
            if now != kind:
                self.say(f"n4 is a {now or 'non-member'} (applied {g.get('applied')})")
                kind = now
            if now == "voter":
                break
            time.sleep(0.05)
        self.c.wait_caught_up()
        lead = self.c.wait_leader()
        for line in self.c.nodes[lead].log_text().splitlines():
            if re.search(r"(add_learner|promote) n4 applied", line):
                self.say(f"{lead}'s log: " + line.split("driver: ", 1)[-1])
        self.table()
        digests = {n: self.c.digest(n) for n in self.c.alive_ids()}
        same = len({(d["count"], d["digest"]) for d in digests.values()}) == 1
        self.say(f"replica digests identical on {sorted(digests)}: {same}")


def run(out: TextIO = sys.stdout, base_dir: str = DEMO_DIR) -> bool:
    shutil.rmtree(base_dir, ignore_errors=True)
    # Security settings live in ProcCluster: tls=True makes the CA and every node's
    # certificate and passes the serve flags; auth=True writes a tokens file (one token
    # per role) and has the cluster's own calls and clients send the admin token.
    cluster = ProcCluster(os.path.abspath(base_dir), size=3, faults=False, tls=True,
                          auth=True)
    demo = Demo(cluster, out)

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        old = demo.act1()
        demo.act2(old)
        demo.act3(old)
        demo.act4()
        demo.say(f"done; logs and data are in {base_dir}/")
        return True
    except KeyboardInterrupt:
        demo.say("interrupted")
        return False
    finally:
        cluster.close()
        signal.signal(signal.SIGTERM, previous)
        demo.say("all nodes stopped")


if __name__ == "__main__":
    sys.exit(0 if run() else 1)
