"""Load generation shared by the benchmarks: concurrent streaming completions
against a running cluster, and a throw-away cluster on loopback ports."""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import aiohttp


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def stream_completion(session, url: str, model: str, prompt: list[int], max_tokens: int,
                            ) -> tuple[float, list[float], int]:
    """One greedy streaming request: (TTFT, gaps between chunks, chunks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    ttft, last, gaps, n = None, None, [], 0
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
            n += 1
    return ttft, gaps, n


async def _burst(url: str, model: str, prompts: list[list[int]], max_tokens: int, sequential: bool = False) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        if sequential:
            results = [await stream_completion(session, url, model, p, max_tokens) for p in prompts]
        else:
            results = await asyncio.gather(*(stream_completion(session, url, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    chunks = sum(r[2] for r in results)
    return {"chunks": chunks, "wall_s": wall, "tok_s": chunks / wall,
            "ttft_mean_ms": 1e3 * statistics.mean(ttfts), "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
            "itl_mean_ms": 1e3 * statistics.mean(gaps) if gaps else 0.0,
            "itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p99_ms": 1e3 * percentile(gaps, 0.99)}


def burst(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once, streaming; figures over every request."""
    return asyncio.run(_burst(url, model, prompts, max_tokens))


def one_at_a_time(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt after the previous one finished: latency without queueing."""
    return asyncio.run(_burst(url, model, prompts, max_tokens, sequential=True))


def start_cluster(run_dir: str | Path, workers: list[tuple[str, str, str | None]], model: str | None = None,
                  mode: str = "auto", engine: dict | None = None, worker: dict | None = None):
    """A cluster on fresh loopback ports, ready; the caller stops it."""
    from pdd.config import load_cluster_config
    from pdd.launcher import Cluster, free_port

    over = {"router": {"mode": mode, "port": free_port(), "control_addr": f"tcp://127.0.0.1:{free_port()}",
                       "admin_addr": f"tcp://127.0.0.1:{free_port()}"}, "engine": dict(engine or {}),
            "worker": dict(worker or {})}
    if model:
        over["engine"]["model"] = model
    cfg = load_cluster_config(overrides=over)
    cluster = Cluster(cfg, workers, Path(run_dir))
    cluster.start()
    try:
        cluster.wait_ready(300)
    except Exception:
        cluster.stop()
        raise
    cluster.model_name = cfg.served_model_name(model)
    return cluster
