"""Timings of the Triton KV-cache kernels on one GPU (not a test; needs CUDA).

    python3 tests/ops/bench_kernels.py [--sweep | --chunks | --fp8 | --decode]

Llama-3-8B attention shape (32 q heads, 8 kv heads, head_dim 128, bf16, block
16). Decode: achieved HBM GB/s = K+V bytes read / median time. Prefill: TFLOP/s
= 4 * heads * head_dim * causal (query, key) pairs / median time. Page copies:
bytes read + written / time. --sweep also times other tile configs.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.testing

from pdd.ops import reference
from pdd.ops import triton_attention as ta
from pdd.ops import triton_ops as tk
from pdd.ops.metadata import AttentionMetadata

H, KVH, D, BS = 32, 8, 128, 16
DT = torch.bfloat16
HBM_PEAK, MMA_PEAK = 4260.0, 796.0  # GB/s, TFLOP/s measured on these machines (docs/design.md)


def batch(q_lens, seq_lens, seed=0):
    dev = "cuda"
    g = torch.Generator().manual_seed(seed)
    need = [triton.cdiv(s, BS) for s in seq_lens]
    nb = 1 + sum(need)
    perm = torch.randperm(nb - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    k = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[k:k + n].int()
        k += n
    ql, sl = torch.tensor(q_lens), torch.tensor(seq_lens)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ql, 0)
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1:
        nd += 1
    meta = AttentionMetadata(slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64, device=dev),
                             query_start_loc=cu.to(dev), seq_lens=sl.int().to(dev), block_tables=table.to(dev),
                             num_decodes=nd, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    kv = torch.empty(2, nb, BS, KVH, D, dtype=DT, device=dev).normal_()
    q = torch.empty(int(cu[-1]), H, D, dtype=DT, device=dev).normal_()
    return q, kv, meta


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")  # ms


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode(sweep: bool):
    print(f"== decode{' sweep' if sweep else ''} (bf16, 32/8 heads, d 128): K+V bytes read / time")
    for b in ((1, 128) if sweep else (1, 32, 128)):
        for ctx in ((8192,) if sweep else (1024, 8192)):
            q, kv, meta = batch([1] * b, [ctx] * b)
            scale = D ** -0.5
            ms = bench(lambda: tk.paged_attention(q, kv, meta, scale))
            gbs = b * ctx * KVH * D * 2 * 2 / ms / 1e6
            splits = ta._decode_num_splits(b, KVH, ctx, ta._decode_config(D, DT, True)["BLOCK_N"], q.device)
            print(f"decode b={b:4d} ctx={ctx:5d} splits={splits:2d}: {ms * 1e3:8.1f} us "
                  f"{gbs:7.0f} GB/s ({gbs / HBM_PEAK:.0%} of {HBM_PEAK:.0f})", flush=True)
            if sweep and ctx == 8192 and b in (1, 128):
                nbytes = b * ctx * KVH * D * 4
                sweep_configs("_decode_config", decode_configs((32, 3, 4), (64, 2, 4), (64, 4, 4), (128, 2, 4), (128, 3, 8)),
                              lambda: tk.paged_attention(q, kv, meta, scale), tk.paged_attention(q, kv, meta, scale),
                              lambda ms: f"{ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s")


def sweep_configs(config_fn: str, configs: list[dict], run, ref, figure) -> None:
    """Time run() with each tile config in place of what `ta.<config_fn>` picks;
    figure(ms) says what the time means (GB/s, TFLOP/s); error against ref."""
    orig = getattr(ta, config_fn)
    for cfg in configs:
        setattr(ta, config_fn, lambda *_, cfg=cfg: dict(cfg))
        name = " ".join(f"{k}={v}" for k, v in cfg.items())
        try:
            err = rel(run(), ref)
            print(f"   {name}: {figure(bench(run))} (diff {err:.1e})", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"   {name}: failed {type(e).__name__}: {e}"[:300])
        finally:
            setattr(ta, config_fn, orig)


def decode_configs(*triples) -> list[dict]:
    return [dict(BLOCK_N=bn, num_stages=st, num_warps=nw) for bn, st, nw in triples]


def decode_fp8():
    """An FP8 cache against bf16 at the same shapes, and the tile configs: the FP8
    pages are half the bytes, so the kernel should take about half the time."""
    print("== decode, FP8 (e4m3) vs bf16 cache (32/8 heads, d 128): K+V bytes read / time")
    configs = decode_configs((64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 3, 8), (128, 4, 8), (256, 2, 8),
                             (256, 3, 8))
    scale = D ** -0.5
    for b, ctx in ((1, 8192), (32, 1024), (32, 8192), (128, 8192)):
        q, kv, meta = batch([1] * b, [ctx] * b)
        kv8 = kv.clamp(-448, 448).to(torch.float8_e4m3fn)
        ref = tk.paged_attention(q, kv8.to(DT), meta, scale)
        for name, cache, size in (("bf16", kv, 2), ("fp8", kv8, 1)):
            ms = bench(lambda: tk.paged_attention(q, cache, meta, scale, (1.0, 1.0)))
            gbs = b * ctx * KVH * D * 2 * size / ms / 1e6
            print(f"decode b={b:4d} ctx={ctx:5d} {name}: {ms * 1e3:8.1f} us {gbs:7.0f} GB/s", flush=True)
        nbytes = b * ctx * KVH * D * 2
        sweep_configs("_decode_config", configs, lambda: tk.paged_attention(q, kv8, meta, scale, (1.0, 1.0)), ref,
                      lambda ms: f"{ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s")


def prefill(sweep: bool):
    print(f"== prefill{' sweep' if sweep else ''} (bf16, causal, 32/8 heads, d 128): 4*H*D*pairs / time")
    for b, n in (((1, 16384),) if sweep else ((1, 4096), (1, 16384), (4, 4096))):
        q, kv, meta = batch([n] * b, [n] * b)
        scale = D ** -0.5
        ms = bench(lambda: tk.paged_attention(q, kv, meta, scale))
        flops = 4 * H * D * b * n * (n + 1) / 2
        tf = flops / ms / 1e9
        print(f"prefill b={b} n={n:5d}: {ms * 1e3:9.1f} us {tf:6.0f} TFLOP/s ({tf / MMA_PEAK:.0%} of {MMA_PEAK:.0f})",
              flush=True)
        if b == 1 and not sweep:
            try:  # torch SDPA (flash) on contiguous K/V, same work, for scale
                qq = q.view(1, n, H, D).transpose(1, 2)
                kk = torch.randn(1, KVH, n, D, dtype=DT, device="cuda")
                vv = torch.randn_like(kk)
                f = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                                             enable_gqa=True)
                ms_t = bench(f)
                print(f"   torch sdpa (contiguous kv) n={n}: {ms_t * 1e3:9.1f} us {flops / ms_t / 1e9:6.0f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                print(f"   torch sdpa failed: {e}"[:200])
        if sweep and n == 16384:
            configs = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=st)
                       for bm, bn, nw, st in ((128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 3),
                                              (128, 32, 4, 4), (128, 128, 8, 2))]
            sweep_configs("_prefill_config", configs, lambda: tk.paged_attention(q, kv, meta, scale),
                          tk.paged_attention(q, kv, meta, scale),
                          lambda ms: f"{ms * 1e3:9.1f} us {flops / ms / 1e9:6.0f} TFLOP/s")


def chunk_beside_decodes():
    """One layer of a mixed step: 80 decodes at 1k of context and one prompt
    chunk at a depth, with the key splits the kernel picks, and forced to each
    count (does the split rule pick well at every depth?)."""
    print("== prompt chunk beside 80 decodes (1k ctx), one layer: splits picked vs forced")
    scale = D ** -0.5
    orig = ta._prefill_num_splits
    for chunk in (128, 256, 512):
        for depth in (512, 1024, 2048, 3072, 4096, 6144, 8192, 12288):
            q, kv, meta = batch([1] * 80 + [chunk], [1024] * 80 + [depth + chunk])
            m_tiles = triton.cdiv(chunk, ta._prefill_config(D, DT, True)["BLOCK_M"])
            picked = orig(H * m_tiles, meta.max_seq_len, ta._prefill_config(D, DT, True)["BLOCK_N"], q.device)
            times = {}
            for forced in (None, 1, 2, 3, 4, 6, 8, 12, 16):
                if forced is not None:
                    ta._prefill_num_splits = lambda *a, f=forced: f
                try:
                    times[forced] = bench(lambda: tk.paged_attention(q, kv, meta, scale)) * 1e3
                finally:
                    ta._prefill_num_splits = orig
            forced_txt = " ".join(f"{k}:{v:.0f}" for k, v in times.items() if k is not None)
            print(f"chunk {chunk:4d} depth {depth:5d}: picked {picked:2d} {times[None]:7.0f} us | forced {forced_txt}",
                  flush=True)


def copies():
    print("== page copies (32 KiB pages: 16 x 8 x 128 bf16)")
    kv = torch.empty(2, 8192, BS, KVH, D, dtype=DT, device="cuda").normal_()
    for n in (64, 2048):
        ids = torch.randperm(8192, device="cuda")[:n]
        dst_ids = torch.randperm(8192, device="cuda")[:n]
        nbytes = 2 * n * BS * KVH * D * 2 * 2  # K and V pages, read + write
        other = torch.empty_like(kv)
        for name, fn in (("gather", lambda: tk.gather_blocks(kv, ids)),
                         ("copy_blocks", lambda: tk.copy_blocks(kv, other, ids, dst_ids)),
                         ("reference gather", lambda: reference.gather_blocks(kv, ids))):
            ms = bench(fn)
            print(f"{name:17s} {n:5d} pages: {ms * 1e3:8.1f} us {nbytes / ms / 1e6:6.0f} GB/s (read+write)")
    t = 16384
    key = torch.randn(t, KVH, D, dtype=DT, device="cuda")
    slots = torch.randperm(8192 * BS, device="cuda")[:t]
    ms = bench(lambda: tk.store_kv(key, key, kv, slots))
    print(f"store_kv {t} tokens: {ms * 1e3:.1f} us {t * KVH * D * 2 * 2 * 2 / ms / 1e6:.0f} GB/s (read+write)")


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs CUDA"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if "--decode" in sys.argv:
        decode(False)
        sys.exit(0)
    if "--fp8" in sys.argv:
        decode_fp8()
        sys.exit(0)
    if "--chunks" in sys.argv:
        chunk_beside_decodes()
        sys.exit(0)
    decode(False)
    prefill(False)
    copies()
    if "--sweep" in sys.argv:  # other tile configs, last: the main figures come first
        decode(True)
        prefill(True)
