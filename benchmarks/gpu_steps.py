"""`pdd bench gpu` with what a kernel developer adds to it: the matmul peaks
measured again (bf16, and torch._scaled_mm with each FP8 scale kind, 8192^3),
each decode batch's captured forward alone (device time apart from the
engine's host work) against its floor, the router's prior step time beside
each measured one, a kernel profile of decode steps (--profile), and prompt
chunks beside decodes (--mixed-chunks: a prompt computed in chunks beside B
decoding requests, what each chunk adds to their step by its depth in the
prompt).

    python -m benchmarks.gpu_steps --model conf/models/llama-3.1-8b --load-format dummy \
        --mixed-chunks 128,256,512 --profile
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.cli import run_as_main
from pdd.bench import gpu
from pdd.bench.commands import add_gpu_args
from pdd.bench.gpu import HBM_BYTES_S, decode_tokens_needed, timed_steps


def add_args(p) -> None:
    add_gpu_args(p)
    p.add_argument("--mixed-chunks", default="", help="comma list of chunk sizes: a prompt computed in chunks "
                   "beside --mixed-batch decodes, step time by depth (e.g. 128,256,512)")
    p.add_argument("--mixed-batch", type=int, default=64, help="decodes beside the chunked prompt")
    p.add_argument("--mixed-prompt", type=int, default=16384, help="prompt tokens of the mixed run")
    p.add_argument("--profile", action="store_true",
                   help="also print where a decode step's time goes (GPU kernels, host gaps)")


class DeveloperFigures:
    """The gpu.Extension that adds this module's figures to `pdd bench gpu`'s run."""

    def __init__(self, args):
        self.args = args
        self.chunks = [int(x) for x in args.mixed_chunks.split(",") if x and int(x) > 0]

    def blocks_needed(self, args, max_batched: int) -> int:
        if not self.chunks:
            return 0
        # each decoding request lives through the prompt's steps at the smallest chunk
        per_request = (args.context + decode_tokens_needed(args, max_batched, args.mixed_batch)
                       + -(-args.mixed_prompt // min(self.chunks)) + args.steps)
        return (args.mixed_batch * per_request + args.mixed_prompt) // 16 + 64

    def while_decoding(self, engine, batch: int) -> dict:
        forward_ms = _graph_replay_ms(engine, batch)
        if self.args.profile:
            _profile_steps(engine, batch)
        return {"graph_forward_ms": forward_ms}

    def after(self, engine, out: dict) -> None:
        prior = _router_prior(engine)
        # The captured forward stops before the LM head: its floor is without those weights.
        head = engine.runner.model.lm_head.weight
        head_ms = 1e3 * head.numel() * head.element_size() / HBM_BYTES_S
        for r in out["decode"]:
            forward_ms = r["graph_forward_ms"]
            r["forward_fraction_of_roofline"] = (r["floor_ms"] - head_ms) / forward_ms if forward_ms else None
            r["router_prior_ms"] = 1e3 * prior.predict(r["batch"], 0)
            print(f"decode  batch {r['batch']:>4}: graph forward alone {forward_ms or float('nan'):.2f} ms; "
                  f"router's prior {r['router_prior_ms']:.2f} ms", flush=True)
        for r in out["prefill"]:
            n = r["tokens"]
            r["router_prior_ms"] = 1e3 * prior.predict(0, n, n * (n + 1) / 2)
            print(f"prefill {n:>6} tokens: router's prior {r['router_prior_ms']:.1f} ms", flush=True)
        args = self.args
        for c in self.chunks:
            r = bench_mixed(args, engine, args.mixed_batch, c, args.mixed_prompt)
            out.setdefault("mixed", []).append(r)
            depths = ", ".join(f"{g['depth'] // 1024}k+: {g['step_ms']:.1f} ms ({g['per_token_us']:.0f} us/token)"
                               for g in r["by_depth"])
            print(f"mixed   batch {args.mixed_batch} ctx {args.context}, chunk {c} of a {args.mixed_prompt}-token "
                  f"prompt: decode step {r['decode_step_ms']:.1f} ms; with the chunk at depth {depths}", flush=True)
        peaks = matmul_peaks()
        out["matmul_peaks_tflop_s"] = peaks
        print("matmul peak 8192^3: " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in peaks.items()), flush=True)


def main(args) -> int:
    return gpu.main(args, DeveloperFigures(args))


def _router_prior(engine):
    """The router's step-time model of this worker before it is measured: its priors
    priced by the model it registers (pdd.router.cost.step.StepFit.price_model)."""
    from pdd.protocol.messages import StepLimits
    from pdd.router.cost.step import StepFit

    limits = StepLimits.of(engine.cfg, engine.model_config)
    fit = StepFit()
    fit.price_model(limits.prefill_flops_per_token, limits.decode_expert_bytes)
    return fit



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
    from pdd.fp8_format import FP8_DTYPE

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
        sp = SamplingParams(max_tokens=decode_tokens_needed(args, engine.cfg.max_num_batched_tokens, batch)
                            + steps_needed, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(f"m{batch}-{chunk}-{i}", torch.randint(0, vocab, (args.context,), generator=g)
                                   .tolist(), sp) for i in range(batch)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs) or sched.waiting:
            engine.step()
        decode_ms = 1e3 * statistics.median(timed_steps(engine, args.steps))
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


if __name__ == "__main__":
    run_as_main(__name__)
