"""Async scheduling: step N+1 is scheduled and launched before step N's tokens
are read, a token still in flight is fed to the next step from the device, and
the results are exactly those of waiting for every step."""
from __future__ import annotations

import random

import pytest

from pdd import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts


def _workload(seed: int):
    """Mixed lengths, greedy and seeded sampling, logprobs, shared prefixes, and
    stop tokens that end requests at steps the scheduler could not foresee."""
    rng = random.Random(seed)
    shared = random_prompts([40], seed=seed)[0]
    prompts, params = [], []
    for i, p in enumerate(random_prompts([rng.choice([1, 5, 16, 17, 33, 70]) for _ in range(24)], seed=seed + 1)):
        prompts.append(shared + p if i % 3 == 0 else p)
        kw = dict(max_tokens=rng.randint(1, 24), logprobs=2 if i % 4 == 0 else None)
        if i % 2:
            params.append(SamplingParams(temperature=0.0, **kw))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, **kw))
    return prompts, params


# An explicit pool: on a GPU the default takes 90% of the memory, and some
# tests here hold two engines at once.
POOL = 256


def _run(model, prompts, params, **engine_kw):
    engine_kw.setdefault("num_blocks", POOL)
    llm = LLM(str(model), **engine_kw)
    outs = llm.generate(prompts, params)
    assert_all_blocks_free(llm)
    return llm, [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]


@pytest.mark.parametrize("num_blocks", [None, 24])  # 24 blocks: preemptions while a step is in flight
def test_async_equals_sync(tiny_model, num_blocks):
    prompts, params = _workload(7)
    # Stop tokens: whatever the greedy requests would say at their 3rd step, so
    # they stop there while their next step has already been launched.
    _, free = _run(tiny_model, prompts, params, async_scheduling=False)
    for sp, (tokens, _, _) in zip(params, free):
        if sp.temperature == 0.0 and len(tokens) > 3:
            sp.stop_token_ids = [tokens[2]]
    kw = dict(chunk_size=32, max_num_batched_tokens=96, num_blocks=num_blocks or POOL)
    _, sync = _run(tiny_model, prompts, params, async_scheduling=False, **kw)
    llm, pipelined = _run(tiny_model, prompts, params, async_scheduling=True, **kw)
    # Tokens and finish reasons exactly; logprobs to float precision (the batches
    # differ, so do the matmuls' summation orders).
    assert [(t, r) for t, r, _ in pipelined] == [(t, r) for t, r, _ in sync]
    for (_, _, lp_async), (_, _, lp_sync) in zip(pipelined, sync):
        assert len(lp_async) == len(lp_sync)
        for (a, top_a), (b, top_b) in zip(lp_async, lp_sync):
            assert a == pytest.approx(b, abs=1e-4)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
    assert any(reason == "stop" for _, reason, _ in sync)
    if num_blocks:
        assert llm.engine.scheduler.num_preemptions > 0


def test_results_come_one_call_later_and_the_token_in_flight_is_fed_on_device(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=POOL)
    engine = llm.engine
    prompt = random_prompts([10], seed=3)[0]
    req = engine.add_request("r", prompt, greedy(4, ignore_eos=True))
    assert engine.step() == []                   # prefill launched, nothing back yet
    assert engine.in_flight is not None and req.num_in_flight == 1
    first = engine.step()                         # launches the decode of the token in flight
    assert [o.new_token_ids for o in first] == [[req.output_token_ids[0]]]
    assert req.num_computed_tokens == len(prompt) + 1 and req.num_in_flight == 1
    tokens = list(req.output_token_ids)
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    sync = LLM(str(tiny_model), num_blocks=POOL, async_scheduling=False)
    alone = sync.generate([prompt], greedy(4, ignore_eos=True))[0]
    assert tokens == alone.token_ids == req.output_token_ids
    assert_all_blocks_free(llm)


def test_a_request_that_must_end_is_not_scheduled_past_its_last_token(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=POOL)
    engine = llm.engine
    req = engine.add_request("one", random_prompts([20], seed=4)[0], greedy(1, ignore_eos=True))
    engine.step()
    assert req.num_in_flight == 1
    out = engine.scheduler.schedule()             # its only token is in flight: nothing to do
    assert not out and req.num_computed_tokens == 20
    [done] = engine.step()
    assert done.finished and done.finish_reason == "length" and len(req.output_token_ids) == 1
    assert_all_blocks_free(llm)


def test_abort_while_a_step_is_in_flight(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=POOL)
    engine = llm.engine
    for i, p in enumerate(random_prompts([30, 8], seed=5)):
        engine.add_request(f"a{i}", p, greedy(20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("a0")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"a1"}
    assert sum(len(o.new_token_ids) for o in outs) == 19  # a1's first token came before the abort
    assert_all_blocks_free(llm)


def test_reserve_waits_only_for_blocks_a_step_in_flight_may_still_write(tiny_model, monkeypatch):
    llm = LLM(str(tiny_model), num_blocks=8)  # 7 usable blocks of 16 tokens
    engine = llm.engine
    waits = []
    # Spy (not a fake): records the call, then does the real wait.
    real_wait = engine.wait_in_flight
    monkeypatch.setattr(engine, "wait_in_flight", lambda: (waits.append(1), real_wait()))
    assert engine.reserve("early", random_prompts([20], seed=1)[0], greedy(4)) is not None
    assert waits == []                            # nothing launched yet: nothing to wait for
    engine.abort_request("early")
    engine.add_request("a", random_prompts([60], seed=2)[0], greedy(20, ignore_eos=True))
    engine.step()
    engine.step()                                 # a decode of "a" is in flight
    assert engine.abort_request("a")              # its 4-5 blocks are free again, maybe still written
    blocks, _ = engine.reserve("b", random_prompts([100], seed=3)[0], greedy(4))
    assert len(blocks) == 7 and waits == [1]      # it got them, after the device finished
    assert engine.steps_done == engine.kv.pool.steps_launched
