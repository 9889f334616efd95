"""Host KV tier copy bandwidth (pdd.kv.copies) against the PCIe ceiling of the
same machine: one contiguous pinned copy of the same bytes each way.

    python benchmarks/host_kv_copy.py                   # the Llama-3.1-8B shape, bf16, on cuda
    python benchmarks/host_kv_copy.py --device cpu --layers 2 --blocks 64   # a smoke run

Prints one JSON line per direction: GB/s of the tier's batched block copies
(scattered pool blocks, gathered on the device, DMA per run of tier slots)
and of the plain copy, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.cli import run_as_main

from pdd.kv.cache import KVCacheSpec, allocate_kv_cache
from pdd.kv.copies import BlockCopier


def _timed(fn, device: torch.device, repeat: int) -> float:
    fn()   # warm: allocator, first DMA
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeat


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=4096, help="blocks in the pool the copies pick from")
    p.add_argument("--blocks", type=int, default=512, help="blocks per copy (512: an 8k-token conversation)")
    p.add_argument("--repeat", type=int, default=10)


def main(a: argparse.Namespace) -> int:
    device = torch.device(a.device)
    spec = KVCacheSpec(a.layers, a.kv_heads, a.head_dim, a.block_size, torch.bfloat16)
    kv = allocate_kv_cache(spec, a.pool_blocks, device)
    copier = BlockCopier(kv)
    storage = torch.empty((a.blocks, *copier.block_shape), dtype=torch.uint8, pin_memory=copier.pinned)
    blocks = torch.randperm(a.pool_blocks - 1)[:a.blocks].add(1).tolist()   # scattered, as a pool's are
    slots = list(range(a.blocks))
    nbytes = a.blocks * spec.bytes_per_block
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = storage.view(-1)
    runs = {"gpu_to_host": (lambda: copier.to_tier(blocks, storage, slots).wait(),
                            lambda: flat_host.copy_(flat_dev, non_blocking=copier.pinned)),
            "host_to_gpu": (lambda: copier.to_pool(storage, slots, blocks).wait(),
                            lambda: flat_dev.copy_(flat_host, non_blocking=copier.pinned))}
    for name, (tier, plain) in runs.items():
        t_tier, t_plain = _timed(tier, device, a.repeat), _timed(plain, device, a.repeat)
        print(json.dumps({"direction": name, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                          else "cpu", "bytes": nbytes, "blocks": a.blocks, "block_bytes": spec.bytes_per_block,
                          "tier_GBps": round(nbytes / t_tier / 1e9, 2),
                          "plain_pinned_GBps": round(nbytes / t_plain / 1e9, 2),
                          "tier_share_of_plain": round(t_plain / t_tier, 3)}))
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
