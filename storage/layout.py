"""The on-disk layout of a node's data directory, shared by the node and the offline tools.

    DATA_DIR/node_id                  the owning node's id (a guard against mix-ups)
    DATA_DIR/LOCK                     fcntl-locked by the process running the node
    DATA_DIR/peers.json               raft addresses learned at runtime
    DATA_DIR/groups/<group>/log       the group's Raft log (LmdbLogStore)
    DATA_DIR/groups/<group>/state     the group's state machine (LmdbStateStore)
    DATA_DIR/partition-logs           the Raft logs of every table partition hosted here,
                                      in one shared LMDB environment (LogEnv); their
                                      groups/<group> directories hold no log
"""

from __future__ import annotations

import os

NODE_ID_FILE = "node_id"
# The cluster the node belongs to, in hex (raftkv.node.stores: where ids come from).
CLUSTER_ID_FILE = "cluster_id"
MAX_CLUSTER_ID_BYTES = 64
LOCK_FILE = "LOCK"
DEFAULT_GROUP = "default"
# The placement metastore's group (its state store is a MetaStore, not a KV store).
META_GROUP = "meta"


def group_paths(data_dir: str, group: str) -> tuple[str, str]:
    base = os.path.join(data_dir, "groups", group)
    return os.path.join(base, "log"), os.path.join(base, "state")


def partition_logs_path(data_dir: str) -> str:
    return os.path.join(data_dir, "partition-logs")


def read_node_id(data_dir: str) -> str | None:
    """The id in ``node_id``, or None if the file is missing or empty. ``ValueError``
    naming the file if it is not text."""
    path = os.path.join(data_dir, NODE_ID_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is damaged: not a node id ({e.reason} at byte "
                         f"{e.start})") from None


def read_cluster_id(data_dir: str) -> bytes:
    """The id in ``cluster_id`` (b"" if the file is missing or empty: not known yet).
    ``ValueError`` naming the file if it is not a hex id."""
    path = os.path.join(data_dir, CLUSTER_ID_FILE)
    if not os.path.exists(path):
        return b""
    with open(path, "rb") as f:
        raw = f.read().strip()
    try:
        cid = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        cid = b"\0" * (MAX_CLUSTER_ID_BYTES + 1)
    if len(cid) > MAX_CLUSTER_ID_BYTES:
        raise ValueError(f"{path} is damaged: not a cluster id (hex, at most "
                         f"{MAX_CLUSTER_ID_BYTES} bytes)")
    return cid


def holds_node_data(data_dir: str) -> bool:
    """Whether the directory holds some group's files or the partitions' logs: the data
    a node writes only after its ``node_id``."""
    groups = os.path.join(data_dir, "groups")
    return ((os.path.isdir(groups) and bool(os.listdir(groups)))
            or os.path.exists(partition_logs_path(data_dir)))
