"""The pure Raft state machine.

Theory of operation
-------------------
``Raft`` is a deterministic function of its inputs. The driver feeds it ``tick()`` (an
abstract unit of time), ``step(message)`` and client requests (``propose``,
``propose_conf_change``, ``read_index``, ``transfer_leadership``). It never reads a
clock, draws from global randomness or touches I/O: the election-timeout jitter comes
from an injected RNG. Its outputs accumulate until the driver calls ``ready()``, which
returns one ``Ready`` batch (state to persist, messages to send, entries to apply); the
driver persists, sends, applies and then calls ``advance()``. Because the core is pure,
the simulator can replay any schedule exactly from its seed.

Roles form a closed enum. ``_become_*`` are the only way to change role and refuse
illegal moves (a leader never becomes a candidate without first stepping down).
``step`` first reconciles terms (§5.1), then dispatches on role.

What is implemented, and where the paper says so:

- Elections (§5.2) with randomized timeouts, pre-vote (dissertation §9.6) and leader
  stickiness: a node that heard from a live leader within the minimum election timeout
  ignores vote requests, which is what keeps a removed or partitioned node from
  disrupting the group (Kudu: pre-vote that checks "heard from a leader recently").
  Check-quorum: a leader that did not hear from a majority within an election timeout
  steps down.
- Replication (§5.3) with probe/replicate/snapshot progress, pipelining bounded by
  message count and bytes, the follower's conflict hint for fast back-off, and conflict
  handling that truncates only from the first entry whose term differs: a stale or
  duplicated AppendEntries never truncates matching entries.
- Commitment (§5.4.2): the leader commits only by counting replicas of an entry of its
  own term (Figure 8).
- ReadIndex (§6.4): reads wait until the leader has committed an entry of its term and
  a majority has acknowledged a heartbeat for the read.
- Leadership transfer (§3.10): the leader catches the target up, sends TimeoutNow,
  and refuses proposals until the transfer completes or an election timeout passes.
- Membership (dissertation ch. 4, Kudu design): one change at a time, configurations
  used from the moment they are appended and rolled back when their entry is truncated,
  PRE_FOLLOWER learners promoted automatically once within ``promote_lag`` entries of
  the leader, removal of the leader by transferring leadership first (the new leader
  performs the change it was handed in TimeoutNow).
- Snapshots: a follower that needs compacted entries is sent the storage's snapshot.
- Quiescence (CockroachDB's quiesced ranges): an idle group stops heartbeating and
  stops ticking, so a node hosting hundreds of idle groups does no per-group work. See
  "Quiescence" below.
- Campaigning at restart (``Config.early_campaign``): a voter that restarts campaigns
  on one of its first ticks, with pre-vote, instead of after an election timeout. See
  "Campaigning at restart" below.
- A removed node learns it was removed, and stops campaigning. See below.

A removed node learns it was removed
------------------------------------
A leader stops replicating to a node as soon as a configuration without it is appended
(§4.2.2), so a voter removed while it was down, or cut off, never receives that entry.
Restarted, it believes itself a voter: it campaigns for ever and knows no leader, and
the members, following a live leader, drop its pre-votes unread (stickiness). etcd
answers a removed member that it was removed, and the member stops. Here a node refuses
a vote request with ``_NOT_A_MEMBER`` (``_refuse_non_member``, before stickiness) when
neither its latest configuration nor the one it has applied includes the candidate,
and the candidate's log ends before that applied index. The refusal carries that index.
A candidate told so by a member, about an entry its log is behind, notes ``removed``
and is no longer promotable: it never campaigns again until a leader's message reaches
it (it was added back), which clears the note. The same notice goes out two more ways,
since a node removed while idle never campaigns (found from outside): the leader sends
it to each node whose removal it applies (``_tell_the_removed``), and answers it to a
read request (READ_INDEX) from a node outside both its latest and applied
configurations; the receiver applies the same test.

Why the notice is true: the applied configuration is committed, and committed entries
are in every later leader's log. The candidate's log is behind that entry (term T at
index a) as Raft compares logs: it ends before a with no later term, or its last term
is below T. Either way none of its entries past a can be committed (a committed entry
after a has a term of at least T), so it holds no committed configuration after a, and
can be a member again only through a later entry, which a leader would send it. (An old
leader cut off while appending proposals nobody acknowledged has a log longer than a but
of a lower term: comparing indexes alone left it unanswered, found in review.) Why it
cannot silence a member: a node added after what the member applied has a log that
reaches its addition, beyond that entry (the member answers as before), and a node takes
the notice only about an entry its log is behind.

Quiescence
----------
With ``Config.quiesce`` on, a leader whose group has nothing left to do goes quiet.
When its heartbeat is due, and when it would tell its followers a new commit index (see
"Quiescing on the last acknowledgement"), it checks (``_quiesce_blocker``, pure and
deterministic):

- it leads, with no transfer, handover, pending read or queued broadcast;
- everything is committed (commit == last index) and the commit is of its own term;
- no learner waits for automatic promotion (heartbeats are what retry it);
- a quorum of voters, itself included, is reachable, and every reachable follower has
  acknowledged the last index (``Progress.match``). Followers the driver reported
  unreachable (``peer_down``) are exempt, as CockroachDB exempts non-live nodes: the
  leader is woken when they come back (``peer_up``). A follower that came back counts
  only once it has answered since (``Progress.unheard``): while it was down, its
  process may have restarted without its state, and then its old acknowledgement
  vouches for nothing. (Found from outside: two of three replicas of an in-memory
  partition restarted empty; the leader, still counting their old match, went quiet
  again and led with no quorum behind it, for good. Kept awake, it is deposed by
  check-quorum, §6.2.)

If so it sends one last heartbeat carrying its last entry's (index, term) (a HEARTBEAT
with ``index > 0``; ordinary heartbeats carry 0) and stops ticking. A follower that
holds that entry and has not been told its leader is unreachable adopts the commit
index and stops ticking too, without an answer: the leader went quiet knowing that
follower's match, and an answer would tell it nothing. The exception is a heartbeat
whose commit index is below the named entry: the leader's match for that follower is
stale (it was exempt as unreachable and an answer was lost), so the follower answers,
and the leader wakes to send it the append that carries the rest. One that cannot
answers with ``reject=True``, which wakes the leader, and the leader tries again at a later
heartbeat.

A quiesced node wakes (``_unquiesce``) on: any local request (propose, read, transfer,
campaign, membership change); any message, except, for a leader, the plain
acknowledgements a quiet group still receives (accepting HEARTBEAT_RESP/APP_RESP of its
term) and, for a follower, its leader's quiesce heartbeat; any change of term or role;
and ``peer_down`` of its leader (follower) or of a member (leader). ``peer_up`` of a
member wakes a leader, so a returning follower is caught up. On waking, the election
timer restarts from zero, so a follower whose leader died campaigns one randomized
election timeout later, with pre-vote, exactly as if heartbeats had just stopped.

Why this is safe: quiescence changes only *when* ticks take effect and *when*
heartbeats are sent. Raft's safety never depends on timing; ReadIndex here is confirmed
by a heartbeat quorum round, never by a lease, so a quiet (possibly deposed) leader
cannot serve a stale read. The one new message content, the quiesce heartbeat, carries
min(match, commit) like every heartbeat (an exempt follower may hold other entries
below the commit index; the simulator caught the first draft sending the commit index
alone), and a follower goes quiet only if it holds the named last entry. Liveness rests on the driver reporting ``peer_down`` for an
unreachable leader, which the transport derives from its connection state and from
per-peer keepalive frames; the simulator models that report, wrong reports included.

Campaigning at restart
----------------------
A follower's first election timeout normally runs from its start, like any other. When
a whole group restarts (a power cut, a redeploy), nobody leads until the last node of
the first majority to come up has waited out a randomized timeout: half a second to a
second at the driver's defaults, most of what a user measures from the restart to the
first answered request. So a voter that starts from a log it has used before (its
term is past the bootstrap term: its group has held an election) and has ``early_campaign`` set draws its first timeout from the first
``max(1, election_tick // 3)`` ticks, and campaigns then.

Why this disrupts no one: the campaign is a pre-election (§9.6), and ``early_campaign``
does nothing without pre-vote and check-quorum (which gives stickiness). A pre-election changes no term anywhere. A node that
heard from a live leader within the minimum election timeout refuses it (stickiness),
and so does the leader itself, so while a leader is healthy the early pre-election
fails, the restarted node keeps its term and waits for the leader's heartbeat, which
makes it a follower. (A quiet follower keeps no time, so it goes on refusing: its
leader is as healthy as when it went quiet, or the transport reports it down.) If
the pre-election fails for any other reason (the peers are not up yet, or a campaign
went out before the connections did and reached no one), the node would wait a full
randomized timeout. Instead, until it first knows a leader or its term moves, a
restarted voter campaigns again whenever the driver reports a voter reachable
(``peer_up``, which the driver calls as soon as a connection's handshake completes):
that voter has just come up, or come back, and may be the vote it lacked. When the
whole group restarted, no node knows a leader, so the first node to campaign once a
majority is up wins at once: as soon as the second node of that majority connects.
A grant of a vote or pre-vote, or a new term, ends the rule too: a node that backed
another candidate must leave that election its time. Campaigning again when a third
node connected, before the candidate's votes or its first append arrived, split the
vote or deposed the new leader (found from outside: 1 whole restart in 30 waited out
a full election timeout, each way). Nodes
that restart together may pre-campaign on the same tick; each pre-election would
succeed and the elections could split the vote, so a pre-candidate that grants a
pre-vote for its own pre-election's term to a lower id steps back to follower. Any
campaign under way (a candidate's, or a pre-candidate's outside the rule) sends its
request again to a voter reported reachable that has not answered it: two nodes that
dialed each other keep one connection, and a request that went out on the other is
lost with it; the candidate would otherwise wait out a full timeout (0.5 to 1 s at the
driver's defaults). A repeated (pre-)vote request changes nothing at the voter.

Commit notices
--------------
When the commit index moves, the leader tells every follower at once, as etcd does
(unless the group quiesces instead, see "Quiescing on the last acknowledgement")
(``_on_commit``, then ``_flush``): a follower applies, and serves follower reads, only
up to the commit index it knows. Usually that follower already holds everything and
the message carries no entries. As an APP it would cost an APP_RESP that tells the
leader nothing it does not know (the follower's match index is already counted), and
with one entry per group per turn, as a node hosting hundreds of partitions sees, those
answers were a quarter of all Raft traffic. So an empty append to a follower in
REPLICATE state goes as a COMMIT: the same fields and the same checks on receipt (the
previous entry must match, §5.3, and only up to it may the follower commit), but
answered only when rejected, which starts the usual probing. Nothing else depends on
the answer: liveness and check-quorum hear from heartbeats, a lost entry-carrying
append is found by the rejection or by the next heartbeat's answer (``pr.match`` below
the last index sends an ordinary append), and probes (PROBE state) and every other
empty append stay APPs, answered as before.

Quiescing on the last acknowledgement
-------------------------------------
Under load spread over many groups, each group sees a write now and then: a commit
notice, then at the next heartbeat the quiesce heartbeat and its answers. That was
five messages per write beyond the appends and their answers, a third of all Raft
traffic with 256 partitions. So the quiesce check also runs where the notice would be
sent (``_flush``): if the group may go quiet, the quiesce heartbeat goes instead of the
notice (it carries the commit index, bounded by each follower's match, and needs no
answer). If the only thing in the way is followers whose answer for the last index is
on its way (REPLICATE, ``pr.next`` beyond it, reachable), the notice is held
(``_notice_held``) and each such answer re-runs the check: the last one quiesces the
group, and the followers learn the commit index from its heartbeat, a moment later than
from a notice. If an answer is lost, the leader is still awake: its next heartbeat
carries the commit index to the followers that answered (min(match, commit)), and the
one whose answer was lost answers that heartbeat, which brings it an append with the
commit. A lost quiesce heartbeat is now the only carrier of the commit index for its
follower, which then learns it when it wakes (an election timeout and a pre-vote, which
wakes the leader too), as a follower that missed its quiesce heartbeat always did.
Anything else in the way (a follower being probed, a new entry, a read) sends the
notices as before. Only when followers learn the commit changes, never
what they may commit; the leader's own commit and apply, and so its clients' answers,
do not wait.

Incarnations
------------
Raft's safety rests on a voter's durable state: a vote (§5.2) and an acknowledgement
(§5.3) are promises about what the voter holds, and §5.4's overlap argument needs every
voter to keep them. A node whose files were wiped (a replaced disk, a deleted
directory, an in-memory replica that restarted) and that starts again with its old
arguments keeps its name and loses its promises: it has forgotten its log, its vote and
its term. Counted as the voter it was, it lets an entry committed with its help be lost
(it votes for a candidate that lacks the entry) and lets a deposed leader commit a
second entry at an index the new leader already committed (it accepts the old term).

So every replica's storage has an *incarnation*, a random number made with its files
(``Config.incarnation``; 0 turns all of this off, as the pure-Raft scenario tests do),
and each group's configuration records which incarnation of each member it counts on
(``ConfState.incarnations``, replicated in configuration entries, so every member agrees).
Every message carries its sender's incarnation (``Message.inc``). The rules:

- **Recording.** A new leader's no-op is a configuration entry (``RECORD``) when the
  configuration does not yet record, as they are, itself and the voters that granted
  its campaign. A leader that hears from a member the configuration does not record
  proposes a ``RECORD`` of it (``_settle_identities``), one change at a time. A learner is
  promoted (automatically or on request) only once its record is committed, so a voter
  is always counted as a recorded incarnation (simulator seed 132: a learner promoted
  by hand before it was recorded could not be recorded later without its own
  acknowledgement).
- **Acknowledgements** (``_recognise``, ``_counted_matches``). A leader ignores the answers of
  a voter whose message names another incarnation than its record: they count toward
  no commit, no ReadIndex quorum, no check-quorum. What it knew of the member (its
  match) is void the moment a new incarnation answers. Such a voter gets a ``READMIT``:
  demoted to an automatically promoted learner recorded as its new incarnation, a
  one-by-one demotion, so as safe as any (ch. 4). It catches up as a learner and is
  promoted. Where a recorded voter's acknowledgement counts (``_counted_matches``): a
  voter recorded by a leader's election entry (it granted that campaign) or by a
  group's first records counts toward a commit index at or beyond that entry, so every
  quorum that used it holds its record; one recorded on contact (RECORD, READMIT)
  counts once that record is committed, or a deposed leader that never knew an
  earlier incarnation could record a wiped node and commit with it.
- **Commit by heartbeat.** A heartbeat's commit is bounded by the leader's match for
  the follower; the heartbeat names the incarnation that match describes (``to_inc``),
  and a follower that is another incarnation commits nothing from it.
- **Votes** (``_identity_allows_vote``). A vote request names the incarnation the
  candidate records for the voter (``to_inc``) and whether that record is committed in
  its log (``to_inc_ok``). A node refuses when it is not that incarnation (the
  candidate counts on state it lost) and refuses a candidate that is not the
  incarnation it records. A node whose storage was created empty (``Config.newborn``)
  and that its configuration does not record cannot tell a group's birth from its own
  loss of state: it votes only when it can prove that no earlier incarnation of it
  ever counted (``_newborn_may_vote`` gives the two proofs and why they hold). A
  candidate at the group's birth is no such proof: a laggard that never received
  anything looks the same, and two such laggards with a wiped voter are three of five
  (simulator seed 92). So a new group is born once enough founders have seen each
  other: a newborn founder announces itself with a pre-vote at its first tick, and
  again when a voter becomes reachable while the group is not born (``peer_up``).

What this does not cover, and why: a voter that was never recorded (logs written
before incarnations, which the first leader records) is counted as before. A group of
three is born only once all three founders have run (each must see that the other two
hold no record of it); five need four. If the first leader dies before its records
commit, a voter it recorded but that never received them may wait for that leader.
Likewise a voter recorded on contact counts once its record commits: if the voters
that could commit it are gone (the first leader was elected without that voter, and
the voter that elected it stopped), the ones left commit nothing until one returns,
for from where they stand that is also the schedule in which a stale leader records a
wiped node (tests/test_core_incarnations.py). A deposed leader whose configuration
predates a member's record can record the member's new incarnation; a wiped node that
takes that uncommitted record for its own then votes, for itself or for that leader,
as a recorded node, and may so vote twice in a term it voted in before the wipe (two
leaders of one term, found in review; an xfail scenario in
tests/test_core_incarnations.py). Requiring a committed record for a newborn node's
own vote and its grants closes it, but slowed the birth of groups under load enough
to fail placement tests, and is not done yet. A leader's match for a follower that was
wiped while down counts until the new incarnation first answers, which matters only
for an entry not yet committed when the follower went down. Two or more wiped voters
of one configuration are beyond any majority protocol, as two lost disks are (a wiped
voter stays lost to the group until its new record commits: simulator seed 2750, where
a second voter was wiped while the first one's record was uncommitted); so is a
removed founder started again on empty files with its founding arguments: it
bootstraps the founding configuration, and a majority of such founders would form a
group of their own.

The lone survivor of two voters
-------------------------------
A group whose configuration has two voters {a, b} needs both for every election and
every commit. If b loses its state (an in-memory replica that restarted), the
Incarnations rules rightly refuse to count it as the voter it was, and nothing else can
make progress: a cannot win an election, so no leader can READMIT b. Yet a holds
everything the pair committed. ``campaign_without(b)`` lets a continue alone. It is a
*survivor election*: a becomes a candidate of the next term and wins when every member
of its *electorate* G grants its vote. The members are asked with ordinary vote
requests (after a pre-vote round, with pre-vote on) and answer under the ordinary rules
(term, one vote per term, §5.4.1's up-to-date check, stickiness, identities). a's first
entry as leader is a configuration entry removing b, so its quorum is itself from then
on; the placement layer adds b back as a fresh learner.

Let W be the configurations in a's log from the one in effect at its commit index to
its latest. The rule applies when the latest has the voters {a, b} and every
configuration of W has the voters {a}, {a, b} or {a, b, z}, or is {b} followed in W by
the promotion of a to {a, b} (a change under way when b was lost may have come from
three voters, from a alone, or from b alone). G is a, the voter z of each three-voter
configuration of W, and each learner y of a two-voter one that is recorded (any
learner with identities off). The caller asserts two things the core cannot see: (A)
b's state is lost: the incarnation the group counts on will never vote or acknowledge
again; (B) no configuration that removes or demotes a was appended, beyond a's log, as
one change from a configuration of W (only {a, b} to {b} matters: the quorum of any
other such removal contains a member of G). A removal of a further down, after some
other change beyond a's log, needs no assertion: that change committed with a member of
G (part 1), which then refuses a (part 3). ``voters_since_commit`` helps a caller that
removes a voter only once every member of its target is a voter: the target of a
removal made from a configuration of W names only that configuration's voters. The
placement layer derives both from the metastore
(``raftkv/placement/safe_restart.py``, "The lone holder of a two-voter
configuration"). The simulator's opt-in ``survive``
fault runs the rule under every other fault, and its checker recounts each survivor's
grants from this text.

Why it is safe.

1. *The configurations in effect anywhere.* The configuration at a's commit index is
   committed, so every later leader's log holds it (§5.4). Any other configuration is
   in W or is a *successor* that a lacks: one change from a configuration of W (one
   at a time, and only after its predecessor committed). A successor matters only if
   it or something under it committed, and it takes effect when appended, so it
   commits with a quorum of its own. Removing or demoting a (a direct successor) is
   excluded by B. What is left: from {a}, a learner promoted to {a, y}; from {a, b},
   {a} or {a, b, y}; from {a, b, z}, {a, b}, {a, z} or {a, b, z, y}. A {b} of W has no successor but the
   promotion of a that follows it: b, its only voter, is its only possible leader,
   and b appended that promotion (a holds it), so b's log never held anything else
   after it. A learner is promoted only once recorded (``_maybe_promote``; the
   placement layer never promotes by hand), and recording it is a change committed
   under {a, b} with a's acknowledgement, so the y of {a, b, y} is recorded in W: it
   is in G.
2. *Every quorum of those configurations meets G*: {a} and {a, y} contain a; the
   quorums of {a, b} and {a, b, y} contain a or y; those of {a, b, z}, {a, z} and
   {a, b, z, y} (three of four) contain a or z. The exception is {b}, whose quorum is
   b alone.
3. *Leader completeness* (§5.4). An entry committed before a's term was acknowledged
   by a quorum of one of them. If it is {b}, the entry is in b's log before b's
   promotion of a, which a holds, so a holds the entry (log matching). Otherwise a
   member g of G acknowledged it. g held it when it granted a's vote (no leader lacking
   a committed entry ever truncated one), and g grants only if a's log is at least as
   up to date as its own, so a holds it (§5.4.3's argument). One exception keeps a
   learner with a few entries a lacks (sent before b was lost, never committed) from
   blocking a for ever: the request carries a's commit index c, and a node may grant
   it although its log is more up to date if it was a voter in no configuration of its
   log from index c on (``_attests_for_survivor``). Then it acknowledged nothing after c
   as a voter: a leader counts an acknowledgement of index i under the latest
   configuration before i in its log, which is the acknowledger's log up to i. And a
   holds every committed entry up to c.
4. *Election safety* (§5.2). Another leader of a's term needs a quorum of one of those
   configurations, which contains a member of G (or is {b}), and each voted for a in
   that term. A lost b never votes again as the voter it was (A, and the Incarnations
   vote rules for its new incarnation), and b runs no survivor election of its own:
   the placement layer calls this only on a node that holds its state while b declared
   the loss of its own.
5. *The removal.* a appends "remove b" as its first entry, perhaps after a
   configuration entry of W that is not committed yet, which "one change at a time"
   forbids. That rule keeps the quorums of any two configurations in use overlapping,
   so that no other leader can commit in a configuration that lacks the new entry.
   Without b, which never votes or acknowledges again, the quorums those
   configurations can still form are {a}, {a, y}, {a, z} and {a, z, y}: all contain a,
   which refuses any candidate lacking its entries. So a's new quorum {a} commits the
   removal and every earlier entry of its log (§5.4.2 allows it once an entry of the
   leader's own term commits). The shapes are limited for this reason: from {a, z, w}
   or four voters with b, a quorum without a could still form.

If a also lost its state it is not a survivor: it holds nothing, and the placement layer
does not call this (both lost is a full-partition restart). A member of G that is down
or lost its own state (it then refuses, as an incarnation the candidate does not
record) makes a wait: it may hold the only copy of what b committed with it. So does a
learner whose storage was created empty and whose record a does not know committed
(it was recorded just before b was lost): the Incarnations vote rule for newborn nodes
has it refuse. The simulator's ``survive`` fault does not lose b in that shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from raftkv.core.errors import (
    CampaignRejected,
    ConfChangeRejected,
    LeaderStepping,
    NotLeader,
    ProposalDropped,
    TransferRejected,
)
from raftkv.core.log import RaftLog
from raftkv.core.membership import (
    ConfChange,
    ConfChangeOp,
    apply_change,
    decode_change,
    decode_conf_entry,
    encode_change,
    encode_conf_entry,
)
from raftkv.core.progress import Inflights, Progress, ProgressState
from raftkv.core.quorum import committed_index, has_quorum, majority, vote_result
from raftkv.core.read_only import ReadOnly
from raftkv.core.types import (
    Message,
    MessageType,
    PeerStatus,
    ReadState,
    Ready,
    Role,
    SoftState,
    Status,
)
from raftkv.storage.errors import Compacted, SnapshotUnavailable, Unavailable
from raftkv.storage.log_store import LogStorage
from raftkv.storage.records import (
    ENTRY_OVERHEAD,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Snapshot,
    VoteFloor,
    payload_bytes,
)

MT = MessageType
_CAMPAIGN_TRANSFER = "transfer"
# A vote refusal's context: the candidate is not a member of the configuration this node
# applied (its ``index``); see "A removed node learns it was removed".
_NOT_A_MEMBER = "not a member"
# Every founding member writes the bootstrap configuration in this term; an election
# starts the next one. A log whose last term is this has never held a leader's entry.
BOOTSTRAP_TERM = 1


class RNG(Protocol):
    def randrange(self, n: int) -> int: ...


class CampaignKind(Enum):
    PRE_ELECTION = "pre-election"
    ELECTION = "election"
    TRANSFER = "transfer"


@dataclass
class Config:
    id: str
    # Ticks without hearing from a leader before a follower campaigns. The actual
    # timeout is drawn uniformly from [election_tick, 2 * election_tick).
    election_tick: int = 10
    heartbeat_tick: int = 1
    max_msg_bytes: int = 1 << 20
    max_inflight_msgs: int = 256
    max_inflight_bytes: int = 32 << 20
    max_apply_bytes: int = 64 << 20
    pre_vote: bool = True
    check_quorum: bool = True
    # A learner within this many entries of the leader's last index is promoted: at the
    # replication rates we measure, that is far less than one election timeout of work,
    # so the new voter cannot stall commits while it finishes catching up (§4.2.1).
    promote_lag: int = 1000
    # Ticks to wait for a snapshot to be acknowledged before probing again.
    snapshot_timeout: int = 0  # 0 means election_tick
    # The state machine's durable applied index (its checkpointIndex): entries up to it
    # are not redelivered on restart.
    applied: int = 0
    # Let idle groups go quiet (see "Quiescence" in the module docstring). The driver
    # and the simulator turn it on; the driver must then report peer liveness.
    quiesce: bool = False
    # Set by storage when it truncated a damaged tail at open (see VoteFloor): until
    # the floor clears, this node neither votes nor campaigns, since either could elect
    # a leader lacking an entry this node acknowledged and the cluster committed.
    vote_floor: VoteFloor | None = None
    # The identity of this replica's storage (see "Incarnations"): a random positive
    # number created with its files, or 0 to turn identity checks off (the pure-Raft
    # scenario tests do). ``newborn``: those files were created empty, so this replica
    # cannot tell a group's birth from its own loss of state.
    incarnation: int = 0
    newborn: bool = False
    # A leader that must remove or demote itself hands leadership over with the change
    # in TimeoutNow, and the transferee proposes it once it has committed an entry of
    # its term (``propose_conf_change``, ``_on_commit``). An owner that drives its
    # membership towards a target of its own (the placement layer: a partition's
    # pending assignment) turns this off: by then the target may keep the old leader,
    # and its own next step computes the removal from the target it holds then.
    auto_handover: bool = True
    # Campaign (a pre-election) within the first ticks after a restart rather than
    # after an election timeout (see "Campaigning at restart"). Needs pre_vote and
    # check_quorum.
    early_campaign: bool = False


def bootstrap(storage: LogStorage, voters: Iterable[str]) -> None:
    """Write the initial configuration as entry 1 (term 1, committed) on a fresh store.

    Every founding member writes the identical entry, so their logs agree from the start
    and no election is needed to agree on membership. Joining nodes start empty instead.
    """
    if storage.last_index() != 0:
        return
    conf = ConfState(voters=frozenset(voters))
    entry = Entry(BOOTSTRAP_TERM, 1, EntryType.CONF_CHANGE, encode_conf_entry(None, conf))
    storage.save(HardState(term=BOOTSTRAP_TERM, vote=None, commit=1), [entry])


def _decode_confs(ents: list[Entry]) -> list[tuple[int, ConfState]]:
    """The configurations carried by ``ents``; ValueError if one is malformed or an
    entry has a type this version does not know (it would be misread on restart)."""
    # The truthiness test keeps the common case (all NORMAL) cheap.
    out = []
    for e in ents:
        if e.type:
            if e.type != EntryType.CONF_CHANGE:
                raise ValueError(f"entry {e.index} has unknown type {e.type!r}")
            out.append((e.index, decode_conf_entry(e.data)[1]))
    return out


class Raft:
    def __init__(self, config: Config, storage: LogStorage, rng: RNG) -> None:
        self.id = config.id
        self.cfg = config
        self.rng = rng
        self.log = RaftLog(storage)
        hard, base_conf = storage.initial_state()
        if config.applied:
            self.log.applied = max(self.log.applied, min(config.applied, self.log.committed))
        # Configuration history: (index, conf) for every config entry not yet applied,
        # plus the one in effect at the applied index. Truncation pops from the end.
        # The base configuration is the snapshot's, in effect at the snapshot's index;
        # compaction may keep a few entries below it, whose configs it already includes.
        try:
            base = storage.snapshot().index
        except SnapshotUnavailable:
            base = 0
        base = max(base, self.log.first_index() - 1)
        self.confs: list[tuple[int, ConfState]] = [(base, base_conf)]
        for e in storage.conf_entries(base + 1):
            self.confs.append((e.index, decode_conf_entry(e.data)[1]))
        self._vote_floor = config.vote_floor
        self._inc = config.incarnation
        self._incs: dict[str, int] = {}
        # Leader: members heard from under an incarnation the configuration does not
        # record; each gets a RECORD or READMIT (``_settle_identities``).
        self._unrecorded: dict[str, int] = {}
        # Candidate: the incarnations of the voters that granted this campaign (its
        # pre-vote or vote), for the no-op to record.
        self._grants: dict[str, int] = {}
        # (the member that told us, the index it had applied) once a member has told us
        # that its applied configuration, beyond our whole log, does not include us.
        self.removed: tuple[str, int] | None = None
        # (Pre-)candidate: its vote requests' type, term and context (``_request_vote``).
        self._vote_request: tuple[MT, int, Any] = (MT.PRE_VOTE, 0, None)
        # Newborn and unrecorded (see "Incarnations"): the voters whose vote requests,
        # since this start, showed no record of this node (or a committed record of it
        # as it is), and whether one showed another incarnation of it.
        self._unaware: set[str] = set()
        self._known_gone = False
        # Survivor election (``campaign_without``): the lost voter, and every member
        # whose grant it needs (itself and the learners that may have been promoted).
        self._survivor: str | None = None
        self._electorate: frozenset[str] = frozenset()
        # (member, incarnation) pairs the configuration once recorded and a later one in
        # the log replaced: a late or duplicated message from one is from a node that no
        # longer exists. (A rollback replaces no one: ``_truncate_confs``.)
        self._retired: set[tuple[str, int]] = set()
        # Members heard from as one of those retired incarnations, with the incarnation.
        self.retired_heard: dict[str, int] = {}
        self.conf: ConfState = self.confs[-1][1]
        self._incs = dict(self.conf.incarnations)
        newborn_founder = self._unborn_founder()
        self._trim_confs()  # applied may start past some of them (Config.applied)

        self.term = hard.term
        self.vote: str | None = hard.vote
        self.role = Role.FOLLOWER
        self.lead: str | None = None
        self.prs: dict[str, Progress] = {}
        self.votes: dict[str, bool] = {}
        self.msgs: list[Message] = []
        self.read_states: list[ReadState] = []
        self.read_only = ReadOnly()
        # Reads received before this leader committed an entry of its term.
        self.pending_reads: list[tuple[str, Any]] = []
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = 0
        self.lead_transferee: str | None = None
        # Transfers this leader started that ran out of time, by transferee: the next
        # handover prefers another voter (see _most_up_to_date_voter).
        self._transfer_timeouts: dict[str, int] = {}
        # The change this leader is handing over with the transfer (removing itself).
        self.transfer_change: ConfChange | None = None
        # (change, term): the change we were handed by TimeoutNow, valid if we win `term`.
        self.handover: tuple[ConfChange, int] | None = None
        self.pending_handover: ConfChange | None = None
        self._bcast_pending = False
        # Quiescence: not ticking; and the peers the driver reported unreachable.
        self.quiesced = False
        # A commit notice held back for the acknowledgements in flight ("Quiescing on
        # the last acknowledgement").
        self._notice_held = False
        self._unreachable: set[str] = set()
        # Restarted with early_campaign, and since then no leader known, no vote or
        # pre-vote granted and no term changed: a voter coming up brings the next
        # campaign forward ("Campaigning at restart").
        self._restarting = False
        self._prev_soft = SoftState(None, Role.FOLLOWER)
        self._prev_hard = hard
        self._snapshot_timeout = config.snapshot_timeout or config.election_tick
        self._become_follower(self.term, None)
        if newborn_founder:
            # Announce ourselves at the first tick: a pre-vote shows the other voters that
            # we hold no record of them, which a newborn voter needs to see from enough
            # of them before it grants a vote (``_identity_allows_vote``). Pre-vote changes
            # no term, so this disturbs nothing.
            self.election_elapsed = self.randomized_election_timeout - 1
        elif (config.early_campaign and config.pre_vote and config.check_quorum
                and self.term > BOOTSTRAP_TERM and self.id in self.conf.voters):
            early = 1 + self.rng.randrange(max(1, config.election_tick // 3))
            self.election_elapsed = self.randomized_election_timeout - early
            self._restarting = True

    # ================================================================ public API ======
    def tick(self) -> None:
        if self.quiesced:
            return  # a quiet group keeps no time: that is the whole point
        if self._restarting and self.lead is not None:
            self._restarting = False  # it has found a leader: the restart is over
        if self.role == Role.LEADER:
            self._tick_heartbeat()
        else:
            self._tick_election()

    def campaign(self) -> None:
        """Start an election now (tests, demos, operator tooling)."""
        self._unquiesce()
        self._campaign(CampaignKind.PRE_ELECTION if self.cfg.pre_vote else CampaignKind.ELECTION)

    def learn_commit(self, index: int, term: int) -> bool:
        """Adopt ``index`` as committed if this log holds the entry (``index``, ``term``)
        in stable storage: the caller knows from elsewhere that that entry committed (the
        placement layer records the configuration entry each change ended with, after its
        leader saw it commit). By Log Matching (§5.3) this log then equals the leader's
        up to ``index``, all of it committed: what a leader's commit index in an
        AppendEntries tells a follower, and the notice a follower misses when its
        leader's last heartbeat is lost or the leader crashes right after committing.
        Whether the commit index moved."""
        log = self.log
        if (index <= log.committed or index >= log.unstable_offset
                or log.term_or_zero(index) != term):
            return False
        return log.commit_to(index)

    def campaign_without(self, lost: str) -> None:
        """A survivor election: win without ``lost``'s vote (see "The lone survivor of two
        voters"). The caller asserts that ``lost`` lost its state and that no
        configuration removing or demoting this node exists beyond this log. Raises
        ``CampaignRejected`` unless the latest configuration's voters are {this node,
        ``lost``} and the ones since the commit index are among the shapes the rule
        covers. Otherwise this node becomes a candidate of the next term and asks its
        electorate (the third voter of those that had three, and each learner that may
        have been promoted) for its vote, under the ordinary rules; with every one
        granted it leads, and its first entry removes ``lost``."""
        self._unquiesce()
        why = self._survivor_blocker(lost)
        if why is not None:
            raise CampaignRejected(why)
        self._survivor_campaign(lost, self._survivor_electorate(lost), self.cfg.pre_vote)

    def _survivor_campaign(self, lost: str, electorate: frozenset[str], pre: bool) -> None:
        """A survivor election's pre-vote round (with pre-vote on) or its election. The
        pre-vote round matters: a member of the electorate that refuses may be the one
        to lead (a learner promoted beyond this log), and a survivor retrying real
        elections would keep raising the term under its campaigns."""
        if pre:
            self._become_pre_candidate()
            vote_type, term = MT.PRE_VOTE, self.term + 1
        else:
            self._become_candidate()
            vote_type, term = MT.VOTE, self.term
        self._survivor, self._electorate = lost, electorate
        # A full election timeout for the answers: our own election timer (an ordinary
        # campaign) would otherwise end the round, and a caller retrying at a steady
        # pace can lock into phase with it (the simulator found that).
        self.election_elapsed = 0
        if self._poll(self.id, True) is True:
            self._survivor_won()
            return
        last, last_term = self.log.last_index(), self.log.last_term()
        for nid in sorted(electorate - {self.id}):
            # ``context``: our commit index, for a learner's attestation (part 3).
            self._send(Message(vote_type, nid, self.id, term, last_term, last,
                               context=self.log.committed))

    def _survivor_won(self) -> None:
        assert self._survivor is not None
        if self.role == Role.PRE_CANDIDATE:
            self._survivor_campaign(self._survivor, self._electorate, pre=False)
        else:
            self._become_leader()

    def propose(self, data: bytes) -> int:
        """Append ``data`` as a new entry; returns its index (its proposedIndex)."""
        return self.propose_batch((data,))

    def propose_batch(self, datas: Iterable[bytes]) -> int:
        """Append several entries at once; returns the index of the last one."""
        self._check_can_propose()
        self._unquiesce()
        term = self.term
        idx = self.log.last_index()
        new = tuple.__new__
        ents = []
        for d in datas:
            idx += 1
            ents.append(new(Entry, (term, idx, 0, d)))
        self._leader_append(ents)
        return idx

    def propose_conf_change(self, cc: ConfChange) -> int:
        """Propose one membership change; returns the index of its entry.

        Raises ``ConfChangeRejected`` when one-by-one rules forbid it now, and
        ``LeaderStepping`` when it removes or demotes the leader itself, after starting
        the handover to the most up-to-date voter (which then performs the change).
        """
        self._check_can_propose()
        self._unquiesce()
        why = self._conf_change_blocker()
        if why:
            raise ConfChangeRejected(why)
        if (cc.op == ConfChangeOp.PROMOTE and self._inc and cc.node in self.conf.learners
                and not self._countable(cc.node)):
            # A voter is counted only as a recorded incarnation, and one whose record
            # is not committed would need its own acknowledgement to commit it.
            raise ConfChangeRejected(
                f"{cc.node} is not yet recorded (the leader has not heard from it, or its "
                "record is not committed); retry once it has caught up")
        new_conf = apply_change(self.conf, cc)
        if cc.node == self.id and cc.op in (ConfChangeOp.REMOVE, ConfChangeOp.DEMOTE):
            target = self._most_up_to_date_voter()
            if target is None:
                raise ConfChangeRejected(f"no other voter can take over from {self.id}")
            self._start_transfer(target, cc)
            raise LeaderStepping(
                f"{cc.describe()} affects the leader: transferring leadership to {target}, "
                "which will perform the change", target,
            )
        index = self.log.last_index() + 1
        entry = Entry(self.term, index, EntryType.CONF_CHANGE, encode_conf_entry(cc, new_conf))
        self._leader_append([entry], new_conf)
        return index

    def read_index(self, context: Any) -> None:
        """Request a linearizable read point; a ``ReadState`` with ``context`` follows."""
        self._unquiesce()  # a follower's request wakes its leader on arrival
        if self.role == Role.LEADER:
            self._leader_read(self.id, context)
        elif self.lead is not None:
            self._send(Message(MT.READ_INDEX, self.lead, self.id, self.term, context=context))
        else:
            raise NotLeader(self.id, None)

    def transfer_leadership(self, to: str) -> None:
        self._unquiesce()
        if self.role == Role.LEADER:
            self._start_transfer(to, None)
        elif self.lead is not None:
            # The leader refuses a non-voter without a word to us (§3.10 has the request
            # forwarded, not answered), so the caller waited out its timeout (found from
            # outside): refuse a node that is no member at all of the configuration this
            # follower knows. A learner is forwarded: the leader may have promoted it in
            # an entry this follower has not received yet (found in review).
            if to not in self.conf.members():
                raise TransferRejected(f"{to} is not a member of the group")
            self._send(Message(MT.TRANSFER_LEADER, self.lead, self.id, self.term, context=to))
        else:
            raise NotLeader(self.id, None)

    def peer_down(self, peer: str) -> None:
        """The driver's liveness report: ``peer`` is unreachable (its connection dropped
        or went silent). A quiet follower whose leader it is wakes, so that it campaigns
        after an election timeout; a quiet leader that counts it as a member wakes, so
        check-quorum and the quiesce rule see the loss."""
        if peer == self.id or peer in self._unreachable:
            return
        self._unreachable.add(peer)
        pr = self.prs.get(peer) if self.role == Role.LEADER else None
        if pr is not None:
            pr.unheard = True
        if self.quiesced and (peer == self.lead or peer in self.prs):
            self._unquiesce()

    def peer_up(self, peer: str) -> None:
        """``peer`` is reachable again, or on a new connection. A quiet leader wakes so
        its heartbeats bring the returning follower up to date (it was exempt while
        unreachable). (A heartbeat sent at once on every report was tried, and made a
        placement heal test stall: a third founder heard of before its election record
        committed was left recorded on contact only.) A newborn
        founder of a group not yet born announces itself again at its next tick: its
        first-tick announcement went out before any connection was up, and a founder
        that died before its first timed campaign would otherwise never have been
        heard, leaving the other two unable to elect anyone (found from outside). A
        restarted voter that has not found a leader yet campaigns at once ("Campaigning
        at restart"), also on a report for a peer not reported down: the driver reports
        a connection that replaced another (two nodes that dialed each other keep one
        connection, and what went out on the other may be lost with it)."""
        was_down = peer in self._unreachable
        self._unreachable.discard(peer)
        if was_down and self.quiesced and self.role == Role.LEADER and peer in self.prs:
            self._unquiesce()
        if (peer in self.conf.voters and peer not in self.votes and self._survivor is None
                and self.role in (Role.PRE_CANDIDATE, Role.CANDIDATE) and not self._restarting):
            # A campaign under way asks again whoever has not answered: its request may
            # have been lost on the connection the new one replaced, and without this it
            # would wait out an election timeout. A (pre-)vote request is idempotent.
            self._request_vote(peer)
            return
        if not (peer in self.conf.voters and self.lead is None
                and self.role in (Role.FOLLOWER, Role.PRE_CANDIDATE)):
            return
        if self._restarting:
            self.campaign()
        elif was_down and self._unborn_founder():
            self.election_elapsed = max(self.election_elapsed,
                                        self.randomized_election_timeout - 1)

    def _unborn_founder(self) -> bool:
        """A newborn voter the configuration does not record: a founder whose group has
        not been born, or a wiped voter (whose announcements cost nothing either)."""
        return bool(self._inc and self.cfg.newborn and self.id in self.conf.voters
                    and self._incs.get(self.id) != self._inc)

    def step(self, m: Message) -> None:
        if self.quiesced and not self._keeps_quiet(m):
            self._unquiesce()
        if not (self.quiesced and self.role == Role.LEADER):
            self._step(m)
            return
        # A quiet leader answering with anything (say, appends for a follower that came
        # back before its peer_up) is active again: its followers wake on receipt, and a
        # leader still asleep would leave them to time out and campaign.
        sent = len(self.msgs)
        self._step(m)
        if len(self.msgs) > sent or self._bcast_pending:
            self._unquiesce()

    def _step(self, m: Message) -> None:
        t = m.type
        if t == MT.VOTE or t == MT.PRE_VOTE:
            if self._refuse_non_member(m):
                return
            if self._inc and self.cfg.newborn:
                self._note_report(m)
        elif (t == MT.VOTE_RESP or t == MT.PRE_VOTE_RESP) and m.context == _NOT_A_MEMBER:
            self._note_removed(m)
        elif self.removed is not None and t in (MT.APP, MT.COMMIT, MT.HEARTBEAT, MT.SNAPSHOT) \
                and m.term >= self.term:
            self.removed = None  # a leader counts on us again (added back since)
        if m.term > self.term:
            if m.type in (MT.VOTE, MT.PRE_VOTE):
                in_lease = (
                    self.cfg.check_quorum
                    and self.lead is not None
                    and self.election_elapsed < self.cfg.election_tick
                )
                if in_lease and m.context != _CAMPAIGN_TRANSFER:
                    # Stickiness: a live leader was heard recently; this is a disrupter.
                    return
            if m.type == MT.PRE_VOTE or (m.type == MT.PRE_VOTE_RESP and not m.reject):
                pass  # pre-vote never changes terms
            elif m.type in (MT.APP, MT.COMMIT, MT.HEARTBEAT, MT.SNAPSHOT):
                self._become_follower(m.term, m.frm)
            else:
                self._become_follower(m.term, None)
        elif m.term < self.term:
            # (Also a node told it was removed: its own campaign may have raised its term
            # past the group's, and once added back it must say so, or the leader's
            # appends are ignored for good without pre-vote or check-quorum: review.)
            if (self.cfg.check_quorum or self.cfg.pre_vote or self.removed is not None) \
                    and m.type in (MT.APP, MT.COMMIT, MT.HEARTBEAT):
                # A stale leader: tell it our term so it steps down. Without this, a
                # leader partitioned away and back could stay deposed-but-unaware forever
                # when pre-vote keeps the rest of us from raising terms past it.
                self._send(Message(MT.APP_RESP, m.frm, self.id, self.term))
            elif m.type == MT.PRE_VOTE:
                self._send(Message(MT.PRE_VOTE_RESP, m.frm, self.id, self.term, reject=True))
            return

        if m.type in (MT.VOTE, MT.PRE_VOTE):
            self._handle_vote_request(m)
        elif self.role == Role.LEADER:
            self._step_leader(m)
        elif self.role == Role.FOLLOWER:
            self._step_follower(m)
        else:
            self._step_candidate(m)

    # -- Ready / advance ---------------------------------------------------------------
    def has_ready(self) -> bool:
        self._flush()
        log = self.log
        return bool(
            self.msgs
            or log.unstable
            or log.pending_snapshot is not None
            or self.read_states
            or log.has_next_committed()
            or self._hard_state() != self._prev_hard
            or SoftState(self.lead, self.role) != self._prev_soft
        )

    def ready(self) -> Ready:
        self._flush()
        log = self.log
        rd = Ready()
        soft = SoftState(self.lead, self.role)
        if soft != self._prev_soft:
            rd.soft_state = soft
        hard = self._hard_state()
        prev = self._prev_hard
        if hard != prev:
            rd.hard_state = hard
        rd.entries = list(log.unstable)
        rd.snapshot = log.pending_snapshot
        rd.committed_entries = log.next_committed(self.cfg.max_apply_bytes)
        rd.messages, self.msgs = self.msgs, []
        rd.read_states, self.read_states = self.read_states, []
        rd.must_sync = bool(
            rd.entries or rd.snapshot is not None
            or hard.term != prev.term or hard.vote != prev.vote
        )
        return rd

    def advance(self, rd: Ready) -> None:
        if rd.soft_state is not None:
            self._prev_soft = rd.soft_state
        if rd.hard_state is not None:
            self._prev_hard = rd.hard_state
        self.log.stable_to(len(rd.entries), rd.snapshot)
        if rd.committed_entries:
            self.log.applied_to(rd.committed_entries[-1].index)
            if self.role == Role.LEADER:
                self._tell_the_removed(rd.committed_entries[0].index,
                                       rd.committed_entries[-1].index)
        self._trim_confs()

    def _tell_the_removed(self, lo: int, hi: int) -> None:
        """Send the "not a member" notice to each node whose removal was just applied
        (entries ``lo..hi``): a leader stops sending to a node once a configuration
        without it is appended, so the node never receives its removal, and one removed
        while idle heard nothing more (found from outside: its /ready said ready for as
        long as it ran). Read from the configurations kept (``self.confs``, not yet
        trimmed to the new applied index), not from every applied entry."""
        prev: ConfState | None = None
        for index, conf in self.confs:
            if prev is not None and lo <= index <= hi:
                for node in sorted(prev.members() - conf.members() - {self.id}):
                    self.tell_if_removed(node)
            prev = conf

    # -- introspection -----------------------------------------------------------------
    def status(self) -> Status:
        peers = {
            nid: PeerStatus(pr.match, pr.next, pr.state_name(), pr.learner, pr.recent_active)
            for nid, pr in self.prs.items()
        }
        return Status(
            id=self.id, role=self.role, term=self.term, leader=self.lead,
            commit=self.log.committed, applied=self.log.applied,
            last_index=self.log.last_index(), conf=self.conf,
            lead_transferee=self.lead_transferee, peers=peers,
        )

    def conf_at(self, index: int) -> ConfState | None:
        """The configuration in effect at ``index``, or None when that is not known: it
        lies before the retained history or after the applied index (a later config
        entry may not have reached this log yet)."""
        if index < self.confs[0][0] or index > self.log.applied:
            return None
        conf = self.confs[0][1]
        for i, c in self.confs:
            if i > index:
                break
            conf = c
        return conf

    def promotable(self) -> bool:
        return (
            self.id in self.conf.voters
            and self.removed is None
            and self.log.pending_snapshot is None
            and self._above_vote_floor()
        )

    def _above_vote_floor(self) -> bool:
        floor = self._vote_floor
        if floor is not None and floor.cleared(
            self.log.last_index(), self.log.term_or_zero(self.log.committed)
        ):
            self._vote_floor = floor = None  # cleared for good
        return floor is None

    # ============================================================== role changes ======
    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = None
            # An election is under way or done since the restart (its own, or one it
            # voted in or refused): its outcome is awaited with the ordinary timers
            # ("Campaigning at restart").
            self._restarting = False
        self.lead = None
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = (
            self.cfg.election_tick + self.rng.randrange(self.cfg.election_tick)
        )
        self.lead_transferee = None
        self.transfer_change = None
        self.pending_handover = None
        self.votes = {}
        self._survivor, self._electorate = None, frozenset()
        self._unrecorded = {}
        self.prs = {}
        self.read_only = ReadOnly()
        self.pending_reads = []
        self._bcast_pending = False
        self._notice_held = False
        self.quiesced = False  # a new term or role starts awake
        self.retired_heard = {}  # a leader's report: it starts again with each role

    def _become_follower(self, term: int, lead: str | None) -> None:
        self._reset(term)
        self._grants = {}
        self.lead = lead
        self.role = Role.FOLLOWER

    def _become_pre_candidate(self) -> None:
        if self.role == Role.LEADER:
            raise AssertionError("invalid transition [leader -> pre-candidate]")
        # Pre-vote changes neither term nor vote: a failed pre-election leaves no trace.
        self.votes = {}
        self._survivor, self._electorate = None, frozenset()
        self.lead = None
        self.role = Role.PRE_CANDIDATE

    def _become_candidate(self) -> None:
        if self.role == Role.LEADER:
            raise AssertionError("invalid transition [leader -> candidate]")
        self._reset(self.term + 1)
        self.vote = self.id
        self.role = Role.CANDIDATE

    def _become_leader(self) -> None:
        if self.role != Role.CANDIDATE:
            raise AssertionError(f"invalid transition [{self.role.name.lower()} -> leader]")
        grants, self._grants = self._grants, {}
        lost = self._survivor
        self._reset(self.term)
        self.lead = self.id
        self._transfer_timeouts = {}
        self.role = Role.LEADER
        last = self.log.last_index()
        # Sorted: set order varies between processes, and a seed must replay exactly.
        for nid in sorted(self.conf.members()):
            self.prs[nid] = self._new_progress(nid, last + 1)
        me = self.prs.get(self.id)
        if me is not None:
            me.become_replicate()
        if self.handover is not None and self.handover[1] == self.term:
            self.pending_handover = self.handover[0]
        self.handover = None
        if lost is not None:
            # A survivor election: the first entry removes the lost voter, so that this
            # leader's quorum is itself (see "The lone survivor of two voters").
            cc = ConfChange(ConfChangeOp.REMOVE, lost)
            conf = apply_change(self.conf, cc)
            if self._inc and conf.incarnation_of(self.id) != self._inc:
                mine = {(n, i) for n, i in conf.incarnations if n != self.id}
                conf = conf._replace(incarnations=frozenset(mine | {(self.id, self._inc)}))
            self._leader_append([Entry(self.term, last + 1, EntryType.CONF_CHANGE,
                                       encode_conf_entry(cc, conf))], conf)
            return
        # The no-op entry of §8: committing it commits every earlier entry and tells us
        # our commit index, which ReadIndex and membership changes wait for. It records
        # the incarnations of the voters that granted our campaign, where the
        # configuration does not yet (see "Incarnations").
        records = self._election_records(grants)
        if records is None:
            self._leader_append([Entry(self.term, last + 1)])
            return
        conf = self.conf._replace(incarnations=records)
        cc = ConfChange(ConfChangeOp.RECORD, self.id)
        self._leader_append([Entry(self.term, last + 1, EntryType.CONF_CHANGE,
                                   encode_conf_entry(cc, conf))], conf)

    def _election_records(self, grants: dict[str, int]) -> frozenset[tuple[str, int]] | None:
        """The configuration's incarnations plus this leader's and its voters', or None
        if they add nothing."""
        if not self._inc:
            return None
        add = {v: inc for v, inc in grants.items() if inc and v in self.conf.voters}
        add[self.id] = self._inc
        add = {v: inc for v, inc in add.items() if self._incs.get(v) != inc}
        if not add:
            return None
        kept = {(n, i) for n, i in self.conf.incarnations if n not in add}
        return frozenset(kept | set(add.items()))

    def _new_progress(self, nid: str, next_index: int) -> Progress:
        pr = Progress(
            next_index,
            Inflights(self.cfg.max_inflight_msgs, self.cfg.max_inflight_bytes),
            learner=nid not in self.conf.voters,
        )
        if nid == self.id:
            pr.match = next_index - 1
            pr.recent_active = True
            pr.inc = self._inc
        return pr

    # ================================================================= elections ======
    def _tick_election(self) -> None:
        self.election_elapsed += 1
        if self.promotable() and self.election_elapsed >= self.randomized_election_timeout:
            self.election_elapsed = 0
            self.campaign()

    def _campaign(self, kind: CampaignKind) -> None:
        if not self.promotable():
            return
        if kind == CampaignKind.PRE_ELECTION:
            self._become_pre_candidate()
            vote_type, term = MT.PRE_VOTE, self.term + 1
        else:
            self._become_candidate()
            vote_type, term = MT.VOTE, self.term
        if self._poll(self.id, True) is True:
            self._won(kind)
            return
        ctx = _CAMPAIGN_TRANSFER if kind == CampaignKind.TRANSFER else None
        self._vote_request = (vote_type, term, ctx)
        for v in sorted(self.conf.voters):
            if v != self.id:
                self._request_vote(v)

    def _request_vote(self, v: str) -> None:
        """Send ``v`` this campaign's (pre-)vote request."""
        vote_type, term, ctx = self._vote_request
        self._send(Message(vote_type, v, self.id, term, self.log.last_term(),
                           self.log.last_index(), context=ctx))

    def _won(self, kind: CampaignKind) -> None:
        if kind == CampaignKind.PRE_ELECTION:
            self._campaign(CampaignKind.ELECTION)
        else:
            self._become_leader()

    def _poll(self, nid: str, granted: bool) -> bool | None:
        self.votes.setdefault(nid, granted)
        if self._survivor is not None:
            answers = [self.votes.get(n) for n in self._electorate]
            if False in answers:
                return False
            return True if None not in answers else None
        return vote_result(self.conf.voters, self.votes)

    def _confs_since_commit(self) -> list[ConfState]:
        """The configuration in effect at the commit index, then every later one in the
        log (each may be in effect somewhere: none of them is known to be committed)."""
        committed = self.log.committed
        base = self.confs[0][1]
        later = []
        for index, conf in self.confs:
            if index <= committed:
                base = conf
            else:
                later.append(conf)
        return [base, *later]

    def voters_since_commit(self) -> frozenset[str]:
        """Every voter of the configuration in effect at the commit index and of each
        later one in the log (W in "The lone survivor of two voters"). A caller of
        ``campaign_without`` may use it for (B): if it removes a voter only once every
        member of its target is a voter, a removal of this node made from a
        configuration of W has a target within this set (the caller must also know that
        the target it reads is that removal's, or a subset of it)."""
        return frozenset(n for conf in self._confs_since_commit() for n in conf.voters)

    def _survivor_blocker(self, lost: str) -> str | None:
        if self.role == Role.LEADER:
            return f"{self.id} already leads term {self.term}"
        if lost == self.id:
            return "a node cannot survive itself"
        if not self.promotable():
            return f"{self.id} cannot campaign (not a voter, or a snapshot or vote floor)"
        if set(self.conf.voters) != {self.id, lost}:
            return (f"the configuration's voters are {sorted(self.conf.voters)}, not "
                    f"{sorted({self.id, lost})}")
        window = self._confs_since_commit()
        for conf, after in zip(window, [*window[1:], None], strict=True):
            voters = set(conf.voters)
            others = voters - {self.id, lost}
            if voters == {lost}:
                # Promoting us from {lost}: what lost committed alone precedes that entry,
                # and we hold the entry (see "The lone survivor of two voters").
                if (self.id in conf.learners and after is not None
                        and set(after.voters) == {self.id, lost}):
                    continue
            elif self.id in voters and len(others) <= 1 and (not others or lost in voters):
                continue
            return (f"a configuration since the commit index has voters "
                    f"{sorted(conf.voters)}: not {{{self.id}}}, {{{self.id}, {lost}}}, "
                    f"{{{self.id}, {lost}, one more}}, or {{{lost}}} promoting {self.id}")
        return None

    def _survivor_electorate(self, lost: str) -> frozenset[str]:
        """This node, the other voter of each three-voter configuration since the commit
        index, and every learner of the two-voter ones that may have been promoted beyond
        this log: a learner is promoted only once recorded, and recording it needed this
        node's acknowledgement, so an unrecorded one was not (with identities off, every
        learner counts). See "The lone survivor of two voters"."""
        out = {self.id}
        for conf in self._confs_since_commit():
            out |= set(conf.voters) - {lost}
            if set(conf.voters) == {self.id, lost}:
                recorded = {n for n, _ in conf.incarnations}
                out |= {n for n in conf.learners if not self._inc or n in recorded}
        return frozenset(out)

    def _handle_vote_request(self, m: Message) -> None:
        can_vote = (
            self.vote == m.frm
            or (self.vote is None and self.lead is None)
            or (m.type == MT.PRE_VOTE and m.term > self.term)
        )
        resp = MT.VOTE_RESP if m.type == MT.VOTE else MT.PRE_VOTE_RESP
        if (can_vote and self._above_vote_floor() and self._identity_allows_vote(m)
                and (self.log.is_up_to_date(m.index, m.log_term)
                     or self._attests_for_survivor(m))):
            # A granted pre-vote answers in the candidate's future term, so it is not
            # mistaken for a rejection from a newer term.
            self._send(Message(resp, m.frm, self.id, m.term))
            self._restarting = False  # it backs that candidate: no campaign against it
            if m.type == MT.VOTE:
                self.election_elapsed = 0
                self.vote = m.frm
            elif (self.role == Role.PRE_CANDIDATE and m.term == self.term + 1
                    and m.frm < self.id and self._survivor is None):
                # Two pre-elections for the same term at once (a group restarted
                # together): if both went on, their elections could split the vote and
                # cost a full timeout. The higher id steps back. Pre-vote changed
                # nothing, so abandoning one is free ("Campaigning at restart").
                self._become_follower(self.term, None)
        else:
            self._send(Message(resp, m.frm, self.id, self.term, reject=True))

    def _refuse_non_member(self, m: Message) -> bool:
        """Answer a vote request from a node that the configuration we applied (so a
        committed one) does not include, and whose log is behind it, by (last term,
        last index) as Raft compares logs (§5.4.1): "not a member" (see "A removed node
        learns it was removed"), with the applied index and its term. Before
        stickiness, which would drop it unanswered while we follow a live leader."""
        notice = self._not_a_member_notice(m.frm)
        if notice is None or (m.log_term, m.index) >= (notice.log_term, notice.index):
            return False
        notice.type = MT.VOTE_RESP if m.type == MT.VOTE else MT.PRE_VOTE_RESP
        self._send(notice)
        return True

    def tell_if_removed(self, node: str) -> bool:
        """Send ``node`` the "not a member" notice if neither our latest configuration
        nor the one we applied includes it; True if sent. For a request from it that no
        leader will take: a read (READ_INDEX), or a write it forwarded (the driver)."""
        notice = self._not_a_member_notice(node)
        if notice is None:
            return False
        self._send(notice)
        return True

    def _not_a_member_notice(self, to: str) -> Message | None:
        """The "not a member" refusal for ``to`` (a PRE_VOTE_RESP carrying the applied
        index and its term), if neither our latest configuration nor the one we applied
        includes it; else None. The receiver takes it only if its log is behind that
        entry (``_note_removed``)."""
        if to in self.conf.members():
            return None
        applied = self.log.applied
        conf = self.conf_at(applied)
        at = self.log.term_or_zero(applied)
        if conf is None or not at or to in conf.members():
            return None
        return Message(MT.PRE_VOTE_RESP, to, self.id, self.term, log_term=at, index=applied,
                       reject=True, context=_NOT_A_MEMBER)

    def _note_removed(self, m: Message) -> None:
        """A member says its applied configuration at ``m.index`` (of term ``m.log_term``)
        leaves us out; if our log is behind that entry, we hold no committed
        configuration after it, so we are not in the group's, and we stop campaigning
        until a leader contacts us again."""
        if m.reject and m.frm in self.conf.members() and (m.log_term, m.index) > (
                self.log.last_term(), self.log.last_index()):
            self.removed = (m.frm, m.index)
            if self.role in (Role.PRE_CANDIDATE, Role.CANDIDATE):
                self._become_follower(self.term, None)

    def _note_report(self, m: Message) -> None:
        """What a vote request tells a newborn node of its own past (``to_inc``)."""
        if m.to_inc == 0 or (m.to_inc == self._inc and m.to_inc_ok):
            self._unaware.add(m.frm)
        elif m.to_inc != self._inc:
            self._known_gone = True  # the candidate counts on an earlier incarnation of us

    def _attests_for_survivor(self, m: Message) -> bool:
        """A survivor election's request (an int ``context``: the candidate's commit
        index c) may be granted by a node whose log is more up to date, if that node was
        a voter in no configuration of its log from index c on: then nothing after c
        was committed with its acknowledgement as a voter ("The lone survivor of two
        voters", part 3), and everything up to c is in the candidate's log."""
        c = m.context
        if type(c) is not int or c < 0:
            return False
        return not self._voter_from(c)

    def _voter_from(self, c: int) -> bool:
        """Whether this node is a voter in the configuration in effect at index ``c`` of
        its log or in any later one; True when the log no longer shows it (compacted)."""
        if self.id in self.conf.voters:
            return True
        if c >= self.confs[0][0]:
            history = self.confs
        else:  # configurations below the applied index were trimmed: read them back
            log = self.log
            storage = log.storage
            base = log.first_index() - 1
            try:
                base = max(base, storage.snapshot().index)
            except SnapshotUnavailable:
                pass
            if c < base:
                return True
            history = [(base, storage.initial_state()[1])]
            for e in storage.conf_entries(base + 1):
                if e.index < log.unstable_offset:
                    history.append((e.index, decode_conf_entry(e.data)[1]))
            history += _decode_confs([e for e in log.unstable if e.type])
        at_c = [conf for i, conf in history if i <= c]
        later = [conf for i, conf in history if i > c]
        return any(self.id in conf.voters for conf in [*at_c[-1:], *later])

    def _identity_allows_vote(self, m: Message) -> bool:
        """The vote rules of "Incarnations": never vote as an incarnation the candidate
        does not know us by, never for a candidate that is not the incarnation we know,
        and, newborn and not yet recorded, only as ``_newborn_may_vote`` allows."""
        if not self._inc:
            return True
        if m.to_inc and m.to_inc != self._inc:
            return False  # the candidate counts on an earlier incarnation of this node
        known = self._incs.get(m.frm)
        if known is not None and m.inc != known:
            return False  # the candidate lost the state this group counted on
        if self.cfg.newborn and self._incs.get(self.id) != self._inc:
            return self._newborn_may_vote(m)
        return True

    def _newborn_may_vote(self, m: Message) -> bool:
        """A node whose storage was created empty, and which its configuration does not
        record, may be a founder at the group's birth or a voter whose files were wiped.
        Its vote is safe when no earlier incarnation of it ever counted: a voter's
        acknowledgement counts only toward a commit index at or beyond its record, or
        once a record made on contact is committed (``_counted_matches``), so a quorum
        that used it holds its record. Either proof will do:

        - the candidate holds a committed record of us as we are: its leader recorded
          us knowing the group's committed history (Raft's leader completeness), so it
          holds everything an earlier incarnation helped commit;
        - more than ``n - majority(n)`` other voters have shown us no record of us (or
          a committed one of us as we are). A record of an earlier incarnation that
          counted is held by a quorum, possibly with that incarnation, so by at least
          ``majority(n) - 1`` other voters: it cannot be absent from that many.

        The candidate's own request is one of the reports (noted before this check)."""
        if m.to_inc == self._inc and m.to_inc_ok:
            return True
        if self._known_gone:
            return False
        others = self.conf.voters - {self.id}
        n = len(self.conf.voters)
        return len(self._unaware & others) > n - majority(n)

    def _step_candidate(self, m: Message) -> None:
        t = m.type
        mine = MT.PRE_VOTE_RESP if self.role == Role.PRE_CANDIDATE else MT.VOTE_RESP
        if t in (MT.APP, MT.COMMIT):
            self._become_follower(m.term, m.frm)
            self._handle_append(m)
        elif t == MT.HEARTBEAT:
            self._become_follower(m.term, m.frm)
            self._handle_heartbeat(m)
        elif t == MT.SNAPSHOT:
            self._become_follower(m.term, m.frm)
            self._handle_snapshot(m)
        elif t == mine:
            granted = not m.reject
            if self._inc:
                known = self._incs.get(m.frm)
                if known is not None and known != m.inc:
                    return  # another incarnation of a voter we count on: not its vote
                if granted:
                    # Only a grant: a refusal may come from a wiped node that a late
                    # candidate must not record by its election (it counts at once).
                    self._grants[m.frm] = m.inc
            result = self._poll(m.frm, granted)
            if result is True and self._survivor is not None:
                self._survivor_won()
            elif result is True:
                self._won(
                    CampaignKind.PRE_ELECTION if self.role == Role.PRE_CANDIDATE
                    else CampaignKind.ELECTION
                )
            elif result is False:
                self._become_follower(self.term, None)

    # =============================================================== follower =========
    def _step_follower(self, m: Message) -> None:
        t = m.type
        if t in (MT.APP, MT.COMMIT):
            self.election_elapsed = 0
            self.lead = m.frm
            self._handle_append(m)
        elif t == MT.HEARTBEAT:
            self.election_elapsed = 0
            self.lead = m.frm
            self._handle_heartbeat(m)
        elif t == MT.SNAPSHOT:
            self.election_elapsed = 0
            self.lead = m.frm
            self._handle_snapshot(m)
        elif t == MT.TIMEOUT_NOW:
            if self.promotable():
                if m.context is not None:
                    try:
                        self.handover = (decode_change(m.context), self.term + 1)
                    except ValueError:
                        return  # malformed: an honest leader never sends it, so ignore it
                # §3.10: start an election at once, bypassing pre-vote and stickiness.
                self._campaign(CampaignKind.TRANSFER)
        elif t == MT.READ_INDEX_RESP:
            self.read_states.append(ReadState(m.index, m.context))
        elif t in (MT.READ_INDEX, MT.TRANSFER_LEADER) and self.lead is not None:
            self._send(Message(t, self.lead, m.frm, self.term, context=m.context))

    def _handle_append(self, m: Message) -> None:
        """AppendEntries (§5.3), and the COMMIT notice: the same checks, but a notice
        is answered only if rejected (see "Commit notices")."""
        log = self.log
        if m.index < log.committed:
            # Everything up to our commit index matches the leader already (Log
            # Matching); answering with it avoids touching committed entries at all.
            if m.type == MT.APP:
                self._send(Message(MT.APP_RESP, m.frm, self.id, self.term, index=log.committed))
            return
        if not log.match_term(m.index, m.log_term):
            hint = min(m.index, log.last_index())
            hint = log.find_conflict_by_term(hint, m.log_term)
            self._send(Message(
                MT.APP_RESP, m.frm, self.id, self.term, log_term=log.term_or_zero(hint),
                index=m.index, reject=True, reject_hint=hint,
            ))
            return
        ents = m.entries
        last_new = m.index + len(ents)
        conflict = log.find_conflict(ents)  # type: ignore[arg-type]
        if conflict:
            if conflict <= log.committed:
                raise AssertionError(
                    f"{self.id}: entry {conflict} conflicts with committed {log.committed}"
                )
            new = list(ents[conflict - m.index - 1 :])
            try:
                confs = _decode_confs(new)
            except ValueError:
                return  # malformed configuration entry: drop the message, change nothing
            self._truncate_confs(conflict)
            log.append(new)
            self._track_confs(confs)
        log.commit_to(min(m.commit, last_new))
        if m.type == MT.APP:
            self._send(Message(MT.APP_RESP, m.frm, self.id, self.term, index=last_new))

    def _handle_heartbeat(self, m: Message) -> None:
        log = self.log
        if self._inc and m.to_inc and m.to_inc != self._inc:
            # The leader's match for us (the heartbeat's commit bound) describes an
            # earlier incarnation of this node, whose log we no longer hold. Answer
            # (rejecting a quiesce heartbeat), so it learns who we are, commit nothing.
            self._send(Message(MT.HEARTBEAT_RESP, m.frm, self.id, self.term,
                               context=m.context, reject=bool(m.index)))
            return
        log.commit_to(min(m.commit, log.last_index()))
        if not m.index:
            self.quiesced = False  # an ordinary heartbeat: the leader is awake
            self._send(Message(MT.HEARTBEAT_RESP, m.frm, self.id, self.term, context=m.context))
            return
        # The leader is going quiet with (m.index, m.log_term) as its last entry. Follow
        # only if we hold that entry (so we may take its commit index, bounded by its
        # match for us) and were not told the leader is unreachable; otherwise reject,
        # which wakes it.
        ok = log.match_term(m.index, m.log_term) and m.frm not in self._unreachable
        # Quiet only once committed up to the named entry: a follower left below it, if
        # the leader's follow-up is lost, must stay awake, so that its election timer
        # (a pre-vote wakes the leader) brings the rest; asleep it waited for good
        # (placement simulator seed 2104: commit 94 of 95, the follow-up dropped).
        self.quiesced = ok and m.commit >= m.index
        self.election_elapsed = 0
        # The leader quiesces with commit == last, so a commit below the named entry
        # means its match for us is stale (it thought us down, and an answer was lost):
        # say so, and it sends us the append that tells us the rest. Otherwise agreement
        # goes unanswered: the leader quiesced knowing our match.
        if not ok or m.commit < m.index:
            self._send(Message(MT.HEARTBEAT_RESP, m.frm, self.id, self.term,
                               context=m.context, reject=not ok))

    def _handle_snapshot(self, m: Message) -> None:
        snap = m.snapshot
        assert snap is not None
        log = self.log
        if snap.index <= log.committed:
            self._send(Message(MT.APP_RESP, m.frm, self.id, self.term, index=log.committed))
            return
        if log.match_term(snap.index, snap.term):
            # We already hold the snapshot's last entry: fast-forward instead of wiping.
            log.commit_to(snap.index)
        else:
            # Our configurations past the commit index are dropped (retiring no one),
            # and the snapshot's follows the committed one.
            self._truncate_confs(log.committed + 1)
            log.restore(snap)
            self.confs = [(snap.index, snap.meta.conf)]
            self._set_conf(snap.meta.conf)
        # Claim only what the snapshot proves (etcd answers with the commit index too):
        # entries after it in our log have not been checked against the leader's.
        self._send(Message(MT.APP_RESP, m.frm, self.id, self.term, index=log.committed))

    # ============================================================= quiescence ========
    def _keeps_quiet(self, m: Message) -> bool:
        """Whether a quiesced node may take ``m`` without waking: only the traffic a
        quiet group still sees (see the module docstring)."""
        if m.term != self.term:
            return False
        if self.role == Role.LEADER:
            return m.type in (MT.HEARTBEAT_RESP, MT.APP_RESP) and not m.reject
        return m.type == MT.HEARTBEAT and m.index > 0 and m.frm == self.lead

    def _unquiesce(self) -> None:
        if self.quiesced:
            self.quiesced = False
            # A full election timeout from now: a follower whose leader died campaigns
            # as if the last heartbeat had just arrived; a leader's check-quorum window
            # starts afresh.
            self.election_elapsed = 0
            self.heartbeat_elapsed = 0

    def _quiesce_blocker(self, acks_in_flight: bool = False) -> str | None:
        """Why this leader must keep heartbeating now, or None if it may go quiet.
        ``acks_in_flight``: count as acknowledged a reachable follower in REPLICATE that
        was sent the last index (``pr.next`` beyond it), whose answer is on its way."""
        if not self.cfg.quiesce:
            return "quiescence is off"
        if self.role != Role.LEADER:
            return "not the leader"
        if (self.lead_transferee is not None or self.pending_handover is not None
                or self.pending_reads or len(self.read_only) or self._bcast_pending):
            return "a transfer, handover, read or broadcast is pending"
        log = self.log
        last = log.last_index()
        if log.committed != last or log.term_or_zero(last) != self.term:
            return "not everything is committed in this term"
        if self.conf.learners & self.conf.auto_promote:
            return "a learner awaits promotion"
        reachable = {self.id}
        for nid, pr in self.prs.items():
            if nid == self.id or nid in self._unreachable:
                continue
            if pr.unheard:
                return f"{nid} has not answered since it was reported unreachable"
            replicating = pr.state == ProgressState.REPLICATE
            acked = replicating and (pr.match == last or (acks_in_flight and pr.next > last))
            if not acked:
                return f"{nid} has not acknowledged {last}"
            reachable.add(nid)
        if not has_quorum(self.conf.voters, reachable):
            return "no quorum of voters is reachable"
        return None

    def _quiesce(self) -> None:
        """Send the last heartbeat, flagged with our last entry, and stop ticking."""
        self.quiesced = True
        self.heartbeat_elapsed = 0
        last = self.log.last_index()
        committed = self.log.committed
        for nid, pr in self.prs.items():
            if nid != self.id:
                # min(match, commit), as in every heartbeat: an exempt (unreachable)
                # follower may hold different entries below our commit index.
                self._send(Message(MT.HEARTBEAT, nid, self.id, self.term, self.term, last,
                                   commit=min(pr.match, committed),
                                   context=self.read_only.last_seq(), to_inc=pr.inc))

    # ================================================================= leader =========
    def _tick_heartbeat(self) -> None:
        self.heartbeat_elapsed += 1
        self.election_elapsed += 1
        if self.election_elapsed >= self.cfg.election_tick:
            self.election_elapsed = 0
            if self.cfg.check_quorum and not self._quorum_active():
                self._become_follower(self.term, None)
                return
            if self.lead_transferee is not None:
                # §3.10: a transfer that did not finish within an election timeout is
                # abandoned so the leader can serve proposals again.
                late = self.lead_transferee
                self._transfer_timeouts[late] = self._transfer_timeouts.get(late, 0) + 1
                self._abort_transfer()
        for pr in self.prs.values():
            if pr.state == ProgressState.SNAPSHOT:
                pr.snapshot_elapsed += 1
                if pr.snapshot_elapsed >= self._snapshot_timeout:
                    pr.become_probe()  # the snapshot was probably lost: probe again
        if self.heartbeat_elapsed >= self.cfg.heartbeat_tick:
            self.heartbeat_elapsed = 0
            if self._quiesce_blocker() is None:
                self._quiesce()
            else:
                self._bcast_heartbeat(self.read_only.last_seq())

    def _quorum_active(self) -> bool:
        active = set()
        for nid, pr in self.prs.items():
            if nid == self.id or pr.recent_active:
                active.add(nid)
            if nid != self.id:
                pr.recent_active = False
        return has_quorum(self.conf.voters, active)

    def _step_leader(self, m: Message) -> None:
        t = m.type
        if self._inc and t in (MT.APP_RESP, MT.HEARTBEAT_RESP) and not self._recognise(m):
            return
        if t == MT.APP_RESP:
            self._handle_append_response(m)
        elif t == MT.HEARTBEAT_RESP:
            self._handle_heartbeat_response(m)
        elif t == MT.READ_INDEX:
            if self.tell_if_removed(m.frm):
                # Its read could never complete: it is not in any configuration this
                # leader knows, and the one it applied (committed) leaves it out. A node
                # removed while idle heard nothing else, and its reads waited 5 s for an
                # index it would never receive (found from outside).
                return
            self._leader_read(m.frm, m.context)
        elif t == MT.TRANSFER_LEADER:
            try:
                self._start_transfer(m.context, None)
            except TransferRejected:
                pass  # the requester times out; nothing else to undo

    def _recognise(self, m: Message) -> bool:
        """Whether an answer from ``m.frm`` may count (see "Incarnations"). An answer
        from a new incarnation voids what we knew of the old one (its match). A member
        the configuration does not record as this incarnation is queued for a RECORD
        or a READMIT; until then a voter's answers are ignored, a learner's are not
        (it counts for nothing, and replicating to it is how it catches up)."""
        pr = self.prs.get(m.frm)
        if pr is None:
            return True  # not a member: the handlers ignore it
        if (m.frm, m.inc) in self._retired:
            # A late message of an incarnation replaced since: ignore it. One that keeps
            # coming is that incarnation's files, restored from an older copy: never
            # counted, never readmitted (only a new incarnation is), so it stays behind;
            # noted for the driver to report (found from outside: nothing said why).
            self.retired_heard[m.frm] = m.inc
            return False
        # Heard as a live incarnation again (stopped and readmitted): no longer reported.
        self.retired_heard.pop(m.frm, None)
        if pr.inc != m.inc:
            if pr.inc:
                pr = self.prs[m.frm] = self._new_progress(m.frm, self.log.last_index() + 1)
            pr.inc = m.inc
        if not m.inc or self._incs.get(m.frm) == m.inc:
            return True  # where its acknowledgement counts: ``_maybe_commit``
        self._unrecorded[m.frm] = m.inc
        self._bcast_pending = True  # _flush proposes the record
        return m.frm not in self.conf.voters

    def _record_began(self, nid: str) -> tuple[int, bool]:
        """Where ``nid``'s current record began: the index of the configuration entry that
        made it (or of the retained base, which is applied, so committed), and whether
        that entry was a group's first records (the configuration before it had none)."""
        confs = self.confs
        rec = confs[-1][1].incarnation_of(nid)
        for k in range(len(confs) - 1, 0, -1):
            prev = confs[k - 1][1]
            if prev.incarnation_of(nid) != rec:
                return confs[k][0], not prev.incarnations
        return confs[0][0], False

    def _elected_record(self, index: int) -> bool:
        """Whether the configuration entry at ``index`` is a leader's first entry of its
        term (a RECORD of the voters that granted its campaign: no incarnation in its
        change's context), rather than a RECORD or READMIT proposed on contact."""
        try:
            e = self.log.entries(index, index + 1)[0]
        except (Compacted, Unavailable):
            return False
        cc = decode_conf_entry(e.data)[0]
        return cc is not None and cc.op == ConfChangeOp.RECORD and not cc.context

    def _countable(self, nid: str) -> bool:
        """Whether ``nid`` may be promoted to voter (see "Incarnations"): without
        identities, or in a configuration that records nobody yet, anyone; otherwise a
        member whose record is committed, or among a group's first records, or the only
        voter."""
        if not self._inc or not self._incs:
            return True
        if nid not in self._incs:
            return False
        if self.conf.voters == {nid}:
            return True  # a lone voter's acknowledgement is the only one there can be
        began, first = self._record_began(nid)
        return first or began <= self.log.committed

    def _counted_matches(self, match: dict[str, int]) -> dict[str, int]:
        """The matches that may count toward the commit index (see "Incarnations"): an
        unrecorded voter's none. A voter recorded by a leader's first entry of its term
        (its election, or the group's first records), or the only voter, counts toward a
        commit index at or beyond that entry, so every quorum that used it holds its
        record. One recorded on contact (a RECORD or READMIT proposal) counts once that
        record is committed: a deposed leader that never knew an earlier incarnation
        could otherwise record a wiped node and commit with it. Leaving a voter out can
        only lower the index, so a few rounds settle it."""
        counted: dict[str, int] = {}
        began: dict[str, int] = {}
        lone = len(self.conf.voters) == 1
        for v, m in match.items():
            if v not in self._incs:
                continue
            index, first = self._record_began(v)
            if index <= self.log.committed or first or lone or self._elected_record(index):
                counted[v], began[v] = m, index
        while True:
            c = committed_index(self.conf.voters, counted)
            late = [v for v in counted if began[v] > c]
            if not late:
                return counted
            for v in late:
                del counted[v]

    def _settle_identities(self) -> None:
        """Propose a RECORD (or a READMIT) for a member heard from as an incarnation the
        configuration does not record: one change at a time, as every change."""
        while self._unrecorded and self._conf_change_blocker() is None \
                and self.lead_transferee is None:
            nid = min(self._unrecorded)
            inc = self._unrecorded.pop(nid)
            if nid not in self.conf.members() or self._incs.get(nid) == inc or nid == self.id:
                continue
            readmit = nid in self.conf.voters and nid in self._incs
            op = ConfChangeOp.READMIT if readmit else ConfChangeOp.RECORD
            try:
                self.propose_conf_change(ConfChange.identity(op, nid, inc))
            except (ConfChangeRejected, ProposalDropped):
                self._unrecorded[nid] = inc
                return
            pr = self.prs.get(nid)
            if pr is not None:
                # Its answer was dropped while it waited for this record: send the
                # record's append now rather than at the next heartbeat. (Only now:
                # re-probing on every dropped answer looped while the record waited.)
                pr.probe_sent = False
            return

    def _handle_append_response(self, m: Message) -> None:
        pr = self.prs.get(m.frm)
        if pr is None:
            return
        if not m.reject and m.index > self.log.last_index():
            # An acknowledgement beyond our log answers nothing we sent: only a second
            # history of the group could send it (found from outside, when the placement
            # layer let one form). Taken, it made the next append read a term past our
            # log, and that error stopped the whole node. Nor does it count as activity.
            return
        pr.recent_active = True
        pr.unheard = False
        if m.reject:
            hint = m.reject_hint
            if m.log_term > 0:
                hint = self.log.find_conflict_by_term(hint, m.log_term)
            if pr.maybe_decr_to(m.index, hint):
                if pr.state == ProgressState.REPLICATE:
                    pr.become_probe()
                self._send_append(m.frm)
            return
        old_paused = pr.is_paused()
        if not pr.maybe_update(m.index) and not (
            pr.match == m.index and pr.state == ProgressState.PROBE
        ):
            return
        if pr.state == ProgressState.PROBE:
            pr.become_replicate()
        elif pr.state == ProgressState.SNAPSHOT and pr.match >= pr.pending_snapshot:
            pr.become_probe()
            pr.become_replicate()
        else:
            pr.inflights.free_le(m.index)
        if self._maybe_commit():
            self._on_commit()
        else:
            if old_paused:
                self._send_append(m.frm)
            if self._notice_held and pr.match == self.log.last_index():
                self._bcast_pending = True  # maybe the last awaited: quiesce, or notices
        while self._send_append(m.frm, send_if_empty=False):
            pass
        if m.frm == self.lead_transferee and pr.match == self.log.last_index():
            self._send_timeout_now(m.frm)
        if pr.learner:
            self._maybe_promote(m.frm, pr)

    def _handle_heartbeat_response(self, m: Message) -> None:
        pr = self.prs.get(m.frm)
        if pr is None:
            return
        pr.recent_active = True
        pr.unheard = False
        pr.probe_sent = False
        if pr.state == ProgressState.REPLICATE and pr.inflights.full():
            pr.inflights.free_first()
        if pr.match < self.log.last_index():
            self._send_append(m.frm)
        if pr.learner:
            # Heartbeats retry a promotion that was blocked when the learner caught up
            # (say, by its own ADD_LEARNER not yet committed): an idle group still
            # promotes it.
            self._maybe_promote(m.frm, pr)
            return
        if m.context is None:
            return
        acks = self.read_only.ack(m.context, m.frm)
        if acks is not None and has_quorum(self.conf.voters, acks | {self.id}):
            for req in self.read_only.release_through(m.context):
                self._answer_read(req.frm, req.context, req.index)

    def _maybe_commit(self) -> bool:
        prs = self.prs
        match = {v: prs[v].match for v in self.conf.voters if v in prs}
        if self._inc and self._incs:
            match = self._counted_matches(match)
        return self.log.maybe_commit(committed_index(self.conf.voters, match), self.term)

    def _on_commit(self) -> None:
        """The commit index moved: tell followers, and release work that waited for
        this leader's first commit in its term."""
        self._bcast_pending = True
        if self.log.term_or_zero(self.log.committed) != self.term:
            return
        if self.pending_reads:
            reads, self.pending_reads = self.pending_reads, []
            for frm, ctx in reads:
                self._leader_read(frm, ctx)
        if self.pending_handover is not None:
            cc, self.pending_handover = self.pending_handover, None
            if not self.cfg.auto_handover:
                return
            try:
                self.propose_conf_change(cc)
            except (ConfChangeRejected, ProposalDropped):
                pass  # already done by someone else, or no longer valid

    def _leader_append(self, ents: list[Entry], conf: ConfState | None = None) -> None:
        """Append our own entries. ``conf`` is the configuration a CONF_CHANGE entry
        produces: it takes effect before the commit index is recomputed, so the change
        is committed by a majority of the *new* voters (dissertation §4.1). Counting
        under the old configuration would let a lone voter commit its promotion of a
        second one that has not seen the entry."""
        self.log.append(ents)
        if conf is not None:
            self.confs.append((ents[-1].index, conf))
            self._set_conf(conf)
        me = self.prs.get(self.id)
        if me is not None:
            me.maybe_update(ents[-1].index)
        if self._maybe_commit():  # a single-voter group commits at once
            self._on_commit()
        self._bcast_pending = True

    def _flush(self) -> None:
        """Send AppendEntries for everything proposed since the last Ready (batching
        many proposals into one message per follower), or the new commit index: as the
        quiesce heartbeat if the group may go quiet, held while the answers that would
        let it are on their way, else as COMMIT notices (see "Quiescing on the last
        acknowledgement")."""
        if self._unrecorded and self.role == Role.LEADER:
            self._settle_identities()
        if self._bcast_pending and self.role == Role.LEADER:
            self._bcast_pending = False
            self._notice_held = False
            if self._quiesce_blocker() is None:
                self._quiesce()  # its heartbeat carries the commit index
                return
            if self._quiesce_blocker(acks_in_flight=True) is None:
                self._notice_held = True  # the last acknowledgement quiesces the group
                return
            for nid in self.prs:
                if nid != self.id:
                    self._send_append(nid, notice=True)

    def _send_append(self, to: str, send_if_empty: bool = True, notice: bool = False) -> bool:
        """Send ``to`` its next entries, or, with none and ``send_if_empty``, an empty
        append (a probe, or a commit index). ``notice``: an empty append to a follower in
        REPLICATE goes as a COMMIT, which it does not answer (see "Commit notices")."""
        pr = self.prs.get(to)
        # The peer may have just been removed by a config appended while handling its
        # own response (an automatic promotion or a handed-over removal).
        if pr is None or pr.is_paused():
            return False
        log = self.log
        prev = pr.next - 1
        last = log.last_index()
        try:
            prev_term = log.term(prev)
            ents = log.entries(pr.next, last + 1, self.cfg.max_msg_bytes) if prev < last else []
        except Compacted:
            return self._send_snapshot(to, pr)
        if not ents and not send_if_empty:
            return False
        kind = MT.COMMIT if notice and not ents and pr.state == ProgressState.REPLICATE else MT.APP
        self._send(Message(kind, to, self.id, self.term, prev_term, prev, ents, log.committed))
        if ents and pr.state == ProgressState.REPLICATE:
            end = ents[-1].index
            pr.next = end + 1
            pr.inflights.add(end, payload_bytes(ents) + ENTRY_OVERHEAD * len(ents))
        elif pr.state == ProgressState.PROBE:
            pr.probe_sent = True
        return True

    def _send_snapshot(self, to: str, pr: Progress) -> bool:
        try:
            snap: Snapshot = self.log.storage.snapshot()
        except SnapshotUnavailable:
            return False
        self._send(Message(MT.SNAPSHOT, to, self.id, self.term, snapshot=snap))
        pr.become_snapshot(snap.index)
        return True

    def _bcast_heartbeat(self, context: Any) -> None:
        for nid, pr in self.prs.items():
            if nid != self.id:
                self._send_heartbeat(nid, pr, context)

    def _send_heartbeat(self, nid: str, pr: Progress, context: Any) -> None:
        self._send(Message(MT.HEARTBEAT, nid, self.id, self.term,
                           commit=min(pr.match, self.log.committed), context=context,
                           to_inc=pr.inc))

    # -- reads -------------------------------------------------------------------------
    def _leader_read(self, frm: str, context: Any) -> None:
        if self.log.term_or_zero(self.log.committed) != self.term:
            # §6.4 step 1: until an entry of this term commits we do not know the
            # latest commit index, so the read waits.
            self.pending_reads.append((frm, context))
            return
        index = self.log.committed
        if self.conf.voters == {self.id}:
            self._answer_read(frm, context, index)
        else:
            self._bcast_heartbeat(self.read_only.add(context, index, frm))

    def _answer_read(self, frm: str, context: Any, index: int) -> None:
        if frm == self.id:
            self.read_states.append(ReadState(index, context))
        else:
            self._send(Message(MT.READ_INDEX_RESP, frm, self.id, self.term, index=index,
                               context=context))

    # -- leadership transfer -----------------------------------------------------------
    def _check_can_propose(self) -> None:
        if self.role != Role.LEADER:
            raise NotLeader(self.id, self.lead)
        if self.lead_transferee is not None:
            raise ProposalDropped(
                f"leadership transfer to {self.lead_transferee} in progress; retry shortly"
            )

    def _start_transfer(self, to: str, change: ConfChange | None) -> None:
        if to == self.id:
            raise TransferRejected(f"{to} is already the leader")
        if to not in self.conf.voters:
            raise TransferRejected(f"{to} is not a voter")
        if self.lead_transferee == to and change is None:
            return
        self.lead_transferee = to
        self.transfer_change = change
        self.election_elapsed = 0  # the transfer must finish within one election timeout
        if self.prs[to].match == self.log.last_index():
            self._send_timeout_now(to)
        else:
            self._send_append(to)  # catch the target up first (§3.10 step 1)

    def _send_timeout_now(self, to: str) -> None:
        cc = self.transfer_change
        self._send(Message(
            MT.TIMEOUT_NOW, to, self.id, self.term,
            context=encode_change(cc) if cc is not None else None,
        ))

    def _abort_transfer(self) -> None:
        self.lead_transferee = None
        self.transfer_change = None

    def _most_up_to_date_voter(self) -> str | None:
        """The voter to hand leadership to (Kudu: "the most up-to-date follower"), among
        those that may answer: one the driver has not reported unreachable first, then
        the one with the fewest transfers to it timed out under this leader, then a
        recently active one, then the highest match. A voter that cannot take over (its
        process runs, but it does not host the group: placement's restart path keeps a
        replica that lost its state stopped until it is removed) was otherwise picked
        again at every retry, for ever, whenever its stale match was the highest
        (placement simulator, seed 138)."""
        candidates = [
            (nid not in self._unreachable, -self._transfer_timeouts.get(nid, 0),
             pr.recent_active, pr.match, nid)
            for nid, pr in self.prs.items()
            if nid != self.id and nid in self.conf.voters
        ]
        return max(candidates)[4] if candidates else None

    # ============================================================== membership ========
    def _conf_change_blocker(self) -> str | None:
        """Why a membership change cannot be accepted now, or None if it can."""
        pending_index = self.confs[-1][0]
        if pending_index > self.log.committed:
            return (
                f"another configuration change (entry {pending_index}) is not yet committed; "
                "only one change may be in flight"
            )
        if self.log.term_or_zero(self.log.committed) != self.term:
            return "the leader has not yet committed an entry of its term; retry shortly"
        return None

    def _maybe_promote(self, nid: str, pr: Progress) -> None:
        if (
            nid in self.conf.auto_promote
            and (not self._inc or (pr.inc and self._incs.get(nid) == pr.inc))
            and pr.state == ProgressState.REPLICATE
            and self.log.last_index() - pr.match <= self.cfg.promote_lag
            and self.lead_transferee is None
            and self._conf_change_blocker() is None
        ):
            self.propose_conf_change(ConfChange(ConfChangeOp.PROMOTE, nid))

    def _track_confs(self, confs: list[tuple[int, ConfState]]) -> None:
        for index, conf in confs:
            self.confs.append((index, conf))
            self._set_conf(conf)

    def _truncate_confs(self, index: int) -> None:
        """Entries from ``index`` on are being replaced: forget the configurations they
        carried and fall back to the latest one still in the log (Kudu: roll back)."""
        if self.confs[-1][0] < index:
            return
        while len(self.confs) > 1 and self.confs[-1][0] >= index:
            self.confs.pop()
        # Going back retires no one: the incarnation a dropped entry recorded (a RECORD
        # or READMIT its leader proposed on hearing from it) is the live one, not a
        # replaced one (simulator seed 68, --kv-api: retired here, the live n10 was
        # ignored for good by the node that later led). We end as a node that never
        # held the entries: the member is an unrecorded incarnation, to be recorded.
        self._set_conf(self.confs[-1][1], retire=False)

    def _trim_confs(self) -> None:
        confs, applied = self.confs, self.log.applied
        while len(confs) > 1 and confs[1][0] <= applied:
            confs.pop(0)

    def _set_conf(self, conf: ConfState, retire: bool = True) -> None:
        """Adopt ``conf``. ``retire``: it follows the current one in log order, so an
        incarnation it records in place of the current one's replaced that one."""
        if retire:
            for nid, inc in self._incs.items():
                if conf.incarnation_of(nid) not in (None, inc):
                    self._retired.add((nid, inc))
        self.conf = conf
        self._incs = dict(conf.incarnations)
        if self.role != Role.LEADER:
            return
        members = conf.members()
        for nid in list(self.prs):
            if nid not in members:
                del self.prs[nid]
                if nid == self.lead_transferee:
                    self._abort_transfer()
        last = self.log.last_index()
        for nid in sorted(members):
            pr = self.prs.get(nid)
            if pr is None:
                self.prs[nid] = self._new_progress(nid, last + 1)
            else:
                pr.learner = nid not in conf.voters
        # A smaller quorum may already hold a later entry.
        if self._maybe_commit():
            self._on_commit()

    # ================================================================= helpers ========
    def _send(self, m: Message) -> None:
        inc = self._inc
        if inc:
            m.inc = inc
            if m.type == MT.VOTE or m.type == MT.PRE_VOTE:
                to_inc = self._incs.get(m.to, 0)
                m.to_inc = to_inc
                m.to_inc_ok = bool(to_inc) and self._record_began(m.to)[0] <= self.log.committed
        self.msgs.append(m)

    def _hard_state(self) -> HardState:
        return HardState(self.term, self.vote, self.log.committed)
