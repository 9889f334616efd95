"""Circuit breakers on the disaggregated path: one per prefill -> decode pair,
one for the path as a whole.

    closed ──(N failures in a row, or >= rate of >= M transfers in the window)──▶ open
    open ──(cool-down elapsed)──▶ half-open: one trial request at a time
    half-open ──(K successes)──▶ closed
    half-open ──(a failure)──▶ open, with the cool-down doubled (up to a cap)

A pair whose breaker is open gets no new disaggregated request: placement
(pdd.router.placement) picks another pair, or prefills where it decodes. The
path breaker opens when failures are everywhere (a broken data plane, a bad
deploy) so no pair is even tried until its cool-down passes. An operator may
force any breaker open or closed until it is set back to auto.

Every change of the state placement acts on is reported when it happens, with
its cause: auto (the breaker's own counts) or admin (forced, or given back to
auto). The one change not reported is an open breaker's cool-down running out:
time alone makes it read half-open (Breaker.effective), until a trial moves it.

Pure bookkeeping with an injected clock: the router's control plane records
outcomes and asks before it places; nothing here runs on its own.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.config import BreakerConfig

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}   # pdd_breaker_state
AUTO, ADMIN = "auto", "admin"                      # why a breaker moved
CAUSES = (AUTO, ADMIN)
PATH = ("*", "*")                                 # the key of the whole-path breaker


@dataclass
class Breaker:
    settings: BreakerConfig
    state: str = CLOSED
    forced: str | None = None          # open | closed: set by an operator, until "auto"
    outcomes: deque = field(default_factory=deque)   # (time, ok) within the window
    consecutive: int = 0
    opened_at: float = 0.0
    cooldown_s: float = 0.0
    trial: str | None = None           # the request on trial (half-open), until its outcome or its end
    trial_successes: int = 0
    reported: str = CLOSED             # the state on_transition last reported

    def effective(self, now: float) -> str:
        """The state placement should act on now (an open breaker past its cool-down reads half-open)."""
        if self.forced is not None:
            return self.forced
        if self.state == OPEN and now >= self.opened_at + self.cooldown_s:
            return HALF_OPEN
        return self.state

    def allows(self, now: float) -> bool:
        state = self.effective(now)
        return state == CLOSED or (state == HALF_OPEN and self.trial is None)

    def failures_in_window(self, now: float) -> int:
        self._trim(now)
        return sum(1 for _, ok in self.outcomes if not ok)

    def _trim(self, now: float) -> None:
        while self.outcomes and self.outcomes[0][0] < now - self.settings.window_s:
            self.outcomes.popleft()


class Breakers:
    """Every pair's breaker plus the path's. `on_transition(key, old, new, cause)` sees each change."""

    def __init__(self, settings: BreakerConfig, on_transition: Callable[[tuple, str, str, str], None] = None):
        self.settings = settings
        self.breakers: dict[tuple[str, str], Breaker] = {}
        self.on_transition = on_transition or (lambda key, old, new, cause: None)

    def get(self, key: tuple[str, str]) -> Breaker:
        b = self.breakers.get(key)
        if b is None:
            b = self.breakers[key] = Breaker(self.settings)
        return b

    # ---------------------------------------------------------------- asked by placement

    def allows(self, prefill: str, decode: str, now: float) -> bool:
        return self.get(PATH).allows(now) and self.get((prefill, decode)).allows(now)

    def would_allow(self, prefill: str, decode: str, now: float) -> bool:
        """`allows`, read only: a pair not seen yet is closed, and stays unlisted."""
        return all(b is None or b.allows(now) for b in (self.breakers.get(PATH), self.breakers.get((prefill, decode))))

    def placed(self, prefill: str, decode: str, now: float, request_id: str) -> None:
        """A request was placed on this pair: in half-open it is the trial."""
        for key in (PATH, (prefill, decode)):
            b = self.get(key)
            if b.forced is None and b.effective(now) == HALF_OPEN:
                self._move(key, b, HALF_OPEN)
                b.trial = request_id

    def release(self, request_id: str) -> None:
        """The request's transfer will have no outcome (aborted by its client,
        placed again, prefilled where it decodes): if it was a trial, the next
        request is. Else the breaker would stay half-open with no trial, forever."""
        for b in self.breakers.values():
            if b.trial == request_id:
                b.trial = None

    # ---------------------------------------------------------------- outcomes

    def record(self, prefill: str, decode: str, ok: bool, now: float) -> None:
        for key in (PATH, (prefill, decode)):
            self._record(key, self.get(key), ok, now)

    def _record(self, key, b: Breaker, ok: bool, now: float) -> None:
        s = self.settings
        b.outcomes.append((now, ok))
        b._trim(now)
        b.consecutive = 0 if ok else b.consecutive + 1
        if b.forced is not None:
            return   # counted, but an operator decides the state
        if b.state != CLOSED:
            if b.trial is None:
                return   # a request placed before the breaker opened: not a trial
            b.trial = None
            if not ok:
                self._open(key, b, now, min(s.max_cooldown_s, 2 * b.cooldown_s))
                return
            b.trial_successes += 1
            if b.trial_successes >= s.successes_to_close:
                b.outcomes.clear()
                b.consecutive = 0
                self._move(key, b, CLOSED)
            return
        n = len(b.outcomes)
        failed = sum(1 for _, x in b.outcomes if not x)
        if not ok and (b.consecutive >= s.consecutive_failures
                       or (n >= s.window_min_transfers and failed / n >= s.failure_rate)):
            self._open(key, b, now, s.cooldown_s)

    def _open(self, key, b: Breaker, now: float, cooldown_s: float) -> None:
        b.opened_at, b.cooldown_s, b.trial_successes, b.trial = now, cooldown_s, 0, None
        self._move(key, b, OPEN)

    def _move(self, key, b: Breaker, new: str) -> None:
        b.state = new
        self._report(key, b, new, AUTO)

    def _report(self, key, b: Breaker, new: str, cause: str) -> None:
        """Tell on_transition if `new` is not what it was told last (an open breaker
        past its cool-down already reads half-open when a trial moves it there)."""
        old, b.reported = b.reported, new
        if old != new:
            self.on_transition(key, old, new, cause)

    def forget(self, worker_id: str) -> list[tuple[str, str]]:
        """Drop every pair `worker_id` is part of (it left for good); the pairs dropped."""
        pairs = [key for key in self.breakers if key != PATH and worker_id in key]
        for key in pairs:
            del self.breakers[key]
        return pairs

    # ---------------------------------------------------------------- operator

    def force(self, state: str | None, keys: list[tuple[str, str]], now: float) -> None:
        """state: open | closed | None (auto: the breaker's own state again, as of `now`)."""
        if state not in (OPEN, CLOSED, None):
            raise ValueError(f"breaker state must be open, closed or auto, got {state!r}")
        for key in keys:
            b = self.get(key)
            b.forced = state
            self._report(key, b, b.effective(now), ADMIN)

    def snapshot(self, now: float) -> list[dict]:
        out = []
        for (prefill, decode), b in sorted(self.breakers.items()):
            state = b.effective(now)
            next_trial = max(0.0, b.opened_at + b.cooldown_s - now) if b.state == OPEN else 0.0
            out.append({"prefill": prefill, "decode": decode, "state": state,
                        "forced": b.forced or "auto", "failures_in_window": b.failures_in_window(now),
                        "consecutive_failures": b.consecutive,
                        "next_trial_in_s": round(next_trial, 3), "cooldown_s": b.cooldown_s})
        return out
