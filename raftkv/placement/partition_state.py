"""What one node's placement manager knows and has under way for each partition
(``PartitionState``): how this node starts its replica, an explicit ``StartPhase`` checked
against ``START_TRANSITIONS``, and the leader's change in progress (``Change``), an
explicit ``ChangePhase`` checked against ``CHANGE_TRANSITIONS``.

The start phases (IGNITE-16668's restart path, ``raftkv.placement.safe_restart``)
-------------------------------------------------------------------------------
Each time this node's manager learns a partition it must decide how to start its replica,
and whether it may: a replica that lost its state (in memory, or a persistent one whose
files were wiped) must not come back as the voter it was.

- ``UNDECIDED``: not looked at yet in this incarnation (the storage self-check and the
  first-start rule run on the first look);
- ``NORMAL``: nothing to hide: start over our own log, bootstrap the founding
  configuration on a founder's first start, or join empty as a new member. It is also
  where the restart path ends: re-added after the leader removed us, or a full-partition
  restart that bootstraps a fresh history;
- ``LOST``: our state is gone while stable names us (or, bug C's in-memory case, the
  change under way may count on us): not started; decide between recording the loss in
  switch.reduce (a majority of stable is available), a full-partition restart (nobody
  holds the state) and waiting;
- ``LEAVING``: our state is gone while only pending names us: leave pending (one invoke
  that also records us in switch.reduce);
- ``LEFT``: left pending; not started until the leader has removed us and pending names
  us again;
- ``RECORDED``: we are in switch.reduce; not started until the leader has removed us
  (stable without us) and re-adds us, or a full-partition restart applies.

The moves are those of ``START_TRANSITIONS``. Only ``NORMAL`` starts the group (the
manager's requests in flight, such as the holds-key write before a start, are marked
separately: they are not phases). Any other move is a bug, raised as
``IllegalTransition``.

The change's phases
-------------------
A changePeers (``raftkv.placement.change_peers``) moves a partition group's Raft
configuration to a target, one membership change at a time. Each step is chosen from
the configuration as it is (level-triggered: a lost answer or a leader change is
repaired by the next look), and the phase names what that step is:

- ``NEW``: the target is adopted and no step taken yet (a target from pending is
  adopted only once a read of the key confirmed the cache, as the Ignite rebalance design's
  onLeaderElected reads the key);
- ``TRIMMING``: removing learners outside the target (a cancelled change's);
- ``ADDING``: adding a missing member as a PRE_FOLLOWER learner;
- ``CATCHING_UP``: learners catch up; the core promotes each one automatically;
- ``REMOVING``: every target member is a voter; once the removal fence is committed
  (``rebalance_steps.fence_removals``), departing voters are removed, the leader last;
- ``HANDING_OVER``: removing ourselves: leadership is being transferred (the next leader
  resumes the change in its own term, and this one ends with our term);
- ``APPLIED``: voters equal the target, no learner left, all committed:
  onNewPeersConfigurationApplied runs onRebalanceDone.

For one target and one term the steps only move forward, with the exceptions the core
can cause: a member whose storage was wiped is readmitted by the core as a learner, at
any point (a target member: back to ``CATCHING_UP``; a departing one, now a learner
outside the target: back to ``TRIMMING``), and a transfer that fails leaves us leading
(``HANDING_OVER`` back to ``REMOVING``). A new target in the same term (pending
rewritten, Approach 2's cancel, an API call) starts over from ``NEW``
(``Change.retarget``); an answer to a step taken before it may still arrive then
(``NEW`` to ``HANDING_OVER``). The catch-up timeout (``change_peers``, "Moving data at a
bounded rate") removes a silent target learner (``CATCHING_UP`` to ``TRIMMING``, a core-like
exception) and adds it again once its hold-off ends, possibly while another learner
catches up (``CATCHING_UP`` to ``ADDING``); no other step of ours and no act of the core
takes a target member out of the configuration within one term.
Any move the table does not list is a bug, raised as ``IllegalTransition``, which the
manager records as an internal error and the placement simulator as a violation.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from raftkv.core import RaftError
from raftkv.placement import rebalance_steps as steps
from raftkv.placement.assignments import PartitionKeys
from raftkv.placement.retry import Backoff

NO_SWITCH = steps.SwitchKeys(b"", b"")


class ChangePhase(Enum):
    # Values appear in status() output; names are what the docstring above uses.
    NEW = "new"
    TRIMMING = "trimming"
    ADDING = "adding"
    CATCHING_UP = "catching_up"
    REMOVING = "removing"
    HANDING_OVER = "handing_over"
    APPLIED = "applied"


_P = ChangePhase
# The core can make members learners again at any point (it readmits a member whose
# storage was wiped: a target member, or a departing voter, which is then trimmed).
_CORE = frozenset({_P.TRIMMING, _P.CATCHING_UP})
# phase -> the phases the next step may be in (for the same target and term).
CHANGE_TRANSITIONS: dict[ChangePhase, frozenset[ChangePhase]] = {
    _P.NEW: frozenset({_P.TRIMMING, _P.ADDING, _P.CATCHING_UP, _P.REMOVING, _P.HANDING_OVER,
                       _P.APPLIED}),
    _P.TRIMMING: _CORE | {_P.ADDING, _P.REMOVING, _P.APPLIED},
    _P.ADDING: _CORE | {_P.ADDING, _P.REMOVING, _P.APPLIED},
    _P.CATCHING_UP: _CORE | {_P.ADDING, _P.REMOVING, _P.APPLIED},
    _P.REMOVING: _CORE | {_P.REMOVING, _P.HANDING_OVER, _P.APPLIED},
    _P.HANDING_OVER: _CORE | {_P.HANDING_OVER, _P.REMOVING},
    _P.APPLIED: _CORE | {_P.APPLIED},
}


class StartPhase(Enum):
    # Values appear in status() output ("start"); the module docstring describes each.
    UNDECIDED = "undecided"
    NORMAL = "normal"
    LOST = "lost"
    LEAVING = "leaving"
    LEFT = "left"
    RECORDED = "recorded"

    @property
    def restarting(self) -> bool:
        """On the restart path: not started, waiting on the metastore's keys."""
        return self in _RESTARTING


_S = StartPhase
_RESTARTING = frozenset({_S.LOST, _S.LEAVING, _S.LEFT, _S.RECORDED})
# phase -> the phases it may move to.
START_TRANSITIONS: dict[StartPhase, frozenset[StartPhase]] = {
    _S.UNDECIDED: frozenset({_S.NORMAL, _S.LOST, _S.LEAVING}),
    # Bug C's in-memory case (``SafeRestart._declare_lost``, from these three as well):
    # not named by stable or pending, we hosted the partition before this start, and the
    # change under way may count on us.
    _S.NORMAL: frozenset({_S.LOST}),
    # Recorded in switch.reduce; or a full restart bootstraps, or we were re-added.
    _S.LOST: frozenset({_S.RECORDED, _S.NORMAL}),
    # Stable may name us before we have left pending (onRebalanceDone wrote it): then
    # we take a stable member's road.
    _S.LEAVING: frozenset({_S.LEFT, _S.RECORDED, _S.NORMAL, _S.LOST}),
    _S.LEFT: frozenset({_S.NORMAL, _S.LOST, _S.RECORDED}),
    _S.RECORDED: frozenset({_S.NORMAL}),
}


class IllegalTransition(RuntimeError):
    pass


class StaleTerm(RaftError):
    """``change_peers`` named a term this node does not lead in (Ignite's rebalance design: a
    changePeers
    from an old term is skipped). The leader of the current term carries on."""


class ChangeSuperseded(RaftError):
    """A newer ``change_peers`` replaced this one's target before it finished."""


class TableExists(ValueError):
    pass


class UnknownTable(KeyError):
    pass


class UnknownNode(KeyError):
    """A node the placement topology does not name."""


class TableDropped(RaftError):
    """The table was dropped while this operation on one of its partitions was under way."""


class Route(NamedTuple):
    group: str
    table: str
    partition: int
    nodes: tuple[str, ...]  # stable
    leader: str | None  # a hint: the leader this node last knew, if it hosts the group


@dataclass
class Change:
    """One changePeers on the leader: valid only in ``term``."""

    term: int
    target: frozenset[str]
    origin: str  # "pending" (the listener) or "api" (a direct change_peers call)
    started: float  # node clock
    waiters: list[Future[None]] = field(default_factory=list)
    inflight: str | None = None  # the membership change proposed and not yet answered
    phase: ChangePhase = ChangePhase.NEW
    handovers: int = 0  # transfers started to remove ourselves (each a LeaderStepping)
    # Catch-up timeout (change_peers, "Moving data at a bounded rate"): since when each
    # target learner has been silent in the group (now, while it answers or its match
    # grows), and the members the change dropped for it, with the time before which it
    # does not add them again.
    learner_since: dict[str, float] = field(default_factory=dict)
    learner_match: dict[str, int] = field(default_factory=dict)  # its match at the last look
    held_off: dict[str, float] = field(default_factory=dict)
    # Holds one of the leader's move slots: taken by its first learner added in this
    # term, given back once every target member is a voter, at a catch-up timeout, or
    # when the change ends (a learner a previous leader added holds none: its copy
    # was counted there).
    slot: bool = False
    # The removal fence (rebalance_steps.fence_removals): the pending revision it was
    # committed for, and whether its invoke is out. No voter is removed before it.
    fenced: int | None = None
    fencing: bool = False
    fence_refused: int | None = None  # a pending revision whose fence was refused

    def move(self, to: ChangePhase) -> None:
        """Enter ``to``; ``IllegalTransition`` unless ``CHANGE_TRANSITIONS`` allows it."""
        if to not in CHANGE_TRANSITIONS[self.phase]:
            raise IllegalTransition(f"changePeers(term {self.term}, {sorted(self.target)}): "
                                    f"{self.phase.name} -> {to.name}")
        self.phase = to

    def retarget(self, target: frozenset[str], origin: str) -> None:
        """A new target in the same term: the steps start over."""
        self.target, self.origin, self.phase = target, origin, ChangePhase.NEW
        self.fenced = None
        self.learner_since.clear()
        self.learner_match.clear()
        self.held_off.clear()


@dataclass
class PartitionState:
    table: str
    index: int
    group: str
    keys: PartitionKeys
    change: Change | None = None
    plan_done: int = 0  # the trigger source revision whose step (1) finished here
    plan_inflight: bool = False
    finishing: tuple[int, int] | None = None  # (term, pending rev) done was issued for
    cancel_key: tuple[int, int] | None = None  # (pending rev, planned rev) cancel issued for
    cleanup_rev: int = -1  # stable's mod revision when step (3) last looked
    backoffs: dict[str, Backoff] = field(default_factory=dict)
    # IGNITE-16668 (see raftkv.placement.safe_restart).
    sw: steps.SwitchKeys = NO_SWITCH
    preexisting: bool = False  # the table existed before this incarnation registered
    start: StartPhase = StartPhase.UNDECIDED
    start_inflight: bool = False  # our holds key is being written before the start
    reduce_inflight: bool = False  # the switch.reduce retry loop is running
    left_at: int = 0  # LEFT: the revision of our leave-pending invoke (wait for the cache)
    unblock_key: tuple[int, int] | None = None  # (pending rev, reduce rev) unblocked for
    wait_scheduled: bool = False
    switch_key: tuple[int, int] | None = None  # (reduce rev, stable rev) triggered for
    tidy_inflight: bool = False  # removing a stray learner (_drop_stray_learners)
    tidy_scheduled: bool = False  # its retry timer is set
    pending_read: tuple[int, int] = (0, -1)  # (term, pending rev) confirmed by a read
    pending_reading: bool = False  # that read is under way
    survive_inflight: bool = False  # the survivor check's linearizable read is under way
    survive_after: float = 0.0  # no survivor election before this (monotonic) time
    survive_refused: str = ""  # the core's last reason to refuse one (logged once)
    gen: int = 0  # the descriptor's create revision: which incarnation of the table

    def move(self, to: StartPhase) -> None:
        """Enter ``to``; ``IllegalTransition`` unless ``START_TRANSITIONS`` allows it."""
        if to not in START_TRANSITIONS[self.start]:
            raise IllegalTransition(f"{self.group} start: {self.start.name} -> {to.name}")
        self.start = to


