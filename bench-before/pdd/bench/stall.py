"""Does CPU work on the router's event loop stall the streams it relays?

One long stream runs; once it flows, K text prompts just under the body limit
arrive at once (refused after tokenization: far beyond the context). Reported:
the stream's chunk gaps before and during that window, the worst /health
answer time during it, and what tokenizing one such prompt costs on its own —
the share a concurrent stream may fairly lose when tokenization is off the loop.

    pdd bench stall [--model DIR] [--big-prompts 4] [--body-bytes 4000000]
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp

from pdd.bench.bystander import Bystander, colocated_cluster


async def _probe_health(session, url: str, until: asyncio.Event, times: list[float]) -> None:
    while not until.is_set():
        t0 = time.perf_counter()
        async with session.get(url + "/health") as resp:
            await resp.read()
        times.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)


async def _measure(url: str, model: str, headers: dict, k: int, body_bytes: int) -> dict:
    text = ("lorem ipsum dolor sit amet " * (body_bytes // 27 + 1))[:body_bytes - 200]
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as session:
        stream, done, health = Bystander(session, url, model), asyncio.Event(), []
        await stream.start()
        before = len(stream.marks)
        probe = asyncio.create_task(_probe_health(session, url, done, health))
        t0 = time.perf_counter()

        async def big():
            async with session.post(url + "/v1/completions", json={"model": model, "prompt": text,
                                                                    "max_tokens": 1}) as resp:
                return resp.status
        statuses = await asyncio.gather(*(big() for _ in range(k)))
        window = (t0, time.perf_counter())
        done.set()
        await probe
        n_after = len(stream.marks)
        await stream.stop()
    baseline = stream.gaps_before(window[0])
    during = stream.gaps(*window)
    return {"statuses": statuses, "window_s": window[1] - window[0], "chunks_in_window": n_after - before,
            "gap_p50_before_ms": 1000 * statistics.median(baseline),
            "max_gap_during_ms": 1000 * max(during, default=0.0),
            "max_health_ms_during": 1000 * max(health, default=0.0)}


def _tokenize_once(model: str | None, body_bytes: int) -> float:
    from pdd.model.make_model import resolve_model_dir
    from pdd.model.tokenizer import Tokenizer
    tok = Tokenizer(resolve_model_dir(model))
    text = ("lorem ipsum dolor sit amet " * (body_bytes // 27 + 1))[:body_bytes - 200]
    t0 = time.perf_counter()
    tok.encode(text)
    return time.perf_counter() - t0


def main(args) -> int:
    with colocated_cluster(args.run_dir, args.model) as cluster:
        result = asyncio.run(_measure(cluster.url, cluster.model_name, cluster.headers, args.big_prompts,
                                      args.body_bytes))
    result["tokenize_one_s"] = _tokenize_once(args.model, args.body_bytes)
    result.update(date=time.strftime("%Y-%m-%d"), big_prompts=args.big_prompts, body_bytes=args.body_bytes)
    print(f"{args.big_prompts} prompts of {args.body_bytes / 2**20:.1f} MiB (answers {sorted(set(result['statuses']))}) "
          f"took {result['window_s']:.2f}s; tokenizing one alone: {result['tokenize_one_s']:.2f}s")
    print(f"live stream: chunk gap p50 before {result['gap_p50_before_ms']:.1f} ms, worst during "
          f"{result['max_gap_during_ms']:.1f} ms ({result['chunks_in_window']} chunks in the window); "
          f"worst /health during: {result['max_health_ms_during']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
