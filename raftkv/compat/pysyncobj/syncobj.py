"""``SyncObj``, ``SyncObjConsumer`` and ``@replicated`` over a raftkv node.

The contract is PySyncObj 0.3.x's; what each option does, and every difference, is in
the package docstring (``raftkv.compat.pysyncobj``). This module docstring is how it
works.

Theory of operation
-------------------
A ``SyncObj`` is one raftkv ``EmbeddedNode`` hosting one Raft group whose state machine
(``_Machine``) is the ``SyncObj`` itself plus its consumers, in the order given: object
0 is the ``SyncObj``, object ``i`` is ``consumers[i - 1]``. The node id and the raft
address are the ``selfNode`` address; peers are ``selfNode`` and ``otherNodes``.

**Commands** are msgpack arrays (``raftkv.statemachine``'s codec: no pickle anywhere),
one log entry each:

- ``[0, object, "name_vN", [args], {kwargs}, origin, request]``: a replicated call.
  ``name_vN`` is PySyncObj's versioned method name (``@replicated(ver=N)``), chosen
  when the call is made from the cluster's enabled code version, so a replica always
  runs the version the caller meant.
- ``[1, version, origin, request]``: ``setCodeVersion``.
- ``[2, "add" | "rem", node, origin, request]``: a membership request. Raft
  changes membership only on its leader, and raftkv forwards only log entries to it,
  so the request travels as an entry: the replica that leads when it applies the entry
  proposes the configuration change (``_carry_out``).
- ``[3, origin, request, code]``: the outcome of such a change, for the node that asked.

``origin`` and ``request`` (the proposing node's id and a number it drew) are null for
calls nobody waits on.

**Results stay local.** Every replica applies every entry; the replica whose id is the
entry's ``origin`` looks the request up in its waiters and completes it with the value
*its own* apply returned, as PySyncObj does. So a result is never serialised (a method
may return anything, a tuple or a set stays one), and a method's exception reaches
its caller as the exception it is. The node's future for the proposal (resolved by the
leader's answer) says only whether the entry made it and at which index; if the entry
reaches this replica inside a snapshot, its result is unknown (``UNKNOWN_OUTCOME``).

**Threads.** The raftkv driver thread applies entries and resolves sync calls' futures.
Callbacks (``callback=``, ``onReady``, ``onStateChanged``, ``onCodeVersionChanged``) are
queued and run by ``_onTick``: on the tick thread when ``autoTick`` is on, else inside
the program's ``doTick``, as in PySyncObj. So a callback may make sync calls.

**Start.** A subclass sets its state after ``super().__init__()`` (the README's
``self.__counter = 0``). The node, which restores the checkpoint and replays the log into
the object, therefore starts when the outermost ``__init__`` returns, never inside
``SyncObj.__init__`` (each subclass's ``__init__`` is wrapped for that, see
``__init_subclass__``).

**Snapshots** hold, for each object, the attributes PySyncObj would serialise: every
entry of its ``__dict__`` except those that existed when ``SyncObj.__init__`` (or
``SyncObjConsumer.__init__``) returned, plus the enabled code version and the index of
the last applied call. The framework's own state lives in slots, never in ``__dict__``.
An attribute that is not plain data fails the checkpoint loudly, naming it; the log is
then kept (``raftkv.node.user_state``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any, cast

from pysyncobj.monotonic import monotonic

from raftkv.compat.pysyncobj.admin import SyncObjAdmin
from raftkv.compat.pysyncobj.config import (
    FAIL_REASON,
    TICK_SECONDS,
    SyncObjConf,
    resolve,
)
from raftkv.compat.pysyncobj.node import Node, TCPNode, node_id
from raftkv.core import (
    ConfChangeOp,
    ConfChangeRejected,
    LeaderStepping,
    NotLeader,
    ProposalDropped,
    Role,
    TransferRejected,
)
from raftkv.core.membership import ConfChange
from raftkv.embedded import EmbeddedNode
from raftkv.node.driver import log_snapshot_failed
from raftkv.node.errors import NodeStopped, RemoteError, RequestTimeout
from raftkv.node.stores import claim_data_dir
from raftkv.node.user_state import SnapshotFailed, UserStateStore
from raftkv.recovery.compaction import compact
from raftkv.statemachine import decode_value, encode_value
from raftkv.storage.commands import MAX_COMMAND_BYTES
from raftkv.storage.dir_lock import release_data_dir
from raftkv.storage.layout import DEFAULT_GROUP, group_paths

__all__ = [
    "VERSION",
    "SyncObj",
    "SyncObjConsumer",
    "SyncObjException",
    "SyncObjExceptionWrongVer",
    "replicated",
    "replicated_sync",
]

log = logging.getLogger("raftkv.compat.pysyncobj")

VERSION = "0.3.17"  # the PySyncObj API this layer follows

REQUEST_TIMEOUT = 5.0  # the driver's deadline for one proposal (retried, see _proposed)
READONLY_PREFIX = "readonly-"  # node ids of read-only nodes (SyncObj(None, ...))
READONLY_GRACE = 10.0  # seconds a disconnected read-only learner stays a member
_HOUSEKEEPING_TICKS = 5  # the loop's housekeeping runs every this many ticks

# Command kinds (first element of every entry). Written into the log: never renumber.
_CALL, _VERSION, _MEMBERSHIP, _RESULT = 0, 1, 2, 3
_SNAPSHOT_FORMAT = 2  # 1: without the attributes deleted since the constructor


class _RAFT_STATE:
    FOLLOWER = 0
    CANDIDATE = 1
    LEADER = 2


class _COMMAND_TYPE:
    REGULAR = 0
    NO_OP = 1
    MEMBERSHIP = 2
    VERSION = 3


class SyncObjException(Exception):
    def __init__(self, errorCode: Any, *args: Any, **kwargs: Any) -> None:
        Exception.__init__(self, errorCode, *args, **kwargs)
        self.errorCode = errorCode


class SyncObjExceptionWrongVer(SyncObjException):
    def __init__(self, ver: int) -> None:
        SyncObjException.__init__(self, "wrongVer")
        self.ver = ver


# Codes that say the command was not applied (and never will be): a call waiting for a
# leader (commandsWaitLeader) proposes it again, after _RETRY_PAUSE unless no leader was
# known (the node then holds it until one is).
_NOT_APPLIED = frozenset({FAIL_REASON.MISSING_LEADER, FAIL_REASON.NOT_LEADER,
                          FAIL_REASON.LEADER_CHANGED})
_RETRY_PAUSE = 0.05


def _fail_reason(exc: BaseException) -> int:
    """PySyncObj's code for why the node could not get a command applied."""
    if isinstance(exc, NotLeader):
        return FAIL_REASON.MISSING_LEADER if exc.leader is None else FAIL_REASON.NOT_LEADER
    if isinstance(exc, ProposalDropped):
        return FAIL_REASON.LEADER_CHANGED
    if isinstance(exc, RequestTimeout):
        # The leader we forwarded to was replaced before answering, or nothing came in
        # time: the entry may have committed. PySyncObj's LEADER_CHANGED says it did not
        # (found from outside: applied calls reported so, which a program retries).
        return FAIL_REASON.UNKNOWN_OUTCOME
    if isinstance(exc, RemoteError):
        return {
            "ProposalDropped": FAIL_REASON.LEADER_CHANGED,
            "NotLeader": FAIL_REASON.NOT_LEADER,
            "RequestTimeout": FAIL_REASON.UNKNOWN_OUTCOME,
        }.get(exc.kind, FAIL_REASON.REQUEST_DENIED)
    if isinstance(exc, ConfChangeRejected | TransferRejected | NodeStopped):
        return FAIL_REASON.REQUEST_DENIED
    return FAIL_REASON.REQUEST_DENIED


# -- the decorators ----------------------------------------------------------------------------
_RESERVED = frozenset({"callback", "sync", "timeout"})


def _decorate(func: Callable[..., Any], ver: int, sync: bool, timeout: float | None,
              namespace: dict[str, Any]) -> Callable[..., Any]:
    if not callable(func):
        raise TypeError("@replicated decorates a method")
    name = func.__name__
    sig = inspect.signature(func)
    clash = _RESERVED.intersection(sig.parameters)
    if clash:
        raise TypeError(f"replicated method {name}() cannot have a parameter named "
                        f"{min(clash)!r}: callback, sync and timeout are reserved")

    @functools.wraps(func)
    def newFunc(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _invoke(self, newFunc, args, kwargs)

    attrs: dict[str, Any] = newFunc.__dict__
    attrs.update(replicated=True, ver=ver, origName=name, _compat_func=func,
                 _compat_sync=sync, _compat_timeout=timeout, _compat_sig=sig)
    # PySyncObj's versioning: a later ``@replicated(ver=1) def f`` replaces ``f`` in the
    # class body, so each version is also kept as ``f_v<ver>`` there.
    if "__module__" in namespace and "__qualname__" in namespace:
        namespace[f"{name}_v{ver}"] = newFunc
    return newFunc


def _version(kwargs: dict[str, Any], allowed: frozenset[str]) -> int:
    extra = set(kwargs) - allowed
    if extra:
        raise TypeError(f"unexpected decorator argument {min(extra)!r}")
    ver = kwargs.get("ver", 0)
    if type(ver) is not int or ver < 0:
        raise TypeError(f"ver must be an int >= 0, not {ver!r}")
    return ver


def replicated(*decArgs: Any, **decKwargs: Any) -> Any:
    """Mark a method that changes replicated state (PySyncObj's decorator).

    A call proposes the method and its arguments (msgpack, checked before anything is
    proposed: ``TypeError`` if they do not fit) and returns at once, with None. Reserved
    keyword arguments: ``callback=fn`` gets ``fn(result, FAIL_REASON)`` once the call is
    applied here or has failed; ``sync=True`` blocks and returns the result, raising
    ``SyncObjException(code)`` on failure or the method's own exception; ``timeout=s``
    bounds a sync call (``SyncObjException('Timeout')``). ``@replicated(ver=N)`` is
    PySyncObj's code versioning.
    """
    if len(decArgs) == 1 and not decKwargs and callable(decArgs[0]):
        return _decorate(decArgs[0], 0, False, None, sys_frame_locals(1))
    if decArgs:
        raise TypeError("@replicated takes only the keyword argument ver=")
    ver = _version(decKwargs, frozenset({"ver"}))

    def deco(func: Callable[..., Any]) -> Callable[..., Any]:
        return _decorate(func, ver, False, None, sys_frame_locals(1))

    return deco


def replicated_sync(*decArgs: Any, **decKwargs: Any) -> Any:
    """As ``@replicated``, but calls block by default (``sync=True``). ``timeout=`` given
    to the decorator is the default timeout of its calls."""
    if len(decArgs) == 1 and not decKwargs and callable(decArgs[0]):
        return _decorate(decArgs[0], 0, True, None, sys_frame_locals(1))
    if decArgs:
        raise TypeError("@replicated_sync takes only the keyword arguments ver= and timeout=")
    ver = _version(decKwargs, frozenset({"ver", "timeout"}))
    timeout = decKwargs.get("timeout")

    def deco(func: Callable[..., Any]) -> Callable[..., Any]:
        return _decorate(func, ver, True, timeout, sys_frame_locals(1))

    return deco


def sys_frame_locals(depth: int) -> dict[str, Any]:
    """The local namespace of the caller of our caller's caller (``depth`` above it):
    the class body a decorator is used in."""
    import sys

    frame = sys._getframe(depth + 1)
    return frame.f_locals


def _invoke(obj: Any, wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    func = wrapper._compat_func
    if kwargs.pop("_doApply", False):  # PySyncObj's escape hatch: run here, now
        return func(obj, *args, **kwargs)
    callback = kwargs.pop("callback", None)
    sync = bool(kwargs.pop("sync", wrapper._compat_sync))
    timeout = kwargs.pop("timeout", wrapper._compat_timeout)
    if callback is not None:
        if not callable(callback):
            raise TypeError(f"{wrapper.origName}(): callback must be callable "
                            f"(fn(result, error)), not {type(callback).__name__}")
        sync = False
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, int | float)):
        raise TypeError(f"{wrapper.origName}(): timeout must be a number of seconds or "
                        f"None, not {type(timeout).__name__}")
    if isinstance(obj, SyncObj):
        engine, index = _engine(obj), 0
        if engine is None:
            raise SyncObjException("SyncObj.__init__ was not called")
    elif isinstance(obj, SyncObjConsumer):
        owner = obj.__dict__.get("_syncObj")
        if owner is None:  # destroyed with its SyncObj: answered as that SyncObj's calls
            owner = _DESTROYED_WITH.get(obj)
        engine = _engine(owner) if isinstance(owner, SyncObj) else None
        if engine is None:
            raise SyncObjException(
                f"{type(obj).__name__} is not attached to a SyncObj: pass it in "
                "SyncObj(..., consumers=[...])")
        index = engine.machine.index_of(obj)
    else:
        raise SyncObjException("Class should be inherited from SyncObj or SyncObjConsumer")
    if engine.machine.applying == threading.get_ident():
        # A replicated method calling another while it is applied: it is already being
        # applied on every replica, so run it (proposing it would apply it twice).
        return func(obj, *args, **kwargs)
    try:
        wrapper._compat_sig.bind(obj, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{wrapper.origName}(): {e}") from None
    return engine.call(index, wrapper.origName, args, kwargs, callback, sync, timeout)


# -- framework state kept off the objects' __dict__ ---------------------------------------
def _engine(obj: Any) -> _Engine | None:
    try:
        engine: _Engine | None = _ENGINE_SLOT.__get__(obj, SyncObj)
        return engine
    except AttributeError:
        return None


def _framework_names(obj: Any) -> frozenset[str]:
    """The ``__dict__`` names PySyncObj would not serialise: those set before its base
    ``__init__`` returned."""
    if isinstance(obj, SyncObj):
        engine = _engine(obj)
        return engine.framework if engine is not None else frozenset()
    try:
        names: frozenset[str] = _CONSUMER_SLOT.__get__(obj, SyncObjConsumer)
        return names
    except AttributeError:  # a consumer whose __init__ did not call super().__init__()
        return frozenset({"_syncObj"})


def _collect_methods(cls: type) -> dict[str, Any]:
    """``name_vN`` -> the decorated wrapper, for every replicated method of ``cls``."""
    table: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            if getattr(value, "replicated", False) is not True:
                continue
            if not hasattr(value, "_compat_func"):
                continue
            vname = f"{value.origName}_v{value.ver}"
            if attr in (vname, value.origName):
                table[vname] = value
    return table


class _Machine:
    """The group's state machine: the SyncObj and its consumers (module docstring)."""

    def __init__(self, engine: _Engine, objects: list[Any]) -> None:
        self.engine = engine
        self.objects = objects
        self.tables = [_collect_methods(type(o)) for o in objects]
        self.versions: list[dict[str, list[int]]] = []
        for table in self.tables:
            by_name: dict[str, set[int]] = {}
            for w in table.values():
                by_name.setdefault(w.origName, set()).add(w.ver)
            self.versions.append({k: sorted(v) for k, v in by_name.items()})
        self.self_code_version = max(
            (w.ver for t in self.tables for w in t.values()), default=0)
        self.enabled_version = 0
        self.last_index = 0  # of the last replicated call applied (in snapshots too)
        self.applying: int | None = None  # the thread inside a replicated method
        # The objects' state as their constructors left it (``restore`` starts from it),
        # and the names in it, per object.
        self.initial: bytes | None = None
        self.initial_names: list[frozenset[str]] = [frozenset() for _ in objects]

    def capture_initial(self) -> None:
        """Note the state the constructors gave the objects, just before the node starts
        and restores anything into them."""
        states = self._states()
        self.initial_names = [frozenset(s) for s in states]
        try:
            self.initial = encode_value(states)
        except TypeError:  # not plain data: no snapshot of it could be taken either
            self.initial = None

    def _states(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in sorted(vars(obj).items()) if k not in _framework_names(obj)}
                for obj in self.objects]

    def index_of(self, obj: Any) -> int:
        for i, o in enumerate(self.objects):
            if o is obj:
                return i
        raise SyncObjException(f"{type(obj).__name__} is not a consumer of this SyncObj")

    def method_name(self, index: int, name: str) -> str:
        """``name_vN``: the newest version of ``name`` the cluster has enabled."""
        versions = self.versions[index].get(name)
        enabled = self.enabled_version
        usable = [v for v in versions or () if v <= enabled]
        if not usable:
            raise SyncObjException(
                f"{type(self.objects[index]).__name__}.{name}() has no version enabled "
                f"(the cluster runs code version {enabled}): call setCodeVersion first")
        return f"{name}_v{usable[-1]}"

    # -- StateMachine ------------------------------------------------------------------------
    def apply(self, index: int, command: bytes) -> object:
        try:
            cmd = decode_value(command)
        except ValueError as e:
            log.error("log entry %d is not a command of this layer: %s", index, e)
            return None
        if type(cmd) is not list or not cmd or type(cmd[0]) is not int:
            log.error("log entry %d is not a command of this layer", index)
            return None
        kind = cmd[0]
        try:
            if kind == _CALL and len(cmd) == 7:
                self._apply_call(index, cmd)
            elif kind == _VERSION and len(cmd) == 4:
                self._apply_version(cmd)
            elif kind == _MEMBERSHIP and len(cmd) == 5:
                self.engine.membership_applied(cmd[1], cmd[2], cmd[3], cmd[4])
            elif kind == _RESULT and len(cmd) == 4:
                if cmd[1] == self.engine.id and type(cmd[3]) is int:
                    self.engine.resolve(cmd[2], None, cmd[3])
            else:
                log.error("log entry %d has unknown command kind %r", index, kind)
        except Exception:
            log.exception("log entry %d could not be applied", index)
        self.last_index = index
        return None  # results stay local: see the module docstring

    def _apply_call(self, index: int, cmd: list[Any]) -> None:
        _, obj, name, args, kwargs, origin, request = cmd
        wrapper = None
        if type(obj) is int and 0 <= obj < len(self.objects) and type(name) is str:
            wrapper = self.tables[obj].get(name)
        if wrapper is None or type(args) is not list or type(kwargs) is not dict:
            err: Exception = SyncObjException(
                f"log entry {index} names no replicated method of this program "
                f"(object {obj!r}, method {name!r}): do all nodes run the same code?")
            log.error("%s", err)
            result: Any = err
            raised = True
        else:
            target = self.objects[obj]
            outer, self.applying = self.applying, threading.get_ident()
            try:
                result = wrapper._compat_func(target, *args, **kwargs)
                raised = False
            except Exception as e:  # noqa: BLE001 - the same on every replica
                result, raised = e, True
                log.warning("replicated %s.%s raised %r at log index %d (the same on every "
                            "replica)", type(target).__name__, name, e, index)
            finally:
                self.applying = outer
        if origin == self.engine.id and request is not None:
            code = FAIL_REASON.REQUEST_DENIED if raised else FAIL_REASON.SUCCESS
            self.engine.resolve(request, result, code, raised)

    def _apply_version(self, cmd: list[Any]) -> None:
        _, ver, origin, request = cmd
        if type(ver) is not int:
            return
        old = self.enabled_version
        if ver > self.self_code_version:
            log.error("the cluster switched to code version %d; this node's code has only "
                      "up to version %d: upgrade it", ver, self.self_code_version)
        if ver > old:
            self.enabled_version = ver
            self.engine.event(self.engine.conf.onCodeVersionChanged, old, ver)
        if origin == self.engine.id and request is not None:
            self.engine.resolve(request, None, FAIL_REASON.SUCCESS)

    def snapshot(self) -> bytes:
        """``[2, enabled version, last call's index, [state of each object], [names its
        constructor made that the state no longer has, per object]]``."""
        states = self._states()
        gone = [sorted(names - state.keys())
                for names, state in zip(self.initial_names, states, strict=True)]
        try:
            return encode_value([_SNAPSHOT_FORMAT, self.enabled_version, self.last_index,
                                 states, gone])
        except TypeError:
            pass
        for obj, state in zip(self.objects, states, strict=True):  # name the culprit
            base = "SyncObj" if isinstance(obj, SyncObj) else "SyncObjConsumer"
            for k, v in state.items():
                encode_value(v, f"{type(obj).__name__}.{k} (every attribute set after "
                                f"{base}.__init__ is replicated state)")
        raise TypeError("the state encodes attribute by attribute but not as a whole "
                        "(nesting too deep?)")

    def restore(self, data: bytes) -> None:
        snap = decode_value(data)
        if (type(snap) is not list or len(snap) not in (4, 5) or snap[0] not in (1, 2)
                or len(snap) != snap[0] + 3 or type(snap[1]) is not int
                or type(snap[2]) is not int or type(snap[3]) is not list):
            raise ValueError("not a raftkv.compat.pysyncobj snapshot")
        enabled, last, states = snap[1:4]
        # Format 1 (before format 2 named the deleted attributes) was the whole state, and
        # was restored as such: any attribute it does not name is deleted, or a replica
        # restoring it would get back one that a method deleted (found in review).
        gone = snap[4] if len(snap) == 5 else [
            sorted(names - state.keys()) if type(state) is dict else []
            for names, state in zip(self.initial_names, states, strict=False)]
        if len(states) != len(self.objects) or type(gone) is not list or len(gone) != len(states):
            raise ValueError(
                f"the snapshot holds the state of {len(states)} objects, this SyncObj has "
                f"{len(self.objects)} (itself and its consumers): did consumers= change?")
        if not all(type(s) is dict and all(type(k) is str for k in s) for s in states) or \
                not all(type(g) is list and all(type(k) is str for k in g) for g in gone):
            raise ValueError("a snapshot's object state is not a map of attributes")
        # The state is what the constructors made, less what the snapshot says was deleted
        # since, with the snapshot's attributes over it: what the replica that took it
        # had, and an attribute a newer version's __init__ adds keeps its value, as
        # PySyncObj keeps it (it sets the dump's attributes one by one; found from
        # outside: an upgraded program's new attribute was deleted by the restart).
        bases = (cast(list[dict[str, Any]], decode_value(self.initial))
                 if self.initial is not None else [{} for _ in self.objects])
        for obj, base, state, deleted in zip(self.objects, bases, states, gone, strict=True):
            framework = _framework_names(obj)
            attrs = vars(obj)
            for k in [k for k in attrs if k not in framework]:
                del attrs[k]
            attrs.update((k, v) for k, v in base.items()
                         if k not in framework and k not in deleted)
            attrs.update((k, v) for k, v in state.items() if k not in framework)
        self.enabled_version = enabled
        self.last_index = last
        self.engine.restored(last)


@dataclass
class _Waiter:
    callback: Callable[[Any, int], Any] | None
    future: Future[tuple[Any, int, bool]] | None
    index: int | None = None  # the entry's index, once the leader has answered
    expires: float | None = None
    member: tuple[str, str] | None = None  # (op, node) of a membership request
    watch: bool = False  # a membership request applied here: watch the configuration


class _Engine:
    """Everything a SyncObj runs on; kept in a slot of the SyncObj (module docstring)."""

    def __init__(self, owner: SyncObj, self_node: Node | str | None, other_nodes: Any,
                 conf: SyncObjConf | None, consumers: list[Any] | None,
                 node_class: type) -> None:
        self.owner = owner
        self.conf = conf if conf is not None else SyncObjConf()
        self.settings = resolve(self.conf)
        self.node_class = node_class
        objs: list[Any] = []
        for c in consumers or []:
            if not isinstance(c, SyncObjConsumer) and getattr(c, "_consumer", None):
                c = c._consumer()
            if not isinstance(c, SyncObjConsumer):
                raise SyncObjException("Consumers must be inherited from SyncObjConsumer")
            objs.append(c)
        self.consumers = objs
        self.readonly = self_node is None
        others = [node_id(n) for n in other_nodes]
        if self.readonly:
            if not others:
                raise ValueError("a read-only node (selfNode=None) needs otherNodes to follow")
            host = _local_ip(others[0])
            self.bind = self.conf.bindAddress or f"{host}:{_free_port(host)}"
            self.id = f"{READONLY_PREFIX}{uuid.uuid4().hex[:12]}"
            if self.settings.data_dir is not None:
                log.warning("a read-only node keeps nothing on disk: journalFile and "
                            "fullDumpFile are ignored (it gets a snapshot when it joins)")
        else:
            assert self_node is not None
            self.id = node_id(self_node)
            self.bind = self.conf.bindAddress or self.id
        self.others = [n for n in others if n != self.id]
        self.peers = {n: n for n in self.others}
        if not self.readonly:
            self.peers[self.id] = self.bind
        self.group = DEFAULT_GROUP
        self.machine = _Machine(self, [owner, *objs])
        self.framework: frozenset[str] = frozenset()
        for c in objs:
            c.__dict__["_syncObj"] = owner
        self.embedded: EmbeddedNode | None = None
        self.started = False
        self.bind_failed = False
        self.destroyed = False
        self.start_time = monotonic()
        self._lock = threading.Lock()
        self._requests = itertools.count(random.getrandbits(48))
        self._waiters: dict[int, _Waiter] = {}
        self._inflight = 0
        # Calls made before the node runs (in the subclass's __init__, or while the bind is
        # retried): proposed, in order, once it does, as PySyncObj's command queue holds
        # them until there is a leader. None once the node runs.
        self._unstarted: list[tuple[bytes, int | None, float | None]] | None = []
        self._events: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = SimpleQueue()
        self._tick_callbacks: list[Callable[[], Any]] = []
        self._ready = False
        self._ready_probe: Future[Any] | None = None
        self._state = _RAFT_STATE.FOLLOWER
        self._leader: str | None = None
        self._ticks = 0
        self._ro_change: Future[Any] | None = None
        self._ro_down: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._initialised = threading.Event()
        self._closing = threading.Event()
        self._start_error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the node: on the tick thread with autoTick (the constructor waits for the
        first bind attempt, as PySyncObj's does), else here, retrying the bind."""
        if self.started or self.destroyed:
            return
        self.started = True
        self.machine.capture_initial()
        if self.conf.autoTick:
            self._thread = threading.Thread(
                target=_tick_thread, args=(self, self.owner), daemon=True,
                name=f"syncobj-tick-{self.id}")
            self._thread.start()
            self._initialised.wait()
            if self._start_error is not None:
                raise self._start_error
        else:
            try:
                while not self._try_start():
                    if self.bind_failed:
                        raise SyncObjException("BindError")
            finally:
                self._initialised.set()  # what waitBinded waits for, on any path

    def _try_start(self) -> bool:
        """One bind attempt; True once the node runs."""
        tries = getattr(self, "_bind_tries", 0) + 1
        self._bind_tries = tries
        if not _bindable(self.bind):
            log.error("cannot bind %s (attempt %d)", self.bind, tries)
            if self.conf.maxBindRetries and tries >= self.conf.maxBindRetries:
                self.bind_failed = True
            else:
                time.sleep(self.conf.bindRetryTime)
            return False
        s = self.settings
        path = data_dir = None
        if s.data_dir is not None and not self.readonly:
            data_dir = s.data_dir
            path = group_paths(data_dir, self.group)[1]
        kw: dict[str, float] = {}
        if s.checkpoint_entries is not None:
            kw["checkpoint_entries"] = s.checkpoint_entries
        if s.checkpoint_seconds is not None:
            kw["checkpoint_seconds"] = s.checkpoint_seconds
        if data_dir is not None:
            # Before the store reads (and tidies) its checkpoint files: another process
            # running this node must keep them. The EmbeddedNode is handed the claim.
            claim_data_dir(data_dir, self.id)
        # In memory (no journalFile, or a read-only node): the log is in memory too.
        try:
            store = UserStateStore(self.machine, path, volatile=path is None,
                                   **kw)  # type: ignore[arg-type]
        except BaseException:
            if data_dir is not None:
                release_data_dir(data_dir)
            raise
        try:
            self.embedded = EmbeddedNode(
                self.id, self.bind, self.peers, s.secret,
                data_dir=None if self.readonly else s.data_dir, durable=True,
                join=self.readonly, tick_seconds=TICK_SECONDS,
                election_tick=s.election_tick, request_timeout=REQUEST_TIMEOUT, state=store,
                compaction=s.compaction,
                admin=lambda _: SyncObjAdmin(self.owner), claimed=data_dir is not None,
            )
        except OSError:
            log.exception("cannot start the node at %s", self.bind)
            self.bind_failed = True
            store.close()
            if data_dir is not None:  # a bind retried later claims it again
                release_data_dir(data_dir)
            return False
        except BaseException:
            if data_dir is not None:  # refused before the node took the claim over
                release_data_dir(data_dir)
            raise
        g = self.embedded.node.groups[self.group]
        self.embedded.node.call(lambda: self._hook(g)).result(timeout=REQUEST_TIMEOUT)
        with self._lock:
            queued, self._unstarted = self._unstarted or [], None
        for data, request, deadline in queued:
            self._propose(data, request, deadline)
        return True

    def _hook(self, g: Any) -> None:  # loop thread
        g.on_leader.append(self._observe)
        g.on_tick.append(self._on_loop_tick)
        self._observe(g)

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        self._closing.set()
        emb = self.embedded
        if emb is not None:
            if emb.node._thread is threading.current_thread():
                # Called from a replicated method: the loop cannot join itself.
                threading.Thread(target=emb.close, daemon=True).start()
            else:
                emb.close()
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            self._finish(w, None, FAIL_REASON.REQUEST_DENIED)
        for c in self.consumers:
            try:
                c._destroy()
            except Exception:
                log.exception("consumer %s failed to destroy", type(c).__name__)

    @property
    def running(self) -> bool:
        return self.embedded is not None and not self.destroyed

    # -- proposing ---------------------------------------------------------------------------
    def call(self, index: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             callback: Callable[[Any, int], Any] | None, sync: bool,
             timeout: float | None) -> Any:
        vname = self.machine.method_name(index, name)
        request = next(self._requests) if (sync or callback is not None) else None
        origin = self.id if request is not None else None
        data = encode_value([_CALL, index, vname, list(args), kwargs, origin, request],
                            f"the arguments of {name}()")
        if len(data) > MAX_COMMAND_BYTES:
            raise ValueError(f"the call {name}() encodes to {len(data)} bytes, over the limit "
                             f"of {MAX_COMMAND_BYTES} bytes for one log entry")
        return self.submit(data, request, callback, sync, timeout)

    def submit(self, data: bytes, request: int | None, callback: Callable[..., Any] | None,
               sync: bool, timeout: float | None, member: tuple[str, str] | None = None) -> Any:
        waiter = None
        if request is not None:
            waiter = _Waiter(callback, Future() if sync else None, member=member)
        code = self._admit(sync)
        if code is not None:
            if sync:
                raise SyncObjException(code)
            if callback is not None:
                self.event(callback, None, code)
            return None
        if waiter is not None:
            assert request is not None
            with self._lock:
                self._waiters[request] = waiter
        deadline = None if timeout is None else monotonic() + timeout
        self._propose(data, request, deadline)
        if waiter is None or waiter.future is None:
            return None
        assert request is not None
        try:
            result, code, raised = waiter.future.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._waiters.pop(request, None)
            raise SyncObjException("Timeout") from None
        if raised:
            raise result
        if code != FAIL_REASON.SUCCESS:
            raise SyncObjException(code)
        return result

    def _admit(self, sync: bool) -> int | None:
        """Why a command cannot even be proposed now, as a code; None if it can. Before the
        node runs, an asynchronous call waits for it (with ``commandsWaitLeader``); a sync
        one cannot, for the node starts only when the constructor that waits returns."""
        if self.destroyed:
            return FAIL_REASON.REQUEST_DENIED
        if self.embedded is None and (sync or not self.conf.commandsWaitLeader):
            return FAIL_REASON.MISSING_LEADER
        if self._inflight >= self.conf.commandsQueueSize:
            return FAIL_REASON.QUEUE_FULL
        if not self.conf.commandsWaitLeader and self._leader is None:
            return FAIL_REASON.MISSING_LEADER
        return None

    def _propose(self, data: bytes, request: int | None, deadline: float | None) -> None:
        with self._lock:
            if self._unstarted is not None:
                self._unstarted.append((data, request, deadline))
                return
            self._inflight += 1
        emb = self.embedded
        assert emb is not None
        fut = emb.node.propose(self.group, data)
        fut.add_done_callback(functools.partial(self._proposed, data, request, deadline))

    def _proposed(self, data: bytes, request: int | None, deadline: float | None,
                  f: Future[Any]) -> None:
        with self._lock:
            self._inflight -= 1
        exc = f.exception()
        if exc is None:
            if request is None:
                return
            index = f.result()[0]
            with self._lock:
                w = self._waiters.get(request)
                if w is None:
                    return  # applied here already
                if w.member is not None:
                    return  # the outcome comes from the leader or the configuration
                if self.machine.last_index >= index:
                    # Applied here, but not as this call: it came inside a snapshot.
                    del self._waiters[request]
                else:
                    w.index = index
                    w.expires = monotonic() + REQUEST_TIMEOUT
                    return
            self._finish(w, None, FAIL_REASON.UNKNOWN_OUTCOME)
            return
        code = _fail_reason(exc)
        if (code in _NOT_APPLIED and self.conf.commandsWaitLeader
                and self.running and (deadline is None or monotonic() < deadline)):
            # Never applied: safe to try again while the call waits for a leader. A
            # leader that changed gets a moment to be known (found in a test under load:
            # the first call of a cluster whose birth outlasted the request deadline
            # failed NOT_LEADER as the leader appeared).
            if code == FAIL_REASON.MISSING_LEADER:
                self._propose(data, request, deadline)
            else:
                retry = threading.Timer(_RETRY_PAUSE, self._propose, (data, request, deadline))
                retry.daemon = True
                retry.start()
            return
        if request is None:
            log.debug("a replicated call failed (%s): %r", code, exc)
            return
        with self._lock:
            w = self._waiters.get(request)
            # (An entry that came inside a snapshot image was applied unseen: nothing
            # more will come for it.)
            if (w is not None and code == FAIL_REASON.UNKNOWN_OUTCOME and w.member is None
                    and "through a snapshot" not in str(exc)):
                # If it did commit, its entry reaches this replica, whose apply resolves
                # the call (the entry names it): as PySyncObj, success is told by the
                # apply here. The leader that replaced the silent one commits it, if it
                # has it, with its first entry: a few election timeouts cover that on a
                # live cluster, and after them the outcome is told unknown (waiting a
                # request timeout held callers 5 s for entries that died with a leader).
                w.expires = monotonic() + 3 * self.settings.election_tick * TICK_SECONDS
                return
            self._waiters.pop(request, None)
        if w is not None:
            self._finish(w, None, code)

    def resolve(self, request: Any, result: Any, code: int, raised: bool = False) -> None:
        with self._lock:
            w = self._waiters.pop(request, None) if type(request) is int else None
        if w is not None:
            self._finish(w, result, code, raised)

    def restored(self, last_index: int) -> None:
        """A snapshot was installed: calls it covers have an unknown result."""
        with self._lock:
            done = [r for r, w in self._waiters.items()
                    if w.index is not None and w.index <= last_index]
            waiters = [self._waiters.pop(r) for r in done]
        for w in waiters:
            self._finish(w, None, FAIL_REASON.UNKNOWN_OUTCOME)

    def _finish(self, w: _Waiter, result: Any, code: int, raised: bool = False) -> None:
        if w.future is not None:
            if not w.future.done():
                w.future.set_result((result, code, raised))
        elif w.callback is not None:
            self.event(w.callback, result, code)

    def event(self, fn: Callable[..., Any] | None, *args: Any) -> None:
        """Run ``fn(*args)`` on the thread that ticks (``_onTick``)."""
        if fn is not None:
            self._events.put((fn, args))

    # -- membership --------------------------------------------------------------------------
    def change(self, op: str, node: Node | str, callback: Callable[..., Any] | None) -> None:
        member = node_id(node)
        request = next(self._requests)
        data = encode_value([_MEMBERSHIP, op, member, self.id, request])
        self.submit(data, request, callback, False, None, member=(op, member))

    def membership_applied(self, op: Any, member: Any, origin: Any, request: Any) -> None:
        """Apply of a membership request (loop thread): the leader carries it out; the
        node that asked starts watching the configuration for its effect."""
        if origin == self.id:
            with self._lock:
                w = self._waiters.get(request) if type(request) is int else None
                if w is not None:
                    w.watch = True
                    w.expires = monotonic() + 2 * REQUEST_TIMEOUT
        g = self._group()
        if g is None or g.raft.role != Role.LEADER or type(member) is not str:
            return
        self._carry_out(g, op, member, origin, request)

    def _carry_out(self, g: Any, op: Any, member: str, origin: Any, request: Any) -> None:
        members = g.raft.conf.members()
        if op == "add":
            if member in members:
                self._report(origin, request, FAIL_REASON.SUCCESS)
                return
            cc = ConfChange(ConfChangeOp.ADD_LEARNER, member, member.encode(), True)
        elif op == "rem":
            if member not in members:
                self._report(origin, request, FAIL_REASON.SUCCESS)
                return
            cc = ConfChange(ConfChangeOp.REMOVE, member)
        else:
            self._report(origin, request, FAIL_REASON.REQUEST_DENIED)
            return
        assert self.embedded is not None
        fut = self.embedded.node.change_membership(self.group, cc)

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if isinstance(exc, LeaderStepping):
                return  # the new leader performs it; the asker sees it in its configuration
            self._report(origin, request,
                         FAIL_REASON.SUCCESS if exc is None else _fail_reason(exc))

        fut.add_done_callback(done)

    def _report(self, origin: Any, request: Any, code: int) -> None:
        if origin is None or type(request) is not int:
            return
        if origin == self.id:
            self.resolve(request, None, code)
        elif self.running:
            assert self.embedded is not None
            self.embedded.node.propose(self.group, encode_value([_RESULT, origin, request, code]))

    def _watch_membership(self, g: Any, now: float) -> None:
        """Membership requests this node made, applied here: done once the configuration
        shows them (a leader that removed itself reports nothing), or unknown in time."""
        members = g.raft.conf.members()
        finished: list[tuple[_Waiter, int]] = []
        with self._lock:
            for r, w in list(self._waiters.items()):
                if w.member is None or not w.watch:
                    continue
                op, node = w.member
                if (node in members) == (op == "add"):
                    finished.append((self._waiters.pop(r), FAIL_REASON.SUCCESS))
                elif w.expires is not None and now > w.expires:
                    finished.append((self._waiters.pop(r), FAIL_REASON.UNKNOWN_OUTCOME))
        for w, code in finished:
            self._finish(w, None, code)

    # -- the loop's side (driver thread) ------------------------------------------------------
    def _group(self) -> Any:
        emb = self.embedded
        return None if emb is None else emb.node.groups.get(self.group)

    def _observe(self, g: Any) -> None:
        role = g.raft.role
        state = (_RAFT_STATE.LEADER if role == Role.LEADER else
                 _RAFT_STATE.FOLLOWER if role == Role.FOLLOWER else _RAFT_STATE.CANDIDATE)
        self._leader = g.leader
        if state != self._state:
            old, self._state = self._state, state
            self.event(self.conf.onStateChanged, old, state)

    def _on_loop_tick(self, g: Any) -> None:
        self._observe(g)
        self._ticks += 1
        if self._ticks % _HOUSEKEEPING_TICKS:
            return
        now = monotonic()
        if self._waiters:
            self._watch_membership(g, now)
            with self._lock:
                late = [r for r, w in self._waiters.items()
                        if w.member is None and w.expires is not None and now > w.expires]
                waiters = [self._waiters.pop(r) for r in late]
            for w in waiters:
                self._finish(w, None, FAIL_REASON.UNKNOWN_OUTCOME)
        if g.raft.role == Role.LEADER:
            self._admit_readonly(g, now)
        if self.readonly:
            assert self.embedded is not None
            # Keep a connection to every member (see _admit_readonly): the partners it was
            # given and every other member of its configuration. Nobody dials a read-only
            # node (its address is in no membership entry), and one that joined by
            # snapshot never saw the entries that carry the others' addresses: a member
            # added before it, once leader, reached it never (found from outside). A
            # member's id is its address here.
            t = self.embedded.node.transport
            members = {m for m in g.raft.conf.members()
                       if m != self.id and not m.startswith(READONLY_PREFIX)}
            for peer in sorted(set(self.others) | members):
                if peer not in t.peers or t.peers[peer].addr is None:
                    t.learn_address(peer, peer)
                t.ping(peer)

    def _admit_readonly(self, g: Any, now: float) -> None:
        """A read-only node (PySyncObj's SyncObj(None, ...)) dials every member; the
        leader adds it as a learner that is never promoted, and removes it once it has
        been gone for READONLY_GRACE seconds."""
        if self._ro_change is not None and not self._ro_change.done():
            return
        assert self.embedded is not None
        t = self.embedded.node.transport
        conf = g.raft.conf
        members = conf.members()
        for peer in t.connected_peers():
            if peer.startswith(READONLY_PREFIX) and peer not in members:
                cc = ConfChange(ConfChangeOp.ADD_LEARNER, peer, b"", False)
                self._ro_change = self.embedded.node.change_membership(self.group, cc)
                return
        live = set(t.connected_peers())
        for m in sorted(conf.learners):
            if not m.startswith(READONLY_PREFIX):
                continue
            if m in live:
                self._ro_down.pop(m, None)
                continue
            since = self._ro_down.setdefault(m, now)
            if now - since > READONLY_GRACE:
                self._ro_down.pop(m, None)
                cc = ConfChange(ConfChangeOp.REMOVE, m)
                self._ro_change = self.embedded.node.change_membership(self.group, cc)
                return

    # -- the tick (tick thread, or the program's doTick) ------------------------------------
    def tick(self, time_to_wait: float) -> None:
        """Run the queued callbacks, check readiness, run onTick callbacks, then wait up to
        ``time_to_wait`` for more callbacks to run."""
        deadline = monotonic() + max(0.0, time_to_wait)
        self._run_events(0.0)
        if self.running and not self._ready:
            probe = self._ready_probe
            if probe is None:
                if self._leader is not None:
                    assert self.embedded is not None
                    # A linearizable read returns once this replica has applied everything
                    # committed when it started: PySyncObj's "synced with the leader".
                    self._ready_probe = self.embedded.node.read(self.group, lambda s: None)
            elif probe.done():
                self._ready_probe = None
                if probe.exception() is None:
                    self._ready = True
                    self.event(self.conf.onReady)
        for cb in list(self._tick_callbacks):
            try:
                cb()
            except Exception:
                log.exception("onTick callback failed")
        self._run_events(deadline)

    def _run_events(self, deadline: float) -> bool:
        ran = False
        while True:
            try:
                remaining = deadline - monotonic()
                if ran or remaining <= 0:
                    fn, args = self._events.get_nowait()
                else:
                    fn, args = self._events.get(timeout=remaining)
            except Empty:
                return ran
            ran = True
            try:
                fn(*args)
            except Exception:
                log.exception("callback %r failed", fn)

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {
            "version": VERSION,
            "revision": "deprecated",
            "self": None if self.readonly else self.node_class(self.id),
            "state": self._state,
            "leader": None if self._leader is None else self.node_class(self._leader),
            "has_quorum": False,
            "partner_nodes_count": len(self.others),
            "readonly_nodes_count": 0,
            "log_len": 0,
            "last_applied": 0,
            "commit_idx": 0,
            "raft_term": 0,
            "next_node_idx_count": 0,
            "match_idx_count": 0,
            "leader_commit_idx": None,
            "uptime": int(monotonic() - self.start_time),
            "self_code_version": self.machine.self_code_version,
            "enabled_code_version": self.machine.enabled_version,
        }
        if not self.running:
            for n in self.others:
                st[f"partner_node_status_server_{n}"] = 0
            return st
        assert self.embedded is not None
        node = self.embedded.status()
        g = node["groups"][self.group]
        connected = set(node["connected"])
        partners = [n for n in g["members"] if n != self.id and not n.startswith(READONLY_PREFIX)]
        readonly = [n for n in g["members"] if n.startswith(READONLY_PREFIX) and n != self.id]
        st["partner_nodes_count"] = len(partners)
        for n in sorted(partners):
            st[f"partner_node_status_server_{n}"] = 2 if n in connected else 0
        st["readonly_nodes_count"] = len(readonly)
        for n in sorted(readonly):
            st[f"readonly_node_status_server_{n}"] = 2 if n in connected else 0
        st["log_len"] = g["last_index"] - g["first_index"] + 1
        st["last_applied"] = g["applied"]
        st["commit_idx"] = g["commit"]
        st["raft_term"] = g["term"]
        peers = g["peers"] if g["role"] == "leader" else {}
        st["next_node_idx_count"] = len(peers)
        st["match_idx_count"] = len(peers)
        for n, p in sorted(peers.items()):
            st[f"next_node_idx_server_{n}"] = p["next"]
            st[f"match_idx_server_{n}"] = p["match"]
        st["leader_commit_idx"] = g["commit"] if g["leader"] is not None else None
        voters = [n for n, kind in g["members"].items() if kind == "voter"]
        up = sum(1 for n in voters if n == self.id or n in connected)
        st["has_quorum"] = bool(voters) and up > len(voters) / 2
        return st

    def members(self) -> tuple[list[str], list[str]]:
        """(partners, read-only nodes) in this node's configuration."""
        g = self._group()
        if g is None:
            return list(self.others), []
        members = g.raft.conf.members()
        return (sorted(n for n in members if n != self.id and not n.startswith(READONLY_PREFIX)),
                sorted(n for n in members if n != self.id and n.startswith(READONLY_PREFIX)))


def _tick_thread(engine: _Engine, owner: SyncObj) -> None:
    try:
        while not engine._try_start():
            engine._initialised.set()
            if engine.bind_failed or engine.destroyed:
                return
    except BaseException as e:  # noqa: BLE001 - the constructor raises it
        engine._start_error = e
        return
    finally:
        engine._initialised.set()
    period = engine.conf.autoTickPeriod
    while not engine._closing.is_set():
        try:
            owner._onTick(period)
        except Exception:
            log.exception("failed _onTick in the tick thread")
            time.sleep(period)


def _bindable(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
        return True
    except (OSError, ValueError):
        return False


def _local_ip(peer: str) -> str:
    """The local address that routes to ``peer`` (for a read-only node to listen on)."""
    host, _, port = peer.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            ip: str = s.getsockname()[0]
            return ip
    except (OSError, ValueError):
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


# -- the public classes --------------------------------------------------------------------------
def _wrap_init(init: Callable[..., None]) -> Callable[..., None]:
    """Start the node when the outermost ``__init__`` of a SyncObj returns."""
    if getattr(init, "_compat_wrapped", False):
        return init

    @functools.wraps(init)
    def __init__(self: SyncObj, *args: Any, **kwargs: Any) -> None:
        try:
            depth: int = _DEPTH_SLOT.__get__(self, SyncObj)
        except AttributeError:
            depth = 0
        _DEPTH_SLOT.__set__(self, depth + 1)
        try:
            init(self, *args, **kwargs)
        finally:
            _DEPTH_SLOT.__set__(self, depth)
        if depth == 0:
            engine = _engine(self)
            if engine is not None:
                engine.start()

    __init__._compat_wrapped = True  # type: ignore[attr-defined]
    return __init__


class SyncObjConsumer:
    """Base class of objects replicated alongside a SyncObj (``consumers=[...]``). Its
    attributes set after ``SyncObjConsumer.__init__`` are its replicated state."""

    __slots__ = ("__dict__", "__framework", "__weakref__")

    def __init__(self) -> None:
        self._syncObj: SyncObj | None = None
        _CONSUMER_SLOT.__set__(self, frozenset(vars(self)))

    def _destroy(self) -> None:
        # PySyncObj clears the link; the owner is kept aside so that a later call gets the
        # destroyed SyncObj's answer (REQUEST_DENIED), not "not attached" (found from
        # outside: the battery had been attached).
        if isinstance(self._syncObj, SyncObj):
            _DESTROYED_WITH[self] = self._syncObj
        self._syncObj = None

    def _serialize(self) -> dict[str, Any]:
        skip = _framework_names(self)
        return {k: v for k, v in vars(self).items() if k not in skip}

    def _deserialize(self, data: dict[str, Any]) -> None:
        vars(self).update(data)


class SyncObj:
    """PySyncObj's ``SyncObj``: a replicated object on a raftkv node (package docstring)."""

    __slots__ = ("__depth", "__dict__", "__engine", "__weakref__")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            cls.__init__ = _wrap_init(vars(cls)["__init__"])  # type: ignore[method-assign]

    def __init__(self, selfNode: Node | str | None, otherNodes: Any,
                 conf: SyncObjConf | None = None, consumers: list[Any] | None = None,
                 nodeClass: type = TCPNode, transport: Any = None,
                 transportClass: Any = None) -> None:
        if transport is not None or transportClass is not None:
            raise ValueError("SyncObj: custom transports are not supported by "
                             "raftkv.compat.pysyncobj (raftkv's authenticated TCP transport "
                             "is the only one)")
        if not (isinstance(nodeClass, type) and issubclass(nodeClass, TCPNode)):
            raise TypeError("SyncObj: nodeClass must be TCPNode or a subclass: node ids are "
                             "host:port addresses")
        engine = _Engine(self, selfNode, otherNodes, conf, consumers, nodeClass)
        _ENGINE_SLOT.__set__(self, engine)
        engine.framework = frozenset(vars(self))

    # -- lifecycle ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Stop the node: close its connections and files. A leader hands leadership over
        first."""
        e = self.__e()
        e.destroy()

    def destroy_synchronous(self) -> None:
        self.destroy()

    def _destroy(self) -> None:
        self.destroy()

    def _doDestroy(self) -> None:
        self.destroy()

    def tick_thread_alive(self) -> bool:
        t = self.__e()._thread
        return t is not None and t.is_alive()

    def waitReady(self) -> None:
        """Wait until the node is bound (PySyncObj: "until the transport is ready")."""
        self.waitBinded()

    def waitBinded(self) -> None:
        """Return once the node listens; ``SyncObjException('BindError')`` if it cannot."""
        e = self.__e()
        if not e.started:
            e.start()
        e._initialised.wait()
        while not e.running:
            if e.bind_failed or e.destroyed:
                raise SyncObjException("BindError")
            time.sleep(0.01)

    def isReady(self) -> bool:
        """True once this node has applied everything the leader had committed when it
        last checked (PySyncObj: "initially synced with others"). ``onReady`` fires then."""
        return self.__e()._ready

    def _isReady(self) -> bool:
        return self.isReady()

    def doTick(self, timeToWait: float = 0.0) -> None:
        """Run queued callbacks (waiting up to ``timeToWait`` for one). For ``autoTick=False``:
        the node itself runs on its own thread; callbacks run here."""
        if self.__e().conf.autoTick:
            raise RuntimeError("doTick is for autoTick=False")
        self._onTick(timeToWait)

    def _onTick(self, timeToWait: float = 0.0) -> None:
        self.__e().tick(timeToWait)

    def addOnTickCallback(self, callback: Callable[[], Any]) -> None:
        self.__e()._tick_callbacks.append(callback)

    def removeOnTickCallback(self, callback: Callable[[], Any]) -> None:
        try:
            self.__e()._tick_callbacks.remove(callback)
        except ValueError:
            pass

    # -- membership and code versions ------------------------------------------------------
    def addNodeToCluster(self, node: Node | str, callback: Callable[..., Any] | None = None
                         ) -> None:
        """Add ``node`` as a learner (PRE_FOLLOWER) that the leader promotes to a voter once
        it has caught up. ``callback(None, FAIL_REASON)`` once the configuration holds it."""
        e = self.__e()
        if not e.conf.dynamicMembershipChange:
            raise Exception("dynamicMembershipChange is disabled")  # noqa: TRY002 - PySyncObj's
        e.change("add", node, callback)

    def removeNodeFromCluster(self, node: Node | str,
                              callback: Callable[..., Any] | None = None) -> None:
        """Remove ``node``; removing the leader hands leadership over first."""
        e = self.__e()
        if not e.conf.dynamicMembershipChange:
            raise Exception("dynamicMembershipChange is disabled")  # noqa: TRY002 - PySyncObj's
        e.change("rem", node, callback)

    def transferLeadership(self, node: Node | str | None = None,
                           callback: Callable[..., Any] | None = None) -> None:
        """Hand leadership to ``node`` (the most up-to-date voter if None); must be called
        on the leader. ``callback(None, FAIL_REASON)`` once it leads, or on failure."""
        e = self.__e()
        if e._state != _RAFT_STATE.LEADER or not e.running:
            e.event(callback, None, FAIL_REASON.NOT_LEADER)
            return
        assert e.embedded is not None
        if node is None:
            best = e.embedded.most_up_to_date_voter()
            if best is None:
                e.event(callback, None, FAIL_REASON.REQUEST_DENIED)
                return
            target = best
        else:
            target = node_id(node)
        fut = e.embedded.node.transfer_leadership(e.group, target)

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            e.event(callback, None, FAIL_REASON.SUCCESS if exc is None else _fail_reason(exc))

        fut.add_done_callback(done)

    def getCodeVersion(self) -> int:
        return self.__e().machine.enabled_version

    def setCodeVersion(self, newVersion: int,
                       callback: Callable[..., Any] | None = None) -> None:
        """Switch the whole cluster to code version ``newVersion`` (a log entry)."""
        e = self.__e()
        if type(newVersion) is not int:
            raise TypeError("newVersion must be an int")
        if newVersion > e.machine.self_code_version:
            raise Exception(  # noqa: TRY002 - PySyncObj's
                f"wrong version, current version is {e.machine.self_code_version}, requested "
                f"version is {newVersion}")
        if newVersion < e.machine.enabled_version:
            raise Exception(  # noqa: TRY002 - PySyncObj's
                f"wrong version, enabled version is {e.machine.enabled_version}, requested "
                f"version is {newVersion}")
        request = next(e._requests)
        e.submit(encode_value([_VERSION, newVersion, e.id, request]), request, callback,
                 False, None)

    def forceLogCompaction(self) -> None:
        """Checkpoint the state machine now and compact the log up to it (keeping the
        policy's last entries for followers a little behind). Returns at once, as
        PySyncObj's does; a state that cannot be encoded is logged as an error naming
        the attribute, as the periodic checkpoint's is (nothing is written, and the log
        is kept)."""
        e = self.__e()
        g = e._group()
        if g is not None and e.embedded is not None:
            node = e.embedded.node

            def failed(f: Future[Any]) -> None:
                exc = f.exception()
                if isinstance(exc, SnapshotFailed):
                    log_snapshot_failed(node.id, g, "forceLogCompaction's checkpoint", exc)
                elif exc is not None:
                    log.error("node %s: forceLogCompaction failed: %s", node.id, exc)

            st = g.storage
            node.call(lambda: compact(st.log, st.state, g.raft.conf_at,
                                      st.compaction.keep)).add_done_callback(failed)

    def _forceLogCompaction(self) -> None:
        self.forceLogCompaction()

    # -- state -------------------------------------------------------------------------------
    def _isLeader(self) -> bool:
        return self.__e()._state == _RAFT_STATE.LEADER

    def _getLeader(self) -> Node | None:
        e = self.__e()
        lead = e._leader
        return None if lead is None else e.node_class(lead)

    def _getTerm(self) -> int:
        g = self.__e()._group()
        return 0 if g is None else int(g.raft.term)

    def _getRaftLogSize(self) -> int:
        g = self.__e()._group()
        if g is None:
            return 0
        return int(g.raft.log.last_index() - g.storage.log.first_index() + 1)

    @property
    def hasQuorum(self) -> bool:
        return bool(self.__e().status()["has_quorum"])

    def getStatus(self) -> dict[str, Any]:
        """PySyncObj's status keys (package docstring lists what each means here)."""
        return self.__e().status()

    def _getStatus(self, args: Any = None, callback: Callable[..., Any] | None = None
                   ) -> dict[str, Any]:
        st = self.getStatus()
        if callback is not None:
            callback(st, None)
        return st

    def printStatus(self) -> None:
        for k, v in self.getStatus().items():
            log.info("%s: %s", k, v)

    def _printStatus(self) -> None:
        self.printStatus()

    def isNodeConnected(self, node: Node | str) -> bool:
        e = self.__e()
        if e.embedded is None:
            return False
        nid = node_id(node)
        return nid in e.embedded.node.transport.connected_peers()

    @property
    def selfNode(self) -> Node | None:
        e = self.__e()
        return None if e.readonly else e.node_class(e.id)

    @property
    def otherNodes(self) -> set[Node]:
        e = self.__e()
        return {e.node_class(n) for n in e.members()[0]}

    @property
    def readonlyNodes(self) -> set[Node]:
        e = self.__e()
        return {Node(n) for n in e.members()[1]}

    @property
    def raftLastApplied(self) -> int:
        g = self.__e()._group()
        return 0 if g is None else int(g.state.applied_index())

    @property
    def raftCommitIndex(self) -> int:
        g = self.__e()._group()
        return 0 if g is None else int(g.raft.log.committed)

    @property
    def raftCurrentTerm(self) -> int:
        return self._getTerm()

    @property
    def conf(self) -> SyncObjConf:
        return self.__e().conf

    def _getConf(self) -> SyncObjConf:
        return self.__e().conf

    def __e(self) -> _Engine:
        engine = _engine(self)
        if engine is None:
            raise SyncObjException("SyncObj.__init__ was not called")
        return engine


SyncObj.__init__ = _wrap_init(SyncObj.__init__)  # type: ignore[method-assign]
_ENGINE_SLOT: Any = vars(SyncObj)["_SyncObj__engine"]
_DEPTH_SLOT: Any = vars(SyncObj)["_SyncObj__depth"]
_CONSUMER_SLOT: Any = vars(SyncObjConsumer)["_SyncObjConsumer__framework"]
# Consumer -> the SyncObj it was destroyed with (``SyncObjConsumer._destroy``).
_DESTROYED_WITH: weakref.WeakKeyDictionary[SyncObjConsumer, SyncObj] = weakref.WeakKeyDictionary()
