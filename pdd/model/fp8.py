"""FP8 linear layers: what a checkpoint with an FP8 `quantization_config` loads into.

The decoder (llama.py) is built with plain nn.Linear layers. At load one of two
things happens, decided once for the whole model:
- FP8 GEMMs (CUDA, compute capability >= 8.9, bf16 activations): every
  quantized linear becomes an `Fp8Linear` holding the checkpoint's FP8 weight
  and scales; its forward is the GEMM picked for its scales (pdd.ops.fp8_linear).
  The decoder calls its linears through pdd.ops.linear, which at decode sizes
  (the row buckets of ops.FP8_GEMV_BUCKETS) takes the weight-only GEMV instead
  (bf16 activations, the scales applied in registers).
- Otherwise (the CPU, older GPUs, a layer whose shape the block GEMM cannot
  take): the layers stay nn.Linear and the loader fills them with the weights
  dequantized to the checkpoint's dtype, so the model computes exactly what the
  same weights dequantized and saved as a plain checkpoint compute.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pdd.model.quant_config import Fp8Scheme
from pdd.ops import fp8_linear
from pdd.fp8_format import FP8_DTYPE, FP8_MAX, FP8_MIN_AMAX

log = logging.getLogger(__name__)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """FP8 weight [N, K] and its scale -> float32 [N, K]. The scale is one value,
    one per output channel ([N] or [N, 1]), or one per block ([ceil(N/bn), ceil(K/bk)])."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is not None:
        bn, bk = block
        n, k = w.shape
        s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif s.numel() > 1:
        s = s.reshape(-1, 1)
    return w * s


def quantize_weight(w: torch.Tensor, weight: str, block: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [N, K] -> (fp8 weight, float32 scale) for `weight` in tensor
    (scale []), channel ([N, 1]) or block ([ceil(N/bn), ceil(K/bk)]); amax scaling."""
    wf = w.to(torch.float32)
    if weight == "tensor":
        s = wf.abs().amax().clamp_min(FP8_MIN_AMAX) / FP8_MAX
        return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s
    if weight == "channel":
        s = wf.abs().amax(1, keepdim=True).clamp_min(FP8_MIN_AMAX) / FP8_MAX
        return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s
    bn, bk = block
    n, k = wf.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, device=wf.device)
    padded[:n, :k] = wf
    s = padded.view(nb, bn, kb, bk).abs().amax((1, 3)).clamp_min(FP8_MIN_AMAX) / FP8_MAX
    q = padded.view(nb, bn, kb, bk) / s[:, None, :, None]
    return q.clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k].to(FP8_DTYPE), s


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ b) with W in FP8: weight [N, K] float8_e4m3fn, weight_scale
    float32 [N] (one per output row: per-tensor scales of packed shards become
    rows) or [N/bn, K/bk] (block), input_scale a static activation scale or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme,
                 device: torch.device, out_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = scheme.block
        self.out_dtype = out_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        if self.block:
            bn, bk = self.block
            scale_shape = (-(-out_features // bn), -(-in_features // bk))
        else:
            scale_shape = (out_features,)
        self.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32, device=device),
                                         requires_grad=False)
        # Packed shards each bring their own static scale; the largest clips none of them.
        self.input_scale = (nn.Parameter(torch.zeros((), dtype=torch.float32, device=device), requires_grad=False)
                            if scheme.static_input else None)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device), requires_grad=False)
                     if bias else None)
        self._gemm = None

    @torch.no_grad()
    def load_shard(self, rows: slice, weight: torch.Tensor, scale: torch.Tensor,
                   input_scale: torch.Tensor | None) -> None:
        """The checkpoint's FP8 `weight` of output rows `rows` with its scale(s)."""
        self.weight[rows].copy_(weight)
        if self.block:
            bn = self.block[0]
            self.weight_scale[rows.start // bn:-(-rows.stop // bn)].copy_(scale)
        else:
            self.weight_scale[rows].copy_(scale.to(torch.float32).reshape(-1).expand(rows.stop - rows.start))
        if self.input_scale is not None:
            self.input_scale.copy_(torch.maximum(self.input_scale, input_scale.to(torch.float32).reshape(())))

    def finalize(self) -> None:
        """Pick the GEMM for the loaded scales (once, after the weights are in)."""
        if self.block:
            self._gemm = self._blockwise
        elif self.input_scale is not None and bool((self.weight_scale == self.weight_scale[0]).all()):
            self._scalar_weight_scale = self.weight_scale[:1].reshape(())
            self._gemm = self._tensorwise
        else:
            self._row_scale = self.weight_scale.view(1, -1)
            self._gemm = self._rowwise

    def _rowwise(self, x):
        return fp8_linear.rowwise(x, self.weight, self._row_scale, self.input_scale, self.out_dtype)

    def _tensorwise(self, x):
        return fp8_linear.tensorwise(x, self.weight, self._scalar_weight_scale, self.input_scale, self.out_dtype)

    def _blockwise(self, x):
        return fp8_linear.blockwise(x, self.weight, self.weight_scale, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (The decoder calls it through ops.linear, which takes the weight-only GEMV
        # instead where that is faster: this is the GEMM path.)
        out = self._gemm(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def fp8_gemm_unavailable(device: torch.device, dtype: torch.dtype, scheme: Fp8Scheme) -> str | None:
    """Why this engine cannot run FP8 GEMMs (then weights are dequantized), or None."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 GEMM"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute capability < 8.9)"
    if dtype != torch.bfloat16:
        return f"FP8 GEMMs output bfloat16, the engine runs {dtype}"
    if scheme.block:
        if scheme.block != (128, 128):
            return f"block-scaled GEMMs take 128x128 blocks, the checkpoint has {scheme.block}"
        if not fp8_linear.block_gemm_supported():
            return f"torch {torch.__version__} has no block-scaled GEMM (F.scaled_mm)"
    return None


def _shape_fits(linear: nn.Linear, shard_sizes: list[int], scheme: Fp8Scheme) -> bool:
    n, k = linear.out_features, linear.in_features
    if n % 16 or k % 16:
        return False  # cuBLASLt's FP8 GEMMs need 16-aligned dimensions
    if scheme.block:
        bn, bk = scheme.block
        starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        # Packed shards must start on block rows; K/bk must be a multiple of 4.
        return all(s % bn == 0 for s in starts) and k % (bk * 4) == 0
    return True


def swap_linears(model: nn.Module, scheme: Fp8Scheme, hf_names: dict[str, list[str]],
                 shard_sizes: dict[str, list[int]], device: torch.device, dtype: torch.dtype,
                 skip: set[str] = frozenset()) -> int:
    """Replace each nn.Linear that the checkpoint stores in FP8 by an Fp8Linear;
    how many were replaced. hf_names: module name -> the checkpoint's module names
    packed into it; shard_sizes: module name -> their row counts; skip: modules kept."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if name in skip:
            continue
        if not isinstance(module, nn.Linear) or not all(scheme.quantizes(n) for n in hf_names.get(name, [name])):
            continue
        if not _shape_fits(module, shard_sizes.get(name, [module.out_features]), scheme):
            log.info("%s [%d x %d]: shape not taken by the FP8 GEMM, weights dequantized",
                     name, module.out_features, module.in_features)
            continue
        parent_name, _, attr = name.rpartition(".")
        fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, scheme, device, dtype)
        setattr(model.get_submodule(parent_name), attr, fp8)
        swapped += 1
    return swapped


def finalize(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.finalize()
