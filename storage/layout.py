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
    path = os.path.join(data_dir, NODE_ID_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None
