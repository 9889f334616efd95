"""Fused mixture-of-experts kernels: routing, grouping and the expert GEMMs.

`fused_moe` (reference.fused_moe defines the result) is a fixed sequence of
launches whatever the routing: no loop over experts, no per-expert launch, no
host sync, every buffer and grid sized from shapes alone (the worst case), so
a decode step with MoE layers can be captured in a CUDA graph.

1. `_route_kernel`, 16 tokens a program: softmax over the router logits,
   top-k by k rounds of argmax, renormalized -> weights [T, k], ids [T, k].
   Each (token, choice) is a *pair*, numbered token * k + choice.
2. Small batches (pairs <= GEMV_MAX_PAIRS, decode): `_expert_gemv`, grid
   (pairs, N tiles). A program reads the rows of its pair's expert only, so a
   step reads the chosen experts' weights and nothing else (the dense GEMV's
   idea, pdd.ops.triton_gemv); a pair needs no grouping.
3. Larger batches (prefill): `align` groups the pairs by expert in three
   launches: counts per expert (`_count_kernel`, a chunk of pairs a program),
   each expert's run padded to BLOCK_M and the expert of each BLOCK_M block, -1
   past the last (`_runs_kernel`, one program), the pairs scattered into their
   runs (`_scatter_kernel`; `sorted_pairs`, padding = pairs, past the end). Then
   `_expert_gemm`, grid (worst-case blocks, N tiles): a program multiplies
   BLOCK_M pairs of one expert by that expert's weights on the tensor cores
   (tl.dot); unused blocks return at once.
Both GEMM kernels run twice: gate_up with SiLU-and-mul fused (gate columns j
and up columns I + j in one program), then down, scaled by the pair's routing
weight into a float32 [pairs, H] buffer; the weighted sum over a token's k pairs
is one more launch (`_sum_pairs_kernel`: the sum in float32, rounded once to x's
dtype). The tiles are rules of the shapes, one for each kernel
(`pair_tiles`, `expert_tiles`); PDD_MOE_GEMV_TILES replaces the GEMV's
(`gemv_tiles_override`).

Weights: gate_up [E, 2I, H], down [E, H, I], in x's dtype, or float8 e4m3 with
128x128 block scales [E, ceil(N/128), ceil(K/128)] (as Qwen3-30B-A3B-FP8
publishes them) applied to each K block's partial product.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdd.fp8_format import FP8_DTYPE
from pdd.ops.triton_common import _dot, _dot_mode, _pow2

GEMV_MAX_PAIRS = 64    # (token, expert) pairs up to which the per-pair GEMV runs (decode batches)
FP8_BLOCK = 128        # the block scales' tile, both dims
_ALIGN_CHUNK = 128     # pairs an align kernel's program (or iteration) takes
_ROUTE_TOKENS = 16     # tokens a route program takes
_TILES_ENV = "PDD_MOE_GEMV_TILES"


# ---------------------------------------------------------------------------
# Routing and grouping
# ---------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_t, TOP_K: tl.constexpr, K_P: tl.constexpr,
                  E_P: tl.constexpr, BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr):
    """BLOCK_T tokens a program, a row each."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < T
    experts = tl.arange(0, E_P)
    e_ok = (experts < E)[None, :]
    x = tl.load(logits_ptr + tokens[:, None] * stride_t + experts[None, :], mask=t_ok[:, None] & e_ok,
                other=0.0).to(tl.float32)
    x = tl.where(e_ok, x, float("-inf"))   # padding experts get no weight; padding tokens stay finite
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    slots = tl.arange(0, K_P)
    weights = tl.zeros([BLOCK_T, K_P], tl.float32)
    ids = tl.zeros([BLOCK_T, K_P], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        pick = tl.min(tl.where(p == best[:, None], experts[None, :], E_P), 1)   # the lowest index of a tie
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        p = tl.where(experts[None, :] == pick[:, None], -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = tokens[:, None] * TOP_K + slots[None, :]
    ok = t_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(w_ptr + out, weights, mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)


@triton.jit
def _experts_onehot(ids_ptr, start, num_pairs, experts, CHUNK: tl.constexpr, E_P: tl.constexpr):
    """Pairs start..start+CHUNK: their indices and one-hot experts [CHUNK, E_P] (none past the end)."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P)
    return offs, (ids[:, None] == experts[None, :]).to(tl.int32)


# The pair count changes with every step: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, E, E_P: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert, a chunk of pairs a program (one atomic add per expert)."""
    experts = tl.arange(0, E_P)
    _, onehot = _experts_onehot(ids_ptr, tl.program_id(0) * CHUNK, num_pairs, experts, CHUNK, E_P)
    tl.atomic_add(counts_ptr + experts, tl.sum(onehot, 0), mask=experts < E)


@triton.jit(do_not_specialize=["max_blocks"])   # it follows the pair count: one variant for all
def _runs_kernel(counts_ptr, cursor_ptr, block_expert_ptr, max_blocks, E,
                 E_P: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each expert's run padded to BLOCK_M, where it starts (the
    scatter's cursors), and the expert of each BLOCK_M block (-1 past the last)."""
    experts = tl.arange(0, E_P)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, ends - padded, mask=experts < E)
    for b0 in range(0, max_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        # A block's expert: how many runs end at or before its first row.
        expert = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, tl.where(expert < E, expert, -1), mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, E, E_P: tl.constexpr, CHUNK: tl.constexpr):
    """Each pair into its expert's run: a program claims room for its chunk's pairs of
    each expert by one atomic add, then places them in chunk order. The order of runs'
    pairs varies between launches; no result depends on it (a pair's rows are its own)."""
    experts = tl.arange(0, E_P)
    offs, onehot = _experts_onehot(ids_ptr, tl.program_id(0) * CHUNK, num_pairs, experts, CHUNK, E_P)
    base = tl.atomic_add(cursor_ptr + experts, tl.sum(onehot, 0), mask=experts < E)
    before = tl.cumsum(onehot, 0) - onehot          # same-expert pairs earlier in this chunk
    pos = tl.sum(onehot * (before + base[None, :]), 1)
    tl.store(sorted_ptr + pos, offs, mask=offs < num_pairs)


# ---------------------------------------------------------------------------
# Expert GEMMs
# ---------------------------------------------------------------------------

@triton.jit
def _block_scale(s_ptr, offs_n, k0, n_ok, stride_sn, stride_sk, BLOCK: tl.constexpr):
    """The 128x128 block scales of output columns offs_n at K block k0 // BLOCK."""
    return tl.load(s_ptr + (offs_n // BLOCK) * stride_sn + (k0 // BLOCK) * stride_sk, mask=n_ok, other=0.0)


@triton.jit
def _finish(acc, acc_up, route_w, a_ptr, SILU: tl.constexpr, WEIGHTED: tl.constexpr):
    """The float32 result of a GEMM tile, rounded where the reference rounds: the
    GEMM's output to x's (a's) dtype, then silu(gate) * up in it, or the routing
    weight's product in float32."""
    out_ty = a_ptr.dtype.element_ty
    y = acc.to(out_ty).to(tl.float32)
    if SILU:
        act = (y / (1.0 + tl.exp(-y))).to(out_ty).to(tl.float32)
        y = act * acc_up.to(out_ty).to(tl.float32)
    if WEIGHTED:
        y = y * route_w
    return y


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_gemv(a_ptr, w_ptr, s_ptr, c_ptr, ids_ptr, route_w_ptr, num_pairs, N, K,
                 stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_cm,
                 A_DIV: tl.constexpr, SILU: tl.constexpr, WEIGHTED: tl.constexpr, SCALED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One pair's row: c[pair, n] = a[pair // A_DIV] . w[expert of pair, n] (SILU: and n + N)."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_row = a_ptr + (pair // A_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_exp = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(a_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        part = tl.sum(w * a[None, :], 1)
        if SCALED:
            part = part * _block_scale(s_exp, offs_n, k0, n_ok, stride_sn, stride_sk, BLOCK_K)
        acc += part
        if SILU:
            w_up = tl.load(w_rows + N * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                           other=0.0).to(tl.float32)
            part_up = tl.sum(w_up * a[None, :], 1)
            if SCALED:
                part_up = part_up * _block_scale(s_exp, offs_n + N, k0, n_ok, stride_sn, stride_sk, BLOCK_K)
            acc_up += part_up
    route_w = 1.0
    if WEIGHTED:
        route_w = tl.load(route_w_ptr + pair)
    y = _finish(acc, acc_up, route_w, a_ptr, SILU, WEIGHTED)
    tl.store(c_ptr + pair.to(tl.int64) * stride_cm + offs_n, y, mask=n_ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_gemm(a_ptr, w_ptr, s_ptr, c_ptr, sorted_ptr, block_expert_ptr, route_w_ptr, num_pairs, N, K,
                 stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_cm,
                 A_DIV: tl.constexpr, SILU: tl.constexpr, WEIGHTED: tl.constexpr, SCALED: tl.constexpr,
                 DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_M pairs of one expert (a block of sorted_pairs) times that expert's
    weights: c[pair, n] = a[pair // A_DIV] . w[expert, n] (SILU: and n + N)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    a_rows = a_ptr + (pairs // A_DIV).to(tl.int64)[:, None] * stride_am
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_cols = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn   # w^T tile [K, N]
    s_exp = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a.dtype)
        part = _dot(a, w, DOT)
        if SCALED:
            part = part * _block_scale(s_exp, offs_n, k0, n_ok, stride_sn, stride_sk, BLOCK_K)[None, :]
        acc += part
        if SILU:
            w_up = tl.load(w_cols + N * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                           other=0.0).to(a.dtype)
            part_up = _dot(a, w_up, DOT)
            if SCALED:
                part_up = part_up * _block_scale(s_exp, offs_n + N, k0, n_ok, stride_sn, stride_sk,
                                                 BLOCK_K)[None, :]
            acc_up += part_up
    route_w = 1.0
    if WEIGHTED:
        route_w = tl.load(route_w_ptr + pairs, mask=m_ok, other=0.0)[:, None]
    y = _finish(acc, acc_up, route_w, a_ptr, SILU, WEIGHTED)
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], y,
             mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------

def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.route, _ROUTE_TOKENS tokens a program."""
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} must be in 1..{e} (the experts)")
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits must have contiguous rows")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        _route_kernel[(triton.cdiv(t, _ROUTE_TOKENS),)](
            router_logits, weights, ids, t, e, router_logits.stride(0), TOP_K=top_k, K_P=_pow2(top_k),
            E_P=_pow2(e), BLOCK_T=_ROUTE_TOKENS, RENORMALIZE=renormalize)
    return weights, ids


def block_m(num_pairs: int, num_experts: int) -> int:
    """Rows of a grouped-GEMM tile: 64 once experts get that many pairs on average, else 16
    (a run is padded to a multiple of it). A function of shapes only."""
    return 64 if num_pairs >= 64 * num_experts else 16


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert: (sorted_pairs [worst case], block_expert [worst case / bm]).
    Three launches (count, runs, scatter), each over chunks of pairs in parallel but runs."""
    num_pairs = ids.numel()
    size = num_pairs + num_experts * (bm - 1)   # every run padded by at most bm - 1
    max_blocks = -(-size // bm)
    dev = ids.device
    sorted_pairs = torch.full((max_blocks * bm,), num_pairs, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    e_p, chunks = _pow2(num_experts), triton.cdiv(num_pairs, _ALIGN_CHUNK)
    _count_kernel[(chunks,)](ids, counts, num_pairs, num_experts, E_P=e_p, CHUNK=_ALIGN_CHUNK)
    _runs_kernel[(1,)](counts, cursor, block_expert, max_blocks, num_experts, E_P=e_p, BLOCK_M=bm,
                       CHUNK=_ALIGN_CHUNK)
    _scatter_kernel[(chunks,)](ids, cursor, sorted_pairs, num_pairs, num_experts, E_P=e_p, CHUNK=_ALIGN_CHUNK)
    return sorted_pairs, block_expert


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, scales) -> None:
    e, n2, h = gate_up.shape
    if x.dim() != 2 or x.shape[1] != h or x.stride(1) != 1:
        raise ValueError(f"x must be [tokens, {h}] with contiguous rows, got {tuple(x.shape)}")
    if n2 % 2 or tuple(down.shape) != (e, h, n2 // 2):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must be "
                         f"[E, 2I, H] and [E, H, I]")
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("expert weights must have contiguous rows")
    fp8 = gate_up.dtype == FP8_DTYPE
    if fp8 != (scales is not None) or (down.dtype == FP8_DTYPE) != fp8:
        raise ValueError("FP8 expert weights (both) come with their block scales, others with none")
    if not fp8 and (gate_up.dtype != x.dtype or down.dtype != x.dtype):
        raise ValueError(f"expert weights are {gate_up.dtype}/{down.dtype}, x is {x.dtype}")


def _scale_args(s: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The block scales' pointer and strides; without scales any pointer (never read)."""
    return (w, (0, 0, 0)) if s is None else (s, s.stride())


class ExpertTiles(NamedTuple):
    """An expert GEMM's tiles and launch (one per GEMM: gate_up's, down's)."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3   # Triton's defaults: what the rule's tiles were measured with


def expert_tiles(n: int, k: int, scaled: bool) -> ExpertTiles:
    """The rule for output width n (I with SiLU) and reduction k: 64-wide tiles at
    most; FP8 K steps are the block scales' 128 columns (one scale a step)."""
    return ExpertTiles(min(64, max(16, _pow2(n))), FP8_BLOCK if scaled else min(64, max(16, _pow2(k))))


def pair_tiles(n: int, k: int, scaled: bool, silu: bool) -> ExpertTiles:
    """The per-pair GEMV's rule: 16 output columns a program (many programs, each
    streaming long rows), 8 warps, K steps of 256 for gate_up (its gate and up
    rows at once, 2 stages) and 128 for down (4 stages). Measured with `python -m
    benchmarks.moe_gemv --sweep` (the Qwen3-30B-A3B shapes at one token, an H100:
    a layer's experts 127.6 us with the grouped rule's 64x64 tiles, 39.6 us with
    these, 45% of its bytes' floor). FP8 experts keep the grouped rule (not swept)."""
    if scaled:
        return expert_tiles(n, k, scaled)
    bk = 256 if silu else 128
    return ExpertTiles(16, min(bk, max(16, _pow2(k))), 8, 2 if silu else 4)


@functools.lru_cache(maxsize=4)
def gemv_tiles_override(spec: str | None) -> tuple[ExpertTiles, ExpertTiles] | None:
    """PDD_MOE_GEMV_TILES="BN,BK,WARPS,STAGES/BN,BK,WARPS,STAGES" (gate_up's, then
    down's): the per-pair GEMV's tiles in place of the rule's, for a device A/B
    without an edit (`python -m benchmarks.moe_gemv --sweep` prints the line)."""
    if not spec:
        return None
    try:
        up, down = (ExpertTiles(*(int(v) for v in part.split(","))) for part in spec.split("/"))
    except (TypeError, ValueError):
        raise ValueError(f"{_TILES_ENV}={spec!r}: want BN,BK,WARPS,STAGES/BN,BK,WARPS,STAGES "
                         "(gate_up's tiles, then down's)") from None
    return up, down


def tiles_spec(tiles: tuple[ExpertTiles, ExpertTiles]) -> str:
    """The PDD_MOE_GEMV_TILES value of (gate_up's, down's) tiles."""
    return "/".join(",".join(str(v) for v in t) for t in tiles)


def _gemm(a, w, s, out, ids, route_w, grouping, a_div: int, silu: bool, weighted: bool,
          tiles: ExpertTiles | None = None) -> None:
    """One expert GEMM over all pairs: the per-pair GEMV, or the grouped tl.dot kernel
    when `grouping` (sorted_pairs, block_expert, bm) is given. `tiles` replaces the
    rule's (`python -m benchmarks.moe_gemv --sweep`)."""
    num_pairs = out.shape[0]
    n = w.shape[1] // 2 if silu else w.shape[1]
    k = w.shape[2]
    scaled = s is not None
    rule = expert_tiles(n, k, scaled) if grouping is not None else pair_tiles(n, k, scaled, silu)
    bn, bk, warps, stages = tiles or rule
    if scaled and bk != FP8_BLOCK:
        raise ValueError(f"FP8 experts take K steps of their {FP8_BLOCK}-column scale blocks, not {bk}")
    s_ptr, s_strides = _scale_args(s, w)
    args = (a, w, s_ptr, out)
    strides = (a.stride(0), w.stride(0), w.stride(1), *s_strides, out.stride(0))
    flags = dict(A_DIV=a_div, SILU=silu, WEIGHTED=weighted, SCALED=scaled, BLOCK_N=bn, BLOCK_K=bk,
                 num_warps=warps, num_stages=stages)
    if grouping is None:
        _expert_gemv[(num_pairs, triton.cdiv(n, bn))](*args, ids, route_w, num_pairs, n, k, *strides, **flags)
        return
    sorted_pairs, block_expert, bm = grouping
    grid = (block_expert.shape[0], triton.cdiv(n, bn))
    _expert_gemm[grid](*args, sorted_pairs, block_expert, route_w, num_pairs, n, k, *strides,
                       DOT=_dot_mode(a), BLOCK_M=bm, **flags)


@triton.jit
def _sum_pairs_kernel(src, dst, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """dst[t] = the sum of token t's TOP_K weighted rows of src (float32, in their
    order), rounded once to dst's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src + (t * TOP_K + j) * H + offs, mask=m, other=0.0)
    tl.store(dst + t * H + offs, acc.to(dst.dtype.element_ty), mask=m)


def _sum_pairs(out: torch.Tensor, t: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[t * top_k, H] float32 -> [t, H] in `dtype`: the weighted sum back, one launch
    (torch's sum then cast would be two, per MoE layer of every decode step)."""
    h = out.shape[1]
    dst = torch.empty(t, h, dtype=dtype, device=out.device)
    block = min(1024, _pow2(h))
    _sum_pairs_kernel[(t, triton.cdiv(h, block))](out, dst, h, TOP_K=top_k, BLOCK=block)
    return dst


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              top_k: int, renormalize: bool, gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None,
              tiles: tuple[ExpertTiles, ExpertTiles] | None = None,
              gemv_max_pairs: int = GEMV_MAX_PAIRS) -> torch.Tensor:
    """reference.fused_moe; FP8 weights with their block scales [E, N/128, K/128].
    `tiles`: gate_up's and down's, replacing the rule's (a sweep's); `gemv_max_pairs`:
    the pairs up to which the per-pair GEMV runs, replacing the rule's (0: always
    the grouped GEMM; a benchmark's comparison of the two)."""
    _check(x, gate_up, down, gate_up_scale)
    t, h = x.shape
    e, inter = gate_up.shape[0], down.shape[2]
    if t == 0:
        return torch.empty_like(x)
    weights, ids = route(router_logits, top_k, renormalize)
    ids = ids.view(-1)
    num_pairs = ids.numel()
    grouping = None
    if num_pairs > gemv_max_pairs:
        bm = block_m(num_pairs, e)
        grouping = (*align(ids, e, bm), bm)
    elif tiles is None:
        tiles = gemv_tiles_override(os.environ.get(_TILES_ENV))
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    up_tiles, down_tiles = tiles or (None, None)
    _gemm(x, gate_up, gate_up_scale, act, ids, weights, grouping, top_k, silu=True, weighted=False, tiles=up_tiles)
    out = torch.empty(num_pairs, h, dtype=torch.float32, device=x.device)
    _gemm(act, down, down_scale, out, ids, weights.view(-1), grouping, 1, silu=False, weighted=True,
          tiles=down_tiles)
    return _sum_pairs(out, t, top_k, x.dtype)


def warm_up(layers, dtype: torch.dtype, device: torch.device, max_tokens: int) -> int:
    """Compile every kernel variant the MoE layers can launch (the GEMV path, the
    grouped path at each BLOCK_M up to max_tokens tokens), once per distinct layer
    shape; how many shapes."""
    seen = set()
    for layer in layers:
        ex = layer.experts
        key = (tuple(ex.gate_up_proj.shape), ex.gate_up_proj.dtype, layer.top_k, layer.renormalize)
        if key in seen:
            continue
        seen.add(key)
        e, h = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[2]
        sizes = {1, GEMV_MAX_PAIRS // layer.top_k + 1, max_tokens}
        if 64 * e // layer.top_k <= max_tokens:
            sizes.add(64 * e // layer.top_k)    # block_m's larger tile
        for tokens in sorted(n for n in sizes if 1 <= n <= max_tokens):
            x = torch.zeros(tokens, h, dtype=dtype, device=device)
            layer(x)
    return len(seen)
