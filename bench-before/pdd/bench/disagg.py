"""TTFT and total time, disaggregated vs colocated, for one burst of requests.

Starts a cluster per mode (colocated: one worker; disagg: --prefill P and
--decode D workers), sends N streaming requests at once (random prompts of
--min-prompt..--max-prompt tokens, --max-tokens output tokens, greedy,
ignore_eos) and reports TTFT (request sent -> first SSE chunk), the
inter-token gap, and the time for the whole burst. --sequential sends them one
at a time instead: TTFT is then the latency of one prompt, no queueing.

On GPUs each worker gets its own (prefill cuda:0, decode cuda:1; colocated
cuda:0). A config-only checkpoint (--load-format dummy) is served with a word
tokenizer (pdd.model.tokenizer.servable_copy).

    pdd bench disagg [--model DIR] [--num-requests 64] [--sequential]
                     [--load-format dummy --kv-cache-bytes N --transfer-backend auto] [--json FILE]
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from pdd.bench.load import burst, one_at_a_time, start_cluster
from pdd.model.tokenizer import servable_copy


def _gpus() -> list[str]:
    try:
        import torch
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def _run_mode(args, mode: str, prompts, model: str | None) -> dict:
    gpus = _gpus()
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode if mode == "disagg" else ["colocated"]
    workers = [(role, f"{role}-{i}", gpus[i % len(gpus)] if gpus else None) for i, role in enumerate(roles)]
    engine = {"load_format": args.load_format, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    if args.kv_cache_bytes:
        engine["kv_cache_bytes"] = args.kv_cache_bytes
    cluster = start_cluster(Path(args.run_dir) / mode, workers, model, mode, engine,
                            worker={"transfer_backend": args.transfer_backend})
    run = burst if not args.sequential else one_at_a_time
    try:
        run(cluster.url, cluster.model_name, prompts[:2], 4)  # warm-up
        # Distinct prompts from the warm-up; nothing cached in either mode.
        out = run(cluster.url, cluster.model_name, prompts[2:], args.max_tokens)
        out["metrics"] = _metrics(cluster.url)
        return out
    finally:
        cluster.stop()


def _metrics(url: str) -> dict[str, float]:
    """Step latency and KV transfer time as the cluster counted them (warm-up included)."""
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    keep = ("pdd_scheduler_iteration_latency_seconds_", "pdd_prefill_to_decode_kv_transfer_seconds_",
            "pdd_disagg_phase_seconds_", "pdd_time_to_first_token_seconds_")
    out = {}
    for line in text.splitlines():
        if line.startswith(keep) and ("_sum" in line or "_count" in line):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main(args) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_requests + 2)]
    results = {"date": time.strftime("%Y-%m-%d"), "num_requests": args.num_requests,
               "prompt_tokens": sum(map(len, prompts[2:])), "max_tokens": args.max_tokens,
               "sequential": args.sequential, "gpus": _gpus(), "transfer_backend": args.transfer_backend}
    model = args.model
    if model and args.load_format == "dummy":
        model = str(servable_copy(model, Path(args.run_dir) / "model"))
    for mode in ("colocated", "disagg"):
        results[mode] = _run_mode(args, mode, prompts, model)
    ratio = results["disagg"]["ttft_mean_ms"] / results["colocated"]["ttft_mean_ms"]
    results["ttft_disagg_over_colocated"] = ratio
    print(f"{'mode':>10} {'total s':>8} {'TTFT mean ms':>13} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL mean ms':>12}")
    for mode in ("colocated", "disagg"):
        r = results[mode]
        print(f"{mode:>10} {r['wall_s']:>8.2f} {r['ttft_mean_ms']:>13.1f} {r['ttft_p50_ms']:>9.1f} "
              f"{r['ttft_p99_ms']:>9.1f} {r['itl_mean_ms']:>12.2f}")
    print(f"TTFT disagg / colocated: {ratio:.3f}")
    mets = results["disagg"]["metrics"]
    phases = {p: mets.get(f'pdd_disagg_phase_seconds_sum{{phase="{p}"}}', 0.0)
              / max(1.0, mets.get(f'pdd_disagg_phase_seconds_count{{phase="{p}"}}', 0.0))
              for p in ("reserve", "first_token", "prefill")}
    print("disagg phases at the router (means incl. warm-up): "
          + ", ".join(f"{p} {1e3 * v:.1f} ms" for p, v in phases.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
