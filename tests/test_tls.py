"""Authenticated frames and TLS, in process: the frame tags refuse what an on-path
attacker can do to a byte stream, two transports on one poller talk over TLS and refuse
a certificate from another CA, and the settings refuse bad files and flags with one
clear line (docs/security.md says what each mode protects)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pysyncobj.poller import createPoller

from raftkv.certs import CertFiles, cluster_certs, issue, make_ca
from raftkv.client import Client, Unavailable
from raftkv.tls import TlsConfig, TlsSetupError
from raftkv.transport import handshake as hs
from raftkv.transport.frames import FrameDecoder, FrameError, FrameMac, encode_frame
from raftkv.transport.tcp import Transport


# ------------------------------------------------------------------ frame tags --------
def _keys() -> tuple[bytes, bytes]:
    return hs.frame_keys(b"secret", hs.new_nonce(), hs.new_nonce())


def test_tagged_frames_decode_in_order_across_arbitrary_splits() -> None:
    key, _ = _keys()
    send = FrameMac(key)
    data = b"".join(encode_frame([i, b"x" * i], send) for i in range(5))
    dec = FrameDecoder(mac=FrameMac(key))
    out: list[object] = []
    for i in range(0, len(data), 7):
        out += dec.feed(data[i:i + 7])
    assert out == [[i, b"x" * i] for i in range(5)]


def _refused(frames: list[bytes], key: bytes) -> str:
    dec = FrameDecoder(mac=FrameMac(key))
    with pytest.raises(FrameError) as e:
        for f in frames:
            dec.feed(f)
    return str(e.value)


def test_a_tampered_replayed_reordered_or_foreign_frame_is_refused() -> None:
    key, other = _keys()
    send = FrameMac(key)
    f0, f1, f2 = (encode_frame([[0, "default", n]], send) for n in range(3))
    tampered = bytearray(f1)
    tampered[8] ^= 0x01  # one bit of the payload
    assert "authentication failed" in _refused([f0, bytes(tampered)], key)
    assert "authentication failed" in _refused([f0, f1, f1], key)  # replayed
    assert "authentication failed" in _refused([f0, f2, f1], key)  # reordered
    assert "authentication failed" in _refused([f1], key)  # an earlier one dropped
    # The same frames under another connection's (or direction's) key.
    assert "authentication failed" in _refused([f0], other)
    # An untagged frame (an older peer, or one that skips the tag) is refused too.
    assert _refused([encode_frame([1])], key)


def test_frame_keys_differ_per_direction_and_per_connection() -> None:
    na, nd = hs.new_nonce(), hs.new_nonce()
    d2a, a2d = hs.frame_keys(b"s", na, nd)
    assert d2a != a2d
    assert hs.frame_keys(b"s", na, nd) == (d2a, a2d)
    assert hs.frame_keys(b"s", na, hs.new_nonce())[0] != d2a
    assert hs.frame_keys(b"other", na, nd)[0] != d2a


def test_an_older_or_a_tls_peer_on_a_plain_port_is_refused_by_name() -> None:
    with pytest.raises(hs.HandshakeError, match="older raftkv"):
        hs.parse_challenge(hs.OLD_MAGIC + bytes(hs.NONCE))
    with pytest.raises(hs.HandshakeError, match="speaks TLS"):
        hs.parse_hello(b"\x16\x03\x01\x02\x00" + bytes(200), b"s", bytes(hs.NONCE))


# ------------------------------------------------------------ TLS transports ----------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca, files = cluster_certs(str(d), ["a", "b"])
    rogue = make_ca(str(d / "rogue"))
    return {**files, "ca": ca, "rogue-b": issue(rogue, str(d / "rogue"), "b")}


def _tls(files: CertFiles, ca: str, auth: bool = True) -> TlsConfig:
    return TlsConfig(files.cert, files.key, ca, client_cert_auth=auth)


def _pair(tls_a: TlsConfig | None, tls_b: TlsConfig | None, **kw: Any
          ) -> tuple[Any, Transport, Transport, list[Any]]:
    poller = createPoller("auto")
    got: list[Any] = []
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addrs = {"a": f"127.0.0.1:{ports[0]}", "b": f"127.0.0.1:{ports[1]}"}
    ts = [Transport(n, addrs[n], b"s", poller, lambda p, items: got.append((p, items)),
                    addresses=addrs, tls=t, **kw) for n, t in (("a", tls_a), ("b", tls_b))]
    for t in ts:
        t.start()
    return poller, ts[0], ts[1], got


def _spin(poller: Any, ts: list[Transport], until: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        for t in ts:
            t.flush()
            t.maintain()
        poller.poll(0.01)


def test_two_transports_talk_over_mutual_tls(pki: dict[str, CertFiles]) -> None:
    ca = pki["ca"].cert
    poller, a, b, got = _pair(_tls(pki["a"], ca), _tls(pki["b"], ca))
    try:
        big = [0, "y" * 300_000]  # many TLS records

        def through() -> bool:
            a.send("b", [0, "hello"])
            b.send("a", big)
            return ("a", [[0, "hello"]]) in got and ("b", [big]) in got

        _spin(poller, [a, b], through)
        assert through()
        assert a.stats["rejected"] == 0 and b.stats["rejected"] == 0
        conn = a.peers["b"].conn
        assert conn is not None and conn.tls is not None and conn.send_mac is None
    finally:
        a.close()
        b.close()


def test_a_message_larger_than_a_frame_crosses_tls_in_parts(pki: dict[str, CertFiles]) -> None:
    """Each part is encrypted as it is framed (``tcp.Connection._fill``), after any TLS
    record already queued, and the parts arrive whole and in order."""
    ca = pki["ca"].cert
    poller, a, b, got = _pair(_tls(pki["a"], ca), _tls(pki["b"], ca), max_frame=64 << 10)
    try:
        def up() -> bool:
            a.ping("b")
            return a.connected_peers() == ["b"]

        _spin(poller, [a, b], up)
        big = [0, os.urandom(3 << 20)]
        a.send("b", big)
        a.flush()
        a.send("b", [0, "after"])  # the next message, queued behind the parts
        _spin(poller, [a, b], lambda: ("a", [[0, "after"]]) in got)
        assert [items for _, items in got if items] == [[big], [[0, "after"]]]
        assert a.stats["rejected"] == 0 and b.stats["rejected"] == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("client_cert_auth", [True, False])
def test_a_peer_with_a_certificate_from_another_ca_is_refused(
    pki: dict[str, CertFiles], client_cert_auth: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    """b's certificate is signed by a rogue CA (b trusts the real one, so only its own
    certificate is wrong). a refuses it whichever side dials: as a dialer it verifies
    b's server certificate; as an acceptor, with client_cert_auth, b's client one
    (without client_cert_auth an acceptor asks for none, and only b's dials are tried:
    the cluster secret is then what keeps a stranger out)."""
    ca = pki["ca"].cert
    poller, a, b, got = _pair(_tls(pki["a"], ca, client_cert_auth),
                              _tls(pki["rogue-b"], ca, client_cert_auth))
    try:
        for _ in range(40):
            a.send("b", [0, "x"])
            if client_cert_auth:
                b.send("a", [0, "y"])
            _spin(poller, [a, b], lambda: False, 0.05)
        assert got == []
        assert a.connected_peers() == [] and b.connected_peers() == []
        assert a.stats["rejected"] > 0
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
    finally:
        a.close()
        b.close()


def test_a_tls_node_and_a_plain_node_refuse_each_other(
    pki: dict[str, CertFiles], caplog: pytest.LogCaptureFixture,
) -> None:
    poller, a, b, got = _pair(_tls(pki["a"], pki["ca"].cert), None)
    try:
        for _ in range(40):
            a.send("b", [0, "x"])
            _spin(poller, [a, b], lambda: False, 0.05)
        assert got == [] and a.connected_peers() == [] and b.connected_peers() == []
        assert "speaks TLS" in caplog.text  # b names what a spoke
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------ settings ----------------
def test_missing_or_mismatched_files_are_named(pki: dict[str, CertFiles],
                                               tmp_path: Path) -> None:
    with pytest.raises(TlsSetupError, match="nope.pem does not exist"):
        TlsConfig(str(tmp_path / "nope.pem"), pki["a"].key).server_context()
    # A directory given for a file is named as one (it said "does not exist").
    with pytest.raises(TlsSetupError, match="is a directory, not a file"):
        TlsConfig(str(tmp_path), pki["a"].key).server_context()
    with pytest.raises(TlsSetupError, match="cannot load the TLS certificate"):
        TlsConfig(pki["a"].cert, pki["b"].key).server_context()  # not its key
    with pytest.raises(TlsSetupError, match="needs a trusted CA"):
        TlsConfig(pki["a"].cert, pki["a"].key, client_cert_auth=True)
    with pytest.raises(TlsSetupError, match="trusted CA file"):
        TlsConfig(pki["a"].cert, pki["a"].key, str(tmp_path / "ca.pem")).client_context()


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s")
    return subprocess.run(
        [sys.executable, "-m", "raftkv.cli", "serve", "--id", "n1", "--data-dir",
         str(tmp_path / "n1"), "--raft-addr", "127.0.0.1:1", "--http-addr", "127.0.0.1:2",
         "--secret-file", str(secret), *args],
        check=False, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "says"), [
    (["--cert-file", "c.pem"], "give both --cert-file and --key-file"),
    (["--peer-client-cert-auth"], "--peer-trusted-ca-file and --peer-client-cert-auth need"),
    (["--peer-cert-file", "c.pem", "--peer-key-file", "k.pem", "--peer-trusted-ca-file",
      "ca.pem"], "ca.pem does not exist"),
    (["--peer-cert-file", "c.pem", "--peer-key-file", "k.pem"],
     "--peer-cert-file needs --peer-trusted-ca-file"),
    (["--peers", "n1=127.0.0.1:1,n2=127.0.0.1:5,n3=127.0.0.1:5"],
     "gives the address 127.0.0.1:5 to n2 and n3"),
    (["--peers", "n1=127.0.0.1:1,n2=127.0.0.1:5,n2=127.0.0.1:6"], "names n2 twice"),
])
def test_serve_refuses_bad_tls_flags_and_repeated_peers_in_one_line(
    tmp_path: Path, args: list[str], says: str,
) -> None:
    res = _serve(tmp_path, *args)
    assert res.returncode == 1
    assert says in res.stderr and res.stderr.startswith("error: ")
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "n1").exists()  # refused before anything was written


def test_the_client_fails_at_once_on_a_server_it_cannot_verify(
    pki: dict[str, CertFiles], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong CA is not a passing fault: the client says so instead of retrying until
    its deadline. A scheme-less endpoint is https once a CA is given (from the env)."""
    import http.server
    import ssl
    import threading

    srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    ctx = TlsConfig(pki["rogue-b"].cert, pki["rogue-b"].key).server_context()
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("RAFTKV_CACERT", pki["ca"].cert)
        c = Client(f"127.0.0.1:{srv.server_address[1]}", timeout=30)
        assert c.endpoints[0].startswith("https://")
        # Not "no answer within 30s": the first refusal is the answer.
        with pytest.raises(Unavailable, match="not signed by the trusted CA") as e:
            c.get("k")
        assert isinstance(e.value.__cause__, ssl.SSLCertVerificationError)
        monkeypatch.setenv("RAFTKV_CACERT", str(tmp_path / "missing.pem"))
        with pytest.raises(TlsSetupError, match="missing.pem does not exist"):
            Client(f"127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command")
def test_the_openssl_commands_in_the_docs_make_certificates_nodes_accept(
    tmp_path: Path,
) -> None:
    """docs/security.md's openssl recipe, run as written: two nodes talk mutual TLS
    with its certificates, and its client certificate loads."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    recipe = doc.split("By hand with openssl", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    res = subprocess.run(["bash", "-euc", recipe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    d = tmp_path / "tls"
    files = {n: CertFiles(str(d / f"{n}.pem"), str(d / f"{n}-key.pem"), str(d / "ca.pem"))
             for n in ("n1", "n2", "client")}
    assert len((tmp_path / "secret").read_text().strip()) == 64
    poller, a, b, got = _pair(_tls(files["n1"], files["n1"].ca), _tls(files["n2"], files["n2"].ca))
    try:
        _spin(poller, [a, b], lambda: a.send("b", [0, "x"]) or bool(got))
        assert got == [("a", [[0, "x"]])]
    finally:
        a.close()
        b.close()
    TlsConfig(files["client"].cert, files["client"].key, files["client"].ca).client_context()


def test_an_embedded_cluster_runs_on_mutual_tls(tmp_path: Path) -> None:
    """``RaftKV(..., peer_tls=TlsConfig(...))``: the embedded API's TLS, end to end."""
    from raftkv.kv import RaftKV
    from raftkv.testing.procs import free_ports

    ids = ["n1", "n2", "n3"]
    peers = {n: f"127.0.0.1:{p}" for n, p in zip(ids, free_ports(3), strict=True)}
    ca, files = cluster_certs(str(tmp_path / "tls"), ids)
    kvs = [RaftKV(n, peers[n], peers, b"s", peer_tls=_tls(files[n], ca.cert)) for n in ids]
    try:
        kvs[0].wait_for_leader()
        kvs[1].put("k", "v")  # forwarded to the leader if n2 is not it
        assert kvs[2].get("k") == b"v"
        conns = [p.conn for p in kvs[0].node.transport.peers.values() if p.conn is not None]
        assert conns and all(c.tls is not None and c.tls.established for c in conns)
    finally:
        for kv in kvs:
            kv.close()
