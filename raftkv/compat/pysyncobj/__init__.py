"""A drop-in for PySyncObj 0.3.x's public API, on raftkv.

A PySyncObj program changes only its imports::

    from pysyncobj import SyncObj, SyncObjConf, replicated      # before
    from pysyncobj.batteries import ReplDict, ReplLockManager

    from raftkv.compat.pysyncobj import SyncObj, SyncObjConf, replicated      # after
    from raftkv.compat.pysyncobj.batteries import ReplDict, ReplLockManager

The layout mirrors PySyncObj's: this package exports what ``pysyncobj`` does
(``SyncObj``, ``SyncObjConf``, ``SyncObjConsumer``, ``replicated``, ``replicated_sync``,
``SyncObjException``, ``FAIL_REASON``, ``SERIALIZER_STATE``, ``_RAFT_STATE``,
``_COMMAND_TYPE``, ``VERSION``), ``.batteries`` the batteries, ``.node`` ``Node`` and
``TCPNode``, ``.config`` ``SyncObjConf``, ``.utility`` ``TcpUtility`` and
``.syncobj_admin`` the admin tool. How it works: ``.syncobj``'s docstring.
The guide: ``docs/migrating-from-pysyncobj.md``.

What a program gets
-------------------
- ``SyncObj(selfNode, otherNodes, conf=None, consumers=None)``: "host:port" addresses are
  the node ids; the node listens on ``selfNode`` (or ``bindAddress``). Subclasses with
  ``@replicated`` methods and plain ``SyncObj(..., consumers=[...])`` both work; the
  SyncObj and its consumers are one state machine in one Raft group.
- ``@replicated``: asynchronous by default (returns None); ``sync=True`` blocks and returns
  the result; ``callback=fn`` gets ``fn(result, FAIL_REASON)``; ``timeout=`` bounds a sync
  call (``SyncObjException('Timeout')``); ``@replicated(ver=N)`` and ``setCodeVersion``
  are PySyncObj's code versioning. ``@replicated_sync`` blocks by default.
- Failure codes (``FAIL_REASON``), from what the raftkv node reports: no leader known
  -> ``MISSING_LEADER``; the leader changed before committing -> ``NOT_LEADER``; a
  leader dropped it unproposed (a leadership transfer) -> ``LEADER_CHANGED``; more than
  ``commandsQueueSize`` commands in flight -> ``QUEUE_FULL``; a refused membership
  change, a stopped node -> ``REQUEST_DENIED``. When the leader it was forwarded to is
  replaced before answering, or no answer comes in time, the call waits for its entry to
  reach this node (three election timeouts, ``raftMinTimeout``, more): applied, it
  succeeds, as in PySyncObj; otherwise, or if it came inside a snapshot,
  ``UNKNOWN_OUTCOME`` (PySyncObj 0.3.17's code 7). Every code but that one means the call was not applied. A sync call
  raises ``SyncObjException(code)``. With ``commandsWaitLeader`` (the default) a call
  that failed ``MISSING_LEADER``, ``NOT_LEADER`` or ``LEADER_CHANGED`` (never applied) is
  proposed again until its timeout, so those codes reach a program only without it.
- **A replicated method that raises** is applied, and raises, on every replica alike (in
  PySyncObj it stops the replica's apply loop). A sync call re-raises that exception; a
  callback gets ``(the exception, FAIL_REASON.REQUEST_DENIED)``.
- Arguments travel as msgpack (``raftkv.statemachine``'s codec: None, bool, int of any
  size, float, str, bytes, and lists, tuples, dicts, sets, frozensets and deques of
  those); anything else raises ``TypeError`` before anything is proposed, as does a call
  that does not fit the method's signature. Results never travel: each node computes its
  own (``.syncobj``).
- Snapshots follow PySyncObj's rule: an object's replicated state is every attribute
  set after ``SyncObj.__init__`` (``SyncObjConsumer.__init__``) returned, private and
  name-mangled ones included (the README's ``self.__counter``). Attributes set *before*
  calling the base ``__init__`` are configuration and are not snapshotted, as in
  PySyncObj. An attribute that is not plain data fails the checkpoint loudly, naming
  it, and the log is kept: nothing is dropped. A restore sets the snapshot's attributes
  over the state the constructor made (less those a replicated method deleted since), as
  PySyncObj sets a dump's: an attribute that a new version's ``__init__`` adds keeps its
  initial value after a restart from an older checkpoint. (A checkpoint written by raftkv
  before snapshots named the deleted attributes restores as the whole state, as it did
  then; a node of that older raftkv cannot read the newer snapshots, so a cluster
  upgrades every node before one sends another a snapshot.)
- ``SyncObjConsumer`` and ``consumers=[...]``: every node must pass the same consumers in
  the same order (a snapshot of another length is refused at restore).
- ``addNodeToCluster(node, callback=)`` adds the node as a raftkv learner (PRE_FOLLOWER)
  that the leader promotes to a voter once it has caught up; ``removeNodeFromCluster``
  removes it (removing the leader hands leadership over first). Both need
  ``dynamicMembershipChange=True`` (else ``Exception``, as PySyncObj), work from any
  node (the request travels as a log entry to whichever node leads), and call back
  ``(None, FAIL_REASON)`` once the change is in this node's configuration. A new node
  is started with the existing nodes as ``otherNodes``, as in PySyncObj. A node that
  removes itself never sees its removal (the log stops coming): its callback gets
  ``UNKNOWN_OUTCOME`` after 10 s; call it on another node.
- Read-only nodes, ``SyncObj(None, otherNodes)``: a learner that is never promoted. It
  listens on an ephemeral port of the address that routes to the first partner (or
  ``bindAddress``), dials every member, and the leader adds it when it sees it
  connected (and removes it ``READONLY_GRACE`` seconds after it disconnects). It keeps
  nothing on disk and gets a snapshot when it joins. It may also make replicated calls.
- ``getStatus()`` with PySyncObj's keys: ``version`` (the PySyncObj API version,
  0.3.17), ``revision``, ``self`` and ``leader`` (``TCPNode``), ``state``
  (``_RAFT_STATE``; raftkv's pre-candidate counts as CANDIDATE), ``has_quorum`` (voters
  connected, this node included, are a majority), ``partner_nodes_count`` and
  ``partner_node_status_server_<id>`` (2 connected, 0 not), ``readonly_nodes_count`` and
  ``readonly_node_status_server_<id>``, ``log_len`` (entries held, after compaction),
  ``last_applied``, ``commit_idx``, ``raft_term``, ``next_node_idx_count`` /
  ``match_idx_count`` and ``next_node_idx_server_<id>`` / ``match_idx_server_<id>`` (on
  the leader; 0 elsewhere), ``leader_commit_idx`` (this node's commit index once a
  leader is known), ``uptime``, ``self_code_version``, ``enabled_code_version``.
  Also ``isReady()`` (True once a linearizable read has confirmed this node applied
  what was committed; ``onReady`` fires then), ``waitReady()`` and ``waitBinded()``
  (wait for the node to listen), ``_getLeader()``, ``_isLeader()``, ``hasQuorum``,
  ``destroy()``, ``printStatus()``, ``transferLeadership()``, ``forceLogCompaction()``,
  ``addOnTickCallback()``, ``isNodeConnected()``, the ``selfNode``, ``otherNodes``,
  ``readonlyNodes``, ``raftLastApplied``, ``raftCommitIndex``, ``raftCurrentTerm`` and
  ``conf`` properties.

What is different underneath
----------------------------
- Every entry is fsynced before it is acknowledged; PySyncObj never fsyncs.
- The node runs on raftkv's driver thread whatever ``autoTick`` says. ``autoTick=False``
  means what the program sees: callbacks (``callback=``, ``onReady``,
  ``onStateChanged``, ``onCodeVersionChanged``, onTick callbacks) run inside its
  ``doTick(timeToWait)`` (or ``_onTick``), never on their own. A sync call completes
  without ``doTick`` (PySyncObj's would time out: nothing ticks its node). With
  ``autoTick`` on they run on a tick thread. Either way they never run on the thread that applies entries,
  so a callback may make sync calls. Replicated methods run on the driver thread; reads
  (``get()``) from the program's threads see a state that may lag, as in PySyncObj.
- The node starts when the outermost ``__init__`` returns (not inside
  ``SyncObj.__init__``), so a subclass's ``self.__counter = 0`` after ``super().__init__()``
  never overwrites the restored state. An asynchronous call made before then (in the
  constructor) waits and is proposed when the node starts, as PySyncObj's queue holds it
  until a leader is known; a sync call there raises ``SyncObjException`` with
  ``MISSING_LEADER`` at once, since it would wait for the constructor it is made in.
- ``destroy()`` is synchronous: a leader hands leadership to its most up-to-date voter,
  then the node stops and its files close.
- With ``commandsWaitLeader`` (the default), a command waits for a leader until the
  call's ``timeout`` (forever without one), retried every 5 s (raftkv's request
  deadline); without it, a call made while no leader is known fails at once with
  ``MISSING_LEADER``.
- A new cluster elects its first leader once every founder (every node of a 3-node
  ``selfNode`` + ``otherNodes`` set, 4 of 5) has started, not as soon as a majority has:
  a node on empty files cannot otherwise tell the cluster's birth from its own lost
  data (raftkv's incarnations, ``docs/wiped-nodes.md``). Later elections need a majority.
- A data directory belongs to the node (the address) that created it: reusing a
  ``journalFile`` under another ``selfNode`` address is refused with ``StorageError``
  (PySyncObj would load it as the new node's).
- One call encodes to at most 16 MiB (one log entry); a larger one raises ``ValueError``
  before anything is proposed.
- An in-memory node (no ``journalFile``) compacts its log as PySyncObj's does: its state
  is its own checkpoint, and a new or lagging node gets a snapshot.

SyncObjConf options
-------------------
Mapped:

- ``journalFile``, ``fullDumpFile``: the node's data directory is ``<journalFile>.raftkv``
  (``<fullDumpFile>.raftkv`` when only that is given), a directory holding the Raft log
  (LMDB, fsynced) and the state machine's checkpoint file. Neither file itself is
  written or read: a PySyncObj journal cannot be read (it is pickle). Without either,
  everything is in memory, as in PySyncObj.
- ``password``: the cluster secret; peers prove it in raftkv's handshake and every frame
  is authenticated with it. It does **not** encrypt traffic (PySyncObj's password did):
  use a private network or a tunnel. Without a password the layer uses a fixed, public
  secret and logs a warning that the cluster is unauthenticated: anyone who can reach
  the port can join it, as with PySyncObj without a password (but nothing received is
  ever unpickled).
- ``raftMinTimeout``: election timeouts are drawn from [raftMinTimeout,
  2 * raftMinTimeout), in ticks of 50 ms. ``raftMaxTimeout`` is accepted; a value other
  than PySyncObj's default or 2 * raftMinTimeout is logged as a warning.
- ``autoTick``, ``autoTickPeriod`` (the tick thread's period), ``commandsQueueSize``
  (commands in flight on this node; more fail with ``QUEUE_FULL``),
  ``commandsWaitLeader``, ``dynamicMembershipChange``, ``bindAddress`` (the address to
  listen on; the node id stays ``selfNode``), ``bindRetryTime`` and ``maxBindRetries``
  (0: retry forever), ``onReady``, ``onStateChanged(old, new)``,
  ``onCodeVersionChanged(old, new)``.
- ``logCompactionMinEntries``, ``logCompactionMinTime``: when not PySyncObj's defaults,
  the checkpoint policy (entries applied, seconds) after which the state machine is
  checkpointed, and the log is compacted once it holds ``logCompactionMinEntries``
  entries (keeping half that many, at most 1,000, for followers a little behind); at
  the defaults raftkv's own policies apply (the log compacted at 100,000 entries).
  ``forceLogCompaction()`` checkpoints and compacts now.

Accepted and ignored, with a warning when set to anything but PySyncObj's default
(``config.IGNORED`` says why for each): ``appendEntriesPeriod``, ``connectionTimeout``,
``connectionRetryTime``, ``leaderFallbackTimeout``, ``appendEntriesUseBatch``,
``appendEntriesBatchSizeBytes``, ``preferredAddrType``, ``sendBufferSize``,
``recvBufferSize``, ``dnsCacheTime``, ``dnsFailCacheTime``, ``logCompactionSplit``,
``logCompactionBatchSize``, ``pollerType``, ``useFork``, ``tcp_keepalive``.

Refused with ``ValueError`` when set: ``serializer``, ``deserializer``,
``serializeChecker`` (they replace the snapshot with the program's own pickling; raftkv
snapshots the objects' attributes as msgpack, and ignoring them could lose state).
``SyncObj(transport=..., transportClass=...)`` and a ``nodeClass`` that is not a
``TCPNode`` are refused too. An option name PySyncObj does not know is logged as a
warning.

``syncobj_admin`` is ``raftkv admin`` (PySyncObj's arguments work: ``raftkv admin -conn
HOST:PORT -pass PW -status``) or ``python -m raftkv.compat.pysyncobj.syncobj_admin``, and
``TcpUtility`` is ``.utility.TcpUtility``: the same commands (``status``, ``add``,
``remove``, ``set_version``, ``transfer``) and answers, over the node's own
authenticated port, never pickled (``.admin`` says what a node answers, ``raftkv.admin``
how). The tool exits 1 when a command fails; PySyncObj's exits 0 whatever happened.

Not provided: ``createJournal`` and PySyncObj's journal and dump formats (pickle),
``HAS_CRYPTO``; mixed clusters of PySyncObj and raftkv nodes (the wire protocols differ).
"""

from raftkv.compat.pysyncobj.config import FAIL_REASON, SERIALIZER_STATE, SyncObjConf
from raftkv.compat.pysyncobj.node import Node, TCPNode
from raftkv.compat.pysyncobj.syncobj import (
    _COMMAND_TYPE,
    _RAFT_STATE,
    VERSION,
    SyncObj,
    SyncObjConsumer,
    SyncObjException,
    SyncObjExceptionWrongVer,
    replicated,
    replicated_sync,
)

__all__ = [
    "FAIL_REASON",
    "SERIALIZER_STATE",
    "VERSION",
    "_COMMAND_TYPE",
    "_RAFT_STATE",
    "Node",
    "SyncObj",
    "SyncObjConf",
    "SyncObjConsumer",
    "SyncObjException",
    "SyncObjExceptionWrongVer",
    "TCPNode",
    "replicated",
    "replicated_sync",
]
