"""Engine step times on a GPU against the roofline (docs/design.md, "Performance model").

decode: B requests with a context of --context tokens each, all decoding; a
step's floor is (weight bytes + KV bytes read) / HBM bandwidth, counting only the
bytes a step reads (an untied embedding table is looked up, not read whole).
prefill: one prompt of N tokens in one step; the floor is
(2 * params * N + attention FLOPs) / matmul peak. A mixture of experts counts
its active parameters (a token's top-k experts) in both: a decode step reads
the experts its batch chose in expectation, a prompt token multiplies by k.
Times are whole engine steps (schedule, inputs, forward, sample, outputs): the
median gap between consecutive step() returns, steps back to back, which is
what a decoding request waits per token.

    pdd bench gpu --model conf/models/llama-3.1-8b --load-format dummy

An FP8 checkpoint (`pdd make-model --preset 8b --fp8 block --out DIR`, then
`--model DIR --load-format auto`, or its config.json alone with dummy weights)
is measured against the bytes it reads (1 byte per FP8 weight, plus scales) and
its prefill against the FP8 GEMM peak (measured on the lent H200, fixed so
runs compare). What a kernel developer adds to this (the matmul peaks measured
again, the captured forward alone, a kernel profile, prompt chunks beside
decodes) is benchmarks.gpu_steps, outside the wheel: it runs `main` with an
Extension.
"""
from __future__ import annotations

import statistics
import time
from typing import Protocol

import torch

from pdd.bench.commands import write_json

class Extension(Protocol):
    """More figures from the same run (benchmarks.gpu_steps)."""
    def blocks_needed(self, args, max_batched: int) -> int: ...        # KV blocks its own runs take
    def while_decoding(self, engine, batch: int) -> dict: ...          # while a timed decode batch still runs
    def after(self, engine, out: dict) -> None: ...                    # once the decode and prefill rows are in


HBM_BYTES_S = 4.26e12      # measured device-to-device copy on the lent H200 (docs/design.md)
MATMUL_FLOP_S = 796e12     # measured bf16 matmul on the lent H200
FP8_MATMUL_FLOP_S = 1465e12  # torch._scaled_mm (e4m3, tensorwise), 8192^3, on the lent H200; each run prints its own


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter (tied ones once), FP8 weights at one byte each
    plus their scales."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes one decode step reads: every layer and the LM head, but of an
    untied embedding table only the batch's rows (a lookup, not a pass over it),
    and of a sparse layer's experts only those its tokens chose."""
    table = model.model.embed_tokens.weight
    row_bytes = table.shape[1] * table.element_size()
    total = weight_bytes(model) - unread_expert_bytes(model, batch)
    if table is model.lm_head.weight:
        return total
    return total - table.shape[0] * row_bytes + batch * row_bytes


def unread_expert_bytes(model: torch.nn.Module, batch: int) -> float:
    """Bytes of the experts a decode step of `batch` tokens leaves unread: each
    sparse layer reads E(1 - (1 - k/E)^batch) experts in expectation
    (ModelConfig.expected_experts_read; random prompts route near uniformly)."""
    cfg, layers = model.config, model.moe_layers()
    if not layers:
        return 0.0
    unread = cfg.moe.num_experts - cfg.expected_experts_read(batch)
    per_expert = sum(p.numel() * p.element_size() for p in layers[0].experts.parameters()) / cfg.moe.num_experts
    return len(layers) * per_expert * unread


def is_fp8(model: torch.nn.Module) -> bool:
    from pdd.model.fp8 import Fp8Linear
    from pdd.model.moe import Experts

    return any(isinstance(m, Fp8Linear) or (isinstance(m, Experts) and m.fp8) for m in model.modules())


def make_engine(args, max_batched: int, num_blocks: int):
    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, device="cuda",
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  num_blocks=num_blocks, max_num_seqs=max(256, max_batched),
                                  max_num_batched_tokens=max_batched,
                                  # with the warm-up, a worker's chunk (its shapes are what it compiles)
                                  chunk_size=EngineConfig.chunk_size if args.warm_up else max_batched,
                                  enable_prefix_caching=False, max_model_len=32768,
                                  cuda_graphs=not args.no_cuda_graphs,
                                  async_scheduling=not args.no_async_scheduling))


def timed_steps(engine, n: int) -> list[float]:
    """Time between consecutive step() returns, steps back to back: a call
    returns when the device has finished a step (its tokens are out), so this is
    the rate at which a request gets tokens. With async scheduling a step's host
    work overlaps the previous step's device work; a sync around each step would
    hide that and count the host time again."""
    engine.step()  # the pipeline holds one step from here on
    engine.step()
    marks = [time.perf_counter()]
    for _ in range(n):
        engine.step()
        marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


def bench_decode(args, engine, batch: int, context: int, extension: Extension | None = None) -> dict:
    from pdd.api import SamplingParams

    g = torch.Generator().manual_seed(batch)
    # Nobody may finish inside the measured steps (the batch would shrink):
    # requests decode while the later ones prefill, then the timed and profiled steps.
    max_tokens = decode_tokens_needed(args, engine.cfg.max_num_batched_tokens, batch)
    vocab = min(32000, engine.model_config.vocab_size)
    reqs = [engine.add_request(f"d{batch}-{i}", torch.randint(0, vocab, (context,), generator=g).tolist(),
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i in range(batch)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    tokens_before = sum(r.num_tokens for r in reqs)
    times = timed_steps(engine, args.steps)
    tokens_after = sum(r.num_tokens for r in reqs)
    assert all(not r.status.finished for r in reqs), "a request finished inside the measured steps"
    more = extension.while_decoding(engine, batch) if extension is not None else {}
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    model, spec = engine.runner.model, engine.runner.kv_spec
    # KV each step reads (in the cache's dtype: FP8 halves it): the batch's mean
    # total context over the timed steps.
    kv_bytes = (tokens_before + tokens_after) / 2 * spec.bytes_per_token
    step = statistics.median(times)
    floor = (decode_weight_bytes(model, batch) + kv_bytes) / HBM_BYTES_S
    deciles = statistics.quantiles(times, n=10)
    return {"batch": batch, "context": context, "step_ms": 1e3 * step, "floor_ms": 1e3 * floor,
            "p10_ms": 1e3 * deciles[0], "p90_ms": 1e3 * deciles[-1],
            "fraction_of_roofline": floor / step, "tokens_s": batch / step, **more}


def decode_tokens_needed(args, max_batched: int, batch: int) -> int:
    """max_tokens of a decode batch's requests: none may finish while its steps are timed."""
    prefill_steps = -(-batch * args.context // max_batched) + 2
    return prefill_steps + args.steps + 48  # + pipeline fill, the profile's 10 steps, margin


def bench_prefill(args, engine, tokens: int) -> dict:
    from pdd.api import SamplingParams

    cfg = engine.model_config
    times = []
    for rep in range(args.prefill_reps + 1):
        g = torch.Generator().manual_seed(rep)
        prompt = torch.randint(0, 32000, (tokens,), generator=g).tolist()
        engine.add_request(f"p{tokens}-{rep}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        if rep:  # the first run compiles kernels
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    linear_flops = 2 * cfg.num_active_parameters() * tokens   # a token's own experts, not all of them
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    flops = linear_flops + attn_flops
    peak = FP8_MATMUL_FLOP_S if is_fp8(engine.runner.model) else MATMUL_FLOP_S
    return {"tokens": tokens, "time_ms": 1e3 * step, "tflop_s": flops / step / 1e12,
            "fraction_of_peak": flops / step / peak, "peak_tflop_s": peak / 1e12}


def kv_capacity_tokens(engine, utilization: float = 0.90) -> int:
    """Tokens a worker's pool would hold at the default gpu_memory_utilization
    beside this model (the bench sizes its own pool to what it needs)."""
    from pdd.kv.cache import gpu_kv_budget

    spec, pool = engine.runner.kv_spec, engine.runner.kv_cache
    budget = gpu_kv_budget(engine.device, utilization, pool.numel() * pool.element_size())
    return max(0, budget // spec.bytes_per_block) * spec.block_size


def main(args, extension: Extension | None = None) -> int:
    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prefill.split(",") if x and int(x) > 0]  # "0": no prefill runs
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "model": args.model,
           "async_scheduling": not args.no_async_scheduling, "decode": [], "prefill": []}
    max_batched = max(max(prompts, default=0), 8192)
    blocks_needed = max(batches) * (args.context + decode_tokens_needed(args, max_batched, max(batches))) // 16
    blocks_needed = max(blocks_needed, max(prompts, default=0) // 16) + 64
    if extension is not None:
        blocks_needed = max(blocks_needed, extension.blocks_needed(args, max_batched))
    engine = make_engine(args, max_batched, blocks_needed)
    model, spec = engine.runner.model, engine.runner.kv_spec
    out["weight_bytes"] = weight_bytes(model)
    out["fp8_linear_layers"] = is_fp8(model)
    print(f"weights: {decode_weight_bytes(model, 1) / 2**30:.2f} GiB read per decode step"
          f"{' (FP8 linear layers)' if is_fp8(model) else ''}", flush=True)
    out["kv_cache_dtype"] = str(spec.dtype).removeprefix("torch.")
    out["kv_bytes_per_token"] = spec.bytes_per_token
    out["kv_capacity_tokens"] = kv_capacity_tokens(engine)
    print(f"KV cache {out['kv_cache_dtype']}: {spec.bytes_per_token / 1024:.0f} KiB/token, a pool at "
          f"gpu_memory_utilization 0.90 holds {out['kv_capacity_tokens']} tokens", flush=True)
    if args.warm_up:
        engine.warm_up()
        from pdd import ops
        ops.report_compiles(lambda kernel: print(f"compiled after the warm-up: {kernel[:3000]}", flush=True))
    for b in batches:
        r = bench_decode(args, engine, b, args.context, extension)
        out["decode"].append(r)
        print(f"decode  batch {b:>4} ctx {args.context}: step {r['step_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, "
              f"p90 {r['p90_ms']:.2f}), floor {r['floor_ms']:.2f} ms, "
              f"{100 * r['fraction_of_roofline']:.0f}% of roofline, {r['tokens_s']:.0f} tok/s", flush=True)
    for n in prompts:
        r = bench_prefill(args, engine, n)
        out["prefill"].append(r)
        print(f"prefill {n:>6} tokens: {r['time_ms']:.1f} ms, {r['tflop_s']:.0f} TFLOP/s, "
              f"{100 * r['fraction_of_peak']:.0f}% of the {r['peak_tflop_s']:.0f} TFLOP/s peak", flush=True)
    if extension is not None:
        extension.after(engine, out)
    write_json(args.json, out)
    return 0
