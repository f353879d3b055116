"""pyspark, pyarrow and pandas are the ``spark`` extra: everything else runs without them,
and the Spark jobs say how to install them instead of failing with an ImportError."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A None entry in sys.modules makes any import of that module raise ImportError: the
# interpreter then behaves as if the spark extra were not installed.
_BLOCK = "import sys\nfor m in ('pyspark', 'pyspark.sql', 'pandas', 'pyarrow'):\n" \
         "    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=120)


def test_the_heavy_spark_dependencies_are_an_extra() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    for heavy in ("pyspark", "pandas", "pyarrow"):
        assert heavy not in core
    assert any(d.startswith("pyspark") for d in meta["optional-dependencies"]["spark"])


def test_the_server_the_cli_and_the_embedded_api_import_without_them() -> None:
    res = _run("import raftkv, raftkv.cli, raftkv.server.serve, raftkv.kv, raftkv.spark\n"
               "from raftkv import RaftKV\nprint('ok')")
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_a_spark_job_without_pyspark_says_how_to_install_it() -> None:
    res = _run("from raftkv.spark import SparkJobError, session\n"
               "try:\n    session()\nexcept SparkJobError as e:\n    print(e)\n")
    assert res.returncode == 0, res.stderr
    assert "pip install 'raftkv[spark]'" in res.stdout


def test_raftkv_spark_without_the_extra_is_one_line_naming_it() -> None:
    """Before anything else: no input is read and no cluster is asked (nothing listens
    at the endpoint, and the error is not about it)."""
    res = _run("import sys\nfrom raftkv.cli import main\n"
               "sys.exit(main(['--endpoints', 'http://127.0.0.1:9', 'spark', 'load', "
               "'--table', 't', '--input', 'nowhere.parquet', '--key', 'id']))\n")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == [
        ("error: raftkv spark needs the spark extra (pyspark is not installed): "
        "pip install 'raftkv[spark]'")]
