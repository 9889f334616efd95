"""Triton paged attention: split-KV GQA decode and varlen causal prefill over the
paged context (see triton_ops for the design)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdd.ops.metadata import AttentionMetadata
from pdd.ops.triton_common import (_FLOAT_DTYPES, _LOG2E, _check_index, _check_kv_layer, _dot_mode,
                                   _kv_scales, _num_sms, _on_gpu, _pdl_wait, _pow2, pdl_options)

# ---------------------------------------------------------------------------
# paged attention: shared tile step
# ---------------------------------------------------------------------------

@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, k_cache, v_cache, bt_row, head_off, start, hi, qk_scale,
                 stride_cb, stride_cs, offs_d,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) of a sequence.

    q: [M, D_PAD] (input dtype); q_pos: [M] absolute positions (CAUSAL only);
    keys at or beyond `hi` are masked when MASKED (else all are in range).
    Scores are kept in the log2 domain (qk_scale includes log2(e)). An FP8
    cache's K and V are cast to q's dtype (exact) here; their scales are applied
    by the callers, K's in qk_scale and V's to the output.
    DOT: 0 = tl.dot on the input dtype (fp32 accumulation), 1 = fp32 inputs in
    full precision (no tf32), 2 = bf16 values upcast to fp32 before tl.dot (the
    Triton interpreter multiplies bf16 operands as raw 16-bit integers).
    """
    k_pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = k_pos < hi
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
    rows = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + head_off
    ptrs = rows[:, None] + offs_d[None, :]
    if MASKED:
        if D_PAD != HEAD_DIM:
            kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        else:
            kv_mask = n_mask[:, None]
        k = tl.load(k_cache + ptrs, mask=kv_mask, other=0.0)
    elif D_PAD != HEAD_DIM:
        k = tl.load(k_cache + ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(k_cache + ptrs)
    k = k.to(q.dtype)
    if DOT == 1:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    elif DOT == 2:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if MASKED:
        if CAUSAL:
            valid = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        else:
            valid = n_mask[None, :]
        qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache + ptrs, mask=kv_mask, other=0.0)
    elif D_PAD != HEAD_DIM:
        v = tl.load(v_cache + ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        v = tl.load(v_cache + ptrs)
    v = v.to(q.dtype)
    if DOT == 1:
        pv = tl.dot(p, v, input_precision="ieee")
    elif DOT == 2:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _q_for_cache(q, k_cache):
    """q as the dot's operand type for this cache. FP8 pages convert to fp16 in one
    instruction a pair, to bf16 only by a long sequence (which made decode attention
    over an FP8 cache bound by that arithmetic, slower than over bf16), so a bf16 q
    goes to fp16 instead: exact below 65504 (saturated beyond), and the softmax
    probabilities, cast to V's type, lose nothing in [0, 1]."""
    if k_cache.dtype.element_ty == tl.float8e4nv:
        if q.dtype == tl.bfloat16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


# ---------------------------------------------------------------------------
# decode: split-KV (flash-decoding), GQA group per program
# ---------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(q_ptr, k_cache, v_cache, out_ptr, m_part, l_part, acc_part,
                   block_tables, seq_lens, num_splits,
                   stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_bt, qk_scale, v_scale,
                   NUM_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, M_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    _pdl_wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    # This sequence's share of keys, a whole number of tiles (num_splits is a
    # runtime value: a new split count needs no recompilation).
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GQA + offs_g
    g_mask = offs_g < GQA
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = _q_for_cache(q, k_cache)

    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    for n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, offs_g, k_cache, v_cache, bt_row, head_off, n,
                                     end, qk_scale, stride_cb, stride_cs, offs_d,
                                     HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, False, DOT)
    if full_end < end:
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, offs_g, k_cache, v_cache, bt_row, head_off,
                                     full_end, end, qk_scale, stride_cb, stride_cs, offs_d,
                                     HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, False, DOT)

    out_mask = g_mask[:, None] & d_mask[None, :]
    acc = acc * v_scale
    if not SPLIT:
        o = acc / l_i[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: [decodes, heads, splits] for m and l, [..., HEAD_DIM] for acc.
        row = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(m_part + row, m_i, mask=g_mask)
        tl.store(l_part + row, l_i, mask=g_mask)
        tl.store(acc_part + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, m_part, l_part, acc_part, num_splits, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         S_PAD: tl.constexpr, PDL: tl.constexpr):
    """One output row and head from its split-KV partials ([rows, heads, splits]
    for m and l, [..., HEAD_DIM] for acc): decodes, and prefill chunks over a deep
    context alike."""
    _pdl_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(m_part + row, mask=s_mask, other=float("-inf"))
    l = tl.load(l_part + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l, 0)
    acc = tl.load(acc_part + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


def _decode_num_splits(num_decodes: int, kv_heads: int, max_seq_len: int, block_n: int,
                       device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the GPU about twice, each split
    at least two key tiles long, at most 64. Host ints only (no sync)."""
    target = 2 * _num_sms(device)
    want = triton.cdiv(target, max(1, num_decodes * kv_heads))
    by_len = triton.cdiv(max(1, max_seq_len), 2 * block_n)
    return max(1, min(want, by_len, 64))


def _decode_config(head_dim: int, dtype: torch.dtype, gpu: bool, fp8_full_grid: bool = False) -> dict:
    """fp8_full_grid: an FP8 cache and at least one program per SM unsplit. Its
    pages are half the bytes of a 64-key tile, too few in flight per program:
    128-key tiles measured 1.3x faster on H200 at batch 32 and 128 (8k context;
    tests/ops/bench_kernels.py --fp8), while with few sequences (split keys)
    the 64-key tiles stay ahead."""
    if not gpu:  # interpreter: small tiles so that small tests cover many tiles
        return dict(BLOCK_N=16, num_warps=1, num_stages=1)
    if head_dim > 128 or dtype == torch.float32:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    if fp8_full_grid and head_dim <= 128:
        return dict(BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)


def _decode(q, kv_layer, meta: AttentionMetadata, scale: float, out, k_scale: float, v_scale: float) -> None:
    nd = meta.num_decodes
    _, _, bs, kvh, d = kv_layer.shape
    h = q.shape[1]
    gqa = h // kvh
    fp8_full_grid = kv_layer.dtype == torch.float8_e4m3fn and nd * kvh >= _num_sms(q.device)
    cfg = _decode_config(d, q.dtype, _on_gpu(q), fp8_full_grid)
    block_n = cfg.pop("BLOCK_N")
    splits = _decode_num_splits(nd, kvh, meta.max_seq_len, block_n, q.device)
    d_pad = max(16, _pow2(d))
    kc, vc = kv_layer[0], kv_layer[1]
    if splits > 1:
        m_part = torch.empty((nd, h, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((nd, h, splits, d), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # unused
    _decode_kernel[(nd, kvh, splits)](
        q, kc, vc, out, m_part, l_part, acc_part, meta.block_tables, meta.seq_lens, splits,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0), scale * k_scale * _LOG2E, v_scale,
        NUM_HEADS=h, GQA=gqa, HEAD_DIM=d, D_PAD=d_pad, M_PAD=max(16, _pow2(gqa)), BLOCK_SIZE=bs,
        BLOCK_N=block_n, SPLIT=splits > 1, DOT=_dot_mode(q), **cfg, **pdl_options(q.device, q.shape[0]))
    if splits > 1:
        _merge_splits(out, m_part, l_part, acc_part, splits, d)


def _merge_splits(out, m_part, l_part, acc_part, splits: int, head_dim: int, max_splits: int | None = None) -> None:
    """max_splits: pad the split axis to this (a power of two) whatever `splits` is,
    so that one compiled merge serves every split count: a new one compiled in
    service stalled a worker's steps for 2 s on H200."""
    rows, h = m_part.shape[0], m_part.shape[1]
    _merge_splits_kernel[(rows, h)](
        out, m_part, l_part, acc_part, splits, out.stride(0), out.stride(1),
        NUM_HEADS=h, HEAD_DIM=head_dim, D_PAD=_pow2(head_dim), S_PAD=max_splits or _pow2(splits),
        num_warps=4 if _on_gpu(out) else 1, **pdl_options(out.device, out.shape[0]))


def decode_split_pads(kv_heads: int, max_seq_len: int, block_n: int, device: torch.device) -> list[int]:
    """Every split-axis width (the merge's S_PAD) a decode of contexts up to
    max_seq_len can compile: a power of two for each split count from 2 up to
    the most _decode_num_splits picks, which is for one sequence of
    max_seq_len tokens (more sequences or shorter ones never split more; in
    between, a sequence's length picks any count)."""
    most = _decode_num_splits(1, kv_heads, max_seq_len, block_n, device)
    return sorted({_pow2(s) for s in range(2, most + 1)})


def warm_up_merges(num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_seq_len: int,
                   device: torch.device) -> int:
    """Compile the split merge for every split count attention can pick, so no
    decode meets a new one in service: its split axis is padded to a power of
    two (a variant each, 2..64: a wider pad would cost every split decode step
    in registers and masked lanes), and prefill's to PREFILL_MAX_SPLITS. Decode
    steps in CUDA graphs compile theirs at capture, but a prefill worker has no
    graphs and any worker decodes eagerly beside prompt chunks, at whatever
    context lengths come. Nothing else of the merge's specialization varies in
    service: its output and partials are fresh [rows, heads, ...] tensors, the
    prefill's sliced past the decodes' rows (16-byte aligned still, for an even
    number of heads), and num_splits is not specialized. Returns how many."""
    block_n = _decode_config(head_dim, dtype, device.type != "cpu")["BLOCK_N"]
    pads = sorted(set(decode_split_pads(kv_heads, max_seq_len, block_n, device)) | {PREFILL_MAX_SPLITS})
    for pad in pads:
        # One row and two: a one-token step launches it under PDL (pdl_options), a variant of its own.
        for rows in (1, 2):
            out = torch.empty((rows, num_heads, head_dim), dtype=dtype, device=device)
            m_part = torch.zeros((rows, num_heads, pad), dtype=torch.float32, device=device)
            acc_part = torch.zeros((rows, num_heads, pad, head_dim), dtype=torch.float32, device=device)
            _merge_splits(out, m_part, torch.ones_like(m_part), acc_part, pad, head_dim, pad)
    return len(pads)


def warm_up_split_prefill(q_heads: int, kv_layer: torch.Tensor, dtype: torch.dtype, max_seq_len: int,
                          kv_scale: tuple[float, float] = (1.0, 1.0)) -> int:
    """Compile the split prefill kernel: a short chunk deep in its prompt (a
    prefix-cache hit, a chunk beside decodes) splits its keys, and a worker's
    warm-up steps reach that only when its budget plus a tail fits in
    max_model_len. One chunk of 17 queries over the deepest context that still
    splits, read from the null block of this worker's own pool (its strides and
    dtype are what service sees; nothing is written to it). Returns 1 if it
    compiled the split variant, 0 if no context this worker takes splits."""
    _, _, bs, _, d = kv_layer.shape
    device = kv_layer.device
    block_n = _prefill_config(d, dtype, device.type != "cpu")["BLOCK_N"]
    seq_len = min(max_seq_len, 128 * block_n)
    queries = 17
    if _prefill_num_splits(q_heads, seq_len, block_n, device) < 2 or seq_len <= queries:
        return 0
    width = -(-triton.cdiv(seq_len, bs) // 16) * 16     # the runner's block tables: 16-column multiples
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(queries, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, queries], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_tables=torch.zeros((1, width), dtype=torch.int32, device=device),
        num_decodes=0, max_query_len=queries, max_seq_len=seq_len)
    q = torch.zeros((queries, q_heads, d), dtype=dtype, device=device)
    paged_attention(q, kv_layer, meta, d ** -0.5, kv_scale)
    return 1


# ---------------------------------------------------------------------------
# prefill: varlen causal flash attention over the paged context
# ---------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_decodes", "num_splits"])
def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, m_part, l_part, acc_part,
                    block_tables, query_start_loc, seq_lens, num_decodes, num_splits,
                    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt, qk_scale, v_scale,
                    NUM_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPLIT: tl.constexpr, DOT: tl.constexpr):
    head = tl.program_id(0)
    # Heaviest (last) query tiles first: causal work grows with the tile index.
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = num_decodes + tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    m_start = m_tile * BLOCK_M
    if m_start < q_len:
        seq_len = tl.load(seq_lens + seq)
        first = seq_len - q_len + m_start            # position of the tile's first query
        hi = tl.minimum(seq_len, first + BLOCK_M)   # keys any row of the tile sees
        full = (first + 1) // BLOCK_N * BLOCK_N     # keys [0, full) every row sees
        # This split's keys: whole tiles of [0, full), which every row sees. The
        # diagonal tiles [full, hi) go to split 0, after its own keys: a row of
        # a split holding only those could see none (a NaN in the online softmax).
        per_split = tl.cdiv(tl.cdiv(full, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, full)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_mask = m_start + offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        tok = (q_start + m_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q = _q_for_cache(q, k_cache)
        q_pos = first + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = block_tables + seq.to(tl.int64) * stride_bt
        head_off = (head // GQA) * stride_ch
        for n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, k_cache, v_cache, bt_row, head_off, n,
                                         hi, qk_scale, stride_cb, stride_cs, offs_d,
                                         HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, True, DOT)
        if split == 0:
            for n in range(full, hi, BLOCK_N):
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, k_cache, v_cache, bt_row, head_off, n,
                                             hi, qk_scale, stride_cb, stride_cs, offs_d,
                                             HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, True, DOT)
        out_mask = m_mask[:, None] & d_mask[None, :]
        acc = acc * v_scale
        if not SPLIT:
            o = acc / l_i[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # Partials by query row (the step's token index), head and split.
            row = (tok * NUM_HEADS + head) * num_splits + split
            tl.store(m_part + row, m_i, mask=m_mask)
            tl.store(l_part + row, l_i, mask=m_mask)
            tl.store(acc_part + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


PREFILL_MAX_SPLITS = 16   # a power of two: the merge's split axis is padded to it


def _prefill_num_splits(programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Key splits per query tile. A short chunk beside decodes is a few query
    tiles per head, each reading the whole context before it one key tile after
    another: a 128-token chunk at 12k tokens of context is 32 programs on an
    H200's 132 SMs, and added 20 ms to an 80-decode step (~1 ms of arithmetic at
    peak); with its keys split, 7.6 ms (docs/benchmarks.md). A grid of more
    programs than SMs is not split (a 1024-token chunk, 256 programs, was ~2 ms
    slower split in two); otherwise enough splits to fill the GPU about twice,
    each at least 16 key tiles long, at most PREFILL_MAX_SPLITS, rounded down
    to a power of two (on H200 a 128-token chunk 12k deep took 228 us a layer
    in 8 splits, 269 in 9; a 256-token one 301 in 4, 377 in 5: tests/ops/
    bench_kernels.py --chunks). Host ints only (no sync)."""
    sms = _num_sms(device)
    if programs > sms:
        return 1
    want = triton.cdiv(2 * sms, max(1, programs))
    by_len = max(1, max_seq_len // (16 * block_n))
    splits = max(1, min(want, by_len, PREFILL_MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)



def _prefill_config(head_dim: int, dtype: torch.dtype, gpu: bool) -> dict:
    if not gpu:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    # H200, Llama-3-8B shape, 16k prompt: 391 TFLOP/s, against 330 for 128/64/8
    # warps/3 stages and 393 for 128/128/8/3, which needs ~200 KiB of shared
    # memory (more than an A100 has); this one needs ~100 KiB.
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)


def _prefill(q, kv_layer, meta: AttentionMetadata, scale: float, out, k_scale: float, v_scale: float) -> None:
    nd = meta.num_decodes
    num_prefills = meta.num_seqs - nd
    _, _, bs, kvh, d = kv_layer.shape
    h = q.shape[1]
    cfg = _prefill_config(d, q.dtype, _on_gpu(q))
    block_m = cfg["BLOCK_M"]
    kc, vc = kv_layer[0], kv_layer[1]
    m_tiles = triton.cdiv(max(1, meta.max_query_len), block_m)
    splits = _prefill_num_splits(h * m_tiles * num_prefills, meta.max_seq_len, cfg["BLOCK_N"], q.device)
    if splits > 1:
        rows = q.shape[0]    # indexed by token: the decodes' rows stay unused
        m_part = torch.empty((rows, h, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((rows, h, splits, d), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # unused
    _prefill_kernel[(h, m_tiles, num_prefills * splits)](
        q, kc, vc, out, m_part, l_part, acc_part, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        nd, splits, q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0), scale * k_scale * _LOG2E, v_scale,
        NUM_HEADS=h, GQA=h // kvh, HEAD_DIM=d, D_PAD=max(16, _pow2(d)), BLOCK_SIZE=bs,
        SPLIT=splits > 1, DOT=_dot_mode(q), **cfg)
    if splits > 1:
        _merge_splits(out[nd:], m_part[nd:], l_part[nd:], acc_part[nd:], splits, d, PREFILL_MAX_SPLITS)


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    scale: float, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached context.

    q: [T, heads, head_dim]; the new tokens' K/V are already in the cache (an
    FP8 cache's entries stand for entry x kv_scale).
    Returns a contiguous [T, heads, head_dim] tensor of q's dtype.
    """
    _check_kv_layer(kv_layer)
    _, _, bs, kvh, d = kv_layer.shape
    assert q.dim() == 3 and q.shape[2] == d, f"q must be [T, heads, {d}], got {tuple(q.shape)}"
    assert q.shape[1] % kvh == 0, f"{q.shape[1]} query heads are not a multiple of {kvh} kv heads"
    assert q.dtype in _FLOAT_DTYPES, f"q dtype {q.dtype} not supported"
    assert q.device == kv_layer.device, f"q is on {q.device}, kv_layer on {kv_layer.device}"
    b = meta.num_seqs
    nd = meta.num_decodes
    for name, t, dim in (("query_start_loc", meta.query_start_loc, 1), ("seq_lens", meta.seq_lens, 1),
                         ("block_tables", meta.block_tables, 2)):
        assert t.dtype == torch.int32, f"meta.{name} must be int32, got {t.dtype}"
        _check_index(t, f"meta.{name}", q.device, dim)
    assert meta.query_start_loc.shape[0] == b + 1, (
        f"meta.query_start_loc has {meta.query_start_loc.shape[0]} entries for {b} sequences")
    assert meta.block_tables.shape[0] == b and meta.block_tables.stride(1) == 1, (
        f"meta.block_tables must be [{b}, max_blocks] with unit column stride, "
        f"got {tuple(meta.block_tables.shape)} strides {meta.block_tables.stride()}")
    assert 0 <= nd <= b, f"meta.num_decodes {nd} out of range for {b} sequences"
    assert meta.max_seq_len <= meta.block_tables.shape[1] * bs, (
        f"meta.max_seq_len {meta.max_seq_len} exceeds the block table "
        f"({meta.block_tables.shape[1]} blocks x {bs})")
    assert q.shape[0] >= nd, f"{q.shape[0]} query tokens for {nd} decodes"

    k_scale, v_scale, _ = _kv_scales(kv_layer, kv_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        _decode(q, kv_layer, meta, scale, out, k_scale, v_scale)
    if nd < b:
        _prefill(q, kv_layer, meta, scale, out, k_scale, v_scale)
    return out
