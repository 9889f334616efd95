"""Model runner: turns a scheduled batch into flat tensors, runs the model once,
samples. Owns the model and the KV pool of its device.

The batch is reordered decodes first (query length 1) then prefill chunks, the
layout the attention ops expect; results are mapped back to schedule order.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pdd.config import EngineConfig
from pdd.engine.sampler import SampleResult, SamplingBatch, sample
from pdd.engine.scheduler import SchedulerOutput
from pdd.kv.cache import KVCacheSpec, allocate_kv_cache
from pdd.model.config import ModelConfig
from pdd.model.loader import load_model
from pdd.ops.metadata import AttentionMetadata

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor    # [S] rows of hidden states to sample from
    sample_rows: list[int]          # schedule index of each sampled row
    sampling: SamplingBatch | None


@dataclass
class StepResult:
    # Per scheduled request, in schedule order: the sampled token, or None for a
    # prefill chunk that is not its prompt's last.
    tokens: list[int | None]
    logprobs: list[tuple | None]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model_dir: str,
                 device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = device
        self.dtype = dtype
        self.model = load_model(model_dir, model_cfg, device, dtype, cfg.load_format)
        self.kv_spec = KVCacheSpec.for_model(model_cfg, cfg.block_size, dtype)
        num_blocks = self.kv_spec.num_blocks_for(cfg, device)
        self.kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, device)
        self.model.set_kv_cache(self.kv_cache)
        log.info("KV pool: %d blocks x %d tokens (%.1f MiB) on %s", num_blocks, cfg.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, device)

        self.graphs = None

    def enable_cuda_graphs(self, max_model_len: int) -> None:
        """Capture decode graphs (CUDA only; needs the pool and max_model_len)."""
        if self.device.type != "cuda" or not self.cfg.cuda_graphs:
            return
        from pdd.engine.cuda_graphs import DecodeGraphs
        from pdd.ops import backend_for, reference

        if backend_for(self.kv_cache) is reference:
            # The reference attention gathers whole padded contexts: fine eagerly,
            # far too large when captured at max_model_len.
            log.warning("CUDA graphs off: Triton kernels unavailable, using the torch reference ops")
            return

        self.graphs = DecodeGraphs(self.model, self.device, min(self.cfg.max_num_seqs, 256), max_model_len,
                                   self.cfg.block_size)
        self.graphs.capture()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[2]

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepInputs:
        scheduled = out.scheduled
        # Decodes first; stable so prefill chunks keep their order.
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i][1] != 1)
        reqs = [scheduled[i][0] for i in order]
        q_lens = np.array([scheduled[i][1] for i in order], dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        seq_lens = starts + q_lens
        cu = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        token_ids = np.empty(num_tokens, dtype=np.int64)
        for r, s, c, n in zip(reqs, cu[:-1], starts, q_lens):
            token_ids[s:s + n] = r.all_token_ids[c:c + n]
        seq_of_token = np.repeat(np.arange(len(reqs)), q_lens)
        positions = np.arange(num_tokens) - cu[:-1][seq_of_token] + starts[seq_of_token]

        max_blocks = max(len(block_tables[i]) for i in order)
        table = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for row, i in enumerate(order):
            table[row, :len(block_tables[i])] = block_tables[i]
        bs = self.cfg.block_size
        slots = table[seq_of_token, positions // bs] * bs + positions % bs

        # Sample only where the step reaches the end of the request's known tokens.
        sample_rows = [row for row, r in enumerate(reqs) if seq_lens[row] == r.num_tokens]
        logits_indices = cu[1:][sample_rows] - 1
        sampling = None
        if sample_rows:
            sampling = SamplingBatch.build([reqs[row].sampling for row in sample_rows],
                                           [int(seq_lens[row]) for row in sample_rows], self.device)

        dev = self.device

        def t(a, dtype=torch.int64):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=t(slots), query_start_loc=t(cu, torch.int32), seq_lens=t(seq_lens, torch.int32),
            block_tables=t(table, torch.int32), num_decodes=int((q_lens == 1).sum()),
            max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
        return StepInputs(t(token_ids), t(positions), meta, t(logits_indices),
                          [order[row] for row in sample_rows], sampling)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        inputs = self.prepare(out, block_tables)
        if self.graphs is not None and self.graphs.can_run(inputs.input_ids, inputs.meta):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        tokens: list[int | None] = [None] * len(out.scheduled)
        logprobs: list[tuple | None] = [None] * len(out.scheduled)
        if inputs.sampling is None:
            return StepResult(tokens, logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        result = sample(logits, inputs.sampling)
        for i, tok in zip(inputs.sample_rows, result.tokens.tolist()):
            tokens[i] = tok
        if result.logprobs is not None:
            self._attach_logprobs(out, inputs, result, logprobs)
        return StepResult(tokens, logprobs)

    @staticmethod
    def _attach_logprobs(out, inputs: StepInputs, result: SampleResult, logprobs: list) -> None:
        lp = result.logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for row, i in enumerate(inputs.sample_rows):
            n = out.scheduled[i][0].sampling.logprobs
            if n is None:
                continue
            top = list(zip(top_ids[row][:n], top_lp[row][:n])) if n and top_ids else []
            logprobs[i] = (lp[row], top)
