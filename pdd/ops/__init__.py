"""KV-cache, decoder-layer and sampling ops, dispatched by device.

Every op has a torch reference (`reference.py`) that defines its semantics and
runs on any device. On CUDA the Triton kernels are used when they are
available; `PDD_OPS=reference` forces the reference everywhere (debugging,
kernel bisection).

Linear layers (`linear`, `linear_silu_mul`) at decode sizes on CUDA run as one
weight-only GEMV launch (pdd.ops.triton_gemv) where that measured faster
(`use_gemv`, by the row-bucket tables HALF_GEMV_BUCKETS and FP8_GEMV_BUCKETS);
`PDD_GEMV=off` keeps them on the layers' own GEMMs (A/B runs), and
`PDD_FP8_GEMV=1,32,...` replaces FP8's table (a device A/B without an edit).
Elsewhere, the CPU included, a linear is exactly the layer's own call.
"""
from __future__ import annotations

import functools
import os
import threading
from types import ModuleType

import torch

from pdd.ops import reference
from pdd.ops.limits import GEMV_BUCKETS, GEMV_MAX_M, SKINNY_MAX_M, gemv_bucket
from pdd.ops.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "store_kv", "paged_attention", "gather_blocks",
           "scatter_blocks", "copy_blocks", "backend_for", "rms_norm", "add_rms_norm", "silu_and_mul",
           "rotary", "rotary_store_kv", "fused_moe", "argmax", "report_compiles", "compiles_reported", "warm_up_sampling",
           "warm_up_attention", "GEMV_MAX_M", "HALF_GEMV_BUCKETS", "FP8_GEMV_BUCKETS", "gemv_enabled",
           "use_gemv", "gemv", "linear", "linear_silu_mul",
           "gemv_warm_up_rows", "warm_up_gemv", "warm_up_moe"]

_triton: ModuleType | None = None
_triton_checked = False
_compiles_reported = 0
_compiles_lock = threading.Lock()


def _load_triton() -> ModuleType | None:
    global _triton, _triton_checked
    if not _triton_checked:
        _triton_checked = True
        if os.environ.get("PDD_OPS", "").lower() != "reference":
            try:
                from pdd.ops import triton_ops
                _triton = triton_ops
            except ImportError:
                _triton = None
    return _triton


def report_compiles(report) -> bool:
    """From now on, call report(kernel) for each Triton kernel compiled in this
    process (`kernel`: its name and argument specialization). After the warm-up
    each one is a stall of every request on the worker (seconds on a cold
    cache), and which argument made a new variant says how to avoid it. False
    when Triton is not used or has no compile hook."""
    if _load_triton() is None:
        return False
    import triton
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False

    def hook(**kw) -> None:
        global _compiles_reported
        with _compiles_lock:   # any thread may launch (an engine's, a sender's)
            _compiles_reported += 1
        # repr: the kernel and its options; key: the argument specialization (which
        # argument's alignment, divisibility or constexpr value made this variant)
        report(f"{kw.get('repr')} key={kw.get('key')}")

    runtime.jit_post_compile_hook = hook
    return True


def compiles_reported() -> int:
    """Kernels compiled since report_compiles() was first called in this process
    (a worker calls it after its warm-up: each one is a compile in service)."""
    return _compiles_reported


def warm_up_sampling(vocab: int, max_rows: int, device: torch.device) -> int:
    """Compile the sampling kernels' variants for every batch of 1..max_rows rows
    (what a worker's warm-up steps do not all reach); how many, 0 off the GPU."""
    backend = _load_triton() if device.type == "cuda" else None
    return backend.warm_up_argmax(vocab, max_rows, device) if backend is not None else 0


def warm_up_attention(num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_seq_len: int,
                      device: torch.device) -> int:
    """Compile attention's split merge for every split count it can pick with
    contexts up to max_seq_len (what a worker's warm-up steps do not all
    reach); how many, 0 off the GPU."""
    backend = _load_triton() if device.type == "cuda" else None
    if backend is None:
        return 0
    return backend.warm_up_merges(num_heads, kv_heads, head_dim, dtype, max_seq_len, device)


def warm_up_split_prefill(num_heads: int, kv_layer: torch.Tensor, dtype: torch.dtype, max_seq_len: int,
                          kv_scale=reference.UNIT_SCALE) -> int:
    """Compile the prefill kernel's split-keys variant (a short chunk deep in
    its prompt), whatever max_model_len lets the warm-up steps reach; 0 off the GPU."""
    backend = _load_triton() if kv_layer.device.type == "cuda" else None
    if backend is None:
        return 0
    return backend.warm_up_split_prefill(num_heads, kv_layer, dtype, max_seq_len, kv_scale)


def backend_for(t: torch.Tensor) -> ModuleType:
    if t.is_cuda:
        return _load_triton() or reference
    return reference


def store_kv(key, value, kv_layer, slot_mapping, kv_scale=reference.UNIT_SCALE) -> None:
    """kv_scale: (k_scale, v_scale) of an FP8 cache (pdd.kv.scales); unused by others."""
    backend_for(kv_layer).store_kv(key, value, kv_layer, slot_mapping, kv_scale)


def paged_attention(q, kv_layer, meta: AttentionMetadata, scale: float,
                    kv_scale=reference.UNIT_SCALE) -> torch.Tensor:
    return backend_for(q).paged_attention(q, kv_layer, meta, scale, kv_scale)


def gather_blocks(kv_layer, block_ids) -> torch.Tensor:
    return backend_for(kv_layer).gather_blocks(kv_layer, block_ids)


def scatter_blocks(kv_layer, block_ids, pages) -> None:
    backend_for(kv_layer).scatter_blocks(kv_layer, block_ids, pages)


def copy_blocks(src_layer, dst_layer, src_ids, dst_ids) -> None:
    backend_for(dst_layer).copy_blocks(src_layer, dst_layer, src_ids, dst_ids)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    return backend_for(x).rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float):
    return backend_for(x).add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x) -> torch.Tensor:
    return backend_for(x).silu_and_mul(x)


def rotary(positions, q, k, cos, sin):
    return backend_for(q).rotary(positions, q, k, cos, sin)


def rotary_store_kv(positions, q, k, v, cos, sin, kv_layer, slot_mapping, kv_scale=reference.UNIT_SCALE,
                    qk_norm=None):
    """(q/k norm: qk_norm = (q weight, k weight, eps),) rotary, then store_kv of
    the rotated k and v: (q, k) rotated (in place on Triton)."""
    return backend_for(q).rotary_store_kv(positions, q, k, v, cos, sin, kv_layer, slot_mapping, kv_scale, qk_norm)


def fused_moe(x, router_logits, gate_up, down, top_k: int, renormalize: bool,
              gate_up_scale=None, down_scale=None) -> torch.Tensor:
    """A mixture of experts' sparse MLP (reference.fused_moe): routing, the grouped
    expert GEMMs and the weighted sum, a fixed set of launches on the GPU
    (pdd.ops.triton_moe). FP8 experts (block scales given) run only there: elsewhere
    the loader dequantizes them."""
    if x.is_cuda and _load_triton() is not None:
        from pdd.ops import triton_moe
        return triton_moe.fused_moe(x, router_logits, gate_up, down, top_k, renormalize, gate_up_scale, down_scale)
    if gate_up_scale is not None:
        raise ValueError("FP8 experts need the Triton MoE kernels (CUDA); the loader dequantizes them elsewhere")
    return reference.fused_moe(x, router_logits, gate_up, down, top_k, renormalize)


def warm_up_moe(layers, dtype: torch.dtype, device: torch.device, max_tokens: int) -> int:
    """Compile the fused MoE kernels' variants for steps of 1..max_tokens tokens
    (what the warm-up steps may not all reach); how many layer shapes, 0 off the GPU."""
    if device.type != "cuda" or _load_triton() is None or not layers:
        return 0
    from pdd.ops import triton_moe
    return triton_moe.warm_up(layers, dtype, device, max_tokens)


def argmax(logits) -> torch.Tensor:
    """[B, V] logits -> int64 [B], as torch.argmax(dim=-1)."""
    return backend_for(logits).argmax(logits)


# ---------------------------------------------------------------------------
# Linear layers: the weight-only GEMV at decode sizes
# ---------------------------------------------------------------------------

def gemv_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears of `dtype` activations on `device` may take the GEMV at
    all. fp32 stays on the layer's GEMM, as on the CPU (an fp32 GPU engine is
    the CPU engine's reference)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and os.environ.get("PDD_GEMV", "on").lower() != "off")


# Which row buckets (pdd.ops.limits.GEMV_BUCKETS: 1, 2..16, 17..32, 33..64,
# 65..128, 129..256) send a linear to the GEMV rather than the layer's own
# GEMM, by weight dtype. The one place to flip after a device sweep
# (`python -m benchmarks.fp8_skinny`, docs/benchmarks.md).
# Half precision: 1..16 rows (H200, 2026-12-01: one row 0.9-1.1x cuBLAS's time
# a layer, 7% less in all, no split-K reduce; 2..16 level, SiLU-and-mul fused
# into gate_up); from 17 rows cuBLAS.
HALF_GEMV_BUCKETS = frozenset({1, GEMV_MAX_M})
# FP8 weights (W8A16: no activation quantization, no padded rows, the scales in
# registers) against scaled_mm (quantize kernel, then cuBLASLt), measured with
# `python -m benchmarks.fp8_skinny` (H200, 2026-12-03; a layer's four 8B linears,
# block / row scales): one row 62 / 60 us against 101 / 132; 2..16 rows 166 / 150
# against 98-104 / 126-135; 32 rows 223 / 191 against 118 / 125; 64 rows 275 / 283
# against 123 / 119; 128 and 256 rows 2-3x slower. The dot kernel streams W at
# ~1 TB/s whatever M (its tiles at 2..256 rows reach 11-44% of the HBM floor), so
# from 2 rows scaled_mm stays; a bucket goes in here once a sweep measures it faster.
FP8_GEMV_BUCKETS = frozenset({1})
_FP8_GEMV_ENV = "PDD_FP8_GEMV"


@functools.lru_cache(maxsize=8)
def _fp8_buckets(spec: str | None) -> frozenset[int]:
    if spec is None:
        return FP8_GEMV_BUCKETS
    try:
        buckets = frozenset(int(v) for v in spec.split(",") if v.strip())
    except ValueError:
        buckets = frozenset({-1})
    if not buckets <= set(GEMV_BUCKETS):
        raise ValueError(f"{_FP8_GEMV_ENV}={spec!r}: a comma list of row buckets out of {GEMV_BUCKETS}")
    return buckets


def _gemv_buckets(weight_dtype: torch.dtype) -> frozenset[int]:
    if weight_dtype != torch.float8_e4m3fn:
        return HALF_GEMV_BUCKETS
    return _fp8_buckets(os.environ.get(_FP8_GEMV_ENV))


def use_gemv(device: torch.device, rows: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether a linear of `rows` rows goes to the GEMV: where its row bucket's
    entry in the weight dtype's table (HALF_GEMV_BUCKETS, FP8_GEMV_BUCKETS, or
    PDD_FP8_GEMV) says it wins over the layer's own GEMM."""
    if not gemv_enabled(device, dtype) or not 1 <= rows <= SKINNY_MAX_M:
        return False
    return gemv_bucket(rows) in _gemv_buckets(weight_dtype)


def gemv_warm_up_rows(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype) -> list[int]:
    """One row count per bucket the GEMV takes for these dtypes (each bucket's
    largest, so the bucket of 256 also runs its two M tiles): one compiled
    variant a bucket, so these compile every variant a step can launch."""
    return [b for b in GEMV_BUCKETS if use_gemv(device, b, dtype, weight_dtype)]


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
         silu: bool = False) -> torch.Tensor | None:
    """x [M, K] @ weight^T (+ bias) (silu: silu(gate) * up of it) through the
    GEMV when it applies to these operands, else None: the caller's own path."""
    if not use_gemv(x.device, x.shape[0], x.dtype, weight.dtype) or _load_triton() is None:
        return None
    from pdd.ops import triton_gemv
    if not triton_gemv.supports(x, weight, block, silu):
        return None
    return triton_gemv.gemv(x, weight, scale, block, bias, silu)


def _layer_gemv(x: torch.Tensor, layer: torch.nn.Module, silu: bool) -> torch.Tensor | None:
    # An nn.Linear, or an Fp8Linear (pdd.model.fp8) with its scales and block shape.
    x2 = x.reshape(-1, x.shape[-1])
    out = gemv(x2, layer.weight, getattr(layer, "weight_scale", None), getattr(layer, "block", None),
               layer.bias, silu)
    return None if out is None else out.view(*x.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """layer(x), as one GEMV launch at decode sizes on the GPU."""
    out = _layer_gemv(x, layer, False)
    return layer(x) if out is None else out


def linear_silu_mul(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """silu_and_mul(layer(x)) of a [gate; up] layer; one GEMV launch at decode
    sizes on the GPU (no [M, 2I] intermediate)."""
    out = _layer_gemv(x, layer, True)
    return silu_and_mul(layer(x)) if out is None else out


def warm_up_gemv(sites, dtype: torch.dtype, device: torch.device) -> int:
    """Compile the GEMV variants of each (linear layer, whether its output goes
    through SiLU-and-mul) for every row bucket use_gemv sends to the GEMV
    (gemv_warm_up_rows); how many distinct layers ran, 0 where the GEMV is not
    used. M is no specialization key, and each variant depends only on
    the layer's shape, dtypes and scales: one layer of each kind suffices."""
    if not gemv_enabled(device, dtype) or _load_triton() is None:
        return 0
    seen = set()
    for layer, silu in sites:
        scale = getattr(layer, "weight_scale", None)
        key = (tuple(layer.weight.shape), layer.weight.dtype, None if scale is None else tuple(scale.shape),
               getattr(layer, "block", None), layer.bias is None, silu)
        if key in seen:
            continue
        seen.add(key)
        for rows in gemv_warm_up_rows(device, dtype, layer.weight.dtype):
            x = torch.zeros(rows, layer.in_features, dtype=dtype, device=device)
            (linear_silu_mul if silu else linear)(x, layer)
    return len(seen)
