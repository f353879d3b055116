"""Split messages (``raftkv.transport.frames``, "Split messages"): a message larger than
``max_frame`` goes as parts, each a tagged frame, reassembled up to ``max_message``, in
order with the messages around it; and a 3-node group on real TCP whose follower catches up
by a snapshot image sent in parts."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pysyncobj.poller import createPoller
from raftkv.recovery.compaction import CompactionPolicy
from test_embedded import SECRET, peers
from test_transport import _spin

import raftkv.node.runtime
from raftkv.core import NotLeader
from raftkv.kv import RaftKV
from raftkv.node.errors import RequestTimeout
from raftkv.testing.procs import free_ports
from raftkv.transport.frames import (
    FIRST,
    HEADER,
    MORE,
    TAG,
    TOTAL,
    VERSION,
    FrameDecoder,
    FrameError,
    FrameMac,
    Outgoing,
    encode_frame,
    pack,
)
from raftkv.transport.tcp import Transport

KEY = b"k" * 32
Frames = list[bytes]


def _frames(payload: object, max_frame: int, mac: FrameMac | None) -> list[bytes]:
    out = Outgoing(pack(payload), max_frame)
    frames = []
    while out.left:
        frames.append(out.next_frame(mac))
    return frames


def _feed(dec: FrameDecoder, data: bytes, cuts: list[int]) -> list[object]:
    got: list[object] = []
    pos = 0
    for cut in sorted({c % (len(data) + 1) for c in cuts}) + [len(data)]:
        got += dec.feed(data[pos:cut])
        pos = cut
    return got


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=4),
       max_frame=st.integers(256, 8192), tagged=st.booleans(),
       cuts=st.lists(st.integers(0, 1 << 20), max_size=40))
def test_split_messages_round_trip_through_arbitrary_pieces(
    sizes: list[int], max_frame: int, tagged: bool, cuts: list[int],
) -> None:
    """Whole and split messages in a row, fed in arbitrary pieces, come out byte-exact
    and in order; every frame stays within max_frame; nothing is left buffered."""
    messages = [[i, os.urandom(n)] for i, n in enumerate(sizes)]
    send = FrameMac(KEY) if tagged else None
    frames = [f for m in messages for f in _frames(m, max_frame, send)]
    assert all(len(f) - 4 <= max_frame for f in frames)
    dec = FrameDecoder(max_frame, FrameMac(KEY) if tagged else None)
    assert _feed(dec, b"".join(frames), cuts) == messages
    assert dec.buffered == 0 and dec.frames == len(frames)


def test_a_message_that_fits_is_the_one_frame_it_always_was() -> None:
    """Below max_frame nothing changed on the wire: the frame a node of the previous
    release sends and accepts (kind 2), tagged with the same sequence numbers."""
    payload = [[0, "g", b"x" * 1000]]
    for a, b in ((None, None), (FrameMac(KEY), FrameMac(KEY))):
        (frame,) = _frames(payload, 2048, a)
        assert frame == encode_frame(payload, b)
        assert HEADER.unpack_from(frame)[1] == VERSION == 2
    assert len(_frames(payload, 1024, None)) == 2  # the same message, split


def _split(mac: FrameMac | None = None) -> list[bytes]:
    frames = _frames([os.urandom(5000)], 1024, mac)
    assert [HEADER.unpack_from(f)[1] for f in frames] == [FIRST] + [MORE] * (len(frames) - 1)
    return frames


@pytest.mark.parametrize("tamper", [
    lambda fs, later: [fs[0], fs[2], fs[1], *fs[3:]],  # parts reordered
    lambda fs, later: [fs[0], *fs[2:]],  # a part dropped
    lambda fs, later: [fs[0], fs[1], fs[1], *fs[2:]],  # a part replayed
    lambda fs, later: [fs[0], fs[1][:-20] + b"\0" + fs[1][-19:], *fs[2:]],  # a part altered
    lambda fs, later: [fs[0], HEADER.pack(HEADER.unpack_from(fs[1])[0], VERSION)  # its kind
                       + fs[1][HEADER.size:], *fs[2:]],
    lambda fs, later: [fs[0], *later[1:]],  # the parts of a later message spliced in
])
def test_a_tampered_part_fails_its_tag(tamper: Callable[[Frames, Frames], Frames]) -> None:
    """Each part is a frame with a tag of its own over its sequence number and header."""
    send = FrameMac(KEY)
    fs, later = _split(send), _split(send)
    dec = FrameDecoder(1024, FrameMac(KEY))
    with pytest.raises(FrameError, match="authentication failed"):
        for f in tamper(fs, later):
            assert dec.feed(f) == []


@pytest.mark.parametrize("stream", [
    lambda fs, one: [fs[0], one, *fs[1:]],  # a whole frame inside a split message
    lambda fs, one: [fs[0], fs[0]],  # a split message begun inside another
    lambda fs, one: fs[1:],  # a following part with no first
    lambda fs, one: [HEADER.pack(1 + 8 + 3, FIRST) + TOTAL.pack(2) + b"abc"],  # past its total
])
def test_parts_out_of_sequence_are_refused(stream: Callable[[Frames, bytes], Frames]) -> None:
    """What tags make impossible to forge is still refused without them (under TLS)."""
    dec = FrameDecoder(1024)
    with pytest.raises(FrameError):
        for f in stream(_split(), encode_frame([1])):
            dec.feed(f)


def test_a_message_over_the_cap_is_refused_at_its_first_header() -> None:
    dec = FrameDecoder(1024, FrameMac(KEY), max_message=1 << 20)
    head = HEADER.pack(1000, FIRST) + TOTAL.pack((1 << 20) + 1)
    with pytest.raises(FrameError, match="message limit"):
        dec.feed(head)  # nothing of the part is needed (or buffered) to refuse it
    fits = _frames([b"x" * ((1 << 20) - 100)], 1024, FrameMac(KEY))
    dec = FrameDecoder(1024, FrameMac(KEY), max_message=1 << 20)
    assert dec.feed(b"".join(fits)) == [[b"x" * ((1 << 20) - 100)]]


@pytest.mark.parametrize("kind", [VERSION, FIRST, MORE])
def test_a_frame_over_max_frame_is_refused_from_its_header_whatever_its_kind(kind: int) -> None:
    with pytest.raises(FrameError, match="exceeds the 1024 limit"):
        FrameDecoder(1024).feed(HEADER.pack(1025, kind) + TOTAL.pack(10))


@pytest.mark.parametrize("kind", [1, 5, 255])
def test_unknown_kinds_and_the_untagged_version_1_are_refused(kind: int) -> None:
    with pytest.raises(FrameError, match=f"unknown frame version {kind}"):
        FrameDecoder().feed(HEADER.pack(1 + TAG, kind) + bytes(TAG))


def test_a_max_frame_with_no_room_for_a_part_is_refused() -> None:
    with pytest.raises(ValueError, match="max_frame"):
        Transport("a", "127.0.0.1:1", b"s", None, lambda p, i: None,  # type: ignore[arg-type]
                  max_frame=64)


SMALL_FRAME = 64 << 10


def test_a_split_message_keeps_its_place_and_holds_up_no_other_peer() -> None:
    """Real transports on one poller: a 16 MiB message to b goes in 64 KiB frames; the
    message queued behind it for b arrives after it, and c's, queued at the same time,
    arrives while b's parts are still on their way (the sender frames them as the
    socket drains, between its other work)."""
    ids = ["a", "b", "c"]
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip(ids, free_ports(3))}
    poller = createPoller("auto")
    arrived: list[tuple[str, list[Any]]] = []

    def on_items(me: str) -> Callable[[str, list[Any]], None]:
        return lambda peer, items: arrived.extend((me, it) for it in items)

    ts = [Transport(n, addrs[n], b"s", poller, on_items(n), addresses=addrs,
                    max_frame=SMALL_FRAME) for n in ids]
    a = ts[0]
    for t in ts:
        t.start()
    try:
        def up() -> bool:
            for peer in ("b", "c"):
                a.ping(peer)
            return a.connected_peers() == ["b", "c"]

        _spin(poller, ts, up)
        big = [0, os.urandom(16 << 20)]
        a.send("b", big)
        a.flush()
        a.send("b", [0, "after"])
        a.send("c", [0, "meanwhile"])
        _spin(poller, ts, lambda: ("b", [0, "after"]) in arrived, 20)
        assert arrived == [("c", [0, "meanwhile"]), ("b", big), ("b", [0, "after"])]
        assert all(t.stats["rejected"] == 0 for t in ts)
    finally:
        for t in ts:
            t.close()


def test_a_follower_catches_up_by_an_image_larger_than_a_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follower is down while the leader compacts its log past it; back up, it needs a
    snapshot image many times max_frame (64 KiB here), which reaches it in parts, and
    its state then equals the leader's."""
    monkeypatch.setattr(raftkv.node.runtime, "Transport",
                        functools.partial(Transport, max_frame=SMALL_FRAME))
    ps = peers()
    policy = CompactionPolicy(max_entries=20, keep=5)

    def start(n: str) -> RaftKV:
        # A generous request timeout: on a loaded CI machine two nodes in one process can
        # stall for seconds, and this test is about the image, not about latency.
        return RaftKV(n, ps[n], ps, SECRET, data_dir=str(tmp_path / n), durable=False,
                      compaction=policy, request_timeout=20.0)

    kvs = {n: start(n) for n in ps}
    try:
        # Every node must name the same leader before one is stopped: a view from one node
        # alone can be a term behind, and stopping the real leader would leave the writes
        # below to a new election.
        deadline = time.monotonic() + 20
        while len({kv.wait_for_leader() for kv in kvs.values()}) != 1:
            assert time.monotonic() < deadline, "the nodes do not agree on a leader"
            time.sleep(0.05)
        lead = kvs["n1"].wait_for_leader()
        # ...and have committed everything the leader holds, which includes the record of
        # every voter: a voter recorded on contact counts only once that record commits,
        # and if the victim were needed for it the other two would wait for it
        # ("Incarnations", what it does not cover; test_core_incarnations).
        kvs[lead].put("key00000", b"v" * 200)  # one of the keys written below, as below
        last = kvs[lead].status()["groups"]["default"]["last_index"]
        while not all(kv.status()["groups"]["default"]["commit"] >= last
                      for kv in kvs.values()):
            assert time.monotonic() < deadline, "the nodes did not all commit"
            time.sleep(0.05)
        victim = next(n for n in ps if n != lead)
        kvs[victim].close()
        live = kvs[lead]
        value = b"v" * 200
        for i in range(0, 4000, 50):  # about 1 MB of state: 16 parts or more
            # Puts may be sent again: under load leadership can still move.
            ops = [(f"key{j:05d}", value) for j in range(i, i + 50)]
            for attempt in range(3):
                try:
                    live.batch(ops)
                    break
                except (NotLeader, RequestTimeout):
                    if attempt == 2:
                        raise
        deadline = time.monotonic() + 20
        while live.status()["groups"]["default"]["first_index"] <= 20:
            assert time.monotonic() < deadline, "the leader did not compact its log"
            time.sleep(0.05)
        kvs[victim] = start(victim)
        want = live.digest()
        deadline = time.monotonic() + 20
        while kvs[victim].digest(stale=True) != want:
            assert time.monotonic() < deadline, "the follower did not catch up"
            time.sleep(0.05)
        assert want["count"] == 4000
        # It caught up by the image, not by the log the leader no longer holds.
        assert kvs[victim].status()["groups"]["default"]["first_index"] > 20
    finally:
        for kv in kvs.values():
            kv.close()
