"""The placement simulator (``python -m raftkv.sim --placement``,
``raftkv.testing.placement_sim``): the real node driver, metastore, placement managers
and partition groups under seeded faults on a virtual clock.

The fast suite runs ``FAST_SEEDS``; ``-m long`` runs ``RAFTKV_PLACEMENT_SEEDS`` (default
0:10000) on every core. Seeds that found a bug are kept below, each with what it found.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from raftkv import sim
from raftkv.testing.placement_sim import PlacementResult, run_placement_seed

FAST_SEEDS = range(1000, 1012)


def _explain(r: PlacementResult) -> str:
    return "\n".join([*r.violations, f"stuck: {r.stuck}", f"lost: {r.lost}",
                      f"check: {r.check}", *r.trace[-40:]])


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_seed_converges_safely(seed: int) -> None:
    r = run_placement_seed(seed)
    assert r.ok, _explain(r)
    assert r.counts.get("put-ok", 0) > 0  # the clients got writes through


@pytest.mark.parametrize("seed, found", [
    # A leader whose metastore view lagged began a change towards a pending that had
    # moved on, and dropped it with the learner it had added still in the configuration:
    # stable reached, a stray learner for ever (PlacementManager._drop_stray_learners).
    (30, "stray learner"),
    # A leader acted on a stale cached pending after onRebalanceDone: its change (and
    # the handover that removed it) left two voters for a stable of three, for ever
    # (PlacementManager._pending_confirmed: read pending before acting, seed 004's
    # onLeaderElected).
    (88, "voters below stable"),
])
def test_regression_seed(seed: int, found: str) -> None:
    r = run_placement_seed(seed)
    assert r.ok, f"{found}:\n{_explain(r)}"


def _timeless(trace: list[str]) -> list[str]:
    # Recovery reports measure their own (wall-clock) speed; nothing else may differ.
    return [re.sub(r" in [0-9.]+s \([0-9,]+ entries/s\)", "", line) for line in trace]


def test_a_seed_replays_exactly() -> None:
    """Same seed, same run: every logged step of every node at the same simulated time,
    incarnations and request ids included."""
    first, again = run_placement_seed(1003, verbose=True), run_placement_seed(1003,
                                                                               verbose=True)
    assert len(first.trace) > 100
    assert _timeless(first.trace) == _timeless(again.trace)
    assert first.counts == again.counts and first.sim_seconds == again.sim_seconds


def test_cli_last_line_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--placement", "--seeds", "1000:1002"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "seeds=2 violations=0 nonlinearizable=0 stuck=0"


def test_cli_rejects_bad_arguments_clearly() -> None:
    for args, said in ((["--faults", "crash,meteor"], "unknown fault(s) meteor"),
                       (["--nodes", "3"], "needs --nodes 4 or more"),
                       (["--seeds", "x:y"], "--seeds must be A:B or N")):
        out = subprocess.run([sys.executable, "-m", "raftkv.sim", "--placement", *args],
                             capture_output=True, text=True, check=False)
        assert out.returncode == 2, out
        assert said in out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.long
def test_long_many_seeds() -> None:
    spec = os.environ.get("RAFTKV_PLACEMENT_SEEDS", "0:10000")
    jobs = str(os.cpu_count() or 1)
    assert sim.main(["--placement", "--seeds", spec, "--jobs", jobs]) == 0
