"""FP8 checkpoints on the CPU: each format's weights are dequantized at load to
the checkpoint's dtype, so greedy output equals pdd's and HF transformers' on
the same weights dequantized and saved as a plain checkpoint. Formats a
checkpoint may carry that pdd does not compute are refused at start, naming
the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdd import LLM
from pdd.model.config import CheckpointError
from pdd.model.make_fp8 import FP8_FORMATS
from pdd.model.make_model import dequantized_copy, make_model
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts
from tests.engine.test_hf_equivalence import hf_greedy

pytest.importorskip("transformers")

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=[(f, "llama") for f in FP8_FORMATS] + [("block", "qwen2")],
                ids=lambda p: "-".join(p))
def fp8_pair(request, tmp_path_factory):
    fmt, arch = request.param
    root = tmp_path_factory.mktemp(f"fp8-{fmt}-{arch}")
    fp8_dir = make_model(root / "fp8", "tiny", arch, seed=0, fp8=fmt)
    return fp8_dir, dequantized_copy(fp8_dir, root / "dequantized")


def test_fp8_checkpoint_equals_its_dequantized_copy_and_hf(fp8_pair):
    fp8_dir, plain_dir = fp8_pair
    prompts = random_prompts([1, 7, 33, 100], seed=4)
    llm = LLM(str(fp8_dir))
    got = [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))]
    assert got == [o.token_ids for o in LLM(str(plain_dir)).generate(prompts, greedy(NEW_TOKENS))]
    assert got == hf_greedy(plain_dir, prompts, NEW_TOKENS)
    assert_all_blocks_free(llm)


def test_checkpoint_tensors_are_published_format(fp8_pair):
    fp8_dir, plain_dir = fp8_pair
    cfg = json.loads((fp8_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    w = load_file(fp8_dir / "model.safetensors")
    q = w["model.layers.0.mlp.down_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (128, 352)
    if qc["quant_method"] == "fp8" and "weight_block_size" in qc:
        assert w["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 3)  # ceil(128/128), ceil(352/128)
    elif qc["quant_method"] == "fp8":
        assert w["model.layers.0.mlp.down_proj.weight_scale"].numel() in (1, 128)
    else:
        assert w["model.layers.0.mlp.down_proj.weight_scale"].shape == (128, 1)
        assert qc["ignore"] == ["lm_head"]
    assert w["model.norm.weight"].dtype == torch.bfloat16 and cfg["torch_dtype"] == "bfloat16"
    plain = load_file(plain_dir / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in plain.values())
    assert not any("scale" in name for name in plain)
    assert "quantization_config" not in json.loads((plain_dir / "config.json").read_text())


def test_static_input_scales_load(tmp_path):
    """activation_scheme static: each layer carries an input_scale (the CPU ignores it:
    activations are not quantized there)."""
    fp8_dir = make_model(tmp_path / "fp8", "tiny", "llama", fp8="tensor")
    tensors = load_file(fp8_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    _edit_quant(fp8_dir, activation_scheme="static")
    plain_dir = dequantized_copy(fp8_dir, tmp_path / "plain")
    prompts = random_prompts([9, 40], seed=5)
    assert ([o.token_ids for o in LLM(str(fp8_dir)).generate(prompts, greedy(16))]
            == [o.token_ids for o in LLM(str(plain_dir)).generate(prompts, greedy(16))])
    del tensors["model.layers.1.mlp.up_proj.input_scale"]
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.input_scale"):
        LLM(str(fp8_dir))


def _edit_quant(model_dir, drop=(), **fields):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"].update(fields)
    for key in drop:
        cfg["quantization_config"].pop(key)
    path.write_text(json.dumps(cfg))


def _edit_group(model_dir, part, **fields):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"][part].update(fields)
    path.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_block_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("block"), "tiny", "llama", fp8="block")


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("compressed"), "tiny", "llama", fp8="compressed")


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("edit, named", [
    (dict(quant_method="awq"), r"quant_method 'awq'"),
    (dict(quant_method="bitsandbytes"), r"quant_method 'bitsandbytes'"),
    (dict(fmt="e5m2"), r"quantization_config\.fmt 'e5m2'"),
    (dict(activation_scheme="static"), r"activation_scheme 'static'.*block"),
    (dict(activation_scheme="per-row"), r"activation_scheme 'per-row'"),
    (dict(weight_block_size=[128]), r"weight_block_size \[128\]"),
    (dict(scale_fmt="ue8m0"), r"scale_fmt 'ue8m0'"),
])
def test_unsupported_fp8_config_is_refused_naming_the_field(fp8_block_dir, tmp_path, edit, named):
    d = _copy(fp8_block_dir, tmp_path / "m")
    _edit_quant(d, **edit)
    with pytest.raises(CheckpointError, match=named):
        LLM(str(d))


@pytest.mark.parametrize("part, edit, named", [
    ("weights", dict(num_bits=4), r"config_groups\.group_0\.weights\.num_bits 4"),
    ("weights", dict(type="int"), r"config_groups\.group_0\.weights\.type 'int'"),
    ("weights", dict(strategy="group", group_size=128), r"weights\.(strategy 'group'|group_size 128)"),
    ("weights", dict(symmetric=False), r"weights\.symmetric False"),
    ("input_activations", dict(dynamic=False), r"input_activations\.strategy 'token'"),
    ("input_activations", dict(type="int"), r"input_activations\.type 'int'"),
])
def test_unsupported_compressed_tensors_group_is_refused(compressed_dir, tmp_path, part, edit, named):
    d = _copy(compressed_dir, tmp_path / "m")
    _edit_group(d, part, **edit)
    with pytest.raises(CheckpointError, match=named):
        LLM(str(d))


@pytest.mark.parametrize("edit, named", [
    (dict(format="pack-quantized"), r"quantization_config\.format 'pack-quantized'"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head"}),
     r"kv_cache_scheme\.strategy 'attn_head'"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme is set, but the checkpoint has no KV"),
    (dict(sparsity_config={"format": "sparse-24"}), r"sparsity_config"),
])
def test_unsupported_compressed_tensors_fields_are_refused(compressed_dir, tmp_path, edit, named):
    d = _copy(compressed_dir, tmp_path / "m")
    _edit_quant(d, **edit)
    with pytest.raises(CheckpointError, match=named):
        LLM(str(d))


def test_weight_only_compressed_tensors_is_refused(compressed_dir, tmp_path):
    d = _copy(compressed_dir, tmp_path / "m")
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"input_activations None"):
        LLM(str(d))


def test_fp8_weights_without_quantization_config_or_scale_are_refused(fp8_block_dir, tmp_path):
    d = _copy(fp8_block_dir, tmp_path / "noconfig")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"is float8 but config\.json has no quantization_config"):
        LLM(str(d))

    d = _copy(fp8_block_dir, tmp_path / "noscale")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight' has no scale"):
        LLM(str(d))

    d = _copy(fp8_block_dir, tmp_path / "badscale")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_scale_inv.*expected \[3, 1\] for 128x128 blocks"):
        LLM(str(d))
