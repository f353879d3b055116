"""How an HTTP handler waits for the driver (raftkv.server.requests.wait): outcomes pass
through from the driver's thread, a hung-up client never cancels the write, and the
backstop bound turns a future that never resolves into a timeout."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future

import pytest

from raftkv.server import requests


def _resolve_later(fn) -> None:
    threading.Timer(0.05, fn).start()


def test_a_result_and_an_error_from_another_thread_reach_the_handler() -> None:
    async def main() -> None:
        ok: Future[int] = Future()
        _resolve_later(lambda: ok.set_result(7))
        assert await requests.wait(ok) == 7
        bad: Future[int] = Future()
        _resolve_later(lambda: bad.set_exception(KeyError("k")))
        with pytest.raises(KeyError):
            await requests.wait(bad)
        done: Future[int] = Future()
        done.set_result(3)  # already resolved before the wait starts
        assert await requests.wait(done) == 3

    asyncio.run(main())


def test_a_cancelled_wait_leaves_the_driver_future_to_resolve() -> None:
    async def main() -> Future[int]:
        fut: Future[int] = Future()
        task = asyncio.ensure_future(requests.wait(fut))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not fut.cancelled()
        fut.set_result(1)  # the driver finishing later is harmless
        await asyncio.sleep(0.01)
        return fut

    assert asyncio.run(main()).result() == 1


def test_a_future_that_never_resolves_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requests, "WAIT_LIMIT", 0.05)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await requests.wait(Future())

    asyncio.run(main())


def test_a_future_resolved_after_the_loop_closed_is_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fut: Future[int] = Future()

    async def main() -> None:
        task = asyncio.ensure_future(requests.wait(fut))
        await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        fut.set_result(1)  # the driver finishing after the server's loop closed
    assert not caplog.records, "a callback failed on the closed loop"
