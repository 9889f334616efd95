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

from dataclasses import dataclass, field

import torch

from pdd.transfer.base import Handoff, KVSender, TransferTarget


@dataclass
class _Shipment:
    target: TransferTarget
    src_block_ids: list[int]
    block_indices: list[int]


@dataclass
class _Outgoing:
    """One request's KV on its way out."""

    target: TransferTarget | None = None   # None: expected, the target comes later
    next_block: int = 0                    # first block index not yet sent complete
    # Expected only: its block table and the end (in tokens) of the steps
    # launched for it so far; once computed, its blocks are held (kept out of
    # reuse) and its first token kept until the target comes.
    table: list[int] = field(default_factory=list)
    end: int = 0
    computed: bool = False
    handoff: Handoff | None = None


class PrefillConnector:
    def __init__(self, sender: KVSender, kv_cache: torch.Tensor, block_size: int, kv=None):
        """kv: the engine's KVCacheManager (hold/release), for prompts computed before their target came."""
        self.sender = sender
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kv = kv
        self.requests: dict[str, _Outgoing] = {}
        self.plan: list[_Shipment] = []

    def __contains__(self, request_id: str) -> bool:
        """The connector still keeps something of the request (it is expected or not finished)."""
        return request_id in self.requests

    def expect(self, request_id: str) -> None:
        """A prompt starts computing; its target comes later (set_target)."""
        self.requests[request_id] = _Outgoing()

    def add(self, target: TransferTarget) -> None:
        self.requests[target.request_id] = _Outgoing(target, target.skip_blocks)
        self.sender.prepare(target)

    def set_target(self, target: TransferTarget) -> None:
        """An expected request's target: what its launched steps computed goes now
        (call between steps, on the engine thread)."""
        o = self.requests[target.request_id]
        o.target = target
        self.sender.prepare(target)
        indices = list(range(target.skip_blocks, -(-o.end // self.block_size)))
        if indices:
            src = [o.table[i] for i in indices]
            for layer in range(self.kv_cache.shape[0]):
                self.sender.send_layer(target, layer, self.kv_cache[layer], src, indices)
            self.sender.step_done()   # queued after the launched steps, before any later write
        o.next_block = max(target.skip_blocks, o.end // self.block_size)
        if o.computed:
            o.computed = False
            self.kv.release(o.table)
            self.finish(target.request_id, o.handoff)

    def begin_step(self, out, block_tables: list[list[int]]) -> None:
        """out: the step's SchedulerOutput."""
        plan = []
        for (req, num_new), start, table in zip(out.scheduled, out.starts, block_tables):
            o = self.requests.get(req.request_id)
            if o is None:
                continue
            end = start + num_new
            if o.target is None:
                o.table, o.end = list(table), end
                continue
            first = o.next_block
            last = (end - 1) // self.block_size
            indices = list(range(first, last + 1))
            if indices:
                plan.append(_Shipment(o.target, [table[i] for i in indices], indices))
            o.next_block = max(first, end // self.block_size)
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
        o = self.requests.get(request_id)
        if o is None:
            return
        if o.target is None:
            self.kv.hold(o.table)
            o.computed, o.handoff = True, handoff
            return
        del self.requests[request_id]
        self.sender.finish(request_id, blocks_skipped=o.target.skip_blocks, handoff=handoff)

    def abort(self, request_id: str) -> None:
        o = self.requests.pop(request_id, None)
        if o is not None and o.computed:
            self.kv.release(o.table)
        self.sender.abort(request_id)
