"""A follower's replicated call returns what the same call on the leader returns.

The leader sends a forwarded call's result with ``raftkv.statemachine``'s result codec
("Results from the leader" in that module's docstring): values keep their types, an
exception comes back as its own class when this process has it loaded and it can be
rebuilt from plain data without running its ``__init__``, and as a ``RemoteError``
naming it otherwise. The end-to-end test runs three ``ReplicatedNode``s on real TCP.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from raftkv.embedded import ReplicatedNode
from raftkv.node.errors import RemoteError
from raftkv.statemachine import (
    ReplicatedObject,
    ResultNotSent,
    decode_result,
    encode_result,
    replicated,
)
from raftkv.testing.procs import free_ports

SECRET = b"results-test"
INITS: list[int] = []  # Refused.__init__ calls: a rebuilt exception must not add one


class Refused(Exception):
    """A user's exception whose __init__ takes other arguments than its args."""

    def __init__(self, code: int, detail: str) -> None:
        INITS.append(code)
        super().__init__(f"refused {code}: {detail}")
        self.code = code
        self.detail = detail


class Opaque:
    """Not plain data."""


def local_exception() -> type[Exception]:
    class Local(Exception):
        pass

    return Local


class Box(ReplicatedObject):
    def __init__(self) -> None:
        self.items: list[Any] = []

    @replicated
    def put(self, item: Any) -> Any:
        self.items.append(item)
        return (len(self.items), {item} if isinstance(item, int) else frozenset(),
                deque([item], maxlen=3), 1 << 80)

    @replicated
    def refuse(self, code: int) -> None:
        self.items.append(code)
        raise Refused(code, "no")

    @replicated
    def fail_locally(self) -> None:
        self.items.append("local")
        raise local_exception()("from a function's own class")

    @replicated
    def missing(self) -> None:
        self.items.append("missing")
        raise KeyError("absent")

    @replicated
    def opaque(self) -> Opaque:
        self.items.append("opaque")
        return Opaque()


def roundtrip(result: object) -> object:
    return decode_result(encode_result(result))


def test_values_keep_their_types() -> None:
    value = (1, {2, 3}, frozenset({(4, 5)}), deque([6], maxlen=2), -(1 << 90), [b"x", None],
             {"k": (1.5, True)})
    back = roundtrip(value)
    assert back == value
    assert type(back) is tuple
    assert [type(v) for v in back] == [type(v) for v in value]  # type: ignore[union-attr]
    assert back[3].maxlen == 2  # type: ignore[index]


def test_a_loaded_exception_class_is_rebuilt_without_running_its_init() -> None:
    before = len(INITS)
    original = Refused(7, "busy")
    original.extra = [1, (2, 3)]  # type: ignore[attr-defined]
    back = roundtrip(original)
    assert type(back) is Refused
    assert back.args == original.args and str(back) == str(original)
    assert (back.code, back.detail, back.extra) == (7, "busy", [1, (2, 3)])  # type: ignore[attr-defined]
    assert len(INITS) == before + 1, "only the original ran __init__"


def test_an_exception_pickled_by_its_fields_keeps_its_message() -> None:
    """raftkv's own errors reduce to their constructor's fields (``Rebuildable``); rebuilt
    without ``__init__``, they keep their args, message and fields all the same."""
    from raftkv.core.errors import NotLeader

    back = roundtrip(NotLeader("n1", "n2"))
    assert type(back) is NotLeader and str(back) == "node n1 is not the leader (leader is n2)"
    assert (back.node, back.leader) == ("n1", "n2")  # type: ignore[attr-defined]


def test_builtin_exceptions_come_back_as_themselves() -> None:
    for exc in (KeyError("k"), ValueError("bad", 3), FileNotFoundError(2, "gone", "/x"),
                ZeroDivisionError("division by zero")):
        back = roundtrip(exc)
        assert type(back) is type(exc) and back.args == exc.args  # type: ignore[attr-defined]
    back = roundtrip(FileNotFoundError(2, "gone", "/x"))
    assert back.filename == "/x" and back.errno == 2  # type: ignore[attr-defined]


def test_an_exception_that_cannot_be_rebuilt_is_a_remote_error_naming_it() -> None:
    local = local_exception()("msg")
    back = roundtrip(local)
    assert isinstance(back, RemoteError)
    assert back.kind == f"{__name__}.local_exception.<locals>.Local" and str(back) == "msg"
    opaque_args = roundtrip(ValueError(Opaque()))
    assert isinstance(opaque_args, RemoteError) and opaque_args.kind == "ValueError"
    with_opaque_attr = Refused(1, "x")
    with_opaque_attr.thing = Opaque()  # type: ignore[attr-defined]
    back = roundtrip(with_opaque_attr)
    assert isinstance(back, RemoteError) and back.kind == f"{__name__}.Refused"


def crafted(module: str, qualname: str, args: list[Any]) -> bytes:
    data: bytes = msgpack.packb([1, module, qualname, msgpack.packb(args), msgpack.packb({}),
                                 "crafted"], use_bin_type=True)
    return data


def test_the_network_cannot_name_what_runs() -> None:
    """Only an Exception subclass this process already loaded, under its own name, is
    rebuilt; a module is never imported and nothing else is ever called."""
    assert "antigravity" not in __import__("sys").modules
    for module, qualname in [("os", "system"), ("builtins", "eval"), ("antigravity", "X"),
                             ("builtins", "SystemExit"), ("builtins", "type"),
                             ("raftkv.statemachine", "RemoteError"),  # imported there, not its home
                             ("builtins", "__import__")]:
        back = decode_result(crafted(module, qualname, ["echo pwned"]))
        assert isinstance(back, RemoteError), (module, qualname)
    assert "antigravity" not in __import__("sys").modules


def test_a_result_that_is_not_plain_data_says_so() -> None:
    back = roundtrip(Opaque())
    assert isinstance(back, ResultNotSent) and "Opaque" in str(back)
    with pytest.raises(ValueError):
        decode_result(msgpack.packb([9, "what"]))


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[tuple[dict[str, Box], dict[str, ReplicatedNode]]]:
    peers = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}
    objs = {n: Box() for n in peers}
    nodes: dict[str, ReplicatedNode] = {}
    try:
        for n, a in peers.items():
            nodes[n] = ReplicatedNode(objs[n], n, a, peers, SECRET, data_dir=str(tmp_path / n))
        yield objs, nodes
    finally:
        for node in nodes.values():
            node.close()


def test_a_followers_call_returns_what_the_leaders_returns(
    boxes: tuple[dict[str, Box], dict[str, ReplicatedNode]],
) -> None:
    objs, nodes = boxes
    lead = nodes["n1"].wait_for_leader()
    leader = objs[lead]
    follower = objs[next(n for n in objs if n != lead)]

    on_leader, on_follower = leader.put(5), follower.put(6)
    assert on_leader == (1, {5}, deque([5], maxlen=3), 1 << 80)
    assert on_follower == (2, {6}, deque([6], maxlen=3), 1 << 80)
    assert [type(v) for v in on_follower] == [type(v) for v in on_leader]
    assert on_follower[2].maxlen == 3

    for obj in (leader, follower):
        with pytest.raises(Refused) as caught:
            obj.refuse(3)
        assert (caught.value.code, str(caught.value)) == (3, "refused 3: no")
        with pytest.raises(KeyError):
            obj.missing()
    with pytest.raises(local_exception().__mro__[1]) as local:  # Exception
        follower.fail_locally()
    assert isinstance(local.value, RemoteError)
    assert local.value.kind.endswith("<locals>.Local")
    assert str(local.value) == "from a function's own class"

    assert isinstance(leader.opaque(), Opaque)
    with pytest.raises(ResultNotSent):
        follower.opaque()
    # Applied all the same, on every replica: the result could not travel, the call did.
    nodes[lead].node.read("default", lambda s: None).result(timeout=5)
    assert leader.items.count("opaque") == 2


def test_a_followers_call_returns_only_once_its_own_replica_applied_it(
    boxes: tuple[dict[str, Box], dict[str, ReplicatedNode]],
) -> None:
    """Found from outside: the leader's answer reached a follower's caller before the
    follower applied the entry, so the caller's own replica did not yet show its write
    (160 calls in 300). PySyncObj answers a call on the node that made it once that node
    has applied it, so a local read right after sees it."""
    objs, nodes = boxes
    lead = nodes["n1"].wait_for_leader()
    follower = objs[next(n for n in objs if n != lead)]
    for i in range(200):
        count = follower.put(i)[0]
        assert len(follower.items) >= count, f"call {i}: result {count}, replica {follower.items}"


def test_when_applied_waits_for_the_index_in_order_and_fails_when_the_store_closes() -> None:
    """The store's side of the wait: released by the apply that reaches the index (at
    once if applied), and with False when the store closes first, so the caller gets
    NodeStopped instead of waiting out its timeout."""
    from raftkv.node.user_state import UserStateStore

    store = UserStateStore(Box())
    seen: list[tuple[str, bool]] = []

    def note(name: str) -> Callable[[bool], None]:
        return lambda ok: seen.append((name, ok))

    store.when_applied(0, note("zero"))  # applied already: at once
    store.when_applied(2, note("two"))
    store.when_applied(1, note("one"))
    store.when_applied(5, note("five"))
    assert seen == [("zero", True)]
    cmd = msgpack.packb(["put", [1], {}])
    store.apply([(1, cmd)])
    assert seen[1:] == [("one", True)]
    store.apply([(2, cmd), (3, cmd)])
    assert seen[2:] == [("two", True)]
    store.close()
    assert seen[3:] == [("five", False)]
    store.when_applied(9, note("late"))  # closed: at once
    assert seen[4:] == [("late", False)]


def test_when_applied_gives_up_at_its_deadline() -> None:
    """Found in review: a follower cut off right after the leader answered held its
    caller until the link healed (for ever, had it been removed). ``expire`` ends the
    waits whose deadline passed, with None (the caller then gets the leader's result)."""
    from raftkv.node.user_state import UserStateStore

    store = UserStateStore(Box())
    seen: list[tuple[int, bool | None]] = []
    for index, deadline in ((3, 10.0), (4, 20.0), (5, float("inf"))):
        store.when_applied(index, lambda ok, i=index: seen.append((i, ok)), deadline)
    store.expire(5.0)
    assert seen == []
    store.expire(10.0)
    assert seen == [(3, None)]
    store.apply([(i, msgpack.packb(["put", [i], {}])) for i in range(1, 5)])
    assert seen == [(3, None), (4, True)]
    store.expire(1e9)
    assert seen == [(3, None), (4, True)]  # no deadline: only the apply or the close ends it
    store.close()
    assert seen[-1] == (5, False)
