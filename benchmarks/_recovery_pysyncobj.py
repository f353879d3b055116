"""PySyncObj's side of ``benchmarks.recovery_e2e``: a 3-process PySyncObj 0.3.17 cluster
(its stock ``ReplDict`` and ``FileJournal``) behind a tiny HTTP front, so that it can be
crashed, restarted and probed like raftkv and etcd.

Each peer process (``python -m benchmarks._recovery_pysyncobj DIR HTTP_PORT SELF
PARTNER...``) constructs ``SyncObj(SELF, PARTNERS, conf, consumers=[ReplDict()])`` with
``journalFile=DIR/journal`` and PySyncObj's defaults otherwise (autoTick on, its election
timeouts 0.4..1.4 s), except that log compaction is pushed out of reach
(``logCompactionMinEntries``, ``logCompactionMinTime`` huge): with a journal but no full
dump file, PySyncObj's compaction drops the journal prefix into memory only, and a
restart would come back without those keys. So a restart replays its whole journal,
which is PySyncObj's recovery with a journal. (FileJournal writes through ``mmap``
and never fsyncs.) Then, and only then, it serves (stdlib ``ThreadingHTTPServer``):

- ``PUT /kv/<key>``: ``ReplDict.set(key, body, sync=True, timeout=1)``: 200 once
  committed and applied on this node (a follower forwards to the leader), else 503;
- ``POST /load?start=S&n=N&per=P&window=W``: N keys from S as ``ReplDict.update`` of P
  keys each (one log entry each, as raftkv's batch and etcd's txn), at most W in flight;
- ``GET /status``: ``SyncObj.getStatus()`` plus ``keys``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

ROOT = Path(__file__).resolve().parent.parent
VALUE = "v" * 100


def serve(directory: str, http_port: int, me: str, partners: list[str]) -> None:
    from pysyncobj import SyncObj, SyncObjConf
    from pysyncobj.batteries import ReplDict

    os.makedirs(directory, exist_ok=True)
    d = ReplDict()
    conf = SyncObjConf(journalFile=os.path.join(directory, "journal"),
                       logCompactionMinEntries=1 << 62, logCompactionMinTime=1e12,
                       dynamicMembershipChange=False)
    node = SyncObj(me, partners, conf, consumers=[d])

    def load(start: int, n: int, per: int, window: int) -> dict[str, Any]:
        slots = threading.Semaphore(window)
        done = threading.Event()
        left = [-(-n // per)]
        failures: list[int] = []
        lock = threading.Lock()

        def callback(_result: Any, error: int) -> None:
            with lock:
                if error != 0:
                    failures.append(error)
                left[0] -= 1
                if left[0] == 0:
                    done.set()
            slots.release()

        t0 = time.perf_counter()
        for lo in range(start, start + n, per):
            slots.acquire()
            d.update({f"k{j:09d}": VALUE for j in range(lo, min(lo + per, start + n))},
                     callback=callback)
        done.wait()
        return {"seconds": time.perf_counter() - t0, "failures": len(failures)}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, code: int, doc: Any) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                d.set(self.path[len("/kv/"):], body.decode(), sync=True, timeout=1.0)
            except Exception as e:  # noqa: BLE001 - any failure is a 503 for the probe
                self._answer(503, {"error": repr(e)})
                return
            self._answer(200, {"ok": True})

        def do_POST(self) -> None:
            q = {k: int(v[0]) for k, v in parse_qs(urlparse(self.path).query).items()}
            self._answer(200, load(q["start"], q["n"], q.get("per", 1000),
                                   q.get("window", 50)))

        def do_GET(self) -> None:
            st = node.getStatus()
            st["keys"] = len(d)
            st["leader"] = None if st["leader"] is None else str(st["leader"])
            st["self"] = str(st["self"])
            self._answer(200, {k: v for k, v in st.items()
                               if isinstance(v, (int, float, str, bool, type(None)))})

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", http_port), Handler).serve_forever()


class PsoCluster:
    """Three peer processes on 127.0.0.1 (SIGKILLed by ``kill``, restarted on their
    journals by ``start``)."""

    def __init__(self, base: str) -> None:
        from raftkv.testing.procs import free_ports

        ports = free_ports(6)
        self.http_ports, raft = ports[:3], ports[3:]
        addrs = [f"127.0.0.1:{p}" for p in raft]
        self.cmds = [[sys.executable, "-m", "benchmarks._recovery_pysyncobj",
                      os.path.join(base, f"p{i}"), str(self.http_ports[i]), addrs[i],
                      *[a for j, a in enumerate(addrs) if j != i]] for i in range(3)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * 3

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        for i, cmd in enumerate(self.cmds):
            self.procs[i] = subprocess.Popen(cmd, cwd=ROOT, env=env,
                                             stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    def status(self, i: int) -> dict[str, Any] | None:
        from benchmarks._recovery_common import get_json

        return get_json(self.http_ports[i], "/status", timeout=5)  # type: ignore[no-any-return]

    def leader(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(3):
                st = self.status(i)
                if st and st.get("state") == 2:  # _RAFT_STATE.LEADER
                    return i
            time.sleep(0.1)
        raise RuntimeError("PySyncObj has no leader")

    def load(self, keys: int, per: int = 1000) -> float:
        from benchmarks._recovery_common import get_json

        lead = self.leader()
        got = get_json(self.http_ports[lead], f"/load?start=0&n={keys}&per={per}", {},
                       timeout=3600)
        if not got or got["failures"]:
            raise RuntimeError(f"PySyncObj load failed: {got}")
        return float(got["seconds"])

    def settle(self, keys: int, timeout: float = 600.0) -> None:
        """Every peer holds ``keys`` keys and has applied its commit index; then 1.2 s
        more, so that FileJournal's one-second timer has stored the commit index."""
        def done() -> bool:
            sts = [self.status(i) for i in range(3)]
            return all(s and s["keys"] >= keys and s["last_applied"] >= s["commit_idx"]
                       for s in sts)
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError("PySyncObj peers did not settle")
            time.sleep(0.2)
        time.sleep(1.2)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
