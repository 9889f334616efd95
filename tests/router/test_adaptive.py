"""Adaptive placement on constructed cluster states, and the estimator that feeds it (no processes)."""
from __future__ import annotations

import math

import pytest

from pdd.api import StepSample, query_key_pairs
from pdd.config import AdaptiveConfig
from pdd.kv.hashing import block_hashes
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.router.cost.constants import COSTS
from pdd.router.estimator import LEAN_DECODE, LEAN_PREFILL, Estimates, Estimator, WorkerEstimate
from pdd.router.placement import DISAGG, LOCAL_PREFILL, AdaptivePolicy, ClusterView, PlaceRequest, Plan, place
from pdd.router.registry import WorkerInfo
from tests.router.sim import SimCluster
from tests.router.test_control import expected, run_to_end

LAYOUT = KVLayout("m", "0", "bfloat16", 16, 32, 8, 128)   # Llama-3-8B's KV: 128 KiB a token
SLO = AdaptiveConfig()
# A GPU-class step: 10 ms + 50 us a token; a chunk's depth costs nothing unless a test says so.
GPU = dict(step_base_s=0.01, step_token_s=5e-5, step_pair_s=0.0)


def worker(wid: str, role: str, flex: bool = False, num_blocks: int = 10_000) -> WorkerInfo:
    return WorkerInfo(wid, role, "h", 1, "cuda", LAYOUT, num_blocks, 256, 32_768,
                      data_addr="" if role == "prefill" else f"tcp://{wid}:1", transfer_backends=["cuda_ipc", "tcp"],
                      host_id="h", prefills_for_others=flex, step=m.StepLimits(2048, 512))


def estimates(**per_worker: WorkerEstimate) -> Estimates:
    return Estimates(per_worker, {"cuda_ipc": 131072 / 3e11, "tcp": 131072 / 1e9})


def est(leaning: str = LEAN_DECODE, **kw) -> WorkerEstimate:
    return WorkerEstimate(**{**GPU, **kw}, leaning=leaning)


def prompt(n: int, seed: int = 1) -> PlaceRequest:
    tokens = [(seed * 7919 + i) % 30_000 for i in range(n)]
    return PlaceRequest(block_hashes(tokens, LAYOUT.block_size), num_tokens=n, max_tokens=256)


def adaptive(request, workers, ests, pair_allowed=lambda p, d: True, slo=SLO):
    view = ClusterView.of(workers, pair_allowed=pair_allowed, estimates=ests, block_size=LAYOUT.block_size)
    return place(request, view, AdaptivePolicy(slo))


@pytest.fixture
def static_pd():
    """One prefill and one decode worker; the decode worker runs 20 requests."""
    return [worker("p0", "prefill"), worker("d0", "decode")], dict(p0=est(LEAN_PREFILL), d0=est(decoding=20))


def test_a_short_prompt_prefills_where_nothing_decodes(static_pd):
    workers, ests = static_pd
    ests["d0"] = est()
    plan = adaptive(prompt(100), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.prefill, plan.reason) == (LOCAL_PREFILL, "d0", None, "short_prompt")


def test_beside_running_decodes_a_short_prompt_goes_to_an_idle_prefill_worker(static_pd):
    """Even a 100-token chunk widens the gap of the 20 requests decoding on d0."""
    workers, ests = static_pd
    plan = adaptive(prompt(100), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.prefill) == (DISAGG, "d0", "p0")


def test_a_short_prompt_stays_beside_decodes_when_the_prefill_worker_is_queued(static_pd):
    workers, ests = static_pd
    ests["p0"] = est(LEAN_PREFILL, pending_tokens=25_000)   # ~1.4 s: within the target, past its headroom
    plan = adaptive(prompt(100), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason) == (LOCAL_PREFILL, "d0", "prefill_queue")


def test_a_long_prompt_goes_to_an_idle_prefill_worker(static_pd):
    """Locally its ~0.15 s of prefill would delay each of the 20 running decodes;
    remotely nobody waits, and the transfer's tail costs a fraction of a millisecond."""
    workers, ests = static_pd
    plan = adaptive(prompt(2000), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.prefill, plan.backend) == (DISAGG, "d0", "p0", "cuda_ipc")
    assert plan.reason == "cost" and plan.prefill_tokens == 2000


def test_a_queued_prefill_worker_misses_the_ttft_target_so_the_decode_worker_prefills(static_pd):
    workers, ests = static_pd
    ests["p0"] = est(LEAN_PREFILL, pending_tokens=100_000)      # ~5.5 s of prompts ahead
    plan = adaptive(prompt(2000), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason) == (LOCAL_PREFILL, "d0", "slo")


def test_past_the_planned_share_of_the_ttft_target_a_long_prompt_prefills_where_it_decodes(static_pd):
    """The prefill worker's queue predicts ~1.3 s: within the 2 s target but past
    the half placement plans for, so the decode worker, whose steps stay within
    the ITL target with one chunk, prefills it."""
    workers, ests = static_pd
    ests["p0"] = est(LEAN_PREFILL, pending_tokens=24_000)
    plan = adaptive(prompt(2000), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason) == (LOCAL_PREFILL, "d0", "prefill_queue")


def test_a_decode_worker_already_prefilling_does_not_take_another_chunk_per_step(static_pd):
    """100 decodes and a local prefill riding: a second chunk would make the
    gap 10 + 100 x 0.1 + 1024 x 0.025 ms = 45.6 ms, past a 40 ms ITL target;
    so the prompt waits in the prefill worker's queue, which still meets the TTFT."""
    workers, ests = static_pd
    slo = AdaptiveConfig(itl_slo_s=0.04)
    ests["p0"] = est(LEAN_PREFILL, step_token_s=2.5e-5, pending_tokens=50_000)
    ests["d0"] = est(decoding=100, step_decode_s=1e-4, step_token_s=2.5e-5, pending_tokens=3000)
    plan = adaptive(prompt(2000), workers, estimates(**ests), slo=slo)
    assert (plan.kind, plan.prefill, plan.decode) == (DISAGG, "p0", "d0")
    ests["d0"] = est(decoding=100, step_decode_s=1e-4, step_token_s=2.5e-5)       # nothing riding: one chunk fits
    plan = adaptive(prompt(2000), workers, estimates(**ests), slo=slo)
    assert (plan.kind, plan.decode, plan.reason) == (LOCAL_PREFILL, "d0", "prefill_queue")


def test_a_prefill_worker_within_its_headroom_keeps_chunks_away_from_running_decodes(static_pd):
    """~0.6 s of queue on the prefill worker costs more request-seconds than the
    local prefill's harm to two decodes, but it is within the planned share of
    the TTFT target: the prompt waits there, and the decodes see no chunk."""
    workers, ests = static_pd
    ests["p0"] = est(LEAN_PREFILL, pending_tokens=10_000)
    ests["d0"] = est(decoding=2)
    plan = adaptive(prompt(2000), workers, estimates(**ests))
    assert (plan.kind, plan.prefill, plan.decode) == (DISAGG, "p0", "d0")


def test_when_nothing_meets_the_targets_it_runs_as_colocated_on_the_least_loaded(static_pd):
    workers, ests = static_pd
    ests["p0"] = est(LEAN_PREFILL, pending_tokens=100_000)
    ests["d0"] = est(decoding=20, pending_tokens=50_000)         # both far past 2 s
    plan = adaptive(prompt(2000), workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.prefill, plan.reason) == (LOCAL_PREFILL, "d0", None, "overloaded")
    # Two workers that prefill for each other, both past the targets: the less
    # loaded one runs it whole, even the one leaning to prefill.
    flex = [worker("c0", "colocated", flex=True), worker("c1", "colocated", flex=True)]
    flex[1].inflight = 200
    both = estimates(c0=est(LEAN_PREFILL, pending_tokens=100_000), c1=est(decoding=200, pending_tokens=50_000))
    plan = adaptive(prompt(2000), flex, both)
    assert (plan.kind, plan.decode, plan.prefill, plan.reason) == (LOCAL_PREFILL, "c0", None, "overloaded")


def test_a_prompt_mostly_cached_on_the_decode_worker_prefills_there(static_pd):
    workers, ests = static_pd
    request = prompt(2000)
    workers[1].note_hashes(request.block_hashes[:120])          # 1920 of its 2000 tokens
    plan = adaptive(request, workers, estimates(**ests))
    assert (plan.kind, plan.decode, plan.reason, plan.prefill_tokens) == (LOCAL_PREFILL, "d0", "cached", 80)


def test_an_open_breaker_means_no_disaggregation(static_pd):
    workers, ests = static_pd
    plan = adaptive(prompt(2000), workers, estimates(**ests), pair_allowed=lambda p, d: False)
    assert (plan.kind, plan.decode, plan.prefill, plan.reason) == (LOCAL_PREFILL, "d0", None, "breaker_open")


def test_an_idle_decode_worker_prefills_itself_rather_than_pay_a_transfer(static_pd):
    workers, ests = static_pd
    ests["d0"] = est()
    plan = adaptive(prompt(2000), workers, estimates(**ests))
    assert (plan.kind, plan.reason) == (LOCAL_PREFILL, "cost")


def test_colocated_workers_split_by_leaning_and_decodes_avoid_the_prefill_side():
    """Two colocated workers that prefill for others: a long prompt computes on
    the one leaning to prefill and decodes on the other; so does a short one
    (its chunk would widen the gaps of c1's 30 decodes): it decodes on the
    decode-leaning worker even though the other runs fewer requests."""
    workers = [worker("c0", "colocated", flex=True), worker("c1", "colocated", flex=True)]
    ests = estimates(c0=est(LEAN_PREFILL, decoding=1, prefill_per_step=400), c1=est(decoding=30))
    long = adaptive(prompt(4000), workers, ests)
    assert (long.kind, long.prefill, long.decode) == (DISAGG, "c0", "c1")
    short = adaptive(prompt(50), workers, ests)
    assert (short.kind, short.prefill, short.decode) == (DISAGG, "c0", "c1")


def test_a_decode_leaning_worker_past_its_tpot_target_sends_decodes_to_the_prefill_side():
    workers = [worker("c0", "colocated", flex=True), worker("c1", "colocated", flex=True)]
    ests = estimates(c0=est(LEAN_PREFILL), c1=est(decoding=900))    # 10 ms + 900 x 50 us = 55 ms a token
    plan = adaptive(prompt(50), workers, ests)
    assert plan.decode == "c0"


def test_a_colocated_worker_that_does_not_prefill_for_others_takes_no_kv():
    workers = [worker("p0", "prefill"), worker("c0", "colocated")]
    plan = adaptive(prompt(2000), workers, estimates(p0=est(LEAN_PREFILL), c0=est(decoding=20)))
    assert (plan.kind, plan.decode, plan.reason) == (LOCAL_PREFILL, "c0", "no_prefill_worker")


# ---------------------------------------------------------------- the estimator


def heartbeat(wid: str, steps: list[tuple[int, float]], running: int = 0, pending: int = 0,
              decodes: list[int] | None = None, pairs: list[int] | None = None) -> m.Heartbeat:
    """steps: (tokens, seconds); `decodes` left out: every token a prompt's; `pairs`
    left out: none (steps whose cost has no depth term)."""
    decodes = decodes if decodes is not None else [0] * len(steps)
    pairs = pairs if pairs is not None else [0] * len(steps)
    samples = [StepSample(latency_s=s, num_tokens=t, num_decodes=d, prefill_pairs=p)
               for (t, s), d, p in zip(steps, decodes, pairs)]
    return m.Heartbeat(wid, running, 0, 100, 100, decoding=running, steps=samples, prefill_tokens_pending=pending)


def test_the_step_model_calibrates_from_heartbeats():
    """Steps of 4 ms + 20 us a token, mixed decode and prefill, over many heartbeats: the fit finds them."""
    e, w = Estimator(SLO), worker("c0", "colocated")
    sizes = [8, 8, 8, 8, 520, 520, 520, 520, 40, 40, 40, 40, 2048, 2048, 2048, 2048]
    for _ in range(40):
        e.observe(heartbeat("c0", [(t, 0.004 + 2e-5 * t) for t in sizes]))
    fitted = e.snapshot([w], LAYOUT, 0.0).workers["c0"]
    assert fitted.step_base_s == pytest.approx(0.004, rel=0.05)
    assert fitted.step_token_s == pytest.approx(2e-5, rel=0.05)
    # no pairs reported: a whole-budget prompt's are priced at the prior
    whole_budget = 0.004 + 2e-5 * 2048 + COSTS.prior_pair_s * query_key_pairs(0, 2048)
    assert fitted.prefill_rate == pytest.approx(2048 / whole_budget, rel=0.05)
    assert fitted.samples == 160


def test_queues_count_what_was_placed_until_the_next_heartbeat():
    e, w = Estimator(SLO), worker("d0", "decode")
    e.observe(heartbeat("d0", [], running=3, pending=100))
    e.placed("d0", "d0", 500, now=0.0)
    assert (e.snapshot([w], LAYOUT, 0.0).workers["d0"].pending_tokens,
            e.snapshot([w], LAYOUT, 0.0).workers["d0"].decoding) == (600, 4)
    e.observe(heartbeat("d0", [], running=4, pending=0))         # the worker has computed it
    assert e.snapshot([w], LAYOUT, 0.0).workers["d0"].pending_tokens == 0


def test_the_transfer_rate_follows_finished_transfers():
    e = Estimator(SLO)
    for _ in range(30):
        e.transferred("tcp", {"bytes": 2e8, "seconds": 0.1})    # 2 GB/s
    assert e.snapshot([], LAYOUT, 0.0).transfer_s("tcp", 1000) == pytest.approx(1000 * 131072 / 2e9, rel=0.01)


def test_the_prefill_side_grows_with_demand_and_shrinks_with_hysteresis():
    """Four colocated workers of ~19k prompt tokens/s each: one leans to prefill
    at no load; demand for ~2.5 of them at 70% brings in more, the least busy
    decoders first; once the demand is gone they go back, one at least staying."""
    workers = [worker(f"c{i}", "colocated", flex=True) for i in range(4)]
    e = Estimator(SLO)
    for i, w in enumerate(workers):
        e.observe(heartbeat(w.worker_id, [(t, 0.01 + 5e-5 * t) for t in [2048, 8] * 40], running=10 * i))
    assert e.snapshot(workers, LAYOUT, 0.0).workers["c0"].leaning == LEAN_PREFILL
    assert e.prefill_leaning == {"c0"}
    rate = e.snapshot(workers, LAYOUT, 0.0).workers["c0"].prefill_rate
    now = 0.0
    while e.demand(now) < 2.5 * 0.7 * rate:                       # prompts of 4k tokens, as fast as they come
        e.placed("c3", "c3", 4096, now)
        now += 0.01
    e.snapshot(workers, LAYOUT, now)
    assert e.prefill_leaning == {"c0", "c1", "c2"}
    e.snapshot(workers, LAYOUT, now + 5.0)                        # demand decays (10 s window): not yet
    assert len(e.prefill_leaning) >= 2
    e.snapshot(workers, LAYOUT, now + 120.0)
    assert e.prefill_leaning == {"c0"}


def test_a_single_colocated_worker_never_leans_to_prefill():
    e, w = Estimator(SLO), worker("c0", "colocated", flex=True)
    e.placed("c0", "c0", 100_000, 0.0)
    assert e.snapshot([w], LAYOUT, 0.0).workers["c0"].leaning == LEAN_DECODE


# ---------------------------------------------------------------- through the state machine


def test_adaptive_decisions_are_counted_and_requests_complete():
    c = SimCluster(mode="adaptive")
    c.add_worker("p0", "prefill")
    c.add_worker("d0", "decode")
    s = c.submit(max_tokens=3)                                    # 10 tokens: short, prefilled where it decodes
    assert (s.mode, s.decode_worker, s.phase) == ("colocated", "d0", "decoding")
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    counted = c.control.metrics.placements.labels("local_prefill", "short_prompt")._value.get()
    assert counted == 1


def test_a_worker_that_only_decodes_keeps_the_prior_cost_per_token():
    """Steps of one size say what a step costs, not what a token adds: the
    slope stays at the prior instead of being invented from noise."""
    e, w = Estimator(SLO), worker("d0", "decode")
    for i in range(50):
        e.observe(heartbeat("d0", [(1, 0.3 + 0.01 * ((i + j) % 3)) for j in range(8)], decodes=[1] * 8))
    fitted = e.snapshot([w], LAYOUT, 0.0).workers["d0"]
    assert fitted.step_s(1) == pytest.approx(0.31, rel=0.05)
    assert fitted.step_token_s == pytest.approx(COSTS.prior_token_s, rel=0.05)


def test_decode_and_prefill_tokens_are_fitted_apart():
    """Steps of 5 ms + 100 us a decode + 25 us a prefill token (decodes read
    their whole context; prefill tokens are matmul-bound): all three found."""
    e, w = Estimator(SLO), worker("c0", "colocated")
    mixes = [(d, p) for d in (1, 32, 96, 160) for p in (0, 0, 512, 1900 - d)]
    for _ in range(40):
        e.observe(heartbeat("c0", [(d + p, 0.005 + 1e-4 * d + 2.5e-5 * p) for d, p in mixes for _ in range(4)],
                            decodes=[d for d, _ in mixes for _ in range(4)]))
    fitted = e.snapshot([w], LAYOUT, 0.0).workers["c0"]
    assert (fitted.step_base_s, fitted.step_decode_s, fitted.step_token_s) == (
        pytest.approx(0.005, rel=0.05), pytest.approx(1e-4, rel=0.05), pytest.approx(2.5e-5, rel=0.05))


def test_a_step_that_compiled_kernels_does_not_become_the_workers_cost():
    """Seconds-long first steps (kernels compiling) count as at most three times
    the prediction: the fit stays near the real cost."""
    e, w = Estimator(SLO), worker("c0", "colocated")
    normal = ([(2048, 0.005 + 2.5e-5 * 2048)] * 4 + [(8, 0.005 + 2.5e-5 * 8)] * 4) * 2
    for _ in range(30):
        e.observe(heartbeat("c0", normal))
    e.observe(heartbeat("c0", [(2048, 5.0)] * 8))
    for _ in range(5):
        e.observe(heartbeat("c0", normal))
    fitted = e.snapshot([w], LAYOUT, 0.0).workers["c0"]
    assert fitted.step_s(0, 2048) == pytest.approx(0.005 + 2.5e-5 * 2048, rel=0.1)


def test_static_modes_count_their_decisions_too():
    c = SimCluster(mode="auto")
    c.add_worker("p0", "prefill")
    c.add_worker("d0", "decode")
    c.submit()
    c.kill("p0")
    c.submit()
    placements = c.control.metrics.placements
    assert placements.labels("disagg", "static")._value.get() == 1
    assert placements.labels("local_prefill", "no_prefill_worker")._value.get() == 1


def test_a_worker_that_only_decodes_takes_the_prefill_cost_its_peer_measured():
    """Same GPUs: the decode-leaning worker's prompt-token cost is the one the
    prefill-leaning worker measured, not its own prior."""
    e = Estimator(SLO)
    workers = [worker("c0", "colocated", flex=True), worker("c1", "colocated", flex=True)]
    for _ in range(40):
        e.observe(heartbeat("c0", [(t, 0.005 + 2.5e-5 * t) for t in [2048] * 4 + [512] * 4]))
        e.observe(heartbeat("c1", [(d, 0.004 + 1e-4 * d) for d in [20] * 4 + [90] * 4], decodes=[20] * 4 + [90] * 4))
    ests = e.snapshot(workers, LAYOUT, 0.0).workers
    assert ests["c0"].step_token_s == pytest.approx(2.5e-5, rel=0.05)
    assert ests["c1"].step_token_s == pytest.approx(2.5e-5, rel=0.05)
    assert (ests["c1"].step_base_s, ests["c1"].step_decode_s) == (pytest.approx(0.004, rel=0.05),
                                                                  pytest.approx(1e-4, rel=0.05))


def test_an_idle_worker_prefills_a_lone_prompt_in_budget_sized_steps():
    """The engine chunks a prompt only beside decodes (chunk_only_beside_decodes):
    an idle worker's 16k prompt is 8 steps of 2048, one beside 20 decodes 32 of 512."""
    idle, busy = est(), est(decoding=20)
    assert idle.prefill_s(16_384) == pytest.approx(8 * idle.step_s(0) + 16_384 * idle.step_token_s)
    assert busy.prefill_s(16_384) == pytest.approx(32 * busy.step_s(20) + 16_384 * busy.step_token_s)


def test_a_short_prompt_is_prefill_demand_only_when_sent_to_a_prefill_worker():
    e = Estimator(SLO)
    e.placed("c1", "c1", 200, 0.0)          # prefilled where it decodes
    assert e.demand(0.0) == 0.0
    e.placed("c0", "c1", 200, 0.0)          # computed by a prefill worker
    assert e.demand(0.0) == pytest.approx(200 / COSTS.demand_window_s)


def test_a_cap_on_prompt_tokens_beside_decodes_slows_a_prefill_there_not_on_an_idle_worker():
    """engine.prefill_tokens_beside_decodes, as the worker registered it."""
    capped, idle = est(decoding=20, beside=256), est(beside=256)
    assert capped.prefill_room == 256 and idle.prefill_room == 2048
    assert capped.prefill_s(2048) == pytest.approx(8 * capped.step_s(20) + 2048 * capped.step_token_s)
    assert capped.chunk_step_s() == pytest.approx(capped.step_s(20, 256))


def test_a_prefill_workers_running_prompts_are_no_decodes():
    """Its heartbeat's `running` counts the prompts it computes; only `decoding`
    is decode load: it is priced with whole-budget steps, not chunks beside decodes."""
    e, p = Estimator(SLO), worker("p0", "prefill")
    e.observe(m.Heartbeat("p0", 6, 0, 100, 100, decoding=0, prefill_tokens_pending=20_000))
    w = e.snapshot([p], LAYOUT, 0.0).workers["p0"]
    assert w.decoding == 0 and w.prefill_room == 2048
    # 2 budget-sized steps either way (a queue's depth is the one measured: none yet)
    assert w.prefill_s(4096) == pytest.approx(w.prefill_s(0, behind=4096) + w.step_pair_s * query_key_pairs(0, 4096))


def test_a_worker_that_chunks_even_alone_is_priced_so():
    always = est(chunk_alone=True)
    assert always.prefill_s(16_384) == pytest.approx(32 * always.step_s(0) + 16_384 * always.step_token_s)


def test_prompts_computed_for_others_are_priced_without_the_chunks_beside_decodes():
    """The engine schedules a prefill-only prompt as if nothing decoded: on a worker
    decoding 20 requests, a 16k prompt for another worker takes 8 budget-sized steps
    (less the decodes' room), not 32 chunks, and no cap applies."""
    busy = est(decoding=20, beside=256)
    room = busy.budget - 20
    assert busy.prefill_s(16_384, for_others=True) == pytest.approx(
        math.ceil(16_384 / room) * busy.step_s(20) + 16_384 * busy.step_token_s)
    assert busy.prefill_s(16_384) == pytest.approx(64 * busy.step_s(20) + 16_384 * busy.step_token_s)


# ---------------------------------------------------------------- a chunk's depth


def deep_steps(cost_per_pair: float) -> tuple[list[tuple[int, float]], list[int]]:
    """Prompt chunks of 512 and 2048 tokens from the start of a prompt to 14k
    deep, at 5 ms + 25 us a token + `cost_per_pair` a query-key pair."""
    steps, pairs = [], []
    for t in (512, 2048):
        for start in range(0, 14_336, 2048):
            p = query_key_pairs(start, t)
            steps.append((t, 0.005 + 2.5e-5 * t + cost_per_pair * p))
            pairs.append(p)
    return steps, pairs


def test_the_step_model_fits_what_a_chunks_depth_costs():
    """Deep chunks cost more than shallow ones of the same size: the fit finds
    the cost of a query-key pair beside the cost of a token, and the worker's
    prompts' mean depth, which prices the prompts queued there."""
    e, w = Estimator(SLO), worker("c0", "colocated")
    steps, pairs = deep_steps(2e-9)
    for _ in range(30):
        e.observe(heartbeat("c0", steps * 4, pairs=pairs * 4))
    fitted = e.snapshot([w], LAYOUT, 0.0).workers["c0"]
    assert (fitted.step_base_s, fitted.step_token_s, fitted.step_pair_s) == (
        pytest.approx(0.005, rel=0.05), pytest.approx(2.5e-5, rel=0.05), pytest.approx(2e-9, rel=0.05))
    depth = sum(pairs) / sum(t for t, _ in steps)
    assert fitted.prefill_depth == pytest.approx(depth, rel=0.01)
    assert fitted.prefill_s(0, behind=2048) == pytest.approx(
        fitted.step_s(0) + 2048 * (2.5e-5 + 2e-9 * depth), rel=0.05)
    assert fitted.chunk_step_s(512, 12_000) > fitted.chunk_step_s(512, 0) + 0.01


def test_a_worker_that_only_decodes_takes_the_depth_cost_its_peer_measured():
    e = Estimator(SLO)
    workers = [worker("c0", "colocated", flex=True), worker("c1", "colocated", flex=True)]
    steps, pairs = deep_steps(3e-9)
    for _ in range(30):
        e.observe(heartbeat("c0", steps * 4, pairs=pairs * 4))
        e.observe(heartbeat("c1", [(d, 0.004 + 1e-4 * d) for d in [20] * 4 + [90] * 4], decodes=[20] * 4 + [90] * 4))
    ests = e.snapshot(workers, LAYOUT, 0.0).workers
    assert ests["c1"].step_pair_s == pytest.approx(3e-9, rel=0.05)
    assert ests["c1"].step_token_s == pytest.approx(2.5e-5, rel=0.05)


ITL30 = AdaptiveConfig(itl_slo_s=0.03)
DEEP = dict(step_base_s=0.005, step_token_s=2.5e-5, step_decode_s=1e-4, step_pair_s=2e-9)  # ~H200, 8B


def test_a_long_prompt_prefilled_beside_decodes_gets_chunks_that_keep_the_gap(static_pd):
    """The prefill worker's queue is too long for the target: a 10k prompt
    prefills where 80 requests decode (a 13 ms step). Its deepest 512-token
    chunk would make a ~40 ms step; it gets the largest chunk whose deepest step
    stays within the ITL target (30 ms here), and still meets the planned share of the TTFT target."""
    workers, _ = static_pd
    d0 = est(decoding=80, **DEEP)
    ests = estimates(p0=est(LEAN_PREFILL, pending_tokens=60_000, **DEEP), d0=d0)
    n = 10_000
    assert d0.chunk_step_s(512, n - 512) > ITL30.itl_slo_s
    plan = adaptive(prompt(n), workers, ests, slo=ITL30)
    assert (plan.kind, plan.decode) == (LOCAL_PREFILL, "d0")
    chunk = plan.prefill_chunk
    assert 0 < chunk < 512 and chunk % 64 == 0
    assert d0.chunk_step_s(chunk, n - chunk) <= ITL30.itl_slo_s < d0.chunk_step_s(chunk + 64, n - chunk - 64)
    assert d0.prefill_s(n, chunk=chunk) <= SLO.ttft_headroom * SLO.ttft_slo_s


def test_a_local_prompt_keeps_the_workers_chunk_when_that_already_keeps_the_gap_or_the_ttft_needs_it(static_pd):
    workers, _ = static_pd
    queued = est(LEAN_PREFILL, pending_tokens=60_000, **DEEP)
    light = est(decoding=4, **DEEP)                            # 512 tokens 2k deep: ~20 ms
    plan = adaptive(prompt(2_000), workers, estimates(p0=queued, d0=light), slo=ITL30)
    assert (plan.kind, plan.prefill_chunk) == (LOCAL_PREFILL, 0)
    # beside 120 decodes, 16k tokens in chunks within 30 ms would take past 2 s: no smaller chunk helps
    plan = adaptive(prompt(16_000), workers, estimates(p0=queued, d0=est(decoding=120, **DEEP)), slo=ITL30)
    assert (plan.kind, plan.prefill_chunk) == (LOCAL_PREFILL, 0)
    # the default target (50 ms) already holds the ~36 ms deepest step of the worker's own chunk
    plan = adaptive(prompt(10_000), workers, estimates(p0=queued, d0=est(decoding=80, **DEEP)))
    assert (plan.kind, plan.prefill_chunk) == (LOCAL_PREFILL, 0)


def test_a_deep_prompt_beside_decodes_is_priced_at_its_depth(static_pd):
    """The same 6k prompt beside 80 decodes (the prefill worker is past its
    queue share, so it prefills locally): without its depth its last 512-token
    chunk looks within an ITL target of 30 ms (26 ms) and keeps the worker's
    chunk; at its depth it is not (32 ms), and it gets a smaller chunk."""
    workers, _ = static_pd
    p0 = est(LEAN_PREFILL, pending_tokens=40_000, **DEEP)
    flat = {**DEEP, "step_pair_s": 0.0}
    plans = [adaptive(prompt(6_000), workers, estimates(p0=p0, d0=est(decoding=80, **costs)), slo=ITL30)
             for costs in (flat, DEEP)]
    assert [(p.kind, p.reason) for p in plans] == [(LOCAL_PREFILL, "prefill_queue")] * 2
    assert plans[0].prefill_chunk == 0
    assert 0 < plans[1].prefill_chunk < 512


def test_a_sized_local_chunk_reaches_the_worker_in_its_admit(monkeypatch):
    """Through the state machine: the plan's chunk travels in Admit.prefill_chunk,
    and a request placed again after a failure carries none. (The decision is
    forced with a stub of place(), tested on its own above.)"""
    import pdd.router.control as control
    c = SimCluster(mode="adaptive")
    c.add_worker("d0", "decode")
    monkeypatch.setattr(control, "place", lambda request, *a, **kw: Plan(
        "d0", kind=LOCAL_PREFILL, reason="slo", prefill_chunk=0 if request.colocated_only else 128))
    s = c.submit(max_tokens=3)
    admits = [msg for msg in c.workers["d0"].inbox if isinstance(msg, m.Admit)]
    assert (s.mode, [a.prefill_chunk for a in admits]) == ("colocated", [128])
    c.restart("d0")                      # its requests are placed again
    admits = [msg for msg in c.workers["d0"].inbox if isinstance(msg, m.Admit)]
    assert [a.prefill_chunk for a in admits] == [0]
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))


def test_noisy_steps_do_not_trade_the_pair_cost_for_the_token_cost():
    """Short prompts' first chunks: their pairs rise with their tokens, and
    noise could move cost from one slope to the other (seen on one H200: 2 ps a
    pair, 41 us a token, where 1.6 ns and 20 us fit). The pair cost is held
    toward its prior harder than the others: both stay near the truth."""
    import random
    rng = random.Random(7)
    e, w = Estimator(SLO), worker("c0", "colocated")
    for _ in range(60):
        sizes = [rng.choice((64, 200, 380, 512)) for _ in range(16)]
        pairs = [query_key_pairs(rng.choice((0, 0, 256)), t) for t in sizes]
        steps = [(t, (0.005 + 2e-5 * t + 1.6e-9 * p) * rng.uniform(0.8, 1.2)) for t, p in zip(sizes, pairs)]
        e.observe(heartbeat("c0", steps, pairs=pairs))
    fitted = e.snapshot([w], LAYOUT, 0.0).workers["c0"]
    assert fitted.step_token_s == pytest.approx(2e-5, rel=0.25)
    assert fitted.step_pair_s == pytest.approx(1.6e-9, rel=0.5)
