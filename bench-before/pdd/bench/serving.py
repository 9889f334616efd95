"""Serving-stack overhead: the same streams through router + ZeroMQ hop + HTTP/SSE
vs the engine stepped in-process.

For each concurrency C: C requests (same prompt length, same number of output
tokens, greedy, ignore_eos) start together. In-process, the inter-token
latency is the engine's step time; through the stack it is the gap between
SSE chunks the client sees. The difference is what the serving stack adds
per token; tokens/s is the relay rate.

    pdd bench serving [--model DIR] [--concurrency 1,64,512] [--max-tokens 64]
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from pdd.bench.load import burst, start_cluster
from pdd.bench.metrics_calc import latency_stats


def run_inprocess(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from pdd.api import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, SamplingParams(**vars(sp)))
    gaps, last, tokens = [], {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
            tokens += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    itl = latency_stats(gaps)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "itl_mean_ms": itl.mean,
            "itl_p50_ms": itl.median, "itl_p99_ms": itl.p99}


def main(args) -> int:
    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine

    levels = [int(x) for x in args.concurrency.split(",")]
    max_seqs = max(levels)
    engine_over = {"max_num_seqs": max_seqs, "max_num_batched_tokens": max(2048, max_seqs)}
    if args.model:
        engine_over["model"] = args.model
    prompt = list(range(100, 100 + args.prompt_len))

    results = {"date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "levels": {}}
    engine = LLMEngine(EngineConfig(**engine_over))
    run_inprocess(engine, [prompt] * 2, 4)  # warm-up
    for c in levels:
        results["levels"][c] = {"inprocess": run_inprocess(engine, [prompt] * c, args.max_tokens)}
    del engine

    engine_over.pop("model", None)
    cluster = start_cluster(args.run_dir, [("colocated", "colocated-0", None)], args.model, "colocated",
                            engine_over)
    try:
        burst(cluster.url, cluster.model_name, [prompt] * 2, 4)  # warm-up
        for c in levels:
            results["levels"][c]["http"] = burst(cluster.url, cluster.model_name, [prompt] * c, args.max_tokens)
    finally:
        cluster.stop()

    print(f"{'streams':>8} {'in-proc tok/s':>14} {'http tok/s':>11} {'in-proc ITL ms':>15} "
          f"{'http ITL ms':>12} {'added ms/token':>15} {'http p99 ms':>12}")
    for c, r in results["levels"].items():
        ip, h = r["inprocess"], r["http"]
        r["added_latency_ms"] = h["itl_mean_ms"] - ip["itl_mean_ms"]
        print(f"{c:>8} {ip['tok_s']:>14.0f} {h['tok_s']:>11.0f} {ip['itl_mean_ms']:>15.2f} "
              f"{h['itl_mean_ms']:>12.2f} {r['added_latency_ms']:>15.2f} {h['itl_p99_ms']:>12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
