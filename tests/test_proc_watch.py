"""Watch against real ``raftkv serve`` processes (``raftkv.server.watch_ops``).

A watcher connected to the leader sees every committed change of its range exactly once,
in revision order, through a SIGKILL of that node and its restart: ``Client.watch``
resumes on another node from the last revision it read whole. The expected history is
built from the writes' own answers (each write's index is its revision), including a
compare-and-set that failed (no event) and one that swapped, a transaction and a batch.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from raftkv.client import Client, ClientError
from raftkv.testing.procs import ProcCluster


@pytest.fixture
def cluster(proc_cluster: ProcCluster) -> ProcCluster:
    return proc_cluster


def _writes(c: Client, lo: int, hi: int) -> list[tuple[int, str, bytes, bytes | None]]:
    """Writes of several kinds under w/ (and one outside); the events they must cause."""
    want: list[tuple[int, str, bytes, bytes | None]] = []
    for i in range(lo, hi):
        key, value = b"w/%03d" % i, b"v%d" % i
        want.append((c.put(key, value), "put", key, value))
    c.put(b"elsewhere", b"not watched")
    ok, index = c.cas(b"w/%03d" % lo, b"wrong", b"never")
    assert not ok
    ok, index = c.cas(b"w/%03d" % lo, None, b"swapped", prev_index=want[0][0])
    assert ok
    want.append((index, "put", b"w/%03d" % lo, b"swapped"))
    answer = c.txn(compare=[{"key": f"w/{lo:03d}", "target": "value", "op": "==",
                             "operand": "swapped"}],
                   success=[{"delete": {"key": f"w/{lo + 1:03d}"}},
                            {"put": {"key": f"w/{lo + 2:03d}", "value": "t"}}])
    assert answer["succeeded"]
    want += [(answer["index"], "delete", b"w/%03d" % (lo + 1), None),
             (answer["index"], "put", b"w/%03d" % (lo + 2), b"t")]
    return want


def test_a_watcher_sees_every_change_once_in_order_through_a_leader_kill(
        cluster: ProcCluster) -> None:
    leader = cluster.wait_leader()
    order = [leader] + [n for n in cluster.nodes if n != leader]
    watcher = Client([cluster.nodes[n].endpoint for n in order], timeout=5)
    got: list[tuple[int, str, bytes, bytes | None]] = []
    done = threading.Event()
    failed: list[BaseException] = []
    expected_last = [0]

    def watch() -> None:
        try:
            for revision, events in watcher.watch(prefix="w/", from_revision=1):
                got.extend((revision, e["type"], e["key"], e.get("value")) for e in events)
                if expected_last[0] and revision >= expected_last[0]:
                    break
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            failed.append(e)
        finally:
            done.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    writer = cluster.client()
    want = _writes(writer, 0, 20)
    cluster.wait_until(lambda: len(got) >= len(want), 20, "the first writes watched")
    cluster.kill(leader)  # the node the watcher reads from
    cluster.wait_leader([n for n in cluster.nodes if n != leader])
    want += _writes(cluster.client([n for n in cluster.nodes if n != leader]), 20, 40)
    cluster.start(leader)
    want += _writes(cluster.client(), 40, 50)
    expected_last[0] = max(r for r, *_ in want)
    assert done.wait(60), f"the watcher saw {len(got)} of {len(want)} events"
    assert not failed, failed
    assert got == sorted(want, key=lambda w: w[0])  # every event once, in revision order
    watcher.close()


def test_a_compacted_or_bad_revision_is_refused(cluster: ProcCluster) -> None:
    c = cluster.client()
    c.put("k", "v")
    index = c.put("k", "w")
    for future in (1 << 40, index + 50):
        with pytest.raises(ClientError) as e:
            next(c.watch(prefix="k", from_revision=future))
        assert e.value.status == 400 and "in the future" in str(e.value.body)
    import http.client
    import json
    n = cluster.nodes[cluster.wait_leader()]
    for query, want in (("?prefix=k&from_revision=0", "from_revision"),
                        ("?prefix=k&from_revision=x", "from_revision"),
                        ("?start=b&end=a", "inverted"), ("", "needs ?prefix"),
                        ("?prefix=k&since=3", "unknown query parameter")):
        conn = http.client.HTTPConnection("127.0.0.1", n.http_port, timeout=10)
        conn.request("GET", "/v1/watch" + query)
        r = conn.getresponse()
        assert r.status == 400 and want in json.loads(r.read())["error"], query
        conn.close()


def test_the_cli_watch(cluster: ProcCluster) -> None:
    import json
    import subprocess
    import sys
    c = cluster.client()
    first = c.put("cli/a", "1")
    c.delete("cli/a")
    ends = ",".join(n.endpoint for n in cluster.nodes.values())
    res = subprocess.run([sys.executable, "-m", "raftkv.cli", "--endpoints", ends, "-w", "json",
                          "watch", "--prefix", "cli/", "--from-revision", str(first),
                          "--count", "2"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [(x["type"], x["key"]) for x in lines] == [("put", "cli/a"), ("delete", "cli/a")]
    assert lines[0]["revision"] == first and lines[0]["value"] == "1"


def test_a_revision_below_the_compaction_point_is_a_410(tmp_path: Path) -> None:
    with ProcCluster(str(tmp_path), size=3, tick=0.02,
                     extra_args=["--compact-entries", "40", "--compact-keep", "5"]) as c:
        c.start()
        c.wait_leader()
        client = c.client()
        last = 0
        for i in range(150):
            last = client.put(f"k{i}", "v")
        # Compaction runs on each node's own timer (once a second), so the first
        # revision is refused only after the serving node's next round.
        deadline = time.monotonic() + 20
        while True:
            try:
                next(client.watch(prefix="k", from_revision=1))
            except ClientError as e:
                assert e.status == 410, e
                oldest = int(e.body["oldest_revision"])
                break
            assert time.monotonic() < deadline, "the log was never compacted"
            time.sleep(0.2)
        assert 1 < oldest <= last
        rev, events = next(client.watch(prefix="k", from_revision=oldest))
        assert oldest <= rev <= last and events
