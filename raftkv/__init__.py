"""raftkv: a Raft library and replicated key-value store.

The embedded API, imported lazily so that ``import raftkv.core`` stays light:

- ``RaftKV``: the replicated KV store (``raftkv.kv``);
- ``ReplicatedNode``, ``ReplicatedObject``, ``replicated``, ``StateMachine``: replicate
  your own object, PySyncObj-style (``raftkv.embedded``, ``raftkv.statemachine``).

The exceptions they raise are in ``raftkv.errors``.

Type checkers do not run ``__getattr__``: they read the ``TYPE_CHECKING`` imports below,
which name the same objects, so ``raftkv.RaftKV`` has its real type and not ``Any``
(``tests/test_public_api.py`` keeps the two lists equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raftkv.embedded import ReplicatedNode
    from raftkv.kv import RaftKV
    from raftkv.statemachine import ReplicatedObject, StateMachine, replicated

_EXPORTS = {
    "RaftKV": "raftkv.kv",
    "ReplicatedNode": "raftkv.embedded",
    "ReplicatedObject": "raftkv.statemachine",
    "replicated": "raftkv.statemachine",
    "StateMachine": "raftkv.statemachine",
}

__all__ = ["RaftKV", "ReplicatedNode", "ReplicatedObject", "StateMachine", "replicated"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raftkv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
