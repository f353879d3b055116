"""The core's purity (DESIGN "The core contract": no clock, socket, thread, OS or global
randomness) and its quorum arithmetic checked against a deliberately dumb implementation
(Raft paper §5.2/§5.3 majorities; etcd's quorum test habit)."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raftkv.core import quorum

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "raftkv" / "core"
FORBIDDEN = {
    "time", "socket", "threading", "select", "os", "random", "asyncio", "lmdb",
    "pysyncobj", "subprocess", "multiprocessing", "datetime",
}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks, which
    only type checkers read (raftkv/__init__.py names its lazy exports there)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
    return out


def _imported_modules(path: Path) -> list[str]:
    """Absolute module names imported anywhere in ``path`` (top level or inside functions),
    including ``__import__("x")`` and ``importlib.import_module("x")``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                out.append(node.module)
        elif isinstance(node, ast.Call) and (
            getattr(node.func, "id", None) == "__import__"
            or getattr(node.func, "attr", None) == "import_module"
        ):
            out += [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
    return out


# pyproject's package-dir: these packages live in top-level folders of the repository.
PACKAGE_DIRS = {"raftkv.storage": ROOT / "storage", "raftkv.recovery": ROOT / "recovery"}


def _project_file(module: str) -> Path | None:
    parts = module.split(".")
    base = ROOT.joinpath(*parts)
    if ".".join(parts[:2]) in PACKAGE_DIRS:
        base = PACKAGE_DIRS[".".join(parts[:2])].joinpath(*parts[2:])
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _core_closure() -> list[Path]:
    """raftkv/core's modules plus every project module they import, transitively (the
    core may use storage's records and errors, which must be just as pure)."""
    todo = list(CORE.rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for m in _imported_modules(p):
            parts = m.split(".")
            for i in range(1, len(parts) + 1):  # the package __init__s run too
                f = _project_file(".".join(parts[:i]))
                if f is not None:
                    todo.append(f)
    return sorted(seen)


CORE_MODULES = _core_closure()


def test_core_modules_found():
    names = {str(p.relative_to(ROOT)) for p in CORE_MODULES}
    assert {"raftkv/core/raft.py", "raftkv/core/log.py", "raftkv/core/progress.py",
            "raftkv/core/quorum.py", "raftkv/core/membership.py",
            "storage/log_store.py"} <= names


@pytest.mark.parametrize("path", CORE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_is_pure(path):
    """DESIGN "Purity: the core never reads a clock or touches I/O" (and Habits 1: "A test
    asserts the core imports no clock, socket or thread"). Checked for every module of
    raftkv/core and every project module it imports."""
    bad = [m for m in _imported_modules(path) if m.split(".")[0] in FORBIDDEN]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


_IMPORT_CORE = """
import sys
before = set(sys.modules)
import raftkv.core
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_importing_core_loads_no_io_modules():
    """Runtime double check: importing raftkv.core in a fresh interpreter loads no
    networking, threading, process or storage-engine module. (``datetime`` is left out:
    msgpack loads it for its Timestamp type; ``os``/``time`` are loaded by the interpreter
    itself.)"""
    res = subprocess.run([sys.executable, "-c", _IMPORT_CORE], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60)
    loaded = res.stdout.split()
    assert "raftkv.core.raft" in loaded
    heavy = FORBIDDEN - {"datetime", "os", "time"}
    assert not [m for m in loaded if m.split(".")[0] in heavy]


def test_purity_checker_catches_forbidden_imports(tmp_path):
    """The checker itself notices both import forms (so the test above can fail)."""
    p = tmp_path / "m.py"
    p.write_text("import os.path\nfrom time import monotonic\nfrom . import quorum\n"
                 "import msgpack\nif TYPE_CHECKING:\n    import socket\n")
    assert sorted(m.split(".")[0] for m in _imported_modules(p)) == ["msgpack", "os", "time"]


# ------------------------------------------------------------ quorum arithmetic --
def dumb_majority(n: int) -> int:
    return next(k for k in range(n + 1) if 2 * k > n)


def dumb_committed_index(voters: set[str], match: dict[str, int]) -> int:
    """The largest index N such that a majority of voters have match >= N (Figure 2:
    "a majority of matchIndex[i] >= N"), by trying every candidate index."""
    if not voters:
        return 0
    best = 0
    for n in range(max(list(match.values()) + [0]) + 1):
        holders = [v for v in voters if match.get(v, 0) >= n]
        if 2 * len(holders) > len(voters):
            best = n
    return best


def dumb_vote_result(voters: set[str], votes: dict[str, bool]) -> bool | None:
    """Try every way the missing voters could still answer: won if every completion wins,
    lost if every completion loses, pending otherwise."""
    pending = sorted(v for v in voters if v not in votes)
    outcomes = set()
    for answers in itertools.product([True, False], repeat=len(pending)):
        full = {v: votes[v] for v in voters if v in votes} | dict(zip(pending, answers))
        outcomes.add(2 * sum(full.values()) > len(voters))
    if outcomes == {True}:
        return True
    if outcomes == {False}:
        return False
    return None


NAMES = [f"n{i}" for i in range(1, 9)]
voter_sets = st.sets(st.sampled_from(NAMES), min_size=1, max_size=7)
# match/votes may name non-voters (learners, removed nodes) and omit voters.
match_maps = st.dictionaries(st.sampled_from(NAMES + ["l1", "l2"]),
                             st.integers(min_value=0, max_value=30), max_size=10)
vote_maps = st.dictionaries(st.sampled_from(NAMES + ["l1", "l2"]), st.booleans(), max_size=10)


@settings(max_examples=400, deadline=None)
@given(voter_sets, match_maps)
def test_committed_index_matches_brute_force(voters, match):
    """§5.3/§5.4 (Figure 2, Rules for Servers, Leaders): commit index = the highest index
    replicated on a majority of voters; learners' and strangers' matches never count."""
    assert quorum.committed_index(voters, match) == dumb_committed_index(voters, match)


@settings(max_examples=400, deadline=None)
@given(voter_sets, vote_maps)
def test_vote_result_matches_brute_force(voters, votes):
    """§5.2: a candidate wins with votes from a majority of voters; it has lost once a
    majority can no longer be reached; non-voters' answers are ignored."""
    assert quorum.vote_result(voters, votes) == dumb_vote_result(voters, votes)


@settings(max_examples=300, deadline=None)
@given(voter_sets, st.sets(st.sampled_from(NAMES + ["l1"])))
def test_has_quorum_and_majority_match_brute_force(voters, acked):
    assert quorum.majority(len(voters)) == dumb_majority(len(voters))
    expect = 2 * len([v for v in voters if v in acked]) > len(voters)
    assert quorum.has_quorum(voters, acked) == expect


def test_quorum_edge_cases():
    """Fixed examples that document the arithmetic (even voter counts need n/2 + 1)."""
    assert quorum.committed_index({"a", "b", "c", "d"}, {"a": 5, "b": 5, "c": 3, "d": 0}) == 3
    assert quorum.committed_index({"a", "b", "c"}, {"a": 5, "l": 9}) == 0
    assert quorum.committed_index(set(), {"a": 5}) == 0
    assert quorum.vote_result({"a", "b", "c", "d"}, {"a": True, "b": True}) is None
    assert quorum.vote_result({"a", "b", "c", "d"}, {"a": False, "b": False}) is False
    assert quorum.vote_result({"a"}, {"a": True}) is True
    assert quorum.vote_result({"a", "b", "c"}, {"a": True, "x": True, "y": True}) is None
