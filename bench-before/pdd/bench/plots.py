"""PNG plots of `pdd bench serve` and `pdd bench sweep` results (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from pathlib import Path

from pdd.bench.metrics_calc import tpot_s
from pdd.bench.serve_client import RequestRecord


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(records: list[RequestRecord], path: Path, title: str) -> Path:
    """One panel per metric: the fraction of samples at or below each latency."""
    plt = _pyplot()
    ok = [r for r in records if r.success]
    samples = {"TTFT": [r.ttft_s for r in ok], "ITL": [g for r in ok for g in r.itl_s],
               "TPOT": [t for t in map(tpot_s, ok) if t is not None], "E2E latency": [r.e2el_s for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, xs) in zip(axes.flat, samples.items()):
        ms = sorted(1e3 * x for x in xs)
        if ms:
            ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post")
        ax.set(title=f"{name} ({len(ms)} samples)", xlabel="ms", ylabel="fraction ≤ x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_lines(points: list[dict], path: Path, title: str) -> Path:
    """p99 TTFT, p99 ITL and goodput against the request rate, one line per layout.
    `points`: dicts with layout, rate, ttft_p99_ms, itl_p99_ms, goodput."""
    plt = _pyplot()
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
