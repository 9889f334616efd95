"""The engine's command-line flags (`pdd generate`, `pdd bench ...`) and the
LLMEngine keyword arguments they make. Imports nothing heavy: `pdd admin` and
the router never pay for torch."""
from __future__ import annotations

import argparse

from pdd.config import EngineConfig
from pdd.kv.scales import KV_CACHE_DTYPES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: built-in tiny model)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes (no weight files read)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: cuda if present)")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (auto: the checkpoint's)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks (default: from the memory budget, engine.kv_cache_bytes)")
    p.add_argument("--chunk-size", type=int, default=512, help="longest prefill chunk of one request per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 8192 on a GPU, 2048 on the CPU")
    p.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt whole")
    p.add_argument("--long-prefill-token-threshold", type=int, default=EngineConfig.long_prefill_token_threshold,
                   help="a prompt with more tokens than this left to compute is long: short prompts take a "
                        "step's tokens first (0: first come, first served; default %(default)s)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before scheduling the next")


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache elements: auto (the model's dtype) or fp8_e4m3 (half the bytes)")


def engine_kwargs(args) -> dict:
    return dict(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype,
                block_size=args.block_size, num_blocks=args.num_blocks, chunk_size=args.chunk_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                async_scheduling=not args.no_async_scheduling)
