"""A simulated node: the core plus in-memory storage plus a KV state machine.

``SimNode.handle_ready`` is the Ready contract carried out faithfully: persist (the
memory store counts one sync per Ready), then hand back the messages, then apply the
committed entries, then ``advance``. Crashing a node throws away everything that is not
in its store: the core object, the state machine and anything stepped in since the last
Ready. Restarting rebuilds the core from the store and the state machine from the
store's snapshot plus the committed log after it, so every entry is re-applied exactly
once per incarnation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgpack

from raftkv.core import Config, Entry, EntryType, Message, Raft, ReadState, Ready
from raftkv.node.group_storage import ALREADY_APPLIED, GroupStorage
from raftkv.recovery.compaction import compact
from raftkv.storage.commands import Put, decode, encode_cas, encode_put
from raftkv.storage.log_store import MemoryLogStore
from raftkv.storage.state_store import MemoryStateStore


def encode_command(client: int, op_id: int, kind: str, key: str, value: Any = None) -> bytes:
    return msgpack.packb([client, op_id, kind, key, value], use_bin_type=True)


def decode_command(data: bytes) -> tuple[int, int, str, str, Any]:
    client, op_id, kind, key, value = msgpack.unpackb(data, raw=False)
    return client, op_id, kind, key, value


class KVStateMachine:
    """put/get/cas/delete over str keys. ``cas`` takes ``[expected, new]``; an expected
    value of None means "the key must be absent"."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def apply(self, data: bytes) -> Any:
        if not data:
            return None  # a leader's no-op entry
        _, _, kind, key, value = decode_command(data)
        if kind == "put":
            self.data[key] = value
            return None
        if kind == "delete":
            self.data.pop(key, None)
            return None
        if kind == "cas":
            expected, new = value
            if self.data.get(key) == expected:
                self.data[key] = new
                return True
            return False
        if kind == "get":
            return self.data.get(key)
        raise ValueError(f"unknown command kind {kind!r}")

    def snapshot(self) -> bytes:
        return msgpack.packb(self.data, use_bin_type=True)

    def restore(self, data: bytes) -> None:
        self.data = msgpack.unpackb(data, raw=False) if data else {}


@dataclass
class Applied:
    entry: Entry
    result: Any


@dataclass
class ReadyOutcome:
    messages: list[Message] = field(default_factory=list)
    applied: list[Applied] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
    ready: Ready | None = None


class SimNode:
    def __init__(
        self, node_id: str, storage: MemoryLogStore, seed: int, identities: bool = False,
        **config: Any,
    ) -> None:
        """``identities``: give the core its storage's incarnation (``Config.incarnation``)."""
        self.id = node_id
        self.storage = storage
        self.seed = seed
        self.identities = identities
        self.config = config
        self.incarnation = 0
        self.alive = True
        self._start()

    def _start(self) -> None:
        self.incarnation += 1
        rng = random.Random(f"{self.seed}/{self.id}/{self.incarnation}")
        snap = self.storage.snapshot()
        self.sm = KVStateMachine()
        self.sm.restore(snap.data)
        self.last_applied = snap.index
        # The state machine starts at the snapshot; the log may reach further back.
        config = Config(id=self.id, applied=snap.index, **self._identity(), **self.config)
        self.raft = Raft(config, self.storage, rng)

    def handle_ready(self) -> ReadyOutcome:
        out = ReadyOutcome()
        if not self.alive or not self.raft.has_ready():
            return out
        rd = self.raft.ready()
        out.ready = rd
        # 1. persist (one sync for the whole batch: group commit)
        if rd.hard_state is not None or rd.entries or rd.snapshot is not None:
            self.storage.save(rd.hard_state, rd.entries, rd.snapshot, sync=rd.must_sync)
        # 2. messages may leave only now that what they promise is durable
        out.messages = rd.messages
        # 3. apply
        if rd.snapshot is not None:
            self.sm.restore(rd.snapshot.data)
            self.last_applied = rd.snapshot.index
        for e in rd.committed_entries:
            if e.index != self.last_applied + 1:
                raise AssertionError(
                    f"{self.id}: applying {e.index} after {self.last_applied}: gap or replay"
                )
            self.last_applied = e.index
            result = self.sm.apply(e.data) if e.type == EntryType.NORMAL else None
            out.applied.append(Applied(e, result))
        out.read_states = rd.read_states
        # 4. advance
        self.raft.advance(rd)
        return out

    # -- what the simulator's clients and checker use ------------------------------------
    def encode(self, client: int, op_id: int, kind: str, key: str, value: Any) -> bytes:
        return encode_command(client, op_id, kind, key, value)

    def read(self, key: str) -> Any:
        return self.sm.data.get(key)

    def op_of(self, data: bytes) -> Any:
        """A hashable identity of the client operation in an entry (None for no-ops)."""
        return tuple(decode_command(data)[:2]) if data else None

    def state(self) -> dict:
        return self.sm.data

    def accept(self, msg: Message) -> bool:
        return True

    def compact(self, keep: int = 0) -> bool:
        """Snapshot the state machine at the applied index and drop the log before it,
        keeping ``keep`` entries so slightly-behind followers need no snapshot."""
        applied = self.raft.log.applied
        if applied <= self.storage.snapshot().index:
            return False
        conf = self.raft.conf_at(applied)
        if conf is None:
            return False  # e.g. a leader's snapshot is pending: its config history replaced ours
        self.storage.create_snapshot(applied, conf, self.sm.snapshot())
        self.storage.compact(max(applied - keep, self.storage.first_index() - 1))
        return True

    def _identity(self) -> dict[str, Any]:
        if not self.identities:
            return {}
        ident = self.storage.identity()
        return {"incarnation": ident.incarnation, "newborn": ident.newborn}

    def crash(self) -> None:
        self.alive = False
        self.storage.crash()

    def restart(self) -> None:
        self.alive = True
        self._start()

    def wipe(self, storage: MemoryLogStore) -> None:
        """The node's files are gone: it restarts on ``storage`` (empty, or freshly
        bootstrapped, as a node started again with its old arguments would be)."""
        self.crash()
        self.replace_storage(storage)
        self.restart()

    def replace_storage(self, storage: MemoryLogStore) -> None:
        """While down: the files are replaced by ``storage``; the next start uses it."""
        assert not self.alive, "wipe a node that is down"
        self.storage = storage
        self._wiped()

    def _wiped(self) -> None:
        """Forget whatever else the node kept on disk (a state store)."""


class StoreSimNode(SimNode):
    """A node on the real storage path: ``GroupStorage`` over a MemoryLogStore and a
    MemoryStateStore, with storage commands (put/cas over bytes).

    A crash loses what the state store applied since its last checkpoint, exactly as
    IGNITE-16907 describes; a restart replays the log from the checkpoint, and the core
    starts at the store's applied index. Snapshots carry the state store's image, which
    may be newer than the snapshot's index: the overlap comes back ALREADY_APPLIED.
    """

    def __init__(self, node_id: str, storage: MemoryLogStore, seed: int,
                 checkpoint_entries: int = 25, **config: Any) -> None:
        self.checkpoint_entries = checkpoint_entries
        self.state_store = self._new_state_store()
        # The newest index the state store held before the core could deliver it: an
        # installed image's (newer than its snapshot index), or the checkpoint a restart
        # found past the log's commit index (a commit index saved without sync is lost).
        self.held_index = 0
        super().__init__(node_id, storage, seed, **config)

    def _start(self) -> None:
        self.incarnation += 1
        self.gs = GroupStorage(self.storage, self.state_store)
        self.gs.recover()
        self.last_applied = self.state_store.applied_index()
        self.held_index = max(self.held_index, self.last_applied)
        rng = random.Random(f"{self.seed}/{self.id}/{self.incarnation}")
        config = Config(id=self.id, applied=self.last_applied, **self._identity(),
                        **self.config)
        self.raft = Raft(config, self.storage, rng)

    def _new_state_store(self) -> MemoryStateStore:
        return MemoryStateStore(
            checkpoint_entries=self.checkpoint_entries, checkpoint_seconds=float("inf")
        )

    def _wiped(self) -> None:
        self.state_store = self._new_state_store()
        self.held_index = 0

    def crash(self) -> None:
        super().crash()
        self.state_store.crash()

    def handle_ready(self) -> ReadyOutcome:
        out = ReadyOutcome()
        if not self.alive or not self.raft.has_ready():
            return out
        rd = self.raft.ready()
        out.ready = rd
        self.gs.persist(rd)
        if rd.snapshot is not None:
            self.held_index = max(self.held_index, self.state_store.applied_index())
        out.messages = [self.gs.outgoing(m) for m in rd.messages]
        results = self.gs.apply(rd.committed_entries)
        out.applied = []
        for e, r in zip(rd.committed_entries, results):
            if r is ALREADY_APPLIED:
                # Only an installed image or a restart's checkpoint may hold entries the
                # core still delivers; anything else is a lost or doubled apply.
                assert e.index <= self.held_index, (
                    f"{self.id}: entry {e.index} reported applied, but no image or "
                    "checkpoint held it"
                )
            else:
                out.applied.append(Applied(e, r))
        self.state_store.maybe_checkpoint(0.0)  # the entries threshold decides
        self.last_applied = self.state_store.applied_index()
        out.read_states = rd.read_states
        self.raft.advance(rd)
        return out

    def compact(self, keep: int = 0) -> bool:
        return compact(self.storage, self.state_store, self.raft.conf_at, keep) is not None

    def encode(self, client: int, op_id: int, kind: str, key: str, value: Any) -> bytes:
        k = key.encode()
        if kind == "put":
            return encode_put(k, b"%d" % value)
        if kind == "cas":
            expected, new = value
            return encode_cas(k, None if expected is None else b"%d" % expected, b"%d" % new)
        raise ValueError(f"no storage command for {kind!r}")

    def read(self, key: str) -> Any:
        v = self.state_store.get(key.encode())
        return None if v is None else int(v)

    def op_of(self, data: bytes) -> Any:
        # Every write stores its globally unique op id as the value it writes.
        if not data:
            return None
        cmd = decode(data)
        return int(cmd.value if isinstance(cmd, Put) else cmd.new)

    def state(self) -> dict:
        return dict(self.state_store.scan())

    def accept(self, msg: Message) -> bool:
        return self.gs.accept(msg)
