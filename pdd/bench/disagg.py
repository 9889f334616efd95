"""TTFT and total time, disaggregated vs colocated, for one burst of requests.

Starts a cluster per mode (colocated: one worker; disagg: --prefill P and
--decode D workers), sends N streaming requests at once (random prompts of
--min-prompt..--max-prompt tokens, --max-tokens output tokens, greedy,
ignore_eos) and reports TTFT (request sent -> first SSE chunk), the
inter-token gap, and the time for the whole burst.

    pdd bench disagg [--model DIR] [--num-requests 64] [--json FILE]
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _one(session, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    ttft, last, gaps = None, None, []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return ttft, gaps


async def burst(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, model, p, max_tokens) for p in prompts))
        total = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {"total_s": total, "ttft_mean_ms": 1e3 * statistics.mean(ttfts), "ttft_p50_ms": 1e3 * _pct(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * _pct(ttfts, 0.99), "itl_mean_ms": 1e3 * statistics.mean(gaps) if gaps else 0.0}


def _run_mode(args, mode: str, prompts) -> dict:
    from pdd.config import load_cluster_config
    from pdd.launcher import Cluster, free_port

    over = {"router": {"mode": mode, "port": free_port(), "control_addr": f"tcp://127.0.0.1:{free_port()}",
                       "admin_addr": f"tcp://127.0.0.1:{free_port()}"}, "engine": {}}
    if args.model:
        over["engine"]["model"] = args.model
    cfg = load_cluster_config(overrides=over)
    if mode == "disagg":
        workers = [("prefill", f"prefill-{i}", None) for i in range(args.prefill)]
        workers += [("decode", f"decode-{i}", None) for i in range(args.decode)]
    else:
        workers = [("colocated", "colocated-0", None)]
    cluster = Cluster(cfg, workers, Path(args.run_dir) / mode)
    cluster.start()
    try:
        cluster.wait_ready(300)
        model = cfg.served_model_name(args.model)
        asyncio.run(burst(cluster.url, model, prompts[:2], 4))  # warm-up
        # Distinct prompts from the warm-up; nothing cached in either mode.
        return asyncio.run(burst(cluster.url, model, prompts[2:], args.max_tokens))
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
        print(f"{mode:>10} {r['total_s']:>8.2f} {r['ttft_mean_ms']:>13.1f} {r['ttft_p50_ms']:>9.1f} "
              f"{r['ttft_p99_ms']:>9.1f} {r['itl_mean_ms']:>12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("disagg", help="TTFT and total time, disaggregated vs colocated")
    b.add_argument("--model", default=None)
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--min-prompt", type=int, default=64)
    b.add_argument("--max-prompt", type=int, default=512)
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--prefill", type=int, default=1)
    b.add_argument("--decode", type=int, default=1)
    b.add_argument("--run-dir", default="/tmp/pdd-bench-disagg")
    b.add_argument("--json", default=None)
    b.set_defaults(func=main)
