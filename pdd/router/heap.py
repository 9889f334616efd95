"""The router's garbage collector, set for a process that streams tokens.

A streamed token makes a handful of short-lived containers (its TokenItem, an
event, lists), which reference counting frees at once; but each allocation
counts towards the collector's next young collection, and every tenth young
collection of a tenth is a full one, which walks every object the router
holds (its requests, their traces, the tokenizer, aiohttp's and ZeroMQ's
state). At tens of thousands of tokens a second that walk runs many times a
second, inside whatever allocated last (a TokenBatch's decode, mostly).

So once the router has started, what it built to start is frozen (never
walked again: `gc.freeze`), and young collections come after YOUNG_THRESHOLD
allocations instead of 700. Reference cycles are still collected, later.
The time the collector takes is counted (pdd_router_gc_seconds_total).
"""
from __future__ import annotations

import gc
import time

YOUNG_THRESHOLD = 20_000   # allocations (less deallocations) between young collections; CPython's default is 700


class CollectorClock:
    """Seconds spent in garbage collection since install(), by generation."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info.get("generation", 0)
        self.seconds[generation] += time.perf_counter() - self._started
        self.collections[generation] += 1


CLOCK = CollectorClock()   # the process's (one router a process)


def settle_for_serving() -> None:
    """Call once the router has started: freeze what it holds, collect young
    objects less often, and count the collector's time from now."""
    CLOCK.install()
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
