"""The request timers' clock: deadlines in a heap, earliest first.

A timer is not cancelled: each gets a sequence number (never 0) that its
request keeps while the timer still counts (RequestState.timer_seq for its
phase, deadline_seq for router.request_timeout_s). A timer that fires with a
number its request no longer holds is stale and skipped, which keeps every
phase change O(1). What a timer firing means is the state machine's
(pdd.router.control.ControlPlane.fire_timers).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator


class Timers:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []   # (deadline, timer seq, request id)
        self._seq = 0

    def add(self, deadline: float, request_id: str) -> int:
        """A timer for `request_id` at `deadline`; its sequence number."""
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, request_id))
        return self._seq

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def postpone(self, seconds: float) -> None:
        """Every deadline `seconds` later (the router stalled)."""
        self._heap = [(deadline + seconds, seq, rid) for deadline, seq, rid in self._heap]
        heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[tuple[int, str]]:
        """(timer seq, request id) of each timer due by `now`, earliest first,
        taken off as it is yielded; one added meanwhile that is due comes too."""
        while self._heap and self._heap[0][0] <= now:
            _, seq, rid = heapq.heappop(self._heap)
            yield seq, rid
