"""The FP8 format pdd computes in, for weights, activations and the KV cache
alike: e4m3 (torch's float8_e4m3fn).

A leaf that imports nothing at load, so that the settings (pdd.kv.scales,
which the torch-free router reads through pdd.config) and the kernels name the
same numbers; `FP8_DTYPE`, torch's dtype object, imports torch when asked for.
"""
from __future__ import annotations

FP8_DTYPE_NAME = "float8_e4m3fn"
FP8_MAX = 448.0          # largest finite e4m3 value: pdd clamps to it rather than store inf/NaN
FP8_MIN_AMAX = 1e-12     # an all-zero group still gets a finite scale


def __getattr__(name: str):
    if name == "FP8_DTYPE":
        import torch
        return getattr(torch, FP8_DTYPE_NAME)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
