"""Custom replicated state machines, the PySyncObj way: ``@replicated`` methods on an object.

A PySyncObj program moves over by changing its base class and its constructor; the methods
stay as they are::

    class Counter(ReplicatedObject):          # was: class Counter(SyncObj)
        def __init__(self):
            self.value = 0                    # was: super().__init__(self_addr, partners)

        @replicated
        def incr(self, n=1):
            self.value += n
            return self.value

        def get(self):
            return self.value

The node hosting the object (``raftkv.node``) attaches it and applies its log entries through
``raftkv.node.user_state.UserStateStore``.

Theory of operation
-------------------
A replicated method never runs where it is called. The call is encoded as a command, the
msgpack array ``[method name, [args...], {kwargs...}]``, and handed to the ``propose``
callable the node attached (``obj._attach(propose)``). Once Raft has committed the entry,
every replica, the caller's included, runs ``obj.apply(index, command)``. That decodes the
command and runs the real method. Every replica thus runs the same methods, with the same
arguments, in the same (log) order. The caller gets back the return value computed by its
own replica's apply, through the ``concurrent.futures.Future`` that ``propose`` returned.

Call options (PySyncObj's reserved keyword arguments; a replicated method cannot have
parameters with these names):

- ``sync=True`` (the default; in PySyncObj it is False): block until the entry is applied and
  return the method's result, or raise what it raised.
- ``sync=False``: return a ``Future`` at once. Its ``result()`` is the method's return value;
  its ``exception()`` is what the method raised, or why the proposal failed.
- ``timeout=seconds``: with ``sync``, raise ``TimeoutError`` if the entry is not applied in
  time. The command may still be applied later: a timeout does not cancel it.
- ``callback=fn``: call ``fn(result, error)`` once the call completes. It runs on the node's
  apply thread, so it must be quick and must not make synchronous replicated calls. Passing a
  callback makes the call asynchronous unless ``sync=True`` is given explicitly.

Rules for replicated methods:

- **Deterministic.** A method may depend only on the object's state and its arguments: no
  clock, no randomness, no I/O, no other object. Otherwise the replicas diverge.
- **msgpack arguments, no pickle.** The log is read by every replica, and no log or network
  bytes ever reach ``pickle``. Arguments may be None, bool, int (64-bit), float, str, bytes,
  list, tuple and dict (of those), with exact types: subclasses such as IntEnum, namedtuple
  or defaultdict would not come back as the same type, so they are refused. Anything else
  raises a ``TypeError`` before anything is proposed, and so does a call that does not fit
  the method's signature. A call encoding to over 16 MiB (``MAX_COMMAND_BYTES``, one log
  entry) raises ``ValueError``. Tuples travel as a msgpack extension
  type, so they arrive as tuples and can be dict keys. bytearray and memoryview arrive as
  bytes.
- **Errors are results.** If a method raises, the exception becomes the entry's result on
  every replica. The object's state then stays as the method left it, on every replica
  alike, and the caller gets the exception raised (``sync``) or set on the Future. A command
  that cannot be decoded, or that names no replicated method of this class, gives a
  ``MalformedCommand`` or ``UnknownMethod`` *result*. ``apply`` itself never raises, so a bad
  entry in the log cannot stop a replica.
- **Nesting.** A replicated method that calls another replicated method of the same object
  runs it directly: it is already being applied, on every replica.
- **Reads are local.** A plain method such as ``get()`` reads this replica's state, which
  may lag the leader's.

Snapshots: ``snapshot()`` and ``restore()`` default to msgpack of the object's public
attributes (``__dict__`` without names starting with ``_``), with the same type rules as
arguments. Keep the node's and your own bookkeeping in ``_private`` attributes, and override
both methods for state that is not plain data. ``snapshot()`` must be deterministic: replicas
compare state by digests of these bytes.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgpack

from raftkv.futures import then
from storage.commands import MAX_COMMAND_BYTES, UNPACK_ERRORS

__all__ = [
    "MalformedCommand",
    "NotAttachedError",
    "Propose",
    "ReplicatedObject",
    "StateMachine",
    "UnknownMethod",
    "decode_value",
    "encode_call",
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


# -- the value codec ---------------------------------------------------------------------------
# msgpack, with strict types so that what a method receives on every replica is exactly what
# the caller passed, type for type; tuples ride in an extension type.
# Written into the Raft log and into checkpoints: never renumber.
_EXT_TUPLE = 1
# The exact types msgpack packs natively in strict mode. (bool is final, so ``True`` is exact.)
_NATIVE = (type(None), bool, int, float, str, bytes, bytearray, memoryview, list, dict)


def _default(obj: object) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    kind = type(obj)
    if isinstance(obj, _NATIVE + (tuple,)):
        base = next(t for t in _NATIVE + (tuple,) if isinstance(obj, t))
        raise TypeError(
            f"{kind.__module__}.{kind.__qualname__} is a subclass of {base.__name__}, which "
            f"would arrive as a plain {base.__name__}: convert it first"
        )
    raise TypeError(f"cannot serialise a {kind.__module__}.{kind.__qualname__}")


def _pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)
    return data


def _ext_hook(code: int, data: bytes) -> object:
    if code == _EXT_TUPLE:
        items = _unpack(data)
        if type(items) is not list:
            raise ValueError("tuple extension does not hold an array")
        return tuple(items)
    raise ValueError(f"unknown msgpack extension type {code}")


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(
        data, raw=False, use_list=True, strict_map_key=False, ext_hook=_ext_hook
    )


_ALLOWED = (
    "None, bool, int (64-bit), float, str, bytes, and lists, tuples and dicts of those, "
    "with exact types"
)


def encode_value(obj: object, what: str = "value") -> bytes:
    """msgpack ``obj`` with the rules of the module docstring; ``TypeError`` otherwise."""
    try:
        return _pack(obj)
    except (TypeError, ValueError, OverflowError) as e:
        # OverflowError: an int beyond 64 bits. ValueError: nesting too deep, or a str with
        # lone surrogates (not UTF-8).
        raise TypeError(f"{what} must be msgpack-serialisable ({_ALLOWED}): {e}") from None


def decode_value(data: bytes) -> object:
    """The inverse of ``encode_value``. Raises ``ValueError`` on bytes it did not produce."""
    try:
        return _unpack(data)
    except UNPACK_ERRORS as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None


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
        if self._applying_thread == threading.get_ident():
            return func(self, *args, **kwargs)  # nested in an apply: already replicated
        propose = self._propose
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
            future.add_done_callback(functools.partial(_call_back, callback))
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


def _call_back(callback: Callable[[Any, BaseException | None], object], f: Future[Any]) -> None:
    if f.cancelled():
        return
    error = f.exception()
    callback(None if error is not None else f.result(), error)


# -- the base class ----------------------------------------------------------------------------
class ReplicatedObject:
    """Base class for objects with ``@replicated`` methods; a ``StateMachine``.

    No ``__init__`` is needed: subclasses initialise their state as they like. The node calls
    ``_attach(propose)`` when it starts hosting the object and ``_detach()`` when it stops.
    """

    # Per class: name -> the undecorated replicated method, collected over the MRO.
    _replicated_methods: ClassVar[dict[str, Callable[..., Any]]] = {}
    _propose: Propose | None = None
    _applying_thread: int | None = None  # the thread inside apply(), if any

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
        if self._propose is not None and self._propose is not propose:
            raise RuntimeError(f"{type(self).__name__} object is already attached to a node")
        self._propose = propose

    def _detach(self) -> None:
        self._propose = None

    # -- StateMachine ------------------------------------------------------------------------
    def apply(self, index: int, command: bytes) -> object:
        """Run the replicated call in ``command``, the entry at log ``index``. Never raises:
        failures are returned as the exception (see the module docstring)."""
        try:
            name, args, kwargs = _decode_call(command)
        except MalformedCommand as e:
            return e
        func = self._replicated_methods.get(name)
        if func is None:
            return UnknownMethod(
                f"{type(self).__name__} has no replicated method {name!r} (log index {index})"
            )
        outer = self._applying_thread
        self._applying_thread = threading.get_ident()
        try:
            return func(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the same result on every replica
            return e
        finally:
            self._applying_thread = outer

    def snapshot(self) -> bytes:
        """msgpack of the public attributes, sorted by name (so equal states give equal
        bytes). ``TypeError`` names an attribute that does not fit the msgpack rules."""
        state = {k: v for k, v in sorted(vars(self).items()) if not k.startswith("_")}
        try:
            return _pack(state)
        except (TypeError, ValueError, OverflowError):
            for k, v in state.items():  # find the culprit for the message
                encode_value(v, f"{type(self).__name__}.{k} (override snapshot/restore "
                                f"for state that is not plain data)")
            raise

    def restore(self, data: bytes) -> None:
        """Replace the public attributes with those in ``data`` (from ``snapshot``). All or
        nothing: ``ValueError`` if ``data`` is not such a snapshot, and nothing changes."""
        try:
            state = _unpack(data)
        except UNPACK_ERRORS as e:
            raise ValueError(
                f"not a {type(self).__name__} snapshot: {type(e).__name__}: {e}"
            ) from None
        if type(state) is not dict or not all(
            type(k) is str and k and not k.startswith("_") for k in state
        ):
            raise ValueError(f"not a {type(self).__name__} snapshot: expected a map of attributes")
        attrs = vars(self)
        for k in [k for k in attrs if not k.startswith("_")]:
            del attrs[k]
        attrs.update(state)
