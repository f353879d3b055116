"""The placement catalog in the metastore: table descriptors, the logical topology, node
addresses, and the names derived from them (partition group ids, assignment keys).

Metastore layout (next to the per-partition keys of ``assignments.partition_keys``)::

    placement.tables.<name>     TableDescriptor as JSON (the seed's ``<tableScope>``;
                                its ``replicas`` field is the rebalance trigger)
    placement.nodes             the logical topology: sorted, comma-separated node ids
    placement.address.<node>    the node's raft address ("host:port")
    placement.incarnation.<node>  a random id, rewritten by each start of the node's manager
    placement.holds.<name>.<p>.<node>  the incarnation in which <node> started hosting
                                partition <p> (IGNITE-16668: who holds the state)
    placement.liveness.<node>   the node's liveness record (``liveness.LivenessRecord``)
    placement.dead              the nodes declared dead: excluded from the data nodes
    placement.draining          nodes being drained (``raftkv cluster drain``)
    placement.settings          cluster-wide placement settings (``ClusterSettings``)
    <name>.<p>.assignments.stable|pending|planned, <name>.<p>.change.trigger.revision,
    <name>.<p>.assignments.switch.reduce|switch.append (IGNITE-16668, see safe_restart.py)

A table's ``initial`` assignments are kept in its descriptor because they are the
*founding* configuration of each partition's Raft group: every founding member bootstraps
the identical entry 1 from them, and a node that is not a founder must join empty (a
different entry 1 on a joiner would conflict with the leader's committed entry 1).

Table names are ``[A-Za-z0-9_-]{1,64}``: they appear in metastore keys (split on ".") and
in group ids, which become directory names (``raftkv.storage.layout.group_paths``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from raftkv.placement.assignments import calc_assignments

TABLES_PREFIX = b"placement.tables."
TOPOLOGY_KEY = b"placement.nodes"
ADDRESS_PREFIX = b"placement.address."
PERSISTENT, MEMORY = "persistent", "memory"
STORAGE_KINDS = (PERSISTENT, MEMORY)
MAX_PARTITIONS = 4096  # one invoke writes a table's descriptor and every stable key

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NODE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_PARTITION_KEY = re.compile(
    rb"(?P<table>[A-Za-z0-9_-]{1,64})\.(?P<p>[0-9]{1,9})\."
    rb"(?P<field>assignments\.stable|assignments\.pending|assignments\.planned"
    rb"|assignments\.removing|assignments\.applied|assignments\.epoch"
    rb"|assignments\.switch\.reduce|assignments\.switch\.append|change\.trigger\.revision)"
)
# The field names of PartitionKeys, by key suffix.
FIELDS = {
    b"assignments.stable": "stable", b"assignments.pending": "pending",
    b"assignments.planned": "planned", b"change.trigger.revision": "trigger",
    b"assignments.removing": "removing", b"assignments.applied": "applied",
    b"assignments.epoch": "epoch",
    b"assignments.switch.reduce": "switch_reduce", b"assignments.switch.append": "switch_append",
}
INCARNATION_PREFIX = b"placement.incarnation."
HOLDS_PREFIX = b"placement.holds."
LIVENESS_PREFIX = b"placement.liveness."
DEAD_KEY = b"placement.dead"
DRAINING_KEY = b"placement.draining"
SETTINGS_KEY = b"placement.settings"


def check_table_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"table names are 1-64 of [A-Za-z0-9_-], got {name!r}")
    return name


def check_node_id(node: object) -> str:
    if not isinstance(node, str) or not _NODE.fullmatch(node) or "," in node:
        raise ValueError(f"node ids are 1-128 of [A-Za-z0-9_.:-], got {node!r}")
    return node


@dataclass(frozen=True)
class TableDescriptor:
    name: str
    partitions: int
    replicas: int
    storage: str
    # Per partition, the founding voters of its Raft group (sorted).
    initial: tuple[tuple[str, ...], ...]

    @classmethod
    def new(cls, name: str, partitions: int, replicas: int, storage: str,
            nodes: list[str]) -> TableDescriptor:
        check_table_name(name)
        if type(partitions) is not int or not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}, got {partitions!r}")
        if type(replicas) is not int or replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas!r}")
        if storage not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {STORAGE_KINDS}, got {storage!r}")
        if not nodes:
            raise ValueError("no logical topology yet: call set_nodes first")
        initial = tuple(
            tuple(calc_assignments(name, p, nodes, replicas)) for p in range(partitions)
        )
        return cls(name, partitions, replicas, storage, initial)

    def with_replicas(self, replicas: int) -> TableDescriptor:
        if type(replicas) is not int or replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas!r}")
        return replace(self, replicas=replicas)

    def encode(self) -> bytes:
        return json.dumps({
            "name": self.name, "partitions": self.partitions, "replicas": self.replicas,
            "storage": self.storage, "initial": [list(a) for a in self.initial],
        }, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TableDescriptor:
        """Strict: ValueError on anything that is not a descriptor we wrote."""
        try:
            d: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed table descriptor: {e}") from None
        if not isinstance(d, dict) or set(d) != {"name", "partitions", "replicas", "storage",
                                                  "initial"}:
            raise ValueError("malformed table descriptor: unexpected fields")
        name, parts, replicas, storage, initial = (
            d["name"], d["partitions"], d["replicas"], d["storage"], d["initial"])
        check_table_name(name)
        if (type(parts) is not int or not 1 <= parts <= MAX_PARTITIONS
                or type(replicas) is not int or replicas < 1 or storage not in STORAGE_KINDS
                or not isinstance(initial, list) or len(initial) != parts
                or not all(isinstance(a, list) and a and all(isinstance(n, str) for n in a)
                           for a in initial)):
            raise ValueError(f"malformed table descriptor for {name!r}")
        return cls(name, parts, replicas, storage, tuple(tuple(a) for a in initial))


def table_key(name: str) -> bytes:
    return TABLES_PREFIX + check_table_name(name).encode()


def address_key(node: str) -> bytes:
    return ADDRESS_PREFIX + check_node_id(node).encode()


def partition_group(table: str, partition: int) -> str:
    """The Raft group id of a partition (also its directory name under ``groups/``)."""
    return f"t.{table}.{partition}"


def partition_wire_id(group: str, generation: int) -> str:
    """The id a partition group's frames carry between nodes: its group id and its
    table's generation (the descriptor's create revision), so that a table dropped and
    created again under the same name never exchanges a message with the old one, from a
    node that lags the drop (``Node.add_group``'s ``wire_id``)."""
    return f"{group}@{generation}"


class PartitionField(NamedTuple):
    table: str
    partition: int
    field: str  # a PartitionKeys field, or "switch_reduce" | "switch_append"


def parse_partition_key(key: bytes) -> PartitionField | None:
    m = _PARTITION_KEY.fullmatch(key)
    if m is None:
        return None
    return PartitionField(m["table"].decode(), int(m["p"]), FIELDS[m["field"]])


def liveness_key(node: str) -> bytes:
    return LIVENESS_PREFIX + check_node_id(node).encode()


def incarnation_key(node: str) -> bytes:
    return INCARNATION_PREFIX + check_node_id(node).encode()


def holds_prefix(table: str, partition: int) -> bytes:
    return HOLDS_PREFIX + f"{check_table_name(table)}.{partition}.".encode()


def holds_key(table: str, partition: int, node: str) -> bytes:
    return holds_prefix(table, partition) + check_node_id(node).encode()
