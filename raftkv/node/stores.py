"""Opening a group's stores: LMDB files in the data directory (``raftkv.storage.layout``), or memory.

**Cluster ids.** A node names its cluster in every handshake, and refuses a peer of
another (``raftkv.transport.handshake``, ``Transport.admit_cluster``). The id lives in the
data directory's ``cluster_id`` file, written once:

- ``snapshot restore`` gives the cluster it makes a random one (``new_cluster_id``): the
  restored cluster has the old one's node ids, addresses and secret, and a node started
  on its files from before the restore was taken back as a member of the new one
  (found from outside: it answered reads from the old data, and acknowledged writes
  were lost). Those files name no id, so the restored members refuse them;
- founders given ``--cluster-token`` (etcd's ``--initial-cluster-token``) derive it from
  the token (``founding_cluster_id``), so each writes the same one when its directory is
  made (``claim_data_dir``). Only from the token: founders may spell one another's
  addresses differently, and a wiped founder may come back with a later membership in
  its ``--peers`` (found in review: deriving it from ``--peers`` split such clusters);
- a node that joins (``--join``) names ``JOINING`` and adopts the first id it meets
  (``Node``, kept in the file). In a cluster with an id, a member that lost its files
  comes back with ``--join``.

Founders without a token, and directories from before ids, name none, and check only
that their peers name none either: a cluster founded again on an earlier one's ids and
addresses cannot tell a missed old directory from a member unless it is given a new
token (or the old directories are all deleted).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

from raftkv.node.group_storage import GroupStorage
from raftkv.recovery.compaction import CompactionPolicy
from raftkv.storage.dir_lock import lock_data_dir, release_data_dir
from raftkv.storage.durable_fs import makedirs_durable, write_durable
from raftkv.storage.errors import StorageError
from raftkv.storage.identity import new_incarnation
from raftkv.storage.layout import (
    CLUSTER_ID_FILE,
    NODE_ID_FILE,
    group_paths,
    holds_node_data,
    read_cluster_id,
    read_node_id,
)
from raftkv.storage.lmdb_log import LmdbLogStore, LogEnv
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.state_store import DEFAULT_CHECKPOINT_SECONDS, MemoryStateStore, StateStore
from raftkv.transport.handshake import JOINING

_log = logging.getLogger(__name__)


def founding_cluster_id(token: str) -> bytes:
    """The cluster id every founder given ``token`` (``--cluster-token``) derives alike;
    b"" (no id) without one (module docstring)."""
    if not token:
        return b""
    return hashlib.sha256(b"raftkv cluster\0" + token.encode()).digest()[:16]


def new_cluster_id() -> bytes:
    """A random cluster id, for a cluster made from a backup (module docstring)."""
    return os.urandom(16)


def keep_cluster_id(data_dir: str, cluster_id: bytes) -> None:
    """Write ``cluster_id`` into the directory's ``cluster_id`` file, durably, unless it
    names one already (an id is written once) or it is no id (b"", ``JOINING``)."""
    if cluster_id and cluster_id != JOINING and not read_cluster_id(data_dir):
        write_durable(os.path.join(data_dir, CLUSTER_ID_FILE),
                      (cluster_id.hex() + "\n").encode())


def claim_data_dir(data_dir: str, node_id: str, cluster_id: bytes = b"") -> None:
    """Create ``data_dir`` for ``node_id``, or check it already belongs to it: starting
    n2 on n1's files would make one node's votes and log appear under another's name.
    Then hold it for this process until ``release_data_dir`` (``lock_data_dir``): two
    processes on one directory would both append to its log and vote with its identity.
    A refused claim holds nothing. A directory made now names ``cluster_id`` (module
    docstring); one made before keeps what it names."""
    makedirs_durable(data_dir)
    lock_data_dir(data_dir)
    try:
        try:
            owner = read_node_id(data_dir)
        except ValueError as e:
            raise StorageError(str(e)) from None
        if owner is not None:
            if owner != node_id:
                raise StorageError(f"{data_dir} holds the data of node {owner!r}, not "
                                   f"of {node_id!r}")
            return
        if holds_node_data(data_dir):
            # node_id is written (durably) before anything else, so data without it is
            # damage from outside, and whose data it is cannot be told: taking it would
            # let this node vote and serve with another's log (found from outside: an
            # emptied node_id let n2 start on n1's files).
            raise StorageError(
                f"{data_dir} holds a node's data but its {NODE_ID_FILE} file is missing or "
                f"empty, so whose data it is cannot be told: write the owner's id into "
                f"{os.path.join(data_dir, NODE_ID_FILE)}, or move the directory away to "
                "start this node empty")
        # Its cluster before its name: a directory is made once node_id is written.
        keep_cluster_id(data_dir, cluster_id)
        # Durably (data, then name): after a power loss an empty or missing node_id would
        # let any node claim this directory, and its votes and log with it (issue 22).
        write_durable(os.path.join(data_dir, NODE_ID_FILE), (node_id + "\n").encode())
    except BaseException:
        release_data_dir(data_dir)
        raise


def _adopt_own_log(shared_log: LogEnv, group: str, log_path: str) -> None:
    """A data directory written before partition logs were shared keeps a partition's
    log in its own directory: move it into the shared environment (one transaction),
    then delete the directory. A crash in between leaves both, and the next open
    deletes the old copy, which the shared one already holds."""
    if not os.path.isdir(log_path):
        return
    if not shared_log.has(group):
        shared_log.adopt(group, log_path)
    shutil.rmtree(log_path)


def open_group_storage(
    data_dir: str | None, group: str, durable: bool = True,
    compaction: CompactionPolicy | None = None, state: StateStore | None = None,
    shared_log: LogEnv | None = None, checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS,
) -> GroupStorage:
    """LMDB files under ``data_dir``, or in-memory stores when it is None (nothing
    survives the process: such a node must rejoin as a new member). ``state`` replaces
    the KV state store (a custom state machine). With ``shared_log`` the group's log
    lives in that shared environment instead of a directory of its own.
    ``checkpoint_seconds`` is the KV state store's time policy (``CheckpointPolicy``)."""
    if data_dir is None:
        return GroupStorage(MemoryLogStore(new_incarnation()), state or MemoryStateStore(),
                            compaction)
    log_path, state_path = group_paths(data_dir, group)
    if shared_log is not None:
        _adopt_own_log(shared_log, group, log_path)
        log: LmdbLogStore = shared_log.store(group)
    else:
        log = LmdbLogStore(log_path, durable=durable)
    own_state = state is None
    if state is None:
        try:
            state = LmdbStateStore(state_path, checkpoint_seconds=checkpoint_seconds)
        except StorageError:
            log.close()
            raise
    if (shared_log is not None and own_state and log.created
            and state.checkpoint_index() > log.last_index()):
        # A partition's log lost (the shared environment deleted) with its state store
        # kept: the placement layer finds no log and takes the replica for one without
        # state (IGNITE-16668's self-check: re-added empty, or a full restart), so its
        # state store, of the history the lost log held, goes too. Kept, it served the
        # old rows as the "restarted empty" partition's, and skipped the new history's
        # entries at indexes it counted as applied: every write failed (found from outside).
        _log.warning("%s: the state store is at index %d but the partition's log is new: "
                     "its log was lost, so its state is discarded with it (the placement "
                     "layer re-adds the replica empty, or restarts the partition)",
                     state_path, state.checkpoint_index())
        state.close()
        shutil.rmtree(state_path)
        state = LmdbStateStore(state_path, checkpoint_seconds=checkpoint_seconds)
    if shared_log is None and log.created and state.checkpoint_index() > log.last_index():
        # A state store applies only what its log holds durably, so a log made now with
        # the store beyond it lost its files (its directory deleted, say). Opened, the
        # node took new entries at indexes the store counts as applied and skipped them:
        # acknowledged writes dropped without a word (found from outside). (A partition's
        # log is in the shared environment; the placement layer handles its loss.)
        checkpoint = state.checkpoint_index()
        log.close()
        shutil.rmtree(log_path)  # made by this open, empty: refused again next time
        if own_state:
            state.close()
        raise StorageError(
            f"{state_path}: the state store is at index {checkpoint}, but the Raft log "
            f"at {log_path} is new (empty): the log's files were lost, and new entries "
            "would be skipped as applied. If the cluster has other members, move this "
            "node's data directory away and start it empty, to be readmitted and catch "
            "up (docs/wiped-nodes.md); alone, the log's entries are gone")
    return GroupStorage(log, state, compaction)
