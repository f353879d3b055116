"""Custom replicated state machines, the PySyncObj way: ``@replicated`` methods on an object.

A PySyncObj program moves over by changing its base class and its constructor; the methods,
and the state they keep in attributes (private and name-mangled ones included), stay as
they are::

    class Counter(ReplicatedObject):          # was: class Counter(SyncObj)
        def __init__(self):
            self.__counter = 0                # was: super().__init__(self_addr, partners)

        @replicated
        def incr(self, n=1):
            self.__counter += n
            return self.__counter

        def get(self):
            return self.__counter

The node hosting the object (``raftkv.node``) attaches it and applies its log entries through
``raftkv.node.user_state.UserStateStore``.

Theory of operation
-------------------
A replicated method never runs where it is called. The call is encoded as a command, the
msgpack array ``[method name, [args...], {kwargs...}]``, and handed to the ``propose``
callable the node attached (``obj._attach(propose)``). Once Raft has committed the entry,
every replica, the caller's included, runs ``obj.apply(index, command)``. That decodes the
command and runs the real method. Every replica thus runs the same methods, with the same
arguments, in the same (log) order. The caller gets back the method's return value, through
the ``concurrent.futures.Future`` that ``propose`` returned, once its own replica has
applied the entry: a read on that replica right after the call sees the call's effect, as
after a PySyncObj call.

Call options (PySyncObj's reserved keyword arguments; a replicated method cannot have
parameters with these names):

- ``sync=True`` (the default; in PySyncObj it is False): block until the entry is applied and
  return the method's result, or raise what it raised.
- ``sync=False``: return a ``Future`` at once. Its ``result()`` is the method's return value;
  its ``exception()`` is what the method raised, or why the proposal failed.
- ``timeout=seconds``: with ``sync``, raise ``TimeoutError`` if the entry is not applied in
  time. The command may still be applied later: a timeout does not cancel it.
- ``callback=fn``: call ``fn(result, error)`` once the call completes. Callbacks run one at a
  time, in the order the calls complete, on a thread of their own (one per process), never on
  the node's thread: a callback may make synchronous replicated calls, as in PySyncObj, and a
  slow one delays the callbacks after it, not the node. Passing a callback makes the call
  asynchronous unless ``sync=True`` is given explicitly.

Rules for replicated methods:

- **Deterministic.** A method may depend only on the object's state and its arguments: no
  clock, no randomness, no I/O, no other object. Otherwise the replicas diverge.
- **msgpack arguments, no pickle.** The log is read by every replica, and no log or network
  bytes ever reach ``pickle``. Arguments may be None, bool, int (any size), float, str,
  bytes, and list, tuple, dict, set, frozenset and ``collections.deque`` (of those), with
  exact types: subclasses such as IntEnum, namedtuple, defaultdict or OrderedDict would not
  come back as the same type, so they are refused. Anything else raises a ``TypeError``
  before anything is proposed, and so does a call that does not fit the method's
  signature. A call encoding to over 16 MiB (``MAX_COMMAND_BYTES``, one log entry) raises
  ``ValueError``. Tuples, sets, frozensets, deques (with their ``maxlen``) and ints beyond
  64 bits travel as msgpack extension types, so they arrive as what was sent: a tuple or
  a frozenset can be a dict key or a set member. A set's members are written in the order
  of their encoded bytes, so equal sets give equal bytes whatever their iteration order
  (which, for str members, differs from process to process). bytearray and memoryview
  arrive as bytes.
- **Errors are results.** If a method raises, the exception becomes the entry's result on
  every replica. The object's state then stays as the method left it, on every replica
  alike, and the caller gets the exception raised (``sync``) or set on the Future. A command
  that cannot be decoded, or that names no replicated method of this class, gives a
  ``MalformedCommand`` or ``UnknownMethod`` *result*. ``apply`` itself never raises, so a bad
  entry in the log cannot stop a replica.
- **Nesting.** A replicated method that calls another replicated method of the same object
  runs it directly: it is already being applied, on every replica.
- **Reads are local.** A plain method such as ``get()`` reads this replica's state, which
  may lag the leader's (but never this replica's own completed calls).

Results from the leader: a call made on a follower is forwarded to the leader, which
applies it first and answers with its result (``encode_result``/``decode_result``, used
by ``raftkv.node.user_state.UserStateStore``); the follower hands it to its caller once
it has applied the entry too (``ReplicatedNode``). The result travels with the codec the
arguments use, so a follower's call returns what the same call on the leader returns,
type for type: a tuple stays a tuple, a set a set. An exception the method raised
travels as its class's module and qualified name, its ``args`` and its attributes (a
builtin exception: what pickle takes from its ``__reduce__``), as plain data, and
comes back as that class only if the class is already loaded in this
process (a module in ``sys.modules``, never imported on the network's word: this
replica ran the same method, so its module is loaded) and is an ``Exception``
subclass. It is rebuilt without running its ``__init__`` (``cls.__new__(cls, *args)``,
then its attributes; builtin exceptions are called as ``cls(*args)``), so no code the
network names runs. Otherwise, or when its args or attributes are not plain data, the
caller gets a ``raftkv.node.errors.RemoteError`` whose ``kind`` is the class's qualified
name and whose message is the exception's. A result that is not plain data (an
instance of your own class) cannot travel: the follower's call raises
``ResultNotSent``, although the call was applied. Return plain data.

Snapshots: a snapshot captures everything a replicated method can change, PySyncObj's rule:
every attribute of the object, public, ``_private`` and name-mangled (``self.__counter`` is
``_Counter__counter``) alike, and the values of ``__slots__`` that subclasses declare. The
node's own bookkeeping (the attached ``propose``, the thread inside ``apply``) is not an
attribute: it lives in a slot of ``ReplicatedObject`` itself, which is never snapshotted,
so no attribute of yours can collide with it (``_propose`` and ``_applying_thread``, where
older versions kept it, are names like any other). ``snapshot()`` is the
msgpack array ``[2, {name: value}]``, names sorted so that equal states give equal bytes
(replicas compare state by digests of these bytes). Every value follows the argument rules
above. A value that does not (an open file, a lock, a lambda, an instance of your own
class) makes ``snapshot()`` raise a ``TypeError`` naming the attribute: a checkpoint then
fails loudly and the node keeps the log it would have compacted (see
``raftkv.node.user_state``), it never drops the attribute. Keep such things off the
object, or override both ``snapshot()`` and ``restore()``, deterministically.
``restore()`` replaces the whole state, all or nothing: attributes that the snapshot does
not name are deleted. A snapshot written before version 2 (a msgpack map of the public
attributes only) still restores, as it always did: it replaces the public attributes and
keeps the private ones as they are.
"""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import sys
import threading
import types
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgpack

from raftkv.futures import then
from raftkv.node.errors import RemoteError
from raftkv.storage.commands import MAX_COMMAND_BYTES, UNPACK_ERRORS

log = logging.getLogger(__name__)

__all__ = [
    "MalformedCommand",
    "NotAttachedError",
    "Propose",
    "ReplicatedObject",
    "ResultNotSent",
    "StateMachine",
    "UnknownMethod",
    "decode_result",
    "decode_value",
    "encode_call",
    "encode_result",
    "encode_value",
    "replicated",
]


@runtime_checkable
class StateMachine(Protocol):
    """What ``UserStateStore`` drives. ``apply`` runs each committed command at its log index
    and returns its result. The result stays on this replica (it answers the caller's
    Future) and is never serialised. ``snapshot`` is the whole state as bytes, and
    ``restore`` replaces the whole state with such bytes."""

    def apply(self, index: int, command: bytes) -> object: ...

    def snapshot(self) -> bytes: ...

    def restore(self, data: bytes) -> None: ...


# ``propose(data) -> Future``: what a node attaches. See ``ReplicatedObject._attach``.
Propose = Callable[[bytes], "Future[Any]"]

RESERVED_KWARGS = frozenset({"sync", "timeout", "callback"})
# ReplicatedObject's own API: a replicated method by one of these names would replace it.
_RESERVED_NAMES = frozenset({"apply", "snapshot", "restore"})


class MalformedCommand(ValueError):
    """An entry's result when its bytes are not a ``[name, args, kwargs]`` command."""


class UnknownMethod(AttributeError):
    """An entry's result when the command names no replicated method of the object's class
    (for instance, a log written by a newer version of the class)."""


class NotAttachedError(RuntimeError):
    """A replicated method was called on an object that no node hosts."""


class ResultNotSent(TypeError):
    """A follower's call was applied, but the leader could not send its result: it is not
    plain data (module docstring, "Results from the leader")."""


# -- the value codec ---------------------------------------------------------------------------
# msgpack, with strict types so that what a method receives on every replica is exactly what
# the caller passed, type for type; what msgpack has no type for rides in extension types.
# Written into the Raft log and into checkpoints: never renumber, only add codes after these.
_EXT_TUPLE = 1  # an array of the items
_EXT_SET = 2  # an array of the members, in the order of their encoded bytes
_EXT_FROZENSET = 3  # as a set
_EXT_DEQUE = 4  # [maxlen or nil, [items...]]
_EXT_BIGINT = 5  # an int beyond 64 bits: big-endian two's complement in (bits + 8) // 8 bytes
# The exact types msgpack packs natively in strict mode. (bool is final, so ``True`` is exact.)
_NATIVE = (type(None), bool, int, float, str, bytes, bytearray, memoryview, list, dict)
_EXTENDED = (tuple, set, frozenset, deque)
# msgpack's native ints: int64 and uint64.
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def _pack_members(members: set[object] | frozenset[object]) -> bytes:
    """The msgpack array of ``members``, sorted by their encoded bytes: equal sets, equal
    bytes, whatever their iteration order (str hashes differ from process to process)."""
    encoded = sorted(_pack(m) for m in members)
    header: bytes = msgpack.Packer().pack_array_header(len(encoded))
    return header + b"".join(encoded)


def _default(obj: object) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if type(obj) is set:
        return msgpack.ExtType(_EXT_SET, _pack_members(obj))
    if type(obj) is frozenset:
        return msgpack.ExtType(_EXT_FROZENSET, _pack_members(obj))
    if type(obj) is deque:
        return msgpack.ExtType(_EXT_DEQUE, _pack([obj.maxlen, list(obj)]))
    if type(obj) is int:  # msgpack calls back only for ints it cannot pack: beyond 64 bits
        size = (obj.bit_length() + 8) // 8  # one bit more, for the sign
        return msgpack.ExtType(_EXT_BIGINT, obj.to_bytes(size, "big", signed=True))
    kind = type(obj)
    if isinstance(obj, _NATIVE + _EXTENDED):
        base = next(t for t in _NATIVE + _EXTENDED if isinstance(obj, t))
        raise TypeError(
            f"{kind.__module__}.{kind.__qualname__} is a subclass of {base.__name__}, which "
            f"would arrive as a plain {base.__name__}: convert it first"
        )
    raise TypeError(f"cannot serialise a {kind.__module__}.{kind.__qualname__}")


def _pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)
    return data


def _unpack_array(data: bytes, what: str) -> list[object]:
    items = _unpack(data)
    if type(items) is not list:
        raise ValueError(f"{what} extension does not hold an array")
    return items


def _members(data: bytes, what: str) -> list[object]:
    items = _unpack_array(data, what)
    try:
        distinct = len(set(items))
    except TypeError as e:  # unhashable: a list, a dict, a set
        raise ValueError(f"{what} extension holds an unhashable member: {e}") from None
    if distinct != len(items):
        raise ValueError(f"{what} extension holds the same member twice")
    return items


def _ext_hook(code: int, data: bytes) -> object:
    # Strict: a payload our encoder could not have written is a ValueError, never a guess.
    if code == _EXT_TUPLE:
        return tuple(_unpack_array(data, "tuple"))
    if code == _EXT_SET:
        return set(_members(data, "set"))
    if code == _EXT_FROZENSET:
        return frozenset(_members(data, "frozenset"))
    if code == _EXT_DEQUE:
        value = _unpack(data)
        if type(value) is not list or len(value) != 2:
            raise ValueError("deque extension does not hold [maxlen, items]")
        maxlen, items = value
        if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
            raise ValueError(f"deque extension has maxlen {maxlen!r}")
        if type(items) is not list or (maxlen is not None and len(items) > maxlen):
            raise ValueError("deque extension does not hold an array of at most maxlen items")
        return deque(items, maxlen)
    if code == _EXT_BIGINT:
        n = int.from_bytes(data, "big", signed=True)
        if not data or _INT_MIN <= n <= _INT_MAX or (n.bit_length() + 8) // 8 != len(data):
            raise ValueError(
                f"int extension of {len(data)} bytes is not an int beyond 64 bits in the "
                "fewest bytes"
            )
        return n
    raise ValueError(f"unknown msgpack extension type {code}")


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(
        data, raw=False, use_list=True, strict_map_key=False, ext_hook=_ext_hook
    )


_ALLOWED = (
    "None, bool, int, float, str, bytes, and lists, tuples, dicts, sets, frozensets and "
    "collections.deques of those, with exact types"
)
# What packing raises on a value outside the rules: TypeError (a type it has no rule for),
# ValueError (nesting too deep, or a str with lone surrogates, not UTF-8), OverflowError,
# and RecursionError (a value that contains itself through a tuple or a deque).
_PACK_ERRORS = (TypeError, ValueError, OverflowError, RecursionError)


def encode_value(obj: object, what: str = "value") -> bytes:
    """msgpack ``obj`` with the rules of the module docstring; ``TypeError`` otherwise."""
    try:
        return _pack(obj)
    except _PACK_ERRORS as e:
        raise TypeError(f"{what} must be msgpack-serialisable ({_ALLOWED}): {e}") from None


def decode_value(data: bytes) -> object:
    """The inverse of ``encode_value``. Raises ``ValueError`` on bytes it did not produce."""
    try:
        return _unpack(data)
    except UNPACK_ERRORS as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None


# -- results, from the leader to a follower ---------------------------------------------------
# [_RESULT_VALUE, value] | [_RESULT_EXCEPTION, module, qualname, args, attributes, message]
# | [_RESULT_UNSENDABLE, type name]. An exception's args (an array) and attributes (a map)
# are encoded apart, each nil when it is not plain data. Never renumber.
_RESULT_VALUE, _RESULT_EXCEPTION, _RESULT_UNSENDABLE = 0, 1, 2


def encode_result(result: object) -> bytes:
    """``result`` (what ``apply`` returned: a value or the exception a method raised) as
    bytes for a follower; never raises. See the module docstring."""
    if isinstance(result, BaseException):
        kind = type(result)
        args, state = _reduced(result)
        try:
            packed_args: bytes | None = _pack(list(args))
        except _PACK_ERRORS:
            packed_args = None
        try:
            attrs: bytes | None = _pack(state)
        except _PACK_ERRORS:
            attrs = None
        return _pack([_RESULT_EXCEPTION, kind.__module__, kind.__qualname__, packed_args,
                      attrs, _message(result)])
    try:
        return _pack([_RESULT_VALUE, result])
    except _PACK_ERRORS:
        what = type(result)
        return _pack([_RESULT_UNSENDABLE, f"{what.__module__}.{what.__qualname__}"])


def _reduced(e: BaseException) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What rebuilds ``e`` (``_rebuild``): a builtin exception's constructor arguments and
    attributes as pickle takes them from ``__reduce__`` (``OSError``'s carry its filename,
    which ``args`` lacks); any other's ``args`` and ``__dict__``, set without running its
    ``__init__``."""
    if type(e).__module__ == "builtins":
        reduced = e.__reduce__()
        if (isinstance(reduced, tuple) and len(reduced) >= 2 and type(reduced[1]) is tuple
                and (len(reduced) == 2 or type(reduced[2]) in (dict, type(None)))):
            return reduced[1], dict(reduced[2] or {}) if len(reduced) > 2 else {}
    return tuple(e.args), dict(vars(e))


def _message(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the result
        return repr(e.args)


def decode_result(data: bytes) -> object:
    """The inverse of ``encode_result``: the value, or an exception *instance* (the
    caller raises it). ``ValueError`` on bytes ``encode_result`` did not produce."""
    result = decode_value(data)
    if type(result) is list and len(result) == 2 and result[0] == _RESULT_VALUE:
        return result[1]
    if type(result) is list and len(result) == 2 and result[0] == _RESULT_UNSENDABLE:
        return ResultNotSent(
            f"the call was applied, but its result, a {result[1]}, is not plain data and "
            f"cannot be sent from the leader to this node (return {_ALLOWED})"
        )
    if (
        type(result) is list and len(result) == 6 and result[0] == _RESULT_EXCEPTION
        and type(result[1]) is str and type(result[2]) is str
        and type(result[3]) in (bytes, type(None)) and type(result[4]) in (bytes, type(None))
        and type(result[5]) is str
    ):
        _, module, qualname, args, attrs, message = result
        return _rebuild(module, qualname, args, attrs, message)
    raise ValueError("not a result encoded by raftkv.statemachine.encode_result")


def _exception_class(module: str, qualname: str) -> type[Exception] | None:
    """The ``Exception`` subclass ``module.qualname`` if this process has loaded it, else
    None. Looks only: no import, no ``getattr`` (a module's ``__getattr__`` is code)."""
    found: object = sys.modules.get(module)
    for part in qualname.split("."):
        if not isinstance(found, types.ModuleType | type) or not part.isidentifier():
            return None  # a class local to a function ("<locals>") is not reachable
        found = vars(found).get(part)
    if (
        isinstance(found, type) and issubclass(found, Exception)
        and found.__module__ == module and found.__qualname__ == qualname
    ):
        return found
    return None


def _rebuild(module: str, qualname: str, args: bytes | None, attrs: bytes | None,
             message: str) -> BaseException:
    cls = _exception_class(module, qualname)
    name = qualname if module == "builtins" else f"{module}.{qualname}"
    if cls is None or args is None or attrs is None:
        return RemoteError(name, message)
    try:
        arg_list = decode_value(args)
        state = decode_value(attrs)
        if type(arg_list) is not list or type(state) is not dict:
            raise ValueError("exception args or attributes of the wrong type")
        if module == "builtins":  # cls.__module__, checked by _exception_class
            exc = cls(*arg_list)  # builtin code, as pickle does: OSError's errno, filename
        else:
            exc = cls.__new__(cls, *arg_list)  # BaseException.__new__ sets args; no __init__
            exc.args = tuple(arg_list)
        if state:
            if not all(type(k) is str for k in state):
                raise ValueError("exception attribute names must be str")
            vars(exc).update(state)
    except Exception:  # noqa: BLE001 - not faithfully rebuildable: say what it was
        return RemoteError(name, message)
    return exc


def encode_call(name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> bytes:
    """The command for ``name(*args, **kwargs)``: ``[name, [args...], {kwargs...}]``."""
    data = encode_value([name, list(args), kwargs], f"the arguments of {name}()")
    if len(data) > MAX_COMMAND_BYTES:
        raise ValueError(
            f"the call {name}() encodes to {len(data)} bytes, over the limit of "
            f"{MAX_COMMAND_BYTES} bytes for one log entry"
        )
    return data


def _decode_call(command: bytes) -> tuple[str, list[object], dict[str, object]]:
    try:
        cmd = decode_value(command)
    except ValueError as e:
        raise MalformedCommand(f"command of {len(command)} bytes does not decode: {e}") from None
    if type(cmd) is not list or len(cmd) != 3:
        raise MalformedCommand("a command is the array [method name, args, kwargs]")
    name, args, kwargs = cmd
    if type(name) is not str or type(args) is not list or type(kwargs) is not dict:
        raise MalformedCommand(
            f"a command is [str, array, map], got [{type(name).__name__}, "
            f"{type(args).__name__}, {type(kwargs).__name__}]"
        )
    if not all(type(k) is str for k in kwargs):
        raise MalformedCommand(f"keyword argument names of {name}() must be str")
    return name, args, kwargs


# -- the decorator -----------------------------------------------------------------------------
def replicated(func: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``func`` a replicated method of a ``ReplicatedObject`` subclass (module docstring).

    Called as ``obj.method(*args, sync=None, timeout=None, callback=None, **kwargs)``;
    ``sync=None`` means synchronous unless a ``callback`` is given.
    """
    if not inspect.isfunction(func):
        raise TypeError(
            f"@replicated decorates plain methods, not a {type(func).__name__}: "
            "static and class methods have no object state to replicate"
        )
    sig = inspect.signature(func)
    clash = RESERVED_KWARGS.intersection(sig.parameters)
    if clash:
        raise TypeError(
            f"replicated method {func.__qualname__} has a parameter named "
            f"{', '.join(sorted(clash))}: {', '.join(sorted(RESERVED_KWARGS))} are reserved "
            "for the call options"
        )
    name = func.__name__

    @functools.wraps(func)
    def call(
        self: ReplicatedObject,
        *args: Any,
        sync: bool | None = None,
        timeout: float | None = None,
        callback: Callable[[Any, BaseException | None], object] | None = None,
        **kwargs: Any,
    ) -> Any:
        if not isinstance(self, ReplicatedObject):
            raise TypeError(f"{func.__qualname__}: @replicated methods need a ReplicatedObject")
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < 1e9):
            # Checked before proposing: a bad timeout must not leave a call that "may
            # still be applied later".
            raise ValueError(f"{func.__qualname__}(): timeout must be a number of seconds "
                             f">= 0 (and finite) or None, not {timeout!r}")
        hosting = _hosting(self)
        if hosting.applying_thread == threading.get_ident():
            return func(self, *args, **kwargs)  # nested in an apply: already replicated
        propose = hosting.propose
        if propose is None:
            raise NotAttachedError(
                f"{type(self).__name__}.{name}() was called on an object no node hosts: "
                "replicated methods run only through the log (attach the object to a node)"
            )
        try:
            sig.bind(self, *args, **kwargs)  # the same TypeError the call would give, now
        except TypeError as e:
            raise TypeError(f"{func.__qualname__}(): {e}") from None
        data = encode_call(name, args, kwargs)
        future = _results(propose(data))
        if callback is not None:
            future.add_done_callback(functools.partial(_CALLBACKS.submit, callback))
        if sync is None:
            sync = callback is None
        if not sync:
            return future
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the method itself raised TimeoutError
                raise
            raise TimeoutError(
                f"{type(self).__name__}.{name}() was not applied within {timeout}s; "
                "it may still be applied later"
            ) from None

    call.__replicated__ = func  # type: ignore[attr-defined]
    return call


def _raise_error_result(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result


def _results(raw: Future[Any]) -> Future[Any]:
    """A Future that raises what the method raised: ``apply`` reports it as the result."""
    return then(raw, _raise_error_result)


class _CallbackThread:
    """Runs ``callback=`` functions one at a time, in completion order, on a daemon thread
    started on first use. The futures complete on the node's loop thread; a callback run
    there that made a synchronous replicated call waited for that very thread, and the node
    hung for good (found by an outside-in check). A daemon, so that a callback that never
    returns cannot hold the interpreter's exit."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[Any, BaseException | None], object],
                                             Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, callback: Callable[[Any, BaseException | None], object],
               f: Future[Any]) -> None:
        if f.cancelled():
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raftkv-callbacks",
                                                daemon=True)
                self._thread.start()
        self._queue.put((callback, f))

    def _run(self) -> None:
        while True:
            callback, f = self._queue.get()
            error = f.exception()
            try:
                callback(None if error is not None else f.result(), error)
            except Exception:  # the caller's bug; the next callback still runs
                log.exception("a callback= function raised")


_CALLBACKS = _CallbackThread()


# -- the base class ----------------------------------------------------------------------------
class _Hosting:
    """The framework's bookkeeping for one object: the ``propose`` the node attached, and
    the thread inside ``apply``. Kept in ``ReplicatedObject``'s slot, never an attribute."""

    __slots__ = ("applying_thread", "propose")

    def __init__(self) -> None:
        self.propose: Propose | None = None
        self.applying_thread: int | None = None


_HOSTING_LOCK = threading.Lock()  # creates an object's _Hosting once, whichever thread asks
SNAPSHOT_VERSION = 2  # snapshot() is [SNAPSHOT_VERSION, {name: value}]; version 1 was a map


def _hosting(obj: ReplicatedObject) -> _Hosting:
    """``obj``'s bookkeeping, created on first use (subclasses need not call an __init__).
    Read through the slot's descriptor, so no attribute or ``__getattr__`` of a subclass
    can stand in for it."""
    try:
        hosting: _Hosting = _HOSTING_SLOT.__get__(obj, ReplicatedObject)
        return hosting
    except AttributeError:
        with _HOSTING_LOCK:
            try:
                hosting = _HOSTING_SLOT.__get__(obj, ReplicatedObject)
            except AttributeError:
                hosting = _Hosting()
                _HOSTING_SLOT.__set__(obj, hosting)
            return hosting


def _user_slots(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, descriptor) of every slot that ``cls`` and its bases declare, but for
    ``ReplicatedObject``'s own. Names are as Python stores them: ``__x`` in class ``C``
    is ``_C__x``. The first class in the MRO wins a name."""
    found: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass is ReplicatedObject or "__slots__" not in vars(klass):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, types.MemberDescriptorType) and value.__objclass__ is klass:
                found.setdefault(name, value)
    return tuple(sorted(found.items()))


class ReplicatedObject:
    """Base class for objects with ``@replicated`` methods; a ``StateMachine``.

    No ``__init__`` is needed: subclasses initialise their state as they like. The node calls
    ``_attach(propose)`` when it starts hosting the object and ``_detach()`` when it stops.
    Every attribute is state, whatever its name (module docstring, "Snapshots").
    """

    # The framework's bookkeeping (a _Hosting): a slot is not in vars(self), so it is never
    # snapshotted and no attribute of a subclass can collide with it. Subclasses without
    # __slots__ of their own still get a __dict__.
    __slots__ = ("__hosting",)

    # Per class: name -> the undecorated replicated method, collected over the MRO.
    _replicated_methods: ClassVar[dict[str, Callable[..., Any]]] = {}
    # Per class: the slots its snapshot holds (_user_slots).
    _snapshot_slots: ClassVar[tuple[tuple[str, Any], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        by_attr: dict[str, Callable[..., Any]] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                func = getattr(value, "__replicated__", None)
                if func is not None:
                    by_attr[attr] = func
                else:
                    by_attr.pop(attr, None)  # overridden by a plain attribute
        # The log names a method by its function's __name__ (what the wrapper encodes), so
        # an alias such as ``add = incr`` resolves too.
        methods: dict[str, Callable[..., Any]] = {}
        for func in by_attr.values():
            other = methods.setdefault(func.__name__, func)
            if other is not func:
                raise TypeError(
                    f"{cls.__qualname__}: two different replicated methods are named "
                    f"{func.__name__!r}; the log could not tell them apart"
                )
        bad = _RESERVED_NAMES.intersection(methods) | _RESERVED_NAMES.intersection(by_attr)
        if bad:
            raise TypeError(
                f"{cls.__qualname__}: {', '.join(sorted(bad))} cannot be replicated methods: "
                "they are ReplicatedObject's own (apply, snapshot, restore)"
            )
        cls._replicated_methods = methods
        cls._snapshot_slots = _user_slots(cls)

    # -- what the node calls -----------------------------------------------------------------
    def _attach(self, propose: Propose) -> None:
        """Route this object's replicated calls to ``propose``.

        ``propose(data)`` must append ``data`` as one NORMAL log entry (or raise, e.g. when
        this node is not the leader) and return a ``Future``. The node completes it with
        ``set_result(r)``, where ``r`` is what ``UserStateStore.apply`` returned for that
        entry (this object's ``apply`` result), or with ``set_exception(e)`` when the entry
        will never be applied as this call (dropped, overwritten by another leader) or its
        result is unknown (the entry reached this replica inside a snapshot).
        """
        hosting = _hosting(self)
        if hosting.propose is not None and hosting.propose is not propose:
            raise RuntimeError(f"{type(self).__name__} object is already attached to a node")
        hosting.propose = propose

    def _detach(self) -> None:
        _hosting(self).propose = None

    # -- StateMachine ------------------------------------------------------------------------
    def apply(self, index: int, command: bytes) -> object:
        """Run the replicated call in ``command``, the entry at log ``index``. Never raises:
        failures are returned as the exception (see the module docstring)."""
        try:
            name, args, kwargs = _decode_call(command)
        except MalformedCommand as e:
            return e
        func = type(self)._replicated_methods.get(name)
        if func is None:
            return UnknownMethod(
                f"{type(self).__name__} has no replicated method {name!r} (log index {index})"
            )
        hosting = _hosting(self)
        outer = hosting.applying_thread
        hosting.applying_thread = threading.get_ident()
        try:
            return func(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the same result on every replica
            return e
        finally:
            hosting.applying_thread = outer

    def snapshot(self) -> bytes:
        """``[2, {name: value}]`` in msgpack: every attribute, private and name-mangled
        ones and subclasses' slots included, sorted by name (so equal states give equal
        bytes). ``TypeError`` names an attribute whose value does not fit the msgpack
        rules: an attribute is never left out."""
        state = _attributes(self)
        try:
            return _pack([SNAPSHOT_VERSION, state])
        except _PACK_ERRORS:
            pass
        for k, v in state.items():  # find the culprit for the message
            encode_value(v, f"{type(self).__name__}.{k} (every attribute is in the snapshot; "
                            f"override snapshot/restore for state that is not plain data)")
        raise TypeError(
            f"{type(self).__name__}: the attributes encode one by one but not together "
            "(nesting too deep?)"
        )

    def restore(self, data: bytes) -> None:
        """Replace the whole state with ``data`` (from ``snapshot``): every attribute and
        slot it does not name is deleted. All or nothing: ``ValueError`` if ``data`` is not
        such a snapshot, and nothing changes.

        A snapshot from before version 2 (a map of the public attributes) replaces the
        public attributes only and keeps the private ones, as it always did."""
        what = f"not a {type(self).__name__} snapshot"
        try:
            state = _unpack(data)
        except UNPACK_ERRORS as e:
            raise ValueError(f"{what}: {type(e).__name__}: {e}") from None
        attrs = getattr(self, "__dict__", None)
        if type(state) is dict:  # version 1
            if not all(type(k) is str and k and not k.startswith("_") for k in state):
                raise ValueError(f"{what}: expected a map of public attributes")
            if attrs is None and state:
                raise ValueError(f"{what}: {type(self).__name__} objects have no __dict__")
            if attrs is not None:
                for k in [k for k in attrs if not (type(k) is str and k.startswith("_"))]:
                    del attrs[k]
                attrs.update(state)
            return
        if (
            type(state) is not list
            or len(state) != 2
            or type(state[0]) is not int
            or type(state[1]) is not dict
        ):
            raise ValueError(f"{what}: expected [{SNAPSHOT_VERSION}, {{attributes}}]")
        version, new = state
        if version != SNAPSHOT_VERSION:
            raise ValueError(
                f"{what}: format version {version}, this code reads {SNAPSHOT_VERSION}"
            )
        if not all(type(k) is str for k in new):
            raise ValueError(f"{what}: an attribute name is not a str")
        slots = dict(type(self)._snapshot_slots)
        if attrs is None and not slots.keys() >= new.keys():
            extra = sorted(new.keys() - slots.keys())
            raise ValueError(
                f"{what}: {type(self).__name__} objects have no __dict__ for {extra[0]!r}"
            )
        # Checked: from here on nothing can fail.
        if attrs is not None:
            attrs.clear()
            attrs.update((k, v) for k, v in new.items() if k not in slots)
        for name, slot in slots.items():
            if name in new:
                slot.__set__(self, new[name])
            else:
                try:
                    slot.__delete__(self)
                except AttributeError:
                    pass  # already empty


def _attributes(obj: ReplicatedObject) -> dict[str, object]:
    """Every attribute of ``obj``, subclasses' slots included, sorted by name; ``TypeError``
    if a name is not a str or is both a slot and a ``__dict__`` entry. (A function, not a
    method: a subclass may have a method or an attribute of any name.)"""
    cls = type(obj)
    attrs: dict[Any, object] = dict(getattr(obj, "__dict__", {}))
    for name, slot in cls._snapshot_slots:
        try:
            value = slot.__get__(obj, cls)
        except AttributeError:
            continue  # an empty slot: absent from the snapshot, emptied by restore
        if name in attrs:
            raise TypeError(
                f"{cls.__name__}.{name} is both a slot and an entry of __dict__: "
                "a snapshot could not tell them apart"
            )
        attrs[name] = value
    bad = [k for k in attrs if type(k) is not str]
    if bad:
        raise TypeError(
            f"{cls.__name__}.__dict__ has a key that is not a str ({bad[0]!r}): a "
            "snapshot holds attributes by name"
        )
    return dict(sorted(attrs.items()))


_HOSTING_SLOT: Any = vars(ReplicatedObject)["_ReplicatedObject__hosting"]
