"""Range scans and watch fan-out over HTTP, raftkv against etcd in the same run.

- **Scan rate** (keys/s): N keys of 100-byte values under one prefix, read whole by one
  client page by page (``limit`` keys a page, linearizable), as ``Client.scan`` does;
  etcd: the v3 JSON gateway's ``/v3/kv/range`` with the same page size and its
  linearizable default, paging by ``range_end`` and the last key.
- **Watch fan-out** (events/s delivered): W watchers on one prefix (streamed HTTP), one
  writer putting E keys as fast as it can; the rate is total events delivered to all
  watchers over the time from the first put to the last event received.

Both run on three nodes on 127.0.0.1, each system at its own defaults (etcd 3.4 from
Debian's ``etcd-server`` package: ``apt-get install etcd-server``; its rows are skipped,
saying so, when ``etcd`` is not on PATH). Prints a table, writes
``benchmarks/results/kv_api.json`` and ``kv_api.png``.

Usage::

    python -m benchmarks.kv_api [--keys 20000] [--page 1000] [--watchers 100] [--events 2000]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._plot import pyplot
from raftkv.client import Client
from raftkv.testing.procs import ProcCluster, free_ports

RESULTS = Path(__file__).resolve().parent / "results"
VALUE = b"v" * 100


# -- raftkv ---------------------------------------------------------------------------------
def raftkv_scan(c: Client, page: int) -> float:
    t0 = time.perf_counter()
    n = sum(1 for _ in c.scan(prefix="s/", page=page))
    return n / (time.perf_counter() - t0)


def raftkv_watch(endpoints: list[str], writer: Client, watchers: int, events: int) -> float:
    got = [0] * watchers
    ready = threading.Barrier(watchers + 1)
    done = threading.Event()
    last = [0.0]
    lock = threading.Lock()

    def watch(i: int) -> None:
        c = Client([endpoints[i % len(endpoints)]], timeout=30)
        ready.wait()
        for _, evs in c.watch(prefix="w/"):
            with lock:
                got[i] += len(evs)
                last[0] = time.perf_counter()
            if got[i] >= events:
                break
        c.close()

    threads = [threading.Thread(target=watch, args=(i,), daemon=True) for i in range(watchers)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(1.0)  # every watch is connected
    t0 = time.perf_counter()
    batch = 100
    for i in range(0, events, batch):
        writer.batch([(b"w/%06d" % j, VALUE) for j in range(i, min(i + batch, events))])
    for t in threads:
        t.join(120)
    done.set()
    return sum(got) / (last[0] - t0)


# -- etcd -------------------------------------------------------------------------------------
class Etcd:
    """Three etcd members on 127.0.0.1 at their defaults (fsync on)."""

    def __init__(self, base: str) -> None:
        ports = free_ports(6)
        self.client_ports = ports[:3]
        peers = ports[3:]
        cluster = ",".join(f"e{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
        # A member restarted on its data directory ignores the --initial-* flags.
        self.cmds = [
            ["etcd", "--name", f"e{i}", "--data-dir", os.path.join(base, f"e{i}"),
             "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
             "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}",
             "--initial-cluster", cluster, "--initial-cluster-state", "new"]
            for i in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.restart()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                self.post(0, "/v3/kv/put", {"key": _b("ready"), "value": _b("1")})
                return
            except (OSError, http.client.HTTPException, RuntimeError):
                time.sleep(0.3)
        raise RuntimeError("etcd did not start")

    def restart(self, only: int | None = None) -> None:
        """Start every member (or member ``only``) on its data directory."""
        for i, cmd in enumerate(self.cmds):
            if only is not None and i != only:
                continue
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if i < len(self.procs):
                self.procs[i] = p
            else:
                self.procs.append(p)

    def leader(self) -> int:
        """The index of the member that leads (asked of each until one says)."""
        for _ in range(100):
            for i in range(len(self.procs)):
                try:
                    st = self.post(i, "/v3/maintenance/status", {})
                except (OSError, http.client.HTTPException, RuntimeError):
                    continue
                if st.get("leader") and st.get("leader") == st["header"]["member_id"]:
                    return i
            time.sleep(0.1)
        raise RuntimeError("etcd has no leader")

    def post(self, i: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.client_ports[i], timeout=30)
        try:
            conn.request("POST", path, json.dumps(body))
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"etcd {path}: {r.status} {data[:200]!r}")
            return dict(json.loads(data))
        finally:
            conn.close()

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _b(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def etcd_load(e: Etcd, keys: int) -> None:
    for i in range(0, keys, 100):  # etcd's txn holds at most 128 ops by default
        ops = [{"request_put": {"key": _b(b"s/%07d" % j), "value": _b(VALUE)}}
               for j in range(i, min(i + 100, keys))]
        e.post(0, "/v3/kv/txn", {"success": ops})


def etcd_scan(e: Etcd, page: int) -> float:
    t0 = time.perf_counter()
    n, start = 0, b"s/"
    while True:
        r = e.post(0, "/v3/kv/range", {"key": _b(start), "range_end": _b(b"s0"),
                                       "limit": page})
        kvs = r.get("kvs", [])
        n += len(kvs)
        if not r.get("more"):
            break
        start = base64.b64decode(kvs[-1]["key"]) + b"\x00"
    return n / (time.perf_counter() - t0)


def etcd_watch(e: Etcd, watchers: int, events: int) -> float:
    got = [0] * watchers
    last = [0.0]
    lock = threading.Lock()
    ready = threading.Barrier(watchers + 1)

    def watch(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", e.client_ports[i % 3], timeout=120)
        conn.request("POST", "/v3/watch", json.dumps(
            {"create_request": {"key": _b("w/"), "range_end": _b("w0")}}))
        r = conn.getresponse()
        ready.wait()
        while got[i] < events:
            line = r.readline()
            if not line:
                break
            doc = json.loads(line).get("result", {})
            n = len(doc.get("events", []))
            if n:
                with lock:
                    got[i] += n
                    last[0] = time.perf_counter()
        conn.close()

    threads = [threading.Thread(target=watch, args=(i,), daemon=True) for i in range(watchers)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(1.0)
    t0 = time.perf_counter()
    for i in range(0, events, 100):
        ops = [{"request_put": {"key": _b(b"w/%06d" % j), "value": _b(VALUE)}}
               for j in range(i, min(i + 100, events))]
        e.post(0, "/v3/kv/txn", {"success": ops})
    for t in threads:
        t.join(120)
    return sum(got) / (last[0] - t0)


# -- the run ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--page", type=int, default=1_000)
    ap.add_argument("--watchers", type=int, default=100)
    ap.add_argument("--events", type=int, default=2_000)
    ap.add_argument("--json", default=str(RESULTS / "kv_api.json"))
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    base = tempfile.mkdtemp(prefix="raftkv-kvapi-")
    try:
        with ProcCluster(os.path.join(base, "raftkv"), size=3) as c:
            c.start()
            c.wait_leader()
            client = c.client(timeout=60)
            for i in range(0, args.keys, 1000):
                client.batch([(b"s/%07d" % j, VALUE) for j in range(i, min(i + 1000, args.keys))])
            rows.append({"system": "raftkv", "scan_keys_per_s": raftkv_scan(client, args.page),
                         "watch_events_per_s": raftkv_watch(
                             [n.endpoint for n in c.nodes.values()], client,
                             args.watchers, args.events)})
        if shutil.which("etcd") is None:
            print("etcd is not on PATH (apt-get install etcd-server): its row is skipped",
                  file=sys.stderr)
        else:
            e = Etcd(os.path.join(base, "etcd"))
            try:
                etcd_load(e, args.keys)
                rows.append({"system": "etcd", "scan_keys_per_s": etcd_scan(e, args.page),
                             "watch_events_per_s": etcd_watch(e, args.watchers, args.events)})
            finally:
                e.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{'system':8} {'scan keys/s':>12} {'watch events/s':>15}   "
          f"({args.keys} keys, page {args.page}; {args.watchers} watchers x {args.events})")
    for r in rows:
        print(f"{r['system']:8} {r['scan_keys_per_s']:12,.0f} {r['watch_events_per_s']:15,.0f}")
    if len(rows) == 2:
        for k in ("scan_keys_per_s", "watch_events_per_s"):
            print(f"raftkv/etcd {k}: {rows[0][k] / rows[1][k]:.2f}")
    out = {"params": vars(args), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, k, title in ((axes[0], "scan_keys_per_s", "scan (keys/s)"),
                             (axes[1], "watch_events_per_s",
                              f"watch fan-out, {args.watchers} watchers (events/s)")):
            ax.bar([r["system"] for r in rows], [r[k] for r in rows])
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(Path(args.json).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
