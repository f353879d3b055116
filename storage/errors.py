"""Named storage errors. Every store raises exactly these, so callers can rely on them.

- ``Compacted``: the requested index is below the first index still in the log (it was
  folded into a snapshot). The caller must fall back to the snapshot.
- ``Unavailable``: the requested index is above the last index. Nothing was read.
- ``SnapshotUnavailable``: a snapshot is being produced; try again later.
- ``IndexMismatch``: a state store was offered an index at or below its checkpointIndex
  (IGNITE-16907). ``checkpoint_index`` tells the driver where to skip to.
- ``CorruptLog``: the log failed validation below the point where it may be truncated.
- ``CheckpointDeferred``: a checkpoint could not open a file for want of a descriptor
  (EMFILE, ENFILE): the data file, before any sync, or the record file, before anything
  is written to it. No checkpoint was recorded and no sync failed, so nothing is in doubt:
  try later.
"""

import errno


class StorageError(Exception):
    pass


class CheckpointDeferred(StorageError):
    """See the module docstring. Unlike a failed sync, which leaves the file's state in
    doubt and so stops the node, this is a resource limit passing by (a connection flood
    ran the process out of descriptors, and a node's loop died of it: found from
    outside)."""


def out_of_descriptors(e: OSError) -> bool:
    return e.errno in (errno.EMFILE, errno.ENFILE)



class Rebuildable:
    """For exceptions whose constructor takes fields, not a message: pickle them by
    those fields (plus any attributes added later) so they cross process boundaries,
    such as the simulator's worker pool, intact."""

    _fields: tuple[str, ...] = ()

    def __reduce__(self) -> tuple:
        return (type(self), tuple(getattr(self, f) for f in self._fields), self.__dict__)


class _Rebuildable(Rebuildable, StorageError):
    pass


class Compacted(_Rebuildable):
    _fields = ("index", "first_index")

    def __init__(self, index: int, first_index: int) -> None:
        super().__init__(f"index {index} is compacted (first index is {first_index})")
        self.index = index
        self.first_index = first_index


class Unavailable(_Rebuildable):
    _fields = ("index", "last_index")

    def __init__(self, index: int, last_index: int) -> None:
        super().__init__(f"index {index} is unavailable (last index is {last_index})")
        self.index = index
        self.last_index = last_index


class SnapshotUnavailable(StorageError):
    pass


class IndexMismatch(_Rebuildable):
    _fields = ("index", "checkpoint_index")

    def __init__(self, index: int, checkpoint_index: int) -> None:
        super().__init__(
            f"index {index} is at or below the checkpointIndex {checkpoint_index}; "
            f"resume from {checkpoint_index + 1}"
        )
        self.index = index
        self.checkpoint_index = checkpoint_index


class CorruptLog(StorageError):
    pass
