"""FP8 GEMMs on Hopper: y = x @ W^T with W in float8 e4m3 and its scales.

Activations are quantized here, one kernel per GEMM (the chain of torch ops it
replaces is 5-6 launches per linear, 4 linears per layer: at decode batch
sizes those launches cost more than the GEMM), then cuBLASLt does the GEMM
through torch (`torch._scaled_mm`; `F.scaled_mm` for block scales). Measured
on the H200 (torch 2.11): 1.2-1.3 PFLOP/s on large shapes for all three scale
kinds (bf16: 0.7), and reading FP8 weights at decode sizes.

Scale layouts (what cuBLASLt takes):
- tensorwise: scale_a, scale_b scalars (static input scale, one weight scale).
- rowwise: scale_a [M, 1] per token, scale_b [1, N] per output channel.
- block: scale_a [M, K/128] per token and 128-column group, column-major, M a
  multiple of 4 (cuBLASLt refuses M=1..3: rows are padded); scale_b the
  checkpoint's [N/128, K/128] transposed, K/128 a multiple of 4.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3 value
_MIN_AMAX = 1e-12        # an all-zero row still gets a finite scale
BLOCK_ROWS_MULTIPLE = 4  # cuBLASLt's block-scaled GEMM wants M % 4 == 0 (TMA-aligned scales)


def quantize_reference(x: torch.Tensor, group: int, static_scale: torch.Tensor | None = None,
                       rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [rows, K] fp8, scale [rows, ceil(K/group)] float32, column-major) with
    x[m, g-th group] ~= q * scale[m, g]. Rows past M are zero (padding). With a static
    scale every entry of `scale` is it."""
    m, k = x.shape
    rows = m if rows is None else rows
    groups = -(-k // group)
    xf = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    xf[:m, :k] = x.float()
    xg = xf.view(rows, groups, group)
    if static_scale is None:
        scale = xg.abs().amax(-1).clamp_min(_MIN_AMAX) / FP8_MAX
    else:
        scale = static_scale.float().reshape(1, 1).expand(rows, groups)
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(rows, -1)[:, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.t().contiguous().t()


def _triton_quantize():
    """The Triton quantizer, or None where pdd's ops run as the torch reference."""
    from pdd import ops
    if ops._load_triton() is None:
        return None
    from pdd.ops.triton_fp8 import quantize
    return quantize


def quantize(x: torch.Tensor, group: int, static_scale: torch.Tensor | None = None,
             rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_reference's result, by one Triton kernel on the GPU."""
    kernel = _triton_quantize() if x.is_cuda else None
    return (kernel or quantize_reference)(x, group, static_scale, rows)


def rowwise(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            input_scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (per-token scales, or the static input scale) @ weight [N, K]^T,
    weight_scale [1, N] float32."""
    q, s = quantize(x, x.shape[1], input_scale)
    return torch._scaled_mm(q, weight.t(), scale_a=s.contiguous(), scale_b=weight_scale, out_dtype=out_dtype)


def tensorwise(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Static activations and one weight scale: scalars on both sides."""
    q, _ = quantize(x, x.shape[1], input_scale)
    return torch._scaled_mm(q, weight.t(), scale_a=input_scale, scale_b=weight_scale, out_dtype=out_dtype)


def blockwise(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] in 1x128 groups @ weight [N, K]^T in 128x128 blocks, weight_scale [N/128, K/128]."""
    import torch.nn.functional as F

    m = x.shape[0]
    rows = -(-m // BLOCK_ROWS_MULTIPLE) * BLOCK_ROWS_MULTIPLE
    q, s = quantize(x, 128, None, rows)
    out = F.scaled_mm(q, weight.t(), s, F.ScalingType.BlockWise1x128, weight_scale.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m]


def block_gemm_supported() -> bool:
    """Whether this torch has the block-scaled GEMM (F.scaled_mm, torch >= 2.10)."""
    import torch.nn.functional as F

    kinds = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and kinds is not None and hasattr(kinds, "BlockWise128x128")
