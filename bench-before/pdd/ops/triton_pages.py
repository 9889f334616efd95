"""Triton kernels that move KV pages: store new tokens' K/V into their slots, and
gather / scatter / copy whole pages (between pools too, across GPUs through
CUDA IPC: the copy touches the destination only through the kernel's stores)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdd.ops.triton_common import (_KV_DTYPES, _check_index, _check_kv_layer, _check_kv_write, _kv_scales,
                                   _on_gpu, _pow2, _to_kv_cache)

# ---------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_cb, stride_cs, stride_ch, inv_k_scale, inv_v_scale,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot >= 0:  # a negative slot (the reference would raise) writes nothing
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tok64 = tok.to(tl.int64)
        k = tl.load(key + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(value + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                    mask=mask)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(k_cache + dst, _to_kv_cache(k, inv_k_scale, k_cache.dtype.element_ty, FP8), mask=mask)
        tl.store(v_cache + dst, _to_kv_cache(v, inv_v_scale, v_cache.dtype.element_ty, FP8), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """Write K/V of new tokens ([T, kv_heads, head_dim]) into their slots (an FP8
    cache: quantized with kv_scale, see reference.quantize_kv)."""
    _check_kv_write(key, value, kv_layer, slot_mapping)
    _, _, bs, kvh, d = kv_layer.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    k_scale, v_scale, fp8 = _kv_scales(kv_layer, kv_scale)
    if not fp8:
        # A dtype conversion (never needed by the engine, whose cache has the model's
        # dtype) is left to torch: the Triton interpreter truncates fp32 -> bf16
        # where torch and compiled Triton round to nearest even.
        key = key if key.dtype == kv_layer.dtype else key.to(kv_layer.dtype)
        value = value if value.dtype == kv_layer.dtype else value.to(kv_layer.dtype)
    kc, vc = kv_layer[0], kv_layer[1]
    _store_kv_kernel[(num_tokens,)](
        key, value, kc, vc, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        KV_HEADS=kvh, HEAD_DIM=d, H_PAD=_pow2(kvh), D_PAD=_pow2(d), BLOCK_SIZE=bs, FP8=fp8,
        num_warps=4 if kvh * d >= 1024 else 1)


# ---------------------------------------------------------------------------
# page copies
# ---------------------------------------------------------------------------

# One compiled variant per page-copy kernel and direction, whatever the pools:
# Triton types an int argument i32 or i64 by its value, so a pool of over 2**31
# elements a layer (a small model given a whole GPU) would get a variant of its
# own, and a cuda_ipc sender writes into peers' pools of any size. The strides
# are typed i64 here (their products are 64-bit anyway: the layer and block
# indices are). They keep Triton's divisibility-by-16 specialization, which
# lets the copies move 16 bytes per access; with pages a multiple of 16
# elements (any block size >= 16) every stride of every pool is such a multiple.
# The page and block counts only size the grid or bound loops (never specialized).

@triton.jit
def _copy_pages_kernel(src, dst, src_ids, dst_ids, src_layer_stride: tl.int64, dst_layer_stride: tl.int64,
                       src_half_stride: tl.int64, src_block_stride: tl.int64, dst_half_stride: tl.int64,
                       dst_block_stride: tl.int64,
                       PAGE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                       SRC_IDS: tl.constexpr, DST_IDS: tl.constexpr):
    """dst[layer, half, dst_ids[i], chunk] = src[layer, half, src_ids[i], chunk], a
    missing id list meaning the identity (the contiguous side of a gather or scatter)."""
    i = tl.program_id(0)
    half = tl.program_id(1) // CHUNKS
    chunk = tl.program_id(1) % CHUNKS
    layer = tl.program_id(2).to(tl.int64)
    if SRC_IDS:
        s = tl.load(src_ids + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    if DST_IDS:
        t = tl.load(dst_ids + i).to(tl.int64)
    else:
        t = i.to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    src_ptrs = src + layer * src_layer_stride + half * src_half_stride + s * src_block_stride + offs
    dst_ptrs = dst + layer * dst_layer_stride + half * dst_half_stride + t * dst_block_stride + offs
    if PAGE % CHUNK == 0:
        x = tl.load(src_ptrs)
        tl.store(dst_ptrs, x.to(dst.dtype.element_ty))
    else:
        mask = offs < PAGE
        x = tl.load(src_ptrs, mask=mask)
        tl.store(dst_ptrs, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n", "total"])
def _copy_pages_few_ctas_kernel(src, dst, src_ids, dst_ids, src_layer_stride: tl.int64,
                                dst_layer_stride: tl.int64, src_half_stride: tl.int64, src_block_stride: tl.int64,
                                dst_half_stride: tl.int64, dst_block_stride: tl.int64,
                                n, total, PAGE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """_copy_pages_kernel's work (both id lists given) done by a fixed number of
    programs, each looping over (layer, page, half, chunk) items: a copy that
    runs beside a forward pass holds only that many SMs' worth of slots."""
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        c = item % (2 * CHUNKS)
        rest = item // (2 * CHUNKS)
        i = rest % n
        layer = (rest // n).to(tl.int64)
        half = c // CHUNKS
        chunk = c % CHUNKS
        s = tl.load(src_ids + i).to(tl.int64)
        t = tl.load(dst_ids + i).to(tl.int64)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        src_ptrs = src + layer * src_layer_stride + half * src_half_stride + s * src_block_stride + offs
        dst_ptrs = dst + layer * dst_layer_stride + half * dst_half_stride + t * dst_block_stride + offs
        mask = offs < PAGE
        x = tl.load(src_ptrs, mask=mask)
        tl.store(dst_ptrs, x.to(dst.dtype.element_ty), mask=mask)


def _copy_geometry(src, dst):
    """(layers, (src layer, half, block strides), (dst ...), page elements, chunk, chunks)."""
    if src.dim() == 6:
        layers, ss, ds = src.shape[0], src.stride()[:3], dst.stride()[:3]
    else:
        layers, ss, ds = 1, (0, *src.stride()[:2]), (0, *dst.stride()[:2])
    page = src[(0,) * (src.dim() - 3)].numel()
    gpu = _on_gpu(src) or _on_gpu(dst)
    chunk = min(_pow2(page), 4096 if gpu else 1024)
    return layers, ss, ds, page, chunk, triton.cdiv(page, chunk)


def _launch_copy(src, dst, src_ids, dst_ids, n: int) -> None:
    """src/dst: [2, blocks, *page] (one layer) or [layers, 2, blocks, *page],
    with contiguous pages; ids: None for identity."""
    if n == 0:
        return
    layers, (sl, sh, sb), (dl, dh, db), page, chunk, chunks = _copy_geometry(src, dst)
    gpu = _on_gpu(src) or _on_gpu(dst)
    any_ids = src_ids if src_ids is not None else dst_ids
    _copy_pages_kernel[(n, 2 * chunks, layers)](
        src, dst, src_ids if src_ids is not None else any_ids, dst_ids if dst_ids is not None else any_ids,
        sl, dl, sh, sb, dh, db,
        PAGE=page, CHUNK=chunk, CHUNKS=chunks, SRC_IDS=src_ids is not None, DST_IDS=dst_ids is not None,
        num_warps=4 if gpu else 1)


def gather_blocks(kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pages of one layer into a contiguous [2, n, block_size, kv_heads, head_dim]."""
    _check_kv_layer(kv_layer)
    _check_index(block_ids, "block_ids", kv_layer.device)
    n = block_ids.shape[0]
    out = torch.empty((2, n, *kv_layer.shape[2:]), dtype=kv_layer.dtype, device=kv_layer.device)
    _launch_copy(kv_layer, out, block_ids, None, n)
    return out


def scatter_blocks(kv_layer: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """Inverse of gather_blocks: write contiguous pages into the given blocks."""
    _check_kv_layer(kv_layer)
    _check_index(block_ids, "block_ids", kv_layer.device)
    n = block_ids.shape[0]
    assert pages.shape == (2, n, *kv_layer.shape[2:]), (
        f"pages must be [2, {n}, {', '.join(map(str, kv_layer.shape[2:]))}], got {tuple(pages.shape)}")
    assert pages.dtype in _KV_DTYPES, f"pages dtype {pages.dtype} not supported"
    assert pages.device == kv_layer.device, f"pages are on {pages.device}, kv_layer on {kv_layer.device}"
    if pages.dtype != kv_layer.dtype:  # see store_kv
        pages = pages.to(kv_layer.dtype)
    if n and not (pages.stride(4) == 1 and pages.stride(3) == pages.shape[4]
                  and pages.stride(2) == pages.shape[3] * pages.shape[4]):
        pages = pages.contiguous()
    _launch_copy(pages, kv_layer, None, block_ids, n)


def copy_blocks_unchecked(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                          dst_ids: torch.Tensor, max_ctas: int | None = None) -> None:
    """copy_blocks for a caller that made its checks once for many calls (the
    cuda_ipc sender: same pools and ids for every layer of a step), on the
    current device and stream: one kernel launch, nothing else on the host.
    src/dst may also be runs of layers, [layers, 2, blocks, ...]: one launch
    copies the pages of all of them. `max_ctas` caps the programs (each then
    loops over several pages): a copy overlapping compute takes fewer SMs."""
    n = src_ids.shape[0]
    if not max_ctas:
        _launch_copy(src, dst, src_ids, dst_ids, n)
        return
    layers, (sl, sh, sb), (dl, dh, db), page, chunk, chunks = _copy_geometry(src, dst)
    total = layers * n * 2 * chunks
    if total:
        _copy_pages_few_ctas_kernel[(min(max_ctas, total),)](
            src, dst, src_ids, dst_ids, sl, dl, sh, sb, dh, db, n, total,
            PAGE=page, CHUNK=chunk, CHUNKS=chunks, num_warps=4 if _on_gpu(src) or _on_gpu(dst) else 1)


def copy_blocks(src_layer: torch.Tensor, dst_layer: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """Page copy between two pools (same layout): dst[:, dst_ids] = src[:, src_ids].

    Runs on src_layer's device and touches dst_layer only through the kernel's
    stores (no torch op on it), so dst_layer may be a peer GPU's pool opened in
    this device's context through CUDA IPC. Index tensors should already be on
    src_layer's device; others are copied there first (from the host that is a
    synchronous copy). If src and dst are the same pool, the two id sets must
    not overlap (the reference reads all pages before writing any).
    """
    _check_kv_layer(src_layer, "src_layer")
    _check_kv_layer(dst_layer, "dst_layer")
    assert src_layer.shape[2:] == dst_layer.shape[2:], (
        f"page layouts differ: src {tuple(src_layer.shape[2:])} vs dst {tuple(dst_layer.shape[2:])}")
    assert src_layer.device.type == dst_layer.device.type, (
        f"src_layer on {src_layer.device}, dst_layer on {dst_layer.device}")
    dev = src_layer.device
    src_ids = src_ids if src_ids.device == dev else src_ids.to(dev)
    dst_ids = dst_ids if dst_ids.device == dev else dst_ids.to(dev)
    _check_index(src_ids, "src_ids", dev)
    _check_index(dst_ids, "dst_ids", dev)
    n = src_ids.shape[0]
    assert dst_ids.shape[0] == n, f"{n} src_ids but {dst_ids.shape[0]} dst_ids"
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            _launch_copy(src_layer, dst_layer, src_ids, dst_ids, n)
    else:
        _launch_copy(src_layer, dst_layer, src_ids, dst_ids, n)
