"""Does a slow-to-compile grammar stall the other requests on its worker?

Grammars used to compile inside the engine step: K requests with a heavy regex
held every stream on the worker for the length of their compiles, long enough
(at K = 48) for the router to declare the worker hung. They now compile in a
bounded pool beside the step (engine.grammar_compile_threads), each within
engine.grammar_compile_timeout_s. This bench shows which of the two holds.

One bystander stream runs alone for --alone-s; then K requests without a
grammar are sent at once (the control: what K arrivals cost the bystander
anyway, their prefill in its steps); then K requests, each with its own regex
`(a{1000}){N}` (N = 2..K+1: no compiled grammar is reused). Reported: the
bystander's chunk gaps alone, beside the K plain requests and beside the K
grammar requests, the K's answers and wall time, and whether the router saw
any worker turn suspect, lost or hung meanwhile.

    pdd bench grammar-stall [--model DIR] [--grammars 48] [--alone-s 1]
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import aiohttp

from pdd.bench.bystander import Bystander, colocated_cluster
from pdd.bench.metrics_calc import latency_stats

# Router counters that move when a worker stops answering in time: liveness
# events by kind, and requests moved off a lost or hung worker.
WATCHED = ("pdd_worker_liveness_events_total", "pdd_request_migrations_total")


async def _counters(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(WATCHED):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def _watch_workers(cfg, until: asyncio.Event, seen: dict[str, set[str]]) -> None:
    """Poll the admin `workers` view (as `pdd admin workers` shows it): the
    hung flag has no counter, and a suspect worker may be back before the end."""
    from pdd.admin.client import call_with_config
    first = None
    while not until.is_set():
        workers = await asyncio.to_thread(call_with_config, cfg, "workers", timeout_s=30.0)
        ids = {w["worker_id"] for w in workers}
        first = ids if first is None else first
        for w in workers:
            for flag in ("suspect", "hung"):
                if w[flag]:
                    seen.setdefault(flag, set()).add(w["worker_id"])
        if first - ids:
            seen.setdefault("gone", set()).update(first - ids)
        await asyncio.sleep(0.2)


def _kind(status: int, text: str) -> str:
    if status == 400 and "grammar_compile_timeout_s" in text:
        return "400 (compile budget)"
    return str(status)


async def _request(session, url: str, model: str, n: int | None) -> tuple[str, float, str]:
    """One of the burst: with the regex (a{1000}){n}, or (n None) without a grammar."""
    body = {"model": model, "prompt": "say a", "max_tokens": 8}
    if n is not None:
        body["guided_regex"] = f"(a{{1000}}){{{n}}}"
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        text = await resp.text()
    return _kind(resp.status, text), time.perf_counter() - t0, "" if resp.status == 200 else text[:300]


def _itl(gaps: list[float]) -> dict:
    s = latency_stats(gaps)   # the percentiles `bench serve` reports
    return {"n": s.count, "p50_ms": s.median, "p99_ms": s.p99, "max_ms": 1000 * max(gaps) if gaps else None}


async def _measure(cluster, k: int, alone_s: float) -> dict:
    url, model = cluster.url, cluster.model_name
    async with aiohttp.ClientSession(headers=cluster.headers, timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = await _counters(session, url)
        stream = Bystander(session, url, model)
        await stream.start()
        alone_from = time.perf_counter()
        await asyncio.sleep(alone_s)
        p0 = time.perf_counter()
        plain = await asyncio.gather(*(_request(session, url, model, None) for _ in range(k)))
        p1 = time.perf_counter()
        await asyncio.sleep(0.5)
        done, seen = asyncio.Event(), {}
        watch = asyncio.create_task(_watch_workers(cluster.cfg, done, seen))
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(_request(session, url, model, n) for n in range(2, k + 2)))
        t1 = time.perf_counter()
        done.set()
        await watch
        outlasted = not stream.ended   # else the gaps "beside" cover only part of the window
        await stream.stop()
        after = await _counters(session, url)
    moved = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    errors = Counter(e for _, _, e in answers if e)
    return {"grammars": k, "alone_s": alone_s,
            "itl_alone": _itl(stream.gaps(alone_from, p0)), "itl_beside_plain": _itl(stream.gaps(p0, p1)),
            "plain_statuses": dict(Counter(kind for kind, _, _ in plain)), "plain_wall_s": p1 - p0,
            "itl_beside": _itl(stream.gaps(t0, t1)),
            "statuses": dict(Counter(kind for kind, _, _ in answers)),
            "wall_s": t1 - t0, "slowest_answer_s": max(s for _, s, _ in answers),
            "bystander_outlasted_window": outlasted, "bystander_error": stream.error,
            "counters_moved": moved, "workers_flagged": {f: sorted(ids) for f, ids in seen.items()},
            "errors": [{"error": e, "count": c} for e, c in errors.most_common(3)],
            "compile_threads": cluster.cfg.engine.grammar_compile_threads,
            "compile_timeout_s": cluster.cfg.engine.grammar_compile_timeout_s}


def _summary(r: dict) -> str:
    def itl(s):
        return "no gaps" if not s["n"] else f"{s['p50_ms']:.1f}/{s['p99_ms']:.1f}/{s['max_ms']:.1f} ms ({s['n']} gaps)"
    statuses = ", ".join(f"{n}x {kind}" for kind, n in sorted(r["statuses"].items()))
    health = "none" if not (r["counters_moved"] or r["workers_flagged"]) else \
        f"counters {r['counters_moved']}, flagged {r['workers_flagged']}"
    lines = [f"bystander ITL p50/p99/max: alone {itl(r['itl_alone'])}; beside {r['grammars']} plain requests "
             f"{itl(r['itl_beside_plain'])}; beside {r['grammars']} grammars {itl(r['itl_beside'])}",
             f"{r['grammars']} grammar requests: {statuses} in {r['wall_s']:.2f}s "
             f"({r['compile_threads']} compile threads, {r['compile_timeout_s']:g}s budget)",
             f"worker suspect/lost/hung during the run: {health}"]
    if not r["bystander_outlasted_window"]:
        lines.append(f"NOTE: the bystander ended before the grammars did ({r['bystander_error'] or 'finished'})")
    return "\n".join(lines)


def main(args) -> int:
    with colocated_cluster(args.run_dir, args.model) as cluster:
        result = asyncio.run(_measure(cluster, args.grammars, args.alone_s))
    result["date"] = time.strftime("%Y-%m-%d")
    print(_summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
