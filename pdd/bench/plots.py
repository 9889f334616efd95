"""PNG plots of `pdd bench serve` results (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from pathlib import Path

from pdd.bench.metrics_calc import tpot_s
from pdd.bench.serve_client import RequestRecord


def pyplot():
    """matplotlib's pyplot on the Agg backend (benchmarks.sweep draws with it too)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(records: list[RequestRecord], path: Path, title: str) -> Path:
    """One panel per metric: the fraction of samples at or below each latency."""
    plt = pyplot()
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

