"""What the Triton KV-cache kernels share: dtype sets and wrapper checks."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # a Triton without grid dependency control: pdl_launch() is False
    gdc_launch_dependents = gdc_wait = None

from pdd.kv.scales import FP8_E4M3_MAX

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV cache may hold: the float dtypes, or FP8 with per-layer scales (pdd.kv.scales).
_KV_DTYPES = _FLOAT_DTYPES + (torch.float8_e4m3fn,)
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------
# Checks shared by the wrappers
# ---------------------------------------------------------------------------

def _check_kv_layer(kv: torch.Tensor, name: str = "kv_layer") -> None:
    assert kv.dim() == 5 and kv.shape[0] == 2, (
        f"{name} must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv.shape)}")
    assert kv.dtype in _KV_DTYPES, f"{name} dtype {kv.dtype} not supported"
    _, _, bs, kvh, d = kv.shape
    assert kv.stride(4) == 1 and kv.stride(3) == d and kv.stride(2) == kvh * d, (
        f"{name}: each page [block_size, kv_heads, head_dim] must be contiguous, "
        f"strides {kv.stride()}")
    assert bs > 0 and bs & (bs - 1) == 0, f"{name}: block_size {bs} must be a power of two"


def _check_index(t: torch.Tensor, name: str, device: torch.device, dim: int = 1) -> None:
    assert t.dtype in _INDEX_DTYPES, f"{name} must be int32 or int64, got {t.dtype}"
    assert t.dim() == dim, f"{name} must be {dim}-D, got shape {tuple(t.shape)}"
    assert t.device == device, f"{name} is on {t.device}, expected {device}"
    if dim == 1:
        assert t.numel() <= 1 or t.stride(0) == 1, f"{name} must be contiguous, stride {t.stride()}"


def _check_kv_write(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """New tokens' K and V ([T, kv_heads, head_dim]) and their slots in kv_layer."""
    _check_kv_layer(kv_layer)
    _, _, _, kvh, d = kv_layer.shape
    for name, t in (("key", key), ("value", value)):
        assert t.dim() == 3 and t.shape[1:] == (kvh, d), (
            f"{name} must be [T, {kvh}, {d}] to match kv_layer, got {tuple(t.shape)}")
        assert t.dtype in _FLOAT_DTYPES, f"{name} dtype {t.dtype} not supported"
        assert t.device == kv_layer.device, f"{name} is on {t.device}, kv_layer on {kv_layer.device}"
    assert key.shape[0] == value.shape[0], f"key has {key.shape[0]} tokens, value {value.shape[0]}"
    _check_index(slot_mapping, "slot_mapping", kv_layer.device)
    assert slot_mapping.shape[0] == key.shape[0], (
        f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def _kv_scales(kv: torch.Tensor, kv_scale: tuple[float, float]) -> tuple[float, float, bool]:
    """(k_scale, v_scale, is FP8) of a cache: scales apply to an FP8 cache only."""
    if kv.dtype != torch.float8_e4m3fn:
        return 1.0, 1.0, False
    k_scale, v_scale = kv_scale
    assert k_scale > 0 and v_scale > 0, f"kv_scale {kv_scale} must be > 0"
    return float(k_scale), float(v_scale), True


@triton.jit
def _to_kv_cache(x, inv_scale, dtype: tl.constexpr, FP8: tl.constexpr):
    """x as a cache of element type `dtype` stores it. FP8: times the reciprocal
    of its scale, clamped to e4m3's range (saturate, never NaN), then the cast
    rounds to nearest even. (A function, so that a caller's values keep their type.)"""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -_FP8_MAX), _FP8_MAX)
    return x.to(dtype)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: small, so that small tests still split


# ---------------------------------------------------------------------------
# Programmatic dependent launch (PDL)
# ---------------------------------------------------------------------------
# A decode step is a chain of ~300 small kernels; between two of them the SMs
# drain the first and ramp up the second. Launched with PDL (Hopper), a kernel's
# programs may start while its predecessor still runs: they do what needs none of
# its results (a GEMV issues its first weight loads), then wait for it
# (`_pdl_wait`: griddepcontrol.wait, which returns once the predecessor has
# completed and its writes are visible). Each such kernel waits before it reads
# an activation or writes anything, in every program, so completion still
# implies every earlier kernel completed; kernels launched without PDL (torch's,
# cuBLAS, the 2..16-row GEMV) keep ordinary stream order on both sides.
#
# Only one-token steps launch so, where every kernel of the chain is one of
# these (H200, Llama-3-8B shape: a step 4.46 -> 4.21 ms bf16, 2.96 -> 2.80 FP8).
# At 8 and 16 tokens, where cuBLAS or the dot GEMV sits between them, steps
# were 2-3% slower under PDL (4.79 -> 4.91 ms at 8 tokens).

@functools.lru_cache(maxsize=None)
def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may launch with PDL: Hopper or newer, a
    Triton with grid dependency control, not switched off (`PDD_PDL=off`, A/B runs)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("PDD_PDL", "on").lower() == "off":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device, tokens: int) -> dict:
    """A kernel's PDL constexpr and launch option (merged into its launch
    kwargs) in a step of `tokens` tokens."""
    return dict(PDL=True, launch_pdl=True) if tokens == 1 and pdl_launch(device) else dict(PDL=False)


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Under PDL: block until the previous kernel in the stream has completed,
    then let the next one start once every program here got this far."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _dot_mode(q: torch.Tensor) -> int:
    """See `_attend_tile`'s DOT."""
    if q.dtype == torch.float32:
        return 1
    return 2 if q.dtype == torch.bfloat16 and not _on_gpu(q) else 0
