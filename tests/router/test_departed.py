"""Workers that leave: what the router keeps of them (breaker pairs, estimates,
metric series) waits router.forget_after_s for them to come back under their
id, then goes. Simulated cluster, simulated clock."""
from __future__ import annotations

import pytest

from pdd.api import StepSample
from pdd.protocol import messages as m
from tests.router.sim import SimCluster
from tests.router.test_control import run_to_end

GRACE_S = 60.0


def busy_heartbeat(wid: str) -> m.Heartbeat:
    """A heartbeat with steps and prefix-cache lookups in it: per-worker series and a step-time fit."""
    step = StepSample(latency_s=0.01, num_tokens=17, num_decodes=1, prefill_chunks=[16])
    return m.Heartbeat(wid, 1, 0, 60, 64, steps=[step] * 4, prefix_hit_tokens=16, prefix_query_tokens=40)


def cluster_with_history() -> SimCluster:
    """p0 prefills for d0 and d1; each pair has been placed on, d1's pair has
    failed transfers (its breaker opened), every worker has reported steps;
    a request ran to its end on each pair (latency and transfer series)."""
    c = SimCluster(forget_after_s=GRACE_S)
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        c.add_worker(wid, role)
    for busy, idle in (("d0", "d1"), ("d1", "d0")):
        c.registry.workers[idle].draining = True
        c.submit()
        c.registry.workers[idle].draining = False
    run_to_end(c)
    for _ in range(5):
        c.control.breakers.record("p0", "d1", False, c.clock())
    for wid in c.workers:
        c.control.handle(wid, busy_heartbeat(wid))
    c.control.show_breakers()
    return c


def series(c: SimCluster, worker_id: str) -> list[str]:
    """Metric lines labelled with `worker_id` (as a worker, a prefill or a decode side)."""
    return [line for line in c.control.metrics.render().decode().splitlines()
            if not line.startswith("#") and f'"{worker_id}"' in line]


def kept(c: SimCluster, worker_id: str) -> dict:
    return {"breakers": sorted(k for k in c.control.breakers.breakers if worker_id in k),
            "estimate": worker_id in c.control.estimator.workers,
            "series": {line.split("{")[0] for line in series(c, worker_id)}}


def test_a_departed_worker_is_forgotten_after_the_grace_period_and_one_back_in_time_keeps_all():
    c = cluster_with_history()
    d0_before, d1_before = kept(c, "d0"), kept(c, "d1")
    assert d1_before["breakers"] == [("p0", "d1")] and d1_before["estimate"]
    assert {"pdd_breaker_state", "pdd_breaker_transitions_total", "pdd_scheduler_iteration_latency_seconds_count",
            "pdd_prefill_chunk_size_tokens_count", "pdd_decode_batch_size_requests_count",
            "pdd_prefix_cache_hit_tokens_total", "pdd_prefix_cache_query_tokens_total",
            "pdd_time_to_first_token_seconds_count", "pdd_inter_token_latency_seconds_count",
            "pdd_time_per_output_token_seconds_count", "pdd_prefill_to_decode_kv_transfer_seconds_count",
            "pdd_kv_transfer_bytes_total"} <= d1_before["series"]
    c.kill("d1")
    c.kill("d0")
    c.advance(GRACE_S / 2)
    assert c.control.membership.forget_departed() == []
    c.add_worker("d0", "decode")          # a new process under d0's id, within the grace period
    c.advance(GRACE_S / 2)
    assert c.control.membership.forget_departed() == ["d1"]
    assert kept(c, "d1") == {"breakers": [], "estimate": False, "series": set()}
    assert kept(c, "d0") == d0_before
    assert c.control.membership.departed == {} and ("*", "*") in c.control.breakers.breakers
    c.check()


def test_a_router_stall_does_not_count_against_a_departed_worker():
    """As for liveness and request timers: the time the router itself did
    not run is nobody's, so a worker back right after it is not forgotten."""
    c = cluster_with_history()
    c.kill("d1")
    c.advance(GRACE_S + 5)
    c.control.router_stalled(GRACE_S)   # the router's timer loop found it woke that late
    assert c.control.membership.forget_departed() == []
    c.add_worker("d1", "decode")
    assert kept(c, "d1")["breakers"] == [("p0", "d1")]


def test_the_settings_are_checked_naming_the_key():
    from pdd.config import ConfigError
    from pdd.config_loader import load_cluster_config
    with pytest.raises(ConfigError, match="router.forget_after_s: must be >= 0"):
        load_cluster_config(env={"PDD_ROUTER__FORGET_AFTER_S": "-1"})
    with pytest.raises(ConfigError, match="worker.worker_id: must be 1 to 200 bytes, got 201"):
        load_cluster_config(env={"PDD_WORKER__WORKER_ID": "w" * 201})
    assert load_cluster_config(env={}).router.forget_after_s == 300.0
