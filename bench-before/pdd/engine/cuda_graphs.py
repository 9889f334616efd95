"""CUDA graphs for decode steps.

A decode step of a small batch is launch-bound: hundreds of small kernels,
each costing more to launch than to run. Each batch-size bucket's forward is
captured once; a step copies its inputs into the static buffers the graph
reads, pads the batch to the bucket (padding rows read and write only the
null block) and replays. Mixed prefill/decode steps run eagerly.

The captured metadata fixes the host-side ints the kernels launch with
(`max_seq_len` = the engine's max_model_len), so a replay never depends on the
batch's actual context lengths beyond the device tensors.
"""
from __future__ import annotations

import logging

import torch

from pdd.ops.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return [s for s in sizes if s <= max_bs]


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_bs: int, max_model_len: int, block_size: int):
        self.model = model
        self.sizes = bucket_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        # A multiple of 16, as the eager steps' tables (pdd.engine.model_runner):
        # one compiled attention variant, and every eager table fits this one.
        self.max_blocks = -(-max_model_len // (16 * block_size)) * 16
        self.max_model_len = max_model_len
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(self.max_bs, **i64)
        self.positions = torch.zeros(self.max_bs, **i64)
        self.slot_mapping = torch.zeros(self.max_bs, **i64)
        self.seq_lens = torch.ones(self.max_bs, **i32)
        self.block_tables = torch.zeros(self.max_bs, self.max_blocks, **i32)
        self.query_start_loc = torch.arange(self.max_bs + 1, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first: the others reuse its memory pool
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            self.model(*args)  # warm-up: kernels compiled, allocator primed
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        n = input_ids.shape[0]
        return (meta.num_decodes == meta.num_seqs == n and n <= self.max_bs
                and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        if bs > n:  # padding rows: one token of context in the null block
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
