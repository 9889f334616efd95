"""Fused Triton kernels for the decoder's small per-token ops.

Eagerly, RMSNorm, the residual add, rotary embedding and SiLU-and-mul are each
a chain of 4-10 tiny torch kernels; at decode batch sizes those launches (even
replayed from a CUDA graph) cost more than the work. One kernel each here.
Semantics (and rounding points) follow `pdd.ops.reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, N] with unit stride along N (a copy only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
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
                                         num_warps=4 if n <= 4096 else 8)
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
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, HEADS, HALF,
                 H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    h = tl.arange(0, H_PAD)
    dm = d < HALF
    m = (h[:, None] < HEADS) & dm[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    # cos/sin are rounded to the activations' dtype first, as the reference does.
    cos = tl.load(cos_ptr + p * HALF + d, mask=dm, other=0.0).to(x1.dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + p * HALF + d, mask=dm, other=0.0).to(x1.dtype).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (a * cos - b * sin).to(x1.dtype), mask=m)
    tl.store(base + HALF, (b * cos + a * sin).to(x1.dtype), mask=m)


def _rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    t, heads, dim = x.shape
    assert x.stride(2) == 1, "rotary: head_dim must be contiguous"
    half = dim // 2
    assert cos.shape[1] == half and cos.is_contiguous() and sin.is_contiguous()
    if t:
        _rope_kernel[(t,)](x, positions, cos, sin, x.stride(0), x.stride(1), heads, half,
                           H_PAD=triton.next_power_of_2(heads), HALF_PAD=triton.next_power_of_2(half))


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style rotary embedding of q [T, H, D] and k [T, KVH, D], in place."""
    _rope_(q, positions, cos, sin)
    _rope_(k, positions, cos, sin)
    return q, k
