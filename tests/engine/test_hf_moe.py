"""Mixtures of experts (Qwen3-MoE, Mixtral): the engine's greedy output equals
Hugging Face transformers' on tiny random checkpoints of both families, through
chunked prefill (a prompt longer than one chunk), prefix-cache hits and
preemption. (The model's sparse MLP runs the torch reference on the CPU;
tests/ops/test_moe_kernels.py holds the Triton kernels to it.)"""
from __future__ import annotations

import pytest

from pdd import LLM
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts
from tests.engine.test_hf_equivalence import NEW_TOKENS, hf_case, hf_greedy

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_case(request, model_factory):
    return hf_case(model_factory(request.param))


def test_config_reads_the_experts(moe_case):
    model_dir, _, _ = moe_case
    moe = LLM(str(model_dir)).engine.model_config.moe
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (8, 2, True)
    # make-model's Qwen3-MoE keeps layer 0 dense (mlp_only_layers); Mixtral has no dense layer.
    assert moe.sparse_layers == ({1, 2, 3} if "qwen3_moe" in model_dir.name else {0, 1, 2, 3})


def test_greedy_matches_hf_in_chunks(moe_case):
    model_dir, prompts, expected = moe_case
    # 16-token chunks: the 33- and 100-token prompts take several steps each.
    llm = LLM(str(model_dir), chunk_size=16, chunk_only_beside_decodes=False)
    for prompt, ref in zip(prompts, expected):
        assert llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids == ref, f"{len(prompt)} tokens"
    assert [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))] == expected
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_keep_output(moe_case):
    model_dir, prompts, expected = moe_case
    llm = LLM(str(model_dir), block_size=16)
    assert llm.generate([prompts[-1]], greedy(NEW_TOKENS))[0].token_ids == expected[-1]
    again = llm.generate([prompts[-1]], greedy(NEW_TOKENS))[0]
    assert again.num_cached_tokens == 96       # every full block but the last prompt token's
    assert again.token_ids == expected[-1]
    assert_all_blocks_free(llm)


def test_preemption_keeps_output(moe_case):
    model_dir, _, _ = moe_case
    # Long prompts (tiny Qwen3-MoE ends some short ones early): 17 usable blocks of 16
    # hold the four prompts' 20 blocks only in turns.
    prompts = random_prompts((60, 70, 80, 90), seed=3)
    expected = hf_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), num_blocks=18, block_size=16)
    outs = llm.generate(prompts, greedy(NEW_TOKENS))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert_all_blocks_free(llm)
