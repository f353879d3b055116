"""``make demo`` runs a real 3-node cluster; it must reach every act's goal and stop
every process it started."""

import io
from pathlib import Path

from raftkv import demo


def test_demo_runs_all_four_acts_on_real_processes(tmp_path: Path) -> None:
    out = io.StringIO()
    assert demo.run(out, base_dir=str(tmp_path / "demo"))
    text = out.getvalue()
    for act in ("== 1.", "== 2. SIGKILL", "== 3. Restart", "== 4. Add n4"):
        assert act in text
    assert "new leader:" in text and "recovery:" in text
    assert "TLS on: HTTPS and mutual TLS between peers" in text
    assert "GET /v1/kv/user:0001 with no token: 401" in text
    assert "PUT /v1/kv/user:0001 with the read token: 403" in text
    assert "learners=(n4*)" in text and "promote n4 applied" in text
    assert "replica digests identical on ['n1', 'n2', 'n3', 'n4']: True" in text
    assert "all nodes stopped" in text
