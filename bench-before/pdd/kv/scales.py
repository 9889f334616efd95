"""The KV cache's element type (`engine.kv_cache_dtype`) and the static scales
of an FP8 cache: one for K and one for V per layer.

An FP8 (e4m3) cache stores fp8(clamp(x / scale, -448, 448)) and reads
stored * scale. The scales are static: they come from the checkpoint (its
per-layer K and V scale tensors, under the names published FP8 checkpoints use,
which the loader reads onto `CausalLM.kv_scales`: pdd.model.kv_scale_tensors,
where each tool's convention is checked to be this one) or are 1.0 when it has
none. A checkpoint's scales go unused by a cache in the model's dtype. Static scales keep every step's arguments the same, so CUDA graphs
captured once stay valid, and two workers agree on what a page means as long
as they hold the same scales: the layout descriptor carries their identity
(`KVScales.identity`), and a peer with other scales is refused.

The risk of 1.0 (no calibration): a K or V value beyond +-448 saturates (pdd
clamps rather than store inf/NaN) and values below ~2e-3 (e4m3's smallest
normal is 2^-6, subnormals reach 2^-9) lose precision or flush to zero.
Llama-family K/V activations are mostly within a few tens, so 1.0 is what vLLM
defaults to as well; a model with outlier channels beyond 448 wants a
calibrated checkpoint.

Per-layer, not per-head: published FP8 checkpoints (compressed-tensors'
`kv_cache_scheme` with the "tensor" strategy, the `fp8` method's) carry one K
and one V scale per layer (llm-compressor's per-head "attn_head" strategy is
refused at load, naming it); and a
per-layer scale folds into the kernels' existing scalars (K's into the softmax
scale, V's into the output), costing no work per element.
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

# engine.kv_cache_dtype -> the cache's torch dtype name (None: the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": "float8_e4m3fn"}
FP8_E4M3_MAX = 448.0


def _f32(x: float) -> float:
    """x as the float32 the kernels receive: the identity hashes what they compute with."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


@dataclass(frozen=True)
class KVScales:
    """Dequantization scales of an FP8 KV cache, one K and one V per layer."""
    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KV scales: {len(self.k)} K scales but {len(self.v)} V scales")
        for name, values in (("k_scale", self.k), ("v_scale", self.v)):
            for i, s in enumerate(values):
                if not (math.isfinite(s) and s > 0):
                    raise ValueError(f"KV scales: layer {i} {name} must be a finite number > 0, got {s!r}")
        object.__setattr__(self, "k", tuple(_f32(s) for s in self.k))
        object.__setattr__(self, "v", tuple(_f32(s) for s in self.v))

    @classmethod
    def unit(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @classmethod
    def from_values(cls, k: Sequence[float], v: Sequence[float]) -> "KVScales":
        return cls(tuple(float(s) for s in k), tuple(float(s) for s in v))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def layer(self, i: int) -> tuple[float, float]:
        """(k_scale, v_scale) of layer i."""
        return self.k[i], self.v[i]

    def identity(self) -> str:
        """A short name for these values, equal on every host: "unit" when all
        are 1.0, else a hash of the float32 values."""
        if all(s == 1.0 for s in self.k + self.v):
            return "unit"
        raw = struct.pack(f"<{2 * self.num_layers}f", *self.k, *self.v)
        return "b2:" + hashlib.blake2b(raw, digest_size=6).hexdigest()
