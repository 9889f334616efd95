"""Throw-away clusters started in this process (start_cluster: the launcher's
handles, for these benchmarks and the tests), and bursts for the older
benchmarks (benchmarks.serving, benchmarks.disagg): all prompts at once or one
at a time, measured with the `pdd bench serve` client and metric definitions
(serve_client, metrics_calc)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from pdd.bench.metrics_calc import compute
from pdd.bench.runner import LoadConfig, run_load
from pdd.bench.serve_client import Target
from pdd.bench.workloads import Item, Turn


def _burst(url: str, model: str, prompts: list[list[int]], max_tokens: int, max_concurrency: int | None) -> dict:
    items = [Item((Turn(p, len(p), max_tokens),)) for p in prompts]
    out = asyncio.run(run_load(Target(url, model=model), items, LoadConfig(max_concurrency=max_concurrency,
                                                                          request_timeout_s=3600)))
    bad = [r.error for r in out.records if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(items)} requests failed, e.g. {bad[0]}")
    m = compute(out.records, out.duration_s)
    return {"chunks": m.total_output_tokens, "wall_s": m.duration_s, "tok_s": m.output_throughput,
            "ttft_mean_ms": m.ttft_ms.mean, "ttft_p50_ms": m.ttft_ms.median, "ttft_p99_ms": m.ttft_ms.p99,
            "itl_mean_ms": m.itl_ms.mean or 0.0, "itl_p50_ms": m.itl_ms.median, "itl_p99_ms": m.itl_ms.p99}


def burst(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once, streaming; figures over every request."""
    return _burst(url, model, prompts, max_tokens, None)


def one_at_a_time(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt after the previous one finished: latency without queueing."""
    return _burst(url, model, prompts, max_tokens, 1)


def start_cluster(run_dir: str | Path, workers: list[tuple[str, str, str | None]], model: str | None = None,
                  mode: str = "auto", engine: dict | None = None, worker: dict | None = None):
    """A cluster on fresh loopback ports, ready; the caller stops it."""
    from pdd.config_loader import load_cluster_config
    from pdd.launcher import free_port
    from pdd.model.make_model import resolve_model_dir
    from pdd.supervisor import Cluster

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
    cluster.model_name = cfg.served_model_names(resolve_model_dir(model))[0]
    return cluster
