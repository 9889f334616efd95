"""Greedy output of the engine equals Hugging Face transformers' greedy output,
for every supported family, however the engine slices the work (chunk sizes,
prefix caching, preemption, batching)."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (1, 7, 16, 33, 100)
NEW_TOKENS = 40


def hf_greedy(model_dir, prompts, max_new_tokens=NEW_TOKENS) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def arch_case(request, model_factory):
    return hf_case(model_factory(request.param))


def hf_case(model_dir):
    """(model_dir, prompts of PROMPT_LENGTHS, HF's greedy tokens for each)."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    return model_dir, prompts, hf_greedy(model_dir, prompts)


def test_greedy_matches_hf(arch_case):
    model_dir, prompts, expected = arch_case
    llm = LLM(str(model_dir))
    outs = llm.generate(prompts, greedy(NEW_TOKENS))
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def llama_case(model_factory):
    return hf_case(model_factory("llama"))


@pytest.mark.parametrize("chunk_size", [16, 7, 4096], ids=["one-block", "odd", "whole-prompt"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_chunked_prefill_and_prefix_cache_keep_output(llama_case, chunk_size, prefix_caching):
    model_dir, prompts, expected = llama_case
    llm = LLM(str(model_dir), chunk_size=chunk_size, enable_prefix_caching=prefix_caching,
              chunk_only_beside_decodes=False)     # a lone prompt chunked too
    # One at a time, then all together: chunks of several prompts share steps.
    for prompt, ref in zip(prompts, expected):
        assert llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids == ref
    assert [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))] == expected
    assert_all_blocks_free(llm)


def test_shared_prefix_is_served_from_cache(llama_case):
    model_dir, prompts, expected = llama_case
    base = prompts[-1]                      # 100 tokens: 6 full blocks of 16
    llm = LLM(str(model_dir), block_size=16)
    first = llm.generate([base], greedy(NEW_TOKENS))[0]
    assert first.num_cached_tokens == 0
    assert first.token_ids == expected[-1]
    # Same first 70 tokens, different tail: 4 full blocks (64 tokens) are reused.
    branch = base[:70] + random_prompts([20], seed=7)[0]
    second = llm.generate([branch], greedy(NEW_TOKENS))[0]
    assert second.num_cached_tokens == 64
    assert second.token_ids == hf_greedy(model_dir, [branch])[0]
    # The identical prompt again: every full block but the one holding the last
    # prompt token is a hit (a step must compute at least one token).
    again = llm.generate([base], greedy(NEW_TOKENS))[0]
    assert again.num_cached_tokens == 96
    assert again.token_ids == expected[-1]
    assert_all_blocks_free(llm)


def test_preemption_under_small_kv_budget(llama_case):
    model_dir, prompts, expected = llama_case
    # 17 usable blocks of 16 tokens cannot hold the five requests' 24 blocks at once.
    llm = LLM(str(model_dir), num_blocks=18, block_size=16)
    outs = llm.generate(prompts, greedy(NEW_TOKENS))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert_all_blocks_free(llm)
