"""Long prompts do not hold short ones (engine.long_prefill_token_threshold):
short prompts take a step's prompt tokens first, also those queued behind a
long one; a long prompt still gets its floor every step, and the blocks for it
in its place in line. Driven on the scheduler itself (exact schedules), then
through the engine (same outputs, earlier first tokens)."""
from __future__ import annotations

import pytest

from pdd import LLM
from pdd.api import SamplingParams
from pdd.config import ConfigError, EngineConfig
from pdd.engine.request import Request
from pdd.engine.scheduler import Scheduler, SchedulerOutput
from pdd.kv.manager import KVCacheManager
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

# Budget 256 with nothing decoding: a lone prompt takes the whole step; a
# prompt is long beyond 256 tokens to compute; one at a time, its floor 64 (a quarter).
SHAPE = dict(max_num_batched_tokens=256, chunk_size=64, long_prefill_token_threshold=256, max_long_partial_prefills=1)
FLOOR = 64
SHORT_LENGTHS = [40, 120, 64, 90, 33, 100, 75, 50, 110, 48, 70, 95]


def _scheduler(num_blocks: int = 256, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(**{**SHAPE, **cfg}).validate(), KVCacheManager(num_blocks, 16))


def _add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 1, **kw) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0).validate(), **kw)
    sched.add_request(req)
    return req


def _step(sched: Scheduler) -> SchedulerOutput:
    """One step whose results come back at once; every sampled token is 7."""
    out = sched.schedule()
    sched.update_from_output(out, [7 if s else None for s in out.samples])
    return out


def _drain(sched: Scheduler, limit: int = 200) -> list[list[tuple[str, int]]]:
    trace = []
    while sched.has_unfinished():
        trace.append([(r.request_id, n) for r, n in _step(sched).scheduled])
        assert len(trace) < limit
    return trace


def _long_and_shorts(sched: Scheduler, long_len: int = 1000, **kw) -> tuple[Request, list[Request]]:
    long_prompt, *shorts = random_prompts([long_len, *SHORT_LENGTHS], seed=31)
    long = _add(sched, "long", long_prompt, **kw)
    return long, [_add(sched, f"s{i}", p, **kw) for i, p in enumerate(shorts)]


def _assert_pool_empty(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert not sched.has_unfinished() and not sched.requests
    assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.mark.parametrize("prefill_only", [False, True])
def test_short_prompts_behind_a_long_one_finish_first_and_the_long_one_keeps_its_floor(prefill_only):
    sched = _scheduler()
    long, shorts = _long_and_shorts(sched, prefill_only=prefill_only)
    first = _step(sched)
    # The shorts behind it fill the step less the long prompt's floor, which it gets.
    assert dict((r.request_id, n) for r, n in first.scheduled) == {
        "s0": 40, "s1": 120, "s2": 32, "long": FLOOR}
    assert first.scheduled[-1][0] is long
    steps = 1
    while long.num_computed_tokens < long.num_prompt_tokens:
        before, left = long.num_computed_tokens, long.num_prompt_tokens - long.num_computed_tokens
        _step(sched)
        steps += 1
        assert long.num_computed_tokens - before >= min(FLOOR, left)   # it moves every step
        if any(not s.status.finished for s in shorts):
            assert long.num_computed_tokens < long.num_prompt_tokens
    assert all(s.status.finished for s in shorts)
    assert long.status.finished and long.output_token_ids == [7]
    # The shorts' 895 tokens at 192 a step while it takes 64 (5 steps), then its last 615.
    assert steps == 8
    _assert_pool_empty(sched)


@pytest.mark.parametrize("off", [0, None])
def test_without_a_threshold_prompts_are_served_first_come_first_served(off):
    fcfs = _scheduler(long_prefill_token_threshold=off)
    _long_and_shorts(fcfs)
    trace = _drain(fcfs)
    assert trace[:4] == [[("long", 256)], [("long", 256)], [("long", 256)],
                         [("long", 232), ("s0", 24)]]
    # A threshold no prompt reaches schedules exactly the same steps.
    high = _scheduler(long_prefill_token_threshold=10**6)
    _long_and_shorts(high)
    assert _drain(high) == trace
    _assert_pool_empty(fcfs)


@pytest.mark.parametrize("max_long", [1, 2])
def test_at_most_max_long_partial_prefills_long_prompts_at_once(max_long):
    """A long prompt beyond the limit waits in its place; the short ones behind
    it go on, and it starts once the first is no longer long."""
    sched = _scheduler(max_long_partial_prefills=max_long)
    first_prompt, second_prompt, *shorts = random_prompts([600, 600, 40, 50, 60], seed=32)
    first = _add(sched, "first", first_prompt)
    second = _add(sched, "second", second_prompt)
    for i, p in enumerate(shorts):
        _add(sched, f"s{i}", p)
    out = _step(sched)
    floor = FLOOR // max_long
    if max_long == 1:
        assert [(r.request_id, n) for r, n in out.scheduled] == [("s0", 40), ("s1", 50), ("s2", 60), ("first", 106)]
        while first.num_prompt_tokens - first.num_computed_tokens > 256:
            assert second.num_computed_tokens == 0
            _step(sched)
        _step(sched)
        assert second.num_computed_tokens > 0
    else:
        assert [(r.request_id, n) for r, n in out.scheduled] == [
            ("s0", 40), ("s1", 50), ("s2", 60), ("first", 256 - 150 - floor), ("second", floor)]
    _drain(sched)
    _assert_pool_empty(sched)


def test_short_prompts_passing_a_long_one_never_take_the_blocks_of_its_floor():
    """A pool the long prompt nearly fills, and more one-block prompts arriving
    every step than there are blocks left: the long prompt's floor blocks are
    taken in its place in line, so it moves every step and ends; the short
    ones wait for the blocks, not it."""
    # 47 usable blocks (752 tokens); long to its last 32 tokens
    sched = _scheduler(num_blocks=48, long_prefill_token_threshold=32)
    long = _add(sched, "long", random_prompts([700], seed=33)[0], prefill_only=True)   # 44 blocks
    arrivals = iter(random_prompts([16] * 12 * 11, seed=34))
    shorts, waited = [], False
    for step in range(-(-700 // FLOOR)):
        arrived = [_add(sched, f"s{step}-{i}", next(arrivals), prefill_only=True) for i in range(12)]
        shorts += arrived
        before, left = long.num_computed_tokens, long.num_prompt_tokens - long.num_computed_tokens
        _step(sched)
        assert long.num_computed_tokens - before >= min(FLOOR, left)
        if step == 0:
            assert all(s.status.finished for s in arrived)     # room and blocks for all 12 beside it
        # The 12 fit the step's tokens beside the long one: one left out lacked blocks.
        waited |= any(s.num_computed_tokens == 0 for s in shorts)
    assert long.status.finished
    assert waited
    _drain(sched)
    assert all(s.status.finished for s in shorts)
    _assert_pool_empty(sched)


def test_a_preemption_takes_the_newest_request_never_one_scheduled_in_the_step():
    """Beside decodes a long prompt lets a short one arriving with it go first;
    the decodes then grow into the pool the long prompt fills: the newest
    running request is preempted (the long one, admitted last), requeued at
    the head, and everything ends with its blocks free."""
    sched = _scheduler(num_blocks=36, max_num_batched_tokens=128, chunk_size=128, long_prefill_token_threshold=128)
    a, b, long_prompt, short_prompt = random_prompts([30, 30, 500, 40], seed=35)
    _add(sched, "a", a, max_tokens=120)
    _add(sched, "b", b, max_tokens=120)
    _step(sched)                                       # both prompts; from now on they decode
    long = _add(sched, "long", long_prompt)
    short = _add(sched, "short", short_prompt)
    out = _step(sched)
    # The decodes, the short prompt whole, the long one the rest (its floor is 32).
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1), ("short", 40), ("long", 86)]
    preempted = []
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        before = [id(r) for r in sched.running]
        out = _step(sched)
        assert [id(r) for r in out.preempted] == before[::-1][:len(out.preempted)]     # newest first
        assert not {id(r) for r in out.preempted} & {id(r) for r, _ in out.scheduled}
        preempted += [r.request_id for r in out.preempted]
    assert "long" in preempted and sched.num_preemptions == len(preempted)
    assert long.output_token_ids == short.output_token_ids == [7]
    _assert_pool_empty(sched)


def test_a_long_prompt_mostly_cached_is_short():
    """What is left to compute decides: a long prompt whose prefix is cached is
    admitted with the short ones, its cached blocks taken."""
    sched = _scheduler()
    base, tail, *shorts = random_prompts([640, 40, 40, 50], seed=36)
    _add(sched, "first", base)
    _drain(sched)
    again = _add(sched, "again", base + tail)
    for i, p in enumerate(shorts):
        _add(sched, f"s{i}", p)
    out = _step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("again", 40), ("s0", 40), ("s1", 50)]
    assert again.num_cached_tokens == 640
    cold = _add(sched, "cold", random_prompts([640], seed=37)[0])
    _add(sched, "s2", random_prompts([41], seed=38)[0])
    out = _step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("s2", 41), ("cold", 215)]
    assert cold.num_cached_tokens == 0
    _drain(sched)
    _assert_pool_empty(sched)


def test_a_reserved_request_computed_here_keeps_its_place_at_the_head():
    """compute_locally puts a reserved request (holding its blocks) at the head
    of the waiting queue: it goes before the short prompts that waited, and,
    short itself, before the running long prompt's tokens beyond its floor."""
    sched = _scheduler()
    long = _add(sched, "long", random_prompts([1000], seed=40)[0])
    _step(sched)                                       # alone: the whole step
    assert long.num_computed_tokens == 256
    shorts = [_add(sched, f"s{i}", p) for i, p in enumerate(random_prompts([40, 50], seed=41))]
    reserved = Request("reserved", random_prompts([200], seed=42)[0], SamplingParams(max_tokens=1).validate())
    blocks = sched.reserve(reserved)
    sched.compute_locally("reserved")
    out = _step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("reserved", 192), ("long", FLOOR)]
    assert out.starts[0] == 0 and sched.kv.block_ids(reserved) == blocks    # its own blocks, from the start
    assert not any(s.num_computed_tokens for s in shorts)
    _drain(sched)
    _assert_pool_empty(sched)


@pytest.mark.parametrize("key, value, message", [
    ("long_prefill_token_threshold", -1, "engine.long_prefill_token_threshold: must be >= 0"),
    ("max_long_partial_prefills", 0, "engine.max_long_partial_prefills: must be >= 1"),
    ("long_prefill_min_share", 0.0, "engine.long_prefill_min_share: must be in (0, 1]"),
    ("long_prefill_min_share", 1.5, "engine.long_prefill_min_share: must be in (0, 1]"),
])
def test_bad_settings_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        EngineConfig(**{key: value}).validate()


def _first_token_steps(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[dict, dict]:
    """Each request's output and the engine step (call) that returned its first token."""
    engine = llm.engine
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, greedy(m, ignore_eos=True))
    tokens, first = {}, {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for o in engine.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, step)
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert_all_blocks_free(llm)
    return tokens, first


@pytest.mark.parametrize("num_blocks", [256, 60])   # 60: preemptions
def test_engine_outputs_are_the_same_and_short_prompts_start_sooner(tiny_model, num_blocks):
    lengths = [900, *SHORT_LENGTHS[:6], 700, *SHORT_LENGTHS[6:]]
    prompts = random_prompts(lengths, seed=39)
    max_tokens = [4 + i % 5 for i in range(len(prompts))]
    runs = {}
    for threshold in (0, 256):
        llm = LLM(str(tiny_model), num_blocks=num_blocks, **{**SHAPE, "long_prefill_token_threshold": threshold})
        runs[threshold] = _first_token_steps(llm, prompts, max_tokens)
        if num_blocks == 60:
            assert llm.engine.scheduler.num_preemptions > 0
    (fcfs, fcfs_first), (policy, policy_first) = runs[0], runs[256]
    assert policy == fcfs
    short = [str(i) for i, n in enumerate(lengths) if n <= 256]
    assert sum(policy_first[r] for r in short) < sum(fcfs_first[r] for r in short)
    behind_first_long = [str(i) for i in range(1, 7)]
    assert all(policy_first[r] < fcfs_first[r] for r in behind_first_long)


def test_a_prompt_held_back_counts_its_prefix_lookup_once():
    """A long prompt waiting behind another (max_long_partial_prefills 1) is looked
    up in the prefix cache on every step it waits; the hit statistics count the
    lookup it was admitted with, once per request."""
    sched = _scheduler()
    first, second = random_prompts([1000, 900], seed=33)
    _add(sched, "a", first)
    _add(sched, "b", second)
    _step(sched)
    assert sched.kv.num_queried_tokens == len(first)   # b waits: looked up, not counted
    while sched.has_unfinished():
        _step(sched)
    assert sched.kv.num_queried_tokens == len(first) + len(second)
    assert sched.kv.num_hit_tokens == 0
