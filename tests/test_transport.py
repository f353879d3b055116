"""The transport's pieces: framing limits, the HMAC handshake, strict decoding of peer
records, and two real transports on one PySyncObj poller."""

from __future__ import annotations

import socket
import time
from collections import Counter
from typing import Any

import msgpack
import pytest
from pysyncobj.poller import createPoller
from raftkv.storage.records import ConfState, Entry, Snapshot, SnapshotMeta

from raftkv.core import Message, MessageType
from raftkv.log_limits import BURST
from raftkv.node.stores import founding_cluster_id
from raftkv.transport import codec
from raftkv.transport import handshake as hs
from raftkv.transport.frames import HEADER, FrameDecoder, FrameError, encode_frame
from raftkv.transport.tcp import Transport


def test_frames_decode_across_arbitrary_splits() -> None:
    data = encode_frame([1, b"x"]) + encode_frame({"a": 2}) + encode_frame("z" * 1000)
    dec = FrameDecoder()
    out: list[object] = []
    for i in range(len(data)):
        out += dec.feed(data[i:i + 1])
    assert out == [[1, b"x"], {"a": 2}, "z" * 1000]
    assert dec.buffered == 0


@pytest.mark.parametrize("bad", [
    HEADER.pack(1 << 30, 1),          # over the size cap: refused before buffering
    HEADER.pack(5, 7) + b"abcd",      # unknown version
    HEADER.pack(0, 1),                # empty frame
    HEADER.pack(3, 1) + b"\xc1\xc1",  # msgpack's never-used byte
])
def test_bad_frames_are_refused(bad: bytes) -> None:
    with pytest.raises(FrameError):
        FrameDecoder(max_frame=1 << 20).feed(bad)


def test_handshake_accepts_the_secret_and_refuses_anything_else() -> None:
    nonce_a, nonce_d = hs.new_nonce(), hs.new_nonce()
    hello = hs.hello(b"s", nonce_a, nonce_d, "n2", "127.0.0.1:7002")
    assert hs.parse_hello(hello[:10], b"s", nonce_a) is None  # incomplete: wait for more
    assert hs.parse_hello(hello, b"s", nonce_a) == ("n2", "127.0.0.1:7002", b"", nonce_d,
                                                    len(hello))
    named = hs.hello(b"s", nonce_a, nonce_d, "n2", "127.0.0.1:7002", b"\x07" * 16)
    assert hs.parse_hello(named, b"s", nonce_a)[2] == b"\x07" * 16  # type: ignore[index]
    with pytest.raises(hs.HandshakeError, match="secret"):
        hs.parse_hello(hello, b"wrong", nonce_a)
    with pytest.raises(hs.HandshakeError, match="secret"):  # a replayed hello, new challenge
        hs.parse_hello(hello, b"s", hs.new_nonce())
    with pytest.raises(hs.HandshakeError, match="magic"):
        hs.parse_hello(b"GET / HTTP/1.1\r\n" + bytes(100), b"s", nonce_a)
    welcome = hs.welcome(b"s", nonce_a, nonce_d, "n1", b"c")
    assert hs.parse_welcome(welcome, b"s", nonce_a, nonce_d) == ("n1", b"c", len(welcome))
    with pytest.raises(hs.HandshakeError, match="names no cluster"):  # the version before
        hs.parse_hello(hs.UNNAMED_MAGIC + bytes(200), b"s", nonce_a)
    with pytest.raises(hs.HandshakeError):
        hs.parse_welcome(welcome, b"other", nonce_a, nonce_d)


def test_raft_messages_round_trip_through_the_codec() -> None:
    snap = Snapshot(SnapshotMeta(7, 2, ConfState(frozenset({"a", "b"}), frozenset({"c"}),
                                                 frozenset({"c"}))), b"img")
    m = Message(MessageType.APP, "b", "a", 3, log_term=2, index=5,
                entries=[Entry(3, 6, 0, b"x"), Entry(3, 7, 1, b"y")], commit=4,
                snapshot=snap, context="ctx")
    item = msgpack.unpackb(msgpack.packb(codec.encode_message("g1", m), use_bin_type=True),
                           raw=False)
    group, back = codec.decode_message(item)
    assert group == "g1"
    assert (back.type, back.to, back.frm, back.term, back.index, back.commit) == (
        MessageType.APP, "b", "a", 3, 5, 4)
    assert list(back.entries) == [Entry(3, 6, 0, b"x"), Entry(3, 7, 1, b"y")]
    assert back.snapshot == snap and back.context == "ctx"


def _item(**change: Any) -> list[Any]:
    m = Message(MessageType.APP, "b", "a", 3, entries=[Entry(3, 1, 0, b"x")])
    item = codec.encode_message("g", m)
    fields = ["kind", "group", "type", "to", "frm", "term", "log_term", "index", "entries",
              "commit", "reject", "reject_hint", "snapshot", "context"]
    for k, v in change.items():
        item[fields.index(k)] = v
    return item


@pytest.mark.parametrize("change", [
    {"type": 99}, {"type": "APP"}, {"term": -1}, {"term": "3"}, {"to": ""}, {"frm": 5},
    {"entries": [[3, 1, 0, "not bytes"]]}, {"entries": [[3, 0, 0, b"x"]]}, {"entries": "x"},
    {"reject": 1}, {"snapshot": [1, 1, [], [], [], "str"]}, {"context": [1, 2]},
    {"group": None},
])
def test_malformed_peer_records_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(codec.WireError):
        codec.decode_message(_item(**change))


def _pair(secret_b: bytes = b"s") -> tuple[Any, Transport, Transport, list[Any]]:
    poller = createPoller("auto")
    got: list[Any] = []
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addrs = {"a": f"127.0.0.1:{ports[0]}", "b": f"127.0.0.1:{ports[1]}"}
    a = Transport("a", addrs["a"], b"s", poller, lambda p, items: got.append((p, items)),
                  addresses=addrs)
    b = Transport("b", addrs["b"], secret_b, poller,
                  lambda p, items: got.append((p, items)), addresses=addrs)
    a.start()
    b.start()
    return poller, a, b, got


def _spin(poller: Any, transports: list[Transport], until: Any, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        for t in transports:
            t.flush()
            t.maintain()
        poller.poll(0.01)


def test_two_transports_share_one_connection_in_both_directions() -> None:
    poller, a, b, got = _pair()
    try:
        # Both send at once: both dial; they settle on the connection the smaller id dialed.
        a.send("b", [0, "x"])
        b.send("a", [0, "y"])
        _spin(poller, [a, b], lambda: a.connected_peers() == ["b"] and
              b.connected_peers() == ["a"])
        # Messages sent while the duplicate is being closed may be lost (Raft resends), so
        # keep sending until both directions got through, then check the survivor.
        def through() -> bool:
            a.send("b", [0, "hello"])
            b.send("a", [0, "back"])
            return ("a", [[0, "hello"]]) in got and ("b", [[0, "back"]]) in got

        _spin(poller, [a, b], through)
        assert through()
        for t, peer in ((a, "b"), (b, "a")):
            conn = t.peers[peer].conn
            assert conn is not None and conn.dialer_id == "a"  # the smaller id's dial won
    finally:
        a.close()
        b.close()


def test_what_went_out_on_a_duplicate_connection_is_delivered() -> None:
    """Both dial at once, and each sends on whichever connection it holds from the moment
    it holds one. The connection they do not keep is retired, not closed: what went out
    on it is still read, so every item not dropped for want of a connection arrives,
    in order per connection. (Closing it at once lost a vote request or its answer now
    and then, and a whole-cluster restart then waited out an election timeout.)"""
    for _ in range(5):
        poller, a, b, got = _pair()
        try:
            a.send("b", [0, 0])
            b.send("a", [0, 0])
            for t in (a, b):
                t.flush()
            base = {t.node_id: t.stats["dropped"] for t in (a, b)}
            sent: dict[str, list[int]] = {"a": [], "b": []}
            retired = False
            deadline = time.monotonic() + 5
            for step in range(1, 400):
                for t, peer in ((a, "b"), (b, "a")):
                    if t.peers[peer].conn is not None:
                        t.send(peer, [0, step])
                        sent[t.node_id].append(step)
                    t.flush()
                    t.maintain()
                retired = retired or bool(a.draining or b.draining)
                poller.poll(0.001)
                if step > 50 and not (a.draining or b.draining) or time.monotonic() > deadline:
                    break
            for _ in range(50):
                poller.poll(0.01)
            assert retired, "the duplicate connection was never retired"
            for t, peer in ((a, "b"), (b, "a")):
                dropped = t.stats["dropped"] - base[t.node_id]
                arrived = [n for frm, items in got if frm == t.node_id
                           for _, n in items if n]
                assert sorted(arrived) == sorted(set(arrived))
                assert len(arrived) == len(sent[t.node_id]) - dropped, (t.node_id, dropped)
        finally:
            a.close()
            b.close()


def test_a_peer_with_the_wrong_secret_never_gets_a_frame_decoded() -> None:
    poller, a, b, got = _pair(secret_b=b"not-the-secret")
    try:
        for _ in range(20):
            a.send("b", [0, "x"])
            b.send("a", [0, "y"])
            _spin(poller, [a, b], lambda: False, 0.05)
        assert got == []
        assert a.connected_peers() == [] and b.connected_peers() == []
        assert a.stats["rejected"] + b.stats["rejected"] > 0
    finally:
        a.close()
        b.close()


def test_a_peer_that_keeps_failing_the_handshake_is_warned_about_once_in_a_while(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found from outside: a node with the wrong secret redials many times a second, and
    each peer logged every refusal as a WARNING (about 20 a second). At most
    ``BURST`` WARNINGs per source and reason per ``EVERY`` seconds
    (``raftkv.log_limits``); the rest
    are DEBUG."""
    poller, a, b, _ = _pair(secret_b=b"not-the-secret")
    caplog.set_level("DEBUG", logger="raftkv.transport.tcp")
    try:
        for _ in range(40):
            a.send("b", [0, "x"])
            b.send("a", [0, "y"])
            _spin(poller, [a, b], lambda: False, 0.05)
        closed = [r for r in caplog.records if "closed" in r.getMessage()]
        warned = [r for r in closed if r.levelname == "WARNING"]
        assert len(closed) > len(warned) > 0, [r.getMessage() for r in closed]
        # Each transport shows at most BURST of a reason in the window.
        kinds = Counter(r.getMessage().split(" closed: ")[1].split(" (")[0] for r in warned)
        assert all(n <= 2 * BURST for n in kinds.values()), kinds
    finally:
        a.close()
        b.close()


def test_the_fault_switch_is_off_unless_enabled() -> None:
    _, a, b, _ = _pair()
    try:
        with pytest.raises(PermissionError):
            a.block({"b"})
    finally:
        a.close()
        b.close()


def test_a_first_frame_that_arrives_with_the_welcome_is_not_taken_for_a_long_handshake() -> None:
    """The acceptor may send its first frame in the same turn it welcomes the dialer;
    the dialer reads both at once and must not mistake them for an oversized handshake."""
    poller, a, b, got = _pair()
    try:
        big = [0, "x" * 4096]

        def both_ways() -> bool:
            a.send("b", [0, "hi"])
            if b.connected_peers():
                b.send("a", big)
            return ("b", [big]) in got or any(p == "b" for p, _ in got)

        _spin(poller, [a, b], both_ways)
        assert any(p == "b" for p, _ in got)
        assert a.stats["rejected"] == 0 and b.stats["rejected"] == 0
    finally:
        a.close()
        b.close()


def test_a_peer_of_another_cluster_is_refused_and_a_joining_node_adopts_it() -> None:
    """Cluster ids (raftkv.transport.handshake): found from outside, a node started on
    its data directory from before a ``snapshot restore`` (same id, address and secret)
    was taken back into the restored cluster, served the old data and lost acknowledged
    writes. Two transports naming different clusters never connect, and each says why;
    one that joins adopts its peer's, and keeps it (the callback)."""
    poller, a, b, got = _pair()
    try:
        a.cluster_id, b.cluster_id = b"\x01" * 16, b"\x02" * 16
        rejected = a.stats["rejected"] + b.stats["rejected"]
        _spin(poller, [a, b], lambda: a.send("b", [0, "x"]) is None and
              a.stats["rejected"] + b.stats["rejected"] > rejected)
        _spin(poller, [a, b], lambda: False, seconds=0.3)
        assert a.connected_peers() == [] and b.connected_peers() == [] and not got
    finally:
        a.close()
        b.close()
    poller, a, b, got = _pair()
    kept: list[bytes] = []
    try:
        a.cluster_id, b.cluster_id = b"\x01" * 16, hs.JOINING
        b.on_cluster_id = kept.append
        _spin(poller, [a, b], lambda: a.send("b", [0, "x"]) is None and bool(got))
        assert got and b.cluster_id == a.cluster_id and kept == [a.cluster_id]
    finally:
        a.close()
        b.close()


def test_the_cluster_check() -> None:
    """Same cluster, or a joining peer: taken. A named cluster and one without an id
    refuse each other (the files of an old cluster, from before a restore or before
    ids, name none), and the message names both."""
    t = Transport("a", "127.0.0.1:1", b"s", createPoller("auto"), lambda p, items: None)
    t.cluster_id = b"\x01"
    t.admit_cluster("b", b"\x01")
    t.admit_cluster("b", hs.JOINING)
    for other, name in ((b"\x02", "id 02"), (b"", "no id")):
        with pytest.raises(hs.HandshakeError, match=f"b belongs to another cluster .{name}. "
                                                    "than this node .id 01.: a data "
                                                    "directory from before a snapshot "
                                                    "restore"):
            t.admit_cluster("b", other)
    t.cluster_id = b""  # a cluster without an id: takes its own kind and joiners
    t.admit_cluster("b", b"")
    t.admit_cluster("b", hs.JOINING)
    with pytest.raises(hs.HandshakeError, match="id 02"):
        t.admit_cluster("b", b"\x02")
    t.cluster_id = hs.JOINING  # adopts the first id, and then is of it
    t.admit_cluster("b", b"")
    assert t.cluster_id == hs.JOINING
    t.admit_cluster("b", b"\x03")
    assert t.cluster_id == b"\x03"


def test_founders_derive_one_cluster_id_from_their_token() -> None:
    """Only from the token (etcd's --initial-cluster-token): founders that spell one
    another's addresses differently, or a wiped founder with a later membership in its
    --peers, derive the same id (found in review: deriving it from --peers split them).
    Without a token there is no id."""
    assert founding_cluster_id("t") == founding_cluster_id("t") != founding_cluster_id("u")
    assert founding_cluster_id("") == b""
