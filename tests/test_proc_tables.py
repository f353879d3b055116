"""Tables on real ``raftkv serve`` processes: create, route keys, describe, grow the cluster.

Three founders host the metastore (voters) and the default group; a fourth node starts
with ``--join`` and is added to the placement topology with ``POST /v1/cluster/nodes``
(``ProcCluster.add_table_node``), which rebalances every table onto it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raftkv.client import Client, ClientError
from raftkv.placement.assignments import calc_assignments
from raftkv.testing.procs import ProcCluster

TABLE, PARTS = "users", 8


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path), size=3, tick=0.02) as c:
        c.start()
        yield c


def _describe(c: Client) -> dict[str, Any]:
    return c.describe_table(TABLE)


def _converged(d: dict[str, Any], nodes: list[str], replicas: int) -> bool:
    for p in d["partitions"]:
        want = calc_assignments(TABLE, p["partition"], nodes, replicas)
        if (p["stable"] != want or p["pending"] or p["planned"] or p["leader"] is None
                or p["voters"] != want or p["learners"]):
            return False
    return True


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last is True:
                return
        except (ClientError, OSError) as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout}s; last: {last!r}")


def test_tables_route_describe_errors_and_a_fourth_node(cluster: ProcCluster) -> None:
    ids = ["n1", "n2", "n3"]
    clients = {i: cluster.client([i]) for i in ids}
    admin = cluster.client()
    created = admin.create_table(TABLE, PARTS, 3)
    assert created == {"name": TABLE, "partitions": PARTS, "replicas": 3,
                       "storage": "persistent"}
    assert [t["name"] for t in cluster.client(["n3"]).list_tables()] == [TABLE]
    _wait(lambda: _converged(_describe(admin), ids, 3), 20, "leaders for every partition")
    d = _describe(clients["n2"])
    assert len(d["partitions"]) == PARTS
    for p in d["partitions"]:
        assert p["stable"] == ids and p["leader"] in ids

    data = {f"key-{i:03d}": f"value-{i}" for i in range(200)}
    for i, (k, v) in enumerate(data.items()):
        clients[ids[i % 3]].put(k, v, table=TABLE)
    for i, (k, v) in enumerate(data.items()):
        assert clients[ids[(i + 1) % 3]].get(k, table=TABLE) == v.encode()
    assert admin.get("key-000") is None  # the default group is a separate keyspace
    admin.delete("key-199", table=TABLE)
    assert admin.get("key-199", table=TABLE) is None
    del data["key-199"]

    with pytest.raises(ClientError) as e:
        admin.put("x", "y", table="nope")
    assert e.value.status == 404 and "unknown table" in e.value.body["error"]
    with pytest.raises(ClientError) as e:
        admin.describe_table("nope")
    assert e.value.status == 404
    with pytest.raises(ClientError) as e:
        admin.create_table("big", 2, 4)
    assert e.value.status == 400 and "exceeds" in e.value.body["error"]
    with pytest.raises(ClientError) as e:
        admin.create_table("bad.name", 2, 1)
    assert e.value.status == 400
    with pytest.raises(ClientError) as e:
        admin.create_table(TABLE, 2, 1)
    assert e.value.status == 409
    with pytest.raises(ClientError) as e:
        admin.set_replicas(TABLE, 4)
    assert e.value.status == 400
    with pytest.raises(ClientError) as e:
        admin.drop_table(TABLE)
    assert e.value.status == 501

    all4 = [*ids, "n4"]
    moving = [p for p in range(PARTS) if calc_assignments(TABLE, p, all4, 3) != ids]
    assert moving
    cluster.add_table_node("n4")
    _wait(lambda: _converged(_describe(admin), all4, 3), 40, "the rebalance onto n4")
    d = _describe(cluster.client(["n4"]))
    assert not d["errors"], d["errors"]
    assert sum("n4" in p["stable"] for p in d["partitions"]) == len(moving)
    n4 = cluster.client(["n4"])
    for i, (k, v) in enumerate(data.items()):
        c = n4 if i % 2 else clients[ids[i % 3]]
        assert c.get(k, table=TABLE) == v.encode()
    n4.put("after", "growth", table=TABLE)
    assert clients["n1"].get("after", table=TABLE) == b"growth"
    for c in [*clients.values(), admin, n4]:
        c.close()
