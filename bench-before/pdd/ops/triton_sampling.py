"""Triton greedy argmax over a batch of logits rows.

torch's argmax of a [B, V] float32 row runs as one slow generic reduction
(~27 us at B=1, V=128256 on an H200). Here V is cut into chunks so that even
one row spreads over many SMs: grid (B, chunks), each program reduces one chunk
to (value, index) and a second one-program-per-row launch reduces those. When
one chunk covers the row, the first launch writes the answer itself.

Semantics match torch.argmax(dim=-1): the lowest index among equal maxima, and
NaN counts as larger than everything (a row with a NaN gives its first NaN's
index). -inf is an ordinary value (an all -inf row gives 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdd.ops.triton_common import _FLOAT_DTYPES, _num_sms, _on_gpu

_NO_INDEX = tl.constexpr(2**31 - 1)  # larger than any column index: V must stay below it
_MAX_CHUNKS = 1024  # the second stage reduces all of a row's chunks in one tile


@triton.jit
def _argmax_tile(x, idx, mask):
    """(value, index) of the maximum of x where mask, the lowest index among ties;
    if x has a NaN: (NaN, index of the first NaN)."""
    nan = x != x
    first_nan = tl.min(tl.where(mask & nan, idx, _NO_INDEX), axis=0)
    ok = mask & ~nan
    # NaN lanes are taken out before the max: a GPU max may drop or keep NaN.
    xs = tl.where(ok, x, float("-inf"))
    best = tl.max(xs, axis=0)
    at = tl.min(tl.where(ok & (xs == best), idx, _NO_INDEX), axis=0)
    has_nan = first_nan < _NO_INDEX
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, at)


@triton.jit
def _argmax_chunks_kernel(x_ptr, stride_row, V, part_val, part_idx, out_ptr,
                          CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    mask = idx < V
    x = tl.load(x_ptr + row * stride_row + idx, mask=mask, other=float("-inf")).to(tl.float32)
    val, at = _argmax_tile(x, idx, mask)
    if CHUNKS == 1:
        tl.store(out_ptr + row, at.to(tl.int64))
    else:
        tl.store(part_val + row * CHUNKS + c, val)
        tl.store(part_idx + row * CHUNKS + c, at)


@triton.jit
def _argmax_merge_kernel(part_val, part_idx, out_ptr, CHUNKS: tl.constexpr, C_PAD: tl.constexpr):
    # Chunks are in column order and each holds its own first maximum (or first
    # NaN), so the same rule over the chunks' answers gives the row's answer.
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    mask = c < CHUNKS
    val = tl.load(part_val + row * CHUNKS + c, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx + row * CHUNKS + c, mask=mask, other=_NO_INDEX)
    _, at = _argmax_tile(val, idx, mask)
    tl.store(out_ptr + row, at.to(tl.int64))


def _chunk_for(rows: int, v: int, device: torch.device) -> int:
    """Columns per program: large enough to amortise a program's start, small
    enough that rows * chunks fills the GPU twice over (B=1 needs many chunks)."""
    chunk = 8192 if device.type != "cpu" else 1024
    while chunk > 1024 and rows * triton.cdiv(v, chunk) < 2 * _num_sms(device):
        chunk //= 2
    chunk = max(chunk, triton.next_power_of_2(triton.cdiv(v, _MAX_CHUNKS)))
    return min(chunk, triton.next_power_of_2(v))


def warm_up_argmax(vocab: int, max_rows: int, device: torch.device) -> int:
    """Compile argmax for each chunk size a batch of 1..max_rows rows picks: the
    chunk is a constexpr, so a batch size first seen in service would compile
    one then (and every request of the worker would wait). Returns how many."""
    first_rows: dict[int, int] = {}
    for rows in range(1, max_rows + 1):
        first_rows.setdefault(_chunk_for(rows, vocab, device), rows)
    for chunk, rows in first_rows.items():
        _argmax(torch.zeros(rows, vocab, dtype=torch.float32, device=device), chunk)
    return len(first_rows)


def _argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(v, chunk)
    assert chunks <= _MAX_CHUNKS, f"{chunks} chunks of {chunk} columns: use larger chunks"
    if chunks == 1:
        part_val, part_idx = out, out  # unused: the first stage writes the answer
    else:
        part_val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    gpu = _on_gpu(logits)
    _argmax_chunks_kernel[(rows, chunks)](logits, logits.stride(0), v, part_val, part_idx, out,
                                          CHUNK=chunk, CHUNKS=chunks,
                                          num_warps=(8 if chunk >= 4096 else 4) if gpu else 1)
    if chunks > 1:
        _argmax_merge_kernel[(rows,)](part_val, part_idx, out, CHUNKS=chunks,
                                      C_PAD=triton.next_power_of_2(chunks), num_warps=4 if gpu else 1)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B], torch.argmax(logits, dim=-1)."""
    assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
    assert logits.dtype in _FLOAT_DTYPES, f"logits dtype {logits.dtype} not supported"
    assert 0 < logits.shape[1] < _NO_INDEX.value, f"vocab size {logits.shape[1]} out of range"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _argmax(logits, _chunk_for(logits.shape[0], logits.shape[1], logits.device))
