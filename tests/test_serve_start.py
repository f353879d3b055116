"""How ``raftkv serve`` starts: arguments that would split a cluster are refused before
anything is written. (``/health`` and ``/ready`` at start: ``tests/test_ready.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raftkv.testing.procs import free_ports


def test_an_id_missing_from_peers_is_refused_without_join(tmp_path: Path) -> None:
    """A mistyped --id used to bootstrap a configuration of the peers plus itself: a
    4-voter group no other node shares."""
    ports = free_ports(5)
    peers = ",".join(f"n{i}=127.0.0.1:{ports[i - 1]}" for i in (1, 2, 3))
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    data = tmp_path / "n7"
    res = subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n7", "--data-dir", str(data),
         "--raft-addr", f"127.0.0.1:{ports[3]}", "--http-addr", f"127.0.0.1:{ports[4]}",
         "--peers", peers, "--secret-file", str(secret)],
        check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "n7 is not among --peers (n1, n2, n3)" in res.stderr
    assert "Traceback" not in res.stderr
    assert not data.exists() or not os.listdir(data)  # nothing written

