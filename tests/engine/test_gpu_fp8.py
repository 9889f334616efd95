"""FP8 checkpoints on the GPU (skipped without FP8 tensor cores): linear layers
run FP8 GEMMs (pdd.ops.fp8_linear, checked against references in
tests/ops/test_fp8_linear.py), decode steps of the 8B shape run and are
captured in CUDA graphs, and a tiny FP8 checkpoint generates like its
dequantized copy where the logits' margins allow."""
from __future__ import annotations

import json

import pytest
import torch

from pdd.model.fp8 import Fp8Linear
from pdd.model.make_fp8 import FP8_FORMATS, fp8_quantization_config
from pdd.model.make_model import dequantized_copy, make_model, model_config
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts, run_to_end

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")


def _fp8_linears(engine) -> list[Fp8Linear]:
    return [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]


@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_8b_shape_fp8_decode_steps_run_in_cuda_graphs(tmp_path, fmt):
    from pdd.api import SamplingParams
    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine

    cfg = model_config("8b", "llama")
    cfg.update(dtype="bfloat16", torch_dtype="bfloat16", quantization_config=fp8_quantization_config(fmt))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda",
                                    kv_cache_bytes=2 * 2**30, max_num_seqs=32))
    layers = _fp8_linears(engine)
    assert len(layers) == 4 * 32  # qkv, o, gate_up, down of every layer; not the LM head
    assert layers[0].weight.dtype == torch.float8_e4m3fn
    assert engine.runner.graphs is not None, "decode CUDA graphs were not captured"
    reqs = run_to_end(engine, [100 + 37 * i for i in range(8)], 8)
    assert all(len(r.output_token_ids) == 8 for r in reqs)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_tiny_fp8_checkpoint_serves_on_the_gpu(tmp_path, fmt):
    from pdd import LLM

    fp8_dir = make_model(tmp_path / "fp8", "tiny", "qwen3", fp8=fmt)
    plain_dir = dequantized_copy(fp8_dir, tmp_path / "plain")
    prompts = random_prompts([1, 7, 33, 100], seed=6)
    gpu = LLM(str(fp8_dir), device="cuda", dtype="bfloat16", kv_cache_bytes=256 * 2**20)
    # The tiny shapes take the per-row GEMMs; 128x128 blocks need K % 512 == 0, so
    # the block checkpoint's layers are dequantized at load.
    assert bool(_fp8_linears(gpu.engine)) == (fmt != "block")
    assert gpu.engine.runner.graphs is not None
    got = [o.token_ids for o in gpu.generate(prompts, greedy(16))]
    ref = [o.token_ids for o in LLM(str(plain_dir), device="cuda", dtype="bfloat16",
                                    kv_cache_bytes=256 * 2**20).generate(prompts, greedy(16))]
    # FP8 activations move the logits by ~1-4% (tests/ops/test_fp8_linear.py bounds the GEMMs), and a
    # random tiny model's top logits are near ties: most first tokens agree, not each (the CPU
    # tests prove the loaded weights exact, token for token).
    assert sum(g[:1] == r[:1] for g, r in zip(got, ref)) >= len(ref) - 1, (got, ref)
    assert_all_blocks_free(gpu)
