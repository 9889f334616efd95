"""`python -m benchmarks.fp8_error`: the FP8 variants carry the FP8 checkpoints' quantization,
and the report compares each with the unquantized model in sane ranges."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from pdd import LLM
from benchmarks import fp8_error
from benchmarks.cli import run
from benchmarks.fp8_error import parse_variant, quantize_linears
from pdd.model import fp8
from pdd.model.llama import PACKED_MODULES
from pdd.model.loader import shard_slice
from pdd.model.make_fp8 import FP8_FORMATS
from pdd.model.make_model import make_model
from pdd.model.quant_config import parse_quantization

E4M3_REL_STEP = 2 ** -4   # 3 mantissa bits: rounding moves a normal value by at most this share


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_variant_weights_are_those_the_fp8_checkpoint_loads(tmp_path, fmt):
    """Quantizing the plain model in memory gives, layer for layer, the weights of
    `make-model --fp8 FMT` (the same random weights, quantized as written) dequantized."""
    plain = make_model(tmp_path / "plain", "tiny", "llama", seed=3)
    fp8_dir = make_model(tmp_path / "fp8", "tiny", "llama", seed=3, fp8=fmt)
    scheme = parse_quantization(json.loads((fp8_dir / "config.json").read_text()), "test")
    tensors = load_file(fp8_dir / "model.safetensors")
    model = LLM(str(plain), device="cpu", dtype="float32").engine.runner.model
    before = model.model.layers[1].mlp.down_proj.weight.clone()
    err = quantize_linears(model, fmt)
    assert 0 < err <= E4M3_REL_STEP
    assert not torch.equal(model.model.layers[1].mlp.down_proj.weight, before)
    params = dict(model.named_parameters())
    checked = 0
    for name, q in tensors.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        prefix = name.rsplit(".", 1)[0]
        scale = tensors.get(f"{prefix}.weight_scale_inv", tensors.get(f"{prefix}.weight_scale"))
        want = fp8.dequantize(q, scale, scheme.block)
        parent, _, frag = prefix.rpartition(".")
        if frag in PACKED_MODULES:   # the shard's rows of qkv_proj / gate_up_proj
            packed, shard = PACKED_MODULES[frag]
            got = params[f"{parent}.{packed}.weight"][shard_slice(model, packed, shard)]
        else:
            got = params[f"{prefix}.weight"]
        assert torch.equal(got, want), name
        checked += 1
    assert checked == 7 * 4   # every linear of the 4 layers; the (tied) LM head stays unquantized


def test_report_compares_each_variant_with_the_reference(tmp_path):
    out = tmp_path / "report.json"
    assert run(fp8_error, ["--device", "cpu", "--num-prompts", "3", "--prompt-len", "40", "--greedy-tokens", "6",
                           "--variants", "reference,w-channel,w-block,kv,kv-calibrated,w-tensor+kv",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["positions"] == 3 * 40 and report["weights"] == "llm-like"
    assert abs(report["reference"]["entropy_mean"] - 2.0) < 1e-3   # the logits were scaled to the target
    assert len(report["reference"]["k_amax"]) == 4 and min(report["reference"]["k_channel_ratio"]) >= 1
    rows = report["variants"]
    assert list(rows) == ["reference", "w-channel", "w-block", "kv", "kv-calibrated", "w-tensor+kv"]
    ref = rows["reference"]
    assert (ref["top1_agreement"], ref["kl_mean"], ref["kl_max"], ref["logit_rel_err_mean"],
            ref["greedy_same_share"], ref["greedy_identical"]) == (1.0, 0.0, 0.0, 0.0, 1.0, 1.0)
    for name, row in rows.items():
        assert 0.0 <= row["top1_agreement"] <= 1.0 and 0.0 <= row["greedy_same_share"] <= 1.0
        assert 0.0 <= row["kl_mean"] <= row["kl_max"] and row["kl_p99"] <= row["kl_max"]
        if name == "reference":
            continue
        assert row["logit_rel_err_mean"] > 0 and row["kl_mean"] > 0   # FP8 changed the outputs
        assert (row["kv_cache"] == "fp8_e4m3") == ("kv" in name)
        assert (0 < row["weight_rel_err"] <= E4M3_REL_STEP) if row["weights"] else row["weight_rel_err"] == 0
    assert rows["kv-calibrated"]["kv_scales"] == "calibrated" and rows["w-tensor+kv"]["weights"] == "tensor"


@pytest.mark.parametrize("bad", ["w-int4", "kv+kv", "w-block+w-channel", "fp8"])
def test_unknown_variant_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(f"--variants: {bad!r}")):
        parse_variant(bad)
