"""The paged KV tensors: one allocation per worker,
kv[layer][k|v][block][slot][kv_head][head_dim], sized from a memory budget.

One allocation on purpose: a single CUDA IPC handle then exports the whole
pool to a peer, and a block id means the same offset in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.config import ConfigError, EngineConfig
from pdd.kv.scales import KV_CACHE_DTYPES
from pdd.model.config import ModelConfig

_CPU_DEFAULT_BYTES = 512 * 2**20
# GPU memory left for one step's activations and logits; generous, not measured per model.
_ACTIVATION_RESERVE = 2 * 2**30


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """engine.kv_cache_dtype (validated by EngineConfig) as the pool's torch dtype."""
    torch_name = KV_CACHE_DTYPES[name]
    return model_dtype if torch_name is None else getattr(torch, torch_name)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype   # the cache's elements (FP8 takes half the bytes of bf16: twice the tokens)

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, cfg: EngineConfig, device: torch.device, beside_bytes: int = 0) -> int:
        """beside_bytes: what the worker will allocate beside the pool on its
        device (nixl's landing region), left out of a budget from free GPU memory."""
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes
        elif device.type == "cuda":
            budget = gpu_kv_budget(device, cfg.gpu_memory_utilization) - beside_bytes
        else:
            budget = _CPU_DEFAULT_BYTES
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 2:
            raise ConfigError(f"engine: KV budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks "
                              f"of {self.bytes_per_block / 2**20:.2f} MiB; raise kv_cache_bytes or "
                              "gpu_memory_utilization (or lower it for the other processes on this GPU)")
        return int(num_blocks)


def gpu_kv_budget(device: torch.device, utilization: float, pool_bytes: int = 0) -> int:
    """Bytes a KV pool may take on a GPU: this process's share of the device
    (`utilization`), less what its model and activations already hold, and never
    more than is free: another process on the same GPU (a second worker) counts
    against what is free, not against this share. `pool_bytes`: a pool already
    allocated, counted as free (what a fresh start would have)."""
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device) - pool_bytes
    return min(int(total * utilization) - own, free + pool_bytes) - _ACTIVATION_RESERVE


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    # Zeroed, not empty: the null block is read as padding by some kernels and
    # must hold finite values.
    return torch.zeros(shape, dtype=spec.dtype, device=device)
