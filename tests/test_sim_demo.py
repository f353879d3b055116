"""``python -m raftkv.sim_demo`` runs the narrated simulated cluster; it must reach every act's goal."""

import io

from raftkv import sim_demo as demo


def test_demo_runs_all_four_acts_and_ends_consistent() -> None:
    out = io.StringIO()
    c = demo.run(out)
    text = out.getvalue()
    for act in ("1. Election", "2. n6 joins", "3. Remove the leader", "4. Partition", "5. Heal"):
        assert act in text
    assert "learners=(n6*)" in text  # seen as a PRE_FOLLOWER before promotion
    assert "replicas identical: True; 'lost' key present: False" in text
    lead = c.leader()
    assert lead is not None and "n6" in c.raft(lead).conf.voters
