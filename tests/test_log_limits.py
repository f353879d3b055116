"""``raftkv.log_limits``: records a remote party can cause, at a bounded rate."""

from __future__ import annotations

import logging

import pytest

from raftkv.log_limits import BURST, EVERY, RateLimitedLog


def test_a_burst_per_source_and_reason_per_window_then_a_count_of_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found from outside: 3,000 HTTP requests with a bad token added 3,000 log lines,
    and a peer with the wrong secret 20 WARNINGs a second."""
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("t.limits"), logging.INFO,
                             clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="t.limits")
    for _ in range(100):
        limited.log("10.0.0.1", "unknown token", "refused %s", "GET /v1/kv/a")
    limited.log("10.0.0.2", "unknown token", "refused %s", "GET /v1/kv/b")  # another source
    shown = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(shown) == BURST + 1
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 100 - BURST
    caplog.clear()
    now[0] = EVERY + 1
    limited.log("10.0.0.1", "unknown token", "refused %s", "GET /v1/kv/a")
    (record,) = caplog.records
    assert record.getMessage() == (f"refused GET /v1/kv/a ({100 - BURST} more like it not "
                                   f"shown, from {EVERY + 1:.0f} s ago)")
