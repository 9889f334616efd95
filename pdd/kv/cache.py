"""The paged KV tensors: one allocation per worker,
kv[layer][k|v][block][slot][kv_head][head_dim], sized from a memory budget.

One allocation on purpose: a single CUDA IPC handle then exports the whole
pool to a peer, and a block id means the same offset in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.config import ConfigError, EngineConfig
from pdd.model.config import ModelConfig

_CPU_DEFAULT_BYTES = 512 * 2**20
# GPU memory left for one step's activations and logits; generous, not measured per model.
_ACTIVATION_RESERVE = 2 * 2**30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, cfg: EngineConfig, device: torch.device) -> int:
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            # This process's share of the device, less what its model already
            # holds, goes to KV: another process on the same GPU (a second
            # worker) counts against what is free, not against this share.
            own = torch.cuda.memory_reserved(device)
            budget = min(int(total * cfg.gpu_memory_utilization) - own, free) - _ACTIVATION_RESERVE
        else:
            budget = _CPU_DEFAULT_BYTES
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 2:
            raise ConfigError(f"engine: KV budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks "
                              f"of {self.bytes_per_block / 2**20:.2f} MiB; raise kv_cache_bytes or "
                              "gpu_memory_utilization (or lower it for the other processes on this GPU)")
        return int(num_blocks)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    # Zeroed, not empty: the null block is read as padding by some kernels and
    # must hold finite values.
    return torch.zeros(shape, dtype=spec.dtype, device=device)
