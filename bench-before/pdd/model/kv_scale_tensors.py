"""An FP8 checkpoint's static KV-cache scales: the tensors each quantization
tool writes, read into a `KVScales` (pdd.kv.scales), and written by make-model.

Per layer, under `model.layers.N.self_attn.`, one K and one V scale as
- `k_scale` / `v_scale`: llm-compressor (compressed-tensors' `kv_cache_scheme`),
  vLLM's own name;
- `k_proj.k_scale` / `v_proj.v_scale`: NVIDIA ModelOpt;
- `k_proj.output_scale` / `v_proj.output_scale`: AutoFP8 and older llm-compressor
  (the KV cache quantized as the output of the K and V projections);
- `kv_scale`: early AutoFP8, one scale used for both K and V.

Every tool computes scale = amax / 448 and quantizes fp8(x / scale), so a stored
value times its scale is the original: pdd's convention (stored = x / scale,
read = stored * scale), and the values are taken as they are. (vLLM doubles them
only on ROCm's e4m3fnuz, whose range is half e4m3fn's; pdd's cache is e4m3fn.)

A checkpoint has scales for every layer or for none, each one finite value
> 0 (a per-head scale is refused: pdd's scales are per layer); anything else is
a CheckpointError naming the tensor.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from pdd.kv.scales import KVScales
from pdd.model.errors import CheckpointError

# naming -> (K tensor, V tensor) after "model.layers.N.self_attn."
NAMINGS: dict[str, tuple[str, str]] = {
    "attn": ("k_scale", "v_scale"),
    "proj": ("k_proj.k_scale", "v_proj.v_scale"),
    "output": ("k_proj.output_scale", "v_proj.output_scale"),
    "legacy": ("kv_scale", "kv_scale"),
}
_SUFFIXES = sorted({s for pair in NAMINGS.values() for s in pair}, key=len, reverse=True)
_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(" + "|".join(map(re.escape, _SUFFIXES)) + r")")


def layer_name(layer: int, suffix: str) -> str:
    return f"model.layers.{layer}.self_attn.{suffix}"


def is_kv_scale(hf_name: str) -> bool:
    return _NAME.fullmatch(hf_name) is not None


def read_kv_scales(names: list[str], get: Callable[[str], tuple[str, torch.Tensor]], num_layers: int,
                   required: str, source: str) -> KVScales | None:
    """The KV scales among the checkpoint's tensor `names` (get(name) -> (file, tensor)),
    None when it has none. `required`: why the checkpoint must have them (its
    quantization_config declares a KV-cache scheme), or "" when it need not."""
    found: dict[tuple[int, str], list[str]] = {}  # (layer, "k" | "v") -> tensor names
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            raise CheckpointError(f"{source}: unexpected tensor {name!r}: config.json has {num_layers} layers")
        for kind, index in (("k", 0), ("v", 1)):
            if any(pair[index] == suffix for pair in NAMINGS.values()):
                found.setdefault((layer, kind), []).append(name)
    if not found:
        if required:
            raise CheckpointError(f"{source}: {required}, but the checkpoint has no KV scales "
                                  f"(e.g. {layer_name(0, 'k_scale')!r})")
        return None
    seen = next(iter(found.values()))[0]
    suffix = _NAME.fullmatch(seen).group(2)
    naming = next(n for n, pair in NAMINGS.items() if suffix in pair)
    values = {"k": [], "v": []}
    for layer in range(num_layers):
        for index, kind in enumerate(("k", "v")):
            tensors = found.get((layer, kind), [])
            if not tensors:
                raise CheckpointError(f"{source}: checkpoint has KV scales (e.g. {seen!r}) but not "
                                      f"{layer_name(layer, NAMINGS[naming][index])!r}: every layer needs a K and "
                                      "a V scale, or none does")
            if len(tensors) > 1:
                raise CheckpointError(f"{source}: layer {layer} has two {kind.upper()} scales: {sorted(tensors)}")
            values[kind].append(_one_value(tensors[0], *get(tensors[0])))
    return KVScales.from_values(values["k"], values["v"])


def _one_value(name: str, path: str, t: torch.Tensor) -> float:
    if t.numel() != 1 or t.dim() > 1 or not t.dtype.is_floating_point:
        raise CheckpointError(f"{path}: KV scale {name!r} is {t.dtype} {tuple(t.shape)}, expected one float "
                              "(per-layer scales; per-head KV scales are not served)")
    value = float(t.float().item())
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{path}: KV scale {name!r} is {value!r}, expected a finite number > 0")
    return value


def kv_scale_tensors(k: list[float], v: list[float], naming: str, dtype: torch.dtype,
                     shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Per-layer scales k, v as a checkpoint of `naming` stores them (make-model).
    The legacy single scale holds the larger of each layer's two: it clips neither."""
    k_name, v_name = NAMINGS[naming]
    out = {}
    for i, (ks, vs) in enumerate(zip(k, v)):
        if k_name == v_name:
            out[layer_name(i, k_name)] = torch.full(shape, max(ks, vs), dtype=dtype)
        else:
            out[layer_name(i, k_name)] = torch.full(shape, ks, dtype=dtype)
            out[layer_name(i, v_name)] = torch.full(shape, vs, dtype=dtype)
    return out
