"""The prefill-time model follows the engine's queue: short prompts pass long
ones (engine.long_prefill_token_threshold). On constructed estimates, in the
estimator's bookkeeping, against the real scheduler, and through the state
machine with the threshold the workers registered (no processes)."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from pdd.api import query_key_pairs
from pdd.config import EngineConfig
from pdd.protocol import messages as m
from pdd.router.cost.estimates import WorkerEstimate
from pdd.router.estimator import LEAN_PREFILL, Estimator
from pdd.router.placement import DISAGG, LOCAL_PREFILL
from pdd.worker.stats import EngineStats, HeartbeatReader
from tests.router.sim import SimCluster
from tests.router.test_adaptive import LAYOUT, SLO, adaptive, est, estimates, prompt, worker
from tests.router.test_control import expected, run_to_end

# An H200-sized prefill worker with the engine's defaults: budget 8192, a
# prompt with more than 4096 tokens to compute is long, up to 4 of those in
# partial prefill are sure of a quarter of a step together (512 tokens each).
SHORT_FIRST = dict(budget=8192, long_threshold=4096, long_partial=4, long_share=0.25)
FIFO = dict(SHORT_FIRST, long_threshold=0)
# Two 12k prompts and 2,000 tokens of short ones pending.
QUEUE = dict(pending_tokens=26_000, pending_long_tokens=24_000, pending_long=2)


def test_a_short_prompt_waits_for_the_short_prompts_and_what_the_long_ones_take_beside_them():
    """FIFO: 26,000 tokens ahead of it. Short prompts first: its 1,000 tokens
    and the 2,000 short ones ahead fit one step beside the long prompts'
    floors (2 x 512), and the long prompts take the rest of that step."""
    p0 = est(LEAN_PREFILL, **QUEUE, **SHORT_FIRST)
    assert p0.long_floor == 512
    assert p0.ahead_of(1000, 8192, 8192) == 2000 + (8192 - 3000)
    short_first = p0.prefill_s(1000, queued=True, for_others=True)
    assert short_first == pytest.approx(2 * p0.step_s(0) + 8192 * p0.step_token_s)
    assert short_first < p0.prefill_s(1000, behind=26_000, for_others=True)
    # Many short tokens ahead: steps of 8192 - 1024 of them, each with the long prompts' floors.
    busy = est(LEAN_PREFILL, pending_tokens=44_000, pending_long_tokens=24_000, pending_long=2, **SHORT_FIRST)
    steps = math.ceil((20_000 + 1000) / (8192 - 1024))
    assert busy.ahead_of(1000, 8192, 8192) == 20_000 + min(24_000, steps * 8192 - 21_000)
    # First come, first served (threshold 0): the whole queue, as before.
    fifo = est(LEAN_PREFILL, **QUEUE, **FIFO)
    assert fifo.prefill_s(1000, queued=True, for_others=True) == fifo.prefill_s(1000, behind=26_000, for_others=True)


def test_a_long_prompt_is_predicted_behind_everything_as_before():
    p0 = est(LEAN_PREFILL, **QUEUE, **SHORT_FIRST)
    for n in (4097, 8000, 16_000):
        assert p0.prefill_s(n, queued=True, for_others=True) == p0.prefill_s(n, behind=26_000, for_others=True)
        assert p0.prefill_s(n, queued=True) == p0.prefill_s(n, behind=26_000)


def test_a_short_prompt_goes_to_the_prefill_worker_whose_queue_is_long_prompts():
    """d0 runs 20 decodes; p0's queue is mostly two long prompts. Read as
    FIFO, the queue alone (~1.3 s) is past the planned share of the TTFT
    target and the prompt prefills beside d0's decodes; with short prompts
    first it waits ~0.37 s there, and d0's decodes see no chunk. A long
    prompt is placed as before."""
    workers = [worker("p0", "prefill"), worker("d0", "decode")]

    def plan(n: int, limits: dict):
        return adaptive(prompt(n), workers, estimates(p0=est(LEAN_PREFILL, **QUEUE, **limits), d0=est(decoding=20)))

    fifo, short_first = plan(1000, FIFO), plan(1000, SHORT_FIRST)
    assert (fifo.kind, fifo.decode, fifo.reason) == (LOCAL_PREFILL, "d0", "prefill_queue")
    assert (short_first.kind, short_first.prefill, short_first.decode) == (DISAGG, "p0", "d0")
    long_fifo, long_short_first = plan(6000, FIFO), plan(6000, SHORT_FIRST)
    assert long_short_first == long_fifo and long_fifo.kind == LOCAL_PREFILL


# ---------------------------------------------------------------- threshold 0 is today's model


def fifo_prefill_s(e: WorkerEstimate, tokens: int, behind: int = 0, for_others: bool = False, cached: int = 0,
                   chunk: int = 0) -> float:
    """The prefill-time model with every prompt in arrival order, written out
    as it stood before the short-first queue (the reference)."""
    if tokens <= 0 and behind <= 0:
        return 0.0
    beside = e.decoding and not for_others
    room = max(1, e.prefill_room if beside else e.budget - e.decoding)
    own = min(e.chunk, chunk) if chunk and beside else e.chunk
    own = max(1, min(own, room) if beside or e.chunk_alone else room)
    steps = math.ceil(behind / room) + math.ceil(tokens / own)
    pairs = behind * e.prefill_depth + query_key_pairs(cached, tokens)
    return steps * e.step_s(e.decoding) + e.step_token_s * (behind + tokens) + e.step_pair_s * pairs


def random_estimate(rng: random.Random, threshold: int = 0, **kw) -> WorkerEstimate:
    """Any worker: costs, decodes, limits, and a queue split any way (what a
    worker with threshold 0 never reports, to show it is not read)."""
    budget = rng.choice((512, 2048, 8192))
    pending = rng.choice((0, rng.randrange(1, 200_000)))
    fields = dict(
        step_base_s=rng.uniform(1e-3, 2e-2), step_token_s=rng.uniform(1e-6, 1e-4),
        step_decode_s=rng.uniform(1e-6, 2e-4), step_pair_s=rng.choice((0.0, rng.uniform(1e-10, 5e-9))),
        pending_tokens=pending, pending_long_tokens=rng.randrange(0, pending + 1), pending_long=rng.randrange(0, 8),
        decoding=rng.choice((0, 0, rng.randrange(1, 300))), prefill_per_step=rng.uniform(0, budget),
        prefill_depth=rng.uniform(0, 8000), budget=budget, chunk=rng.choice((64, 256, 512, budget)),
        beside=rng.choice((0, 0, 256)), chunk_alone=rng.random() < 0.2, long_threshold=threshold,
        long_partial=rng.randrange(1, 5), long_share=rng.uniform(0.05, 1.0))
    return WorkerEstimate(**{**fields, **kw})


def test_with_threshold_0_the_prediction_is_the_fifo_formula_on_random_states():
    rng = random.Random(20261201)
    for _ in range(3000):
        e = random_estimate(rng)
        tokens, cached = rng.randrange(0, 20_000), rng.choice((0, rng.randrange(0, 10_000)))
        chunk, for_others = rng.choice((0, 64, 128, 512)), rng.random() < 0.5
        assert e.prefill_s(tokens, queued=True, for_others=for_others, cached=cached, chunk=chunk) == \
            fifo_prefill_s(e, tokens, e.pending_tokens, for_others, cached, chunk)


def test_with_threshold_0_plans_do_not_read_the_queues_split_on_random_states():
    """The same plans whether the queue is split or not: with the formula
    above, the plans adaptive placement made before the split."""
    rng = random.Random(7)
    for i in range(1000):
        workers = [worker("p0", "prefill"), worker("d0", "decode"), worker("c0", "colocated", flex=True)]
        workers = rng.sample(workers, rng.randrange(1, 4))
        leanings = {w.worker_id: rng.choice((LEAN_PREFILL, "decode")) for w in workers}
        split = {w.worker_id: random_estimate(rng, leaning=leanings[w.worker_id]) for w in workers}
        lump = {wid: WorkerEstimate(**{**e.__dict__, "pending_long_tokens": 0, "pending_long": 0})
                for wid, e in split.items()}
        request = prompt(rng.choice((10, 200, 1000, 5000, 12_000)), seed=i)
        assert adaptive(request, workers, estimates(**split)) == adaptive(request, workers, estimates(**lump))


# ---------------------------------------------------------------- the estimator's queue, by class


def test_the_estimator_splits_each_workers_queue_by_the_threshold_it_registered():
    """The heartbeat's long prompts, plus what was placed since (each prompt
    by the worker's own threshold), until the next heartbeat. A worker that
    registered none (an older one, or threshold 0) is first come, first served."""
    e = Estimator(SLO)
    short_first, fifo, d0 = worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")
    short_first.step = m.StepLimits(8192, 512, True, 0, 4096, 4, 0.25)
    for w in (short_first, fifo):
        e.observe(m.Heartbeat(w.worker_id, 3, 0, 100, 100, prefill_tokens_pending=20_000,
                              long_prefill_tokens_pending=16_000, long_prefills_pending=2))
        e.placed(w.worker_id, "d0", 300, 0.0)
        e.placed(w.worker_id, "d0", 6000, 0.0)
    ests = e.snapshot([short_first, fifo, d0], LAYOUT, 0.0).workers
    p0, p1 = ests["p0"], ests["p1"]
    assert (p0.pending_tokens, p0.pending_long_tokens, p0.pending_long) == (26_300, 22_000, 3)
    assert (p0.long_threshold, p0.long_partial, p0.long_share, p0.budget) == (4096, 4, 0.25, 8192)
    assert (p1.pending_tokens, p1.pending_long_tokens, p1.pending_long, p1.long_threshold) == (26_300, 0, 0, 0)
    e.observe(m.Heartbeat("p0", 1, 0, 100, 100, prefill_tokens_pending=700))     # what is left
    p0 = e.snapshot([short_first, fifo, d0], LAYOUT, 0.0).workers["p0"]
    assert (p0.pending_tokens, p0.pending_long_tokens, p0.pending_long) == (700, 0, 0)
    e.placed("p0", "d0", 5000, 0.0)
    e.left("p0")                                                                   # its queue went with it
    p0 = e.snapshot([short_first, fifo, d0], LAYOUT, 0.0).workers["p0"]
    assert (p0.pending_tokens, p0.pending_long_tokens, p0.pending_long) == (0, 0, 0)


def test_the_model_counts_what_the_real_scheduler_computes_before_a_short_prompt():
    """The engine's own scheduler (tests/engine/test_long_prefills.py's shape:
    budget 256, a prompt long beyond 256 tokens, one at a time, sure of 64
    tokens a step) with a long prompt and twelve short ones queued, then a new
    short prompt: the worker's heartbeat, read by the estimator, predicts the
    tokens its steps compute until the new prompt's last one."""
    from tests.engine.test_long_prefills import SHAPE, _add, _long_and_shorts, _scheduler, _step
    cfg = EngineConfig(**SHAPE)
    sched = _scheduler()
    _long_and_shorts(sched, prefill_only=True)
    heartbeat = HeartbeatReader("p0").heartbeat(
        EngineStats().snapshot(SimpleNamespace(scheduler=sched, kv=sched.kv), {}), 0.0, False)
    assert (heartbeat.long_prefill_tokens_pending, heartbeat.long_prefills_pending) == (1000, 1)
    e, p0 = Estimator(SLO), worker("p0", "prefill")
    p0.step = m.StepLimits.of(cfg)
    e.observe(heartbeat)
    predicted = e.snapshot([p0], LAYOUT, 0.0).workers["p0"]
    new = _add(sched, "new", list(range(100)), prefill_only=True)
    computed = 0
    while not new.status.finished:
        computed += _step(sched).num_tokens
    assert predicted.ahead_of(100, 256, 256) == computed - 100
    assert predicted.ahead_of(100, 256, 256) < heartbeat.prefill_tokens_pending   # FIFO would count the long one whole


# ---------------------------------------------------------------- through the state machine


@pytest.mark.parametrize("threshold,placed", [(4096, ("disagg", "p0")), (0, ("colocated", None))])
def test_the_threshold_a_prefill_worker_registered_decides_where_a_short_prompt_goes(threshold, placed):
    """p0 heartbeats two long prompts queued (24k tokens) and 2k short ones;
    d0 decodes 20 requests. A short prompt waits at p0 beside the long ones
    when p0 registered short prompts first; read FIFO, the queue is past the
    planned share of the TTFT target and d0 prefills it (the step cost is the
    model's prior: 10 ms + 50 us a token)."""
    c = SimCluster(mode="adaptive")
    c.add_worker("p0", "prefill", step=m.StepLimits(8192, 512, True, 0, threshold, 4, 0.25))
    c.add_worker("d0", "decode")
    c.control.handle("p0", m.Heartbeat("p0", 3, 0, 64, 64, prefill_tokens_pending=26_000,
                                       long_prefill_tokens_pending=24_000, long_prefills_pending=2))
    c.control.handle("d0", m.Heartbeat("d0", 20, 0, 64, 64, decoding=20))
    for w in c.workers.values():
        assert isinstance(w.inbox.pop(), m.HeartbeatAck)
    s = c.submit(max_tokens=3)
    assert (s.mode, s.prefill_worker) == placed
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
