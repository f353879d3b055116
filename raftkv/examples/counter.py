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

raftkv::

    from raftkv.statemachine import ReplicatedObject, replicated

    class Counter(ReplicatedObject):
        def __init__(self):
            self.value = 0                 # public: it is what snapshot() saves

        @replicated
        def incr(self, n=1):
            self.value += n
            return self.value

        @replicated
        def set(self, v):
            self.value = v

        def get(self):
            return self.value

    counter = Counter()
    # A node hosts it (the node API is being written): it calls counter._attach(propose)
    # and applies the group's log to it through raftkv.node.user_state.UserStateStore.
    counter.incr(2)                        # sync by default: returns the new value
    counter.incr(2, sync=False)            # a concurrent.futures.Future

The differences:

- The object holds only state. The network addresses go to the node that hosts it, so one
  process can host many groups.
- Calls are synchronous by default. ``sync=False`` returns a ``Future``, ``callback=`` works
  as in PySyncObj, and ``timeout=`` bounds a synchronous wait.
- Arguments and the default snapshot use msgpack, not pickle: use plain data (see
  ``raftkv.statemachine``). State in ``_private`` attributes is *not* snapshotted, so keep
  replicated state in public attributes, or override ``snapshot``/``restore``.
- A method that raises gives the same exception on every replica, and the caller gets it
  raised. It does not crash the node.
"""

from __future__ import annotations

from raftkv.statemachine import ReplicatedObject, replicated


class Counter(ReplicatedObject):
    def __init__(self, value: int = 0) -> None:
        self.value = value

    @replicated
    def incr(self, n: int = 1) -> int:
        self.value += n
        return self.value

    @replicated
    def set(self, v: int) -> None:
        self.value = v

    def get(self) -> int:
        return self.value
