"""Sizes the dispatcher (pdd.ops) and the kernels it loads agree on: a leaf,
because a kernel module that imported them from the dispatcher, which imports
it lazily, would close an import circle."""
from __future__ import annotations

GEMV_MAX_M = 16   # rows (tokens of a step) of the GEMV's first dot bucket (2..16)
SKINNY_MAX_M = 256   # rows up to which the GEMV kernel takes a linear at all (W8A16 skinny GEMM)
# The row counts each compiled GEMV variant serves: a step of M rows runs the
# variant of the smallest bucket >= M (M itself is no specialization key).
# 1: the one-row kernel; 16..128: the dot kernel, one M tile of that many rows;
# 256: the dot kernel in tiles of 128 rows (two M tiles, W read about once:
# the two programs of one N block run next to each other and share it in L2).
GEMV_BUCKETS = (1, GEMV_MAX_M, 32, 64, 128, SKINNY_MAX_M)


def gemv_bucket(rows: int) -> int:
    """The bucket (GEMV_BUCKETS) of a step of `rows` rows, 1 <= rows <= SKINNY_MAX_M."""
    assert 1 <= rows <= SKINNY_MAX_M, f"the GEMV takes 1..{SKINNY_MAX_M} rows, got {rows}"
    return next(b for b in GEMV_BUCKETS if rows <= b)
