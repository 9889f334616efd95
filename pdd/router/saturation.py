"""The router's own limits: new requests are refused while the router itself is
saturated, whatever its workers' queues say, so that the streams it holds keep
their pace instead of all slowing down together.

One probe on the router's loop, every PROBE_INTERVAL_S, takes two readings:

    loop_lag        how late the probe ran. Saturated when each of the last
                    PROBES readings is over router.max_loop_lag_s: a loop busy
                    all the time, not one stall (a GC pause, a SIGSTOP, a
                    starved host) that is over once it is seen.
    loop_busy       the share of the last PROBES intervals the loop's thread
                    spent on a CPU: over router.max_loop_busy, the router's
                    core is spent, and a request more would slow every stream
                    it relays (the lag only grows once it is too late).
    buffered_bytes  what the HTTP connections hold that the kernel has not
                    taken yet, all together, over router.max_buffered_bytes.
    inbound_lag     how long the workers' messages have been waiting for the
                    router without a break: since its control socket was last
                    found empty after a message (the receive loop reports it,
                    `caught_up` / `behind`). Over router.max_inbound_lag_s the
                    workers make tokens faster than it relays them: every
                    stream's tokens and every new request's first token wait
                    that long in the queue, and a request more lengthens the
                    wait for all (the loop itself is not late: it takes one
                    message a turn and serves the streams between).

Admission reads the last probe's verdict (a new request costs no scan of the
connections): Overloaded, which HTTP answers 429 with Retry-After in OpenAI's
shape, counted in pdd_requests_rejected_total{reason}. Nothing already
admitted is touched.

The wait a refusal asks for is spread: Retry-After says the whole seconds of
the wait, and `retry-after-ms` (which OpenAI's SDKs honour before Retry-After)
a uniform draw in [wait / 2, 3 * wait / 2). With one fixed wait, every client
refused during one saturated spell comes back in the same instant, is admitted
together once the verdict clears, and saturates the router again at once:
admission flaps between over-full and refusing.

The wait itself is steered, once a STEER_INTERVAL_S, so that refusals come
about REFUSALS_PER_END times as fast as requests end (at least
MIN_REFUSALS_PER_S): while saturated a request is admitted only in the place of
one that ended, so fewer returns than ends leave places empty, and more only
cost a refusal each, which costs the router the CPU of 15-30 relayed tokens
(a connection's request parsed, answered and logged: 0.3-0.6 ms, read off the
16-core runs in docs/benchmarks.md, where 2,048 clients coming back each second
took half the router's core in refusals and got 44% of the peak delivered).
Over the target the wait grows in proportion (the returns' rate falls as
1 / wait); under 0.7 of it, where the returns come near the ends' own rate, it
shrinks in proportion (at most halved a step); never below RETRY_AFTER_S nor
above MAX_RETRY_AFTER_S.

While saturated, a request is still admitted when the router holds fewer
requests than it did when the verdict tripped (`in_flight`): it takes the place
of one that ended (a request of several choices, the places of as many). The
load stays where it was when the limit was met instead of draining below it
while every arrival is refused; it is never raised past that level until the
verdict clears, and the level is forgotten then (nothing is learned across
trips: a learned cap learned whatever tripped the verdict, other processes'
load included; docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter

from pdd.router.inflight import Overloaded

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.1
PROBES = 5                 # readings of the loop's lag that must all be over the limit
RETRY_AFTER_S = 1          # the shortest wait a refusal asks for
MAX_RETRY_AFTER_S = 30
STEER_INTERVAL_S = 1.0     # how often the wait is steered against the refusals' rate
REFUSALS_PER_END = 1.5     # the refusals' rate the wait aims at, against the rate requests end
MIN_REFUSALS_PER_S = 50    # ... and however few end
LOOP_LAG, LOOP_BUSY, BUFFERED_BYTES, INBOUND_LAG = "loop_lag", "loop_busy", "buffered_bytes", "inbound_lag"


class Saturation:
    def __init__(self, max_loop_lag_s: float, max_buffered_bytes: int, rejected: Counter,
                 max_loop_busy: float = 0.0, cpu_clock: Callable[[], float] = time.thread_time,
                 max_inbound_lag_s: float = 0.0, jitter: Callable[[], float] = random.random,
                 in_flight: Callable[[], int] | None = None, ended: Callable[[], int] | None = None):
        """cpu_clock: the CPU time of the thread `run` runs on (the loop's);
        jitter: a uniform draw in [0, 1) that spreads a refusal's retry-after-ms;
        in_flight: the requests the router holds now (None: every request is
        refused while saturated); ended: how many it has let go since it started
        (None: the refusals' wait is steered against MIN_REFUSALS_PER_S alone)."""
        self.max_loop_lag_s = max_loop_lag_s
        self.max_buffered_bytes = max_buffered_bytes
        self.max_loop_busy = max_loop_busy
        self.max_inbound_lag_s = max_inbound_lag_s
        self.rejected = rejected
        self.cpu_clock = cpu_clock
        self.jitter = jitter
        self.in_flight = in_flight
        self.ended = ended
        self.pinned: int | None = None     # while saturated: the requests held when it tripped
        self.retry_after_s = float(RETRY_AFTER_S)   # the mean wait a refusal asks for now (steered)
        self.refused = 0                   # refusals since the last steer
        self.steered_at: tuple[float, int] | None = None   # (monotonic, requests ended) at the last steer
        for reason in (LOOP_LAG, LOOP_BUSY, BUFFERED_BYTES, INBOUND_LAG):   # their series from the start, at 0
            rejected.labels(reason)
        self.behind_since: float | None = None   # monotonic; None: the socket was empty at the last look
        self.inbound_lag = 0.0
        self.lags: deque[float] = deque(maxlen=PROBES)
        self.clocks: deque[tuple[float, float]] = deque(maxlen=PROBES + 1)   # (wall, the loop thread's CPU)
        self.busy = 0.0
        self.buffered_bytes = 0
        self.reason: str | None = None     # why new requests are refused now, or None
        self._sources: list[Callable[[], int]] = []

    def behind(self, now: float) -> None:
        """The receive loop found another message waiting after one."""
        if self.behind_since is None:
            self.behind_since = now

    def caught_up(self) -> None:
        """... or none: the router has taken everything its workers sent."""
        self.behind_since = None

    def watch(self, buffered_bytes: Callable[[], int]) -> None:
        """Count what `buffered_bytes()` reports (an HTTP server's unsent bytes) at each probe."""
        self._sources.append(buffered_bytes)

    async def run(self) -> None:
        """The probe, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + PROBE_INTERVAL_S
            await asyncio.sleep(PROBE_INTERVAL_S)
            self.probe(loop.time() - due, loop.time(), self.cpu_clock())

    def probe(self, lag_s: float, now: float | None = None, cpu_s: float | None = None) -> None:
        self.lags.append(lag_s)
        if now is not None and cpu_s is not None:
            self.clocks.append((now, cpu_s))
            (t0, c0), (t1, c1) = self.clocks[0], self.clocks[-1]
            self.busy = (c1 - c0) / (t1 - t0) if len(self.clocks) > PROBES and t1 > t0 else 0.0
        self.buffered_bytes = sum(source() for source in self._sources)
        self.inbound_lag = now - self.behind_since if now is not None and self.behind_since is not None else 0.0
        if now is not None:
            self._steer(now)
        reason = self._verdict()
        if reason != self.reason:
            if reason is None:
                log.info("router: no longer saturated; new requests are admitted again")
                self.pinned = None
            else:
                if self.reason is None and self.in_flight is not None:
                    self.pinned = self.in_flight()
                log.warning("router: saturated (%s); new requests get 429 until it passes%s", self._why(reason),
                            f" (or take the place of one of the {self.pinned} held as it ends)"
                            if self.pinned is not None else "")
            self.reason = reason

    def _steer(self, now: float) -> None:
        """The refusals' wait against their rate and the rate requests end (see the module's doc)."""
        if self.steered_at is not None and now - self.steered_at[0] < STEER_INTERVAL_S:
            return
        ended = self.ended() if self.ended is not None else 0
        if self.steered_at is not None:   # (the first call only takes the readings)
            since, ended_then = self.steered_at
            refused_per_s = self.refused / (now - since)
            target = max(MIN_REFUSALS_PER_S, REFUSALS_PER_END * (ended - ended_then) / (now - since))
            if refused_per_s > target:
                self.retry_after_s = min(MAX_RETRY_AFTER_S, self.retry_after_s * refused_per_s / target)
            elif refused_per_s < 0.7 * target:
                self.retry_after_s = max(RETRY_AFTER_S, self.retry_after_s * max(0.5, refused_per_s / target))
        self.refused = 0
        self.steered_at = (now, ended)

    def _verdict(self) -> str | None:
        if self.max_loop_lag_s and len(self.lags) == PROBES and min(self.lags) > self.max_loop_lag_s:
            return LOOP_LAG
        if self.max_loop_busy and self.busy > self.max_loop_busy:
            return LOOP_BUSY
        if self.max_buffered_bytes and self.buffered_bytes > self.max_buffered_bytes:
            return BUFFERED_BYTES
        if self.max_inbound_lag_s and self.inbound_lag > self.max_inbound_lag_s:
            return INBOUND_LAG
        return None

    def _why(self, reason: str) -> str:
        if reason == LOOP_LAG:
            return (f"its event loop ran {min(self.lags):.2f}s late or more at each of its last {PROBES} probes; "
                    f"router.max_loop_lag_s = {self.max_loop_lag_s:g}")
        if reason == LOOP_BUSY:
            return (f"its event loop was on a CPU {100 * self.busy:.0f}% of the last "
                    f"{PROBES * PROBE_INTERVAL_S:g}s; router.max_loop_busy = {self.max_loop_busy:g}")
        if reason == INBOUND_LAG:
            return (f"its workers' messages have waited for it without a break for {self.inbound_lag:.2f}s; "
                    f"router.max_inbound_lag_s = {self.max_inbound_lag_s:g}")
        return (f"its HTTP connections hold {self.buffered_bytes} bytes not yet sent; "
                f"router.max_buffered_bytes = {self.max_buffered_bytes}")

    def check(self, choices: int = 1) -> None:
        """Overloaded (429) while the router is saturated, unless requests it held
        when it tripped have ended since, as many as the new one's `choices`
        (prompts x n: each is a request held; the new one takes their places)."""
        if self.reason is not None and (self.pinned is None or self.in_flight() + choices > self.pinned):
            self.rejected.labels(self.reason).inc()
            self.refused += 1
            wait = self.retry_after_s
            raise Overloaded(f"the router is saturated: {self._why(self.reason)}; retry later",
                             retry_after_s=math.ceil(wait), retry_after_ms=int(1000 * wait * (0.5 + self.jitter())))
