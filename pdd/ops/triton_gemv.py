"""Weight-only GEMV / skinny GEMM for decode-sized batches (M <= SKINNY_MAX_M tokens).

y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in x's dtype or float8 e4m3 with its
scales applied in registers (no activation quantization: W8A16), fp32
accumulation, y in x's dtype. At decode sizes a linear layer is a pass over its
weights: cuBLAS picks split-K kernels with extra reduce launches, and the FP8
GEMM path adds an activation-quantize kernel and rows padded for cuBLASLt; one
launch that reads W once is what the step's HBM roofline asks for.

Each program owns BLOCK_N output columns (rows of W) for all M rows of x (up
to 128; 129..256 rows in two M tiles whose programs run side by side), so W is
read from HBM once. Two kernels, picked by M's bucket
(pdd.ops.limits.GEMV_BUCKETS; tiles in pdd.ops.gemv_tiles):
- M == 1: elementwise products of a [BLOCK_N, BLOCK_K] W tile with x, summed
  along K each step (no tensor cores: nothing to pad to 16 rows). A few rows
  and a wide K span a program: its loads in flight are the whole tile.
- 2 <= M <= 256: tl.dot of the W tile [BLOCK_N, BLOCK_K] with x^T [BLOCK_K,
  BLOCK_M] (BLOCK_M = 16, 32, 64 or 128 by bucket, rows past M masked), FP8
  converted to x's dtype in registers first (exact for e4m3): the W8A16 skinny
  GEMM of decode batches, x's bytes re-read from L2 by each N tile.
M itself is not a specialization key: one compiled variant per bucket.
The dot kernel may split K (GemvConfig.split_k, where a table entry says so):
with few N tiles (N = 4096 in 64-row tiles is 64 programs on 132 SMs) too few
bytes are in flight to keep HBM busy, so K slices run as programs of their own,
store fp32 partials, and a second small launch sums them in slice order (the
same bits every run, unlike atomics) and applies row scales, bias and
SiLU-and-mul. Block scales multiply each K step inside the slices as before.

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

import torch
import triton
import triton.language as tl

from pdd.fp8_format import FP8_DTYPE, FP8_MIN_AMAX
# GemvConfig, gemv_config and GEMV_MAX_M are this module's too (the benchmarks' and tests' names).
from pdd.ops.gemv_tiles import GemvConfig, gemv_config
from pdd.ops.limits import GEMV_MAX_M, SKINNY_MAX_M, gemv_bucket  # noqa: F401
from pdd.ops.triton_common import _FP8_MAX, _num_sms, _pdl_wait, pdl_options

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Scale kinds (the kernel's SCALE)
NO_SCALE, TENSOR_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2, 3
_MIN_AMAX = tl.constexpr(FP8_MIN_AMAX)


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


@triton.jit
def _quantize_cols(xt):
    """x^T tile [BLOCK_K, BLOCK_M] -> (FP8 tile, fp32 scale [BLOCK_M]): one scale a row
    of x and K step, amax / FP8_MAX (as fp8_linear.quantize_reference's 1 x BLOCK_K groups)."""
    xf = xt.to(tl.float32)
    sx = tl.maximum(tl.max(tl.abs(xf), axis=0), _MIN_AMAX) / _FP8_MAX
    q = tl.minimum(tl.maximum(xf / sx[None, :], -_FP8_MAX), _FP8_MAX)
    return q.to(tl.float8e4nv), sx


@triton.jit
def _dot_fp8(w, q, sx, UPCAST: tl.constexpr):
    """W8A8: the FP8 W tile @ the FP8 x^T tile on the FP8 tensor cores (W straight
    from shared memory, never converted), times x's scales."""
    if UPCAST:
        part = tl.dot(w.to(tl.float32), q.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(w, q)
    return part * sx[None, :]


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, up_off,
                     stride_xm, stride_wn, stride_ym, stride_sn, stride_sk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, W8A8: tl.constexpr = False,
                     p_ptr=None, k_span=0, SPLIT_K: tl.constexpr = 1):
    """2 <= M: x^T as the dot's second operand (W8A8: quantized to FP8 per K step), program (i, j) the M tile i of
    BLOCK_M rows (rows past M masked) and the N tile j. The M tiles of one N
    tile are neighbours in launch order: they run together and read their W
    tile from HBM once, from L2 after. Launched in stream order, not under PDL:
    under PDL a whole step at batch 8 took 5.30 ms against 4.87 on H200. Its
    grid is about one program an SM; placed while the previous kernel still
    holds some SMs, programs probably double up on the others.
    SPLIT_K > 1: program (i, j, s) sums only K columns [s * k_span, (s + 1) *
    k_span) (k_span a multiple of BLOCK_K) and stores its fp32 partials (block
    scales applied, row scales not) to p_ptr [SPLIT_K, 1 or 2 (silu), M, N];
    _gemv_reduce_kernel finishes them."""
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (offs_n + up_off).to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    s_gate = s_ptr + (n0 // SCALE_BN) * stride_sn
    s_up = s_ptr + ((n0 + up_off) // SCALE_BN) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * k_span
        k_hi = tl.minimum(K, k_lo + k_span)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        if EVEN_K:
            xt = tl.load(x_cols + kk[:, None], mask=m_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_cols + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if W8A8:
            q, sx = _quantize_cols(xt)
            part = _dot_fp8(_load_w(w_rows, kk, n_ok, k_ok, EVEN_K), q, sx, UPCAST)
        else:
            part = _dot(_load_w(w_rows, kk, n_ok, k_ok, EVEN_K), xt, UPCAST)
        if SCALE == 3:   # BLOCK_K == SCALE_BK: this K step is one block column
            part = part * tl.load(s_gate + (k0 // SCALE_BK) * stride_sk)
        acc += part
        if SILU:
            if W8A8:
                part = _dot_fp8(_load_w(up_rows, kk, n_ok, k_ok, EVEN_K), q, sx, UPCAST)
            else:
                part = _dot(_load_w(up_rows, kk, n_ok, k_ok, EVEN_K), xt, UPCAST)
            if SCALE == 3:
                part = part * tl.load(s_up + (k0 // SCALE_BK) * stride_sk)
            acc_up += part
    if SPLIT_K > 1:
        mask = n_ok[:, None] & m_ok[None, :]
        tiles = 2 if SILU else 1
        part_ptrs = p_ptr + (tl.program_id(2) * tiles * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part_ptrs, acc, mask=mask)
        if SILU:
            tl.store(part_ptrs + M * N, acc_up, mask=mask)
    else:
        _store(acc, acc_up, s_ptr, b_ptr, y_ptr, offs_n, n_ok, offs_m, m_ok, up_off, stride_sn, stride_ym,
               SCALE, HAS_BIAS, SILU)


@triton.jit(do_not_specialize=["M"])
def _gemv_reduce_kernel(p_ptr, s_ptr, b_ptr, y_ptr, M, N, up_off, stride_ym, stride_sn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                        SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The split-K dot's partials [SPLIT_K, 1 or 2, M, N] summed in slice order
    (the same fp32 sums every run: tokens stay bit-identical, unlike atomics),
    then scaled, biased and stored (SiLU-and-mul fused) as the one-pass kernel does."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    mask = n_ok[:, None] & m_ok[None, :]
    tiles = 2 if SILU else 1
    ptrs = p_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for sk in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + (sk * tiles * M).to(tl.int64) * N, mask=mask, other=0.0)
        if SILU:
            acc_up += tl.load(ptrs + ((sk * tiles + 1) * M).to(tl.int64) * N, mask=mask, other=0.0)
    _store(acc, acc_up, s_ptr, b_ptr, y_ptr, offs_n, n_ok, offs_m, m_ok, up_off, stride_sn, stride_ym,
           SCALE, HAS_BIAS, SILU)


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
    return gemv_config(gemv_bucket(x.shape[0]), n // 2 if silu else n, k, weight.element_size(), x.element_size(),
                       silu, tuple(block) if block is not None else None, _num_sms(x.device))


# The split-K reduce's N tile: [64, BLOCK_M <= 64] fp32 a program, a few KB of partials each.
_REDUCE_BLOCK_N = 64


def _split(cfg: GemvConfig, k: int, m: int, out_n: int, silu: bool, device: torch.device):
    """(K slices, K columns a slice, the fp32 partials buffer or None) of a dot
    launch. Slices are whole BLOCK_K steps; a split that leaves the last slice
    empty is cut to the slices that have columns."""
    steps = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, steps))
    k_span = triton.cdiv(steps, split) * cfg.block_k
    split = triton.cdiv(k, k_span)
    if split == 1:
        return 1, k_span, None
    part = torch.empty(split, 2 if silu else 1, m, out_n, dtype=torch.float32, device=device)
    return split, k_span, part


def supports(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None,
             silu: bool = False) -> bool:
    """Whether gemv() takes these operands (M, dtypes, block layout)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= SKINNY_MAX_M or x.dtype not in _X_DTYPES:
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
    `config` overrides the tile table (`python -m benchmarks.gemv --sweep`)."""
    assert x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D"
    m, k = x.shape
    n, wk = weight.shape
    assert wk == k, f"x has {k} columns, weight {wk}"
    assert 1 <= m <= SKINNY_MAX_M, f"gemv takes 1..{SKINNY_MAX_M} rows, got {m}"
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
    assert not cfg.w8a8 or (kind != NO_SCALE and cfg.block_m > 1), "W8A8 takes FP8 weights in the dot kernel"
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
    if cfg.block_m == 1:
        grid = (triton.cdiv(out_n, cfg.block_n),)
        _gemv_row_kernel[grid](x, weight, s, b, y, m, out_n, k, up_off, weight.stride(0), y.stride(0),
                               stride_sn, stride_sk, **common, **pdl_options(x.device, m))
    else:
        upcast = x.dtype == torch.float32 or x.device.type == "cpu"
        split, k_span, part = _split(cfg, k, m, out_n, silu, x.device)
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(out_n, cfg.block_n), split)
        _gemv_dot_kernel[grid](x, weight, s, b, y, m, out_n, k, up_off, x.stride(0), weight.stride(0), y.stride(0),
                               stride_sn, stride_sk, BLOCK_M=cfg.block_m, UPCAST=upcast, W8A8=cfg.w8a8, **common,
                               p_ptr=part, k_span=k_span, SPLIT_K=split)
        if split > 1:
            rbm = min(cfg.block_m, 64)
            rgrid = (triton.cdiv(m, rbm), triton.cdiv(out_n, _REDUCE_BLOCK_N))
            _gemv_reduce_kernel[rgrid](part, s, b, y, m, out_n, up_off, y.stride(0), stride_sn,
                                       BLOCK_M=rbm, BLOCK_N=_REDUCE_BLOCK_N, SPLIT_K=split, SCALE=kind,
                                       HAS_BIAS=bias is not None, SILU=silu, num_warps=4)
    return y
