"""PySyncObj programs on raftkv.compat.pysyncobj as real processes, SIGKILLed and restarted.

The programs (tests/procs/pysyncobj_*.py) are PySyncObj's README counter and its
ReplDict + ReplLockManager app with only their imports changed; the test drives them
through stdin and reads JSON answers from stdout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from programs import Program, answer, leader_of, until

from raftkv.compat.pysyncobj import FAIL_REASON
from raftkv.testing.procs import free_ports


@pytest.fixture
def programs() -> Iterator[list[Program]]:
    started: list[Program] = []
    yield started
    for p in started:
        p.kill()


def test_readme_counter_processes_survive_sigkill(tmp_path: Path, programs: list[Program]
                                                  ) -> None:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]

    def args(i: int) -> list[str]:
        return [str(tmp_path / f"journal{i}"), addrs[i], *[a for a in addrs if a != addrs[i]]]

    nodes = [Program("pysyncobj_counter.py", args(i), tmp_path / f"n{i}.log") for i in range(3)]
    programs.extend(nodes)
    # The counts below are exact: start once a leader is agreed, not during the birth.
    leader_of(nodes, addrs)
    for i in range(5):
        assert nodes[i % 3].ask("inc") == i + 1
    assert nodes[1].ask("add 10 4") == [15, 4]  # a tuple, as JSON
    lead = leader_of(nodes, addrs)
    nodes[lead].kill()  # the leader dies mid-flight: the others elect and go on
    alive = [n for i, n in enumerate(nodes) if i != lead]
    leader_of(alive, [a for i, a in enumerate(addrs) if i != lead])
    assert alive[0].ask("inc") == 16
    nodes[lead].start()
    until(nodes[lead], "get", 16)
    for n in nodes:  # now every process at once
        n.kill()
    for n in nodes:
        n.start()
    # Replayed from each node's own log before any election, up to the commit index it
    # knew (a follower may not have heard that 16 committed before the kill).
    assert all(n.ask("get") in (15, 16) for n in nodes)
    for n in nodes:
        until(n, "get", 16)
    assert answer(nodes[2], "inc") == 17
    until(nodes[0], "get", 17)


def test_dict_and_lock_app_processes_survive_sigkill(tmp_path: Path, programs: list[Program]
                                                     ) -> None:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    unlock = 2.0

    def args(i: int) -> list[str]:
        return [str(tmp_path / f"journal{i}"), f"client{i}", str(unlock), addrs[i],
                *[a for a in addrs if a != addrs[i]]]

    nodes = [Program("pysyncobj_kvlock.py", args(i), tmp_path / f"n{i}.log") for i in range(3)]
    programs.extend(nodes)
    # A new cluster's first leader may be replaced under load before it answers: the
    # call's outcome is then unknown (its entry may have been overwritten), and setting
    # the same value again is safe.
    assert answer(nodes[0], "set testKey1 testValue1") is None
    until(nodes[2], "get testKey1", "testValue1")
    assert nodes[0].ask("acquire job") is True
    assert nodes[1].ask("acquire job") is False
    assert nodes[0].ask("check job") is True
    nodes[0].kill()  # the lock holder crashes: nobody prolongs its lock
    killed = time.monotonic()
    # Not acquired while the dead holder's lock lasts: refused, or a call caught by the
    # leader's death whose outcome is unknown (FAIL_REASON: it may still be waiting).
    first = nodes[1].ask("acquire job")
    assert first is False or isinstance(first, dict), first
    until(nodes[1], "acquire job", True, timeout=unlock + 15)
    assert time.monotonic() - killed >= unlock * 0.7
    assert nodes[2].ask("acquire job") is False
    nodes[0].start()
    until(nodes[0], "get testKey1", "testValue1")
    assert nodes[0].ask("check job") is False
    for n in nodes:
        n.kill()
    for n in nodes:
        n.start()
    assert [n.ask("get testKey1") for n in nodes] == ["testValue1"] * 3
    assert answer(nodes[2], "set testKey2 v2") is None
    until(nodes[0], "get testKey2", "v2")


def test_dynamic_membership_processes(tmp_path: Path, programs: list[Program]) -> None:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(4)]
    founders = addrs[:3]

    def args(i: int, partners: list[str]) -> list[str]:
        return [str(tmp_path / f"journal{i}"), addrs[i], *partners, "--dynamic"]

    nodes = [Program("pysyncobj_counter.py", args(i, [a for a in founders if a != addrs[i]]),
                     tmp_path / f"n{i}.log") for i in range(3)]
    programs.extend(nodes)
    # As above: the counts are exact, so start once a leader is agreed. A call made
    # during the birth may be forwarded to a leader that loses its term before it appends
    # the call; that call then fails (UNKNOWN_OUTCOME), and 'get' below was one short.
    leader_of(nodes, founders)
    assert [nodes[0].ask("inc") for _ in range(3)] == [1, 2, 3]
    fourth = Program("pysyncobj_counter.py", args(3, founders), tmp_path / "n3.log")
    programs.append(fourth)
    assert nodes[1].ask(f"addnode {addrs[3]}") == FAIL_REASON.SUCCESS
    until(fourth, "get", 3)
    fourth.kill()
    assert nodes[2].ask("inc") == 4
    fourth.start()  # restarted from its own data directory, as a member
    until(fourth, "get", 4)
    assert fourth.ask("inc") == 5
    until(nodes[0], "get", 5)
    assert nodes[0].ask(f"removenode {addrs[3]}") == FAIL_REASON.SUCCESS
    assert nodes[0].ask("inc") == 6
    time.sleep(0.5)
    assert fourth.ask("get") == 5, "a removed node still receives the log"
