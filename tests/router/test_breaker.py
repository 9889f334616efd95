"""Circuit breaker transitions on an injected clock."""
from __future__ import annotations

import pytest

from pdd.config import BreakerConfig
from pdd.router.breaker import CLOSED, HALF_OPEN, OPEN, PATH, Breakers

PAIR = ("p0", "d0")


def make(**kw):
    transitions = []
    b = Breakers(BreakerConfig(**kw), lambda key, old, new, cause: transitions.append((key, old, new)))
    return b, transitions


def fail(b, n, now, pair=PAIR):
    for _ in range(n):
        b.placed(*pair, now, "r")
        b.record(*pair, False, now)


def test_opens_after_consecutive_failures_and_refuses_the_pair():
    b, transitions = make(consecutive_failures=5)
    fail(b, 4, 0.0)
    assert b.allows(*PAIR, 0.0)
    fail(b, 1, 0.0)
    assert not b.allows(*PAIR, 0.0)
    assert (PAIR, CLOSED, OPEN) in transitions and (PATH, CLOSED, OPEN) in transitions


def test_opens_on_the_failure_rate_over_the_window_only():
    b, _ = make(consecutive_failures=100, window_s=30, window_min_transfers=10, failure_rate=0.5)
    for i in range(10):       # alternate: 50% failures, never 2 in a row
        b.record(*PAIR, i % 2 == 0, float(i))
    assert not b.allows(*PAIR, 10.0)
    c, _ = make(consecutive_failures=100, window_s=30, window_min_transfers=10, failure_rate=0.5)
    for i in range(10):       # the same outcomes spread over 100 s: never 10 in one window
        c.record(*PAIR, i % 2 == 0, 10.0 * i)
    assert c.allows(*PAIR, 100.0)


def test_half_open_lets_one_trial_through_and_closes_after_two_successes():
    b, transitions = make(consecutive_failures=1, cooldown_s=10, successes_to_close=2)
    fail(b, 1, 0.0)
    assert not b.allows(*PAIR, 9.9)
    assert b.allows(*PAIR, 10.0)
    b.placed(*PAIR, 10.0, "t1")
    assert not b.allows(*PAIR, 10.0)          # one trial at a time
    b.record(*PAIR, True, 11.0)
    assert b.allows(*PAIR, 11.0) and b.get(PAIR).state == HALF_OPEN
    b.placed(*PAIR, 11.0, "t2")
    b.record(*PAIR, True, 12.0)
    assert b.get(PAIR).state == CLOSED and (PAIR, HALF_OPEN, CLOSED) in transitions


def test_a_failed_trial_reopens_with_a_doubled_capped_cooldown():
    b, _ = make(consecutive_failures=1, cooldown_s=10, max_cooldown_s=30)
    fail(b, 1, 0.0)
    now = 10.0
    for expected in (20.0, 30.0, 30.0):
        b.placed(*PAIR, now, "t")
        b.record(*PAIR, False, now)
        assert b.get(PAIR).state == OPEN and b.get(PAIR).cooldown_s == expected
        assert not b.allows(*PAIR, now + expected - 0.1) and b.allows(*PAIR, now + expected)
        now += expected


def test_outcomes_of_requests_placed_before_opening_are_not_trials():
    b, _ = make(consecutive_failures=1, cooldown_s=10)
    fail(b, 1, 0.0)
    b.record(*PAIR, True, 11.0)               # a late success of an old request
    assert b.get(PAIR).trial_successes == 0 and b.allows(*PAIR, 11.0)


def test_a_trial_that_ends_without_an_outcome_lets_the_next_one_try():
    """Its client left, or it was placed again: it will never report a transfer.
    (A fault run once left a breaker half-open with no trial, for good.)"""
    b, _ = make(consecutive_failures=1, cooldown_s=10, successes_to_close=1)
    fail(b, 1, 0.0)
    b.placed(*PAIR, 10.0, "gone")
    assert not b.allows(*PAIR, 10.5)
    b.release("someone-else")
    assert not b.allows(*PAIR, 10.5)
    b.release("gone")
    assert b.allows(*PAIR, 10.5)
    b.placed(*PAIR, 11.0, "next")
    b.record(*PAIR, True, 12.0)
    assert b.get(PAIR).state == CLOSED and b.get(PATH).state == CLOSED


def test_path_breaker_stops_every_pair():
    b, _ = make(consecutive_failures=3)
    fail(b, 1, 0.0, ("p0", "d0"))
    fail(b, 1, 0.0, ("p0", "d1"))
    fail(b, 1, 0.0, ("p1", "d0"))
    assert not b.allows("p1", "d1", 0.0)      # never failed itself, but the path is open


def test_operator_forces_until_auto():
    b, _ = make()
    b.force(OPEN, [PAIR], 0.0)
    assert not b.allows(*PAIR, 0.0)
    fail(b, 0, 0.0)
    b.force(None, [PAIR], 0.0)
    assert b.allows(*PAIR, 0.0)
    b2, _ = make(consecutive_failures=1)
    fail(b2, 1, 0.0)
    b2.force(CLOSED, [PAIR, PATH], 0.0)
    assert b2.allows(*PAIR, 0.0)
    with pytest.raises(ValueError, match="open, closed or auto"):
        b2.force("sideways", [PAIR], 0.0)


def test_every_change_an_operator_makes_is_a_transition_with_its_cause():
    seen = []
    b = Breakers(BreakerConfig(consecutive_failures=1, cooldown_s=10, successes_to_close=1),
                 lambda key, old, new, cause: seen.append((key, old, new, cause)))
    b.force(OPEN, [PAIR], 0.0)
    b.force(OPEN, [PAIR], 0.0)                # already so: no change
    b.force(None, [PAIR], 0.0)
    assert seen == [(PAIR, CLOSED, OPEN, "admin"), (PAIR, OPEN, CLOSED, "admin")]
    seen.clear()
    fail(b, 1, 0.0)                           # open on its own
    b.force(CLOSED, [PAIR], 1.0)
    b.force(None, [PAIR], 20.0)               # given back past its cool-down: it reads half-open
    b.placed(*PAIR, 20.0, "trial")            # the trial moves it there: no second report
    b.record(*PAIR, True, 20.0)
    assert [t for t in seen if t[0] == PAIR] == [(PAIR, CLOSED, OPEN, "auto"), (PAIR, OPEN, CLOSED, "admin"),
                                                 (PAIR, CLOSED, HALF_OPEN, "admin"), (PAIR, HALF_OPEN, CLOSED, "auto")]


def test_snapshot_reports_failures_and_time_to_the_next_trial():
    b, _ = make(consecutive_failures=2, cooldown_s=10)
    fail(b, 2, 0.0)
    (path, pair) = b.snapshot(4.0)
    assert pair["prefill"] == "p0" and pair["state"] == "open" and pair["failures_in_window"] == 2
    assert pair["next_trial_in_s"] == 6.0 and pair["forced"] == "auto"
    assert path["prefill"] == "*"
