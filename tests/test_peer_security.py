"""The peer port against an attacker on the network, with real ``raftkv serve`` processes
(docs/security.md, "What an attacker on the network can do"):

- without TLS, a relay on the path between two nodes replays one frame, or flips one
  bit of another: the receiving node closes that connection, logs why, stays up, and
  no write is lost or applied twice (the replicas' digests agree);
- with TLS, a peer whose certificate comes from another CA is refused, dialing in or
  dialed, and so is an HTTPS client that trusts another CA or presents no certificate
  to a node that requires one;
- a member removed from the cluster is no longer dialed, also after a restart.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from raftkv.certs import issue, make_ca
from raftkv.client import Client, Unavailable
from raftkv.testing.procs import ProcCluster, free_port
from raftkv.tls import client_context
from raftkv.transport import handshake as hs
from raftkv.transport.frames import HEADER

TAMPER, REPLAY = "tamper", "replay"


class OnPathAttacker:
    """A TCP relay standing where a node dials another (its address is the one given for
    the dialed node), as an attacker on the network path would. It relays both ways;
    in the dialer's direction it follows the handshake and the frames, and does its
    ``attack`` once, to the first frame of at least ``min_frame`` bytes (an append
    carrying entries): ``replay`` sends it twice, ``tamper`` flips one bit of its
    payload. It knows no secret, so it cannot make a frame of its own."""

    def __init__(self, target_port: int, attack: str, min_frame: int = 600) -> None:
        self.target = ("127.0.0.1", target_port)
        self.attack = attack
        self.min_frame = min_frame
        self.done = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(16)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                dialer, _ = self.sock.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pipe, args=(upstream, dialer), daemon=True).start()
            threading.Thread(target=self._frames, args=(dialer, upstream),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        buf = b""

        def take(n: int) -> bytes:
            nonlocal buf
            while len(buf) < n:
                data = src.recv(65536)
                if not data:
                    raise EOFError
                buf += data
            out, buf = buf[:n], buf[n:]
            return out

        try:
            # The hello: magic, nonce and MAC, then the id, the address and the
            # cluster, each after a one-byte length.
            hello = take(len(hs.MAGIC) + hs.NONCE + hs.MAC)
            for _ in range(3):
                n = take(1)
                hello += n + take(n[0])
            dst.sendall(hello)
            while True:
                header = take(HEADER.size)
                frame = header + take(HEADER.unpack(header)[0] - 1)
                if self.done.is_set() or len(frame) < self.min_frame:
                    dst.sendall(frame)
                elif self.attack == REPLAY:
                    dst.sendall(frame + frame)
                    self.done.set()
                else:
                    bad = bytearray(frame)
                    bad[len(frame) // 2] ^= 0x10
                    dst.sendall(bytes(bad))
                    self.done.set()
        except (OSError, EOFError):
            pass
        finally:
            for s in (src, dst):
                s.close()


@contextmanager
def cluster(tmp_path: Path, **kw: object) -> Iterator[ProcCluster]:
    with ProcCluster(str(tmp_path), size=3, **kw) as c:  # type: ignore[arg-type]
        c.start()
        c.wait_leader()
        yield c


def _no_traceback(c: ProcCluster) -> None:
    for n in c.nodes.values():
        assert "Traceback" not in n.log_text(), f"{n.id}:\n{n.log_text()[-3000:]}"


def test_a_replayed_and_a_tampered_frame_are_refused_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    """n4 and n5 join as learners at addresses where an attacker relays to them, so
    every node's connection to them crosses the relay. While a client writes, the
    relay replays one append to n4 and alters one append to n5."""
    with cluster(tmp_path, faults=False) as c:
        client = c.client()
        client.put("before", "1")
        attackers = {}
        for nid, attack in (("n4", REPLAY), ("n5", TAMPER)):
            node = c.add_node(nid)
            attackers[nid] = OnPathAttacker(node.raft_port, attack)
            c.client(["n1", "n2", "n3"]).add_learner(nid, attackers[nid].addr)
        try:
            acked = {}
            deadline = time.monotonic() + 60
            i = 0
            while not all(a.done.is_set() for a in attackers.values()):
                assert time.monotonic() < deadline, "the relays saw no append to attack"
                key, value = f"k{i:05d}", f"v{i}-" + "x" * 700
                client.put(key, value)
                acked[key] = value
                i += 1
            for _ in range(20):  # and after the attacks
                key = f"k{i:05d}"
                acked[key] = f"after-{i}"
                client.put(key, acked[key])
                i += 1
            needle = "frame authentication failed"
            for nid in ("n4", "n5"):
                node = c.nodes[nid]
                c.wait_until(lambda n=node: needle in n.log_text(), 20,
                             f"{nid} to log the refused frame")
                line = next(x for x in node.log_text().splitlines() if needle in x)
                assert " WARNING " in line, line
                assert node.alive
            # Nothing lost, nothing applied twice: every replica (the attacked learners
            # included, once they catch up over a fresh connection) has the same state,
            # and every acknowledged write reads back.
            c.wait_caught_up(timeout=60)

            def same() -> bool:
                # An entry may still land between the catch-up and the reads (a node was
                # seen one index ahead, same rows, on a loaded machine): read until they
                # agree, index included.
                seen = {json.dumps(c.digest(nid), sort_keys=True) for nid in c.nodes}
                return len(seen) == 1

            c.wait_until(same, 30, "every replica's digest and applied index equal")
            for nid in ("n4", "n5"):
                local = c.client([nid])
                for key in list(acked)[::25] + [list(acked)[-1]]:
                    assert local.get(key, stale=True) == acked[key].encode(), (nid, key)
            assert client.get("before") == b"1"
            _no_traceback(c)
        finally:
            for a in attackers.values():
                a.close()


def _challenge_over_tls(port: int, ctx: ssl.SSLContext) -> bytes | str:
    """Dial a TLS raft port with ``ctx``: what the node sends once TLS is up (its
    cluster-secret challenge), or how TLS failed."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            # TLS 1.3: a client hears that its certificate was refused on its first read.
            return s.recv(len(hs.MAGIC) + hs.NONCE) or "closed"
    except (ssl.SSLError, ConnectionError) as e:
        return f"refused: {e}"


class RoguePeer:
    """A TLS server with a certificate of another CA, where a learner is said to be."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(16)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.errors: list[str] = []
        self.ctx = ctx
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.ctx.wrap_socket(raw, server_side=True) as s:
                    s.recv(1)
            except (ssl.SSLError, OSError) as e:
                self.errors.append(str(e))


def test_tls_refuses_a_peer_or_client_with_a_certificate_from_another_ca(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path, faults=False, tls=True,
                 extra_args=["--client-cert-auth"]) as c:
        rogue_dir = os.path.join(str(tmp_path), "rogue")
        rogue_ca = make_ca(rogue_dir)
        rogue = issue(rogue_ca, rogue_dir, "n9")
        assert c.ca is not None and c.client_cert is not None
        lead = c.wait_leader()
        node = c.nodes[lead]

        # A certificate of the cluster's CA gets the challenge, so what refuses the
        # next one is its CA and nothing else.
        good = client_context(c.ca.cert, c.client_cert.cert, c.client_cert.key)
        got = _challenge_over_tls(node.raft_port, good)
        assert isinstance(got, bytes) and got.startswith(hs.MAGIC), got
        # Dialing in with a rogue certificate (trusting the real CA): refused by TLS,
        # before a byte of the raftkv handshake.
        mark = len(node.log_text())
        got = _challenge_over_tls(node.raft_port, client_context(c.ca.cert, rogue.cert,
                                                                 rogue.key))
        assert isinstance(got, str), got
        c.wait_until(lambda: "CERTIFICATE_VERIFY_FAILED" in node.log_text()[mark:], 10,
                     "the leader to log the rogue certificate")

        # Dialed: a learner's address is a TLS server with a rogue certificate. Every
        # node refuses it (and says why in its log); the cluster goes on.
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(rogue.cert, rogue.key)
        peer = RoguePeer(server)
        try:
            client = c.client()
            marks = {n: len(c.nodes[n].log_text()) for n in c.nodes}
            client.add_learner("n9", peer.addr)
            for n, m in marks.items():
                c.wait_until(lambda n=n, m=m: "CERTIFICATE_VERIFY_FAILED"
                             in c.nodes[n].log_text()[m:], 10, f"{n} to refuse n9")
            client.put("after", "1")
            c.wait_until(lambda: len(peer.errors) >= 3, 10, "the rogue peer to be refused")
            st = c.status(lead)
            assert st is not None and "n9" not in st["connected"], st
        finally:
            peer.sock.close()

        # HTTPS: a client trusting another CA refuses the node; a node that requires a
        # client certificate refuses a client without one, or with a rogue one.
        ep = [node.endpoint]
        with pytest.raises(Unavailable, match="not signed by the trusted CA"):
            Client(ep, cacert=rogue_ca.cert).get("after")
        for cert, key in ((None, None), (rogue.cert, rogue.key)):
            with pytest.raises(Unavailable):
                Client(ep, timeout=2, cacert=c.ca.cert, cert=cert, key=key).get("after")
        assert Client(ep, cacert=c.ca.cert, cert=c.client_cert.cert,
                      key=c.client_cert.key).get("after") == b"1"
        # Plain HTTP to the HTTPS port: no answer, and no traceback in the node's log.
        plain = http.client.HTTPConnection("127.0.0.1", node.http_port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
        _no_traceback(c)


def test_a_removed_member_is_no_longer_dialed_even_after_a_restart(tmp_path: Path) -> None:
    """n5 is added as a learner at an address where the test listens (and never answers,
    so every node keeps dialing it), then removed: no node dials it again, restarted or
    not, and the address books forget it."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", free_port()))
    listener.listen(64)
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    dials: list[float] = []
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                s, _ = listener.accept()
            except OSError:
                return
            dials.append(time.monotonic())
            held.append(s)

    threading.Thread(target=accept, daemon=True).start()
    try:
        with cluster(tmp_path) as c:
            c.client().add_learner("n5", addr)
            c.wait_until(lambda: len(dials) >= 3, 20, "every node to dial n5")
            c.client().remove("n5")

            def forgotten() -> bool:
                sts = [c.status(n) for n in c.nodes]
                return all(st is not None and "n5" not in st["addresses"] for st in sts)

            c.wait_until(forgotten, 20, "every node to forget n5's address")
            for s in held:  # the relay closes what it was holding: nothing pending
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            before = len(dials)
            time.sleep(5)  # more than twice the longest dial back-off (2 s)
            assert len(dials) == before, "a node dialed the removed n5"

            c.kill("n2")
            c.start("n2")
            c.wait_caught_up()
            st = c.status("n2")
            assert st is not None and "n5" not in st["addresses"], st["addresses"]
            with open(os.path.join(c.nodes["n2"].data_dir, "peers.json")) as f:
                assert "n5" not in json.load(f)
            before = len(dials)
            time.sleep(5)
            assert len(dials) == before, "n2 dialed the removed n5 after its restart"
            assert all("forgot n5" in c.nodes[n].log_text() for n in ("n1", "n3"))
    finally:
        listener.close()
