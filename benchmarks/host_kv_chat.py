"""Multi-turn chat whose conversations outgrow the GPU pool, with the host KV
tier off and on: what the tier saves returning conversations.

For each --host-kv size a colocated `pdd up` is started (the pool fixed by
--kv-cache-bytes, or --num-blocks on a CPU), `pdd bench serve --dataset
multi-turn` runs against it, and its workers' counters are read from the
router's /metrics after. Printed per size: prompt tokens computed and found
cached, the host tier's hit blocks and its loads' mean wait (from a load's
start until the engine saw it done: the part of a returning turn's TTFT spent
on its history), TTFT of the later turns (the returning conversations) median
/ p99, ITL p99; then the ratios of the last size to the first.

    python -m benchmarks.host_kv_chat --model conf/models/llama-3.1-8b --load-format dummy \\
        --kv-cache-bytes 17179869184 --host-kv 0,68719476736 --num-prompts 100 --turns 8 \\
        --input-len 512:512 --output-len 128:128 --max-concurrency 16
    python -m benchmarks.host_kv_chat --device cpu --num-blocks 128 --host-kv 0,67108864 \\
        --num-prompts 12 --turns 4 --input-len 100:100 --output-len 16:16 --max-concurrency 4   # a CPU run

A config-only checkpoint (dummy weights) gets a stand-in tokenizer, as the
router needs one (pdd.model.tokenizer.servable_copy).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.cli import run_as_main
from pdd.bench.layouts import Layout, UpProcess
from pdd.bench.scrape import metric_lines, series
from pdd.bench.serve import config_from_args, run
from pdd.bench.serve_args import add_endpoint_args, add_load_args, add_report_args, add_workload_args
from pdd.model.tokenizer import servable_copy

COUNTERS = ("pdd_prefix_cache_query_tokens_total", "pdd_prefix_cache_hit_tokens_total",
            "pdd_host_kv_cache_hit_blocks_total", "pdd_host_kv_cache_evicted_blocks_total",
            "pdd_host_kv_cache_loads_total", "pdd_host_kv_cache_load_wait_seconds_total")


def add_args(p) -> None:
    p.add_argument("--model", dest="checkpoint", default=None, help="checkpoint (default: the built-in tiny model)")
    p.add_argument("--host-kv", default="0,68719476736", help="comma list of engine.host_kv_cache_bytes, a run each")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="the GPU pool (engine.kv_cache_bytes)")
    p.add_argument("--num-blocks", type=int, default=None, help="the pool in blocks instead (engine.num_blocks)")
    p.add_argument("--load-format", default=None, help="e.g. dummy (engine.load_format)")
    p.add_argument("--dtype", default=None, help="engine.dtype")
    p.add_argument("--device", default=None, help="engine.device (cpu for a run without a GPU)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a cluster to start")
    add_endpoint_args(p)
    add_workload_args(p)
    add_load_args(p)
    add_report_args(p)
    p.set_defaults(dataset="multi-turn", url="", model=None, no_plots=True)


def _engine_env(args, host_bytes: int) -> dict[str, str]:
    settings = {"HOST_KV_CACHE_BYTES": host_bytes, "KV_CACHE_BYTES": args.kv_cache_bytes,
                "NUM_BLOCKS": args.num_blocks, "LOAD_FORMAT": args.load_format, "DTYPE": args.dtype,
                "DEVICE": args.device}
    return {f"PDD_ENGINE__{k}": str(v) for k, v in settings.items() if v is not None}


def one_run(args, host_bytes: int, checkpoint: str | None, out: Path) -> dict:
    layout = Layout(f"colocated:1 host_kv={host_bytes}", ("--mode", "colocated", "--workers", "1"),
                    _engine_env(args, host_bytes))
    with UpProcess(layout, out / f"host-kv-{host_bytes}", checkpoint, args.api_key, args.ready_timeout) as url:
        args.url = url
        result = run(config_from_args(args))
        counters = series(metric_lines(url), COUNTERS)
    total = lambda name: sum(v for k, v in counters.items() if k.split("{")[0] == name)   # noqa: E731
    m = result.metrics
    later = m.ttft_ms_later_turns
    queried, hit = total(COUNTERS[0]), total(COUNTERS[1])
    return {"host_kv_cache_bytes": host_bytes, "completed": m.completed, "failed": m.failed,
            "prompt_tokens": m.total_input_tokens, "prompt_tokens_computed": m.total_input_tokens - m.total_cached_tokens,
            "prompt_tokens_cached": m.total_cached_tokens, "workers_prefix_hit_rate": round(hit / queried, 3) if queried
            else None,
            "host_hit_blocks": total(COUNTERS[2]), "host_evicted_blocks": total(COUNTERS[3]),
            "host_loads": total(COUNTERS[4]),   # a returning turn's wait for its history's load, on average:
            "host_load_wait_mean_ms": round(1000 * total(COUNTERS[5]) / total(COUNTERS[4]), 2) if total(COUNTERS[4])
            else None,
            "later_ttft_median_ms": later.median if later else None, "later_ttft_p99_ms": later.p99 if later else None,
            "itl_p99_ms": m.itl_ms.p99 if m.itl_ms else None, "duration_s": round(m.duration_s, 1)}


def main(args) -> int:
    sizes = [int(x) for x in args.host_kv.split(",")]
    out = Path(args.result_dir)
    checkpoint = args.checkpoint and str(servable_copy(args.checkpoint, out / "model"))
    rows = []
    for size in sizes:
        row = one_run(args, size, checkpoint, out)
        rows.append(row)
        print(json.dumps(row), flush=True)
    first, last = rows[0], rows[-1]
    if first["later_ttft_median_ms"] and last["later_ttft_median_ms"]:
        print(f"later turns' TTFT median {first['later_ttft_median_ms']:.1f} -> {last['later_ttft_median_ms']:.1f} ms "
              f"({first['later_ttft_median_ms'] / last['later_ttft_median_ms']:.2f}x lower); ITL p99 "
              f"{first['itl_p99_ms']:.1f} -> {last['itl_p99_ms']:.1f} ms "
              f"({last['itl_p99_ms'] / first['itl_p99_ms']:.2f}x); prompt tokens computed "
              f"{first['prompt_tokens_computed']:,.0f} -> {last['prompt_tokens_computed']:,.0f}", flush=True)
    (out / "host_kv_chat.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                       "args": {k: v for k, v in vars(args).items() if k != "func"},
                                                       "rows": rows}, indent=1, default=str))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    run_as_main(__name__)
