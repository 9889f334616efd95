"""An FP8 (e4m3) KV cache in the engine on the CPU (the torch reference ops):
greedy output is deterministic, close to a float32 cache's, and unchanged by
prefix-cache hits and chunking; the checkpoint's scales reach every layer, and
a checkpoint's KV scales serve as the same scales set by hand do."""
from __future__ import annotations

import logging

import pytest
import torch

from pdd import LLM
from pdd.api import SamplingParams
from pdd.kv.scales import KVScales
from pdd.model.make_model import make_model
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

FP8 = dict(kv_cache_dtype="fp8_e4m3", num_blocks=256)


def prompt_top1_and_logprobs(llm, prompts):
    """Teacher-forced: at every prompt position, the top-1 token and the logprob of the prompt's next token."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    return [[(top[0][0], lp) for lp, _, top in o.prompt_logprobs] for o in outs]


def closeness(llm, ref: LLM, prompts) -> tuple[float, float]:
    """(share of prompt positions where llm's top-1 token is ref's, mean |logprob difference|)."""
    pairs = [(a, b) for r, g in zip(prompt_top1_and_logprobs(ref, prompts), prompt_top1_and_logprobs(llm, prompts))
             for a, b in zip(r, g)]
    return (sum(a[0] == b[0] for a, b in pairs) / len(pairs),
            sum(abs(a[1] - b[1]) for a, b in pairs) / len(pairs))


def test_fp8_kv_is_deterministic_and_close_to_a_float32_cache(tiny_model):
    """Exact tokens are not the check: e4m3 keeps 3 mantissa bits (a value is
    rounded by up to 6.25%; 2.4% on average over this model's K and V), and on
    a random-weight model whose top-1 margins are thin even a bf16 model leaves
    float32's greedy path within a few tokens. Teacher-forced, position by
    position (no divergence compounds), the FP8 cache must pick float32's top-1
    token at >= 85% of positions (measured 91%; bf16 weights and cache: 98%)
    and move the prompt tokens' logprobs by <= 0.3 on average (measured 0.18;
    bf16: 0.05). A cache whose scales were applied wrongly, or not at all on one
    side, is far outside both bounds."""
    prompts = random_prompts([64] * 8, seed=3)
    fp8 = LLM(str(tiny_model), **FP8)
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    agree, drift = closeness(fp8, LLM(str(tiny_model), num_blocks=256), prompts)
    assert agree >= 0.85 and drift <= 0.3, (agree, drift)
    # Deterministic: a second engine generates the same tokens.
    first = [o.token_ids for o in fp8.generate(prompts, greedy(24, ignore_eos=True))]
    again = LLM(str(tiny_model), **FP8).generate(prompts, greedy(24, ignore_eos=True))
    assert [o.token_ids for o in again] == first
    assert_all_blocks_free(fp8)


def test_fp8_kv_prefix_cache_hits_and_chunks_keep_output(tiny_model):
    """Attention reads every token's K/V from the cache (quantized) whether it
    was computed in this step, an earlier chunk or found in the prefix cache:
    so hits and chunking give exactly the output of one uncached prefill."""
    base = random_prompts([100], seed=4)[0]                 # 6 full blocks of 16
    branch = base[:70] + random_prompts([20], seed=5)[0]     # shares 4 full blocks
    plain = LLM(str(tiny_model), enable_prefix_caching=False, **FP8)
    expected = [o.token_ids for o in plain.generate([base, branch], greedy(30, ignore_eos=True))]
    llm = LLM(str(tiny_model), chunk_size=7, chunk_only_beside_decodes=False, **FP8)
    first = llm.generate([base], greedy(30, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0 and first.token_ids == expected[0]
    hit = llm.generate([branch], greedy(30, ignore_eos=True))[0]
    assert hit.num_cached_tokens == 64 and hit.token_ids == expected[1]
    again = llm.generate([base], greedy(30, ignore_eos=True))[0]
    assert again.num_cached_tokens == 96 and again.token_ids == expected[0]
    assert_all_blocks_free(llm)


def with_checkpoint_scales(monkeypatch, scales: KVScales) -> None:
    """Puts `scales` on CausalLM.kv_scales by hand, where the loader puts an FP8
    checkpoint's k_scale/v_scale tensors: the tiny checkpoint has none."""
    from pdd.engine import model_runner

    real = model_runner.load_model

    def load(*a, **kw):
        model = real(*a, **kw)
        model.kv_scales = scales
        return model
    monkeypatch.setattr(model_runner, "load_model", load)


def test_checkpoint_scales_reach_every_layer(tiny_model, monkeypatch):
    scales = KVScales.from_values([0.5, 1.0, 2.0, 0.25], [1.0, 2.0, 0.5, 4.0])
    with_checkpoint_scales(monkeypatch, scales)
    llm = LLM(str(tiny_model), **FP8)
    assert llm.engine.runner.kv_scales == scales
    assert [layer.self_attn.kv_scale for layer in llm.engine.runner.model.model.layers] == \
        [(0.5, 1.0), (1.0, 2.0), (2.0, 0.5), (0.25, 4.0)]
    # Stored divided by its scale, read multiplied by it: as close to a float32
    # cache as with unit scales (see the test above).
    agree, drift = closeness(llm, LLM(str(tiny_model), num_blocks=256), random_prompts([64] * 8, seed=3))
    assert agree >= 0.85 and drift <= 0.3, (agree, drift)
    # Without an FP8 cache the scales have nothing to scale.
    assert LLM(str(tiny_model), num_blocks=64).engine.runner.kv_scales is None


def test_checkpoint_scales_must_cover_every_layer(tiny_model, monkeypatch):
    with_checkpoint_scales(monkeypatch, KVScales.unit(3))
    with pytest.raises(ValueError, match="KV scales cover 3 layers, the model has 4"):
        LLM(str(tiny_model), **FP8)


def test_a_checkpoints_kv_scales_serve_as_the_same_scales_set_by_hand(tmp_path, monkeypatch, caplog):
    """An FP8 checkpoint with KV scales (llm-compressor's kv_cache_scheme) generates
    what the same weights without them generate with those scales put on the
    model by hand; its layout identity is theirs, not "unit"."""
    scaled = make_model(tmp_path / "scaled", "tiny", "llama", fp8="compressed", kv_scales="random")
    plain = make_model(tmp_path / "plain", "tiny", "llama", fp8="compressed")  # the same weights
    prompts = random_prompts([5, 40, 100], seed=7)
    with caplog.at_level(logging.INFO, logger="pdd.engine.model_runner"):
        llm = LLM(str(scaled), **FP8)
    assert "K and V scales from the checkpoint" in caplog.text
    scales = llm.engine.runner.kv_scales
    assert scales == llm.engine.runner.model.kv_scales and scales.k != (1.0,) * 4
    assert scales.identity().startswith("b2:")
    got = [o.token_ids for o in llm.generate(prompts, greedy(24, ignore_eos=True))]
    with_checkpoint_scales(monkeypatch, scales)
    by_hand = LLM(str(plain), **FP8)
    assert by_hand.engine.runner.kv_scales.identity() == scales.identity()
    assert [o.token_ids for o in by_hand.generate(prompts, greedy(24, ignore_eos=True))] == got
    assert_all_blocks_free(llm)


def test_a_checkpoints_kv_scales_are_unused_by_a_cache_in_the_model_dtype(tmp_path, caplog):
    scaled = make_model(tmp_path / "scaled", "tiny", "llama", fp8="tensor", kv_scales=0.5)
    with caplog.at_level(logging.INFO, logger="pdd.engine.model_runner"):
        llm = LLM(str(scaled), num_blocks=64)
    assert llm.engine.runner.kv_scales is None and llm.engine.runner.model.kv_scales is not None
    assert "the checkpoint's FP8 KV scales are unused: engine.kv_cache_dtype is auto" in caplog.text
    assert llm.generate(random_prompts([9], seed=1), greedy(4))[0].token_ids
