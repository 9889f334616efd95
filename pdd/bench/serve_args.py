"""Arguments of `pdd bench serve` (and of benchmarks.sweep), named after
`vllm bench serve` where it has the flag. Only argparse here: building the CLI
parser must not import aiohttp, numpy or matplotlib."""
from __future__ import annotations

import argparse

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def int_range(text: str) -> tuple[int, int]:
    """"N" or "MIN:MAX"."""
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or MIN:MAX") from None


def slo(text: str) -> tuple[str, float]:
    """"ttft:500" -> ("ttft", 500.0)."""
    name, _, ms = text.partition(":")
    try:
        return name, float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want METRIC:MILLISECONDS, e.g. ttft:500") from None


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first at /v1/models)")
    add_endpoint_args(p)


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS, help="the API the requests go to")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", "--dataset-name", default="random",
                   choices=["random", "mixed", "shared-prefix", "multi-turn"], help="the workload's prompts")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (multi-turn: conversations)")
    p.add_argument("--input-len", type=int_range, default=None, metavar="MIN:MAX",
                   help="prompt tokens (mixed: the short class; shared-prefix: the suffix; multi-turn: "
                        "each user turn); default per dataset")
    p.add_argument("--output-len", type=int_range, default=None, metavar="MIN:MAX", help="max_tokens")
    p.add_argument("--long-input-len", type=int_range, default=(8192, 16384), metavar="MIN:MAX",
                   help="mixed: the long class")
    p.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long prompts")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each common prefix")
    p.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    p.add_argument("--prompt-format", default="auto", choices=["auto", "ids", "text"],
                   help="token ids or text (auto: text for chat and multi-turn, else ids)")
    p.add_argument("--token-id-range", type=int_range, default=(10, 1000), metavar="LO:HI",
                   help="random token ids are drawn from [LO, HI)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals")


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1: Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--duration", type=float, default=None, help="send nothing after this many seconds")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (not OpenAI's field; pdd, vLLM and SGLang honour it)")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not measured")


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--result-dir", default=".", help="where the JSON result and plots go")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics in the summary")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma list of percentiles reported (besides mean, median, p90 and p99 always)")
    p.add_argument("--goodput", type=slo, nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs of goodput: ttft, tpot, e2el in milliseconds, e.g. ttft:500 tpot:50")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_parser(sub, runner) -> None:
    b = sub.add_parser("serve", help="load test any OpenAI-compatible server (vLLM-style metrics)")
    add_target_args(b)
    add_workload_args(b)
    add_load_args(b)
    add_report_args(b)
    b.add_argument("--result-filename", default=None, help="default: serve-DATASET-RATEqps-TIME.json")
    b.set_defaults(func=runner("serve"))

