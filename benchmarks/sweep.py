"""`pdd bench serve` at each request rate, for each cluster
layout, into one report.

    python -m benchmarks.sweep --layouts colocated:2,disagg:1p1d --rates 4,8,12 \\
        --dataset mixed --num-prompts 200 --goodput ttft:500 tpot:50 --result-dir sweep/

For each layout: `pdd up` (layouts.py), warm-up requests, `bench serve` at every
rate, stop. Each rate sends prompts of its own seed (--seed + k for the k-th
rate), so no prompt is answered from the prefix cache of an earlier rate, and
every layout gets the same prompts at the same rate. --until-fail then keeps adding
--rate-step to a layout's rate until it misses its SLOs for more than 1% of
the requests. Writes sweep.json, sweep.md (the table) and sweep.png (p99 TTFT,
p99 ITL and goodput against the rate, a line per layout), plus each run's
serve JSON under LAYOUT/.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.cli import run_as_main
from benchmarks.gaps import anatomy
from pdd.bench.layouts import Layout, UpProcess, parse_layouts
from pdd.bench.scrape import metric_lines
from pdd.bench.serve_args import add_endpoint_args, add_load_args, add_report_args, add_workload_args
from pdd.bench.serve import ServeConfig, ServeResult, command_line, config_from_args, run, save, summary
from pdd.model.tokenizer import servable_copy

log = logging.getLogger(__name__)

PASS_FRACTION = 0.99    # a rate is met when at least this share of its requests meet every SLO


@dataclass
class SweepPoint:
    layout: str
    rate: float
    completed: int
    failed: int
    not_sent: int
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    tpot_p99_ms: float | None
    goodput: float | None
    slo_attainment: float | None
    result_file: str = ""
    placements: dict[str, int] = dataclasses.field(default_factory=dict)   # "kind/reason" -> decisions at this rate
    # First gaps (hand-overs) vs later ones, and the ITL tail's share of each (benchmarks.gaps)
    gaps: dict = dataclasses.field(default_factory=dict)
    # What placement estimated of each worker at the rate's end (fitted step model, leaning)
    estimates: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, layout: str, rate: float, result: ServeResult, path: str = "",
           placements: dict[str, int] | None = None) -> "SweepPoint":
        m = result.metrics
        gaps = dataclasses.asdict(anatomy([r.to_json() for r in result.outcome.records]))
        return cls(layout, rate, m.completed, m.failed, result.outcome.not_sent, m.ttft_ms.p99, m.itl_ms.p99,
                   m.tpot_ms.p99, m.goodput, m.slo_attainment, str(path), dict(placements or {}), gaps)

    def passes(self) -> bool:
        return self.slo_attainment is not None and self.slo_attainment >= PASS_FRACTION - 1e-9


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--rates {text!r}: want a comma list of numbers") from None
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates {text!r}: want rates > 0")
    return rates


def climb(rates: list[float], run_at: Callable[[float], SweepPoint], until_fail: bool = False,
          step: float = 0.0, max_rate: float = float("inf")) -> list[SweepPoint]:
    """Every rate of `rates`; with until_fail, then the last + step, + 2 step, ...
    while the newest rate still passes and max_rate is not passed."""
    points = [run_at(r) for r in rates]
    k = 1
    while until_fail and step > 0 and points[-1].passes():
        rate = round(rates[-1] + k * step, 6)
        if rate > max_rate:
            break
        points.append(run_at(rate))
        k += 1
    return points


def highest_passing(points: list[SweepPoint]) -> float | None:
    return max((p.rate for p in points if p.passes()), default=None)


def markdown(points: list[SweepPoint], slos_ms: dict[str, float]) -> str:
    fmt = lambda v, spec=".1f": "–" if v is None else format(v, spec)  # noqa: E731
    rows = ["| layout | rate (req/s) | completed | failed | TTFT p99 (ms) | ITL p99 (ms) | TPOT p99 (ms) "
            "| goodput (req/s) | met SLOs |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        met = "–" if p.slo_attainment is None else f"{100 * p.slo_attainment:.1f}%"
        rows.append(f"| {p.layout} | {p.rate:g} | {p.completed} | {p.failed} | {fmt(p.ttft_p99_ms)} "
                    f"| {fmt(p.itl_p99_ms)} | {fmt(p.tpot_p99_ms)} | {fmt(p.goodput, '.2f')} | {met} |")
    if slos_ms:
        rows.append("")
        rows.append("SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slos_ms.items())
                    + f"; a rate is met when ≥ {100 * PASS_FRACTION:g}% of its requests meet all of them.")
        for layout in dict.fromkeys(p.layout for p in points):
            best = highest_passing([p for p in points if p.layout == layout])
            rows.append(f"- {layout}: highest rate met: {'none' if best is None else f'{best:g} req/s'}")
    return "\n".join(rows) + "\n"


_PLACEMENT = re.compile(r'^pdd_placement_total\{kind="([^"]*)",reason="([^"]*)"\} ([0-9.e+]+)$')


def placement_counts(url: str) -> dict[str, int]:
    """The router's placement decisions so far, "kind/reason" -> count (its /metrics);
    empty when the server is not pdd or does not answer."""
    return {f"{m[1]}/{m[2]}": int(float(m[3])) for m in map(_PLACEMENT.match, metric_lines(url)) if m}


def _since(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n - before.get(k, 0)}


def _sweep_layout(layout: Layout, up: UpProcess, base: ServeConfig, args, out: Path) -> list[SweepPoint]:
    url = up.url
    cfg = dataclasses.replace(base, target=dataclasses.replace(base.target, url=url))
    runs = 0

    def run_at(rate: float) -> SweepPoint:
        nonlocal cfg, runs
        # NOTE: the k-th rate gets seed + k: prompts new to this cluster (none served from
        # its prefix cache), and the same at that rate for every layout.
        workload = dataclasses.replace(base.workload, seed=base.workload.seed + runs)
        placed_before = placement_counts(url)
        result = run(dataclasses.replace(cfg, workload=workload, load=dataclasses.replace(cfg.load, request_rate=rate)))
        cfg = dataclasses.replace(result.config, num_warmups=0)   # warm once per cluster; the model name is known
        runs += 1
        path = save(result, out / slug(layout), f"rate-{rate:g}.json", plots=False)
        placed = _since(placement_counts(url), placed_before)
        point = SweepPoint.of(layout.name, rate, result, path, placed)
        point.estimates = worker_estimates(up)
        g = point.gaps
        print(f"\n[{layout.name} at {rate:g} req/s]\n{summary(result)}" + (f"\nplacements: {placed}" if placed else "")
              + f"\nfirst gaps p50/p90/max {g['first_median_ms']}/{g['first_p90_ms']}/{g['first_max_ms']} ms, "
              f"later gaps p50/p99 {g['later_median_ms']}/{g['later_p99_ms']} ms, "
              f"first gaps among those >= ITL p99: {g['tail_first_share']}", flush=True)
        return point

    rates = parse_rates(args.rates)
    step = args.rate_step or (rates[-1] - rates[-2] if len(rates) > 1 else rates[-1])
    return climb(rates, run_at, args.until_fail, step, args.max_rate)


def slug(layout: Layout) -> str:
    """The layout's name as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", layout.name)


def worker_estimates(up: UpProcess) -> dict[str, dict]:
    """What the router's placement estimates of each worker now (`pdd admin
    status`: the fitted step model, queue, leaning), by worker id; empty if
    the admin socket does not answer."""
    from pdd.admin.client import call_with_config
    from pdd.config_loader import load_cluster_config

    try:
        cfg = load_cluster_config(up.run_dir / "cluster.toml")
        status = call_with_config(cfg, "status", timeout_s=10.0)
    except Exception as e:   # a diagnostic: the sweep goes on without it
        log.warning("no worker estimates from %s: %s", up.run_dir, e)
        return {}
    return {w["worker_id"]: w.get("estimate", {}) for w in status.get("workers", [])}


def add_args(p) -> None:
    p.add_argument("--layouts", default="colocated:2,disagg:1p1d",
                   help="comma list: colocated:N, disagg:PpDd, adaptive:N, adaptive:PpDd or threshold:PpDd")
    p.add_argument("--layout-args", action="append", default=[], metavar="LAYOUT=ARGS",
                   help="more `pdd up` arguments for one layout, e.g. 'adaptive:2=--some-flag' (repeatable)")
    p.add_argument("--layout-env", action="append", default=[], metavar="LAYOUT=KEY=VALUE",
                   help="an environment variable for one layout's cluster, e.g. a PDD_TABLE__KEY override")
    p.add_argument("--rates", default="4,8,12", help="comma list of request rates (requests/s)")
    p.add_argument("--until-fail", action="store_true",
                   help="after --rates, add --rate-step until each layout misses its SLOs for >1%% of requests")
    p.add_argument("--rate-step", type=float, default=None, help="default: the last gap in --rates")
    p.add_argument("--max-rate", type=float, default=256.0, help="--until-fail stops here")
    p.add_argument("--model", dest="checkpoint", default=None,
                   help="checkpoint for `pdd up` (default: its built-in tiny model); the served name is asked")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a cluster to start")
    add_endpoint_args(p)
    add_workload_args(p)
    add_load_args(p)
    add_report_args(p)
    p.set_defaults(num_warmups=2)


def main(args) -> int:
    layouts = parse_layouts(args.layouts, args.layout_args, args.layout_env)
    parse_rates(args.rates)
    base = config_from_args(args)
    if args.until_fail and not base.slos_ms:
        raise ValueError("--until-fail needs SLOs: --goodput ttft:MS tpot:MS")
    out = Path(args.result_dir)
    # A config-only checkpoint (a model shape with dummy weights) gets a stand-in
    # tokenizer, which the router needs to start.
    checkpoint = args.checkpoint and str(servable_copy(args.checkpoint, out / "model"))
    points: list[SweepPoint] = []
    for layout in layouts:
        up = UpProcess(layout, out / slug(layout), checkpoint, args.api_key, args.ready_timeout)
        with up:
            points += _sweep_layout(layout, up, base, args, out)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command_line(), "config": base.to_json(),
              "layouts": [{"name": lo.name, "up_args": list(lo.up_args), "env": lo.env} for lo in layouts],
              "until_fail": args.until_fail, "pass_fraction": PASS_FRACTION,
              "highest_rate_met": {lo.name: highest_passing([p for p in points if p.layout == lo.name])
                                   for lo in layouts},
              "points": [dataclasses.asdict(p) for p in points]}
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    table = markdown(points, base.slos_ms)
    (out / "sweep.md").write_text(table)
    if not args.no_plots:
        names = ", ".join(lo.name for lo in layouts)
        sweep_lines(report["points"], out / "sweep.png", f"{base.workload.dataset}: {names}")
    print("\n" + table + f"\nreport: {out / 'sweep.md'}, {out / 'sweep.json'}")
    return 0


def sweep_lines(points: list[dict], path: Path, title: str) -> Path:
    """p99 TTFT, p99 ITL and goodput against the request rate, one line per layout.
    `points`: dicts with layout, rate, ttft_p99_ms, itl_p99_ms, goodput."""
    from pdd.bench.plots import pyplot

    plt = pyplot()
    panels = (("ttft_p99_ms", "p99 TTFT (ms)"), ("itl_p99_ms", "p99 ITL (ms)"), ("goodput", "goodput (req/s)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    layouts = list(dict.fromkeys(p["layout"] for p in points))
    for ax, (key, label) in zip(axes, panels):
        for layout in layouts:
            xy = sorted((p["rate"], p[key]) for p in points if p["layout"] == layout and p[key] is not None)
            if xy:
                ax.plot(*zip(*xy), marker="o", label=layout)
        ax.set(xlabel="request rate (req/s)", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    run_as_main(__name__)
