"""Torch reference implementations of the KV-cache ops.

They define what the Triton kernels must compute, run everywhere (CPU CI
included) and stay batched: no Python loop over sequences. Attention pads each
group (decodes, prefills) to its longest member, which is wasteful but simple;
the kernels are the fast path.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim].
An FP8 cache (float8_e4m3fn) holds K and V divided by their layer's scales
(`kv_scale` = (k_scale, v_scale), pdd.kv.scales); for other caches the scales
are unused.
"""
from __future__ import annotations

import torch

from pdd.fp8_format import FP8_MAX
from pdd.ops.metadata import AttentionMetadata

UNIT_SCALE = (1.0, 1.0)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as stored in a cache of `dtype`: for FP8, x / scale (times its float32
    reciprocal, as the kernels compute it) clamped to e4m3's range (a value
    beyond it saturates instead of becoming NaN), rounded to nearest even."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache entry stands for: FP8 entries times their scale (float32)."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    return x.float() * scale


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # Index copies are not implemented for float8 on the CPU; the bytes are what moves.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: tuple[float, float] = UNIT_SCALE) -> None:
    """Write K/V of new tokens ([T, kv_heads, head_dim]) into their slots."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_layer.shape
    flat = _as_bytes(kv_layer).view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, _as_bytes(quantize_kv(key, kv_layer.dtype, kv_scale[0])))
    flat[1].index_copy_(0, slot_mapping, _as_bytes(quantize_kv(value, kv_layer.dtype, kv_scale[1])))


def _gather_context(kv_layer: torch.Tensor, block_tables: torch.Tensor, kv_scale: tuple[float, float]):
    """K and V of whole sequences, dequantized: [B, max_blocks * block_size, kv_heads, head_dim] each."""
    k = dequantize_kv(kv_layer[0][block_tables.long()], kv_scale[0])  # [B, max_blocks, block_size, kvh, d]
    v = dequantize_kv(kv_layer[1][block_tables.long()], kv_scale[1])
    b, mb, bs, kvh, d = k.shape
    return k.reshape(b, mb * bs, kvh, d), v.reshape(b, mb * bs, kvh, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, L, KVH, D], mask [B, Q, L] (True = attend) -> [B, Q, H, D]."""
    b, nq, h, d = q.shape
    kvh = k.shape[2]
    qg = q.float().view(b, nq, kvh, h // kvh, d)
    scores = torch.einsum("bqkgd,blkd->bkgql", qg, k.float()) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgql,blkd->bqkgd", probs, v.float())
    return out.reshape(b, nq, h, d).to(q.dtype)


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    scale: float, kv_scale: tuple[float, float] = UNIT_SCALE) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached context.

    q: [T, heads, head_dim]; the new tokens' K/V are already in the cache.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        k, v = _gather_context(kv_layer, meta.block_tables[:nd], kv_scale)
        key_pos = torch.arange(k.shape[1], device=q.device)
        mask = (key_pos[None, :] < meta.seq_lens[:nd, None])[:, None, :]  # [B, 1, L]
        out[:nd] = _attend(q[:nd, None], k, v, mask, scale)[:, 0]
    if nd < meta.num_seqs:
        out[nd:] = _prefill_attention(q, kv_layer, meta, scale, kv_scale)
    return out


def _prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                       scale: float, kv_scale: tuple[float, float]) -> torch.Tensor:
    nd = meta.num_decodes
    starts = meta.query_start_loc[nd:].long()
    q_lens = starts[1:] - starts[:-1]
    seq_lens = meta.seq_lens[nd:].long()
    first = int(starts[0])
    q_tokens = q[first:]
    num_seqs = q_lens.shape[0]
    # Pad the prefill queries into [B, Qmax, H, D] without a per-sequence loop.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    idx_in_seq = torch.arange(q_tokens.shape[0], device=q.device) - (starts[:-1] - first)[seq_of_token]
    padded = q.new_zeros(num_seqs, meta.max_query_len, *q.shape[1:])
    padded[seq_of_token, idx_in_seq] = q_tokens

    k, v = _gather_context(kv_layer, meta.block_tables[nd:], kv_scale)
    key_pos = torch.arange(k.shape[1], device=q.device)
    # Query j of a sequence sits at absolute position seq_len - q_len + j.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(meta.max_query_len, device=q.device)[None, :]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, L]
    out = _attend(padded, k, v, mask, scale)
    return out[seq_of_token, idx_in_seq]


def gather_blocks(kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pages of one layer into a contiguous [2, n, block_size, kv_heads, head_dim]."""
    # Index a view whose pages are flat rows: one contiguous copy per page
    # instead of the 5-D gather's element-wise walk (~5x faster on CPU).
    two, num_blocks = kv_layer.shape[:2]
    flat = kv_layer.reshape(two, num_blocks, -1)
    return flat.index_select(1, block_ids.long()).view(two, -1, *kv_layer.shape[2:])


def scatter_blocks(kv_layer: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """Inverse of gather_blocks: write contiguous pages into the given blocks."""
    two, num_blocks = kv_layer.shape[:2]
    flat = _as_bytes(kv_layer).view(two, num_blocks, -1)
    flat.index_copy_(1, block_ids.long(), _as_bytes(pages.to(kv_layer.dtype)).reshape(two, pages.shape[1], -1))


def copy_blocks(src_layer: torch.Tensor, dst_layer: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """Page copy between two pools (same layout): dst[:, dst_ids] = src[:, src_ids]."""
    scatter_blocks(dst_layer, dst_ids.to(dst_layer.device), gather_blocks(src_layer, src_ids).to(dst_layer.device))


# ---------------------------------------------------------------- decoder layer ops

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32, round to the model dtype, then scale: HF's order.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual), the sum in the model dtype."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style rotary embedding; cos/sin tables [max_positions, head_dim / 2] in float32."""
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    return _rotate(q, c, s), _rotate(k, c, s)


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: tuple[float, float] = UNIT_SCALE, qk_norm=None):
    """(with qk_norm = (q weight, k weight, eps): `rms_norm` of each q and k head
    first, Qwen3's q/k norm, then) `rotary`, then `store_kv` of the rotated k and
    v; returns the rotated (q, k).

    The Triton kernel rotates q and k in place and returns them, this one returns
    new tensors: callers use the returned pair, and count neither on the inputs
    being rotated nor on them being left as they were.
    """
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    q, k = rotary(positions, q, k, cos, sin)
    store_kv(k, v, kv_layer, slot_mapping, kv_scale)
    return q, k


# ---------------------------------------------------------------- sampling

def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> int64 [B]: the lowest index among ties; NaN counts as the maximum."""
    return logits.argmax(dim=-1)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights float32 [T, k], expert ids int32 [T, k]):
    the softmax over all experts (in float32), its top k, rescaled to sum to 1 when
    `renormalize` (which makes them the softmax over the k chosen, Mixtral's rule)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """Σ over each token's top-k experts e of weight * down[e] @ silu_and_mul(gate_up[e] @ x):
    x [T, H], gate_up [E, 2I, H], down [E, H, I] -> [T, H]. Each expert's output is
    rounded to x's dtype before it is weighted (as a GEMM in that dtype leaves it), the
    sum is in float32. A loop over the experts chosen: the reference, not the fast path."""
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        h = silu_and_mul(x[token] @ gate_up[e].t()) @ down[e].t()
        out.index_add_(0, token, h.float() * weights[token, slot, None])
    return out.to(x.dtype)
