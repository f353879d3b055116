"""raftkv: a Raft library and replicated key-value store.

The embedded API, imported lazily so that ``import raftkv.core`` stays light:

- ``RaftKV``: the replicated KV store (``raftkv.kv``);
- ``ReplicatedNode``, ``ReplicatedObject``, ``replicated``: replicate your own object,
  PySyncObj-style (``raftkv.embedded``, ``raftkv.statemachine``).
"""

from __future__ import annotations

import importlib
from typing import Any

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
