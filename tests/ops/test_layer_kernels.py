"""Fused decoder-layer kernels (pdd.ops.triton_layers) against the torch reference.
Interpreted on CPU (float32; rotary_store_kv bf16 too), compiled on CUDA (float32 and bf16)."""
from __future__ import annotations

import pytest
import torch

from tests.ops.test_kernels import CUDA, DEVICE, _interpreter_env, make_kv, tk, triton  # noqa: F401  (the interpreter without a GPU)

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


# ---------------------------------------------------------------------------
# rotary_store_kv: rotary of q and k, then store_kv of the rotated k and v
# ---------------------------------------------------------------------------

BOTH = [torch.float32, torch.bfloat16]  # bf16 interpreted too: close, not equal (it truncates)


def rope_tables(dim, max_pos, seed):
    g = torch.Generator().manual_seed(seed)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(dim // 2, generator=g) + 0.01)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def qkv_views(t, heads, kv_heads, dim, dtype, seed):
    """q, k, v as the model makes them: splits of one [T, q + 2 kv] projection output, viewed per head."""
    qkv = rand(t, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=seed)
    qkv = torch.where(qkv == 0, torch.ones_like(qkv), qkv)  # never zero: a missed write shows
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return qkv, q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)


def scattered_slots(t, num_blocks, block_size, seed):
    """t distinct slots in random order over blocks 1.. (block 0 is the null block)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm((num_blocks - 1) * block_size, generator=g)[:t] + block_size).to(DEVICE)


def check_rotary_store_kv(t, heads, kv_heads, dim, dtype, cache_dtype, block_size=8, qk_norm=False):
    num_blocks = 2 + 2 * triton.cdiv(t, block_size)
    norm = None
    if qk_norm:   # Qwen3's per-head q and k norms, with weights away from 1
        norm = ((1 + 0.2 * rand(dim, dtype=torch.float32, seed=t + 5)).to(dtype),
                (1 - 0.2 * rand(dim, dtype=torch.float32, seed=t + 6)).to(dtype), 1e-6)
    cos, sin = rope_tables(dim, 100, seed=t)
    positions = torch.randint(0, 100, (t,), generator=torch.Generator().manual_seed(t + 1)).to(DEVICE)
    slots = scattered_slots(t, num_blocks, block_size, seed=t + 2)
    qkv, q, k, v = qkv_views(t, heads, kv_heads, dim, dtype, seed=t + 3)
    kv = make_kv(num_blocks, block_size, kv_heads, dim, cache_dtype, seed=t + 4)
    before, ref_kv, v_before = kv.clone(), kv.clone(), v.clone()
    ref_q, ref_k = reference.rotary_store_kv(positions, q.clone(), k.clone(), v.clone(), cos, sin,
                                             ref_kv, slots, qk_norm=norm)

    out_q, out_k = tk.rotary_store_kv(positions, q, k, v, cos, sin, kv, slots, qk_norm=norm)
    assert out_q is q and out_k is k, "q and k are rotated in place"
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    assert torch.equal(v, v_before), "V was modified"
    flat, ref_flat, old = (x.view(2, -1, kv_heads, dim) for x in (kv, ref_kv, before))
    coarsest = torch.bfloat16 if torch.bfloat16 in (dtype, cache_dtype) else torch.float32
    close(flat[0, slots], ref_flat[0, slots], coarsest)
    if dtype == cache_dtype or cache_dtype == torch.float32:  # V: exact copies
        assert torch.equal(flat[1, slots], ref_flat[1, slots])
    else:
        close(flat[1, slots], ref_flat[1, slots], cache_dtype)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], old[:, untouched]), "a slot outside slot_mapping changed"


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("t", [1, 5, 37])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 32), (4, 2, 48), (8, 2, 64), (6, 1, 16)])
def test_rotary_store_kv(dtype, t, heads, kv_heads, dim):
    check_rotary_store_kv(t, heads, kv_heads, dim, dtype, dtype)


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("t, heads, kv_heads, dim", [(1, 4, 2, 32), (7, 8, 2, 64), (5, 6, 1, 48)])
def test_rotary_store_kv_with_qk_norm_normalizes_each_head_first(dtype, t, heads, kv_heads, dim):
    check_rotary_store_kv(t, heads, kv_heads, dim, dtype, dtype, qk_norm=True)


def test_the_fused_qk_norm_is_the_norm_then_the_rotation():
    """The reference's fused op against the separate ops it stands for, so the kernel
    above is checked against what the model ran before the fusion."""
    t, heads, kv_heads, dim = 5, 4, 2, 32
    cos, sin = rope_tables(dim, 100, seed=1)
    positions = torch.arange(t, device=DEVICE)
    _, q, k, v = qkv_views(t, heads, kv_heads, dim, torch.float32, seed=2)
    qw, kw = 1 + 0.2 * rand(dim, dtype=torch.float32, seed=3), 1 - 0.2 * rand(dim, dtype=torch.float32, seed=4)
    kv_a, kv_b = make_kv(4, 8, kv_heads, dim, torch.float32), make_kv(4, 8, kv_heads, dim, torch.float32)
    slots = torch.arange(8, 8 + t, device=DEVICE)
    fused = reference.rotary_store_kv(positions, q, k, v, cos, sin, kv_a, slots, qk_norm=(qw, kw, 1e-6))
    apart = reference.rotary_store_kv(positions, reference.rms_norm(q, qw, 1e-6), reference.rms_norm(k, kw, 1e-6),
                                      v, cos, sin, kv_b, slots)
    assert torch.equal(fused[0], apart[0]) and torch.equal(fused[1], apart[1]) and torch.equal(kv_a, kv_b)


def test_rotary_store_kv_rejects_misshapen_qk_norm_weights():
    cos, sin = rope_tables(32, 10, seed=0)
    _, q, k, v = qkv_views(3, 4, 2, 32, torch.float32, seed=0)
    kv = make_kv(3, 8, 2, 32, torch.float32)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(AssertionError, match="q/k norm weights"):
        tk.rotary_store_kv(pos, q, k, v, cos, sin, kv, pos, qk_norm=(w[:16], w, 1e-6))


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_rotary_store_kv_converts_to_the_cache_dtype(dtype, cache_dtype):
    check_rotary_store_kv(9, 4, 2, 32, dtype, cache_dtype)


def test_rotary_store_kv_no_tokens():
    cos, sin = rope_tables(32, 10, seed=0)
    _, q, k, v = qkv_views(0, 4, 2, 32, torch.float32, seed=0)
    kv = make_kv(3, 8, 2, 32, torch.float32)
    before = kv.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    tk.rotary_store_kv(empty, q, k, v, cos, sin, kv, empty)
    assert torch.equal(kv, before)


def test_rotary_store_kv_rejects_bad_inputs():
    cos, sin = rope_tables(32, 10, seed=0)
    _, q, k, v = qkv_views(3, 4, 2, 32, torch.float32, seed=0)
    kv = make_kv(3, 8, 2, 32, torch.float32)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="slot_mapping has"):
        tk.rotary_store_kv(pos, q, k, v, cos, sin, kv, pos[:2])
    with pytest.raises(AssertionError, match="value must be"):
        tk.rotary_store_kv(pos, q, k, v[:, :1], cos, sin, kv, pos)
    with pytest.raises(AssertionError, match="cos/sin must be"):
        tk.rotary_store_kv(pos, q, k, v, cos[:, :8], sin[:, :8], kv, pos)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 3000])
def test_cuda_rotary_store_kv_llama3(t):
    # Llama-3-8B: 32 q heads, 8 kv heads, head_dim 128, bf16, block 16.
    check_rotary_store_kv(t, 32, 8, 128, torch.bfloat16, torch.bfloat16, block_size=16)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 3000])
def test_cuda_rotary_store_kv_qwen3_moe_with_qk_norm(t):
    # Qwen3-30B-A3B: 32 q heads, 4 kv heads, head_dim 128, q/k norms, bf16, block 16.
    check_rotary_store_kv(t, 32, 4, 128, torch.bfloat16, torch.bfloat16, block_size=16, qk_norm=True)
