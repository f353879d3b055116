"""What ``pip install raftkv`` costs on disk: a fresh virtualenv's site-packages.

What is measured
----------------
1. A bare virtualenv is created (``python -m venv``) and its ``site-packages`` measured:
   what any venv holds before anything is installed (pip, and setuptools on Python
   3.11).
2. ``pip install <this repository>`` (no extras, or ``--extras spark`` for
   ``.[spark]``) into it, from whatever index pip is configured with, and
   ``site-packages`` measured again: the total, what the install added, and the
   largest packages.

The size is the sum of the files' sizes on disk (``du``'s figure: allocated blocks), so
it matches ``du -sh site-packages``.

Budget (issue 17): the base install, total, under 60 MB. The script exits 1 if the
total is over ``--budget-mb`` (default 60; 0 disables the check), so it can gate a
release. It needs the package index (pip downloads the dependencies) and takes tens of
seconds, which is why it is a script and not part of the test suite.

Usage::

    python -m benchmarks.install_size [--extras spark] [--budget-mb 60] [--keep DIR]
        [--json FILE]

Results: a table on stdout and ``--json`` (default ``benchmarks/results/install_size.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MB = 1_000_000


def disk_bytes(path: Path) -> int:
    """Bytes allocated to the files under ``path`` (as ``du`` counts them)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            total += st.st_blocks * 512
    return total


def site_packages(env: Path) -> Path:
    (sp,) = env.glob("lib/python*/site-packages")
    return sp


@dataclass
class Size:
    extras: str | None
    total_bytes: int
    bare_venv_bytes: int
    added_bytes: int
    largest: dict[str, int]  # top-level entries the install added, largest first


def measure(env: Path, extras: str) -> Size:
    venv.create(env, with_pip=True)
    sp = site_packages(env)
    bare = disk_bytes(sp)
    bare_entries = set(os.listdir(sp))
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", target],
                   check=True)
    total = disk_bytes(sp)
    added = {e: disk_bytes(sp / e) for e in os.listdir(sp) if e not in bare_entries
             and not e.endswith(".dist-info")}
    return Size(extras or None, total, bare, total - bare,
                dict(sorted(added.items(), key=lambda kv: -kv[1])[:10]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--extras", default="", help="install .[EXTRAS] (default: no extras)")
    ap.add_argument("--budget-mb", type=float, default=60.0,
                    help="exit 1 if site-packages is larger (0: no check)")
    ap.add_argument("--keep", help="build the venv in this directory and keep it")
    ap.add_argument("--json", default=str(RESULTS / "install_size.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raftkv-install-size-") as tmp:
        env = Path(args.keep) if args.keep else Path(tmp) / "venv"
        r = measure(env, args.extras)
    what = f".[{args.extras}]" if args.extras else "."
    print(f"pip install {what} into a fresh venv (Python {sys.version.split()[0]}):")
    print(f"  site-packages total      {r.total_bytes / MB:8.1f} MB")
    print(f"  of which the bare venv   {r.bare_venv_bytes / MB:8.1f} MB (pip, setuptools)")
    print(f"  added by the install     {r.added_bytes / MB:8.1f} MB")
    for name, size in r.largest.items():
        print(f"    {name:<28} {size / MB:6.1f} MB")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({**asdict(r), "budget_mb": args.budget_mb}, f, indent=1)
    total_mb = r.total_bytes / MB
    if args.budget_mb and total_mb > args.budget_mb:
        print(f"OVER BUDGET: {total_mb:.1f} MB > {args.budget_mb} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
