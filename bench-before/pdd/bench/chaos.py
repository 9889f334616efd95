"""`pdd bench chaos`: each fault scenario at a fixed load against a throw-away cluster.

    pdd bench chaos [--scenarios kill-decode,transfer-fail-0.3] [--model DIR] \\
        [--request-rate 4] [--max-concurrency 16] [--duration 30] [--json chaos.json]

For each scenario: `pdd up` in its layout (pdd.bench.layouts), the `bench serve`
load (random prompts at --request-rate, pdd.bench.runner) for --duration
seconds, the fault injected at --fault-at of it (and cleared at --clear-at for
the faults that are), then the cluster drains and every worker's blocks are
counted. Reported per scenario:

    sent / completed / failed   the load's requests (a burst's are counted apart)
    TTFT p99, ITL p99           of requests sent, and of gaps ending, during the fault
                                (from injection to clearing, or to the end of the load)
    back after                  seconds from the fault until the first token of the
                                first request that succeeded among those sent after
                                the fault and after the last one that failed
    leaked blocks               per worker, num_blocks - free_blocks once idle
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from pdd.bench.layouts import UpProcess, parse_layouts
from pdd.bench.metrics_calc import latency_stats
from pdd.bench.runner import LoadConfig, run_load
from pdd.bench.serve_client import RequestRecord, Target, build_body, send, served_model
from pdd.bench.workloads import WorkloadConfig, build_workload
from pdd.model.tokenizer import servable_copy

RUNTIME_FAULTS = {"PDD_ROUTER__ALLOW_FAULT_INJECTION": "1"}
DRAIN_TIMEOUT_S = 120.0
COUNTERS = ("pdd_request_migrations_total", "pdd_kv_transfer_failures_total", "pdd_disagg_fallbacks_total",
            "pdd_requests_rejected_total", "pdd_breaker_transitions_total")


class Chaos:
    """The running cluster, as a scenario's actions see it."""

    def __init__(self, run_dir: Path, target: Target, items: list):
        from pdd.config_loader import load_cluster_config
        self.target, self.items = target, items
        self.cfg = load_cluster_config(run_dir / "cluster.toml")
        self.burst: list[RequestRecord] = []

    def admin(self, cmd: str, *args):
        from pdd.admin.client import call_with_config
        return call_with_config(self.cfg, cmd, *args, timeout_s=30.0)

    def workers(self) -> dict[str, dict]:
        return {w["worker_id"]: w for w in self.admin("workers")}


Action = Callable[[Chaos], object]   # may be a coroutine function (bursts)


def kill(worker: str) -> Action:
    def act(c: Chaos) -> None:
        os.kill(c.workers()[worker]["pid"], signal.SIGKILL)   # `pdd up` restarts it
    return act


def set_faults(spec: str, worker: str | None = None) -> Action:
    return lambda c: c.admin("faults", "set", spec, *([worker] if worker else []))


def clear_faults(c: Chaos) -> None:
    c.admin("faults", "clear")


def abort_storm(n: int) -> Action:
    """n streams at once whose clients leave after a random 0-2 s (some before their first token)."""
    async def act(c: Chaos) -> None:
        rng = random.Random(n)
        async with aiohttp.ClientSession() as session:
            async def leave(k: int) -> None:
                body, _ = build_body(c.target, c.items[k % len(c.items)], 0, [], True)
                rec = RequestRecord(-1, 0, 0, 0)
                try:
                    await asyncio.wait_for(send(session, c.target, body, rec, time.perf_counter()), rng.uniform(0, 2))
                except asyncio.TimeoutError:
                    rec.error = "left"
                c.burst.append(rec)
            await asyncio.gather(*(leave(k) for k in range(n)))
    return act


def overload(n: int) -> Action:
    """n requests at once (the cluster's router.max_queued_requests is small)."""
    async def act(c: Chaos) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def one(k: int) -> None:
                body, _ = build_body(c.target, c.items[k % len(c.items)], 0, [], True)
                c.burst.append(await send(session, c.target, body, RequestRecord(-1, 0, 0, 0), time.perf_counter()))
            await asyncio.gather(*(one(k) for k in range(n)))
    return act


@dataclass(frozen=True)
class Scenario:
    layout: str
    inject: Action
    clear: Action | None = None
    env: dict[str, str] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {
    "kill-decode": Scenario("disagg:1p1d", kill("decode-0")),
    "kill-prefill": Scenario("disagg:1p1d", kill("prefill-0")),
    "hang-decode": Scenario("disagg:1p2d", set_faults("decode.hang_after_steps=1", "decode-0"), clear_faults,
                            {**RUNTIME_FAULTS, "PDD_WORKER__STEP_TIMEOUT_S": "5"}),
    "transfer-fail-cleared": Scenario("disagg:1p1d", set_faults("transfer.fail_rate=1"), clear_faults,
                                      {**RUNTIME_FAULTS, "PDD_ROUTER__BREAKER__COOLDOWN_S": "2"}),
    "transfer-fail-0.3": Scenario("disagg:1p1d", set_faults("transfer.fail_rate=0.3"), env=RUNTIME_FAULTS),
    "abort-storm": Scenario("disagg:1p1d", abort_storm(100)),
    "overload": Scenario("disagg:1p1d", overload(300), env={"PDD_ROUTER__MAX_QUEUED_REQUESTS": "16"}),
}


@dataclass
class ScenarioResult:
    scenario: str
    layout: str
    sent: int
    completed: int
    failed: int
    fault_at_s: float
    fault_end_s: float
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    back_after_s: float | None
    leaked_blocks: dict[str, int]
    burst: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)


def run_scenario(name: str, args, work_dir: Path) -> ScenarioResult:
    sc = SCENARIOS[name]
    (layout,) = parse_layouts(sc.layout, extra_env=[f"{sc.layout}={k}={v}" for k, v in sc.env.items()])
    items = build_workload(WorkloadConfig(dataset="random", num_prompts=math.ceil(args.request_rate * args.duration),
                                          input_len=(args.input_len, args.input_len),
                                          output_len=(args.output_len, args.output_len), seed=args.seed))
    load = LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      duration_s=args.duration, request_timeout_s=600.0, seed=args.seed)
    fault_at, clear_at = args.fault_at * args.duration, args.clear_at * args.duration
    with UpProcess(layout, work_dir / name, args.model, ready_timeout_s=args.ready_timeout) as url:
        target = Target(url, model=asyncio.run(_served_model(url)))
        chaos = Chaos(work_dir / name / "run", target, items)
        expected_workers = len(chaos.workers())

        async def timeline(t0: float) -> None:
            await _at(t0 + fault_at, sc.inject, chaos)
            if sc.clear is not None:
                await _at(t0 + clear_at, sc.clear, chaos)

        async def main():
            t0 = time.perf_counter()
            actions = asyncio.create_task(timeline(t0))
            outcome = await run_load(target, items, load)
            await actions
            return outcome
        outcome = asyncio.run(main())
        fault_end = clear_at if sc.clear is not None else args.duration
        leaked = _drained_leaks(chaos, expected_workers)
        counters = _counters(url)
    return _result(name, sc.layout, outcome.records, fault_at, fault_end, leaked, chaos.burst, counters)


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        return await served_model(session, Target(url))


async def _at(when: float, action: Action, chaos: Chaos) -> None:
    await asyncio.sleep(max(0.0, when - time.perf_counter()))
    result = await asyncio.get_running_loop().run_in_executor(None, action, chaos)
    if asyncio.iscoroutine(result):
        await result


def _drained_leaks(c: Chaos, expected_workers: int) -> dict[str, int]:
    """Once nothing is in flight and every worker (a killed one restarted) reports,
    the blocks each one still holds."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        workers = c.workers()
        idle = not c.admin("requests") and len(workers) >= expected_workers and all(
            w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["num_blocks"] for w in workers.values())
        if idle or time.monotonic() > deadline:
            return {wid: w["num_blocks"] - w["free_blocks"] for wid, w in sorted(workers.items())}
        time.sleep(0.2)


def _counters(url: str) -> dict[str, float]:
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(COUNTERS):
            key, _, value = line.rpartition(" ")
            if float(value):
                out[key] = float(value)
    return out


def _result(name: str, layout: str, records: list[RequestRecord], fault_at: float, fault_end: float,
            leaked: dict[str, int], burst: list[RequestRecord], counters: dict[str, float]) -> ScenarioResult:
    ok = [r for r in records if r.success]
    during = [r for r in ok if fault_at <= r.start_s < fault_end]
    gaps = []
    for r in ok:
        t = r.start_s + r.ttft_s
        for g in r.itl_s:
            t += g
            if fault_at <= t < fault_end:
                gaps.append(g)
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return ScenarioResult(
        name, layout, len(records), len(ok), len(records) - len(ok), round(fault_at, 3), round(fault_end, 3),
        latency_stats([r.ttft_s for r in during]).p99, latency_stats(gaps).p99, back_after(records, fault_at),
        leaked, _burst_counts(burst), errors, counters)


def back_after(records: list[RequestRecord], fault_at: float) -> float | None:
    """Seconds from the fault to the first token of the first successful request
    sent after both the fault and the last failed request (None: not back by the end)."""
    last_failed = max((r.start_s for r in records if not r.success and r.start_s >= fault_at), default=fault_at)
    firsts = [r.start_s + r.ttft_s for r in records if r.success and r.start_s >= last_failed]
    return round(min(firsts) - fault_at, 3) if firsts else None


def _burst_counts(burst: list[RequestRecord]) -> dict[str, int]:
    if not burst:
        return {}
    counts = {"sent": len(burst), "completed": sum(r.success for r in burst),
              "left": sum(r.error == "left" for r in burst),
              "http_429": sum(r.error.startswith("HTTP 429") for r in burst),
              "http_5xx": sum(r.error.startswith("HTTP 5") for r in burst)}
    counts["other_failures"] = counts["sent"] - sum(counts[k] for k in ("completed", "left", "http_429", "http_5xx"))
    return counts


def table(results: list[ScenarioResult]) -> str:
    ms = lambda v: "-" if v is None else f"{v:.0f}"   # noqa: E731
    head = f"{'scenario':<22} {'sent':>5} {'done':>5} {'fail':>5} {'TTFT p99':>9} {'ITL p99':>8} {'back s':>7}  leaked blocks"
    lines = [head, "-" * len(head)]
    for r in results:
        back = "-" if r.back_after_s is None else f"{r.back_after_s:.2f}"
        leaks = " ".join(f"{w}={n}" for w, n in r.leaked_blocks.items())
        lines.append(f"{r.scenario:<22} {r.sent:>5} {r.completed:>5} {r.failed:>5} {ms(r.ttft_p99_ms):>9} "
                     f"{ms(r.itl_p99_ms):>8} {back:>7}  {leaks}")
        if r.burst:
            lines.append(f"{'':<22} burst: " + ", ".join(f"{k} {v}" for k, v in r.burst.items()))
        if r.counters:
            lines.append(f"{'':<22} " + ", ".join(f"{k.removeprefix('pdd_')} {v:g}" for k, v in r.counters.items()))
        for err, n in list(r.errors.items())[:3]:
            lines.append(f"{'':<22} x{n} {err}")
    return "\n".join(lines)


def main(args) -> int:
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()] if args.scenarios else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ValueError(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    if not (0 <= args.fault_at < args.clear_at <= 1) or args.request_rate <= 0 or math.isinf(args.request_rate):
        raise ValueError("want 0 <= --fault-at < --clear-at <= 1 and a finite --request-rate > 0")
    if args.model:   # a config-only checkpoint (dummy weights) gets a stand-in tokenizer for the router
        args.model = str(servable_copy(args.model, Path(args.run_dir) / "model"))
    results = []
    for name in names:
        print(f"bench chaos: {name} ...", flush=True)
        results.append(run_scenario(name, args, Path(args.run_dir)))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": {
            k: v for k, v in vars(args).items() if k != "func"}, "results": [asdict(r) for r in results]}, indent=1))
    return 0
