"""Mixture-of-experts checkpoints: make-model writes the tensors under the names
the published Qwen3-MoE and Mixtral checkpoints use (HF transformers loads them
with nothing missing, tests/model/test_make_model.py); pdd's loader stacks them
per layer and refuses a missing or misshapen expert tensor, naming it; the
config's expert fields are validated; a block-scaled FP8 MoE checkpoint computes
what its dequantized copy computes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdd import LLM
from pdd.model.config import CheckpointError, ModelConfig
from pdd.model.make_model import dequantized_copy, make_model
from tests.engine.helpers import greedy, random_prompts
from tests.engine.test_hf_equivalence import hf_greedy

EXPERT = {"qwen3_moe": "model.layers.2.mlp.experts.5.{}.weight",
          "mixtral": "model.layers.2.block_sparse_moe.experts.5.{}.weight"}
UP, DOWN = {"qwen3_moe": "up_proj", "mixtral": "w3"}, {"qwen3_moe": "down_proj", "mixtral": "w2"}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def arch(request):
    return request.param


def _with_tensors(src, dst, change):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_experts_are_stacked_for_the_kernels(model_factory, arch):
    d = model_factory(arch)
    w = load_file(d / "model.safetensors")
    model = LLM(str(d)).engine.runner.model
    experts = model.model.layers[2].mlp.experts
    inter = ModelConfig.from_dir(d).moe.intermediate_size
    assert experts.gate_up_proj.shape == (8, 2 * inter, 128) and experts.down_proj.shape == (8, 128, inter)
    gate = {"qwen3_moe": "gate_proj", "mixtral": "w1"}[arch]
    assert torch.equal(experts.gate_up_proj[5, :inter], w[EXPERT[arch].format(gate)])
    assert torch.equal(experts.gate_up_proj[5, inter:], w[EXPERT[arch].format(UP[arch])])
    assert torch.equal(experts.down_proj[5], w[EXPERT[arch].format(DOWN[arch])])


def test_missing_expert_tensor_is_named(model_factory, arch, tmp_path):
    name = EXPERT[arch].format(UP[arch])
    bad = _with_tensors(model_factory(arch), tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*{name.replace('.', '[.]')}"):
        LLM(str(bad))


def test_misshapen_expert_tensor_is_named(model_factory, arch, tmp_path):
    name = EXPERT[arch].format(DOWN[arch])
    bad = _with_tensors(model_factory(arch), tmp_path / "m", lambda t: t.update({name: t[name][:, :-1].clone()}))
    with pytest.raises(CheckpointError, match=f"{name.replace('.', '[.]')}' has shape"):
        LLM(str(bad))


def test_expert_config_fields_are_checked(model_factory, arch):
    raw = json.loads((model_factory(arch) / "config.json").read_text())
    experts = "num_local_experts" if arch == "mixtral" else "num_experts"
    with pytest.raises(CheckpointError, match="num_experts_per_tok 9 is more than the 8 experts"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 9})
    with pytest.raises(CheckpointError, match=f"missing required field '{experts}'"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != experts})
    if arch == "qwen3_moe":
        with pytest.raises(CheckpointError, match="mlp_only_layers"):
            ModelConfig.from_dict({**raw, "mlp_only_layers": [7]})
        every_other = ModelConfig.from_dict({**raw, "mlp_only_layers": [], "decoder_sparse_step": 2})
        assert every_other.moe.sparse_layers == {1, 3}
        assert not ModelConfig.from_dict({**raw, "norm_topk_prob": False}).moe.renormalize


def test_active_parameters_count_the_chosen_experts(model_factory, arch):
    cfg = ModelConfig.from_dir(model_factory(arch))
    moe, h = cfg.moe, cfg.hidden_size
    expert = 3 * h * moe.intermediate_size
    unchosen = len(moe.sparse_layers) * (moe.num_experts - moe.top_k) * expert
    assert cfg.num_parameters() - cfg.num_active_parameters() == unchosen
    w = load_file(model_factory(arch) / "model.safetensors")
    assert cfg.num_parameters() == sum(t.numel() for t in w.values())
    assert cfg.expected_experts_read(1) == pytest.approx(moe.top_k)
    assert moe.top_k < cfg.expected_experts_read(4) < cfg.expected_experts_read(64) <= moe.num_experts


def test_fp8_block_experts_equal_their_dequantized_copy(arch, tmp_path):
    fp8_dir = make_model(tmp_path / "fp8", "tiny", arch, fp8="block")
    w = load_file(fp8_dir / "model.safetensors")
    name = EXPERT[arch].format(DOWN[arch])
    assert w[name].dtype == torch.float8_e4m3fn
    assert w[name.replace(".weight", ".weight_scale_inv")].dtype == torch.float32  # 128x128 blocks
    assert w[name.replace(f"experts.5.{DOWN[arch]}", "gate")].dtype == torch.bfloat16  # the router is not FP8
    plain = dequantized_copy(fp8_dir, tmp_path / "plain")
    prompts = random_prompts([7, 40], seed=2)
    got = [o.token_ids for o in LLM(str(fp8_dir)).generate(prompts, greedy(16))]
    assert got == [o.token_ids for o in LLM(str(plain)).generate(prompts, greedy(16))]
    if pytest.importorskip("transformers"):
        assert got == hf_greedy(plain, prompts, 16)
