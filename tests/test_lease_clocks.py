"""The leader's lease clocks (``raftkv.server.lease_clocks``) on a hand-driven clock."""

from __future__ import annotations

import pytest

from raftkv.server.lease_clocks import RELOAD_SECONDS, LeaseClocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_falls_due_after_its_ttl_once_until_it_is_revoked_or_retried() -> None:
    clock = Clock()
    c = LeaseClocks(clock)
    assert c.take_over(3) and not c.take_over(3)
    c.reload({7: 2})
    clock.now += 1.9
    assert c.due() == []
    clock.now += 0.1
    assert c.due() == [7] and c.due() == []  # on its way: not offered twice
    with pytest.raises(KeyError):
        c.keepalive(7)  # too late: the revoke is on its way
    c.retry(7)
    assert c.due() == [7]
    c.revoked(7)
    assert c.due() == [] and not c.knows(7)


def test_keepalive_and_grant_restart_the_clock_only_while_leading() -> None:
    clock = Clock()
    c = LeaseClocks(clock)
    c.granted(1, 5)
    assert not c.knows(1)  # not leading: no clocks
    c.take_over(2)
    c.reload({})
    c.granted(1, 5)
    clock.now += 4
    assert c.keepalive(1) == 5
    clock.now += 4
    assert c.due() == [] and c.remaining(1) == pytest.approx(1.0)
    with pytest.raises(KeyError):
        c.keepalive(99)


def test_a_new_term_restarts_every_lease_and_a_reload_drops_revoked_ones() -> None:
    clock = Clock()
    c = LeaseClocks(clock)
    c.take_over(1)
    c.reload({1: 3, 2: 3})
    clock.now += 2.5
    assert c.take_over(0) and c.due() == [] and c.remaining(1) is None
    assert c.take_over(4)
    c.reload({1: 3, 2: 3})
    assert not c.reload_due()
    clock.now += RELOAD_SECONDS
    assert c.reload_due()
    clock.now += 1.9
    assert c.due() == []  # a full TTL from the take-over, not from the first grant
    c.reload({2: 3})  # 1 was revoked through another node
    assert not c.knows(1)
    clock.now += 0.1
    assert c.due() == [2]


def test_a_lease_whose_revoke_failed_stays_doomed_until_the_term_ends() -> None:
    """A revoke that timed out may still commit: a keepalive in between must not be told
    the lease lives (a review finding). A new term starts every clock afresh."""
    clock = Clock()
    c = LeaseClocks(clock)
    c.take_over(3)
    c.reload({7: 2})
    clock.now += 2
    assert c.due() == [7]
    c.retry(7)
    with pytest.raises(KeyError):
        c.keepalive(7)
    assert c.due() == [7]  # proposed again
    c.take_over(4)
    c.reload({7: 2})
    assert c.keepalive(7) == 2
