"""Seeded sampling depends only on (seed, position): reproducible, batch-independent,
and a request restarted from its prompt plus its first k tokens continues identically."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM, SamplingParams
from pdd.engine.sampler import SamplingBatch, sample, uniform_noise, unit_float
from tests.engine.helpers import assert_all_blocks_free, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


def sampled(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, **kw)


def test_same_seed_same_tokens_other_seed_differs(llm):
    prompt = random_prompts([20], seed=4)[0]
    a = llm.generate([prompt], sampled(seed=11))[0].token_ids
    b = llm.generate([prompt], sampled(seed=11))[0].token_ids
    c = llm.generate([prompt], sampled(seed=12))[0].token_ids
    assert a == b
    assert a != c


def test_seeded_request_is_independent_of_its_batch(llm):
    prompts = random_prompts([20, 3, 60, 8], seed=4)
    alone = llm.generate([prompts[0]], sampled(seed=11))[0].token_ids
    together = llm.generate(prompts, [sampled(seed=11), sampled(seed=1), sampled(), sampled(seed=2)])
    assert together[0].token_ids == alone


@pytest.mark.parametrize("k", [1, 5, 17])
def test_restart_from_prompt_plus_k_tokens_continues_identically(llm, k):
    prompt = random_prompts([25], seed=8)[0]
    params = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, seed=1234, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(max_tokens=32, **params))[0].token_ids
    resumed = llm.generate([prompt + full[:k]], SamplingParams(max_tokens=32 - k, **params))[0].token_ids
    assert resumed == full[k:]
    assert_all_blocks_free(llm)


def test_unseeded_requests_differ(llm):
    prompt = random_prompts([10], seed=1)[0]
    outs = llm.generate([prompt] * 4, sampled())
    assert len({tuple(o.token_ids) for o in outs}) > 1


def _batch(n, **kw):
    params = [SamplingParams(**{"temperature": 1.0, **kw}).validate() for _ in range(n)]
    return SamplingBatch.build(params, list(range(n)), torch.device("cpu"))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, _batch(6, top_k=1, seed=3)).tokens, greedy)
    assert torch.equal(sample(logits, _batch(6, top_p=1e-6, seed=3)).tokens, greedy)
    assert torch.equal(sample(logits, _batch(6, min_p=1.0, seed=3)).tokens, greedy)


def test_sampling_follows_the_distribution():
    # One row, many positions: empirical frequencies approach softmax(logits).
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=1.0, seed=99).validate()] * 20000
    batch = SamplingBatch.build(params, list(range(20000)), torch.device("cpu"))
    counts = torch.bincount(sample(logits, batch).tokens, minlength=4).float() / 20000
    assert torch.allclose(counts, torch.softmax(logits[0], -1), atol=0.015)


def test_top_k_and_top_p_exclude_tail_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0]]).repeat(2000, 1)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=5).validate()] * 2000
    tokens = sample(logits, SamplingBatch.build(params, list(range(2000)), torch.device("cpu"))).tokens
    assert set(tokens.tolist()) == {0, 1}
    params = [SamplingParams(temperature=1.0, top_p=0.6, seed=5).validate()] * 2000
    tokens = sample(logits, SamplingBatch.build(params, list(range(2000)), torch.device("cpu"))).tokens
    assert set(tokens.tolist()) == {0, 1}


def test_noise_is_uniform_and_a_pure_function():
    seeds = torch.tensor([1, 1, 2], dtype=torch.int64)
    pos = torch.tensor([5, 5, 5], dtype=torch.int64)
    u = uniform_noise(seeds, pos, 100000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_logprobs_are_reported(llm):
    prompt = random_prompts([9], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for token, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and top[0][0] == token    # greedy: the sampled token is the top one
        assert lp == pytest.approx(top[0][1]) and lp <= 0.0


# ---- min_tokens: the tokens that would stop a request are not sampled before it

def test_banned_tokens_are_not_sampled_and_logprobs_stay_the_models():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0, logprobs=0).validate() for _ in range(3)]
    banned = [[int(top[0])], [], [int(top[2]), 7]]
    out = sample(logits, SamplingBatch.build(params, [0, 1, 2], torch.device("cpu"), banned=banned))
    expected = logits.clone()
    expected[0, top[0]] = expected[2, top[2]] = expected[2, 7] = float("-inf")
    assert torch.equal(out.tokens, expected.argmax(-1)) and out.tokens[1] == top[1]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.tokens[:, None])[:, 0])


def test_logit_bias_moves_the_choice_and_logprobs_stay_the_models():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    top = logits.argmax(-1)
    low = logits.argmin(-1)
    biases = [{int(low[0]): 100.0}, {}, {int(top[2]): -100.0, int(low[2]): 100.0}]
    params = [SamplingParams(temperature=0.0, logprobs=0, logit_bias=b).validate() for b in biases]
    out = sample(logits, SamplingBatch.build(params, [0, 1, 2], torch.device("cpu")))
    assert out.tokens.tolist() == [int(low[0]), int(top[1]), int(low[2])]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.tokens[:, None])[:, 0])


def test_logit_bias_reaches_the_engine_and_out_of_vocabulary_is_refused(llm):
    prompt = random_prompts([12], seed=3)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
    banned = {free[0]: -100.0}
    biased = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logit_bias=banned))[0].token_ids
    assert biased[0] != free[0] and free[0] not in biased
    forced = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={5: 100.0}))[0]
    assert forced.token_ids == [5, 5, 5]
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(Exception, match=rf"logit_bias: token id {vocab} is outside the vocabulary"):
        llm.generate([prompt], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    with pytest.raises(Exception, match=r"logit_bias\[3\]: must be"):
        SamplingParams(logit_bias={3: 101.0}).validate()
    assert_all_blocks_free(llm)


def test_min_tokens_holds_off_a_stop_token(llm):
    prompt = random_prompts([12], seed=5)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0].token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first],
                                                 min_tokens=3))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 4
    if first in held.token_ids:          # it may stop the request from the 4th token on, and then ends it
        assert held.token_ids.index(first) == len(held.token_ids) - 1 >= 3
    assert_all_blocks_free(llm)


def test_uniforms_are_never_0_or_1_whatever_the_bits():
    """u = 1 would make the Gumbel noise +inf, and a token masked to -inf (by a
    grammar, top-k, top-p) would then score NaN, which argmax picks."""
    extremes = torch.tensor([-1, (1 << 63) - 1, 0, 1, -(1 << 63), (1 << 41) - 1, -(1 << 41)], dtype=torch.int64)
    u = unit_float(extremes)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all()), u
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all()), gumbel


def test_a_masked_token_is_never_sampled_whatever_the_noise():
    """Every token but two masked out (as a grammar does), noise at its extremes:
    the pick is one of the two."""
    logits = torch.randn(4, 64)
    batch = SamplingBatch.build([SamplingParams(temperature=1.0, seed=s) for s in range(4)], [5] * 4,
                                torch.device("cpu"))
    words = torch.zeros(4, 2, dtype=torch.int32)
    words[:, 0] = 0b101          # tokens 0 and 2
    batch.allowed = words
    for bits in (-1, 0, (1 << 63) - 1):
        noise = unit_float(torch.full((4, 64), bits, dtype=torch.int64))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("pdd.engine.sampler.uniform_noise", lambda seeds, positions, vocab, n=noise: n)
            tokens = sample(logits, batch).tokens
        assert set(tokens.tolist()) <= {0, 2}, (bits, tokens)
