"""The engine: scheduler + model runner + KV manager behind add/step/abort.

    out = scheduler.schedule()           which requests, how many tokens each
    step = runner.launch(out, ...)       one forward over the mixed batch, queued
    runner.collect(previous step)        the step before it: wait for its tokens
    scheduler.update_from_output(...)    append tokens, finish, free

Every role (colocated, prefill, decode) runs this same loop. With async
scheduling (the default) a step() call schedules and launches step N before it
waits for step N-1, so the host's scheduling, input preparation and output
handling overlap the GPU's work instead of leaving it idle; the outputs a call
returns are those of the step launched by the call before. A step that finds
nothing to schedule still returns the results of the one in flight.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdd import ops
from pdd.api import InvalidRequest, SamplingParams, StepSample, query_key_pairs
from pdd.config import EngineConfig
from pdd.engine.grammar_jobs import GrammarJobs
from pdd.engine.model_runner import ModelRunner
from pdd.engine.request import Request, RequestStatus
from pdd.engine.scheduler import Scheduler
from pdd.kv.cache import KVCacheSpec
from pdd.kv.manager import KVCacheManager
from pdd.model.config import ModelConfig
from pdd.model.make_model import resolve_model_dir

if TYPE_CHECKING:
    from pdd.grammar import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    # (logprob of the sampled token, [(token id, logprob), ...]) per new token
    logprobs: list = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Where new_token_ids[0] stands in the request's whole output, counting
    # tokens produced before this engine saw it.
    position: int = 0
    # With the first token, for a request that asks (SamplingParams.prompt_logprobs):
    # an entry per prompt position but the first (pdd.engine.prompt_logprobs).
    prompt_logprobs: list | None = None
    # finish_reason "error": why the request cannot go on (its grammar failed);
    # new_token_ids then holds no token.
    error: str | None = None
    # The error is the request's own (its grammar did not compile, or not within
    # its budget): the client is told 400, not that the server failed.
    invalid: bool = False


def _is_token(t, vocab: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_step_budget(device: torch.device) -> int:
    """max_num_batched_tokens when the config leaves it out (see EngineConfig)."""
    return 8192 if device.type == "cuda" else 2048


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32  # half precision on CPU is slow and loses accuracy
    return torch.bfloat16 if model_cfg.dtype == "float32" else getattr(torch, model_cfg.dtype)


class LLMEngine:
    def __init__(self, cfg: EngineConfig | None = None,
                 beside_kv: Callable[[KVCacheSpec, int], int] | None = None):
        """beside_kv: what the worker allocates beside the KV pool (ModelRunner)."""
        self.cfg = cfg = (cfg or EngineConfig()).validate()
        self.model_dir = resolve_model_dir(cfg.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(cfg.device)
        if cfg.max_num_batched_tokens is None:
            self.cfg = cfg = dataclasses.replace(cfg, max_num_batched_tokens=default_step_budget(self.device))
        if self.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)   # process-wide: one engine per worker process
        self._use_device()
        self.dtype = resolve_dtype(cfg.dtype, self.model_config, self.device)
        torch.manual_seed(cfg.seed)
        self.runner = ModelRunner(cfg, self.model_config, str(self.model_dir), self.device, self.dtype, beside_kv)
        self.kv = KVCacheManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.kv)
        pool_tokens = self.kv.pool.num_usable_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, pool_tokens)
        if self.model_config.sliding_window:
            # Sliding-window attention is not implemented: stay within the window,
            # where full attention computes the same thing.
            self.max_model_len = min(self.max_model_len, self.model_config.sliding_window)
        self.last_step = StepSample()
        self.connector = None
        self.in_flight = None  # the launched step whose results are not taken yet
        self._batch = None     # what the running step() call scheduled (see abort_failed_step)
        self.steps_done = 0    # launched steps known to have finished on the device
        # Requests waiting for their grammars (pdd.engine.grammar_jobs): not scheduled until compiled.
        c = self.cfg
        self.grammar_jobs = GrammarJobs(self.model_dir, self.model_config.vocab_size,
                                        tuple(self.model_config.eos_token_ids), c.grammar_compile_threads,
                                        c.grammar_cache_bytes, c.grammar_compile_timeout_s)
        self.runner.enable_cuda_graphs(self.max_model_len)

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams | None = None, block_hashes: list[int] | None = None,
                     **kwargs) -> Request:
        """A checked Request, or InvalidRequest naming the field. Everything is
        checked here, whoever sent it: one bad value must fail its own request,
        never a whole batch on the device. `block_hashes`: the prompt's, if the
        caller has them (the router computes them once for every worker)."""
        # A copy: validate() normalises in place, and the caller's object may be shared.
        sampling = dataclasses.replace(sampling or SamplingParams()).validate()
        if not prompt_token_ids:
            raise InvalidRequest("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not _is_token(t, vocab)), None)
        if bad is not None:
            raise InvalidRequest(f"prompt: token id {bad!r} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in sampling.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if sampling.top_k >= vocab:
            sampling.top_k = 0  # keeping every token is no filter at all
        num_prior = kwargs.get("num_prior_output_tokens", 0)
        if not 0 <= num_prior < len(prompt_token_ids):
            raise InvalidRequest(f"num_prior_output_tokens: must be in [0, {len(prompt_token_ids)}) (they are "
                                 f"the tail of the prompt), got {num_prior}")
        if kwargs.get("prefill_chunk", 0) < 0:
            raise InvalidRequest(f"prefill_chunk: must be >= 0 (0: the engine's chunk_size), "
                                 f"got {kwargs['prefill_chunk']}")
        total = len(prompt_token_ids) + sampling.max_tokens - num_prior
        if len(prompt_token_ids) >= self.max_model_len or total > self.max_model_len:
            raise InvalidRequest(
                f"prompt: this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(prompt_token_ids)} prompt tokens + max_tokens {sampling.max_tokens} were requested; "
                "shorten the prompt or lower max_tokens")
        req = Request(request_id, list(prompt_token_ids), sampling,
                      eos_token_ids=self.model_config.eos_token_ids, **kwargs)
        if block_hashes:
            full = len(prompt_token_ids) // self.cfg.block_size
            if len(block_hashes) != full:
                raise InvalidRequest(f"block_hashes: {len(block_hashes)} hashes for a prompt of "
                                     f"{len(prompt_token_ids)} tokens, which has {full} full blocks of "
                                     f"{self.cfg.block_size}")
            req.block_hashes = list(block_hashes)
        if sampling.structured_output is not None:   # last: nothing may refuse it after its compile starts
            self.grammar_jobs.start(req)
        return req

    @property
    def grammar_compiler(self) -> "GrammarCompiler | None":
        return self.grammar_jobs.compiler

    def _attach_grammars(self) -> list[EngineOutput]:
        """Between steps: what became of the compiles (pdd.engine.grammar_jobs).
        The outputs of the requests that ended."""
        outputs = []
        held = lambda req: self.scheduler.requests.get(req.request_id) is req   # noqa: E731 (not aborted)
        for req, error in self.grammar_jobs.settle(held):
            if error is not None:
                outputs.append(self._fail(req, error, invalid=True))
            elif req.output_token_ids and req.check_stop():   # a first token it got meanwhile (KV landed) ends it
                self.scheduler.finish(req)
                outputs.append(self._finished_output(req))
        return outputs

    def _fail(self, req: Request, error: str, invalid: bool = False) -> EngineOutput:
        self.scheduler.abort(req.request_id)
        req.status, req.error = RequestStatus.FINISHED_ERROR, error
        out = self._finished_output(req)
        out.invalid = invalid
        return out

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar's compile."""
        return len(self.grammar_jobs)

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until a pending compile ends, at most timeout_s (an offline
        caller with nothing else to step on)."""
        self.grammar_jobs.wait(timeout_s)

    def flush_grammar_cache(self) -> int:
        """Forget the compiled grammars (cache flush); how many there were."""
        return self.grammar_jobs.flush()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None, **kwargs) -> Request:
        req = self.make_request(request_id, prompt_token_ids, sampling, **kwargs)
        self.scheduler.add_request(req)
        return req

    # ------------------------------------------------------------ warm-up

    def warm_up(self) -> None:
        """Run short synthetic requests through the engine's own steps, so the
        Triton kernels of eager (prefill, mixed) steps are compiled before real
        requests wait on them (seconds of TTFT on a fresh H200 worker otherwise),
        then the variants of sampling, attention's split merge and the decode
        GEMV that those steps do not all reach. For an idle engine that serves
        nothing yet.

        Leaves no trace: prefix caching is off while it runs (nothing is looked
        up, counted, published as a cached block or reported as a recent hash),
        every block goes back to the free queue in its old order, and the
        step and preemption counters are restored."""
        if self.has_unfinished() or self.scheduler.requests or self.connector is not None:
            raise RuntimeError("warm_up() is for an idle engine that serves nothing yet")
        t0 = time.perf_counter()
        max_tokens = max(1, min(4, self.max_model_len - 1))
        phases = self._warm_up_plan(max_tokens)
        if not phases:
            log.info("engine warm-up skipped: no room for its prompts")
            return
        # A fixed seed: a missing one would be drawn from the process's random state.
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
        rng = random.Random(0)
        vocab = self.model_config.vocab_size
        pool, sched = self.kv.pool, self.scheduler
        free_order, freed_at = list(pool.free_queue), list(pool.freed_at)
        launched, preemptions = pool.steps_launched, sched.num_preemptions
        prefix_caching, self.kv.enable_prefix_caching = self.kv.enable_prefix_caching, False
        num = 0
        try:
            for phase in phases:
                # Each group joins after one step of the groups before it: its
                # prefill shares steps with their decodes (mixed steps).
                for group in phase:
                    for n in group:
                        self.add_request(f"warm-up-{num}", [rng.randrange(vocab) for _ in range(n)], sp)
                        num += 1
                    self.step()
                while self.has_unfinished():
                    self.step()
        finally:
            self.kv.enable_prefix_caching = prefix_caching
        ops.warm_up_sampling(self.model_config.vocab_size, self.cfg.max_num_seqs, self.device)
        mc = self.model_config
        ops.warm_up_attention(mc.num_heads, mc.num_kv_heads, mc.head_dim, self.dtype, self.max_model_len, self.device)
        attn = self.runner.model.model.layers[0].self_attn
        ops.warm_up_split_prefill(mc.num_heads, attn.kv_cache, self.dtype, self.max_model_len, attn.kv_scale)
        ops.warm_up_gemv(self.runner.model.gemv_sites(), self.dtype, self.device)
        self.wait_in_flight()
        steps = pool.steps_launched - launched
        assert pool.num_free_blocks == len(free_order) and not sched.requests, "warm-up left state behind"
        # Nothing runs any more (wait_in_flight): the counters can go back.
        pool.free_queue.clear()
        pool.free_queue.update(dict.fromkeys(free_order))
        pool.freed_at[:] = freed_at
        pool.steps_launched = self.steps_done = launched
        sched.num_preemptions = preemptions
        self.last_step = StepSample()
        log.info("engine warm-up: %d requests, %d steps in %.2f s", num, steps, time.perf_counter() - t0)

    def watch_compiles(self) -> None:
        """From now on, log each Triton kernel compiled in this process and count
        it (pdd.ops.compiles_reported): called once the warm-ups are done (the
        engine's, and the data plane's page copies), each one is a stall of every
        request on the worker, and its specialization says which argument made it."""
        if self.device.type == "cuda":
            ops.report_compiles(lambda kernel: log.warning(
                "a Triton kernel was compiled in service (every request here waited; the warm-up "
                "did not cover it): %s", kernel[:3000]))

    def _warm_up_plan(self, max_tokens: int) -> list[list[list[int]]]:
        """Prompt lengths: phases (each runs to completion before the next) of
        groups (each added one step after the one before, so its prefill shares
        a step with their decodes). Empty if nothing fits."""
        cfg, bs = self.cfg, self.cfg.block_size
        limit = self.max_model_len - max_tokens   # longest prompt make_request accepts
        if limit < 1:
            return []
        chunk = min(cfg.chunk_size, cfg.max_num_batched_tokens)
        n = max(1, min(cfg.max_num_batched_tokens // chunk, cfg.max_num_seqs - 1, 8))
        # A step of full prefill chunks (lengths off the multiples of 16, as real
        # prompts are), then their decodes beside the chunks of a prompt several
        # chunks long: the large shapes of a busy step.
        phases = [[[chunk - i for i in range(n)] + [3 * chunk + chunk // 2 + 1]]]
        # The largest step: a prompt of the whole budget alone (a prefill
        # worker's usual step, chunk_only_beside_decodes): memory it lacks shows
        # at start, not on the first long prompt in service. Its last 17 tokens
        # (at least 2k deep: whole budgets before them) follow in a step of their
        # own, a short chunk deep in a prompt, whose attention splits its keys
        # (pdd.ops, _prefill_num_splits): compiled in service, that path stalled
        # a worker's steps for 2 s on H200.
        budget = cfg.max_num_batched_tokens
        phases.append([[max(1, -(-2048 // budget)) * budget + 17]])
        # Triton compiles a kernel per specialization of its arguments (a pointer
        # 16-byte aligned or not, an int equal to 1, a multiple of 16 or neither),
        # and the attention kernels' vary with the batch: the block-table width
        # (1, a multiple of 16, other), the number of sequences, and whether
        # decode attention splits the KV (contexts beyond ~128 tokens).
        # So: each context class, in prefill-only and mixed steps of 2, 3 and 4
        # sequences.
        for ctx in (bs - max_tokens, 6 * bs + 3, 16 * bs - max_tokens, 20 * bs + 3):
            phases += [[[ctx] * 3, [ctx]], [[ctx] * 2, [ctx]]]
        return [p for p in (self._fit_phase(p, limit, max_tokens) for p in phases) if p]

    def _fit_phase(self, phase: list[list[int]], limit: int, max_tokens: int) -> list[list[int]]:
        """The phase with every prompt resident at once within the free blocks (no
        preemption, nothing waiting): lengths clipped, halved, then prompts dropped."""
        def blocks() -> int:
            return sum(self.kv.blocks_needed(x + max_tokens) for g in phase for x in g)
        phase = [[max(1, min(x, limit)) for x in g] for g in phase]
        while phase and blocks() > self.kv.num_free_blocks:
            if any(x > 1 for g in phase for x in g):
                phase = [[max(1, x // 2) for x in g] for g in phase]
            else:
                phase[-1].pop()
                phase = [g for g in phase if g]
        return phase

    # ------------------------------------------------------------ disaggregation

    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                block_hashes: list[int] | None = None) -> tuple[list[int], int] | None:
        """Decode role: hold blocks for a prompt computed elsewhere. Returns
        (block ids, tokens already cached here) or None when out of blocks."""
        req = self.make_request(request_id, prompt_token_ids, sampling, block_hashes)
        blocks = self.scheduler.reserve(req)
        if blocks is None:
            return None
        # A block freed while a step was in flight (its request aborted, preempted
        # or stopped) may still be written by that step; the KV coming for it is
        # written by another process or thread, in no order with our stream.
        if any(self.kv.pool.freed_at[b] > self.steps_done for b in blocks):
            self.wait_in_flight()
        return list(blocks), req.num_cached_tokens

    def kv_ready(self, request_id: str, first_token: int) -> EngineOutput | None:
        """Decode role: the KV has landed. Returns an output only when the first
        token already ends the request (nothing left to decode)."""
        self._check_first_token(first_token)
        return self._finished_output(self.scheduler.kv_ready(request_id, first_token))

    def prefill_locally(self, request_id: str, first_token: int | None = None) -> EngineOutput | None:
        """Decode role: the KV will not come; prefill here (after `first_token` if
        the client has it). Returns an output only when that token ends the request."""
        if first_token is not None:
            self._check_first_token(first_token)
        return self._finished_output(self.scheduler.compute_locally(request_id, first_token))

    def _check_first_token(self, token: int) -> None:
        # It becomes an input of the next step: out of the vocabulary, it would
        # fail the whole batch in the embedding lookup.
        vocab = self.model_config.vocab_size
        if not _is_token(token, vocab):
            raise InvalidRequest(f"first_token: token id {token!r} is outside the vocabulary [0, {vocab})")

    @staticmethod
    def _finished_output(req: Request) -> EngineOutput | None:
        if not req.status.finished:
            return None
        return EngineOutput(req.request_id, [], True, req.finish_reason, [], req.num_prompt_tokens,
                            req.num_cached_tokens, req.num_output_tokens, error=req.error)

    def attach_connector(self, connector) -> None:
        """Prefill side: a KV connector sees each step's batch and every layer as
        it is written (layer-wise transfer while the forward continues)."""
        self.connector = connector

    def abort_request(self, request_id: str) -> bool:
        if self.scheduler.abort(request_id) is None:
            return False
        if self.in_flight is not None and all(r.status.finished for r, _ in self.in_flight.out.scheduled):
            self.in_flight = None  # nothing in it to wait for: its results would all be dropped
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def wait_in_flight(self) -> None:
        """Block until the device has finished every launched step (also one
        whose results were dropped: it may still write freed blocks)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.steps_done = self.kv.pool.steps_launched

    def _use_device(self) -> None:
        """Make our GPU the calling thread's current device: kernels (Triton's
        included), streams and graph capture all follow it, and a worker on
        cuda:1 must not launch on cuda:0."""
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            elif torch.cuda.current_device() != self.device.index:
                torch.cuda.set_device(self.device)

    def step(self) -> list[EngineOutput]:
        self._use_device()  # steps may come from another thread than __init__
        t0 = time.perf_counter()
        self._batch = None   # stays None if scheduling raises (see abort_failed_step)
        ended = self._attach_grammars() if len(self.grammar_jobs) else []
        out = self._batch = self.scheduler.schedule()
        launched = self._launch(out) if out else None
        # The step in flight stays in_flight until its results are taken: if
        # taking them fails, abort_failed_step still knows its requests.
        outputs = ended + (self._take_results(self.in_flight) if self.in_flight is not None else [])
        self.in_flight = launched
        if launched is not None and not self.cfg.async_scheduling:
            outputs += self._take_results(launched)
            self.in_flight = None
        self.last_step = StepSample(
            latency_s=time.perf_counter() - t0, num_tokens=out.num_tokens,
            num_decodes=sum(1 for _, n in out.scheduled if n == 1),
            prefill_chunks=[n for _, n in out.scheduled if n > 1],
            prefill_pairs=sum(query_key_pairs(start, n) for (_, n), start in zip(out.scheduled, out.starts)
                              if n > 1))
        return outputs

    def abort_failed_step(self) -> list[str]:
        """step() raised: abort the requests whose state that leaves unknown
        (KV half written, sampled tokens lost) and return their ids. Those are
        the requests of the batch it scheduled (every running request if
        scheduling itself failed) and of the step in flight. Waits for the
        device first, so a broken device raises here, not in the next step."""
        at_risk = self.scheduler.running if self._batch is None else [r for r, _ in self._batch.scheduled]
        ids = [r.request_id for r in at_risk]
        if self.in_flight is not None:
            ids += [r.request_id for r, _ in self.in_flight.out.scheduled]
        self._batch = self.in_flight = None
        self.wait_in_flight()
        return [rid for rid in dict.fromkeys(ids) if self.abort_request(rid)]

    def _launch(self, out):
        tables = [self.kv.block_ids(r) for r, _ in out.scheduled]
        layer_done = None
        if self.connector is not None:
            self.connector.begin_step(out, tables)
            # Only steps that ship pages are hooked: a colocated worker that also
            # prefills for others keeps its CUDA graphs for the decode steps.
            layer_done = self.connector.save_layer if self.connector.plan else None
        self.kv.pool.steps_launched += 1
        try:
            step = self.runner.launch(out, tables, self.in_flight, layer_done)
            step.seq = self.kv.pool.steps_launched
            return step
        finally:
            if self.connector is not None:
                self.connector.end_step()

    def _take_results(self, step) -> list[EngineOutput]:
        result = self.runner.collect(step)
        self.steps_done = step.seq
        out = step.out
        logprobs = {r.request_id: lp for (r, _), lp in zip(out.scheduled, result.logprobs) if lp}
        outputs = []
        for req in self.scheduler.update_from_output(out, result.tokens, result.prompt_logprobs):
            if req.error:   # its last token is not one the grammar allows: not sent
                outputs.append(EngineOutput(req.request_id, [], True, req.finish_reason,
                                            num_prompt_tokens=req.num_prompt_tokens, error=req.error))
                continue
            lp = logprobs.get(req.request_id)
            outputs.append(EngineOutput(
                req.request_id, [req.output_token_ids[-1]], req.status.finished, req.finish_reason,
                [lp] if lp else [], req.num_prompt_tokens, req.num_cached_tokens, req.num_output_tokens - 1,
                req.take_prompt_logprobs()))
        return outputs
