"""Placement on constructed cluster states: what every policy shares, and the
threshold policy (the peers' rule: uncached prompt tokens and the prefill queue)."""
from __future__ import annotations

import dataclasses

import pytest

from pdd.config import ROUTER_MODES, ConfigError, RouterConfig, ThresholdConfig
from pdd.config_loader import build
from pdd.protocol import messages as m
from pdd.router.placement import (DISAGG, LOCAL_PREFILL, ClusterView, PlaceRequest, ThresholdPolicy, place,
                                  policy_for)
from tests.router.sim import SimCluster
from tests.router.test_adaptive import LAYOUT, est, estimates, prompt, worker
from tests.router.test_control import expected, run_to_end

THRESHOLD = ThresholdConfig(max_local_prefill_tokens=512, max_prefill_queue_tokens=32_768)


def threshold(request, workers, ests, pair_allowed=lambda p, d: True, cfg=THRESHOLD, exclude=frozenset()):
    view = ClusterView.of(workers, exclude, pair_allowed, ests, LAYOUT.block_size)
    return place(request, view, ThresholdPolicy(cfg))


@pytest.fixture
def pd():
    """One prefill worker, one decode worker with 20 requests decoding, nothing queued."""
    return [worker("p0", "prefill"), worker("d0", "decode")], dict(p0=est(), d0=est(decoding=20))


def test_a_prompt_of_at_most_the_threshold_uncached_prefills_where_it_decodes(pd):
    """Even beside running decodes and with an idle prefill worker: the rule
    looks at the prompt, not at what its chunks do to the decodes."""
    workers, ests = pd
    plan = threshold(prompt(512), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.prefill, plan.reason, plan.prefill_tokens) == (
        LOCAL_PREFILL, "d0", None, "short_prompt", 512)
    plan = threshold(prompt(513), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.prefill, plan.backend, plan.reason, plan.prefill_tokens) == (
        DISAGG, "d0", "p0", "cuda_ipc", "long_prompt", 513)


def test_the_threshold_counts_the_tokens_the_decode_worker_does_not_cache(pd):
    workers, ests = pd
    request = prompt(2000)
    workers[1].note_hashes(request.block_hashes[:100])            # 1600 of its 2000 tokens
    plan = threshold(request, workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason, plan.prefill_tokens) == (LOCAL_PREFILL, "d0", "cached", 400)
    workers[1].cached_hashes.clear()
    workers[0].note_hashes(request.block_hashes[:100])            # cached where it would be computed: sent
    plan = threshold(request, workers, estimates(**ests))
    assert (plan.kind, plan.prefill, plan.reason, plan.prefill_tokens) == (DISAGG, "p0", "long_prompt", 400)


def test_a_full_prefill_queue_keeps_a_long_prompt_where_it_decodes(pd):
    workers, ests = pd
    ests["p0"] = est(pending_tokens=32_768)
    plan = threshold(prompt(4000), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason, plan.prefill_tokens) == (LOCAL_PREFILL, "d0", "prefill_queue", 4000)
    ests["p0"] = est(pending_tokens=32_767)
    assert threshold(prompt(4000), workers, estimates(**ests)).prefill == "p0"


def test_of_two_prefill_workers_the_least_loaded_with_room_computes_it():
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    workers[1].inflight = 50                                      # p1 busier by requests ...
    ests = estimates(p0=est(), p1=est(), d0=est(decoding=20))
    assert threshold(prompt(4000), workers, ests).prefill == "p0"
    ests = estimates(p0=est(pending_tokens=40_000), p1=est(), d0=est(decoding=20))   # ... but p0's queue is full
    assert threshold(prompt(4000), workers, ests).prefill == "p1"


def test_without_a_usable_prefill_worker_the_decode_worker_prefills_and_says_why(pd):
    workers, ests = pd
    plan = threshold(prompt(4000), workers, estimates(**ests), pair_allowed=lambda p, d: False)
    assert (plan.kind, plan.decode, plan.reason) == (LOCAL_PREFILL, "d0", "breaker_open")
    other_host = [dataclasses.replace(workers[0], transfer_backends=["cuda_ipc"], host_id="other"), workers[1]]
    assert threshold(prompt(4000), other_host, estimates(**ests)).reason == "no_backend"
    plan = threshold(prompt(4000), workers, estimates(**ests), exclude=frozenset({"p0"}))
    assert (plan.kind, plan.reason) == (LOCAL_PREFILL, "no_prefill_worker")


def test_a_colocated_worker_that_takes_no_kv_runs_the_request_whole():
    workers = [worker("p0", "prefill"), worker("c0", "colocated")]
    plan = threshold(prompt(4000), workers, estimates(p0=est(), c0=est()))
    assert (plan.kind, plan.decode, plan.prefill, plan.reason) == ("colocated", "c0", None, "colocated_worker")
    flex = [worker("p0", "prefill"), worker("c0", "colocated", flex=True)]
    plan = threshold(prompt(4000), flex, estimates(p0=est(), c0=est()))
    assert (plan.kind, plan.decode, plan.prefill) == (DISAGG, "c0", "p0")


def test_with_no_decode_capable_worker_left_a_prefill_worker_runs_it(pd):
    workers, ests = pd
    plan = threshold(prompt(4000), workers, estimates(**ests), exclude=frozenset({"d0"}))
    assert (plan.decode, plan.prefill, plan.reason) == ("p0", None, "no_decode_worker")


# ---------------------------------------------------------------- every policy


@pytest.mark.parametrize("mode", ROUTER_MODES)
def test_every_mode_names_a_policy_of_that_name(mode):
    assert policy_for(RouterConfig(mode=mode)).name == mode


@pytest.mark.parametrize("mode", ROUTER_MODES)
def test_every_policy_sees_the_same_exclusions_and_breaker(mode):
    """Built once in ClusterView: an excluded or drained worker and a pair whose
    breaker is open are never chosen, whatever the policy."""
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"), worker("d1", "decode"),
               worker("d2", "decode")]
    workers[4].draining = True
    ests = estimates(p0=est(leaning="prefill"), p1=est(leaning="prefill"), d0=est(decoding=20),
                     d1=est(decoding=20), d2=est())
    view = ClusterView.of(workers, frozenset({"d0"}), lambda p, d: p != "p0", ests, LAYOUT.block_size)
    plan = place(prompt(4000), view, policy_for(RouterConfig(mode=mode)))
    assert plan.decode == "d1" and plan.prefill in (None, "p1")


@pytest.mark.parametrize("mode", ROUTER_MODES)
def test_a_placement_after_a_failure_prefills_where_it_decodes_whatever_the_policy(mode):
    workers = [worker("p0", "prefill"), worker("d0", "decode")]
    request = dataclasses.replace(prompt(4000), colocated_only=True)
    view = ClusterView.of(workers, estimates=estimates(p0=est(), d0=est()), block_size=LAYOUT.block_size)
    plan = place(request, view, policy_for(RouterConfig(mode=mode)))
    assert (plan.decode, plan.prefill, plan.reason) == ("d0", None, "placed_again")


# ---------------------------------------------------------------- settings and the state machine


def test_threshold_settings_are_checked_and_named():
    cfg = build(RouterConfig, {"mode": "threshold"}, "router",
                env={"PDD_ROUTER__THRESHOLD__MAX_LOCAL_PREFILL_TOKENS": "1024"})
    assert (cfg.mode, cfg.threshold.max_local_prefill_tokens, cfg.threshold.max_prefill_queue_tokens) == (
        "threshold", 1024, 32_768)
    with pytest.raises(ConfigError, match="router.threshold.max_prefill_queue_tokens: must be >= 1"):
        build(RouterConfig, {"threshold": {"max_prefill_queue_tokens": 0}}, "router", env={})
    with pytest.raises(ConfigError, match="router.threshold.max_local_prefill_tokens: must be >= 0"):
        build(RouterConfig, {}, "router", env={"PDD_ROUTER__THRESHOLD__MAX_LOCAL_PREFILL_TOKENS": "-1"})
    with pytest.raises(ConfigError, match=r"\[router.threshold\]: unknown key"):
        build(RouterConfig, {"threshold": {"max_queue": 3}}, "router", env={})


def test_the_prefill_queue_counts_what_was_placed_until_the_next_heartbeat():
    """Through the state machine (10-token prompts): each long prompt queues its
    tokens on the prefill worker at once, so the third finds the queue full and
    prefills where it decodes; the worker's heartbeat then says what is left."""
    c = SimCluster(mode="threshold", threshold=ThresholdConfig(max_local_prefill_tokens=4, max_prefill_queue_tokens=15))
    c.add_worker("p0", "prefill")
    c.add_worker("d0", "decode")
    first, second, third = c.submit(max_tokens=3), c.submit(max_tokens=3), c.submit(max_tokens=3)
    assert [(s.mode, s.prefill_worker) for s in (first, second, third)] == [
        ("disagg", "p0"), ("disagg", "p0"), ("colocated", None)]
    c.control.handle("p0", m.Heartbeat("p0", 0, 0, 64, 64, prefill_tokens_pending=0))
    fourth = c.submit(max_tokens=3)
    assert (fourth.mode, fourth.prefill_worker) == ("disagg", "p0")
    run_to_end(c)
    for s in (first, second, third, fourth):
        assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    placements = c.control.metrics.placements
    assert placements.labels("disagg", "long_prompt")._value.get() == 3
    assert placements.labels("local_prefill", "prefill_queue")._value.get() == 1


def test_a_router_spreads_its_requests_between_heartbeats_by_the_load_the_workers_reported():
    """Several routers: a worker's load is what it reported (every router's
    requests) moved by what this router placed there since. Between two
    heartbeats the requests a router places spread over the workers instead
    of all going to the one that last reported least."""
    from pdd.router.placement import pick_worker
    from pdd.router.registry import WorkerRegistry
    registry = WorkerRegistry(0.5, 3, 5.0)
    c = SimCluster()
    for wid in ("c0", "c1"):
        c.add_worker(wid, "colocated")
        registry.workers[wid] = c.registry.workers[wid]
    for wid, running in (("c0", 10), ("c1", 12)):   # the other routers' requests, as reported
        registry.heartbeat(m.Heartbeat(wid, running=running, waiting=0, free_blocks=64, total_blocks=64))
    picked = []
    for _ in range(6):
        w = pick_worker(registry.workers.values(), [])
        w.inflight += 1   # this router placed one there
        picked.append(w.worker_id)
    assert picked.count("c0") == 4 and picked.count("c1") == 2


def test_what_a_worker_holds_in_its_host_kv_tier_counts_as_cached_and_is_priced_as_a_load(pd):
    """The heartbeats' host_hashes: blocks a worker loads from host memory
    instead of computing. Affinity and the threshold rule count them as cached;
    the cost model adds their load time (bytes over COSTS.host_load_bytes_s)."""
    from pdd.router.cost.constants import COSTS
    from pdd.router.registry import WorkerRegistry
    workers, ests = pd
    registry = WorkerRegistry(0.5, 3, 5.0)
    decode = registry.workers["d0"] = workers[1]
    request = prompt(2000)
    block_bytes = 2 * 32 * 8 * 128 * 2 * LAYOUT.block_size
    registry.heartbeat(m.Heartbeat("d0", 0, 0, 64, 64, recent_hashes=request.block_hashes[:40],
                                   host_hashes=request.block_hashes[:100],
                                   host_kv={"capacity_blocks": 1000, "bytes_per_block": block_bytes}))
    assert decode.tiered_prefix_match(request.block_hashes) == (100, 60)
    assert request.cached_on(decode, LAYOUT.block_size) == 1600
    assert request.host_load_s(decode) == pytest.approx(60 * block_bytes / COSTS.host_load_bytes_s)
    plan = threshold(request, workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason, plan.prefill_tokens) == (LOCAL_PREFILL, "d0", "cached", 400)
    assert request.host_load_s(workers[0]) == 0.0   # the prefill worker holds none of it
