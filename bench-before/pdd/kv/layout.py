"""The KV layout descriptor: what must be equal for two workers to exchange KV.

Pairing a prefill and a decode worker that differ in any of these corrupts
output silently (the classic bug: dtype lost in transfer), so registration and
every transfer compare descriptors and refuse a mismatch, naming the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    model_id: str          # served model name
    weights_hash: str      # fingerprint of config + weights (pdd.model.loader.weights_fingerprint)
    dtype: str             # e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The pool's element type ("" = dtype); an FP8 cache differs from the model's.
    kv_cache_dtype: str = ""
    # Identity of an FP8 cache's scales (pdd.kv.scales.KVScales.identity): equal
    # bytes mean equal values only under equal scales. "" for a cache without.
    kv_scales: str = ""

    def __post_init__(self) -> None:
        if not self.kv_cache_dtype:
            object.__setattr__(self, "kv_cache_dtype", self.dtype)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        names = {f.name for f in dataclasses.fields(cls)}
        # A descriptor without the KV fields describes a cache in the model's dtype.
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = required - set(d)
        if missing:
            raise ValueError(f"KV layout lacks field(s) {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def mismatch(self, other: "KVLayout") -> str | None:
        """None if compatible, else a message naming the first differing field."""
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return f"KV layout mismatch on {f.name}: {a!r} vs {b!r}"
        return None
