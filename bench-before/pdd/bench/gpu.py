"""Engine step times on a GPU against the roofline (DESIGN.md, "Performance model").

decode: B requests with a context of --context tokens each, all decoding; a
step's floor is (weight bytes + KV bytes read) / HBM bandwidth, counting only the
bytes a step reads (an untied embedding table is looked up, not read whole).
prefill: one prompt of N tokens in one step; the floor is
(2 * params * N + attention FLOPs) / matmul peak.
mixed (--mixed-chunks): a prompt computed in chunks beside B decoding requests,
what each chunk adds to their step by its depth in the prompt.
Times are whole engine steps (schedule, inputs, forward, sample, outputs): the
median gap between consecutive step() returns, steps back to back, which is
what a decoding request waits per token.

    pdd bench gpu --model conf/models/llama-3.1-8b --load-format dummy

An FP8 checkpoint (`pdd make-model --preset 8b --fp8 block --out DIR`, then
`--model DIR --load-format auto`, or its config.json alone with dummy weights)
is measured against the bytes it reads (1 byte per FP8 weight, plus scales) and
its prefill against the FP8 GEMM peak (measured on the lent H200, fixed so
runs compare). The run starts by measuring the matmul peaks again (bf16, and
torch._scaled_mm with each scale kind) on 8192^3, reported beside them.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

HBM_BYTES_S = 4.26e12      # measured device-to-device copy on the lent H200 (DESIGN.md)
MATMUL_FLOP_S = 796e12     # measured bf16 matmul on the lent H200
FP8_MATMUL_FLOP_S = 1465e12  # torch._scaled_mm (e4m3, tensorwise), 8192^3, on the lent H200; each run prints its own


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter (tied ones once), FP8 weights at one byte each
    plus their scales."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Weight bytes one decode step reads: every layer and the LM head, but of an
    untied embedding table only the batch's rows (a lookup, not a pass over it)."""
    table = model.model.embed_tokens.weight
    row_bytes = table.shape[1] * table.element_size()
    if table is model.lm_head.weight:
        return weight_bytes(model)
    return weight_bytes(model) - table.shape[0] * row_bytes + batch * row_bytes


def is_fp8(model: torch.nn.Module) -> bool:
    from pdd.model.fp8 import Fp8Linear

    return any(isinstance(m, Fp8Linear) for m in model.modules())


def _cuda_time(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def matmul_peaks(n: int = 8192) -> dict:
    """TFLOP/s of an n^3 GEMM: bf16, and FP8 e4m3 through torch._scaled_mm with
    tensorwise, rowwise and 128x128 block scales (the kinds FP8 checkpoints use)."""
    from pdd.ops import fp8_linear
    from pdd.ops.fp8_linear import FP8_DTYPE

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE)
    one = torch.ones((), device="cuda")
    rows, cols = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    runs = {
        "bf16": lambda: a @ b.t(),
        "fp8_tensorwise": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "fp8_rowwise": lambda: torch._scaled_mm(a8, b8.t(), scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16),
    }
    if fp8_linear.block_gemm_supported():
        import torch.nn.functional as F
        a_scale = torch.ones(n // 128, n, device="cuda").t()      # column-major, as cuBLASLt takes it
        b_scale = torch.ones(n // 128, n // 128, device="cuda").t()
        runs["fp8_block"] = lambda: F.scaled_mm(a8, b8.t(), a_scale, F.ScalingType.BlockWise1x128, b_scale,
                                                F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    return {name: 2 * n ** 3 / _cuda_time(fn) / 1e12 for name, fn in runs.items()}


def _engine(args, max_batched: int, num_blocks: int):
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


def _timed_steps(engine, n: int) -> list[float]:
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


def bench_decode(args, engine, batch: int, context: int) -> dict:
    from pdd.api import SamplingParams

    g = torch.Generator().manual_seed(batch)
    # Nobody may finish inside the measured steps (the batch would shrink):
    # requests decode while the later ones prefill, then the timed and profiled steps.
    max_tokens = _decode_tokens_needed(args, engine.cfg.max_num_batched_tokens, batch)
    vocab = min(32000, engine.model_config.vocab_size)
    reqs = [engine.add_request(f"d{batch}-{i}", torch.randint(0, vocab, (context,), generator=g).tolist(),
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i in range(batch)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    tokens_before = sum(r.num_tokens for r in reqs)
    times = _timed_steps(engine, args.steps)
    tokens_after = sum(r.num_tokens for r in reqs)
    assert all(not r.status.finished for r in reqs), "a request finished inside the measured steps"
    forward_ms = _graph_replay_ms(engine, batch)
    if args.profile:
        _profile_steps(engine, batch)
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    model, spec = engine.runner.model, engine.runner.kv_spec
    # KV each step reads (in the cache's dtype: FP8 halves it): the batch's mean
    # total context over the timed steps.
    kv_bytes = (tokens_before + tokens_after) / 2 * spec.bytes_per_token
    step = statistics.median(times)
    floor = (decode_weight_bytes(model, batch) + kv_bytes) / HBM_BYTES_S
    # The captured forward stops before the LM head: its floor is without those weights.
    head = model.lm_head.weight
    forward_floor = floor - head.numel() * head.element_size() / HBM_BYTES_S
    deciles = statistics.quantiles(times, n=10)
    return {"batch": batch, "context": context, "step_ms": 1e3 * step, "floor_ms": 1e3 * floor,
            "p10_ms": 1e3 * deciles[0], "p90_ms": 1e3 * deciles[-1],
            "fraction_of_roofline": floor / step, "tokens_s": batch / step, "graph_forward_ms": forward_ms,
            "forward_fraction_of_roofline": (1e3 * forward_floor / forward_ms) if forward_ms else None}


def _decode_tokens_needed(args, max_batched: int, batch: int) -> int:
    prefill_steps = -(-batch * args.context // max_batched) + 2
    return prefill_steps + args.steps + 48  # + pipeline fill, the profile's 10 steps, margin


def _profile_steps(engine, batch: int, n: int = 10) -> None:
    """Kernel time by kernel, and how much of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    busy = sum(e.self_device_time_total for e in averages) / 1e6  # us -> s
    launches = sum(e.count for e in averages if e.device_type != torch.autograd.DeviceType.CPU)
    print(f"-- profile batch {batch}: {n} steps, wall {1e3 * wall / n:.2f} ms/step, GPU busy "
          f"{1e3 * busy / n:.2f} ms/step ({100 * busy / wall:.0f}%), {launches / n:.0f} kernels/step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))


def _graph_replay_ms(engine, batch: int) -> float | None:
    """GPU time of the captured decode forward alone (no scheduling, sampling,
    host sync): separates device time from the engine's host overhead."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    bs = next(s for s in graphs.sizes if s >= batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.graphs[bs].replay()
    start.record()
    for _ in range(20):
        graphs.graphs[bs].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


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
    linear_flops = 2 * cfg.num_parameters() * tokens
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    flops = linear_flops + attn_flops
    peak = FP8_MATMUL_FLOP_S if is_fp8(engine.runner.model) else MATMUL_FLOP_S
    return {"tokens": tokens, "time_ms": 1e3 * step, "tflop_s": flops / step / 1e12,
            "fraction_of_peak": flops / step / peak, "peak_tflop_s": peak / 1e12}


def bench_mixed(args, engine, batch: int, chunk: int, prompt: int) -> dict:
    """What a prompt chunk costs beside running decodes: `batch` requests decode
    at --context while one prompt of `prompt` tokens is computed `chunk` tokens a
    step (the engine's chunk beside decodes). Steps are timed back to back and
    grouped by how deep into the prompt the chunk is (its attention reads
    everything before it); per_token_us is (mixed step - decode step) / chunk.
    Mixed steps run eagerly (CUDA graphs cover decode-only batches)."""
    import dataclasses

    from pdd.api import SamplingParams

    sched = engine.scheduler
    saved = sched.cfg
    sched.cfg = dataclasses.replace(saved, chunk_size=chunk)   # the chunk beside decodes, for this run only
    try:
        steps_needed = -(-prompt // chunk) + args.steps
        g = torch.Generator().manual_seed(batch + chunk)
        vocab = min(32000, engine.model_config.vocab_size)
        sp = SamplingParams(max_tokens=_decode_tokens_needed(args, engine.cfg.max_num_batched_tokens, batch)
                            + steps_needed, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(f"m{batch}-{chunk}-{i}", torch.randint(0, vocab, (args.context,), generator=g)
                                   .tolist(), sp) for i in range(batch)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs) or sched.waiting:
            engine.step()
        decode_ms = 1e3 * statistics.median(_timed_steps(engine, args.steps))
        long = engine.add_request(f"m{batch}-{chunk}-prompt", torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                                  SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        engine.step()   # the pipeline holds one step: time from the next return on
        by_depth: dict[int, list[float]] = {}
        trace = []        # (depth, ms between step() returns, ms inside step())
        last = time.perf_counter()
        while long.num_computed_tokens < prompt:
            depth = long.num_computed_tokens   # where the chunk scheduled in the step now ending started
            engine.step()
            now = time.perf_counter()
            by_depth.setdefault(depth // 4096 * 4096, []).append(now - last)
            trace.append((depth, round(1e3 * (now - last), 2), round(1e3 * engine.last_step.latency_s, 2)))
            last = now
        for rid in list(sched.requests):
            engine.abort_request(rid)
    finally:
        sched.cfg = saved
    groups = []
    for depth, times in sorted(by_depth.items()):
        step = 1e3 * statistics.median(times)
        groups.append({"depth": depth, "steps": len(times), "step_ms": step,
                       "per_token_us": 1e3 * (step - decode_ms) / chunk})
    return {"batch": batch, "context": args.context, "chunk": chunk, "prompt": prompt, "decode_step_ms": decode_ms,
            "by_depth": groups, "steps": trace}


def kv_capacity_tokens(engine, utilization: float = 0.90) -> int:
    """Tokens a worker's pool would hold at the default gpu_memory_utilization
    beside this model (the bench sizes its own pool to what it needs)."""
    from pdd.kv.cache import gpu_kv_budget

    spec, pool = engine.runner.kv_spec, engine.runner.kv_cache
    budget = gpu_kv_budget(engine.device, utilization, pool.numel() * pool.element_size())
    return max(0, budget // spec.bytes_per_block) * spec.block_size


def main(args) -> int:
    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prefill.split(",") if x and int(x) > 0]  # "0": no prefill runs
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "model": args.model,
           "async_scheduling": not args.no_async_scheduling, "decode": [], "prefill": []}
    max_batched = max(max(prompts, default=0), 8192)
    blocks_needed = max(batches) * (args.context + _decode_tokens_needed(args, max_batched, max(batches))) // 16
    blocks_needed = max(blocks_needed, max(prompts, default=0) // 16) + 64
    chunks = [int(x) for x in args.mixed_chunks.split(",") if x and int(x) > 0]
    if chunks:   # each decoding request lives through the prompt's steps at the smallest chunk
        per_request = (args.context + _decode_tokens_needed(args, max_batched, args.mixed_batch)
                       + -(-args.mixed_prompt // min(chunks)) + args.steps)
        blocks_needed = max(blocks_needed, (args.mixed_batch * per_request + args.mixed_prompt) // 16 + 64)
    peaks = matmul_peaks()
    out["matmul_peaks_tflop_s"] = peaks
    print("matmul peak 8192^3: " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in peaks.items()), flush=True)
    engine = _engine(args, max_batched, blocks_needed)
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
        r = bench_decode(args, engine, b, args.context)
        out["decode"].append(r)
        print(f"decode  batch {b:>4} ctx {args.context}: step {r['step_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, "
              f"p90 {r['p90_ms']:.2f}), floor {r['floor_ms']:.2f} ms, "
              f"{100 * r['fraction_of_roofline']:.0f}% of roofline, {r['tokens_s']:.0f} tok/s; "
              f"graph forward alone {r['graph_forward_ms'] or float('nan'):.2f} ms", flush=True)
    for n in prompts:
        r = bench_prefill(args, engine, n)
        out["prefill"].append(r)
        print(f"prefill {n:>6} tokens: {r['time_ms']:.1f} ms, {r['tflop_s']:.0f} TFLOP/s, "
              f"{100 * r['fraction_of_peak']:.0f}% of the {r['peak_tflop_s']:.0f} TFLOP/s peak", flush=True)
    for c in chunks:
        r = bench_mixed(args, engine, args.mixed_batch, c, args.mixed_prompt)
        out.setdefault("mixed", []).append(r)
        depths = ", ".join(f"{g['depth'] // 1024}k+: {g['step_ms']:.1f} ms ({g['per_token_us']:.0f} us/token)"
                           for g in r["by_depth"])
        print(f"mixed   batch {args.mixed_batch} ctx {args.context}, chunk {c} of a {args.mixed_prompt}-token prompt: "
              f"decode step {r['decode_step_ms']:.1f} ms; with the chunk at depth {depths}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
