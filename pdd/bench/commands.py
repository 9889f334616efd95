"""The `pdd bench` subcommands' arguments. Kept apart from the benchmarks so that
building the CLI parser imports nothing heavy (torch, zmq): each benchmark
module is imported only when its subcommand runs."""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from pdd.bench.serve_args import add_serve_parser
from pdd.engine.args import add_kv_cache_dtype_arg


def _runner(module: str):
    def run(args):
        return importlib.import_module(f"pdd.bench.{module}").main(args)
    run.module = module   # tests check every subcommand's module exists
    return run


def _bench_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    """The subcommand `name`, run by pdd.bench.<name, dashes as underscores>.main."""
    b = sub.add_parser(name, help=help)
    b.set_defaults(func=_runner(name.replace("-", "_")))
    return b


def add_json_arg(b: argparse.ArgumentParser) -> None:
    b.add_argument("--json", default=None, help="write the figures to this JSON file")


def write_json(path: str | None, figures) -> None:
    """--json FILE: the figures written there (nothing without it)."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=2, default=str) + "\n")


def add_tiny_model_arg(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")


def add_bench_parsers(sub, add_engine_args) -> None:
    add_serve_parser(sub, _runner)

    b = _bench_parser(sub, "frontdoor", "tokens/s and requests/s the routers deliver against concurrency, for 1, 2, "
                      "4 routers; router CPU per token; what clients get past saturation (429s, resets)")
    add_tiny_model_arg(b)
    b.add_argument("--routers", default="1,2,4", help="comma list of router counts, a cluster each")
    b.add_argument("--concurrency", default="16,64,256,1024,2048", help="comma list of streams in flight")
    b.add_argument("--mode", default="colocated", choices=["colocated", "disagg"], help="the workers' layout")
    b.add_argument("--workers", type=int, default=1, help="colocated workers")
    b.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg)")
    b.add_argument("--decode", type=int, default=1, help="decode workers (disagg)")
    b.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request (ignore_eos)")
    b.add_argument("--prompt-words", type=int, default=24, help="words of each prompt")
    b.add_argument("--prefixes", type=int, default=0,
                   help="prompts share this many prefixes of --prompt-words words (0: one prompt for all)")
    b.add_argument("--client-procs", type=int, default=8, help="client processes the streams are spread over")
    b.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each window")
    b.add_argument("--duration", type=float, default=15.0, help="seconds measured at each point")
    b.add_argument("--port", type=int, default=18080, help="the routers' HTTP port")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-frontdoor", help="where the clusters' logs go")
    b.add_argument("--server-path", default=None, metavar="DIR",
                   help="run the clusters from the pdd package under DIR (e.g. an older commit's, for a "
                        "before/after in one sitting); the clients stay this pdd's")
    add_json_arg(b)

    b = _bench_parser(sub, "chaos", "fault scenarios at a fixed load, each on a throw-away cluster")
    b.add_argument("--scenarios", default="", help="comma list (default: all): kill-decode, kill-prefill, "
                   "hang-decode, transfer-fail-cleared, transfer-fail-0.3, abort-storm, overload")
    b.add_argument("--model", default=None, help="checkpoint for `pdd up` (default: its built-in tiny model)")
    b.add_argument("--request-rate", type=float, default=4.0, help="requests/s of the load")
    b.add_argument("--max-concurrency", type=int, default=32, help="load requests in flight at most")
    b.add_argument("--duration", type=float, default=30.0, help="seconds of load per scenario")
    b.add_argument("--fault-at", type=float, default=1 / 3, help="the fault comes at this share of --duration")
    b.add_argument("--clear-at", type=float, default=2 / 3, help="... and is cleared (where it is) at this share")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens of each load request")
    b.add_argument("--output-len", type=int, default=64, help="max_tokens of each load request")
    b.add_argument("--seed", type=int, default=0, help="seed of the load's prompts and arrivals")
    b.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a cluster to start")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-chaos", help="each scenario's `pdd up` logs go here")
    add_json_arg(b)

    add_gpu_args(_bench_parser(sub, "gpu", "decode and prefill step times against the H200 roofline"))


def add_gpu_args(b: argparse.ArgumentParser) -> None:
    """`pdd bench gpu`'s flags (benchmarks.gpu_steps takes them too, beside its own)."""
    b.add_argument("--model", default="conf/models/llama-3.1-8b",
                   help="checkpoint (config-only is enough with dummy weights)")
    b.add_argument("--load-format", default="dummy", help="dummy: random weights of the checkpoint's shapes")
    add_kv_cache_dtype_arg(b)
    b.add_argument("--batches", default="1,32,128", help="comma list of decode batch sizes")
    b.add_argument("--context", type=int, default=1024, help="context tokens of each decoding request")
    b.add_argument("--steps", type=int, default=60, help="decode steps timed per batch size")
    b.add_argument("--prefill", default="4096,16384", help="comma list of prompt lengths timed")
    b.add_argument("--prefill-reps", type=int, default=3, help="timed prefills per length")
    b.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    b.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before scheduling the next")
    b.add_argument("--warm-up", action="store_true",
                   help="run the engine's warm-up first, as a worker does, and print each kernel compiled after it")
    add_json_arg(b)
