"""Backup and restore of the default KV group and of tables (``raftkv snapshot``).

A *backup file* is one consistent image of the group's state store at index I, with the
membership in effect there, framed so that a damaged or truncated file is recognised::

    b"RAFTKV-SNAPSHOT 1\\n"
    frame*: 4-byte big-endian length, then that many bytes
      frame 0      msgpack {"group", "index", "term", "voters", "learners", "node", "created"}
                   (a table partition's also "table_generation": below)
      frames 1..n  the state store's snapshot chunks, verbatim (header, rows, trailer:
                   ``raftkv.storage.state_store``; the trailer carries the rows' digest)
      0xFFFFFFFF   (a length no frame has: the end follows)
      end frame    msgpack {"end": n, "blake2b": hex of every frame before it}

``save`` writes one from a running node (``GET /v1/snapshot``): the node takes the image
after a ReadIndex round, so it holds every write acknowledged before the request, and
streams it from one LMDB read transaction (writes go on meanwhile).

``verify`` checks a file completely: magic, frame sizes, the checksum, and every row
through the snapshot loader (order, sizes, revisions, digest). ``restore`` runs it first
and writes nothing unless the whole file checks out. Then, in the manner of ``etcdutl
snapshot restore``, it makes the data directory of every member of a *new* cluster, in
one run: each gets the image as its state store (applied and checkpoint index I) and a
Raft log that starts at a snapshot record at I whose configuration is exactly the new
members, each recorded as the incarnation of its new files (so their votes count at once:
"Incarnations" in ``raftkv.core.raft``), and commit index I. Started with ``raftkv serve``
and the same members as ``--peers``, they elect a leader and serve the restored keys, with
their revisions; the metastore and tables start empty. The old cluster's membership, log
and vote are not carried over: it is a new cluster with the old data.

**Tables.** A *table backup* is a directory: one backup file per partition
(``p0000.snap``, ...: the same format, of that partition's group, streamed by its leader
from ``GET /v1/tables/{t}/partitions/{p}/snapshot``) and ``manifest.json``, written last,
naming the table, its partition count, replicas and storage, and each file's index, row
count and digest. A directory without a manifest is an interrupted save. Each partition
is its own Raft group with its own revisions, so each file is consistent at its own
index; the partitions are not one cut across the table (as with Kudu's or Cassandra's
per-tablet backups). They are all of one table, though: each file's header carries the
generation of the table its image came from (the create revision of its descriptor, read
with the image), and the save fails if any differs from the generation ``describe``
gave when it began, since a table dropped and created again under the same name meanwhile
would otherwise leave a backup that mixes two tables and verifies. ``verify_table`` checks the manifest and every file in full.
``restore_table`` loads a backup into a *new* table of the same partition count on a
running cluster, in per-partition batches with ids (as the Spark loader does, so a batch
retried after a lost answer applies once), then compares each partition's digest, read
after a ReadIndex round on its leader, with the backup's. An interrupted restore leaves a
partly loaded table: drop it and run the restore again. The
rows get the new table's revisions: a table's revisions are its partitions' log indexes,
which a restore into a running cluster cannot keep.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from hashlib import blake2b
from typing import IO, TYPE_CHECKING, Any

import msgpack

from raftkv.core.raft import BOOTSTRAP_TERM
from raftkv.placement.catalog import MAX_PARTITIONS, STORAGE_KINDS, partition_group
from raftkv.storage.commands import MAX_BATCH_OPS, MAX_COMMAND_BYTES, user_key
from raftkv.storage.digest import DigestBuilder
from raftkv.storage.errors import StorageError
from raftkv.storage.layout import DEFAULT_GROUP
from raftkv.storage.lmdb_log import LmdbLogStore
from raftkv.storage.lmdb_state import LmdbStateStore
from raftkv.storage.records import ConfState, HardState, Snapshot, SnapshotMeta
from raftkv.storage.revisions import value_of
from raftkv.storage.state_store import KV_ROWS, MAX_SNAPSHOT_CHUNK_BYTES, SnapshotLoader

if TYPE_CHECKING:
    from raftkv.client import Client

MAGIC = b"RAFTKV-SNAPSHOT 1\n"
MANIFEST = "manifest.json"
_TABLE_FORMAT = 1
_LEN = struct.Struct(">I")
_MAX_HEADER = 1 << 20
_END = 0xFFFFFFFF


class BackupError(Exception):
    """A backup file that is not one, or damaged; a restore that cannot be done."""


@dataclass(frozen=True)
class BackupInfo:
    group: str
    index: int
    term: int
    voters: list[str]
    learners: list[str]
    node: str
    created: float
    count: int = 0
    digest: str = ""
    table_generation: int | None = None


def frames(info: dict[str, Any], chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The bytes of a backup file: magic, framed header and chunks, checksummed end."""
    h = blake2b(digest_size=16)
    yield MAGIC
    n = 0
    for body in itertools.chain((msgpack.packb(info, use_bin_type=True),), chunks):
        frame = _LEN.pack(len(body)) + body
        h.update(frame)
        n += 1
        yield frame
    end = msgpack.packb({"end": n - 1, "blake2b": h.hexdigest()})
    yield _LEN.pack(_END) + _LEN.pack(len(end)) + end


def _read_frames(f: IO[bytes]) -> Iterator[bytes]:
    """The frame bodies of a backup file; the end frame is checked and not yielded."""
    head = f.read(len(MAGIC))
    if head != MAGIC:
        if MAGIC.startswith(head):
            raise BackupError("the backup file is truncated (it ends inside its magic)")
        raise BackupError("not a raftkv backup file (wrong magic): made by "
                          "`raftkv snapshot save`?")
    h = blake2b(digest_size=16)
    n = 0
    while True:
        raw = f.read(_LEN.size)
        if len(raw) != _LEN.size:
            raise BackupError(f"the backup file is truncated after {n} frames (no end frame)")
        (size,) = _LEN.unpack(raw)
        if size == _END:
            _check_end(f, n, h.hexdigest())
            return
        if size > MAX_SNAPSHOT_CHUNK_BYTES:
            raise BackupError(f"frame {n} claims {size} bytes: the file is damaged")
        body = f.read(size)
        if len(body) != size:
            raise BackupError(f"the backup file is truncated in frame {n}")
        h.update(raw + body)
        n += 1
        yield body


def _check_end(f: IO[bytes], n: int, digest: str) -> None:
    raw = f.read(_LEN.size)
    size = _LEN.unpack(raw)[0] if len(raw) == _LEN.size else None
    body = f.read(size) if size is not None and size < 4096 else b""
    try:
        doc = msgpack.unpackb(body)
    except (ValueError, msgpack.UnpackException):
        doc = None
    if not isinstance(doc, dict) or doc.get("end") != n - 1 or doc.get("blake2b") != digest:
        raise BackupError("the backup file's end frame or checksum does not match: it is "
                          "damaged")
    if f.read(1):
        raise BackupError("the backup file has data after its end frame")


def _header(body: bytes) -> BackupInfo:
    try:
        doc = msgpack.unpackb(body, max_str_len=_MAX_HEADER)
        if not isinstance(doc, dict):
            raise TypeError(f"a {type(doc).__name__}, not a map")
        generation = doc.get("table_generation")
        return BackupInfo(str(doc["group"]), int(doc["index"]), int(doc["term"]),
                          [str(v) for v in doc["voters"]], [str(v) for v in doc["learners"]],
                          str(doc["node"]), float(doc["created"]),
                          table_generation=None if generation is None else int(generation))
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
        raise BackupError(f"the backup file's header is malformed: {e}") from None


def _chunks(path: str) -> tuple[BackupInfo, Iterator[bytes], IO[bytes]]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as e:
        raise BackupError(f"cannot read {path}: {e.strerror}") from None
    it = _read_frames(f)
    try:
        first = next(it, None)
        if first is None:
            raise BackupError("the backup file holds no header")
        return _header(first), it, f
    except BaseException:
        f.close()
        raise


def verify(path: str) -> BackupInfo:
    """Check the whole file (module docstring): its framing and checksum first, then its
    image; its ``BackupInfo`` with the row count and digest, or ``BackupError`` saying
    what is wrong."""
    _, it, f = _chunks(path)
    with f:
        for _ in it:
            pass
    info, it, f = _chunks(path)
    with f:
        try:
            loader = SnapshotLoader(it)
            for _ in loader.rows():
                pass
        except StorageError as e:
            raise BackupError(f"the backup's image is invalid: {e}") from None
        if loader.applied != info.index:
            raise BackupError(f"the image is at index {loader.applied}, the header says "
                              f"{info.index}")
    assert loader.received is not None  # set once verified
    return BackupInfo(**{**info.__dict__, "count": loader.received.count,
                         "digest": loader.received.digest})


def restore(path: str, members: dict[str, str], data_dirs: list[str]) -> BackupInfo:
    """Make a new cluster's data directories from a backup (module docstring).
    ``members``: node id -> raft address, in the order of ``data_dirs``. Every directory
    must be new or empty; nothing is written unless the file verifies."""
    from raftkv.node.stores import claim_data_dir, new_cluster_id, open_group_storage
    from raftkv.storage.dir_lock import release_data_dir

    if not members or len(members) != len(data_dirs):
        raise BackupError("give one --data-dir per member, in the order of --members")
    if len({os.path.realpath(d) for d in data_dirs}) != len(data_dirs):
        raise BackupError("the same data directory is given twice")
    for d in data_dirs:
        if os.path.exists(d) and (not os.path.isdir(d) or os.listdir(d)):
            raise BackupError(f"{d} is not an empty directory: restore makes new ones")
    info = verify(path)
    opened = []
    # A cluster of its own: a node started on its files from before the restore (same
    # ids, addresses and secret) is refused by the restored members, not taken back
    # (raftkv.node.stores, "Cluster ids").
    cluster_id = new_cluster_id()
    try:
        for node_id, d in zip(members, data_dirs, strict=True):
            claim_data_dir(d, node_id, cluster_id)
            opened.append((node_id, open_group_storage(d, DEFAULT_GROUP)))
        records = frozenset((n, s.log.identity().incarnation) for n, s in opened)
        conf = ConfState(voters=frozenset(members), incarnations=records)
        for _, s in opened:
            _, it, f = _chunks(path)
            with f:
                s.state.install_snapshot(it)
            meta = SnapshotMeta(info.index, BOOTSTRAP_TERM, conf)
            s.log.save(HardState(term=BOOTSTRAP_TERM, vote=None, commit=info.index), [],
                       Snapshot(meta, b""))
            state = s.state
            assert isinstance(state, LmdbStateStore)  # open_group_storage's, on a data dir
            got = state.digest(revisions=True)
            if got.digest != info.digest or got.count != info.count:
                raise BackupError(f"the restored state's digest {got.digest} is not the "
                                  f"backup's {info.digest}")
    except StorageError as e:
        raise BackupError(f"restoring failed: {e} (the directories made are incomplete: "
                          f"delete them)") from None
    finally:
        for _, s in opened:
            log = s.log
            assert isinstance(log, LmdbLogStore)  # open_group_storage's, on a data dir
            log.close()
            s.state.close()
        for d in data_dirs:
            release_data_dir(d)
    return info


def backup_info(node: str, group: str, index: int, term: int, conf: ConfState) -> dict[str, Any]:
    return {"group": group, "index": index, "term": term, "voters": sorted(conf.voters),
            "learners": sorted(conf.learners), "node": node, "created": time.time()}



def _partition_file(p: int) -> str:
    return f"p{p:04d}.snap"


def _empty_dir(d: str) -> None:
    if os.path.exists(d) and (not os.path.isdir(d) or os.listdir(d)):
        raise BackupError(f"{d} is not an empty directory: a table backup makes a new one")


def save_table(client: Client, table: str, directory: str) -> dict[str, Any]:
    """Save every partition of ``table`` into ``directory`` (new or empty), each file
    verified as it lands, and the manifest last (module docstring); the manifest."""
    _empty_dir(directory)
    desc = client.describe_table(table)
    count, generation = len(desc["partitions"]), desc.get("generation")
    os.makedirs(directory, exist_ok=True)
    files = []
    for p in range(count):
        name = _partition_file(p)
        path = os.path.join(directory, name)
        size = client.snapshot_save(path, table=table, partition=p)
        info = verify(path)
        if info.group != partition_group(table, p):
            raise BackupError(f"partition {p}'s backup is of group {info.group}, not "
                              f"{partition_group(table, p)}")
        if info.table_generation != generation:
            raise BackupError(
                f"partition {p} is of table generation {info.table_generation}, the table "
                f"was of generation {generation} when the save began (the table was dropped "
                "and created again during the save, or a node of an older release that "
                f"records none answered); {directory} is not a backup (it has no manifest): "
                "remove it and save again")
        files.append({"partition": p, "file": name, "bytes": size, "index": info.index,
                      "keys": info.count, "revisions_digest": info.digest})
    manifest = {"format": _TABLE_FORMAT, "table": table, "generation": generation,
                "partitions": count,
                "replicas": desc["replicas"], "storage": desc["storage"],
                "created": time.time(), "files": files}
    tmp = os.path.join(directory, MANIFEST + ".part")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the files' and the manifest's names, after their contents
    finally:
        os.close(fd)
    return manifest


def _manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise BackupError(f"{directory} is not a directory")
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise BackupError(f"{directory} has no {MANIFEST}: not a table backup, or its save "
                          "was interrupted") from None
    except (OSError, ValueError) as e:
        raise BackupError(f"{path} is not readable JSON: {e}") from None
    try:
        if doc["format"] != _TABLE_FORMAT:
            raise BackupError(f"{path}: table backup format {doc['format']!r} is not "
                              f"supported (this build reads {_TABLE_FORMAT})")
        count, files, replicas = doc["partitions"], doc["files"], doc["replicas"]
        if (not isinstance(doc["table"], str) or type(count) is not int
                or not 1 <= count <= MAX_PARTITIONS):
            raise BackupError(f"{path} names no table or no partition count "
                              f"(1..{MAX_PARTITIONS})")
        if doc.get("generation") is not None and type(doc["generation"]) is not int:
            raise BackupError(f"{path}: generation must be an integer")
        if type(replicas) is not int or replicas < 1 or doc["storage"] not in STORAGE_KINDS:
            raise BackupError(f"{path}: replicas must be a positive integer and storage one "
                              f"of {', '.join(STORAGE_KINDS)}")
        if (not isinstance(files, list) or len(files) != count
                or [entry["partition"] for entry in files] != list(range(count))
                or any(type(entry["partition"]) is not int for entry in files)):
            raise BackupError(f"{path} does not list one file per partition 0..{count - 1}")
        for entry in files:
            name = _partition_file(entry["partition"])
            if entry["file"] != name:
                raise BackupError(f"{path}: partition {entry['partition']}'s file is "
                                  f"{entry['file']!r}, not {name}")
            if (type(entry["index"]) is not int or type(entry["keys"]) is not int
                    or not isinstance(entry["revisions_digest"], str)):
                raise BackupError(f"{path}: partition {entry['partition']}'s index, keys "
                                  "or digest is malformed")
    except (KeyError, TypeError, ValueError) as err:
        raise BackupError(f"{path} is malformed: {err!r} is missing or wrong") from None
    return dict(doc)


def verify_table(directory: str) -> dict[str, Any]:
    """Check a table backup completely: the manifest, then every partition's file in full
    (``verify``), each against the manifest's group, index, count and digest; the
    manifest, each file's entry with its row count and digest as found."""
    doc = _manifest(directory)
    table = str(doc["table"])
    for e in doc["files"]:
        p = int(e["partition"])
        try:
            info = verify(os.path.join(directory, e["file"]))
        except BackupError as err:
            raise BackupError(f"partition {p} ({e['file']}): {err}") from None
        want = (partition_group(table, p), int(e["index"]), int(e["keys"]),
                str(e["revisions_digest"]))
        got = (info.group, info.index, info.count, info.digest)
        if doc.get("generation") is not None and info.table_generation != doc["generation"]:
            raise BackupError(f"partition {p} ({e['file']}) is of table generation "
                              f"{info.table_generation}, the manifest's is "
                              f"{doc['generation']}: files of two tables")
        if got != want:
            raise BackupError(f"partition {p} ({e['file']}) holds group {got[0]} at index "
                              f"{got[1]} with {got[2]} keys, digest {got[3]}; the manifest "
                              f"says {want[0]}, {want[1]}, {want[2]}, {want[3]}")
    return doc


def _user_rows(path: str) -> Iterator[tuple[bytes, bytes]]:
    """A verified partition file's user rows as (key, value), without revision headers."""
    _, it, f = _chunks(path)
    with f:
        loader = SnapshotLoader(it)
        try:
            loader.expect(KV_ROWS, "a table restore")
        except StorageError as e:
            raise BackupError(f"{path}: {e}") from None
        for k, row in loader.rows():
            if user_key(k):
                yield k, value_of(row)


def restore_table(client: Client, directory: str, table: str,
                  replicas: int | None = None) -> dict[str, Any]:
    """Load a table backup into a new table ``table`` (module docstring): verified first,
    created with the backup's partition count (and its replicas, unless given) and
    storage, loaded in idempotent batches, then checked partition by partition against
    the backup's value digests. ``{"table", "partitions", "keys"}``."""
    doc = verify_table(directory)
    count = int(doc["partitions"])
    client.create_table(table, count, int(doc["replicas"] if replicas is None else replicas),
                        storage=str(doc["storage"]))
    keys = 0
    for e in doc["files"]:
        p = int(e["partition"])
        want = DigestBuilder()
        ops: list[tuple[bytes, bytes | None]] = []
        size = n = 0
        for k, v in _user_rows(os.path.join(directory, e["file"])):
            want.add(k, v)
            if ops and (len(ops) >= MAX_BATCH_OPS or size + len(k) + len(v) + 64
                        > MAX_COMMAND_BYTES // 2):
                client.partition_batch(table, p, ops, batch_id=b"restore/%d/%d" % (p, n))
                ops, size, n = [], 0, n + 1
            ops.append((k, v))
            size += len(k) + len(v) + 64
        if ops:
            client.partition_batch(table, p, ops, batch_id=b"restore/%d/%d" % (p, n))
        expect = want.result()
        got = client.table_partition_digest(table, p)
        if (got["count"], got["digest"]) != (expect.count, expect.digest):
            raise BackupError(f"partition {p} of {table} holds {got['count']} keys, digest "
                              f"{got['digest']}; the backup has {expect.count}, "
                              f"{expect.digest} (was the table written to meanwhile?)")
        keys += expect.count
    return {"table": table, "partitions": count, "keys": keys}
