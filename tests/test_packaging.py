"""The install: storage/ and recovery/ live at the repository's top (a fixed layout) but
install as ``raftkv.storage`` and ``raftkv.recovery``, so no top-level name of ours can
clash with an application's own ``storage`` or ``recovery`` package (issue 17)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_is_listed():
    """The explicit package list (needed for package-dir) names every folder with an
    ``__init__.py``: a new subpackage cannot be silently left out of the wheel."""
    tool = _pyproject()["tool"]["setuptools"]
    dirs = tool["package-dir"]
    found = set()
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    assert set(tool["packages"]) == found


def test_import_beside_an_application_storage_package(tmp_path):
    """An application with its own ``storage`` and ``recovery`` packages imports raftkv
    (and the modules that use raftkv.storage) without either shadowing the other."""
    for name in ("storage", "recovery"):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"MINE = {name!r}\n")
        (pkg / "errors.py").write_text("")
    code = ("from raftkv import RaftKV\n"
            "import raftkv.storage.lmdb_log, raftkv.recovery.local, raftkv.node.driver\n"
            "import storage, recovery\n"
            "assert storage.MINE == 'storage' and recovery.MINE == 'recovery'\n"
            "print(RaftKV.__name__)\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path,
                         capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "RaftKV"


def test_wheel_has_no_top_level_storage(tmp_path):
    """The built wheel holds raftkv/storage and raftkv/recovery, py.typed, and nothing at
    the top level but raftkv and its metadata."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("raftkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"raftkv"}
    assert "raftkv/storage/lmdb_log.py" in names
    assert "raftkv/recovery/local.py" in names
    assert "raftkv/py.typed" in names
