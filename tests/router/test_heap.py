"""The router's collector settings: what it built to start is frozen, young
collections come less often, and the collector's time is counted and scraped."""
from __future__ import annotations

import gc

from prometheus_client import generate_latest

from pdd.router import heap
from pdd.router.metrics import RouterMetrics


def test_settling_freezes_the_heap_and_counts_the_collectors_time():
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        heap.settle_for_serving()
        assert gc.get_freeze_count() > frozen
        assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
        before = list(heap.CLOCK.collections)
        gc.collect()
        assert heap.CLOCK.collections == [before[0], before[1], before[2] + 1]   # one full collection, counted
        text = generate_latest(RouterMetrics().registry).decode()
        assert 'pdd_router_gc_seconds_total{generation="2"}' in text
    finally:
        heap.CLOCK.uninstall()
        gc.unfreeze()
        gc.set_threshold(*threshold)
