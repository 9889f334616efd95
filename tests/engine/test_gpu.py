"""The GPU path end to end (skipped without CUDA): the engine on the GPU (Triton
kernels, decode CUDA graphs) gives the CPU engine's greedy tokens, which equal
HF transformers' (test_hf_equivalence.py)."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# qwen3_moe, mixtral: the fused MoE kernels (per-pair GEMV in decode graphs, grouped GEMM in 64-token chunks).
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_gpu_engine_matches_cpu_engine(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts([1, 7, 16, 33, 100, 300], seed=2)
    cpu = LLM(str(model_dir), device="cpu")
    expected = [o.token_ids for o in cpu.generate(prompts, greedy(40))]
    # A small KV budget: the default takes 90% of the GPU, and an engine of an
    # earlier test may not be collected yet.
    gpu = LLM(str(model_dir), device="cuda", dtype="float32", chunk_size=64, kv_cache_bytes=512 * 2**20)
    assert gpu.engine.runner.graphs is not None, "decode CUDA graphs were not captured"
    assert [o.token_ids for o in gpu.generate(prompts, greedy(40))] == expected
    # One at a time too: batch sizes 1..6 all replay graphs with padding.
    for p, e in zip(prompts, expected):
        assert gpu.generate([p], greedy(40))[0].token_ids == e
    assert_all_blocks_free(gpu)


def test_gpu_bf16_runs_and_prefix_cache_hits(model_factory):
    gpu = LLM(str(model_factory("llama")), device="cuda", dtype="bfloat16", kv_cache_bytes=512 * 2**20)
    base = random_prompts([200], seed=3)[0]
    first = gpu.generate([base], greedy(16))[0]
    again = gpu.generate([base], greedy(16))[0]
    assert again.num_cached_tokens == 192 and again.token_ids == first.token_ids
    assert_all_blocks_free(gpu)


def test_gpu_fp8_kv_captures_graphs_and_matches_the_cpu_engine(model_factory):
    """An FP8 KV cache on the GPU: decode graphs capture (its per-layer scales
    are static kernel arguments), and greedy tokens equal the CPU engine's with
    an FP8 cache (the torch reference). Both round to nearest even and clamp
    alike, so the caches differ only where float32 K/V computed on the two
    devices fall on opposite sides of an FP8 rounding boundary: rare, and one
    step of one element; the tiny model's top-1 margins absorb it."""
    model_dir = model_factory("llama")
    prompts = random_prompts([1, 7, 16, 33, 100, 300], seed=2)
    cpu = LLM(str(model_dir), device="cpu", kv_cache_dtype="fp8_e4m3")
    expected = [o.token_ids for o in cpu.generate(prompts, greedy(16))]
    gpu = LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_dtype="fp8_e4m3", chunk_size=64,
              kv_cache_bytes=256 * 2**20)
    assert gpu.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert gpu.engine.runner.graphs is not None, "decode CUDA graphs were not captured"
    assert [o.token_ids for o in gpu.generate(prompts, greedy(16))] == expected
    assert_all_blocks_free(gpu)


def test_gpu_bf16_with_fp8_kv_prefix_cache_hits(model_factory):
    gpu = LLM(str(model_factory("llama")), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
              kv_cache_bytes=256 * 2**20)
    base = random_prompts([200], seed=3)[0]
    first = gpu.generate([base], greedy(16))[0]
    again = gpu.generate([base], greedy(16))[0]
    assert again.num_cached_tokens == 192 and again.token_ids == first.token_ids
    assert_all_blocks_free(gpu)


def test_gpu_pdl_launches_give_stream_order_results_bit_for_bit(model_factory, monkeypatch):
    """Kernels launched with programmatic dependent launch (Hopper) start while
    their predecessor still runs and wait for its results (the GEMV issues its
    first weight loads before the wait): the step computes exactly what
    ordinary stream order computes. bf16, so every linear at decode sizes is the
    GEMV, under the captured decode graphs and eagerly (short prefills)."""
    from pdd.ops import triton_common

    def run(pdl: str):
        monkeypatch.setenv("PDD_PDL", pdl)
        triton_common.pdl_launch.cache_clear()
        llm = LLM(str(model_factory("llama")), device="cuda", dtype="bfloat16", chunk_size=64,
                  kv_cache_bytes=256 * 2**20)
        assert llm.engine.runner.graphs is not None, "decode CUDA graphs were not captured"
        outs = llm.generate(random_prompts([1, 7, 16, 33, 100, 300], seed=4), greedy(40, logprobs=3))
        assert_all_blocks_free(llm)
        return triton_common.pdl_launch(torch.device("cuda")), [(o.token_ids, o.logprobs) for o in outs]

    used, with_pdl = run("on")
    if not used:
        pytest.skip("PDL needs Hopper or newer and a Triton with grid dependency control")
    assert run("off") == (False, with_pdl)
    triton_common.pdl_launch.cache_clear()
