"""Fused Triton kernels for the decoder's small per-token ops.

Eagerly, RMSNorm, the residual add, rotary embedding and SiLU-and-mul are each
a chain of 4-10 tiny torch kernels; at decode batch sizes those launches (even
replayed from a CUDA graph) cost more than the work. One kernel each here;
rotary of q and k and the KV-cache write of the rotated k and v share one
(`rotary_store_kv`), one program per token.
Semantics (and rounding points) follow `pdd.ops.reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdd.ops.triton_common import _check_kv_write, _kv_scales, _pdl_wait, _to_kv_cache, pdl_options


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, N] with unit stride along N (a copy only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=m, other=0.0)
        # The residual sum is rounded to the model dtype, as an add in that dtype is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_r + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=m)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    assert weight.shape == (n,), f"weight {tuple(weight.shape)} does not match hidden size {n}"
    x2 = _rows(x)
    out = torch.empty_like(x2)
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous(), "residual must match x and be contiguous"
        r2 = residual.view(-1, n)
    else:
        r2 = x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), n, eps,
                                         HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
                                         num_warps=4 if n <= 4096 else 8, **pdl_options(x.device, x2.shape[0]))
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); the residual is updated in place."""
    out = _rms_norm(x, residual, weight, eps)
    return out, residual


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2N] = [gate | up] -> silu(gate) * up [..., N]."""
    n2 = x.shape[-1]
    assert n2 % 2 == 0, f"last dim {n2} is not [gate | up]"
    x2 = _rows(x)
    n = n2 // 2
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(n))
    if x2.shape[0]:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _rope_heads(x_ptr, stride_h, cos, sin, norm_w, eps, HEADS: tl.constexpr, HALF: tl.constexpr,
                H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    """Rotate one token's [HEADS, 2 * HALF] rows at x_ptr in place; returns the
    rotated halves (in x's dtype) for a caller that also stores them elsewhere.
    NORM: each head is RMS-normalized with the weights at norm_w first (Qwen3's
    q/k norm), rounded where the reference's rms_norm rounds."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF_PAD)
    m = (h[:, None] < HEADS) & (d[None, :] < HALF)
    base = x_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        # The mean square over the whole head: both halves (masked lanes are 0).
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        dm = d < HALF
        w1 = tl.load(norm_w + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        a = (w1 * (a * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    y1 = (a * cos[None, :] - b * sin[None, :]).to(x1.dtype)
    y2 = (b * cos[None, :] + a * sin[None, :]).to(x1.dtype)
    tl.store(base, y1, mask=m)
    tl.store(base + HALF, y2, mask=m)
    return y1, y2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache, v_cache, slot_mapping,
                   q_norm_w, k_norm_w, eps,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd,
                   stride_cb, stride_cs, stride_ch, inv_k_scale, inv_v_scale,
                   HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, STORE_KV: tl.constexpr, QK_NORM: tl.constexpr,
                   FP8: tl.constexpr, PDL: tl.constexpr):
    """One token: (with QK_NORM, RMS-normalize each q and k head first, then)
    rotate all its q and k heads in place and, with STORE_KV, write the rotated
    k and its v into the token's cache slot (store_kv's layout; FP8: quantized
    with the layer's scales)."""
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dm = d < HALF
    # cos/sin are rounded to the activations' dtype first, as the reference does.
    act = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + p * HALF + d, mask=dm, other=0.0).to(act).to(tl.float32)
    sin = tl.load(sin_ptr + p * HALF + d, mask=dm, other=0.0).to(act).to(tl.float32)
    _rope_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, q_norm_w, eps, HEADS, HALF, H_PAD, HALF_PAD, QK_NORM)
    k1, k2 = _rope_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, k_norm_w, eps, KV_HEADS, HALF, KVH_PAD,
                         HALF_PAD, QK_NORM)
    if STORE_KV:
        slot = tl.load(slot_mapping + t).to(tl.int64)
        if slot >= 0:  # a negative slot (the reference would raise) writes nothing
            h = tl.arange(0, KVH_PAD)
            m = (h[:, None] < KV_HEADS) & dm[None, :]
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
                + h[:, None] * stride_ch + d[None, :]
            cdt = k_cache.dtype.element_ty
            tl.store(k_cache + dst, _to_kv_cache(k1, inv_k_scale, cdt, FP8), mask=m)
            tl.store(k_cache + dst + HALF, _to_kv_cache(k2, inv_k_scale, cdt, FP8), mask=m)
            # V moves in the same two half tiles, so one mask and one dst serve all four stores.
            src = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd
            v1 = tl.load(src, mask=m)
            v2 = tl.load(src + HALF * stride_vd, mask=m)
            tl.store(v_cache + dst, _to_kv_cache(v1, inv_v_scale, cdt, FP8), mask=m)
            tl.store(v_cache + dst + HALF, _to_kv_cache(v2, inv_v_scale, cdt, FP8), mask=m)


def _check_rotary(positions, q, k, cos, sin) -> None:
    assert q.dim() == 3 and k.dim() == 3, f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, head_dim]"
    t, _, dim = q.shape
    assert k.shape[0] == t and k.shape[2] == dim and dim % 2 == 0, (
        f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match (even head_dim)")
    assert q.dtype == k.dtype, f"q is {q.dtype}, k {k.dtype}"
    assert q.stride(2) == 1 and k.stride(2) == 1, "rotary: head_dim must be contiguous"
    assert positions.shape == (t,), f"positions {tuple(positions.shape)} for {t} tokens"
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == dim // 2, (
        f"cos/sin must be [max_positions, {dim // 2}], got {tuple(cos.shape)}")
    assert cos.is_contiguous() and sin.is_contiguous(), "cos/sin tables must be contiguous"


def _launch_rotary(positions, q, k, cos, sin, v=None, kv_layer=None, slot_mapping=None,
                   kv_scale=(1.0, 1.0), qk_norm=None) -> None:
    t, heads, dim = q.shape
    kvh = k.shape[1]
    if t == 0:
        return
    store = kv_layer is not None
    if store:
        kc, vc = kv_layer[0], kv_layer[1]
        kv_strides = (v.stride(0), v.stride(1), v.stride(2), kc.stride(0), kc.stride(1), kc.stride(2))
        bs = kv_layer.shape[2]
        k_scale, v_scale, fp8 = _kv_scales(kv_layer, kv_scale)
    else:  # unused pointers and strides: any valid tensor will do
        kc = vc = v = slot_mapping = k
        kv_strides, bs = (0,) * 6, 1
        k_scale, v_scale, fp8 = 1.0, 1.0, False
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)   # unused without QK_NORM
    pow2 = triton.next_power_of_2
    h_pad, kvh_pad, half_pad = pow2(heads), pow2(kvh), pow2(dim // 2)
    _rotary_kernel[(t,)](
        q, k, v, positions, cos, sin, kc, vc, slot_mapping, q_w, k_w, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *kv_strides, 1.0 / k_scale, 1.0 / v_scale,
        HEADS=heads, KV_HEADS=kvh, HALF=dim // 2, H_PAD=h_pad, KVH_PAD=kvh_pad, HALF_PAD=half_pad,
        BLOCK_SIZE=bs, STORE_KV=store, QK_NORM=qk_norm is not None, FP8=fp8,
        num_warps=4 if h_pad * half_pad >= 1024 else 1,
        **pdl_options(q.device, t))


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style rotary embedding of q [T, H, D] and k [T, KVH, D], in place (one launch)."""
    _check_rotary(positions, q, k, cos, sin)
    _launch_rotary(positions, q, k, cos, sin)
    return q, k


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: tuple[float, float] = (1.0, 1.0), qk_norm=None):
    """`rotary` of q and k in place, then `store_kv` of the rotated k and v, in one launch.

    qk_norm: (q weight [D], k weight [D], eps) to RMS-normalize each head of q
    and k before the rotation (Qwen3), in the same launch: otherwise two norm
    launches ahead of this kernel (from two tokens on, each behind a copy of
    its strided head view).
    A cache dtype other than k/v's is converted in the kernel (round to nearest
    even, as torch does, when compiled; the interpreter truncates fp32 -> bf16);
    an FP8 cache's values are quantized with kv_scale first.
    """
    _check_rotary(positions, q, k, cos, sin)
    _check_kv_write(k, v, kv_layer, slot_mapping)
    if qk_norm is not None:
        q_w, k_w, _ = qk_norm
        dim = q.shape[-1]
        assert q_w.shape == (dim,) and k_w.shape == (dim,), (
            f"q/k norm weights {tuple(q_w.shape)}, {tuple(k_w.shape)} for head_dim {dim}")
        assert q_w.is_contiguous() and k_w.is_contiguous(), "q/k norm weights must be contiguous"
    _launch_rotary(positions, q, k, cos, sin, v, kv_layer, slot_mapping, kv_scale, qk_norm)
    return q, k
