"""TTFT and total time, disaggregated vs colocated, for one burst of requests.

Starts a cluster per mode (colocated: one worker; disagg: --prefill P and
--decode D workers), sends N streaming requests at once (random prompts of
--min-prompt..--max-prompt tokens, --max-tokens output tokens, greedy,
ignore_eos) and reports TTFT (request sent -> first SSE chunk), the
inter-token gap, and the time for the whole burst.

    pdd bench disagg [--model DIR] [--num-requests 64] [--json FILE]
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from pdd.bench.load import burst, start_cluster


def _run_mode(args, mode: str, prompts) -> dict:
    if mode == "disagg":
        workers = [("prefill", f"prefill-{i}", None) for i in range(args.prefill)]
        workers += [("decode", f"decode-{i}", None) for i in range(args.decode)]
    else:
        workers = [("colocated", "colocated-0", None)]
    cluster = start_cluster(Path(args.run_dir) / mode, workers, args.model, mode)
    try:
        burst(cluster.url, cluster.model_name, prompts[:2], 4)  # warm-up
        # Distinct prompts from the warm-up; nothing cached in either mode.
        return burst(cluster.url, cluster.model_name, prompts[2:], args.max_tokens)
    finally:
        cluster.stop()


def main(args) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_requests + 2)]
    results = {"date": time.strftime("%Y-%m-%d"), "num_requests": args.num_requests,
               "prompt_tokens": sum(map(len, prompts[2:])), "max_tokens": args.max_tokens}
    for mode in ("colocated", "disagg"):
        results[mode] = _run_mode(args, mode, prompts)
    print(f"{'mode':>10} {'total s':>8} {'TTFT mean ms':>13} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL mean ms':>12}")
    for mode in ("colocated", "disagg"):
        r = results[mode]
        print(f"{mode:>10} {r['wall_s']:>8.2f} {r['ttft_mean_ms']:>13.1f} {r['ttft_p50_ms']:>9.1f} "
              f"{r['ttft_p99_ms']:>9.1f} {r['itl_mean_ms']:>12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
