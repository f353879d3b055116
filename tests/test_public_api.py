"""The public API carries real types (issue 17 item 3): the lazy exports of ``raftkv`` are
visible to type checkers, and ``raftkv.errors`` gathers the exceptions users catch
without changing their identity."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import raftkv
import raftkv.errors

ROOT = Path(__file__).resolve().parents[1]


def test_every_lazy_export_has_a_type_checking_import_of_the_same_object() -> None:
    tree = ast.parse((ROOT / "raftkv" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module is not None
                typed.update({a.asname or a.name: imp.module for a in imp.names})
    assert typed == raftkv._EXPORTS
    assert sorted(raftkv.__all__) == sorted(raftkv._EXPORTS)
    for name, module in typed.items():
        assert getattr(raftkv, name) is getattr(importlib.import_module(module), name)


def test_the_errors_module_re_exports_the_classes_raised_elsewhere() -> None:
    """Catching ``raftkv.errors.X`` catches what the code raises: the same class objects,
    reachable from their old paths too."""
    from raftkv.storage.commands import CommandError

    from raftkv.client import ClientError, OutcomeUnknown, Unavailable
    from raftkv.core import NotLeader
    from raftkv.node.errors import RequestTimeout

    assert raftkv.errors.NotLeader is NotLeader
    assert raftkv.errors.RequestTimeout is RequestTimeout
    assert raftkv.errors.CommandError is CommandError
    assert raftkv.errors.Unavailable is Unavailable and raftkv.errors.ClientError is ClientError
    assert issubclass(raftkv.errors.OutcomeUnknown, Unavailable) and OutcomeUnknown
    for name in raftkv.errors.__all__:
        cls = getattr(raftkv.errors, name)
        assert isinstance(cls, type) and issubclass(cls, Exception), name
        assert name in (raftkv.errors.__doc__ or ""), f"{name} is not documented"
    public = {n for n, v in vars(raftkv.errors).items()
              if isinstance(v, type) and issubclass(v, Exception)}
    assert public == set(raftkv.errors.__all__)


def test_a_type_checker_sees_the_real_types(tmp_path: Path) -> None:
    """mypy on a user's program, against the package laid out as installed (storage/ and
    recovery/ under raftkv/, as ``make test`` does): a wrong use of ``raftkv.RaftKV`` is an
    error, which it could not be if the lazy export were ``Any``."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "raftkv", tree / "raftkv", symlinks=True,
                    copy_function=_symlink)
    for name in ("storage", "recovery"):
        shutil.copytree(ROOT / name, tree / "raftkv" / name, copy_function=_symlink)
    (tree / "user.py").write_text(
        "import raftkv\n"
        "from raftkv.errors import NotLeader\n"
        "kv = raftkv.RaftKV('n1', '127.0.0.1:7001', {'n1': '127.0.0.1:7001'}, b's')\n"
        "index: str = kv.put(b'k', b'v')\n"
        "def hint(e: NotLeader) -> int:\n"
        "    return e.leader\n")
    res = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental",
                          "--ignore-missing-imports", "user.py"], cwd=tree, check=False,
                         capture_output=True, text=True, timeout=300)
    assert 'user.py:4: error: Incompatible types in assignment (expression has type "int"' \
        in res.stdout, res.stdout + res.stderr
    assert 'user.py:6: error: Incompatible return value type (got "str | None"' \
        in res.stdout, res.stdout + res.stderr
    assert "Found 2 errors in 1 file" in res.stdout, res.stdout


def _symlink(src: str, dst: str) -> None:
    Path(dst).symlink_to(src)
