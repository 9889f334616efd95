"""Triton kernels for the KV-cache ops; `reference.py` defines what each computes.

Same names and signatures as the reference, so the dispatcher (`pdd.ops`) can
call either. The wrappers check shapes, strides, dtypes and devices, pick tile
sizes from host ints only, and launch: no `.item()`, no `.tolist()`, no loop
over sequences, nothing that waits for the GPU (decode steps can be captured
in CUDA graphs).

KV cache of one layer: [2, num_blocks, block_size, kv_heads, head_dim]; each
page (one block of K or of V) must be contiguous, blocks and halves may have
any stride.

Kernels:
- `store_kv`: one program per token, all kv heads of its K and V.
- decode (`meta.num_decodes` first sequences, one query each): grid
  (decodes, kv_heads, splits). A program holds the GQA group of query heads
  that share one KV head as the rows of a tl.dot tile, so each K/V page is read
  once per KV head. Flash-decoding: the context of each sequence is cut into
  `splits` ranges (sized from that sequence's own length, so the split count
  alone is chosen on the host); each program writes its partial (max, sum,
  acc) and a small kernel merges them. With one split the decode kernel writes
  the output itself.
- prefill (the other sequences): grid (heads, query tiles, prefills); varlen
  causal flash attention over the paged context, tiles of BLOCK_M queries x
  BLOCK_N keys, tl.dot for QK^T and PV in the input dtype with fp32
  accumulation; key tiles that every query of the tile sees run without
  masks, the diagonal tiles with the causal mask, later tiles are skipped.
- page copies (`gather_blocks`, `scatter_blocks`, `copy_blocks`): grid
  (pages, 2 halves x chunks), one contiguous CHUNK of a page per program.
- `rotary_store_kv` (triton_layers): one program per token rotates its q and
  k heads in place and writes the rotated k and v into its slot.
- `argmax` (triton_sampling): grid (rows, vocab chunks), then one program per
  row merges the chunks' answers.
"""
from __future__ import annotations

from pdd.ops import triton_layers as _layers
from pdd.ops.triton_attention import paged_attention, warm_up_merges, warm_up_split_prefill
from pdd.ops.triton_pages import copy_blocks, gather_blocks, scatter_blocks, store_kv
from pdd.ops.triton_sampling import argmax, warm_up_argmax

__all__ = ["store_kv", "paged_attention", "gather_blocks", "scatter_blocks", "copy_blocks",
           "rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "rotary_store_kv", "argmax",
           "warm_up_argmax", "warm_up_merges", "warm_up_split_prefill"]

# The decoder's per-token ops (fused norm, rotary, SiLU-mul) live in triton_layers.
rms_norm = _layers.rms_norm
add_rms_norm = _layers.add_rms_norm
silu_and_mul = _layers.silu_and_mul
rotary = _layers.rotary
rotary_store_kv = _layers.rotary_store_kv
