"""What the Spark jobs need to know about a raftkv cluster and table, asked once on the
driver before any Spark work starts, so a bad table name or an unreachable cluster fails
before a single row is read or written.

The view also carries the bearer token the driver resolved (``token=``, else
``RAFTKV_TOKEN`` or ``RAFTKV_TOKEN_FILE`` on the driver: ``raftkv.client.resolve_token``),
and every client a task opens uses it: an executor on another machine needs neither the
driver's environment nor its files. It travels to the executors inside the serialized
task, as everything a task uses does (encrypt Spark's RPC, ``spark.network.crypto.enabled``,
when that link is not trusted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raftkv.client import Client, ClientError, Unavailable, resolve_token


class SparkJobError(Exception):
    """A load or verify cannot run: bad input, unknown table, unreachable cluster. Raised on
    the driver before any write, with a message meant for the user."""


@dataclass(frozen=True)
class PartitionInfo:
    partition: int
    leader: str | None
    replicas: tuple[str, ...]  # stable members and nodes hosting a replica, sorted


@dataclass(frozen=True)
class TableView:
    table: str
    partitions: tuple[PartitionInfo, ...]
    http: dict[str, str]  # node id -> host:port of its HTTP API
    endpoints: tuple[str, ...]  # what the caller gave, for fallbacks
    token: str | None = field(default=None, repr=False)  # never printed

    def client(self, endpoints: list[str], timeout: float) -> Client:
        """A client of ``endpoints`` with the job's credentials."""
        return Client(endpoints, timeout=timeout, token=self.token)

    def endpoints_for(self, partition: int) -> list[str]:
        """The partition's leader first, then its other replicas, then every other node:
        a write sent to a follower is forwarded, so any of them works, the leader best."""
        info = self.partitions[partition]
        order = ([info.leader] if info.leader else []) + list(info.replicas)
        out: list[str] = []
        for n in order:
            addr = self.http.get(n)
            if addr and addr not in out:
                out.append(addr)
        for addr in list(self.http.values()) + list(self.endpoints):
            if addr not in out:
                out.append(addr)
        return out


def endpoints_of(cluster: str | list[str]) -> list[str]:
    eps = [e for e in cluster.split(",") if e] if isinstance(cluster, str) else list(cluster)
    if not eps:
        raise SparkJobError("no cluster endpoint given (host:port of any raftkv serve node)")
    return eps


def table_view(cluster: str | list[str], table: str, timeout: float = 10.0,
               connect_timeout: float | None = None, token: str | None = None) -> TableView:
    eps = endpoints_of(cluster)
    try:
        token = resolve_token(token)
    except ValueError as e:
        raise SparkJobError(str(e)) from None
    client = Client(eps, timeout=timeout, connect_timeout=connect_timeout, token=token)
    try:
        d: dict[str, Any] = client.describe_table(table)
    except ClientError as e:
        if e.status == 404:
            raise SparkJobError(f"unknown table {table!r} on the cluster at "
                                f"{', '.join(eps)}") from None
        raise SparkJobError(f"the cluster refused to describe {table!r}: {e}") from None
    except Unavailable as e:
        raise SparkJobError(f"the cluster at {', '.join(eps)} is unreachable: {e}") from None
    finally:
        client.close()
    parts = tuple(
        PartitionInfo(p["partition"], p.get("leader"),
                      tuple(sorted(set(p.get("stable") or []) | set(p.get("hosted_on") or []))))
        for p in sorted(d["partitions"], key=lambda p: p["partition"]))
    return TableView(table, parts, dict(d.get("http") or {}),
                     tuple(e.split("://", 1)[-1] for e in eps), token)
