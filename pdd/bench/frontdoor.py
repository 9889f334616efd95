"""What the front door carries: tokens and requests per second delivered against
concurrency, for 1, 2, 4 ... routers, and what clients get past saturation.

For each router count a cluster is started (`pdd up --routers N`, the built-in
tiny model unless --model: the engine should not be what limits), and for each
concurrency C, C streams run in a closed loop (each starts its next request
when one ends) from --client-procs processes of aiohttp clients, for
--duration seconds after --warmup. Reported per point: tokens/s and requests/s
delivered in the window (a request's max_tokens, ignore_eos, spread over its
SSE events: an event carries a token's text, and a token whose text is held
back sends none), the routers' CPU per
token (their processes' user + system time over the window, /proc), ITL p50/p99
as the clients saw it against the workers' step time p50/p99 (the router's
step histogram: what the router adds is the difference), TTFT p50/p99, and
what clients got instead of tokens: 429s (and the mean Retry-After they were
told, which they honour), other statuses,
connection errors (resets) and streams that ended in an error event.

With --prefixes K the prompts share K prefixes (of --prompt-words words,
each followed by a few words of its own), and the workers' prefix-cache hit
rate over the window says whether affinity holds with N routers as with one.
(Where that CPU goes: `python -m benchmarks.router_tokens --py-spy DIR` in a checkout.)

    pdd bench frontdoor --routers 1,2,4 --concurrency 16,64,256,1024,2048
    pdd bench frontdoor --routers 1,2 --workers 2 --prefixes 8 --prompt-words 400 --concurrency 64
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import time
from pathlib import Path

from pdd.bench.commands import write_json
from pdd.bench.layouts import UpProcess, parse_layouts
from pdd.bench.scrape import metric_lines, series
from pdd.bench.serve_client import Target, first_model
from pdd.lifetime import children, serving

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
GAP_SAMPLE = 20_000   # inter-token gaps kept per client process (a uniform sample)
# What the routers say they refused or cut (their /metrics, summed by labels): who reset a client.
GUARD_COUNTERS = ("pdd_requests_rejected_total", "pdd_http_connections_refused_total", "pdd_http_clients_cut_total",
                  "pdd_http_errors_total")


# ---------------------------------------------------------------- clients (each in a process of its own)

def _retry_after(headers) -> float:
    """The wait a 429 asks for, as OpenAI's SDKs read it: `retry-after-ms` first,
    else Retry-After in seconds (1 s when neither is there)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        return float(ms) / 1000
    return float(headers.get("Retry-After", "1"))


async def _stream_loop(session, url: str, bodies: list[bytes], max_tokens: int, window: tuple[float, float],
                       tally: dict) -> None:
    t0, t1 = window
    while time.time() < t1:
        body = random.choice(bodies)
        start = time.time()
        try:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    key = "429" if resp.status == 429 else f"status_{resp.status}"
                    tally[key] = tally.get(key, 0) + 1
                    await resp.read()
                    wait = _retry_after(resp.headers) if resp.status == 429 else 0.5
                    if resp.status == 429:
                        tally["retry_after_s"] = tally.get("retry_after_s", 0.0) + wait
                    await asyncio.sleep(wait)
                    continue
                # Read as it arrives, not line by line: the events of one read came
                # together (their gaps are 0), and a client this cheap leaves the
                # host's cores to the routers it measures.
                last, events, in_window, failed = None, 0, 0, False
                async for chunk in resp.content.iter_any():
                    n = chunk.count(b"data: {")
                    if not n:
                        continue
                    now = time.time()
                    if b'data: {"error"' in chunk:
                        tally["error_events"] += 1
                        failed = True
                        break
                    events += n
                    if t0 <= now <= t1:
                        in_window += n
                        if last is None:
                            tally["ttft"].append(now - start)
                        _sample_gaps(tally, now - last if last is not None else None, n - 1)
                    last = now
                # An event is not a token: one whose text is held back (an incomplete
                # UTF-8 character, a stop string's possible start) sends none. A request
                # that ran to the end had max_tokens (ignore_eos): its share in the window.
                if events and not failed:
                    tally["tokens"] += max_tokens * in_window / events
                if t0 <= time.time() <= t1:
                    tally["requests"] += 1
        except (OSError, asyncio.TimeoutError, Exception) as e:   # aiohttp's client errors: resets, cut streams
            if time.time() < t1:
                tally["connection_errors"] += 1
                tally.setdefault("error_kinds", {}).setdefault(type(e).__name__, 0)
                tally["error_kinds"][type(e).__name__] += 1
                await asyncio.sleep(0.2)


def _sample_gaps(tally: dict, first: float | None, zeros: int) -> None:
    """A read's gaps into a uniform sample of every gap in the window (reservoir):
    `first` since the last read (None: the stream's first), then `zeros` of 0."""
    for gap in ([first] if first is not None else []) + [0.0] * zeros:
        tally["n_gaps"] += 1
        if len(tally["gaps"]) < GAP_SAMPLE:
            tally["gaps"].append(gap)
        elif (j := random.randrange(tally["n_gaps"])) < GAP_SAMPLE:
            tally["gaps"][j] = gap


def _client_process(url: str, streams: int, bodies: list[bytes], max_tokens: int, window: tuple[float, float],
                    out) -> None:
    import aiohttp
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    tally = {"tokens": 0, "requests": 0, "error_events": 0, "connection_errors": 0, "ttft": [], "gaps": [],
             "n_gaps": 0}

    async def main():
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            await asyncio.gather(*(_stream_loop(session, url, bodies, max_tokens, window, tally)
                                   for _ in range(streams)))
    asyncio.run(main())
    out.put(tally)


def prompts(concurrency: int, prompt_words: int, prefixes: int) -> list[str]:
    """One prompt of `prompt_words` words; or with `prefixes`, many prompts of
    that many shared prefixes, each with a short suffix of its own."""
    rng = random.Random(concurrency)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))   # noqa: E731
    if not prefixes:
        return [words(prompt_words)]
    heads = [words(prompt_words) for _ in range(prefixes)]
    return [f"{head} {words(6)}" for head in heads for _ in range(64)]


def run_point(url: str, model: str, concurrency: int, procs: int, max_tokens: int, prompt_words: int,
              warmup_s: float, duration_s: float, cpu_pids: list[int], metrics_url: str, prefixes: int = 0,
              router_urls: tuple[str, ...] = (), watch=contextlib.nullcontext) -> dict:
    """One point: `concurrency` streams against `url`; the steps and prefix-cache
    lookups as `metrics_url` (one router: every worker reports to each) counts them;
    `watch()` is entered for the window (a profiler, say)."""
    bodies = [json.dumps({"model": model, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True,
                          "stream": True, "temperature": 0}).encode() for p in prompts(concurrency, prompt_words,
                                                                                        prefixes)]
    procs = max(1, min(procs, concurrency))
    start = time.time() + 1.0   # the processes are up by then
    window = (start + warmup_s, start + warmup_s + duration_s)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url + "/v1/completions", concurrency // procs +
                                                         (i < concurrency % procs), bodies, max_tokens, window,
                                                         out))
               for i in range(procs)]
    guards_before = _guards(router_urls)
    for w in workers:
        w.start()
    # The CPU is read at the window's ends; /metrics (which a saturated router
    # answers late) just before and after it: the steps and prefix lookups are
    # rates over whatever interval those answers span.
    steps_before, prefix_before = _scrape(metrics_url)
    time.sleep(max(0.0, window[0] - time.time()))
    with watch():
        cpu_before, cpu_t0 = _cpu_seconds(cpu_pids), time.time()
        time.sleep(max(0.0, window[1] - time.time()))
        cpu_s = (_cpu_seconds(cpu_pids) - cpu_before) * duration_s / max(time.time() - cpu_t0, 1e-3)
    steps_after, prefix_after = _scrape(metrics_url)
    steps = _histogram_delta(steps_before, steps_after)
    hits, queries = (a - b for a, b in zip(prefix_after, prefix_before))
    tallies = [out.get() for _ in workers]   # each process ends its streams soon after the window
    for w in workers:
        w.join(60)
        if w.is_alive():
            w.kill()
    guards = {k: v - guards_before.get(k, 0.0) for k, v in _guards(router_urls).items()
              if v - guards_before.get(k, 0.0)}
    total = {k: sum(t[k] for t in tallies) for k in ("tokens", "requests", "error_events", "connection_errors")}
    for t in tallies:
        for k, v in t.items():
            if k == "429" or k.startswith("status_"):
                total[k] = total.get(k, 0) + v
    retry_after_s = sum(t.get("retry_after_s", 0.0) for t in tallies)
    kinds: dict[str, int] = {}
    for t in tallies:
        for k, v in t.get("error_kinds", {}).items():
            kinds[k] = kinds.get(k, 0) + v
    gaps = sorted(g for t in tallies for g in t["gaps"])
    ttft = sorted(x for t in tallies for x in t["ttft"])
    return {"concurrency": concurrency, **total, "error_kinds": kinds,
            "tokens_s": round(total["tokens"] / duration_s, 1), "requests_s": round(total["requests"] / duration_s, 2),
            "router_cpu_cores": round(cpu_s / duration_s, 3),
            "router_us_per_token": round(1e6 * cpu_s / total["tokens"], 2) if total["tokens"] else None,
            "itl_p50_ms": _ms(_q(gaps, 0.5)), "itl_p99_ms": _ms(_q(gaps, 0.99)),
            "step_p50_ms": _ms(_histogram_q(steps, 0.5)), "step_p99_ms": _ms(_histogram_q(steps, 0.99)),
            "ttft_p50_ms": _ms(_q(ttft, 0.5)), "ttft_p99_ms": _ms(_q(ttft, 0.99)),
            "prefix_hit_rate": round(hits / queries, 3) if queries else None, "router_guards": guards,
            "retry_after_mean_s": round(retry_after_s / total["429"], 2) if total.get("429") else None}


def _q(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


# ---------------------------------------------------------------- what the servers say

def _cpu_seconds(pids: list[int]) -> float:
    """User + system time of these processes so far, from /proc (those gone count 0)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _scrape(url: str) -> tuple[dict[float, float], tuple[float, float]]:
    """From a router's /metrics: its engine-step histogram (upper bound ->
    cumulative count, over every worker), and the workers' prefix-cache
    (hit, looked-up) prompt tokens so far."""
    steps, hits, queries = {}, 0.0, 0.0
    for line in metric_lines(url):
        if line.startswith("pdd_scheduler_iteration_latency_seconds_bucket{"):
            le = float(line.split('le="', 1)[1].split('"', 1)[0].replace("+Inf", "inf"))
            steps[le] = steps.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdd_prefix_cache_hit_tokens_total{"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdd_prefix_cache_query_tokens_total{"):
            queries += float(line.rsplit(" ", 1)[1])
    return steps, (hits, queries)


def _guards(urls) -> dict[str, float]:
    """GUARD_COUNTERS of every router, summed by series (name and labels)."""
    out: dict[str, float] = {}
    for url in urls:
        for key, value in series(metric_lines(url), GUARD_COUNTERS).items():
            out[key] = out.get(key, 0.0) + value
    return out


def _histogram_delta(before: dict, after: dict) -> dict:
    return {le: after[le] - before.get(le, 0.0) for le in after}


def _histogram_q(hist: dict[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear within its bucket."""
    bounds = sorted(hist)
    if not bounds or hist[bounds[-1]] <= 0:
        return None
    want, prev_le, prev_n = q * hist[bounds[-1]], 0.0, 0.0
    for le in bounds:
        n = hist[le]
        if n >= want:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((want - prev_n) / max(n - prev_n, 1e-9))
        prev_le, prev_n = le, n
    return prev_le


# ---------------------------------------------------------------- the cluster

class Cluster(UpProcess):
    """`pdd up --routers N` on --port, ready; its routers' URLs and processes (stop() as Ctrl-C)."""

    def __init__(self, args, routers: int, run_dir: Path):
        workers = f"colocated:{args.workers}" if args.mode == "colocated" else f"disagg:{args.prefill}p{args.decode}"
        (layout,) = parse_layouts(workers, [f"{workers}=--routers {routers}"] if routers > 1 else [])
        super().__init__(layout, run_dir, args.model, port=args.port, server_path=args.server_path)
        self.__enter__()
        try:
            from pdd.config_loader import load_cluster_config
            cfg = load_cluster_config(self.run_dir / "cluster.toml")
            # Each router's own port (one router: the port): router 0's step histogram, every router's guards.
            self.router_urls = tuple(f"http://127.0.0.1:{p}" for p in cfg.router.http_ports) or (self.url,)
            self.own_url = self.router_urls[0]
            self.model = first_model(Target(self.url))
            self.router_pids = _router_pids(self.proc.pid)
        except BaseException:
            self.stop()
            raise


def _router_pids(parent: int) -> list[int]:
    """`pdd up`'s routers and their children (the tokenizer processes): what the router CPU is."""
    routers = [pid for pid, argv in children(parent) if serving(argv, "router")]
    return routers + [pid for r in routers for pid, _ in children(r)]


def main(args) -> int:
    routers = [int(x) for x in args.routers.split(",")]
    points = [int(x) for x in args.concurrency.split(",")]
    results = []
    for n in routers:
        run_dir = Path(args.run_dir) / f"routers-{n}"
        cluster = Cluster(args, n, run_dir)
        try:
            for c in points:
                r = run_point(cluster.url, cluster.model, c, args.client_procs, args.max_tokens, args.prompt_words,
                              args.warmup, args.duration, cluster.router_pids, cluster.own_url, args.prefixes,
                              cluster.router_urls)
                r["routers"], r["server"] = n, args.server_path or "this pdd"
                results.append(r)
                print(f"routers {n}  streams {c:5d}  {r['tokens_s']:>10,.0f} tok/s  {r['requests_s']:7.1f} req/s  "
                      f"router {r['router_us_per_token']} us/token ({r['router_cpu_cores']} cores)  "
                      f"ITL p50/p99 {r['itl_p50_ms']}/{r['itl_p99_ms']} ms (steps {r['step_p50_ms']}/"
                      f"{r['step_p99_ms']})  429s {r.get('429', 0)}  resets {r['connection_errors']}  "
                      f"error events {r['error_events']}  prefix hits {r['prefix_hit_rate']}", flush=True)
                if r["router_guards"] or r["error_kinds"]:
                    print(f"    routers refused/cut: {r['router_guards']}; client errors: {r['error_kinds']}",
                          flush=True)
        finally:
            cluster.stop()
    summary = {"date": time.strftime("%Y-%m-%d"), "host_cores": os.cpu_count(), "args": vars(args) | {"func": None},
               "points": results}
    for n in routers:
        mine = [r for r in results if r["routers"] == n]
        peak = max(mine, key=lambda r: r["tokens_s"])
        print(f"routers {n}: peak {peak['tokens_s']:,.0f} tok/s at {peak['concurrency']} streams; at the most "
              f"streams {mine[-1]['tokens_s']:,.0f} ({100 * mine[-1]['tokens_s'] / max(peak['tokens_s'], 1):.0f}% "
              "of peak)")
    write_json(args.json, summary)
    return 0
