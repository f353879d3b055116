"""The placement manager's cache of the metastore's placement keys, with the holds keys
of each partition indexed.

The restart rules read all the holds keys of one partition (``SafeRestart._first_start``,
``_restart_epoch``: who started hosting it, in which incarnation, from which full
restart). A scan of the whole cache for them costs O(keys) per partition, and a node
that restarts with 256 partitions of three replicas ran 256 such scans over about
1,000 keys while it opened them: a tenth of its loop thread's time in one profiled
restart. ``KeyCache`` keeps, beside the plain mapping, each partition's holds keys
(``holds_of``), maintained by every write to the mapping.

It is a ``dict`` so that everything that reads the cache reads it as before. The writes
that keep the index (``[key] = value``, ``pop``, ``del``) are the only ones offered;
the others raise rather than bypass the index.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from raftkv.placement.catalog import HOLDS_PREFIX, partition_group
from raftkv.placement.meta_commands import VersionedValue


def holds_partition(key: bytes) -> bytes | None:
    """The partition prefix (``holds_prefix(table, p)``) of a holds key, or None for any
    other key. Table names have no dot (``check_table_name``) and the partition is a
    number, so the prefix ends at the second dot after ``HOLDS_PREFIX``; node ids may
    have dots, and follow it."""
    if not key.startswith(HOLDS_PREFIX):
        return None
    table_end = key.find(b".", len(HOLDS_PREFIX))
    part_end = key.find(b".", table_end + 1) if table_end >= 0 else -1
    return key[:part_end + 1] if part_end >= 0 else None


def holds_group(key: bytes) -> str | None:
    """The partition group a holds key names, or None for any other key."""
    prefix = holds_partition(key)
    if prefix is None:
        return None
    table, _, index = prefix[len(HOLDS_PREFIX):-1].partition(b".")
    try:
        return partition_group(table.decode(), int(index))
    except (UnicodeDecodeError, ValueError):
        return None


class KeyCache(dict[bytes, VersionedValue]):
    """A mapping of key to ``VersionedValue`` that indexes holds keys by partition (the
    module docstring)."""

    def __init__(self, items: Iterable[tuple[bytes, VersionedValue]] = ()) -> None:
        super().__init__()
        self._holds: dict[bytes, dict[bytes, VersionedValue]] = {}
        for k, v in items:
            self[k] = v

    def holds_of(self, prefix: bytes) -> dict[bytes, VersionedValue]:
        """The holds keys under ``prefix`` (``holds_prefix(table, p)``) and their values.
        A view to read, not to change."""
        return self._holds.get(prefix, {})

    def __setitem__(self, key: bytes, value: VersionedValue) -> None:
        super().__setitem__(key, value)
        prefix = holds_partition(key)
        if prefix is not None:
            self._holds.setdefault(prefix, {})[key] = value

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        self._unindex(key)

    def pop(self, key: bytes, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._unindex(key)
        return value

    def _unindex(self, key: bytes) -> None:
        prefix = holds_partition(key)
        if prefix is None:
            return
        held = self._holds.get(prefix)
        if held is not None:
            held.pop(key, None)
            if not held:
                del self._holds[prefix]

    def _unindexed(self, *_: Any, **__: Any) -> NoReturn:
        raise TypeError("KeyCache is written only with [key] = value, pop and del")

    update = setdefault = popitem = clear = __ior__ = _unindexed  # type: ignore[assignment]
