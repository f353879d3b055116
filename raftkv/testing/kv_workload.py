"""What the simulator's KV API clients ask (``SimConfig.kv_api``): random puts, deletes,
gets with metadata, compare-and-set on a value or a revision, transactions over two or
three keys, and leases (grant, put attached, keepalive, revoke), encoded as the real
storage commands.

Every written value is the op's own id, unique in the run, so a read names its writer.
Clients remember what they last saw of each key (value, mod revision, version) and of
which leases they granted, and aim their compares and CAS there, so that both outcomes
of a compare happen often.
"""

from __future__ import annotations

import random
from typing import Any

from raftkv.storage.commands import (
    encode_cas,
    encode_cas_index,
    encode_delete,
    encode_lease_grant,
    encode_lease_revoke,
    encode_put,
    encode_put_lease,
    encode_txn,
)
from raftkv.storage.txn import CmpOp, Compare, Kind, Target, Txn, TxnOp
from raftkv.testing.kv_history import Meta

KINDS = ("put", "put", "delete", "get", "get", "get", "get", "cas", "cas_index", "txn", "txn",
         "grant", "put_lease", "put_lease", "keepalive", "keepalive", "keepalive", "revoke")
# Keys only a lease put writes (the others are written all the time, which detaches
# them): what makes an expiry delete something.
LEASED_KEYS = ("l0", "l1")
_TARGETS = {"value": Target.VALUE, "mod": Target.MOD, "create": Target.CREATE,
            "version": Target.VERSION, "exists": Target.EXISTS}
_OPS = {"==": CmpOp.EQ, "!=": CmpOp.NE, "<": CmpOp.LT, ">": CmpOp.GT}
_KINDS = {"put": Kind.PUT, "delete": Kind.DELETE, "get": Kind.GET}
TTLS = (1, 2)  # seconds of simulated time: 5 to 20 election timeouts


class KvWorkload:
    def __init__(self, rng: random.Random, keys: int) -> None:
        self.rng = rng
        self.keys = [f"k{i}" for i in range(keys)]
        self.seen: dict[str, Meta | None] = {}
        self.leases: list[int] = []

    def saw(self, key: str, m: Meta | None) -> None:
        self.seen[key] = m

    def next(self, op_id: int) -> tuple[str, str | None, Any]:
        """(kind, key, args) of a new op, in ``kv_history.KvOp``'s terms."""
        rng, value = self.rng, str(op_id)
        kind = rng.choice(KINDS)
        key = rng.choice(self.keys + list(LEASED_KEYS) if kind == "get" else self.keys)
        m = self.seen.get(key)
        if kind in ("put", "delete", "get"):
            return kind, key, value if kind == "put" else None
        if kind == "cas":
            return kind, key, (rng.choice([None, None if m is None else m.value]), value)
        if kind == "cas_index":
            return kind, key, (rng.choice([0, 0 if m is None else m.mod]), value)
        if kind == "txn":
            return kind, None, self._txn(value)
        if kind == "grant":
            self.leases.append(op_id)
            return kind, None, (op_id, rng.choice(TTLS))
        if not self.leases:
            return "get", key, None
        lease = rng.choice(self.leases[-3:])
        if kind == "put_lease":
            return kind, rng.choice(LEASED_KEYS + (key,)), (value, lease)
        return kind, None, lease  # keepalive, revoke

    def _txn(self, value: str) -> tuple[Any, ...]:
        rng = self.rng
        keys = rng.sample(self.keys, rng.choice((2, 3)))
        compares = []
        for key in rng.sample(keys, rng.choice((1, 2))):
            m = self.seen.get(key)
            target = rng.choice(list(_TARGETS))
            if target == "exists":
                compares.append((key, target, rng.choice(("==", "!=")), m is not None))
                continue
            if target == "value":
                operand: Any = rng.choice([value, "" if m is None else m.value])
            else:
                have = 0 if m is None else {"mod": m.mod, "create": m.create,
                                            "version": m.version}[target]
                operand = max(0, have + rng.choice((-1, 0, 0, 1)))
            compares.append((key, target, rng.choice(list(_OPS)), operand))

        def branch(tag: str) -> tuple[Any, ...]:
            ops = []
            for key in keys:
                what = rng.choice(("put", "put", "delete", "get", "skip"))
                if what != "skip":
                    ops.append((what, key, f"{value}{tag}" if what == "put" else None))
                if rng.random() < 0.3:
                    ops.append(("get", key, None))  # after the write: sees it
            return tuple(ops)

        return tuple(compares), branch("a"), branch("b")


def encode(kind: str, key: str | None, args: Any) -> bytes:
    """The storage command of a write (``KvOp`` terms)."""
    k = b"" if key is None else key.encode()
    if kind == "put":
        return encode_put(k, args.encode())
    if kind == "delete":
        return encode_delete(k)
    if kind == "cas":
        expected, new = args
        return encode_cas(k, None if expected is None else expected.encode(), new.encode())
    if kind == "cas_index":
        return encode_cas_index(k, args[0], args[1].encode())
    if kind == "txn":
        compares, success, failure = args
        return encode_txn(Txn(
            tuple(Compare(c.encode(), _TARGETS[t], _OPS[o],
                          operand.encode() if isinstance(operand, str) else operand)
                  for c, t, o, operand in compares),
            tuple(TxnOp(_KINDS[w], kk.encode(), None if v is None else v.encode())
                  for w, kk, v in success),
            tuple(TxnOp(_KINDS[w], kk.encode(), None if v is None else v.encode())
                  for w, kk, v in failure)))
    if kind == "grant":
        return encode_lease_grant(*args)
    if kind == "put_lease":
        return encode_put_lease(k, args[0].encode(), args[1])
    if kind in ("revoke", "expire"):
        return encode_lease_revoke(args)
    raise ValueError(f"not a write: {kind!r}")
