"""Programs run as real processes, driven through stdin, answering JSON lines on stdout.

The programs are in tests/procs/. ``Program`` starts one (its stderr goes to a log file),
``ask`` sends a command line and returns the ``ok`` of its answer, ``kill`` SIGKILLs it
and ``start`` starts it again with the same arguments. Used by
tests/test_compat_pysyncobj_procs.py and tests/test_admin.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROCS = Path(__file__).parent / "procs"
ROOT = Path(__file__).resolve().parent.parent


class Program:
    """One program process; ``ask`` sends a command line and returns its answer."""

    def __init__(self, script: str, args: list[str], log: Path) -> None:
        self.script, self.args, self.log = script, args, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""
        self.start()

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(PROCS / self.script), *self.args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                start_new_session=True)
        self.buf = b""
        assert "started" in self._line(30)

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise AssertionError(f"{self.script} {self.args}: no answer in {timeout}s; "
                                     f"see {self.log}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"{self.script} exited; see {self.log}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str, timeout: float = 30.0) -> Any:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self._line(timeout)["ok"]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def until(program: Program, command: str, expect: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = program.ask(command)
        if got == expect:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{command!r} answered {got!r}, not {expect!r}")
        time.sleep(0.1)


def answer(program: Program, command: str, timeout: float = 20.0) -> Any:
    """The first answer that is not a FAIL_REASON: a command caught by a leader's death
    may fail (UNKNOWN_OUTCOME, when its entry does not reach the node in time), as in
    PySyncObj."""
    deadline = time.monotonic() + timeout
    while True:
        got = program.ask(command)
        if not (isinstance(got, dict) and "error" in got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{command!r} kept failing: {got!r}")
        time.sleep(0.1)


def leader_of(programs: list[Program], addrs: list[str]) -> int:
    deadline = time.monotonic() + 20
    while True:
        lead = programs[0].ask("leader")
        if lead in addrs and all(p.ask("leader") == lead for p in programs):
            return addrs.index(lead)
        assert time.monotonic() < deadline, "no agreed leader"
        time.sleep(0.1)
