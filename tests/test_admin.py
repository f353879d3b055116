"""``raftkv admin`` (raftkv/admin.py): syncobj_admin for embedded nodes, on the raft port.

Real processes: PySyncObj's README counter on the compat layer (tests/procs/
pysyncobj_counter.py) administered with syncobj_admin's own arguments, and raftkv's
counter on a ReplicatedNode (tests/procs/embedded_counter.py) with raftkv's; leaders
are SIGKILLed on the way. In-process: the admin channel's rules (the secret first, a
tool is never a peer, bad input closes only its own connection).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from programs import ROOT, Program, answer, leader_of, until

from raftkv.admin import AdminClient, AdminError
from raftkv.compat.pysyncobj.syncobj_admin import executeAdminCommand
from raftkv.compat.pysyncobj.utility import TcpUtility, UtilityException
from raftkv.kv import RaftKV
from raftkv.testing.procs import free_ports
from raftkv.transport import codec
from raftkv.transport.blocking import PeerLink
from raftkv.transport.frames import HEADER, TAG, VERSION, FrameMac, encode_frame
from raftkv.transport.tcp import MAX_ADMIN


def admin(*args: str, timeout: float = 60, before: tuple[str, ...] = ()
          ) -> tuple[int, str, str]:
    """``raftkv [BEFORE] admin ARGS`` as a process: (exit status, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "raftkv.cli", *before, "admin", *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    return p.returncode, p.stdout.strip(), p.stderr.strip()


def status_lines(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines())


def until_not(program: Program, command: str, unwanted: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while (got := program.ask(command)) == unwanted:
        assert time.monotonic() < deadline, f"{command!r} kept answering {got!r}"
        time.sleep(0.1)
    return got


@pytest.fixture
def programs() -> Iterator[list[Program]]:
    started: list[Program] = []
    yield started
    for p in started:
        p.kill()


def test_syncobj_admin_arguments_administer_pysyncobj_programs(
    tmp_path: Path, programs: list[Program]
) -> None:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(4)]
    founders = addrs[:3]

    def start(i: int, partners: list[str]) -> Program:
        p = Program("pysyncobj_counter.py",
                    [str(tmp_path / f"journal{i}"), addrs[i], *partners, "--dynamic"],
                    tmp_path / f"n{i}.log")
        programs.append(p)
        return p

    nodes = [start(i, [a for a in founders if a != addrs[i]]) for i in range(3)]
    for _ in range(3):
        answer(nodes[0], "inc")
    lead = leader_of(nodes, founders)
    follower = founders[(lead + 1) % 3]

    code, out, _ = admin("-conn", follower, "-pass", "procs", "-status")
    st = status_lines(out)
    assert code == 0
    assert st["leader"] == founders[lead] and st["self"] == follower
    assert st["partner_nodes_count"] == "2" and st["has_quorum"] == "True"
    assert int(st["commit_idx"]) >= 3 and st["state"] == "0"  # _RAFT_STATE.FOLLOWER

    code, out, _ = admin("-conn", follower, "-pass", "not-the-password", "-status",
                           timeout=30)
    assert code == 1 and "closed the connection" in out
    assert answer(nodes[0], "inc") == 4, "a refused tool costs the node nothing"

    fourth = start(3, founders)
    code, out, _ = admin("-conn", follower, "-pass", "procs", "-add", addrs[3])
    assert (code, out) == (0, f"SUCCESS ADD {addrs[3]}")
    until(fourth, "get", 4)
    code, out, _ = admin("-conn", addrs[3], "-pass", "procs", "-remove", addrs[3])
    assert (code, out) == (1, f"FAIL REMOVE {addrs[3]}")  # as PySyncObj: ask another node
    # An operator's mistake is a failure, not SUCCESS (found from outside: removing a
    # mistyped address printed SUCCESS REMOVE and exited 0).
    code, out, _ = admin("-conn", follower, "-pass", "procs", "-remove", "127.0.0.1:1")
    assert (code, out) == (1, "FAIL REMOVE 127.0.0.1:1")
    code, out, err = admin("--conn", follower, "--password", "procs", "remove", "127.0.0.1:1")
    assert code == 1 and "not a member of the cluster" in err, (out, err)
    code, out, _ = admin("-conn", follower, "-pass", "procs", "-add", addrs[3])
    assert (code, out) == (1, f"FAIL ADD {addrs[3]}")
    code, out, _ = admin("-conn", follower, "-pass", "procs", "-set_version", "1")
    assert code == 1 and out == "wrong version, current version is 0, requested version is 1"

    # raftkv's own syntax on the same node, and JSON.
    code, out, _ = admin("--conn", follower, "--password", "procs", "--json", "status")
    doc = json.loads(out)
    assert code == 0 and doc["result"]["leader"] == founders[lead]
    assert doc["result"]["partner_nodes_count"] == 3  # the fourth is a member now

    # Transfer from a follower: it names the leader, and the tool asks the leader.
    code, out, _ = admin("-conn", follower, "-pass", "procs", "-transfer", follower)
    assert (code, out) == (0, f"SUCCESS TRANSFER {follower}")
    assert leader_of(nodes, founders) == founders.index(follower)

    # The leader dies: the survivors' status names the new leader, and a survivor
    # removes the dead node from the cluster.
    dead = founders.index(follower)
    nodes[dead].kill()
    alive = [a for a in addrs if a != follower]
    deadline = time.monotonic() + 20
    while True:
        code, out, _ = admin("-conn", alive[0], "-pass", "procs", "-status")
        st = status_lines(out)
        if code == 0 and st["leader"] in alive:
            break
        assert time.monotonic() < deadline, f"no new leader: {out}"
        time.sleep(0.2)
    code, out, _ = admin("-conn", alive[1], "-pass", "procs", "-remove", follower)
    assert (code, out) == (0, f"SUCCESS REMOVE {follower}")
    assert answer(fourth, "inc") == 5
    until(nodes[(dead + 1) % 3], "get", 5)


def test_raftkv_admin_administers_embedded_nodes(tmp_path: Path, programs: list[Program]
                                                 ) -> None:
    secret = tmp_path / "secret"
    secret.write_text("an embedded secret\n")
    addrs = {f"n{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(free_ports(4))}
    founders = ["n1", "n2", "n3"]

    def start(nid: str, members: list[str], join: bool = False) -> Program:
        p = Program("embedded_counter.py",
                    [str(tmp_path / nid), str(secret), nid,
                     *[f"{m}={addrs[m]}" for m in members], *(["--join"] if join else [])],
                    tmp_path / f"{nid}.log")
        programs.append(p)
        return p

    nodes = {n: start(n, founders) for n in founders}
    assert answer(nodes["n1"], "inc") == 1

    def run(*args: str) -> Any:
        code, out, err = admin("--conn", addrs[conn], "--secret-file", str(secret), "--json",
                               *args)
        assert code == 0, (args, out, err)
        return json.loads(out)

    lead = until_not(nodes["n1"], "leader", None)
    conn = next(n for n in founders if n != lead)
    st = run("status")["result"]
    assert (st["id"], st["role"], st["leader"]) == (conn, "follower", lead)
    assert st["leader_addr"] == addrs[lead]
    assert st["members"] == dict.fromkeys(founders, "voter")

    nodes["n4"] = start("n4", [*founders, "n4"], join=True)
    added = run("add", "n4", addrs["n4"])
    assert added["node"] == addrs[lead], "a follower names the leader, and it answers"
    until(nodes["n4"], "get", 1)
    conn = "n4"
    deadline = time.monotonic() + 20
    while run("status")["result"]["members"].get("n4") != "voter":  # promoted once caught up
        assert time.monotonic() < deadline, "n4 was not promoted"
        time.sleep(0.2)

    target = next(n for n in founders if n != lead)
    assert run("transfer", target)["result"] == {"leader": target}
    until(nodes["n4"], "leader", target)

    nodes[target].kill()
    deadline = time.monotonic() + 20
    while run("status")["result"]["leader"] in (None, target):
        assert time.monotonic() < deadline, "no new leader after the kill"
        time.sleep(0.2)
    assert run("remove", target)["result"]["leader"] is None
    deadline = time.monotonic() + 20
    while run("status")["result"]["members"] != {n: "voter" for n in addrs if n != target}:
        assert time.monotonic() < deadline, "the removal did not reach n4"
        time.sleep(0.2)
    assert answer(nodes["n4"], "inc") == 2

    # Refusals: one line on stderr, exit status 1, stdout saying FAIL as syncobj_admin does.
    code, out, err = admin("--conn", addrs["n4"], "--secret-file", str(secret), "add", "n5")
    assert (code, out) == (1, "FAIL ADD n5") and "raft address" in err
    code, out, err = admin("--conn", addrs["n4"], "--password", "wrong", "status", timeout=30)
    assert code == 1 and err.startswith("error: ") and "\n" not in err


@pytest.fixture
def lone() -> Iterator[RaftKV]:
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    kv = RaftKV("n1", addr, {"n1": addr}, b"lone secret")
    kv.wait_for_leader()
    yield kv
    kv.close()


def handshake(addr: str, secret: bytes) -> PeerLink:
    """A tool's side of the handshake (an empty id), ready for frames."""
    return PeerLink(addr, secret, timeout=10)


def tagged(link: PeerLink, body: bytes) -> bytes:
    """A frame holding ``body`` as it is (msgpack or not), under the link's next tag: it
    passes the node's check, so what the node does next is about the body."""
    assert link.mac is not None
    header = HEADER.pack(len(body) + 1 + TAG, VERSION)
    return header + body + link.mac.tag(header, body)


def closed(link: PeerLink) -> bool:
    s = link.sock
    s.settimeout(10)
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True


def no_tools_left(kv: RaftKV) -> None:
    """The node notices closed tool connections (on its loop, soon after)."""
    deadline = time.monotonic() + 10
    while kv.node.transport.admins:
        assert time.monotonic() < deadline, "closed tools are still counted"
        time.sleep(0.02)


def test_a_tool_is_never_a_peer_and_bad_input_closes_only_its_connection(lone: RaftKV) -> None:
    addr, t = lone.node.cfg.raft_addr, lone.node.transport
    st = AdminClient(addr, b"lone secret").request("status")
    assert (st["role"], st["connected"]) == ("leader", [])
    no_tools_left(lone)
    assert "" not in t.peers

    link = handshake(addr, b"lone secret")
    link.sock.sendall(tagged(link, b"\xc1garb"))  # a frame that is not msgpack
    assert closed(link)
    link = handshake(addr, b"lone secret")
    link.send_items([[]])  # an item that is not a request
    assert closed(link)
    link = handshake(addr, b"lone secret")
    forged = FrameMac(bytes(32))  # a key not derived from this handshake
    link.sock.sendall(encode_frame([codec.encode_admin(1, "status", [])], forged))
    assert closed(link)  # "frame authentication failed": never decoded, never answered
    link = handshake(addr, b"lone secret")
    link.send_items([codec.encode_admin(7, "status", [])])  # tagged: it is answered
    (frame,) = link.read_frames()
    assert type(frame) is list and codec.decode_admin_reply(frame[0])[:2] == (7, True)
    link.close()
    with pytest.raises(AdminError) as e:
        AdminClient(addr, b"lone secret").request("status", ["unexpected"])
    assert e.value.kind == "ValueError"
    with pytest.raises(AdminError) as e:
        AdminClient(addr, b"wrong secret", timeout=10).request("status")
    assert e.value.kind == "Unreachable"

    tools = [handshake(addr, b"lone secret") for _ in range(MAX_ADMIN)]
    with pytest.raises(AdminError):  # one too many: refused at the handshake
        AdminClient(addr, b"lone secret", timeout=10).request("status")
    for link in tools:
        link.close()
    no_tools_left(lone)
    assert lone.put("k", "v") > 0 and lone.get("k") == b"v"
    assert "" not in t.peers


def test_a_node_without_an_admin_service_says_so(lone: RaftKV) -> None:
    lone.node.admin_handler = None  # a node built on the driver alone
    with pytest.raises(AdminError) as e:
        AdminClient(lone.node.cfg.raft_addr, b"lone secret").request("status")
    assert "serves no admin requests" in str(e.value)


def test_syncobj_admin_refuses_bad_arguments_before_connecting() -> None:
    assert executeAdminCommand(["-conn", "nowhere", "-status"]) == "invalid address to connect"
    assert executeAdminCommand(["-conn", "127.0.0.1:1", "-add", "x"]) == \
        "invalid address to command add"
    assert executeAdminCommand(["-conn", "127.0.0.1:1"]) == "invalid command"
    with pytest.raises(UtilityException):
        TcpUtility("pw", timeout=5).executeCommand("127.0.0.1:1", ["status"])
    code, _, err = admin("--conn", "127.0.0.1:1", "status", timeout=30)
    assert code == 1 and err.startswith("error: cannot connect")


def test_raftkv_admin_on_a_raft_port_under_mutual_tls(tmp_path: Path) -> None:
    """Nodes whose raft port runs mutual TLS (``peer_tls``): the tool dials with TLS as a
    peer does, given the CA and a certificate it signs (the ``raftkv`` command's
    --cacert/--cert/--key, or the node's own --peer-* names), follows a follower to the
    leader under TLS, and is refused without TLS, without a certificate, or with one from
    another CA."""
    from raftkv.certs import cluster_certs, issue, make_ca
    from raftkv.tls import TlsConfig, client_context

    ids = ["n1", "n2", "n3"]
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip(ids, free_ports(3), strict=True)}
    ca, files = cluster_certs(str(tmp_path / "tls"), [*ids, "admin"])
    rogue_ca = make_ca(str(tmp_path / "rogue"))
    rogue = issue(rogue_ca, str(tmp_path / "rogue"), "admin")
    secret = tmp_path / "secret"
    secret.write_text("a tls secret\n")
    kvs = [RaftKV(n, addrs[n], addrs, b"a tls secret",
                  peer_tls=TlsConfig(files[n].cert, files[n].key, ca.cert, client_cert_auth=True))
           for n in ids]
    try:
        kvs[0].wait_for_leader()
        lead = kvs[0].leader()
        follower = next(n for n in ids if n != lead)
        mine = ["--cacert", ca.cert, "--cert", files["admin"].cert, "--key", files["admin"].key]

        code, out, err = admin("--conn", addrs[follower], "--secret-file", str(secret), *mine,
                               "--json", "status")
        assert code == 0, err
        st = json.loads(out)["result"]
        assert (st["id"], st["leader"], st["leader_addr"]) == (follower, lead, addrs[lead])
        # The raftkv command's global options may come first, as for its other commands.
        code, out, err = admin("--conn", addrs[follower], "--secret-file", str(secret),
                               "status", before=tuple(mine))
        assert code == 0 and status_lines(out)["leader"] == lead, err
        # The node's own flag names, and its own certificate, do as well.
        code, out, err = admin(
            "--conn", addrs[follower], "--secret-file", str(secret),
            "--peer-trusted-ca-file", ca.cert, "--peer-cert-file", files[follower].cert,
            "--peer-key-file", files[follower].key, "transfer", follower)
        assert (code, out) == (0, f"SUCCESS TRANSFER {follower}"), err
        deadline = time.monotonic() + 20
        while any(kv.leader() != follower for kv in kvs):
            assert time.monotonic() < deadline, "the transfer did not happen"
            time.sleep(0.1)

        # A follower (the old leader now) names the leader and the tool asks it, under
        # TLS too (the leader's certificate is checked against its own address).
        tool = AdminClient(addrs[lead], b"a tls secret", timeout=15,
                           tls=client_context(ca.cert, files["admin"].cert, files["admin"].key))
        absent = f"127.0.0.1:{free_ports(1)[0]}"
        assert "index" in tool.request("add", ["n4", absent])
        assert tool.answered_by == addrs[follower]
        tool.request("remove", ["n4"])
        assert tool.request("status")["members"] == dict.fromkeys(ids, "voter")
        conns = [c for kv in kvs for c in kv.node.transport.admins]
        assert all(c.tls is not None and c.send_mac is None for c in conns)

        refusals = {
            "no TLS": None,
            "no certificate": client_context(ca.cert),
            "another CA's certificate": client_context(ca.cert, rogue.cert, rogue.key),
            "a node from another CA": client_context(rogue_ca.cert),
        }
        for what, ctx in refusals.items():
            with pytest.raises(AdminError) as e:
                AdminClient(addrs[follower], b"a tls secret", timeout=15,
                            tls=ctx).request("status")
            assert e.value.kind == "Unreachable", what
            assert "TLS" in str(e.value), (what, str(e.value))
        assert kvs[1].put("k", "v") > 0 and kvs[2].get("k") == b"v"
    finally:
        for kv in kvs:
            kv.close()
