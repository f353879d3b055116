"""What a ``Node`` takes from the world around it: the clock, randomness, the transport,
the wake-up of its loop and worker threads.

Theory of operation
-------------------
The driver (``raftkv.node.driver``) is the only layer above the pure core with side
effects, and everything nondeterministic it does goes through one ``Runtime``, as
FoundationDB routes network, disk, clock and random numbers through one interface:

- ``clock()``: monotonic seconds. Every deadline, tick and timer of the driver and of the
  layers hosted on it (the metastore's watches, the placement manager's retries and
  survivor timers) reads this clock, never ``time`` (the server's leader balancer,
  which the simulator does not run, still does).
- ``random()``: a generator for one Raft core's election timeouts, or the node's
  request ids.
- ``transport(node, addresses)``: the peer transport, delivering received items to
  ``node._on_items`` on the loop.
- ``notify()``: wake the loop (another thread queued a call).
- ``poll(timeout)``: wait for network events or a wake-up, at most ``timeout`` seconds,
  dispatching received frames (the loop thread's only blocking point).
- ``executor(job, node_id)``: worker threads for a job (persisting several log
  environments at once, background checkpoints).
- ``spawn(fn, name)``: run ``fn`` off the loop (packing a snapshot image).

``ThreadRuntime`` is production: PySyncObj's monotonic clock, poller and wake-up pipe,
the TCP transport (``raftkv.transport.tcp``), thread pools. The placement simulator
(``raftkv.testing.placement_sim``) supplies a virtual clock, seeded generators, a
simulated network, and inline execution, and runs the very same ``Node``, metastore and
placement code one loop turn at a time (``Node.turn``), so a seed replays exactly.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from pysyncobj.monotonic import monotonic
from pysyncobj.pipe_notifier import PipeNotifier
from pysyncobj.poller import createPoller

from raftkv.transport.tcp import Transport

if TYPE_CHECKING:
    from raftkv.node.driver import Node

# Worker threads, by job: "persist" commits several log environments' Readies at once
# (see Node._handle_readies), about the number of commits whose syncs the file system can
# fold together; "checkpoint" syncs state stores (see Node._checkpoint_due). Apart, so
# that a backlog of checkpoints never holds up a turn's persist, which the loop awaits.
POOL_THREADS = {"persist": 8, "checkpoint": 4}


class Runtime(Protocol):
    def clock(self) -> float: ...

    def random(self) -> random.Random: ...

    def transport(self, node: Node, addresses: dict[str, str]) -> Transport: ...

    def notify(self) -> None: ...

    def poll(self, timeout: float) -> None: ...

    def executor(self, job: str, node_id: str) -> Executor: ...

    def spawn(self, fn: Callable[[], None], name: str) -> None: ...

    def shutdown(self) -> None: ...


class ThreadRuntime:
    """Production: real time, OS randomness, TCP on PySyncObj's poller, threads."""

    def __init__(self) -> None:
        self.poller = createPoller("auto")
        self._notifier = PipeNotifier(self.poller)
        self._pools: dict[str, ThreadPoolExecutor] = {}

    clock = staticmethod(monotonic)

    def random(self) -> random.Random:
        return random.Random()

    def transport(self, node: Node, addresses: dict[str, str]) -> Transport:
        cfg = node.cfg
        transport = Transport(
            node.id, cfg.raft_addr, cfg.secret, self.poller, node._on_items,
            addresses=addresses, on_address=node._on_address,
            on_undelivered=node._on_undelivered, on_connected=node._on_connected,
            on_admin=node._on_admin,
            faults=cfg.faults, tls=cfg.peer_tls,
        )
        transport.bind()  # an address in use fails the node's construction (Transport.bind)
        return transport

    def notify(self) -> None:
        self._notifier.notify()

    def poll(self, timeout: float) -> None:
        self.poller.poll(timeout)

    def executor(self, job: str, node_id: str) -> Executor:
        """The worker threads for ``job`` (see POOL_THREADS), started on first use."""
        pool = self._pools.get(job)
        if pool is None:
            pool = self._pools[job] = ThreadPoolExecutor(
                POOL_THREADS[job], thread_name_prefix=f"{job}-{node_id}")
        return pool

    def spawn(self, fn: Callable[[], None], name: str) -> None:
        threading.Thread(target=fn, name=name, daemon=True).start()

    def shutdown(self) -> None:
        """Wait for the worker threads (a failed persist job leaves its turn's others
        running: they must finish before the stores they write are closed)."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)

