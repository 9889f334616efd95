"""Prefill-side KV connector: which pages of which request go out after each layer.

The engine calls `begin_step` with the step's batch, the model calls
`save_layer(i)` as soon as layer i is written, and the connector hands the
sender that layer's pages of every block the step touched. A block that a
chunk only half filled is sent again, complete, with the next chunk; blocks
the decode worker already caches (`skip_blocks`) are never sent. Blocks the
prefill worker found in its own prefix cache are sent with the first step's
layers (they were computed earlier, but the decode worker lacks them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.transfer.base import KVSender, TransferTarget


@dataclass
class _Shipment:
    target: TransferTarget
    src_block_ids: list[int]
    block_indices: list[int]


class PrefillConnector:
    def __init__(self, sender: KVSender, kv_cache: torch.Tensor, block_size: int):
        self.sender = sender
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.targets: dict[str, TransferTarget] = {}
        self.next_block: dict[str, int] = {}   # first block index not yet sent complete
        self.plan: list[_Shipment] = []

    def add(self, target: TransferTarget) -> None:
        self.targets[target.request_id] = target
        self.next_block[target.request_id] = target.skip_blocks
        self.sender.prepare(target)

    def begin_step(self, out, block_tables: list[list[int]]) -> None:
        """out: the step's SchedulerOutput."""
        plan = []
        for (req, num_new), start, table in zip(out.scheduled, out.starts, block_tables):
            target = self.targets.get(req.request_id)
            if target is None:
                continue
            end = start + num_new
            first = self.next_block[req.request_id]
            last = (end - 1) // self.block_size
            indices = list(range(first, last + 1))
            if indices:
                plan.append(_Shipment(target, [table[i] for i in indices], indices))
            self.next_block[req.request_id] = max(first, end // self.block_size)
        self.plan = plan

    def save_layer(self, layer: int) -> None:
        for s in self.plan:
            self.sender.send_layer(s.target, layer, self.kv_cache[layer], s.src_block_ids, s.block_indices)

    def end_step(self) -> None:
        self.plan = []
        self.sender.step_done()

    def finish(self, request_id: str) -> None:
        """The prompt is computed (first token sampled): no more pages will follow."""
        target = self.targets.pop(request_id, None)
        self.next_block.pop(request_id, None)
        if target is not None:
            self.sender.finish(request_id, blocks_skipped=target.skip_blocks)

    def abort(self, request_id: str) -> None:
        self.targets.pop(request_id, None)
        self.next_block.pop(request_id, None)
        self.sender.abort(request_id)
