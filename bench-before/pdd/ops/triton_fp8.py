"""FP8 activation quantization in one Triton kernel (semantics: fp8_linear.quantize_reference).

One program per (row, group of columns): the group's absolute max gives its
scale (or the static scale is read), the group is divided by it, clamped to
the e4m3 range and stored as fp8; rows past the input's (padding) store zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdd.ops.fp8_linear import _MIN_AMAX, FP8_DTYPE, FP8_MAX


# The row count changes with every batch: one compiled variant for all of them.
@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, M, K, stride_x, stride_q, stride_s_row, stride_s_grp,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    offs = grp * GROUP + tl.arange(0, BLOCK)
    in_group = (offs < K) & (offs < grp * GROUP + GROUP)
    real_row = tl.full([BLOCK], 0, tl.int64) + row < M   # padding rows read nothing
    x = tl.load(x_ptr + row * stride_x + offs, mask=in_group & real_row, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / FP8_MAX
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=in_group)
    tl.store(s_ptr + row * stride_s_row + grp * stride_s_grp, scale)


def quantize(x: torch.Tensor, group: int, static_scale: torch.Tensor | None = None,
             rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with unit column stride, got {tuple(x.stride())}"
    assert static_scale is None or static_scale.numel() == 1, "static_scale must hold one value"
    m, k = x.shape
    rows = m if rows is None else rows
    assert rows >= m, f"rows {rows} < {m} input rows"
    groups = -(-k // group)
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()  # column-major [rows, groups]
    if rows:
        _quantize_kernel[(rows, groups)](
            x, q, scale, static_scale if static_scale is not None else scale, m, k, x.stride(0), q.stride(0),
            scale.stride(0), scale.stride(1), GROUP=group, BLOCK=triton.next_power_of_2(group),
            STATIC=static_scale is not None, FP8_MAX=FP8_MAX, MIN_AMAX=_MIN_AMAX,
            num_warps=4 if group <= 4096 else 8)
    return q, scale
