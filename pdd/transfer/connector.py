"""Prefill-side KV connector: which pages of which request go out after each layer.

The engine calls `begin_step` with the step's batch, the model calls
`save_layer(i)` as soon as layer i is written, and the connector hands the
sender that layer's pages of every block the step touched. A block that a
chunk only half filled is sent again, complete, with the next chunk; blocks
the decode worker already caches (`skip_blocks`) are never sent. Blocks the
prefill worker found in its own prefix cache are sent with the first step's
layers (they were computed earlier, but the decode worker lacks them).

Where the pages go may be learnt after the prompt started computing: the
router hands a prompt to the prefill worker while the decode worker reserves
its blocks (the reservation is off the time to first token), so a request is
`expect`ed first and gets its target later. When the target arrives (between
steps), every block of the steps launched so far goes at once, all layers,
queued after those steps' writes; later chunks go layer by layer as usual. If
the prompt was all computed before its target came, its blocks were held
(kept out of reuse) meanwhile, and are let go once sent.

`finish` hands the sender the first token (a Handoff): the request's last
data-plane message carries it, and the decode worker starts on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.transfer.base import Handoff, KVSender, TransferTarget


@dataclass
class _Shipment:
    target: TransferTarget
    src_block_ids: list[int]
    block_indices: list[int]


class PrefillConnector:
    def __init__(self, sender: KVSender, kv_cache: torch.Tensor, block_size: int, kv=None):
        """kv: the engine's KVCacheManager (hold/release), for prompts computed before their target came."""
        self.sender = sender
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kv = kv
        self.targets: dict[str, TransferTarget] = {}
        self.next_block: dict[str, int] = {}   # first block index not yet sent complete
        # Expected requests (no target yet): their block table and the end (in
        # tokens) of the steps launched for them so far.
        self.expected: dict[str, tuple[list[int], int]] = {}
        # Expected and computed: blocks kept out of reuse, and the first token, until the target comes.
        self.held: dict[str, Handoff | None] = {}
        self.plan: list[_Shipment] = []

    def expect(self, request_id: str) -> None:
        """A prompt starts computing; its target comes later (set_target)."""
        self.expected[request_id] = ([], 0)

    def add(self, target: TransferTarget) -> None:
        self.targets[target.request_id] = target
        self.next_block[target.request_id] = target.skip_blocks
        self.sender.prepare(target)

    def set_target(self, target: TransferTarget) -> None:
        """An expected request's target: what its launched steps computed goes now
        (call between steps, on the engine thread)."""
        rid = target.request_id
        table, end = self.expected.pop(rid)
        self.add(target)
        indices = list(range(target.skip_blocks, -(-end // self.block_size)))
        if indices:
            src = [table[i] for i in indices]
            for layer in range(self.kv_cache.shape[0]):
                self.sender.send_layer(target, layer, self.kv_cache[layer], src, indices)
            self.sender.step_done()   # queued after the launched steps, before any later write
        self.next_block[rid] = max(target.skip_blocks, end // self.block_size)
        if rid in self.held:
            handoff = self.held.pop(rid)
            self.kv.release(table)
            self.finish(rid, handoff)

    def begin_step(self, out, block_tables: list[list[int]]) -> None:
        """out: the step's SchedulerOutput."""
        plan = []
        for (req, num_new), start, table in zip(out.scheduled, out.starts, block_tables):
            rid = req.request_id
            if rid in self.expected:
                self.expected[rid] = (list(table), start + num_new)
            target = self.targets.get(rid)
            if target is None:
                continue
            end = start + num_new
            first = self.next_block[rid]
            last = (end - 1) // self.block_size
            indices = list(range(first, last + 1))
            if indices:
                plan.append(_Shipment(target, [table[i] for i in indices], indices))
            self.next_block[rid] = max(first, end // self.block_size)
        self.plan = plan

    def save_layer(self, layer: int) -> None:
        for s in self.plan:
            self.sender.send_layer(s.target, layer, self.kv_cache[layer], s.src_block_ids, s.block_indices)

    def end_step(self) -> None:
        self.plan = []
        self.sender.step_done()

    def finish(self, request_id: str, handoff: Handoff | None = None) -> None:
        """The prompt is computed (`handoff`: its first token): no more pages will
        follow. Without a target yet, its blocks are held until the target comes."""
        if request_id in self.expected:
            self.kv.hold(self.expected[request_id][0])
            self.held[request_id] = handoff
            return
        target = self.targets.pop(request_id, None)
        self.next_block.pop(request_id, None)
        if target is not None:
            self.sender.finish(request_id, blocks_skipped=target.skip_blocks, handoff=handoff)

    def abort(self, request_id: str) -> None:
        self.targets.pop(request_id, None)
        self.next_block.pop(request_id, None)
        expected = self.expected.pop(request_id, None)
        if request_id in self.held:
            del self.held[request_id]
            self.kv.release(expected[0])
        self.sender.abort(request_id)
