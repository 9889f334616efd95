"""Continuous batching: many requests at once give each request's solo result."""
from __future__ import annotations

import dataclasses
import random

import pytest

from pdd import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), chunk_size=64, max_num_batched_tokens=256)


def test_64_concurrent_mixed_requests_equal_solo_runs(llm):
    rng = random.Random(3)
    lengths = [rng.choice([1, 3, 15, 16, 17, 40, 90, 200]) for _ in range(64)]
    prompts = random_prompts(lengths, seed=5)
    params = []
    for i in range(64):
        if i % 2:
            params.append(SamplingParams(max_tokens=rng.randint(1, 48), temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(1, 48), temperature=0.9, top_p=0.9,
                                         top_k=50, seed=i, ignore_eos=True))
    together = llm.generate(prompts, params)
    assert max(len(llm.engine.scheduler.running), 0) == 0
    for prompt, sp, out in zip(prompts, params, together):
        alone = llm.generate([prompt], sp)[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == sp.max_tokens
        assert out.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_eos_stops_and_ignore_eos_continues(llm, monkeypatch):
    prompt = random_prompts([12], seed=9)[0]
    free_run = llm.generate([prompt], greedy(10, ignore_eos=True))[0].token_ids
    # The random model rarely samples its real EOS: make the third generated token the EOS.
    eos = free_run[2]
    cut = free_run.index(eos) + 1
    monkeypatch.setattr(llm.engine, "model_config",
                        dataclasses.replace(llm.engine.model_config, eos_token_ids=(eos,)))
    stopped = llm.generate([prompt], greedy(10))[0]
    assert stopped.token_ids == free_run[:cut] and stopped.finish_reason == "stop"
    ignored = llm.generate([prompt], greedy(10, ignore_eos=True))[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"
    # min_tokens holds the stop back, as in vLLM: the EOS cannot be sampled among the first
    # min_tokens tokens, and the request ends on a later EOS or at max_tokens.
    held = llm.generate([prompt], greedy(10, min_tokens=cut + 1))[0]
    assert held.token_ids[:cut - 1] == free_run[:cut - 1]       # the same up to where the EOS was
    assert eos not in held.token_ids[:cut + 1]
    assert (held.finish_reason == "length" and len(held.token_ids) == 10) or (
        held.finish_reason == "stop" and held.token_ids[-1] == eos and held.token_ids.count(eos) == 1)
    assert_all_blocks_free(llm)


def test_stop_token_ids_stop_even_when_eos_is_ignored(llm):
    prompt = random_prompts([12], seed=9)[0]
    free_run = llm.generate([prompt], greedy(10, ignore_eos=True))[0].token_ids
    stop = free_run[4]
    stopped = llm.generate([prompt], greedy(10, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert stopped.token_ids == free_run[:free_run.index(stop) + 1]
    assert stopped.finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    for i, p in enumerate(random_prompts([50, 5, 120], seed=2)):
        engine.add_request(f"a{i}", p, greedy(30))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_usable_blocks
    for i in range(3):
        assert engine.abort_request(f"a{i}")
    assert not engine.abort_request("a0")
    assert_all_blocks_free(llm)
