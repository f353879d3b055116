"""A replicated counter: the PySyncObj README's first example, moved to raftkv.

PySyncObj::

    from pysyncobj import SyncObj, replicated

    class Counter(SyncObj):
        def __init__(self, self_addr, partner_addrs):
            super().__init__(self_addr, partner_addrs)
            self.__counter = 0

        @replicated
        def incr(self, n=1):
            self.__counter += n
            return self.__counter

        @replicated
        def set(self, v):
            self.__counter = v

        def get(self):
            return self.__counter

    counter = Counter("host1:4321", ["host2:4321", "host3:4321"])
    counter.incr(2, sync=True)

raftkv: the base class and the constructor change, the methods and ``self.__counter`` stay::

    from raftkv import ReplicatedNode, ReplicatedObject, replicated

    class Counter(ReplicatedObject):
        def __init__(self):
            self.__counter = 0

        @replicated
        def incr(self, n=1):
            self.__counter += n
            return self.__counter

        @replicated
        def set(self, v):
            self.__counter = v

        def get(self):
            return self.__counter

    counter = Counter()
    node = ReplicatedNode(counter, "n1", peers["n1"], peers, secret, data_dir="data/n1")
    counter.incr(2)                        # sync by default: returns the new value
    counter.incr(2, sync=False)            # a concurrent.futures.Future

The differences:

- The object holds only state. The network addresses go to the node that hosts it
  (``raftkv.ReplicatedNode``), so one process can host many groups.
- Calls are synchronous by default. ``sync=False`` returns a ``Future``, ``callback=`` works
  as in PySyncObj, and ``timeout=`` bounds a synchronous wait.
- Arguments and snapshots use msgpack, not pickle: state and arguments must be plain data
  (None, bool, int, float, str, bytes, and lists, tuples, dicts, sets, frozensets and
  deques of those; see ``raftkv.statemachine``). As in PySyncObj, a snapshot holds every
  attribute, private and name-mangled ones such as ``self.__counter`` included. An
  attribute that is not plain data fails the snapshot loudly, naming the attribute; it is
  never skipped.
- A method that raises gives the same exception on every replica, and the caller gets it
  raised. It does not crash the node.
"""

from __future__ import annotations

from raftkv.statemachine import ReplicatedObject, replicated


class Counter(ReplicatedObject):
    def __init__(self, value: int = 0) -> None:
        self.__counter = value

    @replicated
    def incr(self, n: int = 1) -> int:
        self.__counter += n
        return self.__counter

    @replicated
    def set(self, v: int) -> None:
        self.__counter = v

    def get(self) -> int:
        return self.__counter
