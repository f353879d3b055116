"""The placement simulator (``python -m raftkv.sim --placement``,
``raftkv.testing.placement_sim``): the real node driver, metastore, placement managers
and partition groups under seeded faults on a virtual clock.

The fast suite runs ``FAST_SEEDS``; ``-m long`` runs ``RAFTKV_PLACEMENT_SEEDS`` (default
0:10000) with every fault, the opt-in ones included, on every core. Seeds that found a bug are kept below, each with what it found.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

from raftkv import sim
from raftkv.placement.assignments import calc_assignments, decode_nodes
from raftkv.placement.catalog import DEAD_KEY, MEMORY, PERSISTENT, partition_group
from raftkv.placement.liveness import ClusterSettings
from raftkv.testing.placement_chaos import META, TABLE, Scenario
from raftkv.testing.placement_sim import (
    ALL_FAULTS,
    DRAIN_FAULTS,
    LIVENESS_FAULTS,
    SCALE_DOWN,
    SCALE_UP,
    PlacementResult,
    PlacementSim,
    run_placement_seed,
)

FAST_SEEDS = range(1000, 1004)


def _explain(r: PlacementResult) -> str:
    return "\n".join([*r.violations, f"stuck: {r.stuck}", f"lost: {r.lost}",
                      f"check: {r.check}", *r.trace[-40:]])


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_seed_converges_safely(seed: int) -> None:
    r = run_placement_seed(seed)
    assert r.ok, _explain(r)
    assert r.counts.get("put-ok", 0) > 0  # the clients got writes through


# Seeds that found a bug, each with what it found. The fault model and the fixes have
# changed the schedules since (a seed replays exactly only on the code it ran on), so a
# kept seed guards its area rather than the exact interleaving; the scripted tests below
# pin the sequences that can be written down.
KEPT_SEEDS = [
    # A leader whose metastore view lagged left a stray learner for ever
    # (PlacementManager._drop_stray_learners).
    (30, "stray learner"),
    # A leader acted on a stale cached pending after onRebalanceDone: two voters for a
    # stable of three, for ever (ChangePeers._pending_confirmed).
    (88, "voters below stable"),
    # Step (3) stopped a group in which the node was still a voter after a cancel
    # dropped it from pending: {it, leader} without a quorum (rebalance._reconcile).
    (6, "stopped a needed voter"),
    # Frames reordered on one link: a stale quiesce heartbeat quieted a follower below
    # the commit index (the simulated network now keeps TCP's order).
    (120, "quiesced below the commit index"),
    (164, "quiesced below the commit index"),
    # Faults the partitions could not survive (two losses in one group), now excluded
    # by PlacementSim._survivable_loss.
    (148, "in-memory crash of a two-voter configuration"),
    (2006, "lone-holder loss before step (1) ran"),
    (18, "lone-holder loss with a learner not yet recorded"),
    (581, "a loss while a replica-count intent was not yet planned"),
    # A founder removed and re-added in the same incarnation bootstrapped the founding
    # configuration again (or reopened its stale log) and won a term with another stale
    # member; its leader then crashed on an acknowledgement beyond its log
    # (SafeRestart._first_start, step (3) deletes a removed member's files).
    (646, "a removed founder campaigned under a stale configuration"),
    # The first version of _first_start let a removed founder named by pending again
    # bootstrap: two leaders in one term.
    (917, "two leaders in a term"),
    # A persistent holder restarting while the other member's files were wiped: the
    # wiped one saw no holder and started a fresh history, which diverged from the
    # holder's committed entries (SafeRestart._restart_epoch).
    (1195, "a full restart over a restarted persistent holder"),
    # Two of three founders registered after the table's creation and took the restart
    # path for a partition they never hosted (SafeRestart._first_start).
    (63, "founders waiting at creation"),
    # A leader removing itself handed over, at every retry, to a voter that could not
    # take over (Raft._most_up_to_date_voter).
    (138, "handover to a stopped replica"),
    (747, "a removal left {lost, leader} of three voters; switch.reduce kept a lost voter"),
    (920, "the same: a wiped voter kept in a two-member pending"),
    (1202, "the same, after partitions and wipes"),
    (35, "a livelock: a start refused by its back-off kicked the same start at once"),
    (1829, "the fault model wiped a second metastore founder during the first's re-add"),
    (2807, "a founder's empty log took the founding configuration: two committed entries"),
    # A two-replica persistent table lost a member's files; a cancel and the unblock left
    # pending naming neither member, so the lone holder could not prove (B) of the
    # survivor rule (ChangePeers._lone_holder).
    (785, "a lone holder that pending did not name"),
]


# Seeds found by the long runs of 2026-11-27. Their schedules depend on the hash seed,
# so each runs as the command line replays it, with PYTHONHASHSEED=0.
HASH_SEEDED = [
    # Liveness, two replicas: stable [n1, n3], a cancel by the leader n3 wrote pending
    # [n2, n4, n5] after n1's files were wiped but before n1 recorded the loss, and n3
    # lost its term before it could name itself again. A pending that names a node that
    # is a voter of no configuration of the holder's log now proves (B) as well
    # (SafeRestart._survivor_case).
    (1076, "a lone holder left out of pending by a cancel"),
    # Liveness, two replicas: {n2, n3, n4} -> {n2, n4} committed on n4, whose notice of
    # it to n2 was lost; n3 deleted its replica, n4's files were wiped, and n2's survivor
    # election needed n3 (its commit index was below the removal). n2 now learns the
    # commit from the metastore (PartitionKeys.applied, Raft.learn_commit).
    (1187, "a holder that missed a commit learns it from the metastore"),
    # Liveness: the lone holder n3 started its group as soon as its holds key was
    # written, and the one look that followed ran before the watch brought that key to
    # its cache; nothing looked again (MetastoreView._apply_event now kicks a hosted
    # two-voter group a holds or incarnation key may unblock).
    (1739, "a holder whose own holds key came late looks again"),
    # Liveness, core quiescence: the leader went quiet while it counted n2 unreachable,
    # so its quiesce heartbeat named entry 95 with commit 94; n2 slept, the follow-up
    # was dropped, and n2 stayed one entry behind for good. A follower now goes quiet
    # only once the heartbeat's commit reaches the entry it names (Raft._handle_heartbeat).
    (2104, "a follower told a commit below the quiesce entry stays awake"),
    # Liveness: onRebalanceDone re-adding n1 wrote pending [n1, n2, n3] and switch.append
    # [n1]; a cancel moved planned [n2, n3, n5] in before n1 was promoted. The next done
    # found n1 neither reduced nor added, kept it in switch.append but not in the pending
    # it wrote (pendingAddition), and looped on a no-op change for ever; planned never
    # moved in. pendingAddition now names every node of switch.append'
    # (rebalance_steps.rebalance_done_switch).
    (2902, "a re-add a cancel dropped from pending is added again by the next done"),
]


@pytest.mark.parametrize("seed, found", HASH_SEEDED)
def test_hash_seeded(seed: int, found: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    res = subprocess.run([sys.executable, "-m", "raftkv.sim", "--placement", "--seeds", str(seed)],
                         check=False, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, f"{found}:\n{res.stdout[-2000:]}"


# The same, found by the long run on 0c17fee with the liveness faults on
# (``--faults drop,delay,dup,partition,crash,wipe,outage,flap``), replayed that way.
LIVENESS_HASH_SEEDED = [
    # Liveness: n5, removed from [n2, n3] and still hosting, was re-added and promoted
    # while its metastore cache still showed stable [n2, n3] with nothing pending; step
    # (3) stopped it and deleted its files, it came back empty as a fresh joiner, and
    # the leader's removal of n2 left {n3, wiped n5} for ever. Step (3) now also waits
    # while our log holds a configuration naming us newer than the one that stable
    # ended with (PartitionKeys.applied; PlacementManager._log_past_stable).
    (2255, "a re-added voter stopped on a stale stable came back empty"),
    # The same on t.chaos.0: n2 removed, re-added and promoted, then stopped on the stale
    # stable [n1, n3]; one replica ended at applied index 0.
    (2236, "the same: a re-added voter stopped on a stale stable"),
    # The same on t.chaos.3: n3's cache read stable [n4, n5] while its log's voters were
    # {n3, n4}.
    (3365, "the same, on a third table"),
    # Stuck after a wipe while the core re-sent vote requests to silent voters every tick
    # (reverted, not diagnosed): kept so that such a change is caught again.
    (560, "stuck after the wipe of n1 with a per-tick re-poll"),
    (681, "stuck after the wipe of n2 with a per-tick re-poll"),
]


@pytest.mark.parametrize("seed, found", LIVENESS_HASH_SEEDED)
def test_hash_seeded_with_liveness_faults(seed: int, found: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    faults = ",".join((*ALL_FAULTS, *LIVENESS_FAULTS))
    res = subprocess.run([sys.executable, "-m", "raftkv.sim", "--placement", "--seeds", str(seed),
                          "--faults", faults],
                         check=False, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, f"{found}:\n{res.stdout[-2000:]}"


@pytest.mark.parametrize("seed, found", KEPT_SEEDS)
def test_kept_seed(seed: int, found: str) -> None:
    r = run_placement_seed(seed)
    assert r.ok, f"{found}:\n{_explain(r)}"


def _scripted(seed: int, storage: str, replicas: int,
              script: Callable[[PlacementSim], None]) -> PlacementResult:
    """One partition on n1..n3, clients on, then ``script``; no random faults."""
    scenario = Scenario(seed, 1, storage, replicas, list(META), [], list(META), replicas)
    return PlacementSim(seed, scenario=scenario, faults=(), verbose=True).run(script)


@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_two_replica_in_memory_partition_whose_replica_restarts_converges(victim: str,
                                                                          ) -> None:
    """Issue 14, "a reachable state waits for ever": stable [a, b] in memory, one of them
    restarts without its state. A lost follower is removed by its leader; a lost leader
    leaves the lone holder, which continues alone ("The lone holder of a two-voter
    configuration" in raftkv.placement.safe_restart). Either way the restarted one is
    re-added fresh and nothing acknowledged is lost (the run's checks)."""
    def script(sim: PlacementSim) -> None:
        stable = sim.assignment(0)[0]
        assert len(stable) == 2
        lead = sim.wait(lambda: sim.leader_of(partition_group(TABLE, 0)), 10, "a leader")
        lost = lead if victim == "leader" else next(n for n in stable if n != lead)
        sim.restart_later(sim.hosts[lost], 0.5)
        sim.sleep(2.0)

    r = _scripted(5000 + (victim == "follower"), MEMORY, 2, script)
    assert r.ok, _explain(r)
    assert any("re-added after its removal" in line for line in r.trace)
    if victim == "leader":
        assert any("campaigns without it" in line for line in r.trace), "no survivor election"


def test_seed_102_a_two_voter_stable_left_by_a_re_add_survives_a_second_loss() -> None:
    """Chaos seed 102's sequence, in the simulator: a three-replica in-memory partition
    loses one replica's state, so IGNITE-16668 removes it (stable: two voters) and
    re-adds it (pending: three); while the re-add is under way one of the two stable
    voters restarts too. It must converge with nothing acknowledged lost."""
    def script(sim: PlacementSim) -> None:
        first = sim.assignment(0)[0][2]
        sim.restart_later(sim.hosts[first], 0.3)
        sim.wait(lambda: (len(sim.assignment(0)[0]) == 2
                          and len(sim.assignment(0)[1]) == 3), 60,
                 "the re-add under way (stable of two, pending of three)")
        second = sim.assignment(0)[0][0]
        sim.log(f"second loss: {second} while {sim.assignment(0)}")
        sim.restart_later(sim.hosts[second], 0.3)
        sim.sleep(2.0)

    r = _scripted(5102, MEMORY, 3, script)
    assert r.ok, _explain(r)
    assert any("second loss" in line for line in r.trace)


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
    """Every fault, the opt-in ones included (failure detection, re-replication,
    metastore replacement, flapping nodes and drains): ``RAFTKV_PLACEMENT_FAULTS``
    narrows it."""
    spec = os.environ.get("RAFTKV_PLACEMENT_SEEDS", "0:10000")
    faults = os.environ.get("RAFTKV_PLACEMENT_FAULTS",
                            ",".join(ALL_FAULTS + LIVENESS_FAULTS + DRAIN_FAULTS))
    jobs = str(os.cpu_count() or 1)
    assert sim.main(["--placement", "--seeds", spec, "--faults", faults, "--jobs", jobs]) == 0


# ================================== failure detection and re-replication (liveness) =====
# 20: the catch-up timeout re-added a held-off learner while another caught up, a phase
# move (CATCHING_UP -> ADDING) the transition table did not list.
LIVENESS_SEEDS = [*range(2000, 2003), 20]


@pytest.mark.parametrize("seed", LIVENESS_SEEDS)
def test_seeds_with_outages_and_flapping_nodes(seed: int) -> None:
    """The opt-in liveness faults on top of every other: a node down past the
    scale-down timeout (its partitions re-replicate), and one that flaps around it."""
    r = run_placement_seed(seed, faults=ALL_FAULTS + LIVENESS_FAULTS)
    assert r.ok, _explain(r)


# Drains (``--faults ...,drain``): 153 found a start abandoned after its holds key was
# written (no longer named when the write returned), the key left for good and the drain
# waiting on it (PlacementManager._sweep_holds); 104, a 2-replica partition moved onto
# {n4, n5} while n5 was dead but not yet declared so, which two replicas never survive
# (the simulator now loses a node for good only with three replicas). 232 SIGKILLs a
# node during its drain, 230 removes one lost for good; 2000-2002 are fresh seeds.
DRAIN_SEEDS = [153, 104, 232, 230, *range(2000, 2003)]


# Found by the long run on 8ae3af3 with every opt-in fault (outage, flap and drain):
# 420, the metastore leader removed a draining node whose start's holds keys were still
# on their way, and then waited for good on keys the node, out of the metastore, could
# never release (a removed node is now forgotten whatever keys it left); 430, stuck
# after a wipe, passes on the code after the review's holds-cache fix (not diagnosed
# further). 2808 (found on 9a22f8a, the first seeds run with the early send of 0a7f7b3):
# the simulator's drain of n5 lost its first attempt's answer, and the retry, finding n5
# out of the topology (drained by that attempt and forgotten), was taken for a refusal;
# n5 was never stopped, then named again while up, and never readmitted to the metastore
# it had left, so nothing converged. A harness bug (PlacementSim.drain): the product
# drained n5 as asked.
# 5176 (found on 9f6f29b): a metastore step that demoted voters above metastore_voters
# demoted the spare promoted for n1 when n1 came back first; on that course a partition's
# stable stayed above its assignment ([n2, n3, n4, n5] for [n3, n4, n5]) and was never
# planned again. The step was left out; the stuck state it reached came back on 42f8de6
# and is fixed (docs/placement-simulator.md, "seed 5176 again": DONE_REPLANNED).
LONG_DRAIN_SEEDS = [420, 430, 2808, 5176]


@pytest.mark.parametrize("seed", DRAIN_SEEDS)
def test_seeds_with_drains(seed: int) -> None:
    """``drain`` of a live node, of one SIGKILLed during it, and ``remove-node`` of one
    lost for good, on top of every other fault: the node leaves the topology, the
    metastore and the draining list within a bound, and the usual checks hold."""
    r = run_placement_seed(seed, faults=ALL_FAULTS + DRAIN_FAULTS)
    assert r.ok, _explain(r)


@pytest.mark.parametrize("seed", LONG_DRAIN_SEEDS)
def test_hash_seeded_with_every_opt_in_fault(seed: int) -> None:
    """Replayed as the long run found them: PYTHONHASHSEED=0, a process of their own."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    faults = ",".join((*ALL_FAULTS, *LIVENESS_FAULTS, *DRAIN_FAULTS))
    res = subprocess.run([sys.executable, "-m", "raftkv.sim", "--placement", "--seeds", str(seed),
                          "--faults", faults],
                         check=False, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:]


@pytest.mark.parametrize("storage", [PERSISTENT, MEMORY])
def test_a_node_down_for_good_is_declared_dead_and_its_replicas_move(storage: str) -> None:
    """Issue 18's scenario in the simulator: four data nodes, a replica's node dies and
    stays down. It is suspect, then dead after the scale-down timeout; every partition
    is re-assigned over the three live nodes and has three replicas there. Back, it is a
    data node again after the scale-up timeout (the run's final checks)."""
    def script(sim: PlacementSim) -> None:
        sim.set_settings(ClusterSettings(SCALE_DOWN, SCALE_UP))
        sim.apply(("nodes", [*META, "n4"]))
        sim.settle("four nodes")
        victim = sim.assignment(0)[0][0]
        live = sorted({*META, "n4"} - {victim})
        sim.hosts[victim].crash()
        want = calc_assignments(TABLE, 0, live, 3)
        sim.wait(lambda: sim.assignment(0) == (want, [], []), 60, f"re-replication to {want}")
        meta = sim._meta_view()
        assert meta is not None
        dead = meta.store.get_entry(DEAD_KEY)
        assert dead is not None and decode_nodes(dead.value) == [victim]
        sim.wait(lambda: sim.leader_of(partition_group(TABLE, 0)), 10, "a leader")
        sim.sleep(2.0)  # writes go on with three live replicas

    scenario = Scenario(5018, 1, storage, 3, list(META), [], [*META, "n4"], 3)
    r = PlacementSim(5018, scenario=scenario, faults=(), verbose=True).run(script)
    assert r.ok, _explain(r)
    assert any(" is dead " in line for line in r.trace)
