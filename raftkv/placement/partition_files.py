"""A persistent partition's files on disk: where they live, the generation file that
tells a re-created table's partition from the old one's, deleting a dropped table's
files and sweeping orphans after a full read of the metastore."""

from __future__ import annotations

import logging
import os
import shutil

from raftkv.placement.manager_base import (
    GEN_FILE,
    ManagerBase,
)
from raftkv.placement.partition_state import (
    PartitionState,
)
from raftkv.storage.durable_fs import ensure_durable, makedirs_durable
from raftkv.storage.errors import StorageError
from raftkv.storage.layout import group_paths

log = logging.getLogger(__name__)


class PartitionFiles(ManagerBase):
    """A partition's files (see the module docstring)."""

    def _group_dir(self, gid: str) -> str | None:
        if self.data_dir is None:
            return None
        return os.path.dirname(group_paths(self.data_dir, gid)[0])

    def _delete_files(self, gid: str) -> None:
        """Delete a partition's log, then its directory: a crash in between leaves a
        state store without a log, which the restart self-check (``_has_log``) takes for
        wiped storage. The other order would leave a log without its state store."""
        base = self._group_dir(gid)
        if self._logs is None or base is None:
            return
        try:
            if self._logs.has(gid):
                self._logs.drop(gid)
            if os.path.exists(base):
                shutil.rmtree(base)
        except (OSError, StorageError) as e:
            log.error("node %s: cannot delete %s's files: %s", self.id, gid, e)
            self._record(gid, "drop", e, 1)

    def _sweep_orphan_files(self) -> None:
        """Delete the partition directories of tables that no longer exist (dropped while
        this node was down). Only ``t.<table>.<p>`` directories are touched."""
        if self.data_dir is None or self._logs is None:
            return
        root = os.path.join(self.data_dir, "groups")
        try:
            names = set(os.listdir(root)) | self._logs.groups()
        except (OSError, StorageError):
            return
        for gid in sorted(names):
            if gid.startswith("t.") and gid not in self._parts and gid not in self._hosted:
                log.info("node %s: deleting %s (its table no longer exists)", self.id, gid)
                self._delete_files(gid)

    def _clear_stale_files(self, part: PartitionState) -> None:
        """Files of an earlier table of the same name (dropped and re-created while this
        node was down) are not this table's: delete them before the storage self-check."""
        base = self._group_dir(part.group)
        if base is None:
            return
        try:
            with open(os.path.join(base, GEN_FILE)) as f:
                gen = int(f.read().strip())
        except (OSError, ValueError):
            # No marker: no files, or files written before markers existed. An empty
            # or garbled one says nothing either: never a reason to delete.
            return
        if gen != part.gen:
            log.info("node %s: %s holds files of an earlier table %s (generation %d, now "
                     "%d): deleting them", self.id, part.group, part.table, gen, part.gen)
            self._delete_files(part.group)

    def _write_gen(self, part: PartitionState) -> None:
        base = self._group_dir(part.group)
        if base is None:
            return
        # Durably: after a power loss an empty marker (the data of a rename not yet
        # synced) read as generation 0 and deleted a live partition's files (issue 22).
        makedirs_durable(base)
        ensure_durable(os.path.join(base, GEN_FILE), f"{part.gen}\n".encode())

