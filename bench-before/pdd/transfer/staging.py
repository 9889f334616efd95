"""A layer's pages on their way out of a sender: the destination block each
source block goes to (checked), and the pages gathered into memory the sender
owns, so that the engine may reuse its blocks whatever the data plane does.
Every sender backend uses it (local, tcp, cuda_ipc, nixl).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd import ops
from pdd.kv.layout import KVLayout
from pdd.transfer.base import TransferTarget
from pdd.transfer.receiver import pool_mismatch


def dst_blocks_for(layout: KVLayout, target: TransferTarget, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> list[int]:
    """The destination block of each source block; ValueError on a caller's mistake."""
    err = pool_mismatch(src_layer, layout, "source layer")
    if err:
        raise ValueError(err)
    if len(src_block_ids) != len(block_indices):
        raise ValueError(f"{len(src_block_ids)} source blocks but {len(block_indices)} block indices")
    n = len(target.dst_block_ids)
    bad = [i for i in block_indices if not 0 <= i < n]
    if bad:
        raise ValueError(f"block index {bad[0]} outside the target's {n} destination blocks")
    return [int(target.dst_block_ids[i]) for i in block_indices]


def index_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as a long tensor on `device`, without a host sync: a plain
    torch.tensor(..., device="cuda") copies from pageable memory and waits for
    the whole stream, which would stall the engine behind its own forward pass."""
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


@dataclass
class Staged:
    """One layer's pages in memory the sender owns, plus how to know they are ready."""

    pages: torch.Tensor
    ready: "torch.cuda.Event | None" = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def stage_pages(src_layer: torch.Tensor, src_block_ids: list[int], to_host: bool) -> Staged:
    """Gather pages into a fresh contiguous tensor (on the host if `to_host`).

    On CUDA the gather and the device->host copy are queued on the current
    stream, so the engine's later writes to those blocks are ordered after
    them; the copy lands in pinned memory and an event says when it is done.
    """
    pages = ops.gather_blocks(src_layer, index_tensor(src_block_ids, src_layer.device))
    if not to_host or not pages.is_cuda:
        return Staged(pages.contiguous())
    host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
    host.copy_(pages, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Staged(host, event)


def warm_up_staging(kv_cache: torch.Tensor, to_host: bool) -> None:
    """stage_pages once (the null block of one layer): its gather compiled now."""
    stage_pages(kv_cache[0], [0], to_host).wait()