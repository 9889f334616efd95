"""The cost model prices a mixture of experts by what it computes and reads:
a worker registers its model's prompt-token FLOPs (2 x active parameters) and
the expert bytes each decode adds (m.StepLimits.of), and until it is measured
its step-time priors scale by them; measurements still override the priors."""
from __future__ import annotations

import pytest

from pdd.api import StepSample
from pdd.config import AdaptiveConfig, EngineConfig
from pdd.model.config import ModelConfig
from pdd.protocol import messages as m
from pdd.router.cost.constants import COSTS
from pdd.router.estimator import Estimator
from tests.router.test_adaptive import LAYOUT, worker

MODELS = {name: ModelConfig.from_dir(f"conf/models/{name}")
          for name in ("llama-3.1-8b", "qwen3-30b-a3b", "qwen3-30b-a3b-fp8-block", "mixtral-8x7b")}


def registered(wid: str, model: str):
    info = worker(wid, "decode")
    info.step = m.StepLimits.of(EngineConfig(max_num_batched_tokens=2048, chunk_size=512), MODELS[model])
    return info


def test_limits_carry_the_active_parameters_and_expert_bytes():
    dense, moe = m.StepLimits.of(EngineConfig(), MODELS["llama-3.1-8b"]), m.StepLimits.of(EngineConfig(),
                                                                                         MODELS["qwen3-30b-a3b"])
    assert dense.prefill_flops_per_token == 2 * MODELS["llama-3.1-8b"].num_parameters()
    assert dense.decode_expert_bytes == 0
    assert moe.prefill_flops_per_token == pytest.approx(2 * 3.35e9, rel=0.01)   # A3B: ~3.3B active
    # From 1 to 64 decodes a step goes from 8 experts a layer to nearly all 128: ~1.9 experts of
    # 3 x 2048 x 768 bf16 weights in each of 48 layers per more decode.
    assert moe.decode_expert_bytes == pytest.approx(48 * 1.87 * 3 * 2048 * 768 * 2, rel=0.01)
    fp8 = m.StepLimits.of(EngineConfig(), MODELS["qwen3-30b-a3b-fp8-block"])
    assert fp8.decode_expert_bytes == pytest.approx(moe.decode_expert_bytes / 2)


def test_unmeasured_workers_are_priced_by_their_model():
    est = Estimator(AdaptiveConfig())
    infos = [registered("dense", "llama-3.1-8b"), registered("a3b", "qwen3-30b-a3b"),
             registered("mixtral", "mixtral-8x7b"), worker("unsaid", "decode")]
    e = est.estimates(infos, LAYOUT, 0.0).workers
    assert e["dense"].step_token_s == pytest.approx(COSTS.prior_token_s, rel=0.01)  # the priors' own model
    assert e["unsaid"].step_token_s == pytest.approx(COSTS.prior_token_s)
    assert e["a3b"].step_token_s == pytest.approx(COSTS.prior_token_s * 3.35 / 8.03, rel=0.01)
    assert e["mixtral"].step_token_s == pytest.approx(COSTS.prior_token_s * 12.9 / 8.03, rel=0.01)
    # A decode costs a dense model its attention; a mixture of experts also the experts it adds.
    assert e["dense"].step_decode_s == pytest.approx(COSTS.prior_decode_s)
    assert e["a3b"].step_decode_s > 3 * COSTS.prior_decode_s
    assert e["a3b"].prefill_s(4096) < e["dense"].prefill_s(4096) < e["mixtral"].prefill_s(4096)


def test_measurements_override_the_model_priors():
    est = Estimator(AdaptiveConfig())
    info = registered("a3b", "qwen3-30b-a3b")
    est.estimates([info], LAYOUT, 0.0)
    # Heartbeats of prefill steps (a fitted group of 4 each) at 10 us a token and 2 ms of base.
    for i in range(200):
        n = (256, 512, 1024, 2048)[i % 4]
        est.observe(m.Heartbeat("a3b", 0, 0, 100, 100, steps=[
            StepSample(num_tokens=n, num_decodes=0, latency_s=0.002 + 1e-5 * n)] * COSTS.group))
    assert est.estimates([info], LAYOUT, 0.0).workers["a3b"].step_token_s == pytest.approx(1e-5, rel=0.05)
