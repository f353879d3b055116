"""What a ``ReplicatedObject`` snapshot holds, and what happens when it cannot be taken.

The rule (raftkv/statemachine.py, "Snapshots"): a snapshot captures everything a replicated
method can change, every attribute of the object, private and name-mangled ones and
subclasses' slots included; the framework's bookkeeping lives in a slot of its own and is
never part of it. A state that cannot be encoded fails the snapshot loudly and the log is
kept (raftkv/node/user_state.py). Sets, frozensets, deques and big ints travel in msgpack
extension types, decoded strictly. Tests are named after the rule they check.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raftkv.recovery.compaction import CompactionPolicy, compact
from raftkv.storage.errors import StorageError
from test_statemachine import Group

import raftkv
import raftkv.embedded
from raftkv.examples.counter import Counter as ExampleCounter
from raftkv.node.user_state import CHECKPOINT_FILE, UserStateStore
from raftkv.statemachine import (
    ReplicatedObject,
    decode_value,
    encode_call,
    encode_value,
    replicated,
)
from raftkv.testing.procs import free_ports

SECRET = b"snapshot-test"
REPO = Path(__file__).resolve().parents[1]


# -- PySyncObj's README counter on a real cluster -------------------------------------------
class PySyncObjCounter(ReplicatedObject):
    """PySyncObj's README counter, with only the base class and constructor changed."""

    def __init__(self) -> None:
        self.__counter = 0

    @replicated
    def incr(self) -> int:
        self.__counter += 1
        return self.__counter

    def get(self) -> int:
        return self.__counter


def _on_loop(node: raftkv.ReplicatedNode, fn: Callable[[Any], Any]) -> Any:
    """Run ``fn(state store)`` on the node's loop thread (the stores are its alone)."""
    return node.node.call(lambda: fn(node.node.groups[node.group].state)).result(timeout=10)


def _group_status(node: raftkv.ReplicatedNode) -> dict[str, Any]:
    status: dict[str, Any] = node.status()["groups"][node.group]
    return status


@pytest.fixture
def manual_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """ReplicatedNode's store checkpoints only when a test says so, not by its timer."""
    monkeypatch.setattr(raftkv.embedded, "UserStateStore", functools.partial(
        UserStateStore, checkpoint_entries=1 << 30, checkpoint_seconds=3600.0))


@pytest.mark.parametrize("checkpoint_after", [5, 2], ids=["from_checkpoint", "checkpoint_plus_replay"])
def test_pysyncobj_counter_keeps_its_private_value_across_a_restart_of_every_node(
    tmp_path: Path, manual_checkpoints: None, checkpoint_after: int,
) -> None:
    """The bug: ``self.__counter`` was left out of checkpoints, so after 5 increments and
    a restart of all three nodes the value was 0 (or only what the log replayed after the
    checkpoint), with no warning. Restarted from a checkpoint taken after all 5, and from
    a checkpoint after 2 plus a replay of the last 3, the value is 5 on every node."""
    ps = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}

    def start() -> tuple[dict[str, PySyncObjCounter], dict[str, raftkv.ReplicatedNode]]:
        objs = {n: PySyncObjCounter() for n in ps}
        nodes = {n: raftkv.ReplicatedNode(objs[n], n, a, ps, SECRET, data_dir=str(tmp_path / n))
                 for n, a in ps.items()}
        return objs, nodes

    def caught_up(nodes: dict[str, raftkv.ReplicatedNode]) -> None:
        for node in nodes.values():  # a read round: applied >= every acknowledged write
            node.node.read(node.group, lambda s: None).result(timeout=10)

    objs, nodes = start()
    try:
        nodes["n1"].wait_for_leader()
        for i in range(5):
            assert objs[f"n{i % 3 + 1}"].incr() == i + 1
            if i + 1 == checkpoint_after:
                caught_up(nodes)
                for node in nodes.values():
                    _on_loop(node, lambda s: s.checkpoint())
        caught_up(nodes)
        assert {o.get() for o in objs.values()} == {5}
        for node in nodes.values():
            g = _group_status(node)
            # The case under test: the checkpoint holds everything, or only the first 2.
            assert (g["checkpoint"] == g["applied"]) == (checkpoint_after == 5), g
    finally:
        for node in nodes.values():
            node.close()

    objs, nodes = start()
    try:
        nodes["n1"].wait_for_leader()
        caught_up(nodes)
        assert {n: o.get() for n, o in objs.items()} == {n: 5 for n in ps}
        assert objs["n2"].incr() == 6
    finally:
        for node in nodes.values():
            node.close()


# -- the round trip: every attribute, type for type -----------------------------------------
class SlottedBase(ReplicatedObject):
    __slots__ = ("__hidden", "shown")


class Thing(SlottedBase):
    """Public, private and name-mangled attributes, slots of a base class, and a __dict__."""

    def __init__(self) -> None:
        self.__mangled = "set by the class's own code"
        self._private = 1
        self.public = 2

    @replicated
    def noop(self) -> None: ...

    def set_slots(self, hidden: Any, shown: Any) -> None:
        for name, value in (("_SlottedBase__hidden", hidden), ("shown", shown)):
            if value is _UNSET:
                if hasattr(self, name):
                    delattr(self, name)
            else:
                setattr(self, name, value)


_UNSET = object()  # an empty slot


def typed(x: Any) -> Any:
    """``x`` as a tree that tells types apart (1, 1.0 and True; -0.0 and 0.0; a list and a
    tuple; a set and a frozenset; deques by maxlen); dicts keep their order."""
    t = type(x)
    if t in (list, tuple):
        return (t.__name__, [typed(i) for i in x])
    if t is deque:
        return ("deque", x.maxlen, [typed(i) for i in x])
    if t is dict:
        return ("dict", [(typed(k), typed(v)) for k, v in x.items()])
    if t in (set, frozenset):
        return (t.__name__, sorted(repr(typed(i)) for i in x))
    if t is float:
        return ("float", x.hex())
    return (t.__name__, x)


def full_state(obj: ReplicatedObject) -> Any:
    slots = {n: typed(getattr(obj, n, _UNSET)) for n in ("_SlottedBase__hidden", "shown")}
    return typed(dict(sorted(vars(obj).items()))), slots  # attribute order is no state


scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=1 << 63).map(lambda n: -n)
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
)
hashables = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3).map(tuple) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
values = st.recursive(
    scalars | hashables,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(hashables, inner, max_size=4)
        | st.sets(hashables, max_size=4)
        | st.frozensets(hashables, max_size=4)
        | st.builds(deque, st.lists(inner, max_size=4))
        | st.builds(lambda items, extra: deque(items, len(items) + extra),
                    st.lists(inner, max_size=4), st.integers(0, 2))
    ),
    max_leaves=12,
)
names = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda n: not hasattr(Thing, n))  # not a method or a slot
attributes = st.dictionaries(
    st.one_of(names, names.map(lambda n: "_" + n), names.map(lambda n: "_Thing__" + n)),
    values, max_size=6,
)


def rebuilt(x: Any) -> Any:
    """An equal copy whose sets were filled in another order (and so may iterate in one)."""
    t = type(x)
    if t in (list, tuple):
        return t(rebuilt(i) for i in x)
    if t is deque:
        return deque((rebuilt(i) for i in x), x.maxlen)
    if t is dict:
        return {rebuilt(k): rebuilt(v) for k, v in x.items()}
    if t in (set, frozenset):
        return t(rebuilt(i) for i in reversed(list(x)))
    return x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attrs=attributes,
    dropped=st.sets(st.sampled_from(["_Thing__mangled", "_private", "public"])),
    hidden=st.just(_UNSET) | values,
    shown=st.just(_UNSET) | values,
)
def test_snapshot_restores_every_attribute_type_for_type_and_is_deterministic(
    attrs: dict[str, Any], dropped: set[str], hidden: Any, shown: Any,
) -> None:
    obj = Thing()
    for name in dropped:
        delattr(obj, name)
    for name, value in attrs.items():
        setattr(obj, name, value)
    obj.set_slots(hidden, shown)
    data = obj.snapshot()

    fresh = Thing()  # its own defaults and empty slots: restore replaces all of it
    fresh.set_slots("stale", _UNSET)
    fresh.restore(data)
    assert full_state(fresh) == full_state(obj)
    assert fresh.snapshot() == data

    # The same state built in another order gives the same bytes.
    twin = Thing()
    for name in ["_Thing__mangled", "_private", "public"]:
        delattr(twin, name)
    for name, value in reversed(list(vars(obj).items())):
        setattr(twin, name, rebuilt(value))
    twin.set_slots(rebuilt(hidden), rebuilt(shown))
    assert twin.snapshot() == data


def test_set_members_are_written_in_one_order_whatever_the_hash_seed() -> None:
    """str hashes differ between processes, and so does a set's iteration order; the
    replicas' snapshots must not."""
    code = (
        "import sys; from raftkv.statemachine import encode_value; "
        "sys.stdout.write(encode_value({'apple', 'pear', 'fig', 'kiwi', 'plum', ('t', 1), "
        "frozenset({'x', 'y', 'z'})}).hex())"
    )
    outputs = {
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1
    assert decode_value(bytes.fromhex(outputs.pop())) == {
        "apple", "pear", "fig", "kiwi", "plum", ("t", 1), frozenset({"x", "y", "z"})
    }


# -- extension types as arguments, and strict decoding ----------------------------------------
class Box(ReplicatedObject):
    def __init__(self) -> None:
        self.items: dict[Any, Any] = {}

    @replicated
    def put(self, key: Any, value: Any) -> Any:
        self.items[key] = value
        return value


def test_sets_deques_and_big_ints_travel_as_arguments_type_for_type() -> None:
    box = Box()
    Group(box)
    sent = {
        "set": {1, "a", (2, 3)},
        "frozenset": frozenset({b"x", frozenset({1})}),
        "deque": deque([1, [2], {3: 4}]),
        "bounded": deque([1, 2], maxlen=3),
        "big": 1 << 200,
        "negative": -(1 << 64) - 7,
        "edges": [(1 << 64) - 1, 1 << 64, -(1 << 63), -(1 << 63) - 1],
    }
    for key, value in sent.items():
        assert typed(box.put(key, value)) == typed(value)
    assert box.put(frozenset({1, 2}), "a frozenset is a key") == "a frozenset is a key"
    assert typed(box.items) == typed({**sent, frozenset({1, 2}): "a frozenset is a key"})
    assert box.items["bounded"].maxlen == 3


def test_subclasses_and_self_containing_values_are_refused_with_a_type_error() -> None:
    class MySet(set[int]):
        pass

    class MyDeque(deque[int]):
        pass

    looped: deque[Any] = deque()
    looped.append(looped)
    for bad, message in [(MySet({1}), "subclass of set"), (MyDeque([1]), "subclass of deque"),
                         (looped, "msgpack-serialisable")]:
        with pytest.raises(TypeError, match=message):
            encode_value(bad)
    assert decode_value(encode_value(deque([1], maxlen=1))) == deque([1])


class _Boom:
    """A pickle payload that would record its own execution."""

    ran = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_boom, ())


def _boom() -> None:
    _Boom.ran = True


def _ext(code: int, payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, payload))


def test_extension_types_decode_strictly_and_never_reach_pickle() -> None:
    good = {
        2: (msgpack.packb([1, 2]), {1, 2}),
        3: (msgpack.packb(["a"]), frozenset({"a"})),
        4: (msgpack.packb([2, [1, 2]]), deque([1, 2], maxlen=2)),
        5: (b"\x01" + bytes(8), 1 << 64),
    }
    for code, (payload, value) in good.items():
        assert typed(decode_value(_ext(code, payload))) == typed(value)
    assert decode_value(_ext(4, msgpack.packb([None, []]))).maxlen is None  # type: ignore[attr-defined]

    bad = [
        _ext(2, msgpack.packb({"not": "an array"})),
        _ext(2, msgpack.packb([[1], [1]])),  # unhashable members
        _ext(2, msgpack.packb([1, 1])),  # the same member twice
        _ext(3, msgpack.packb([{}])),
        _ext(3, b"\xc1"),  # not msgpack
        _ext(4, msgpack.packb([1, 2, 3])),
        _ext(4, msgpack.packb([-1, []])),
        _ext(4, msgpack.packb([True, []])),
        _ext(4, msgpack.packb(["2", []])),
        _ext(4, msgpack.packb([1, [1, 2]])),  # more items than maxlen
        _ext(4, msgpack.packb([None, {}])),
        _ext(5, b""),
        _ext(5, b"\x01"),  # fits in 64 bits: msgpack's own int
        _ext(5, b"\x00" * 8 + b"\x01"),  # fits in 64 bits
        _ext(5, b"\x00\x01" + bytes(8)),  # not the canonical length
        _ext(1, msgpack.packb(7)),
        _ext(99, b""),
    ]
    hostile = pickle.dumps(_Boom())
    bad += [_ext(code, hostile) for code in range(1, 128) if code != 5]
    for data in bad:
        with pytest.raises(ValueError):
            decode_value(data)
    assert type(decode_value(_ext(5, hostile))) is int  # as a big int, any bytes are a number
    assert not _Boom.ran

    box = Box()
    g = Group(box)
    results = [g.propose(msgpack.packb(["put", ["k", msgpack.ExtType(2, b"\xc1")], {}]))
               .result(0), g.propose(encode_call("put", ("k", {1}), {})).result(0)]
    assert type(results[0]).__name__ == "MalformedCommand" and results[1] == {1}


# -- a state that cannot be encoded fails loudly, and the log is kept ----------------------------
class Keeper(ReplicatedObject):
    def __init__(self) -> None:
        self.total = 0

    @replicated
    def add(self, n: int) -> int:
        self.total += n
        return self.total

    @replicated
    def forget(self, name: str) -> None:
        delattr(self, name)


@pytest.mark.parametrize("kind", ["open_file", "lambda", "custom_instance"])
def test_unencodable_private_attribute_fails_the_snapshot_naming_it(
    tmp_path: Path, kind: str,
) -> None:
    obj = Keeper()
    with open(tmp_path / "f", "w") as handle:
        value = {"open_file": handle, "lambda": lambda: 1, "custom_instance": Keeper()}[kind]
        obj._Keeper__handle = value  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match=r"Keeper\._Keeper__handle"):
            obj.snapshot()


def test_failed_checkpoint_is_a_storage_error_and_keeps_the_checkpoint_and_the_log(
    tmp_path: Path,
) -> None:
    obj = Keeper()
    g = Group(obj, tmp_path, checkpoint_entries=2, checkpoint_seconds=60.0)
    obj.add(1)
    before = g.store.checkpoint()
    file = (tmp_path / CHECKPOINT_FILE).read_bytes()
    obj._cache = lambda: 1  # type: ignore[attr-defined]
    obj.add(2)
    for attempt in (g.store.checkpoint, lambda: compact(g.log, g.store, g.raft.conf_at)):
        with pytest.raises(StorageError, match=r"snapshot\(\) failed.*Keeper\._cache"):
            attempt()
        assert g.store.checkpoint_index() == before < g.store.applied_index()
        assert g.log.first_index() == 1  # nothing compacted
        assert (tmp_path / CHECKPOINT_FILE).read_bytes() == file
    # Tried again when the policy is due again, counted from the failure: not at every apply.
    assert not g.store.checkpoint_due(0.0)
    obj.forget("_cache")
    assert not g.store.checkpoint_due(0.0)
    obj.add(3)
    assert g.store.checkpoint_due(0.0)
    assert g.store.checkpoint() == g.store.applied_index()
    reopened = Keeper()
    UserStateStore(reopened, tmp_path)
    assert reopened.total == 6 and not hasattr(reopened, "_cache")


def test_node_logs_a_failed_checkpoint_keeps_running_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Every replica holds the same state, so a state that cannot be snapshotted used to
    stop the loop of every node at its first checkpoint: the whole group went down, and
    again after each restart. Now the node logs an error, neither checkpoints nor compacts
    past the last good checkpoint, and serves; a restart replays the log it kept."""
    monkeypatch.setattr(raftkv.embedded, "UserStateStore", functools.partial(
        UserStateStore, checkpoint_entries=1, checkpoint_seconds=0.05))
    ps = {"n1": f"127.0.0.1:{free_ports(1)[0]}"}
    kw: dict[str, Any] = {"data_dir": str(tmp_path),
                          "compaction": CompactionPolicy(max_entries=2, keep=0)}
    obj = Keeper()
    node = raftkv.ReplicatedNode(obj, "n1", ps["n1"], ps, SECRET, **kw)
    try:
        node.wait_for_leader()
        obj.add(1)
        _wait(lambda: (g := _group_status(node))["checkpoint"] == g["applied"])
        checkpointed = _group_status(node)["checkpoint"]
        with caplog.at_level(logging.ERROR, logger="raftkv.node.driver"):
            obj._Keeper__sock = object()  # type: ignore[attr-defined]
            assert obj.add(2) == 3
            assert obj.add(3) == 6
            _wait(lambda: "checkpoint failed" in caplog.text
                  and "compacting its log failed" in caplog.text)
        assert "Keeper._Keeper__sock" in caplog.text and node.node.failure is None
        g = _group_status(node)
        assert g["checkpoint"] == checkpointed < g["applied"]
        assert g["first_index"] <= checkpointed + 1  # the log after the checkpoint is kept
    finally:
        node.close()
    obj = Keeper()
    node = raftkv.ReplicatedNode(obj, "n1", ps["n1"], ps, SECRET, **kw)
    try:
        node.wait_for_leader()
        node.node.read(node.group, lambda s: None).result(timeout=10)
        assert obj.total == 6  # the checkpoint at 1, and the log after it
    finally:
        node.close()


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- snapshots written before version 2 ---------------------------------------------------------
class Legacy(ReplicatedObject):
    def __init__(self) -> None:
        self.items: dict[Any, Any] = {}
        self.blob = b""
        self._note = "local"

    @replicated
    def note(self, text: str) -> None:
        self._note = text


def _old_snapshot(public: dict[str, Any]) -> bytes:
    """What snapshot() wrote before version 2: a map of the public attributes, by name."""
    def pack(obj: Any) -> bytes:
        data: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True, default=tuples)
        return data

    def tuples(obj: Any) -> Any:
        assert type(obj) is tuple
        return msgpack.ExtType(1, pack(list(obj)))

    return pack(dict(sorted(public.items())))


def test_old_format_checkpoint_restores_public_attributes_and_the_next_keeps_everything(
    tmp_path: Path,
) -> None:
    """An old checkpoint file still opens: it replaces the public attributes and keeps the
    private ones, as the old code did. The next checkpoint is in the new format and holds
    the private ones too."""
    writer = UserStateStore(Legacy(), tmp_path)
    writer._write(7, _old_snapshot({"items": {(1, "t"): [1]}, "stale": None}))
    writer.close()
    obj = Legacy()
    obj.extra = "not in the old snapshot"  # type: ignore[attr-defined]
    obj._note = "kept"
    store = UserStateStore(obj, tmp_path)
    assert store.applied_index() == 7
    assert vars(obj) == {"items": {(1, "t"): [1]}, "stale": None, "_note": "kept"}
    with pytest.raises(ValueError, match="not a Legacy snapshot"):
        obj.restore(msgpack.packb({"_private": 1}))  # never in an old snapshot
    store.apply([(8, encode_call("note", ("replicated",), {}))])
    store.checkpoint()
    store.close()
    again = Legacy()
    UserStateStore(again, tmp_path)
    assert vars(again) == {"items": {(1, "t"): [1]}, "stale": None, "_note": "replicated"}


# -- the framework's bookkeeping -------------------------------------------------------------------
class Clashing(ReplicatedObject):
    """Attributes named as the framework's bookkeeping used to be."""

    def __init__(self) -> None:
        self._propose = "mine"
        self._applying_thread = 42
        self._replicated_methods = ["also mine"]  # type: ignore[misc, assignment]
        self._state = "a name the framework might have used"
        self.calls = 0

    @replicated
    def call(self) -> int:
        self.calls += 1
        self._propose += "!"
        return self.calls


def test_bookkeeping_is_not_in_the_snapshot_and_user_attributes_of_its_names_are_kept() -> None:
    obj = Clashing()
    Group(obj)
    assert obj.call() == 1 and obj.call() == 2
    attrs = {"_propose": "mine!!", "_applying_thread": 42, "_replicated_methods": ["also mine"],
             "_state": "a name the framework might have used", "calls": 2}
    assert vars(obj) == attrs
    state = decode_value(obj.snapshot())
    assert isinstance(state, list)
    version, saved = state
    assert version == 2 and saved == attrs
    copy = Clashing()
    Group(copy)
    copy.restore(obj.snapshot())
    assert vars(copy) == attrs
    assert copy.call() == 3  # still attached after a restore: the bookkeeping is not state
    assert copy._propose == "mine!!!"


def test_example_counter_is_the_pysyncobj_readme_counter() -> None:
    c = ExampleCounter()
    Group(c)
    c.incr(2)
    assert vars(c) == {"_Counter__counter": 2}
    copy = ExampleCounter()
    copy.restore(c.snapshot())
    assert copy.get() == 2
