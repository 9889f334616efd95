"""The GEMV's tiles (pdd.ops.triton_gemv): a fixed rule per row bucket plus the
measured exceptions of one GPU, no autotune (every variant must compile at
warm-up, not in service). Each bucket of rows (pdd.ops.limits.GEMV_BUCKETS) is
one compiled variant per layer shape and dtype: the row count within a bucket
only masks rows or adds M tiles.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import triton

from pdd.ops.limits import GEMV_MAX_M, SKINNY_MAX_M


class GemvConfig(NamedTuple):
    block_m: int      # 1: the row kernel; 16..128: the dot kernel's M tile
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    w8a8: bool = False   # dot kernel, FP8 weights: x quantized per K step, FP8 tensor cores (an experiment)
    split_k: int = 1     # dot kernel: K slices a W tile's columns are split over (fp32 partials, one reduce launch)


# The row kernel's tiles, measured (`python -m benchmarks.gemv --sweep` on an H200, 132 SMs;
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
# spill): (w_bytes, block scales, N or I, K, silu) -> (BLOCK_N, BLOCK_K, warps, stages[, K slices]).
_DOT_TUNED_132 = {
    (2, False, 6144, 4096, False): (64, 256, 4, 4),
    (1, True, 6144, 4096, False): (64, 128, 4, 4),
    (1, False, 6144, 4096, False): (64, 256, 4, 4),
    (1, False, 4096, 4096, False): (32, 128, 4, 4),
    (1, False, 4096, 14336, False): (32, 128, 4, 6),
}

# The skinny buckets' (17..256 rows) tiles where a sweep (`python -m
# benchmarks.fp8_skinny --sweep`) beat the rule below: (bucket, w_bytes, block
# scales, N or I, K, silu) -> (BLOCK_N, BLOCK_K, warps, stages[, K slices]).
# Empty until the device sweep fills it; the sweep's candidates include split-K
# (GemvConfig.split_k), which the rule below never picks.
_SKINNY_TUNED_132: dict[tuple, tuple[int, int, int, int]] = {}


def _tuned_config(block_m: int, tuned: tuple[int, ...]) -> GemvConfig:
    """A dot table entry: (BLOCK_N, BLOCK_K, warps, stages[, K slices])."""
    block_n, block_k, warps, stages, *split = tuned
    return GemvConfig(block_m, block_n, block_k, warps, stages, split_k=split[0] if split else 1)


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


def _fitting_rows(candidates: tuple[int, ...], n: int, silu: bool,
                  scale_block: tuple[int, int] | None) -> tuple[int, ...] | None:
    """The BLOCK_N candidates a dot tile may take; None where block scales fit none
    (every program's rows, gate's and up's, inside one block row; one scale a K step)."""
    if scale_block is None:
        return candidates
    bn, bk = scale_block
    fit = tuple(c for c in candidates if bn % c == 0 and (not silu or n % c == 0))
    return fit if fit and bk >= 16 and not bk & (bk - 1) else None


def _dot16_config(n: int, k: int, w_bytes: int, x_bytes: int, silu: bool,
                  scale_block: tuple[int, int] | None, sms: int) -> GemvConfig | None:
    tiles = 2 if silu else 1
    tuned = _DOT_TUNED_132.get((w_bytes, scale_block is not None, n, k, silu)) if sms == 132 else None
    if tuned is not None:
        return _tuned_config(GEMV_MAX_M, tuned)
    # x^T is re-read from L2 by every program: wider tiles amortize it; about one
    # program per SM, kept busy by num_stages of W tiles in flight (cp.async).
    block_k = 256 if w_bytes == 1 else 128
    candidates = _fitting_rows((64, 32, 16), n, silu, scale_block)
    if candidates is None:
        return None
    if scale_block is not None:
        block_k = scale_block[1]      # one scale per K step of the dot
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


# The skinny rule's budgets (sm_90, 132 SMs; a guess until the sweep): fp32
# accumulators (gate and up) at most 64 a thread, the W tile converted in
# registers at most 16k elements a program (past that the 2..16 dot spilled),
# and the stages' shared memory under 192 KB (one program an SM: x's tile makes
# each stage too large for two).
_SKINNY_ACC_PER_THREAD = 64
_SKINNY_W_TILE = 16384
_SKINNY_SMEM = 192 << 10


def _skinny_config(bucket: int, n: int, k: int, w_bytes: int, x_bytes: int, silu: bool,
                   scale_block: tuple[int, int] | None, sms: int) -> GemvConfig | None:
    """17..256 rows: M tiles of up to 128 rows (the bucket 256 in two), W read once
    a tile. Each program re-reads its M tile's x from L2 for its BLOCK_N rows of
    W, 2 * BLOCK_M / BLOCK_N x bytes a W byte: BLOCK_N of twice BLOCK_M (up to
    128) keeps that at most one, halved while the grid holds under half the SMs."""
    tiles = 2 if silu else 1
    block_m = min(bucket, 128)
    m_tiles = bucket // block_m
    candidates = _fitting_rows((128, 64, 32, 16), n, silu, scale_block)
    if candidates is None:
        return None
    tuned = _SKINNY_TUNED_132.get((bucket, w_bytes, scale_block is not None, n, k, silu)) if sms == 132 else None
    if tuned is not None:
        return _tuned_config(block_m, tuned)
    block_n = next((c for c in candidates if c <= 2 * block_m), candidates[-1])
    while block_n > candidates[-1] and triton.cdiv(n, block_n) * m_tiles < sms // 2:
        block_n //= 2
    warps = 4
    while tiles * block_n * block_m > _SKINNY_ACC_PER_THREAD * 32 * warps:
        if warps == 8:
            block_n //= 2
        else:
            warps = 8
    if scale_block is not None:
        block_k = scale_block[1]      # one scale per K step of the dot
    else:
        block_k = min(256 if w_bytes == 1 and block_m <= 32 else 128, max(16, triton.next_power_of_2(k)))
        while tiles * block_n * block_k > _SKINNY_W_TILE and block_k > 64:
            block_k //= 2
    stage = tiles * block_n * block_k * w_bytes + block_k * block_m * x_bytes
    num_stages = max(2, min(6, _SKINNY_SMEM // stage))
    return GemvConfig(block_m, block_n, block_k, warps, num_stages)


@functools.lru_cache(maxsize=None)
def gemv_config(m_bucket: int, n: int, k: int, w_bytes: int, x_bytes: int, silu: bool,
                scale_block: tuple[int, int] | None, sms: int) -> GemvConfig | None:
    """Tiles for a row bucket (GEMV_BUCKETS), output width n (I when silu),
    reduction k. None: block scales whose block rows no tile fits in (bn not a
    multiple of 16, or silu's I)."""
    if m_bucket == 1:
        return _row_config(n, k, w_bytes, 2 if silu else 1, scale_block, sms)
    if m_bucket == GEMV_MAX_M:
        return _dot16_config(n, k, w_bytes, x_bytes, silu, scale_block, sms)
    assert GEMV_MAX_M < m_bucket <= SKINNY_MAX_M, f"no GEMV bucket of {m_bucket} rows"
    return _skinny_config(m_bucket, n, k, w_bytes, x_bytes, silu, scale_block, sms)
