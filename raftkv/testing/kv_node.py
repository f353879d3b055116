"""A simulated node serving the KV API: ``StoreSimNode`` (GroupStorage over a
MemoryLogStore and a MemoryStateStore) with the commands of revisions, transactions and
leases, and the leader's lease clocks as the server keeps them.

The clocks are ``raftkv.server.lease_clocks.LeaseClocks``, the very bookkeeping the
server's ``LeaseKeeper`` uses, on the simulated clock; ``lease_tick`` and ``keepalive``
do what ``LeaseKeeper._tick`` and ``LeaseKeeper.keepalive`` do around it (the simulator
proposes the revokes ``lease_tick`` returns, as the keeper's ``_expire`` does). They live
in memory, so a crash loses them, as a process restart would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raftkv.core import NotLeader, Role
from raftkv.server.lease_clocks import LeaseClocks, read_leases
from raftkv.storage.commands import (
    Cas,
    CasIndex,
    LeaseGrant,
    Put,
    PutLease,
    decode,
)
from raftkv.storage.leases import lease_key
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.revisions import KeyMeta
from raftkv.storage.txn import Kind, Txn
from raftkv.testing.kv_history import Meta
from raftkv.testing.node import StoreSimNode


def meta(m: KeyMeta | None) -> Meta | None:
    """A store's answer as the history records it."""
    return None if m is None else Meta(m.value.decode(), m.create_revision, m.mod_revision,
                                       m.version, m.lease)


class KvSimNode(StoreSimNode):
    def __init__(self, node_id: str, storage: MemoryLogStore, seed: int,
                 clock: Callable[[], float], **config: Any) -> None:
        self.clock = clock
        super().__init__(node_id, storage, seed, **config)

    def _start(self) -> None:
        super()._start()
        self.leases = LeaseClocks(self.clock)

    def read(self, key: str) -> Any:
        return meta(self.state_store.get_meta(key.encode()))

    def op_of(self, data: bytes) -> Any:
        """A command carrying a value no other command writes is identified by it (every
        write value is its op's unique id); others (deletes, revokes, transactions
        without a put) by nothing: two of them may be equal bytes."""
        if not data:
            return None
        cmd = decode(data)
        if isinstance(cmd, Put | PutLease):
            return cmd.value
        if isinstance(cmd, Cas | CasIndex):
            return cmd.new
        if isinstance(cmd, LeaseGrant):
            return ("grant", cmd.lease)
        if isinstance(cmd, Txn):
            puts = [o.value for o in (*cmd.success, *cmd.failure) if o.kind is Kind.PUT]
            return puts[0] if puts else None
        return None

    def _leading(self) -> int:
        return self.raft.term if self.alive and self.raft.role == Role.LEADER else 0

    def lease_tick(self) -> list[int]:
        """``LeaseKeeper._tick``: the leases whose revoke to propose now."""
        term = self._leading()
        if self.leases.take_over(term):
            if term:
                self.leases.reload(read_leases(self.state_store))
            return []
        if not term:
            return []
        if self.leases.reload_due():
            self.leases.reload(read_leases(self.state_store))
        return self.leases.due()

    def lease_alive(self, lease: int) -> bool:
        """After a keepalive's ReadIndex round, as ``LeaseKeeper.keepalive``: whether the
        lease still exists (if not, its clock is dropped and the answer is "not found")."""
        if self.state_store.get_meta(lease_key(lease)) is not None:
            return True
        self.leases.revoked(lease)
        return False

    def keepalive(self, lease: int) -> int | None:
        """``LeaseKeeper.keepalive`` up to its ReadIndex round (which the simulator runs):
        the TTL (None: not found). ``NotLeader`` off the
        leader."""
        term = self._leading()
        if not term:
            raise NotLeader(self.id, self.raft.lead)
        if term != self.leases.term:
            self.lease_tick()  # elected since the last tick: a take-over, which revokes nothing
        if lease not in self.leases.revoking and not self.leases.knows(lease):
            self.leases.reload(read_leases(self.state_store))
        try:
            return self.leases.keepalive(lease)
        except KeyError:
            return None
