"""An FP8 checkpoint's KV-cache scales, under each name the quantization tools
write them, are read into CausalLM.kv_scales with their values; bad ones, and
KV-cache schemes pdd cannot honour, are refused naming the tensor or field.
(make-model writes the checkpoints; the loader reads them as pdd serves them.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdd.kv.scales import KVScales
from pdd.model.config import CheckpointError, ModelConfig
from pdd.model.kv_scale_tensors import NAMINGS
from pdd.model.loader import load_model
from pdd.model.make_model import make_model


def load(model_dir):
    return load_model(model_dir, ModelConfig.from_dir(model_dir), torch.device("cpu"), torch.float32)


def stored_scales(model_dir, naming: str) -> KVScales:
    """The values the checkpoint holds, as float32 (the legacy single scale for K and V both)."""
    tensors = load_file(model_dir / "model.safetensors")
    k_name, v_name = NAMINGS[naming]
    k = [tensors[f"model.layers.{i}.self_attn.{k_name}"].float().item() for i in range(4)]
    v = [tensors[f"model.layers.{i}.self_attn.{v_name}"].float().item() for i in range(4)]
    return KVScales.from_values(k, v)


@pytest.mark.parametrize("fmt, naming", [
    ("compressed", "attn"),      # llm-compressor
    ("compressed", "output"),    # older llm-compressor
    ("tensor", "output"),        # AutoFP8
    ("channel", "proj"),         # ModelOpt's names
    ("block", "legacy"),         # early AutoFP8: one kv_scale for both
    ("tensor", "attn"),
])
def test_each_naming_is_read_into_kv_scales(tmp_path, fmt, naming):
    d = make_model(tmp_path / "m", "tiny", "llama", fp8=fmt, kv_scales="random", kv_scale_naming=naming)
    names = [n for n in load_file(d / "model.safetensors") if ".self_attn." in n and n.endswith("scale")]
    assert {n.split(".self_attn.")[1] for n in names if "_proj.weight" not in n} == set(NAMINGS[naming])
    scales = load(d).kv_scales
    assert scales == stored_scales(d, naming)
    assert len(set(scales.k)) == 4 and all(0.01 <= s <= 0.04 for s in scales.k + scales.v)
    if naming == "legacy":
        assert scales.k == scales.v
    else:
        assert scales.k != scales.v


def test_one_value_for_every_layer_and_a_checkpoint_without_scales(tmp_path):
    d = make_model(tmp_path / "m", "tiny", "llama", fp8="compressed", kv_scales=0.125)
    assert load(d).kv_scales == KVScales.from_values([0.125] * 4, [0.125] * 4)
    assert load(make_model(tmp_path / "none", "tiny", "llama", fp8="compressed")).kv_scales is None


def test_make_model_cli_writes_kv_scales(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "pdd.cli", "make-model", "--out", str(out), "--fp8", "tensor",
                           "--kv-scales", "0.5", "--kv-scale-names", "proj"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == "static"
    assert load(out).kv_scales == KVScales.from_values([0.5] * 4, [0.5] * 4)
    proc = subprocess.run([sys.executable, "-m", "pdd.cli", "make-model", "--out", str(tmp_path / "x"),
                           "--kv-scales", "0.5"], capture_output=True, text=True)
    assert proc.returncode != 0 and "FP8 checkpoints only" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pdd.cli", "make-model", "--out", str(tmp_path / "x"),
                           "--fp8", "tensor", "--kv-scales", "-1"], capture_output=True, text=True)
    assert proc.returncode != 0 and "finite number > 0" in proc.stderr


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("scaled"), "tiny", "llama", fp8="compressed", kv_scales="random")


def edited(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


def _drop(*names):
    return lambda t: [t.pop(n) for n in names]


@pytest.mark.parametrize("edit, named", [
    (_set("model.layers.1.self_attn.k_scale", torch.tensor([0.0])),
     r"KV scale 'model\.layers\.1\.self_attn\.k_scale' is 0\.0, expected a finite number > 0"),
    (_set("model.layers.2.self_attn.v_scale", torch.tensor([-0.5])), r"'model\.layers\.2\.self_attn\.v_scale' is -0\.5"),
    (_set("model.layers.0.self_attn.v_scale", torch.tensor([float("nan")])), r"'model\.layers\.0\.self_attn\.v_scale' is nan"),
    (_set("model.layers.3.self_attn.k_scale", torch.tensor(float("inf"))), r"'model\.layers\.3\.self_attn\.k_scale' is inf"),
    (_set("model.layers.1.self_attn.k_scale", torch.full((2,), 0.1)),  # one per KV head
     r"'model\.layers\.1\.self_attn\.k_scale' is torch\.float32 \(2,\), expected one float.*per-head"),
    (_set("model.layers.1.self_attn.v_scale", torch.ones(1, 1, dtype=torch.int32)),
     r"'model\.layers\.1\.self_attn\.v_scale' is torch\.int32 \(1, 1\)"),
    (_drop("model.layers.2.self_attn.v_scale"), r"not 'model\.layers\.2\.self_attn\.v_scale': every layer"),
    (_drop("model.layers.3.self_attn.k_scale", "model.layers.3.self_attn.v_scale"),
     r"not 'model\.layers\.3\.self_attn\.k_scale'"),
    (_set("model.layers.1.self_attn.kv_scale", torch.tensor(0.1)),
     r"layer 1 has two K scales: \['model\.layers\.1\.self_attn\.k_scale', 'model\.layers\.1\.self_attn\.kv_scale'\]"),
    (_set("model.layers.7.self_attn.k_scale", torch.tensor(0.1)),
     r"unexpected tensor 'model\.layers\.7\.self_attn\.k_scale': config\.json has 4 layers"),
], ids=["zero", "negative", "nan", "inf", "per-head", "int", "no-v", "no-layer", "two-names", "no-such-layer"])
def test_bad_kv_scales_are_refused_naming_the_tensor(scaled, tmp_path, edit, named):
    with pytest.raises(CheckpointError, match=named):
        load(edited(scaled, tmp_path / "m", edit))


def test_a_declared_kv_cache_scheme_needs_the_scales(scaled, tmp_path):
    d = edited(scaled, tmp_path / "m", lambda t: [t.pop(n) for n in list(t) if n.endswith(("k_scale", "v_scale"))])
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme is set, but the checkpoint has no KV scales"):
        load(d)


def _edit_kv_scheme(model_dir, value):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = value
    path.write_text(json.dumps(cfg))


def _scheme(**fields):
    base = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
            "group_size": None}
    return {**base, **fields}


@pytest.mark.parametrize("value, named", [
    (_scheme(strategy="attn_head"), r"kv_cache_scheme\.strategy 'attn_head' is not supported \(only tensor"),
    (_scheme(strategy="channel"), r"kv_cache_scheme\.strategy 'channel'"),
    (_scheme(type="int"), r"kv_cache_scheme\.type 'int' is not supported \(only float"),
    (_scheme(num_bits=4), r"kv_cache_scheme\.num_bits 4"),
    (_scheme(dynamic=True), r"kv_cache_scheme\.dynamic True"),
    (_scheme(symmetric=False), r"kv_cache_scheme\.symmetric False"),
    (_scheme(strategy="group", group_size=32), r"kv_cache_scheme\.group_size 32"),
    ("static", r"kv_cache_scheme 'static' is not supported \(expected an object"),
])
def test_unsupported_compressed_kv_cache_scheme_is_refused_naming_the_field(scaled, tmp_path, value, named):
    d = shutil.copytree(scaled, tmp_path / "m")
    _edit_kv_scheme(d, value)
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dir(d)


def test_fp8_method_kv_cache_scheme(tmp_path):
    """AutoFP8 marks its KV scales with kv_cache_scheme 'static': then they are required;
    no other value means anything pdd computes."""
    d = make_model(tmp_path / "m", "tiny", "llama", fp8="tensor", kv_scales="random")
    assert ModelConfig.from_dir(d).quant.kv_cache
    _edit_kv_scheme(d, "dynamic")
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme 'dynamic' is not supported"):
        ModelConfig.from_dir(d)
    d = edited(make_model(tmp_path / "n", "tiny", "llama", fp8="tensor", kv_scales=0.5), tmp_path / "o",
               lambda t: [t.pop(n) for n in list(t) if n.endswith("output_scale")])
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme 'static', but the checkpoint has no KV scales"):
        load(d)
