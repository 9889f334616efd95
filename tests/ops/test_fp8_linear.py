"""FP8 activation quantization (pdd.ops.triton_fp8) against its torch reference,
interpreted on CPU and compiled on CUDA; on a GPU with FP8 tensor cores, each FP8
GEMM (tensorwise, rowwise, block) against a float matmul of the dequantized
operands."""
from __future__ import annotations

import pytest
import torch

from tests.ops.interpreted import import_kernels
from tests.ops.test_kernels import CUDA, DEVICE, INTERPRET, _interpreter_env, triton  # noqa: F401  (the interpreter without a GPU)

from pdd.ops import fp8_linear  # noqa: E402
from pdd.ops.fp8_linear import FP8_DTYPE, quantize_reference  # noqa: E402

quantize = import_kernels("pdd.ops.triton_fp8").quantize

FP8_GPU = CUDA and torch.cuda.get_device_capability() >= (8, 9)
# One e4m3 step (1/8 relative) at most: a division may round the other way. The
# interpreter's float8 emulation rounds a value that carries into the next
# power of two down to the previous one (124.6 -> 64, not 128): looser there.
Q_RTOL = 0.5 if INTERPRET else 0.13


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("rows, k, group, pad_to", [(1, 64, 64, None), (5, 96, 32, 8), (3, 300, 128, 4)])
def test_quantize_matches_reference(rows, k, group, pad_to):
    x = rand(rows, k, seed=rows)
    x[0, :group] = 0  # an all-zero group keeps a finite scale
    q, s = quantize(x, group, None, pad_to)
    rq, rs = quantize_reference(x, group, None, pad_to)
    assert s.shape == rs.shape and s.stride() == rs.stride()  # column-major, as cuBLASLt takes block scales
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert q.dtype == FP8_DTYPE
    torch.testing.assert_close(q.float(), rq.float(), rtol=Q_RTOL, atol=0)
    assert torch.all(q[rows:].float() == 0)


def test_quantize_with_a_static_scale_clamps():
    x = rand(4, 64, seed=9)
    x[1, 3] = 1e4
    scale = torch.tensor(0.05, device=DEVICE)
    q, s = quantize(x, 64, scale)
    rq, rs = quantize_reference(x, 64, scale)
    assert torch.all(s == 0.05) and q[1, 3].float() == 448.0
    torch.testing.assert_close(q.float(), rq.float(), rtol=Q_RTOL, atol=0)


def _dequant_blocks(q, s, rows, cols):
    n, k = q.shape
    return q.float() * s.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


# Relative Frobenius error of an FP8 GEMM against the float matmul of its own dequantized
# operands: only accumulation order and the bf16 output differ.
GEMM_TOL = 1e-2
SHAPES = [(1, 6144, 4096), (3, 4096, 4096), (16, 28672, 4096), (33, 4096, 14336), (256, 1024, 512)]


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("kind", ["tensor", "channel", "static-channel", "static-tensor", "block"])
def test_fp8_gemm_matches_dequantized_matmul(kind, m, n, k):
    from pdd.model.fp8 import quantize_weight

    x = rand(m, k, dtype=torch.bfloat16, seed=1)
    w = rand(n, k, seed=2) * 0.02
    if kind == "block":
        if not fp8_linear.block_gemm_supported():
            pytest.skip(f"torch {torch.__version__} has no block-scaled GEMM")
        wq, ws = quantize_weight(w.cpu(), "block", (128, 128))
        wq, ws = wq.cuda(), ws.cuda()
        out = fp8_linear.blockwise(x, wq, ws, torch.bfloat16)
        xq, xs = quantize_reference(x, 128)
        ref = _dequant_blocks(xq, xs, 1, 128) @ _dequant_blocks(wq, ws, 128, 128).t()
    else:
        wq, ws = quantize_weight(w.cpu(), "tensor" if kind.endswith("tensor") else "channel")
        wq, ws = wq.cuda(), ws.cuda().float()
        static = torch.tensor(x.float().abs().max().item() / 448.0, device="cuda") if "static" in kind else None
        if kind == "static-tensor":
            out = fp8_linear.tensorwise(x, wq, ws.reshape(()), static, torch.bfloat16)
        else:
            out = fp8_linear.rowwise(x, wq, ws.reshape(1, -1).expand(1, n).contiguous(), static, torch.bfloat16)
        xq, xs = quantize_reference(x, k, static)
        ref = (xq.float() * xs) @ (wq.float() * ws.reshape(-1, 1)).t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < GEMM_TOL
    # And against the unquantized bf16 matmul: FP8's own error (e4m3 has 3 mantissa bits).
    assert _rel(out, x.float() @ w.float().t()) < 0.08
