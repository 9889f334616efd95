"""Fused decoder-layer kernels (pdd.ops.triton_layers) against the torch reference.
Interpreted on CPU (float32), compiled on CUDA (float32 and bf16)."""
from __future__ import annotations

import pytest
import torch

from tests.ops.test_kernels import CUDA, DEVICE, tk  # sets up the interpreter when there is no GPU

from pdd.ops import reference  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e}"


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 64), (7, 96), (33, 128)])
def test_rms_norm_and_fused_residual_add(dtype, rows, n):
    x, res = rand(rows, n, dtype=dtype, seed=1), rand(rows, n, dtype=dtype, seed=2)
    w = (1 + 0.1 * rand(n, dtype=torch.float32, seed=3)).to(dtype)
    close(tk.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
    ref_out, ref_res = reference.add_rms_norm(x, res, w, 1e-6)
    out, new_res = tk.add_rms_norm(x, res.clone(), w, 1e-6)
    close(out, ref_out, dtype)
    close(new_res, ref_res, dtype)


def test_rms_norm_of_a_strided_head_view():
    # q/k norm (Qwen3) normalises [T, H, D] views of the fused qkv output.
    qkv = rand(5, 3 * 4 * 48, dtype=torch.float32, seed=4)
    q = qkv[:, :4 * 48].view(5, 4, 48)
    w = 1 + 0.1 * rand(48, dtype=torch.float32, seed=5)
    close(tk.rms_norm(q, w, 1e-6), reference.rms_norm(q, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 32), (9, 352), (4, 3000)])
def test_silu_and_mul(dtype, rows, n):
    x = rand(rows, 2 * n, dtype=dtype, seed=6)
    close(tk.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (4, 1, 48), (8, 8, 64)])
def test_rotary_in_place_on_qkv_views(dtype, heads, kv_heads, dim):
    t, max_pos = 11, 64
    qkv = rand(t, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=7)
    q = qkv[:, :heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(dim // 2) + 0.01).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    ref_q, ref_k = reference.rotary(positions, q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    out_q, out_k = tk.rotary(positions, q, k, cos, sin)
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before), "rotary touched V"
