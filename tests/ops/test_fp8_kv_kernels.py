"""An FP8 (e4m3) KV cache in the Triton kernels against the torch reference:
writes quantize (x / scale, clamped to +-448, rounded to nearest even), reads
dequantize (entry x scale). Interpreted on CPU, compiled on CUDA.

Tolerances: the stored bytes are equal when compiled (Triton's cast and
torch's both round to nearest even). The interpreter's float -> e4m3 cast is
not that: it loses the carry into the exponent (1.97 -> 1.0, not 2.0) and
rounds some ties the other way, so interpreted writes get values already on
the FP8 grid (times the scale, a power of two: no rounding happens) and only
rotated K, made inside the kernel, is compared loosely there. Attention is
compared with the reference run on the dequantized cache (float32), at the
tolerances of the bf16/fp32 attention tests: an FP8 entry converts to bf16 or
fp32 exactly, so FP8 adds no error of its own to the kernel, only the scale
folding (K's into the softmax scale, V's into the output: float32 roundings).
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.test_kernels import (CUDA, DEVICE, _interpreter_env, make_batch, make_kv, rel_err,  # noqa: F401
                                    ta, tk)
from tests.ops.test_layer_kernels import qkv_views, rope_tables, scattered_slots

from pdd.ops import reference  # noqa: E402

FP8 = torch.float8_e4m3fn
SCALES = [(1.0, 1.0), (0.5, 2.0)]


def quantized_kv(num_blocks, block_size, kv_heads, head_dim, kv_scale, seed=0):
    """A random FP8 cache as the kernels would have written it (through the reference)."""
    x = make_kv(num_blocks, block_size, kv_heads, head_dim, torch.float32, seed) * 2
    kv = torch.empty(x.shape, dtype=FP8, device=DEVICE)
    kv[0] = reference.quantize_kv(x[0], FP8, kv_scale[0])
    kv[1] = reference.quantize_kv(x[1], FP8, kv_scale[1])
    return kv


def dequantized(kv, kv_scale):
    return torch.stack([kv[0].float() * kv_scale[0], kv[1].float() * kv_scale[1]])


def assert_codes_equal(a, b):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.isfinite(a.float()).all(), "a NaN was stored"


def kv_values(*shape, scale, seed, dtype=torch.float32):
    """Random K or V values; interpreted, on the FP8 grid times `scale` (see above)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3
    if not CUDA:
        x = reference.quantize_kv(x, FP8, scale).float() * scale
    return x.to(dtype).to(DEVICE)


def check_fp8_attention(q, kv, meta, kv_scale, tol=None):
    scale = q.shape[-1] ** -0.5
    out = tk.paged_attention(q, kv, meta, scale, kv_scale)
    ref = reference.paged_attention(q, dequantized(kv, kv_scale), meta, scale)
    # The reference's own FP8 path is the same computation.
    assert torch.equal(reference.paged_attention(q, kv, meta, scale, kv_scale), ref)
    assert torch.isfinite(out.float()).all()
    tol = tol or (1e-5 if q.dtype == torch.float32 else 1e-2)
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    row_err = ((out.float() - ref.float()).flatten(1).norm(dim=1)
               / ref.float().flatten(1).norm(dim=1)).max().item()
    assert row_err < 4 * tol, f"worst token's relative error {row_err:.2e}"


def fp8_batch(seqs, kv_scale, dtype=torch.float32, block_size=16, kv_heads=2, heads=4, head_dim=32, seed=0):
    q, kv, meta = make_batch(seqs, block_size=block_size, kv_heads=kv_heads, heads=heads, head_dim=head_dim,
                             dtype=dtype, seed=seed)
    return q, quantized_kv(kv.shape[1], block_size, kv_heads, head_dim, kv_scale, seed), meta


# ---------------------------------------------------------------------------
# writes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantizes_like_the_reference(kv_scale, src_dtype):
    t, kvh, d, bs = 21, 2, 32, 8
    key = kv_values(t, kvh, d, scale=kv_scale[0], seed=3, dtype=src_dtype)
    value = kv_values(t, kvh, d, scale=kv_scale[1], seed=4, dtype=src_dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -449.0])   # beyond e4m3's range: saturate
    slots = scattered_slots(t, 8, bs, seed=4)
    a = torch.zeros(2, 8, bs, kvh, d, dtype=FP8, device=DEVICE)
    b = a.clone()
    tk.store_kv(key, value, a, slots, kv_scale)
    reference.store_kv(key, value, b, slots, kv_scale)
    assert_codes_equal(a, b)
    flat = a.view(2, -1, kvh, d)
    assert flat[0, slots[0], 0, :4].float().abs().tolist() == [448.0] * 4
    # What is read back is the value to within e4m3's rounding (3 mantissa bits).
    back = flat[1, slots].float() * kv_scale[1]
    assert ((back - value.float()).abs() <= value.float().abs() / 16 + 2 ** -9 * kv_scale[1]).all()


@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv_quantizes_like_the_reference(kv_scale, dtype):
    t, heads, kvh, dim, bs = 13, 4, 2, 32, 8
    cos, sin = rope_tables(dim, 100, seed=1)
    positions = torch.randint(0, 100, (t,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    slots = scattered_slots(t, 6, bs, seed=3)
    _, q, k, _ = qkv_views(t, heads, kvh, dim, dtype, seed=4)
    v = kv_values(t, kvh, dim, scale=kv_scale[1], seed=5, dtype=dtype)
    a = torch.zeros(2, 6, bs, kvh, dim, dtype=FP8, device=DEVICE)
    b = a.clone()
    reference.rotary_store_kv(positions, q.clone(), k.clone(), v.clone(), cos, sin, b, slots, kv_scale)
    tk.rotary_store_kv(positions, q, k, v, cos, sin, a, slots, kv_scale)
    if CUDA:
        assert_codes_equal(a, b)
        return
    assert_codes_equal(a[1], b[1])
    # Interpreted K: within the cast's lost carry (half the value) and a bf16 step.
    assert ((a[0].float() - b[0].float()).abs() <= b[0].float().abs() / 2 + 2 ** -9).all()


# ---------------------------------------------------------------------------
# attention over an FP8 cache
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_prefill_and_mixed(kv_scale, dtype):
    seqs = [(1, 9), (1, 70), (1, 33), (24, 24), (17, 81), (40, 45)]
    q, kv, meta = fp8_batch(seqs, kv_scale, dtype, block_size=4, seed=3)
    assert meta.num_decodes == 3
    check_fp8_attention(q, kv, meta, kv_scale)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_decode_and_prefill(monkeypatch, splits):
    """Split partials carry V's scale (the merge sums them as they are)."""
    monkeypatch.setattr(ta, "_decode_num_splits", lambda *a: splits)
    monkeypatch.setattr(ta, "_prefill_num_splits", lambda *a: splits)
    seqs = [(1, 3), (1, 130), (29, 200), (5, 123)]
    q, kv, meta = fp8_batch(seqs, (0.5, 2.0), block_size=4, seed=splits)
    check_fp8_attention(q, kv, meta, (0.5, 2.0))


def test_a_bf16_cache_ignores_scales():
    """Scales belong to FP8 caches: a bf16 cache's attention is unchanged by them."""
    q, kv, meta = make_batch([(1, 20), (7, 30)], block_size=8, kv_heads=2, heads=4, head_dim=32,
                             dtype=torch.float32)
    assert torch.equal(tk.paged_attention(q, kv, meta, 0.2, (3.0, 5.0)), tk.paged_attention(q, kv, meta, 0.2))


# ---------------------------------------------------------------------------
# page copies move FP8 bytes as they are
# ---------------------------------------------------------------------------

def test_fp8_pages_gather_scatter_and_copy():
    src = quantized_kv(20, 16, 2, 32, (1.0, 1.0), seed=1)
    ids = torch.tensor([7, 0, 19, 3], device=DEVICE)
    pages = tk.gather_blocks(src, ids)
    assert pages.dtype == FP8 and torch.equal(pages.view(torch.uint8), src[:, ids].view(torch.uint8))
    dst = torch.zeros(2, 12, 16, 2, 32, dtype=FP8, device=DEVICE)
    dst_ids = torch.tensor([2, 11, 4, 9], device=DEVICE)
    tk.scatter_blocks(dst, dst_ids, pages)
    assert torch.equal(dst[:, dst_ids].view(torch.uint8), pages.view(torch.uint8))
    other = torch.zeros_like(dst)
    tk.copy_blocks(src, other, ids, dst_ids)
    ref = torch.zeros_like(dst)
    reference.copy_blocks(src, ref, ids, dst_ids)
    assert torch.equal(other.view(torch.uint8), ref.view(torch.uint8))


# ---------------------------------------------------------------------------
# CUDA: Llama-3-8B attention shapes (32 q heads, 8 kv heads, head_dim 128), bf16 queries
# ---------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
L3 = dict(heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("kv_scale", SCALES)
def test_cuda_fp8_decode_b32_ctx8k(kv_scale):
    g = torch.Generator().manual_seed(21)
    lens = torch.randint(6000, 8193, (32,), generator=g).tolist()
    q, kv, meta = fp8_batch([(1, s) for s in lens], kv_scale, seed=21, **L3)
    check_fp8_attention(q, kv, meta, kv_scale)


@cuda_only
def test_cuda_fp8_mixed_and_long_prefill():
    g = torch.Generator().manual_seed(22)
    decodes = [(1, s) for s in torch.randint(1, 8193, (16,), generator=g).tolist()]
    prefills = [(2048, 8192), (1000, 1000), (128, 12000), (1, 77)]
    q, kv, meta = fp8_batch(decodes + prefills, (0.5, 2.0), seed=22, **L3)
    check_fp8_attention(q, kv, meta, (0.5, 2.0))


@cuda_only
def test_cuda_fp8_store_llama3():
    t, kvh, d = 3000, 8, 128
    g = torch.Generator().manual_seed(23)
    key = (torch.randn(t, kvh, d, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    value = (torch.randn(t, kvh, d, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    slots = scattered_slots(t, 400, 16, seed=24)
    a = torch.zeros(2, 400, 16, kvh, d, dtype=FP8, device=DEVICE)
    b = a.clone()
    tk.store_kv(key, value, a, slots, (0.5, 2.0))
    reference.store_kv(key, value, b, slots, (0.5, 2.0))
    assert_codes_equal(a, b)
