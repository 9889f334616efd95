"""The FP8 half of `pdd make-model --fp8 FORMAT`: what a published FP8 checkpoint
of each format stores — its `quantization_config`, each linear layer's
float8_e4m3fn weight and scale under that format's names, and (`--kv-scales`)
per-layer KV-cache scales named as the tool that writes such checkpoints names
them. pdd.model.quant_config and pdd.model.loader read what this writes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# make-model --fp8: how the linear layers of an FP8 checkpoint are stored, as the
# published checkpoints of each format do (pdd.model.quant_config reads them).
FP8_FORMATS = ("tensor", "channel", "block", "compressed")

# make-model --kv-scales: the names each format's KV-cache scales get by default,
# as the tool that writes such checkpoints names them (AutoFP8 for the fp8
# method, llm-compressor for compressed-tensors; pdd.model.kv_scale_tensors
# lists every naming read).
KV_SCALE_NAMING = {"tensor": "output", "channel": "output", "block": "output", "compressed": "attn"}
# --kv-scales random: per-layer K and V scales drawn in this range, around what
# calibration gives the tiny presets (K/V amax ~4, so amax / 448 ~ 0.009).
KV_SCALE_RANGE = (0.01, 0.04)


def fp8_quantization_config(fmt: str, kv_scales: bool = False) -> dict[str, Any]:
    """`quantization_config` of format `fmt`; `kv_scales`: the checkpoint carries KV-cache scales."""
    kv_static = {"kv_cache_scheme": "static"} if kv_scales else {}  # AutoFP8's mark
    if fmt in ("tensor", "channel"):
        return {"activation_scheme": "dynamic", "quant_method": "fp8", **kv_static}
    if fmt == "block":  # DeepSeek-V3 / Qwen3-*-FP8
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
                **kv_static}
    fp8_args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8,
                "observer_kwargs": {}, "symmetric": True, "type": "float"}
    return {  # llm-compressor's FP8_DYNAMIC scheme
        "config_groups": {"group_0": {
            "input_activations": {**fp8_args, "dynamic": True, "observer": None, "strategy": "token"},
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {**fp8_args, "dynamic": False, "observer": "minmax", "strategy": "channel"},
        }},
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": ({**fp8_args, "dynamic": False, "observer": "minmax", "strategy": "tensor"}
                            if kv_scales else None),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
    }


def kv_scale_values(num_layers: int, kv_scales: float | str, seed: int) -> tuple[list[float], list[float]]:
    """(K, V) scales per layer: `kv_scales` for all, or "random" ones in KV_SCALE_RANGE
    (from their own generator: the weights do not change)."""
    import torch

    if kv_scales != "random":
        return [float(kv_scales)] * num_layers, [float(kv_scales)] * num_layers
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lo, hi = KV_SCALE_RANGE
    k, v = (lo + (hi - lo) * torch.rand((2, num_layers), generator=gen, dtype=torch.float64)).tolist()
    return k, v


def kv_scale_tensors_for(cfg: dict[str, Any], fmt: str, kv_scales: float | str, naming: str,
                      seed: int) -> dict[str, torch.Tensor]:
    import torch

    from pdd.model.kv_scale_tensors import kv_scale_tensors

    k, v = kv_scale_values(cfg["num_hidden_layers"], kv_scales, seed)
    if fmt == "compressed":  # llm-compressor: a [1] tensor in the model's dtype
        return kv_scale_tensors(k, v, naming, torch.bfloat16, (1,))
    return kv_scale_tensors(k, v, naming, torch.float32, ())


def fp8_tensors(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    prefix = name.rsplit(".", 1)[0]
    q, scale = quantize_fp8(w, fmt)
    return {name: q, f"{prefix}.{'weight_scale_inv' if fmt == 'block' else 'weight_scale'}": scale}


def quantize_fp8(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as an FP8 checkpoint of format `fmt` (FP8_FORMATS) stores
    it: (float8_e4m3fn weight, its scale)."""
    import torch

    from pdd.model.fp8 import quantize_weight

    if fmt == "block":
        return quantize_weight(w, "block", (128, 128))
    if fmt == "compressed":  # llm-compressor stores scales in the model's dtype
        _, scale = quantize_weight(w, "channel")
        scale = scale.to(torch.bfloat16)
        return (w.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
    return quantize_weight(w, fmt)
