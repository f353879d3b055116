"""Helpers of ``benchmarks.recovery_e2e``: write probes, loaders, status pollers, and the
parsing of raftkv's ``startup:`` log lines. Nothing here is timed by itself."""

from __future__ import annotations

import base64
import compileall
import http.client
import json
import re
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

VALUE = b"v" * 100
PROBE_EVERY = 0.02
PROBE_CAP = 0.1  # the longest wait between a table probe's attempts at one partition
Attempt = Callable[[http.client.HTTPConnection], bool]


def compile_bytecode() -> None:
    """Compile raftkv's bytecode where it is missing or stale, as pip does when it installs
    a wheel. A checkout installed editable under ``PYTHONDONTWRITEBYTECODE`` (this CI
    image sets it) never caches it, so each node would compile the package at start: CPU
    no installed node spends, and a start-up benchmark must not count."""
    root = Path(__file__).resolve().parent.parent
    for package in ("raftkv", "storage", "recovery"):
        compileall.compile_dir(root / package, quiet=1)


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def first_write(targets: list[tuple[int, Attempt]], t0: float, limit: float = 60.0) -> float:
    """Seconds from ``t0`` until one of the probes (port, attempt) is acknowledged; every
    target is tried each ``PROBE_EVERY`` seconds, each attempt on a fresh connection with a
    1 s timeout, in its own thread."""
    done = threading.Event()
    when: list[float] = []

    def probe(port: int, attempt: Attempt) -> None:
        while not done.is_set() and time.perf_counter() - t0 < limit:
            start = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            try:
                if attempt(conn):
                    when.append(time.perf_counter())
                    done.set()
                    return
            except (OSError, http.client.HTTPException, ValueError):
                pass
            finally:
                conn.close()
            time.sleep(max(0.0, PROBE_EVERY - (time.perf_counter() - start)))

    threads = [threading.Thread(target=probe, args=t, daemon=True) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(limit + 2)
    if not when:
        raise RuntimeError(f"no write acknowledged within {limit}s")
    return min(when) - t0


class Seq:
    """A thread-safe counter for unique probe keys."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n


def raftkv_put(seq: Seq) -> Attempt:
    def attempt(conn: http.client.HTTPConnection) -> bool:
        conn.request("PUT", f"/v1/kv/probe-{seq.next()}", body=b"x")
        return conn.getresponse().status == 200
    return attempt


def etcd_put(seq: Seq) -> Attempt:
    def attempt(conn: http.client.HTTPConnection) -> bool:
        conn.request("POST", "/v3/kv/put", json.dumps({"key": b64(f"probe-{seq.next()}"),
                                                        "value": b64("x")}))
        r = conn.getresponse()
        return r.status == 200 and "header" in json.loads(r.read() or b"{}")
    return attempt


def pso_put(seq: Seq) -> Attempt:
    def attempt(conn: http.client.HTTPConnection) -> bool:
        conn.request("PUT", f"/kv/probe-{seq.next()}", body=b"x")
        return conn.getresponse().status == 200
    return attempt


def summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples": samples}


# -- writers ---------------------------------------------------------------------------------
def _parallel(n: int, threads: int, one: Callable[[http.client.HTTPConnection, int], None],
              port_of: Callable[[int], int]) -> float:
    """Items 0..n-1 split over ``threads`` workers, each on a keep-alive connection (to
    ``port_of(worker)``), retrying an item until it succeeds; the seconds taken."""
    nxt = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(w: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port_of(w), timeout=30)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n:
                break
            for attempt in range(50):
                try:
                    one(conn, i)
                    break
                except (OSError, http.client.HTTPException, RuntimeError) as e:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port_of(w), timeout=30)
                    if attempt == 49:
                        errors.append(e)
                    time.sleep(0.05)
        conn.close()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} writes failed, e.g. {errors[0]!r}")
    return time.perf_counter() - t0


def _check(r: http.client.HTTPResponse) -> bytes:
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
    return data


def raftkv_puts(port: int, prefix: str, n: int, threads: int = 64) -> float:
    """``n`` single PUTs (one Raft entry each) of 100-byte values."""
    def one(conn: http.client.HTTPConnection, i: int) -> None:
        conn.request("PUT", f"/v1/kv/{prefix}{i:09d}", body=VALUE)
        _check(conn.getresponse())
    return _parallel(n, threads, one, lambda w: port)


def etcd_puts(port: int, prefix: str, n: int, threads: int = 64) -> float:
    v = b64(VALUE)

    def one(conn: http.client.HTTPConnection, i: int) -> None:
        conn.request("POST", "/v3/kv/put", json.dumps({"key": b64(f"{prefix}{i:09d}"),
                                                        "value": v}))
        _check(conn.getresponse())
    return _parallel(n, threads, one, lambda w: port)


def raftkv_batches(port: int, prefix: str, keys: int, per: int, threads: int = 4) -> float:
    """``keys`` keys in batches of ``per`` (``POST /v1/batch``: one Raft entry each)."""
    import msgpack

    def one(conn: http.client.HTTPConnection, b: int) -> None:
        lo = b * per
        body = msgpack.packb([[f"{prefix}{j:09d}".encode(), VALUE]
                              for j in range(lo, min(lo + per, keys))], use_bin_type=True)
        conn.request("POST", "/v1/batch", body=body,
                     headers={"Content-Type": "application/x-msgpack"})
        _check(conn.getresponse())
    return _parallel(-(-keys // per), threads, one, lambda w: port)


def etcd_batches(port: int, prefix: str, keys: int, per: int, threads: int = 4) -> float:
    """``keys`` keys in txns of ``per`` puts (``POST /v3/kv/txn``; at most 128 by default)."""
    v = b64(VALUE)

    def one(conn: http.client.HTTPConnection, b: int) -> None:
        lo = b * per
        ops = [{"request_put": {"key": b64(f"{prefix}{j:09d}"), "value": v}}
               for j in range(lo, min(lo + per, keys))]
        conn.request("POST", "/v3/kv/txn", json.dumps({"success": ops}))
        _check(conn.getresponse())
    return _parallel(-(-keys // per), threads, one, lambda w: port)


# -- status ----------------------------------------------------------------------------------
def get_json(port: int, path: str, body: dict[str, Any] | None = None,
             timeout: float = 2.0) -> Any | None:
    """GET (or POST ``body``) and the JSON answer; None when down or not 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body))
        r = conn.getresponse()
        data = r.read()
        return json.loads(data) if r.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def raftkv_group(port: int, group: str = "default") -> dict[str, Any] | None:
    st = get_json(port, "/v1/cluster")
    return None if st is None else st["groups"].get(group)


def etcd_status(port: int) -> dict[str, Any] | None:
    """etcd's endpoint status (``raftIndex``, ``raftAppliedIndex``, ``leader``...), ints."""
    st = get_json(port, "/v3/maintenance/status", {})
    if st is None:
        return None
    for k in ("raftIndex", "raftAppliedIndex", "raftTerm", "leader", "dbSize"):
        if k in st:
            st[k] = int(st[k])
    st["member_id"] = int(st["header"]["member_id"])
    return dict(st)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"{what} not reached within {timeout}s")


# -- tables ----------------------------------------------------------------------------------
def table_probe_keys(partitions: int) -> list[bytes]:
    """One key per partition, in partition order (raftkv's own partition function)."""
    from raftkv.placement.assignments import partition_of

    keys: list[bytes | None] = [None] * partitions
    left, i = partitions, 0
    while left:
        k = b"probe-%d" % i
        p = partition_of(k, partitions)
        if keys[p] is None:
            keys[p] = k
            left -= 1
        i += 1
    return [k for k in keys if k is not None]


def every_partition_writable(table: str, keys: list[bytes], ports: dict[str, int], t0: float,
                             limit: float = 120.0, workers: int = 32) -> tuple[float, float]:
    """Seconds from ``t0`` until a PUT into every partition (its key from
    ``table_probe_keys``) has been acknowledged. Returns (the last partition's time, the
    median partition's). ``ports``: each node's id and HTTP port.

    The probe finds partitions as the partition-aware client does: one thread polls each
    node's ``GET /v1/tables/{t}/leaders`` every ``PROBE_EVERY`` s, and ``workers`` threads
    send each partition's PUT to the node last named for it (its leader, or a host that
    knows none yet and would forward the write), retrying a partition after a failure
    at ``PROBE_EVERY`` s, doubling to at most ``PROBE_CAP`` s, as a client backs off (about
    2,500-3,000 PUTs in a 256-partition restart). It used to retry every partition every
    10 ms from 32 threads, to any node: in one profiled restart the node spent two thirds
    of its GIL time in aiohttp answering those 503s (py-spy ``--gil``)."""
    by_node = dict(ports)
    leaders: dict[int, str] = {}
    tried: dict[int, float] = {}  # partition: when it may be tried again
    backoff: dict[int, float] = {}
    pending = set(range(len(keys)))
    got: dict[int, float] = {}
    lock = threading.Lock()
    done = threading.Event()

    def poll_routes() -> None:
        conns: dict[int, http.client.HTTPConnection] = {}
        while not done.is_set() and time.perf_counter() - t0 < limit:
            start = time.perf_counter()
            for port in by_node.values():
                conn = conns.get(port) or http.client.HTTPConnection("127.0.0.1", port,
                                                                     timeout=1)
                conns[port] = conn
                try:
                    conn.request("GET", f"/v1/tables/{quote(table)}/leaders")
                    r = conn.getresponse()
                    body = r.read()
                    named = json.loads(body)["leaders"] if r.status == 200 else []
                except (OSError, http.client.HTTPException, ValueError, KeyError):
                    conn.close()
                    conns.pop(port, None)
                    continue
                with lock:
                    for p, lead in enumerate(named):
                        if isinstance(lead, str) and lead in by_node and p in pending:
                            leaders[p] = lead
            done.wait(max(0.0, PROBE_EVERY - (time.perf_counter() - start)))
        for c in conns.values():
            c.close()

    def next_partition() -> tuple[int, int] | None:
        now = time.perf_counter()
        with lock:
            for p in pending:
                if p in leaders and now >= tried.get(p, 0.0):
                    pending.discard(p)  # this worker's until it answers
                    return p, by_node[leaders[p]]
        return None

    def work() -> None:
        conns: dict[int, http.client.HTTPConnection] = {}
        while not done.is_set() and time.perf_counter() - t0 < limit:
            job = next_partition()
            if job is None:
                time.sleep(PROBE_EVERY / 4)
                continue
            p, port = job
            ok = False
            conn = conns.get(port) or http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conns[port] = conn
            try:
                conn.request("PUT", f"/v1/tables/{table}/kv/{quote(keys[p])}", body=b"x")
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conns.pop(port, None)
            with lock:
                if ok:
                    got[p] = time.perf_counter() - t0
                    if len(got) == len(keys):
                        done.set()
                else:
                    backoff[p] = min(2 * backoff.get(p, PROBE_EVERY / 2), PROBE_CAP)
                    tried[p] = time.perf_counter() + backoff[p]
                    leaders.pop(p, None)
                    pending.add(p)
        for c in conns.values():
            c.close()

    ts = [threading.Thread(target=poll_routes, daemon=True)]
    ts += [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(limit + 5)
    if len(got) < len(keys):
        raise RuntimeError(f"{len(keys) - len(got)} partitions not writable within {limit}s")
    times = sorted(got.values())
    return times[-1], statistics.median(times)


# -- raftkv's startup log line ---------------------------------------------------------------
_STARTUP = re.compile(r"startup: (.*?) seconds after the process started")
# The default group's line, as ``serve`` logs it (the metastore's follows, unprefixed).
_RECOVERY = re.compile(r"raftkv\.serve: (recovery: .*)")


def startup_phases(text: str) -> dict[str, float] | None:
    """The last ``startup:`` line of a node's log: {phase: seconds since process start}."""
    found = _STARTUP.findall(text)
    if not found:
        return None
    out = {}
    for part in found[-1].split(", "):
        name, _, value = part.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def last_recovery_line(text: str) -> str | None:
    """The default group's last ``recovery:`` line: where its state store reopened and
    what it replayed from the log (up to the commit index the log had stored; entries
    committed after that are applied once the new leader commits again)."""
    found = _RECOVERY.findall(text)
    return found[-1] if found else None


def phase_summary(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median, min and max of each phase over the (restart, node) samples."""
    out: dict[str, dict[str, float]] = {}
    for phase in ("imported", "opened", "elected", "committed", "http"):
        xs = [s[phase] for s in samples if phase in s]
        if xs:
            out[phase] = {"median_s": statistics.median(xs), "min_s": min(xs),
                          "max_s": max(xs), "n": len(xs)}
    return out
