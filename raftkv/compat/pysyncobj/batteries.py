"""PySyncObj's batteries: replicated containers and a lock manager, as ``SyncObjConsumer``s.

Pass them to a ``SyncObj`` (``consumers=[...]``); every node must pass the same kinds in
the same order. Writes are ``@replicated`` (asynchronous unless ``sync=True``, see
``raftkv.compat.pysyncobj``), reads are local and may lag the leader. Items, keys and
values must be plain data (``raftkv.statemachine``'s msgpack rules: None, bool, int,
float, str, bytes, and lists, tuples, dicts, sets, frozensets and deques of those),
checked before anything is proposed.

Differences from PySyncObj's, all for determinism (every replica must reach the same
state from the same log):

- ``ReplSet.pop()`` removes the smallest member in the codec's order (by encoded bytes),
  not an arbitrary one: ``set.pop()`` depends on hashing, which differs from process to
  process for str members, so replicas would pop different members.
- ``ReplList.pop()`` without a position pops the last item (PySyncObj passes None to
  ``list.pop``, which raises).
- ``ReplLockManager``: the time that decides whether a lock has expired is always an
  argument of the log entry, read once from the proposing node's clock
  (``tryAcquire`` reads ``time.time()`` once and passes it; so does the thread that
  prolongs this client's locks). Applying an entry never reads a clock, so every
  replica expires the same locks at the same point of the log. Only ``isAcquired``, a
  local read, compares with this node's clock. Clocks of the nodes must agree to well
  within ``autoUnlockTime`` (NTP): a node whose clock runs ahead can take over locks early.
"""

from __future__ import annotations

import heapq
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, ItemsView, KeysView, ValuesView
from typing import Any

from raftkv.compat.pysyncobj.syncobj import SyncObjConsumer, _engine, replicated
from raftkv.statemachine import encode_value

__all__ = [
    "ReplCounter",
    "ReplDict",
    "ReplList",
    "ReplLockManager",
    "ReplPriorityQueue",
    "ReplQueue",
    "ReplSet",
]


class ReplCounter(SyncObjConsumer):
    """A replicated number: ``set``, ``add``, ``sub``, ``inc`` (each returns the new value)."""

    def __init__(self) -> None:
        super().__init__()
        self.__counter = 0

    @replicated
    def set(self, newValue: Any) -> Any:
        self.__counter = newValue
        return self.__counter

    @replicated
    def add(self, value: Any) -> Any:
        self.__counter += value
        return self.__counter

    @replicated
    def sub(self, value: Any) -> Any:
        self.__counter -= value
        return self.__counter

    @replicated
    def inc(self) -> Any:
        self.__counter += 1
        return self.__counter

    def get(self) -> Any:
        return self.__counter


class ReplList(SyncObjConsumer):
    """A replicated list, with ``list``'s interface."""

    def __init__(self) -> None:
        super().__init__()
        self.__data: list[Any] = []

    @replicated
    def reset(self, newData: list[Any]) -> None:
        if not isinstance(newData, list):
            raise TypeError("ReplList.reset takes a list")
        self.__data = newData

    @replicated
    def set(self, position: int, newValue: Any) -> None:
        self.__data[position] = newValue

    @replicated
    def append(self, item: Any) -> None:
        self.__data.append(item)

    @replicated
    def extend(self, other: Any) -> None:
        self.__data.extend(other)

    @replicated
    def insert(self, position: int, element: Any) -> None:
        self.__data.insert(position, element)

    @replicated
    def remove(self, element: Any) -> None:
        self.__data.remove(element)

    @replicated
    def pop(self, position: int | None = None) -> Any:
        return self.__data.pop(-1 if position is None else position)

    @replicated
    def sort(self, reverse: bool = False) -> None:
        self.__data.sort(reverse=reverse)

    def index(self, element: Any) -> int:
        return self.__data.index(element)

    def count(self, element: Any) -> int:
        return self.__data.count(element)

    def get(self, position: int) -> Any:
        return self.__data[position]

    def __getitem__(self, position: int) -> Any:
        return self.__data[position]

    # As in PySyncObj, item assignment is code version 1: enabled by setCodeVersion(1).
    @replicated(ver=1)
    def __setitem__(self, position: int, element: Any) -> None:
        self.__data[position] = element

    def __len__(self) -> int:
        return len(self.__data)

    def rawData(self) -> list[Any]:
        return self.__data


class ReplDict(SyncObjConsumer):
    """A replicated dict, with ``dict``'s interface."""

    def __init__(self) -> None:
        super().__init__()
        self.__data: dict[Any, Any] = {}

    @replicated
    def reset(self, newData: dict[Any, Any]) -> None:
        if not isinstance(newData, dict):
            raise TypeError("ReplDict.reset takes a dict")
        self.__data = newData

    @replicated
    def __setitem__(self, key: Any, value: Any) -> None:
        self.__data[key] = value

    @replicated
    def set(self, key: Any, value: Any) -> None:
        self.__data[key] = value

    @replicated
    def setdefault(self, key: Any, default: Any) -> Any:
        return self.__data.setdefault(key, default)

    @replicated
    def update(self, other: dict[Any, Any]) -> None:
        self.__data.update(other)

    @replicated
    def pop(self, key: Any, default: Any = None) -> Any:
        return self.__data.pop(key, default)

    @replicated
    def clear(self) -> None:
        self.__data.clear()

    def __getitem__(self, key: Any) -> Any:
        return self.__data[key]

    def get(self, key: Any, default: Any = None) -> Any:
        return self.__data.get(key, default)

    def __len__(self) -> int:
        return len(self.__data)

    def __contains__(self, key: Any) -> bool:
        return key in self.__data

    def keys(self) -> KeysView[Any]:
        return self.__data.keys()

    def values(self) -> ValuesView[Any]:
        return self.__data.values()

    def items(self) -> ItemsView[Any, Any]:
        return self.__data.items()

    def rawData(self) -> dict[Any, Any]:
        return self.__data


class ReplSet(SyncObjConsumer):
    """A replicated set, with ``set``'s interface."""

    def __init__(self) -> None:
        super().__init__()
        self.__data: set[Any] = set()

    @replicated
    def reset(self, newData: set[Any]) -> None:
        if not isinstance(newData, set):
            raise TypeError("ReplSet.reset takes a set")
        self.__data = newData

    @replicated
    def add(self, item: Any) -> None:
        self.__data.add(item)

    @replicated
    def remove(self, item: Any) -> None:
        self.__data.remove(item)

    @replicated
    def discard(self, item: Any) -> None:
        self.__data.discard(item)

    @replicated
    def pop(self) -> Any:
        """Remove and return the smallest member by encoded bytes (deterministic)."""
        if not self.__data:
            raise KeyError("pop from an empty set")
        item = min(self.__data, key=encode_value)
        self.__data.remove(item)
        return item

    @replicated
    def clear(self) -> None:
        self.__data.clear()

    @replicated
    def update(self, other: Any) -> None:
        self.__data.update(other)

    def rawData(self) -> set[Any]:
        return self.__data

    def __len__(self) -> int:
        return len(self.__data)

    def __contains__(self, item: Any) -> bool:
        return item in self.__data


class ReplQueue(SyncObjConsumer):
    """A replicated FIFO queue (``collections.deque``); ``put`` returns False when full."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__()
        self.__maxsize = maxsize
        self.__data: deque[Any] = deque()

    def qsize(self) -> int:
        return len(self.__data)

    def empty(self) -> bool:
        return not self.__data

    def __len__(self) -> int:
        return len(self.__data)

    def full(self) -> bool:
        return self.__maxsize > 0 and len(self.__data) >= self.__maxsize

    @replicated
    def put(self, item: Any) -> bool:
        if self.__maxsize and len(self.__data) >= self.__maxsize:
            return False
        self.__data.append(item)
        return True

    @replicated
    def get(self, default: Any = None) -> Any:
        return self.__data.popleft() if self.__data else default


class ReplPriorityQueue(SyncObjConsumer):
    """A replicated priority queue (``heapq``): ``get`` returns the smallest item."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__()
        self.__maxsize = maxsize
        self.__data: list[Any] = []

    def qsize(self) -> int:
        return len(self.__data)

    def empty(self) -> bool:
        return not self.__data

    def __len__(self) -> int:
        return len(self.__data)

    def full(self) -> bool:
        return self.__maxsize > 0 and len(self.__data) >= self.__maxsize

    @replicated
    def put(self, item: Any) -> bool:
        if self.__maxsize and len(self.__data) >= self.__maxsize:
            return False
        heapq.heappush(self.__data, item)
        return True

    @replicated
    def get(self, default: Any = None) -> Any:
        return heapq.heappop(self.__data) if self.__data else default


class _ReplLockManagerImpl(SyncObjConsumer):
    """The replicated lock table: lockID -> (clientID, time of the last acquire or
    prolongation). Every time comes in the entry (module docstring)."""

    def __init__(self, autoUnlockTime: float) -> None:
        super().__init__()
        self.__locks: dict[Any, tuple[Any, float]] = {}
        self.__autoUnlockTime = autoUnlockTime

    @replicated
    def acquire(self, lockID: Any, clientID: Any, currentTime: float) -> bool:
        held = self.__locks.get(lockID)
        if held is not None and currentTime - held[1] > self.__autoUnlockTime:
            held = None  # expired
        if held is None or held[0] == clientID:
            self.__locks[lockID] = (clientID, currentTime)
            return True
        return False

    @replicated
    def prolongate(self, clientID: Any, currentTime: float) -> None:
        for lockID in list(self.__locks):
            owner, since = self.__locks[lockID]
            if currentTime - since > self.__autoUnlockTime:
                del self.__locks[lockID]
            elif owner == clientID:
                self.__locks[lockID] = (clientID, currentTime)

    @replicated
    def release(self, lockID: Any, clientID: Any) -> None:
        held = self.__locks.get(lockID)
        if held is not None and held[0] == clientID:
            del self.__locks[lockID]

    def isAcquired(self, lockID: Any, clientID: Any, currentTime: float) -> bool:
        held = self.__locks.get(lockID)
        return (held is not None and held[0] == clientID
                and currentTime - held[1] < self.__autoUnlockTime)


class ReplLockManager:
    """Distributed locks that expire ``autoUnlockTime`` seconds after their holder was last
    heard from. A thread of this object prolongs its locks every ``autoUnlockTime / 4``
    while a leader is known. ``selfID`` names this lock holder (default: host, pid, id)."""

    def __init__(self, autoUnlockTime: float, selfID: str | None = None) -> None:
        self.__lockImpl = _ReplLockManagerImpl(autoUnlockTime)
        if selfID is None:
            selfID = f"{socket.gethostname()}:{os.getpid()}:{id(self)}"
        self.__selfID = selfID
        self.__autoUnlockTime = autoUnlockTime
        self.__stop = threading.Event()
        self.__thread = threading.Thread(
            target=_prolong_loop, args=(weakref.ref(self), self.__stop), daemon=True,
            name=f"ReplLockManager-{selfID}")
        self.__thread.start()

    def _consumer(self) -> _ReplLockManagerImpl:
        return self.__lockImpl

    def destroy(self) -> None:
        """Stop prolonging this holder's locks (call before dropping the manager)."""
        self.__stop.set()

    def _prolong(self) -> bool:
        """One prolongation if due; False once there is nothing left to do."""
        sync_obj = self.__lockImpl._syncObj
        if sync_obj is None:
            return True
        engine = _engine(sync_obj)
        if engine is not None and engine.destroyed:
            return False
        if sync_obj._getLeader() is not None:
            self.__lockImpl.prolongate(self.__selfID, time.time())
        return True

    @property
    def _period(self) -> float:
        return float(self.__autoUnlockTime) / 4.0

    def tryAcquire(self, lockID: Any, callback: Callable[[Any, int], Any] | None = None,
                   sync: bool = False, timeout: float | None = None) -> Any:
        """Try to take ``lockID``: True if acquired, False if someone else holds it
        (returned with ``sync=True``, else passed to ``callback(result, FAIL_REASON)``)."""
        attempt = time.time()  # read once, here; the entry carries it to every replica
        impl = self.__lockImpl
        if sync:
            got = impl.acquire(lockID, self.__selfID, attempt, callback=callback, sync=sync,
                               timeout=timeout)
            if got and time.time() - attempt > self.__autoUnlockTime / 2.0:
                got = False  # it took too long: the lock may expire before we use it
                impl.release(lockID, self.__selfID, sync=sync)
            return got

        def done(got: Any, err: int) -> None:
            if got and time.time() - attempt > self.__autoUnlockTime / 2.0:
                got = False
                impl.release(lockID, self.__selfID, sync=False)
            if callback is not None:
                callback(got, err)

        impl.acquire(lockID, self.__selfID, attempt, callback=done, sync=False,
                     timeout=timeout)
        return None

    def isAcquired(self, lockID: Any) -> bool:
        """Whether this holder has ``lockID`` by this replica's state and clock."""
        return self.__lockImpl.isAcquired(lockID, self.__selfID, time.time())

    def release(self, lockID: Any, callback: Callable[[Any, int], Any] | None = None,
                sync: bool = False, timeout: float | None = None) -> None:
        self.__lockImpl.release(lockID, self.__selfID, callback=callback, sync=sync,
                                timeout=timeout)


def _prolong_loop(ref: weakref.ref[ReplLockManager], stop: threading.Event) -> None:
    last = 0.0
    while not stop.wait(0.1):
        manager = ref()
        if manager is None:
            return
        try:
            if time.monotonic() - last < manager._period:
                continue
            last = time.monotonic()
            if not manager._prolong():
                return
        except Exception:
            import logging

            logging.getLogger("raftkv.compat.pysyncobj").exception("prolongate failed")
        finally:
            del manager
