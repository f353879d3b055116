"""``SyncObjConf``, ``FAIL_REASON`` and ``SERIALIZER_STATE``, as PySyncObj 0.3.x names them.

Every option PySyncObj 0.3.17 knows is accepted by the constructor with PySyncObj's
default, so ``SyncObjConf(**kwargs)`` never fails on a known name. What each option does
under raftkv is decided when a ``SyncObj`` is built from the configuration
(``resolve``), and listed in ``raftkv.compat.pysyncobj``'s module docstring:

- **mapped**: it has an effect, possibly translated (``journalFile`` becomes a data
  directory, ``raftMinTimeout`` a number of ticks);
- **ignored**: raftkv has no such knob. A value other than PySyncObj's default is logged
  as a warning, naming the option and why; the default is silently fine;
- **refused**: honouring it is impossible and ignoring it could lose data
  (``serializer``/``deserializer``/``serializeChecker``): ``ValueError`` at ``SyncObj``
  construction, saying why.

An option name PySyncObj does not know is logged as a warning (PySyncObj drops it
silently, which hides typos).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raftkv.recovery.compaction import CompactionPolicy

log = logging.getLogger("raftkv.compat.pysyncobj")


class FAIL_REASON:
    """Why a replicated call failed; the second argument of every callback."""

    SUCCESS = 0  #: Command successfully applied.
    QUEUE_FULL = 1  #: More than ``commandsQueueSize`` commands in flight on this node.
    MISSING_LEADER = 2  #: No leader known (election in progress, or no connection).
    DISCARDED = 3  #: Another leader's entry took this command's place in the log.
    NOT_LEADER = 4  #: The leader changed before it committed the command.
    LEADER_CHANGED = 5  #: Like NOT_LEADER: leadership moved (a transfer) without a commit.
    REQUEST_DENIED = 6  #: Refused (a membership change in progress, a stopped node, ...).
    UNKNOWN_OUTCOME = 7  #: It may or may not have been applied (a timeout, a snapshot).


class SERIALIZER_STATE:
    NOT_SERIALIZING = 0
    SERIALIZING = 1
    SUCCESS = 2
    FAILED = 3


# Every option of PySyncObj 0.3.17's SyncObjConf, with its default.
DEFAULTS: dict[str, Any] = {
    "password": None,
    "autoTick": True,
    "autoTickPeriod": 0.05,
    "commandsQueueSize": 100000,
    "raftMinTimeout": 0.4,
    "raftMaxTimeout": 1.4,
    "appendEntriesPeriod": 0.1,
    "connectionTimeout": 3.5,
    "connectionRetryTime": 5.0,
    "leaderFallbackTimeout": 30.0,
    "appendEntriesUseBatch": True,
    "appendEntriesBatchSizeBytes": 2**16,
    "bindAddress": None,
    "preferredAddrType": "ipv4",
    "sendBufferSize": 2**16,
    "recvBufferSize": 2**16,
    "dnsCacheTime": 600.0,
    "dnsFailCacheTime": 30.0,
    "logCompactionMinEntries": 5000,
    "logCompactionMinTime": 300,
    "logCompactionSplit": False,
    "logCompactionBatchSize": 2**16,
    "commandsWaitLeader": True,
    "fullDumpFile": None,
    "journalFile": None,
    "bindRetryTime": 1.0,
    "maxBindRetries": 0,
    "onReady": None,
    "onStateChanged": None,
    "dynamicMembershipChange": False,
    "pollerType": "auto",
    "useFork": True,
    "serializer": None,
    "serializeChecker": None,
    "deserializer": None,
    "onCodeVersionChanged": None,
    "tcp_keepalive": (16, 3, 5),
}

# Options raftkv has no knob for: name -> why a non-default value has no effect.
IGNORED: dict[str, str] = {
    "appendEntriesPeriod": "raftkv heartbeats every 2 ticks of 50 ms (0.1 s)",
    "connectionTimeout": "a peer counts as down when its connection drops or it is silent "
    "for one election timeout",
    "connectionRetryTime": "raftkv redials with exponential back-off from 0.05 s to 2 s",
    "leaderFallbackTimeout": "a leader steps down when it has not heard from a majority "
    "within one election timeout (check-quorum)",
    "appendEntriesUseBatch": "raftkv always batches: one log append, one fsync and one "
    "frame per peer per loop turn",
    "appendEntriesBatchSizeBytes": "raftkv bounds appends by its own message and byte limits",
    "preferredAddrType": "addresses are used as given; an IPv6 literal selects IPv6",
    "sendBufferSize": "raftkv sizes socket buffers at 1 MiB",
    "recvBufferSize": "raftkv sizes socket buffers at 1 MiB",
    "dnsCacheTime": "host names are resolved by the OS resolver at each dial",
    "dnsFailCacheTime": "host names are resolved by the OS resolver at each dial",
    "logCompactionSplit": "a checkpoint is a snapshot of the state machine written to a "
    "file; it does not stop the cluster, so there is nothing to stagger",
    "logCompactionBatchSize": "snapshots travel in raftkv's own chunks",
    "pollerType": "raftkv's driver picks the best poller itself",
    "useFork": "raftkv never forks: checkpoints are written by the node's own threads",
    "tcp_keepalive": "raftkv sets its own TCP keepalive and pings peers every heartbeat",
}

REFUSED: dict[str, str] = {
    "serializer": "a custom serializer receives PySyncObj's internal state to pickle; "
    "raftkv snapshots every attribute of the SyncObj and its consumers as msgpack "
    "(override nothing: keep state in attributes of plain data)",
    "deserializer": "see serializer",
    "serializeChecker": "see serializer",
}

MAPPED = frozenset(DEFAULTS) - frozenset(IGNORED) - frozenset(REFUSED)

TICK_SECONDS = 0.05  # the raftkv driver's tick: heartbeats every 2, elections after 8+
DATA_DIR_SUFFIX = ".raftkv"
# The secret used when no password is given: public, so it authenticates nothing.
DEV_SECRET = b"raftkv.compat.pysyncobj: no password was set, this cluster is unauthenticated"


class SyncObjConf:
    """PySyncObj's configuration object: every option, with PySyncObj's default."""

    def __init__(self, **kwargs: Any) -> None:
        d = DEFAULTS
        self.password: str | bytes | None = kwargs.get("password", d["password"])
        self.autoTick: bool = kwargs.get("autoTick", d["autoTick"])
        self.autoTickPeriod: float = kwargs.get("autoTickPeriod", d["autoTickPeriod"])
        self.commandsQueueSize: int = kwargs.get("commandsQueueSize", d["commandsQueueSize"])
        self.raftMinTimeout: float = kwargs.get("raftMinTimeout", d["raftMinTimeout"])
        self.raftMaxTimeout: float = kwargs.get("raftMaxTimeout", d["raftMaxTimeout"])
        self.appendEntriesPeriod: float = kwargs.get("appendEntriesPeriod", d["appendEntriesPeriod"])
        self.connectionTimeout: float = kwargs.get("connectionTimeout", d["connectionTimeout"])
        self.connectionRetryTime: float = kwargs.get("connectionRetryTime", d["connectionRetryTime"])
        self.leaderFallbackTimeout: float = kwargs.get("leaderFallbackTimeout", d["leaderFallbackTimeout"])
        self.appendEntriesUseBatch: bool = kwargs.get("appendEntriesUseBatch", d["appendEntriesUseBatch"])
        self.appendEntriesBatchSizeBytes: int = kwargs.get("appendEntriesBatchSizeBytes", d["appendEntriesBatchSizeBytes"])
        self.bindAddress: str | None = kwargs.get("bindAddress", d["bindAddress"])
        self.preferredAddrType: str | None = kwargs.get("preferredAddrType", d["preferredAddrType"])
        self.sendBufferSize: int = kwargs.get("sendBufferSize", d["sendBufferSize"])
        self.recvBufferSize: int = kwargs.get("recvBufferSize", d["recvBufferSize"])
        self.dnsCacheTime: float = kwargs.get("dnsCacheTime", d["dnsCacheTime"])
        self.dnsFailCacheTime: float = kwargs.get("dnsFailCacheTime", d["dnsFailCacheTime"])
        self.logCompactionMinEntries: int = kwargs.get("logCompactionMinEntries", d["logCompactionMinEntries"])
        self.logCompactionMinTime: float = kwargs.get("logCompactionMinTime", d["logCompactionMinTime"])
        self.logCompactionSplit: bool = kwargs.get("logCompactionSplit", d["logCompactionSplit"])
        self.logCompactionBatchSize: int = kwargs.get("logCompactionBatchSize", d["logCompactionBatchSize"])
        self.commandsWaitLeader: bool = kwargs.get("commandsWaitLeader", d["commandsWaitLeader"])
        self.fullDumpFile: str | None = kwargs.get("fullDumpFile", d["fullDumpFile"])
        self.journalFile: str | None = kwargs.get("journalFile", d["journalFile"])
        self.bindRetryTime: float = kwargs.get("bindRetryTime", d["bindRetryTime"])
        self.maxBindRetries: int = kwargs.get("maxBindRetries", d["maxBindRetries"])
        self.onReady: Callable[[], Any] | None = kwargs.get("onReady", d["onReady"])
        self.onStateChanged: Callable[[int, int], Any] | None = kwargs.get("onStateChanged", d["onStateChanged"])
        self.dynamicMembershipChange: bool = kwargs.get("dynamicMembershipChange", d["dynamicMembershipChange"])
        self.pollerType: str = kwargs.get("pollerType", d["pollerType"])
        self.useFork: bool = kwargs.get("useFork", d["useFork"])
        self.serializer: Any = kwargs.get("serializer", d["serializer"])
        self.serializeChecker: Any = kwargs.get("serializeChecker", d["serializeChecker"])
        self.deserializer: Any = kwargs.get("deserializer", d["deserializer"])
        self.onCodeVersionChanged: Callable[[int, int], Any] | None = kwargs.get("onCodeVersionChanged", d["onCodeVersionChanged"])
        self.tcp_keepalive: tuple[int, int, int] | None = kwargs.get("tcp_keepalive", d["tcp_keepalive"])
        for name in sorted(set(kwargs) - set(DEFAULTS)):
            log.warning("SyncObjConf: unknown option %r ignored (PySyncObj 0.3.x has no such "
                        "option)", name)

    def validate(self) -> None:
        """PySyncObj's own checks, as ``ValueError`` naming the option (PySyncObj asserts)."""
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"SyncObjConf: {what}")

        g = self.__dict__
        # The numbers first, by type: a str compared below raised a bare TypeError that
        # named no option (found from outside: raftMinTimeout='abc').
        for name in ("autoTickPeriod", "commandsQueueSize", "raftMinTimeout",
                     "raftMaxTimeout", "appendEntriesPeriod", "logCompactionMinEntries",
                     "logCompactionMinTime", "bindRetryTime", "maxBindRetries"):
            v = g[name]
            check(isinstance(v, int | float) and not isinstance(v, bool),
                  f"{name} must be a number, not {type(v).__name__}")
            check(math.isfinite(v), f"{name} must be finite, not {v!r}")
        check(g["autoTickPeriod"] > 0, "autoTickPeriod must be > 0")
        check(g["commandsQueueSize"] >= 0, "commandsQueueSize must be >= 0")
        check(g["raftMinTimeout"] > g["appendEntriesPeriod"] * 3,
              "raftMinTimeout must be > 3 * appendEntriesPeriod")
        check(g["raftMaxTimeout"] > g["raftMinTimeout"], "raftMaxTimeout must be > raftMinTimeout")
        check(g["appendEntriesPeriod"] > 0, "appendEntriesPeriod must be > 0")
        check(g["logCompactionMinEntries"] >= 2, "logCompactionMinEntries must be >= 2")
        check(g["logCompactionMinTime"] > 0, "logCompactionMinTime must be > 0")
        check(g["bindRetryTime"] > 0, "bindRetryTime must be > 0")
        check(g["maxBindRetries"] >= 0, "maxBindRetries must be >= 0")
        check((g["serializer"] is None) == (g["deserializer"] is None),
              "serializer and deserializer go together")


@dataclass(frozen=True)
class Resolved:
    """What a ``SyncObjConf`` means for a raftkv node (see the module docstring)."""

    secret: bytes
    data_dir: str | None
    election_tick: int
    checkpoint_entries: int | None
    checkpoint_seconds: float | None
    # The log's compaction when either option above was set: at PySyncObj's entry
    # threshold, keeping half of it (at most raftkv's usual 1,000) for followers a little
    # behind. None: raftkv's own policy (100,000 entries).
    compaction: CompactionPolicy | None = None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        return math.isclose(a, b)
    return bool(a == b)


def resolve(conf: SyncObjConf) -> Resolved:
    """Check ``conf`` and translate it (module docstring); warns about ignored options,
    ``ValueError`` for refused ones."""
    values = vars(conf)
    # Refused options first: PySyncObj's own checks would otherwise speak of them as if
    # they could work ("serializer and deserializer go together", found from outside).
    for name, why in REFUSED.items():
        if values.get(name) is not None:
            raise ValueError(f"SyncObjConf option {name!r} is not supported by "
                             f"raftkv.compat.pysyncobj: {why}")
    conf.validate()
    for name, why in IGNORED.items():
        if not _same(values.get(name), DEFAULTS[name]):
            log.warning("SyncObjConf option %s=%r is ignored by raftkv.compat.pysyncobj: %s",
                        name, values.get(name), why)
    if conf.password is None:
        log.warning("SyncObjConf has no password, so this cluster is unauthenticated: "
                    "raftkv.compat.pysyncobj uses a fixed, public secret, and ANY process that can reach this node's port can join "
                    "the cluster and write to it. Set password= for a real deployment.")
        secret = DEV_SECRET
    else:
        pw = conf.password
        secret = pw.encode() if isinstance(pw, str) else bytes(pw)
        if not secret:
            raise ValueError("SyncObjConf: password must not be empty")
    journal, dump = conf.journalFile, conf.fullDumpFile
    base = journal if journal is not None else dump
    data_dir = None if base is None else str(base) + DATA_DIR_SUFFIX
    for name, path in (("journalFile", journal), ("fullDumpFile", dump)):
        if path is not None and os.path.isfile(path):
            log.warning("%s %s exists: it is PySyncObj's (pickle) and cannot be read; it is "
                        "left alone, and this node keeps its data in %s/", name, path, data_dir)
    election_tick = max(2, round(conf.raftMinTimeout / TICK_SECONDS))
    lo = election_tick * TICK_SECONDS
    if not (_same(conf.raftMaxTimeout, DEFAULTS["raftMaxTimeout"])
            or _same(conf.raftMaxTimeout, 2 * lo)):
        log.warning("SyncObjConf raftMaxTimeout=%r: raftkv draws election timeouts from "
                    "[raftMinTimeout, 2 * raftMinTimeout), here [%.2f, %.2f) s",
                    conf.raftMaxTimeout, lo, 2 * lo)
    entries = seconds = None
    if not _same(conf.logCompactionMinEntries, DEFAULTS["logCompactionMinEntries"]):
        entries = int(conf.logCompactionMinEntries)
    if not _same(conf.logCompactionMinTime, DEFAULTS["logCompactionMinTime"]):
        seconds = float(conf.logCompactionMinTime)
    compaction = None
    if entries is not None or seconds is not None:
        at = int(conf.logCompactionMinEntries)
        compaction = CompactionPolicy(max_entries=at, keep=min(CompactionPolicy.keep, at // 2))
    return Resolved(secret, data_dir, election_tick, entries, seconds, compaction)
