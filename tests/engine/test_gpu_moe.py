"""Mixtures of experts on the GPU (skipped without CUDA): the Qwen3-30B-A3B
shape (4 of its 48 layers, dummy weights) in bf16 and with FP8 block-scaled
experts warms up, captures decode CUDA graphs and then compiles nothing while
it serves prefills and decodes; FP8 experts give what their dequantized weights
give in bf16. (tests/ops/test_moe_kernels.py checks the kernels themselves, on
the GPU too; tests/engine/test_gpu.py the tiny models against the CPU engine.)"""
from __future__ import annotations

import json

import pytest
import torch

from pdd import ops
from pdd.model.fp8 import dequantize
from pdd.ops import reference
from tests.engine.helpers import run_to_end

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")


def _engine(tmp_path, name: str):
    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine

    cfg = json.loads(open(f"conf/models/{name}/config.json").read())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda",
                                  kv_cache_bytes=2 * 2**30, max_num_seqs=64))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-30b-a3b-fp8-block"])
def test_a3b_shape_warms_up_and_serves_without_compiling(tmp_path, name):
    engine = _engine(tmp_path, name)
    experts = engine.runner.model.moe_layers()[0].experts
    assert experts.fp8 == name.endswith("fp8-block")
    assert engine.runner.graphs is not None, "decode CUDA graphs were not captured"
    engine.warm_up()
    compiled = []
    ops.report_compiles(compiled.append)
    reqs = run_to_end(engine, [100 + 301 * i for i in range(40)], 12)   # up to 11,839-token prompts
    assert all(len(r.output_token_ids) == 12 for r in reqs)
    assert compiled == [], compiled


@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
def test_fp8_experts_equal_their_dequantized_weights(tmp_path, tokens):
    layer = _engine(tmp_path, "qwen3-30b-a3b-fp8-block").runner.model.moe_layers()[0]
    ex = layer.experts
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, ex.gate_up_proj.shape[2], device="cuda", generator=g).to(torch.bfloat16)
    out = layer(x)
    deq = [torch.stack([dequantize(w[e], s[e], (128, 128)) for e in range(w.shape[0])]).to(torch.bfloat16)
           for w, s in ((ex.gate_up_proj, ex.gate_up_weight_scale), (ex.down_proj, ex.down_weight_scale))]
    ref = reference.fused_moe(x, layer.gate(x), deq[0], deq[1], layer.top_k, layer.renormalize)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1.5e-2, err    # the dense FP8 GEMV's bound (tests/ops/test_gemv.py)
