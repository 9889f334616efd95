"""Weight-only GEMV / skinny GEMM for decode-sized batches (M <= GEMV_MAX_M tokens).

y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in x's dtype or float8 e4m3 with its
scales applied in registers (no activation quantization: W8A16), fp32
accumulation, y in x's dtype. At decode sizes a linear layer is a pass over its
weights: cuBLAS picks split-K kernels with extra reduce launches, and the FP8
GEMM path adds an activation-quantize kernel and rows padded for cuBLASLt; one
launch that reads W once is what the step's HBM roofline asks for.

Each program owns BLOCK_N output columns (rows of W) for all M rows of x, so W
is read once; there is no split over K. Two kernels, picked by M's bucket:
- M == 1: elementwise products of a [BLOCK_N, BLOCK_K] W tile with x, summed
  along K each step (no tensor cores: nothing to pad to 16 rows). A few rows
  and a wide K span a program: its loads in flight are the whole tile.
- 2 <= M <= 16: tl.dot of the W tile [BLOCK_N, BLOCK_K] with x^T [BLOCK_K, 16]
  (rows past M masked), FP8 converted to x's dtype first (exact for e4m3).
M itself is not a specialization key: one compiled variant per bucket.

Scales (how pdd.model.fp8 stores them): one value (tensor), one per output
row ([N] or [N, 1]), or one per block ([ceil(N/bn), ceil(K/bk)]). Row and
tensor scales multiply the finished dot products; block scales multiply x's
K columns (M == 1) or each K block's partial dot (BLOCK_K == bk), which needs
every program's BLOCK_N rows inside one block row (bn % BLOCK_N == 0).

`silu=True` (the MLP's gate_up_proj, W = [gate; up], 2I rows): out[M, I] =
silu(gate) * up, each program reading gate rows j and up rows I + j; rounded
where ops.silu_and_mul of the unfused output rounds.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdd.ops import GEMV_MAX_M
from pdd.ops.fp8_linear import FP8_DTYPE
from pdd.ops.triton_common import _num_sms, _pdl_wait, pdl_options

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Scale kinds (the kernel's SCALE)
NO_SCALE, TENSOR_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2, 3


@triton.jit
def _scaled(acc, s_ptr, b_ptr, rows, n_ok, stride_sn, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BM] (W rows `rows`) times its row or tensor scale, plus the bias."""
    if SCALE == 1:
        acc = acc * tl.load(s_ptr).to(tl.float32)
    elif SCALE == 2:
        acc = acc * tl.load(s_ptr + rows * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _store(acc, acc_up, s_ptr, b_ptr, y_ptr, offs_n, n_ok, offs_m, m_ok, up_off, stride_sn, stride_ym,
           SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    out_ty = y_ptr.dtype.element_ty
    y = _scaled(acc, s_ptr, b_ptr, offs_n, n_ok, stride_sn, SCALE, HAS_BIAS)
    if SILU:
        # Rounded as gate_up_proj's output and silu_and_mul's activation are.
        g = y.to(out_ty).to(tl.float32)
        u = _scaled(acc_up, s_ptr, b_ptr, offs_n + up_off, n_ok, stride_sn, SCALE, HAS_BIAS)
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        y = act * u.to(out_ty).to(tl.float32)
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(ptrs, y.to(out_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _load_w(rows_ptr, kk, n_ok, k_ok, EVEN_K: tl.constexpr):
    """W tile [BLOCK_N, BLOCK_K] of the rows at rows_ptr, columns kk."""
    mask = n_ok[:, None]
    if not EVEN_K:
        mask = mask & k_ok[None, :]
    return tl.load(rows_ptr + kk[None, :], mask=mask, other=0.0)


@triton.jit
def _row_step(acc, acc_up, w, w_up, x_ptr, kk, K, s_gate, s_up, stride_sk,
              SCALE: tl.constexpr, SCALE_BK: tl.constexpr, SILU: tl.constexpr, EVEN_K: tl.constexpr):
    """The one-row kernel's products of a loaded W tile (and up's) with x's columns kk."""
    k_ok = kk < K
    if EVEN_K:
        x = tl.load(x_ptr + kk).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    xs = x
    if SCALE == 3:
        xs = x * tl.load(s_gate + (kk // SCALE_BK) * stride_sk, mask=k_ok, other=0.0)
    acc += tl.sum(w.to(tl.float32) * xs[None, :], axis=1, keep_dims=True)
    if SILU:
        if SCALE == 3:
            xs = x * tl.load(s_up + (kk // SCALE_BK) * stride_sk, mask=k_ok, other=0.0)
        acc_up += tl.sum(w_up.to(tl.float32) * xs[None, :], axis=1, keep_dims=True)
    return acc, acc_up


# The token count changes with every step: one compiled variant for all of them.
@triton.jit(do_not_specialize=["M"])
def _gemv_row_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, up_off,
                     stride_wn, stride_ym, stride_sn, stride_sk,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """M == 1: x is one row."""
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (offs_n + up_off).to(tl.int64)[:, None] * stride_wn
    # Block scales: this program's rows (gate and up) each sit in one block row.
    s_gate = s_ptr + (n0 // SCALE_BN) * stride_sn
    s_up = s_ptr + ((n0 + up_off) // SCALE_BN) * stride_sn
    acc = tl.zeros([BLOCK_N, 1], tl.float32)
    acc_up = tl.zeros([BLOCK_N, 1], tl.float32)
    # The weights need nothing from the previous kernel: under PDL the first
    # tile's loads are in flight while it finishes; x is read after the wait.
    w = _load_w(w_rows, offs_k, n_ok, offs_k < K, EVEN_K)
    w_up = w
    if SILU:
        w_up = _load_w(up_rows, offs_k, n_ok, offs_k < K, EVEN_K)
    _pdl_wait(PDL)
    acc, acc_up = _row_step(acc, acc_up, w, w_up, x_ptr, offs_k, K, s_gate, s_up, stride_sk,
                            SCALE, SCALE_BK, SILU, EVEN_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + offs_k
        # All of this step's W loads are issued before any product needs them: the
        # tile's bytes are what this program keeps in flight.
        w = _load_w(w_rows, kk, n_ok, kk < K, EVEN_K)
        if SILU:
            w_up = _load_w(up_rows, kk, n_ok, kk < K, EVEN_K)
        acc, acc_up = _row_step(acc, acc_up, w, w_up, x_ptr, kk, K, s_gate, s_up, stride_sk,
                                SCALE, SCALE_BK, SILU, EVEN_K)
    offs_m = tl.zeros([1], tl.int32)
    _store(acc, acc_up, s_ptr, b_ptr, y_ptr, offs_n, n_ok, offs_m, offs_m < M, up_off, stride_sn, stride_ym,
           SCALE, HAS_BIAS, SILU)


@triton.jit
def _dot(w, xt, UPCAST: tl.constexpr):
    """W tile [BLOCK_N, BLOCK_K] @ x^T tile [BLOCK_K, BLOCK_M], fp32. UPCAST: in
    fp32 without tf32 (fp32 activations; bf16 under the interpreter, which
    multiplies bf16 operands as raw 16-bit integers)."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    return tl.dot(w.to(xt.dtype), xt)


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, up_off,
                     stride_xm, stride_wn, stride_ym, stride_sn, stride_sk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """2 <= M <= BLOCK_M: x^T as the dot's second operand, rows past M masked.
    Launched in stream order, not under PDL: under PDL a whole step at batch 8
    took 5.30 ms against 4.87 on H200. Its grid is about one program an SM;
    placed while the previous kernel still holds some SMs, programs probably
    double up on the others."""
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (offs_n + up_off).to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    s_gate = s_ptr + (n0 // SCALE_BN) * stride_sn
    s_up = s_ptr + ((n0 + up_off) // SCALE_BN) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        if EVEN_K:
            xt = tl.load(x_cols + kk[:, None], mask=m_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_cols + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        part = _dot(_load_w(w_rows, kk, n_ok, k_ok, EVEN_K), xt, UPCAST)
        if SCALE == 3:   # BLOCK_K == SCALE_BK: this K step is one block column
            part = part * tl.load(s_gate + (k0 // SCALE_BK) * stride_sk)
        acc += part
        if SILU:
            part = _dot(_load_w(up_rows, kk, n_ok, k_ok, EVEN_K), xt, UPCAST)
            if SCALE == 3:
                part = part * tl.load(s_up + (k0 // SCALE_BK) * stride_sk)
            acc_up += part
    _store(acc, acc_up, s_ptr, b_ptr, y_ptr, offs_n, n_ok, offs_m, m_ok, up_off, stride_sn, stride_ym,
           SCALE, HAS_BIAS, SILU)


# ---------------------------------------------------------------------------
# Tile configs: a fixed table of a few variants per layer shape, no autotune
# (every variant must compile at warm-up, not in service)
# ---------------------------------------------------------------------------

class GemvConfig(NamedTuple):
    block_m: int      # 1: the row kernel; 16: the dot kernel
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The row kernel's tiles, measured (`pdd bench gemv --sweep` on an H200, 132 SMs;
# docs/benchmarks.md, "The decode GEMV"). Its loop is not software-pipelined, so
# what keeps HBM busy is many programs an SM, each with one W tile in flight:
# 4 rows a program (twice the programs of 8) beat wider tiles everywhere but
# under block scales, whose per-column scale gather favours 8 rows over 32 KB.
# (rows a program, W bytes a loop step with gate and up together, warps)
_ROW_RULE_HALF = (4, 16 << 10, 4)            # bf16 / fp16 weights
_ROW_RULE_FP8_ROWS = (4, 16 << 10, 4)        # FP8, one scale a row or the tensor
_ROW_RULE_FP8_BLOCKS = (8, 32 << 10, 4)      # FP8, 128x128 block scales
# Where one layer's best beat the rule by more than a few per cent on that
# sweep (the Llama-3-8B shapes on 132 SMs): (w_bytes, block scales, N or I,
# K, silu) -> (rows, K span, warps).
_ROW_TUNED_132 = {
    (2, False, 6144, 4096, False): (4, 4096, 4),
    (2, False, 4096, 14336, False): (4, 2048, 8),
    (1, True, 4096, 4096, False): (4, 2048, 4),
    (1, True, 14336, 4096, True): (16, 256, 4),
    (1, False, 6144, 4096, False): (8, 1024, 4),
    (1, False, 4096, 14336, False): (4, 2048, 4),
}


# The dot kernel's (2..16 rows) tiles where the sweep (`--sweep-rows 16`, timed
# at 4 and 16 rows) beat the rule below by more than 3% without spilling
# registers (bf16 o_proj and down_proj were 5-6% faster with 32x256 tiles that
# spill): (w_bytes, block scales, N or I, K, silu) -> (BLOCK_N, BLOCK_K, warps, stages).
_DOT_TUNED_132 = {
    (2, False, 6144, 4096, False): (64, 256, 4, 4),
    (1, True, 6144, 4096, False): (64, 128, 4, 4),
    (1, False, 6144, 4096, False): (64, 256, 4, 4),
    (1, False, 4096, 4096, False): (32, 128, 4, 4),
    (1, False, 4096, 14336, False): (32, 128, 4, 6),
}


def _row_config(n: int, k: int, w_bytes: int, tiles: int, scale_block: tuple[int, int] | None,
                sms: int) -> GemvConfig | None:
    tuned = _ROW_TUNED_132.get((w_bytes, scale_block is not None, n, k, tiles == 2)) if sms == 132 else None
    if tuned is not None:
        block_n, block_k, warps = tuned
    else:
        block_n, tile_bytes, warps = (_ROW_RULE_HALF if w_bytes > 1 else
                                      _ROW_RULE_FP8_BLOCKS if scale_block is not None else _ROW_RULE_FP8_ROWS)
        block_k = tile_bytes // (tiles * block_n * w_bytes)
    # Block scales: each program's rows (gate's and up's) inside one block row.
    while scale_block is not None and (scale_block[0] % block_n or (tiles == 2 and n % block_n)):
        if block_n == 4:
            return None
        block_k, block_n = block_k * 2, block_n // 2
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    return GemvConfig(1, block_n, block_k, warps, 1)


def _bucket(m: int) -> int:
    return 1 if m == 1 else GEMV_MAX_M


@functools.lru_cache(maxsize=None)
def gemv_config(m_bucket: int, n: int, k: int, w_bytes: int, x_bytes: int, silu: bool,
                scale_block: tuple[int, int] | None, sms: int) -> GemvConfig | None:
    """Tiles for output width n (I when silu), reduction k. None: block scales
    whose block rows no tile fits in (bn not a multiple of 16, or silu's I)."""
    tiles = 2 if silu else 1
    if m_bucket == 1:
        return _row_config(n, k, w_bytes, tiles, scale_block, sms)
    tuned = _DOT_TUNED_132.get((w_bytes, scale_block is not None, n, k, silu)) if sms == 132 else None
    if tuned is not None:
        return GemvConfig(GEMV_MAX_M, *tuned)
    # x^T is re-read from L2 by every program: wider tiles amortize it; about one
    # program per SM, kept busy by num_stages of W tiles in flight (cp.async).
    block_k = 256 if w_bytes == 1 else 128
    candidates = (64, 32, 16)
    if scale_block is not None:
        bn, bk = scale_block
        candidates = tuple(c for c in candidates if bn % c == 0 and (not silu or n % c == 0))
        if not candidates or bk & (bk - 1) or bk < 16:
            return None
        block_k = bk      # one scale per K step of the dot
    block_n = next((c for c in candidates if triton.cdiv(n, c) >= (9 * sms) // 10), candidates[-1])
    if scale_block is None:
        block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        # FP8 tiles are converted in registers before the dot: past 16k elements
        # (silu's two 64x256 tiles) they spill (sm_90 builds).
        while tiles * block_n * block_k > 16384 and block_k > 64:
            block_k //= 2
    stage = tiles * block_n * block_k * w_bytes + block_k * GEMV_MAX_M * x_bytes
    # Stages in flight hide HBM latency; under ~96 KB of shared memory (num_stages - 1
    # buffers) two programs still fit on an SM where the grid has more than one each.
    num_stages = max(2, min(8, (96 * 1024) // stage + 1))
    return GemvConfig(GEMV_MAX_M, block_n, block_k, 4, num_stages)


# ---------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------

def _scale_kind(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None) -> int:
    if weight.dtype != FP8_DTYPE:
        assert scale is None, "scales come with FP8 weights only"
        return NO_SCALE
    assert scale is not None, "an FP8 weight needs its scale"
    assert scale.dtype == torch.float32, f"weight scales must be float32, got {scale.dtype}"
    n, k = weight.shape
    if block is not None:
        bn, bk = block
        want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
        assert tuple(scale.shape) == want, f"block scales must be {want} for {n}x{k} in {bn}x{bk}, got {tuple(scale.shape)}"
        return BLOCK_SCALE
    if scale.numel() == 1:
        return TENSOR_SCALE
    assert scale.numel() == n and scale.shape[0] == n, f"row scales must be [{n}] or [{n}, 1], got {tuple(scale.shape)}"
    return ROW_SCALE


def _plan(x: torch.Tensor, weight: torch.Tensor, block, silu: bool) -> GemvConfig | None:
    n, k = weight.shape
    return gemv_config(_bucket(x.shape[0]), n // 2 if silu else n, k, weight.element_size(), x.element_size(),
                       silu, tuple(block) if block is not None else None, _num_sms(x.device))


def supports(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None,
             silu: bool = False) -> bool:
    """Whether gemv() takes these operands (M, dtypes, block layout)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_M or x.dtype not in _X_DTYPES:
        return False
    if weight.dtype not in (x.dtype, FP8_DTYPE) or weight.stride(-1) != 1:
        return False
    if silu and weight.shape[0] % 2:
        return False
    return _plan(x, weight, block, silu) is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
         silu: bool = False, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype; with silu,
    weight is [gate; up] (2I rows) and the result silu(gate) * up [M, I].
    `config` overrides the tile table (`pdd bench gemv --sweep`)."""
    assert x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D"
    m, k = x.shape
    n, wk = weight.shape
    assert wk == k, f"x has {k} columns, weight {wk}"
    assert 1 <= m <= GEMV_MAX_M, f"gemv takes 1..{GEMV_MAX_M} rows, got {m}"
    assert x.dtype in _X_DTYPES, f"x dtype {x.dtype} not supported"
    assert weight.dtype in (x.dtype, FP8_DTYPE), f"weight is {weight.dtype}, x {x.dtype}"
    assert weight.stride(1) == 1, f"weight must have unit column stride, got {weight.stride()}"
    assert weight.device == x.device, f"weight is on {weight.device}, x on {x.device}"
    kind = _scale_kind(weight, scale, block)
    if silu:
        assert n % 2 == 0, f"silu: weight rows {n} are not [gate; up]"
    out_n = n // 2 if silu else n
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), f"bias must be [{n}], got {tuple(bias.shape)}"
    cfg = config or _plan(x, weight, block, silu)
    assert cfg is not None, f"block scales {block} do not fit this GEMV's tiles"
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, out_n, dtype=x.dtype, device=x.device)
    if kind == BLOCK_SCALE:
        s, stride_sn, stride_sk = scale, scale.stride(0), scale.stride(1)
        sbn, sbk = block
    else:
        s = scale.reshape(-1) if scale is not None else weight   # unused without a scale
        stride_sn, stride_sk = (s.stride(0) if kind == ROW_SCALE else 0), 0
        sbn = sbk = 1
    b = bias if bias is not None else weight
    up_off = out_n if silu else 0
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE=kind, SCALE_BN=sbn, SCALE_BK=sbk,
                  HAS_BIAS=bias is not None, SILU=silu, EVEN_K=k % cfg.block_k == 0,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (triton.cdiv(out_n, cfg.block_n),)
    if cfg.block_m == 1:
        _gemv_row_kernel[grid](x, weight, s, b, y, m, out_n, k, up_off, weight.stride(0), y.stride(0),
                               stride_sn, stride_sk, **common, **pdl_options(x.device, m))
    else:
        upcast = x.dtype == torch.float32 or x.device.type == "cpu"
        _gemv_dot_kernel[grid](x, weight, s, b, y, m, out_n, k, up_off, x.stride(0), weight.stride(0), y.stride(0),
                               stride_sn, stride_sk, BLOCK_M=cfg.block_m, UPCAST=upcast, **common)
    return y
