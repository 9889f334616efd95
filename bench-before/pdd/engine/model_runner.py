"""Model runner: turns a scheduled batch into flat tensors, runs the model once,
samples. Owns the model and the KV pool of its device.

The batch is reordered decodes first (query length 1) then prefill chunks, the
layout the attention ops expect; results are mapped back to schedule order.

`launch` only queues work on the GPU and returns; `collect` waits for that
step's sampled tokens. Between the two the engine prepares and launches the
next step, so the host's work hides behind the GPU's. A token sampled by the
step in flight is fed to the next one on the GPU (`LaunchedStep.row_of`): the
host never waits for it to build the next batch.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdd.config import EngineConfig
from pdd.engine import prompt_logprobs
from pdd.engine.penalties import Penalties, penalty_row
from pdd.engine.prompt_logprobs import PromptRows, PromptScores
from pdd.engine.sampler import SampleResult, SamplingBatch, sample
from pdd.engine.scheduler import SchedulerOutput
from pdd.engine.staging import Staging
from pdd.kv.cache import KVCacheSpec, allocate_kv_cache, is_fp8, resolve_kv_cache_dtype
from pdd.kv.scales import KVScales
from pdd.model.config import ModelConfig
from pdd.model.loader import load_model
from pdd.ops.metadata import AttentionMetadata

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # [S] rows of hidden states to sample from; None: all, in order
    sample_rows: list[int]          # schedule index of each sampled row
    sampling: SamplingBatch | None
    sampled_ids: list[str]          # request id of each sampled row
    prompt: PromptRows | None = None  # rows scoring prompt tokens (prompt logprobs); None: none
    # (sampled row, request) of the rows whose request has a grammar (pdd.grammar)
    grammar_rows: list = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A step queued on the device; `ModelRunner.collect` turns it into a StepResult."""
    out: SchedulerOutput
    sample_rows: list[int]
    row_of: dict[str, int]               # request id -> row of `tokens` (sampled ones)
    tokens: torch.Tensor | None = None   # [S] sampled tokens, on the device
    tokens_host: torch.Tensor | None = None  # their copy into host memory, done at `done`
    result: SampleResult | None = None
    done: torch.cuda.Event | None = None  # recorded after the step's last work (CUDA only)
    seq: int = 0                           # the engine's launch count
    prompt: PromptRows | None = None
    prompt_scores: PromptScores | None = None

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


@dataclass
class StepResult:
    # Per scheduled request, in schedule order: the sampled token, or None for a
    # prefill chunk that is not its prompt's last.
    tokens: list[int | None]
    logprobs: list[tuple | None]
    # Per scheduled request: (first position, prompt logprob entries) for a
    # prompt chunk of a request that asks for them, else None.
    prompt_logprobs: list[tuple[int, list] | None] = field(default_factory=list)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model_dir: str,
                 device: torch.device, dtype: torch.dtype,
                 beside_kv: Callable[[KVCacheSpec, int], int] | None = None):
        """beside_kv(spec, max_tokens) -> bytes the worker allocates beside the
        KV pool on its device (`beside_kv_bytes`; max_tokens bounds one request)."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = device
        self.dtype = dtype
        self.model = load_model(model_dir, model_cfg, device, dtype, cfg.load_format)
        self.kv_spec = KVCacheSpec.for_model(model_cfg, cfg.block_size,
                                             resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype))
        max_tokens = cfg.max_model_len or model_cfg.max_position_embeddings
        self.beside_kv_bytes = beside_kv(self.kv_spec, max_tokens) if beside_kv is not None else 0
        num_blocks = self.kv_spec.num_blocks_for(cfg, device, self.beside_kv_bytes)
        self.kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, device)
        self.kv_scales = self._kv_scales()
        self.model.set_kv_cache(self.kv_cache, self.kv_scales)
        log.info("KV pool: %d blocks x %d tokens = %d tokens of %s (%.1f MiB) on %s", num_blocks, cfg.block_size,
                 num_blocks * cfg.block_size, str(self.kv_spec.dtype).removeprefix("torch."),
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, device)

        self.graphs = None
        self.staging = Staging(device)

    def _kv_scales(self) -> KVScales | None:
        """An FP8 cache's scales: the checkpoint's, else 1.0 (pdd.kv.scales says
        what that risks); None for a cache in the model's dtype."""
        scales = self.model.kv_scales
        if not is_fp8(self.kv_spec.dtype):
            if scales is not None:
                log.info("the checkpoint's FP8 KV scales are unused: engine.kv_cache_dtype is %s (a %s cache)",
                         self.cfg.kv_cache_dtype, str(self.kv_spec.dtype).removeprefix("torch."))
            return None
        if scales is None:
            log.info("FP8 KV cache: the checkpoint has no KV scales, using 1.0 "
                     "(K/V values beyond +-448 saturate)")
            return KVScales.unit(self.model_cfg.num_layers)
        if scales.num_layers != self.model_cfg.num_layers:
            raise ValueError(f"the checkpoint's KV scales cover {scales.num_layers} layers, "
                             f"the model has {self.model_cfg.num_layers}")
        log.info("FP8 KV cache: K and V scales from the checkpoint (%s; K %.4g..%.4g, V %.4g..%.4g)",
                 scales.identity(), min(scales.k), max(scales.k), min(scales.v), max(scales.v))
        return scales

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

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]],
                in_flight: LaunchedStep | None = None) -> StepInputs:
        scheduled = out.scheduled
        # Decodes first; stable so prefill chunks keep their order.
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i][1] != 1)
        reqs = [scheduled[i][0] for i in order]
        q_lens = np.array([scheduled[i][1] for i in order], dtype=np.int64)
        starts = np.array([out.starts[i] for i in order], dtype=np.int64)
        seq_lens = starts + q_lens
        cu = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        token_ids = np.zeros(num_tokens, dtype=np.int64)
        from_gpu, gpu_rows = [], []  # input tokens still in flight: where they go, where they are
        in_flight_row = {}           # batch row -> its row of the step in flight's sampled tokens
        for row, (r, s, c, n) in enumerate(zip(reqs, cu[:-1], starts, q_lens)):
            known = min(n, r.num_tokens - c)
            token_ids[s:s + known] = r.all_token_ids[c:c + known]
            if known < n:  # only ever the last input: the token the step in flight samples
                from_gpu.append(s + n - 1)
                gpu_rows.append(in_flight_row.setdefault(row, in_flight.row_of[r.request_id]))
        seq_of_token = np.repeat(np.arange(len(reqs)), q_lens)
        positions = np.arange(num_tokens) - cu[:-1][seq_of_token] + starts[seq_of_token]

        # On the GPU rounded up to 16 columns: the table's row stride is a kernel
        # argument, and Triton compiles one variant for a multiple of 16 and one for any other.
        max_blocks = max(len(block_tables[i]) for i in order)
        if self.device.type == "cuda":
            max_blocks = -(-max_blocks // 16) * 16
        table = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for row, i in enumerate(order):
            table[row, :len(block_tables[i])] = block_tables[i]
        bs = self.cfg.block_size
        slots = table[seq_of_token, positions // bs] * bs + positions % bs

        # Sample where the step reaches the end of the request's tokens.
        sample_rows = [row for row, i in enumerate(order) if out.samples[i]]
        logits_indices = cu[1:][sample_rows] - 1
        sampling = None
        if sample_rows:
            sampling = SamplingBatch.build([reqs[row].sampling for row in sample_rows],
                                           [int(seq_lens[row]) for row in sample_rows], self.device, self.staging,
                                           [reqs[row].stop_ids_banned_at(int(seq_lens[row])) for row in sample_rows])
            sampling.penalties = self._penalties(reqs, sample_rows, seq_lens, in_flight_row, in_flight)
        prompt = prompt_logprobs.plan([(order[row], reqs[row], int(cu[row]), int(starts[row]), int(q_lens[row]))
                                       for row in range(len(reqs)) if reqs[row].prompt_logprobs is not None],
                                      self.staging)

        input_ids, positions_d, slots_d, logits_d, from_gpu_d, gpu_rows_d = self.staging.upload(
            [token_ids, positions, slots, logits_indices, from_gpu, gpu_rows], torch.int64)
        cu_d, seq_lens_d, table_d = self.staging.upload([cu, seq_lens, table], torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slots_d, query_start_loc=cu_d, seq_lens=seq_lens_d, block_tables=table_d,
            num_decodes=int((q_lens == 1).sum()), max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()))
        if from_gpu:
            input_ids[from_gpu_d] = in_flight.tokens[gpu_rows_d]
        if len(sample_rows) == num_tokens:
            logits_d = None  # a pure decode step: every token is sampled (saves a gather)
        return StepInputs(input_ids, positions_d, meta, logits_d, [order[row] for row in sample_rows], sampling,
                          [reqs[row].request_id for row in sample_rows], prompt,
                          [(j, reqs[row]) for j, row in enumerate(sample_rows) if reqs[row].grammar is not None])

    def _penalties(self, reqs: list, sample_rows: list[int], seq_lens: np.ndarray, in_flight_row: dict[int, int],
                   in_flight: LaunchedStep | None) -> Penalties | None:
        """The penalty tensors of the sampled rows that have a penalty (None: none has)."""
        rows = {}
        for j, row in enumerate(sample_rows):
            pen = penalty_row(reqs[row], int(seq_lens[row]), in_flight_row.get(row))
            if pen is not None:
                rows[j] = pen
        if not rows:
            return None
        return Penalties.build(rows, self.model_cfg.vocab_size, self.device, self.staging,
                               in_flight.tokens if in_flight is not None else None)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, block_tables: list[list[int]],
               in_flight: LaunchedStep | None = None,
               layer_done: Callable[[int], None] | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling; returns without waiting for them.
        `layer_done`: the KV connector's per-layer hook (pdd.model.llama), for a
        step that ships pages; such a step runs eagerly (a graph replays no hook)."""
        inputs = self.prepare(out, block_tables, in_flight)
        if (layer_done is None and self.graphs is not None
                and self.graphs.can_run(inputs.input_ids, inputs.meta)):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, layer_done)
        step = LaunchedStep(out, inputs.sample_rows, {rid: j for j, rid in enumerate(inputs.sampled_ids)},
                            prompt=inputs.prompt)
        if inputs.prompt is not None:
            step.prompt_scores = prompt_logprobs.score(self.model.compute_logits, hidden, inputs.prompt)
        on_gpu = self.device.type == "cuda"
        if inputs.sampling is not None:
            rows = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
            logits = self.model.compute_logits(rows)
            if inputs.grammar_rows:
                inputs.sampling.allowed = self._grammar_mask(inputs, in_flight)
            step.result = sample(logits, inputs.sampling)
            step.tokens = step.tokens_host = step.result.tokens
            if on_gpu:
                step.tokens_host = torch.empty(step.tokens.shape, dtype=step.tokens.dtype, pin_memory=True)
                step.tokens_host.copy_(step.tokens, non_blocking=True)
        if on_gpu:
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def _grammar_mask(self, inputs: StepInputs, in_flight: LaunchedStep | None) -> torch.Tensor:
        """The sampled rows' allowed tokens, packed, on the device. The host
        computes them while the device runs this step's forward (queued before):
        a grammar's next mask depends on the token the step before sampled,
        which is on the host once that step is done, ahead of this forward."""
        from pdd.grammar import fill_masks

        if in_flight is not None and any(r.request_id in in_flight.row_of for _, r in inputs.grammar_rows):
            in_flight.wait()
        rows = []
        for j, req in inputs.grammar_rows:
            req.grammar.sync(req.output_token_ids, self._pending_token(req, in_flight))
            rows.append((req.grammar, j))
        return self.staging.upload([fill_masks(rows, len(inputs.sample_rows))], torch.int32)[0]

    @staticmethod
    def _pending_token(req, in_flight: LaunchedStep | None) -> int | None:
        """The token the step in flight sampled for `req`, if it will be
        appended (the request was not preempted since); None if none. The row
        under its id may be another request's: one aborted while that step was
        in flight, whose id came back with a new request."""
        row = in_flight.row_of.get(req.request_id) if in_flight is not None else None
        if row is None:
            return None
        i = in_flight.sample_rows[row]
        if in_flight.out.scheduled[i][0] is not req or in_flight.out.preemptions[i] != req.num_preemptions:
            return None
        return int(in_flight.tokens_host[row])

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step and return its sampled tokens in schedule order."""
        num = len(step.out.scheduled)
        tokens: list[int | None] = [None] * num
        logprobs: list[tuple | None] = [None] * num
        step.wait()
        prompt = ([None] * num if step.prompt is None
                  else prompt_logprobs.entries(step.prompt_scores, step.prompt, num))
        if step.result is None:
            return StepResult(tokens, logprobs, prompt)
        for i, tok in zip(step.sample_rows, step.tokens_host.tolist()):
            tokens[i] = tok
        if step.result.logprobs is not None:
            self._attach_logprobs(step, logprobs)
        return StepResult(tokens, logprobs, prompt)

    @staticmethod
    def _attach_logprobs(step: LaunchedStep, logprobs: list) -> None:
        out, result = step.out, step.result
        lp = result.logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for row, i in enumerate(step.sample_rows):
            n = out.scheduled[i][0].sampling.logprobs
            if n is None:
                continue
            top = list(zip(top_ids[row][:n], top_lp[row][:n])) if n and top_ids else []
            logprobs[i] = (lp[row], top)
