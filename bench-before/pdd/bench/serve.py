"""`pdd bench serve`: a load test of any OpenAI-compatible server (pdd, vLLM,
SGLang), streaming, with the metrics of vLLM's serving benchmark.

    pdd bench serve --url http://127.0.0.1:8000 --dataset mixed --num-prompts 200 \\
        --request-rate 8 --goodput ttft:500 tpot:50 --result-dir results/

Prints a summary; writes a JSON result (command, config, counts, every metric,
per-request records) and a PNG of the latency CDFs into --result-dir.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdd.bench.metrics_calc import METRICS, Metrics, compute
from pdd.bench.runner import LoadConfig, RunOutcome, run_load
from pdd.bench.serve_client import Target, served_model
from pdd.bench.workloads import WorkloadConfig, build_workload, warmup_config


@dataclass(frozen=True)
class ServeConfig:
    target: Target
    workload: WorkloadConfig
    load: LoadConfig
    slos_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)
    num_warmups: int = 0
    progress: bool = True

    def to_json(self) -> dict:
        target = {"url": self.target.url, "endpoint": self.target.endpoint, "model": self.target.model}
        load = dataclasses.asdict(self.load)
        load["request_rate"] = "inf" if math.isinf(self.load.request_rate) else self.load.request_rate
        return {"target": target, "workload": dataclasses.asdict(self.workload), "load": load,
                "slos_ms": self.slos_ms, "percentiles": list(self.percentiles), "num_warmups": self.num_warmups}


@dataclass
class ServeResult:
    config: ServeConfig       # with the served model name filled in
    num_requests: int         # planned: every turn of every item
    outcome: RunOutcome
    metrics: Metrics

    def to_json(self, command: str) -> dict:
        return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, "config": self.config.to_json(),
                "num_requests": self.num_requests, "completed": self.metrics.completed,
                "failed": self.metrics.failed, "not_sent": self.outcome.not_sent,
                "metrics": self.metrics.to_json(), "requests": [r.to_json() for r in self.outcome.records]}


def config_from_args(args) -> ServeConfig:
    chat = args.endpoint == "/v1/chat/completions"
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "text" if chat or args.dataset == "multi-turn" else "ids"
    if chat and fmt == "ids":
        raise ValueError("chat messages are text: use --prompt-format text with /v1/chat/completions")
    workload = WorkloadConfig(
        dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        long_input_len=args.long_input_len, long_fraction=args.long_fraction, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, turns=args.turns, prompt_format=fmt, token_id_range=args.token_id_range,
        seed=args.seed)
    load = LoadConfig(request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, duration_s=args.duration,
                      request_timeout_s=args.request_timeout, ignore_eos=args.ignore_eos, seed=args.seed)
    # sweep has no --url (each layout's cluster gives one) and its --model is the checkpoint
    target = Target(getattr(args, "url", ""), args.endpoint, getattr(args, "model", None) or "", args.api_key)
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p)
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: want e.g. 50,90,99") from None
    return ServeConfig(target, workload, load, dict(args.goodput or []), percentiles, args.num_warmups,
                       not args.disable_tqdm)


def run(cfg: ServeConfig) -> ServeResult:
    """Warm up, then one measured run of cfg's workload."""
    items = build_workload(cfg.workload)
    if not cfg.target.model:
        cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, model=asyncio.run(_model(cfg.target))))
    if cfg.num_warmups:
        warm = build_workload(warmup_config(cfg.workload, cfg.num_warmups))
        outcome = asyncio.run(run_load(cfg.target, warm, dataclasses.replace(cfg.load, request_rate=math.inf,
                                                                            duration_s=None)))
        bad = [r.error for r in outcome.records if not r.success]
        if bad:
            raise ValueError(f"{len(bad)} warm-up request(s) to {cfg.target.url} failed, e.g. {bad[0]}")
    total = sum(len(item.turns) for item in items)
    from tqdm import tqdm
    with tqdm(total=total, disable=not cfg.progress, unit="req", desc="bench serve") as bar:
        outcome = asyncio.run(run_load(cfg.target, items, cfg.load, on_done=lambda r: bar.update(1)))
    return ServeResult(cfg, total, outcome, compute(outcome.records, outcome.duration_s, cfg.slos_ms,
                                                    list(cfg.percentiles)))


async def _model(target: Target) -> str:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await served_model(session, target)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"{target.url}/v1/models: {type(e).__name__}: {e}") from None


def summary(result: ServeResult, metrics: tuple[str, ...] = METRICS) -> str:
    """The figures as a readable table."""
    m, cfg = result.metrics, result.config
    rate = cfg.load.request_rate
    lines = [f"target      {cfg.target.url}{cfg.target.endpoint}  model {cfg.target.model}",
             f"workload    {cfg.workload.dataset}, {result.num_requests} requests, "
             f"rate {'inf' if math.isinf(rate) else f'{rate:g}/s'}"
             + (f", max concurrency {cfg.load.max_concurrency}" if cfg.load.max_concurrency else ""),
             f"requests    {m.completed} completed, {m.failed} failed, {result.outcome.not_sent} not sent, "
             f"in {m.duration_s:.2f} s",
             f"tokens      {m.total_input_tokens:,} in, {m.total_output_tokens:,} out",
             f"throughput  {m.request_throughput:.2f} req/s, {m.output_throughput:,.1f} output tok/s, "
             f"{m.total_token_throughput:,.1f} total tok/s"]
    if m.goodput is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in m.slos_ms.items())
        lines.append(f"goodput     {m.goodput:.2f} req/s ({slos}; {100 * m.slo_attainment:.1f}% of requests met them)")
    extra = [p for p in m.ttft_ms.percentiles if p not in ("p50", "p90", "p99")]   # those have columns
    head = ["ms", "mean", "median", "p90", "p99", *extra]
    lines += ["", "  ".join(f"{h:>9}" for h in head)]
    for name in metrics:
        s = getattr(m, f"{name}_ms")
        row = [s.mean, s.median, s.p90, s.p99, *(s.percentiles[p] for p in extra)]
        lines.append("  ".join([f"{name.upper():>9}"] + [f"{'-' if v is None else f'{v:.2f}':>9}" for v in row]))
    for e in m.errors[:5]:
        lines.append(f"error x{e['count']}: {e['error']}")
    return "\n".join(lines)


def save(result: ServeResult, result_dir: str | Path, filename: str | None, plots: bool) -> Path:
    rate = result.config.load.request_rate
    name = filename or (f"serve-{result.config.workload.dataset}-{'inf' if math.isinf(rate) else f'{rate:g}'}qps-"
                        f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    path = Path(result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(command_line()), indent=1))
    if plots:
        from pdd.bench.plots import latency_cdfs
        latency_cdfs(result.outcome.records, path.with_suffix(".png"), f"{result.config.workload.dataset}, "
                     f"{'inf' if math.isinf(rate) else f'{rate:g}'} req/s")
    return path


def command_line() -> str:
    """argv as typed, an API key masked."""
    out, hide = [], False
    for a in sys.argv:
        out.append("***" if hide else "--api-key=***" if a.startswith("--api-key=") else a)
        hide = a == "--api-key"
    return shlex.join(out)


def main(args) -> int:
    cfg = config_from_args(args)
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {', '.join(METRICS)}")
    result = run(cfg)
    print(summary(result, tuple(args.percentile_metrics.split(","))))
    path = save(result, args.result_dir, args.result_filename, not args.no_plots)
    print(f"result: {path}")
    return 0 if result.metrics.completed else 1
