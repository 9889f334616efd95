"""The `pdd bench` subcommands' arguments. Kept apart from the benchmarks so that
building the CLI parser imports nothing heavy (torch, zmq): each benchmark
module is imported only when its subcommand runs."""
from __future__ import annotations

import argparse
import importlib

from pdd.bench.serve_args import add_serve_parser, add_sweep_parser
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


def _add_json_arg(b: argparse.ArgumentParser) -> None:
    b.add_argument("--json", default=None, help="write the figures to this JSON file")


def _add_tiny_model_arg(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")


def add_bench_parsers(sub, add_engine_args) -> None:
    add_serve_parser(sub, _runner)
    add_sweep_parser(sub, _runner)

    b = _bench_parser(sub, "gaps", "a saved serve result's token gaps: first (hand-over) vs later (decode) gaps")
    b.add_argument("files", nargs="+", help="result JSON files written by `pdd bench serve` or `sweep`")
    b.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")

    b = _bench_parser(sub, "offline", "offline engine throughput: batched vs one at a time vs HF")
    add_engine_args(b)
    b.add_argument("--num-requests", type=int, default=64, help="prompts in the batch")
    b.add_argument("--min-prompt", type=int, default=16, help="shortest prompt, tokens")
    b.add_argument("--max-prompt", type=int, default=256, help="longest prompt, tokens")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    b.add_argument("--hf", action="store_true", help="also time HF transformers generate, one at a time")
    b.add_argument("--hf-batched", action="store_true", help="also time HF generate on all prompts at once")
    b.add_argument("--hf-cb", action="store_true",
                   help="also time HF generate_batch (its continuous batching) on all prompts")
    b.add_argument("--no-solo", action="store_true", help="skip pdd one-request-at-a-time")
    b.add_argument("--passes", type=int, default=2, help="batched passes; the last one is reported")
    b.add_argument("--ttft-by-length", action="store_true",
                   help="instead: time to first token of short and long prompts arriving together, in steps "
                        "and seconds, first come first served vs short prompts first (--long-prefill-token-threshold)")
    b.add_argument("--long-share", type=float, default=0.1, help="--ttft-by-length: the share of long prompts")
    b.add_argument("--min-long-prompt", type=int, default=8192, help="--ttft-by-length: shortest long prompt, tokens")
    b.add_argument("--max-long-prompt", type=int, default=16384, help="--ttft-by-length: longest long prompt, tokens")
    _add_json_arg(b)

    b = _bench_parser(sub, "serving", "serving-stack overhead vs the in-process engine")
    _add_tiny_model_arg(b)
    b.add_argument("--concurrency", default="1,64,512", help="comma list of requests in flight at once, one run each")
    b.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-serving", help="where the cluster's logs and config go")
    _add_json_arg(b)

    b = _bench_parser(sub, "disagg", "TTFT and total time, disaggregated vs colocated")
    _add_tiny_model_arg(b)
    b.add_argument("--num-requests", type=int, default=64, help="requests per layout")
    b.add_argument("--min-prompt", type=int, default=64, help="shortest prompt, tokens")
    b.add_argument("--max-prompt", type=int, default=512, help="longest prompt, tokens")
    b.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    b.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated run)")
    b.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated run)")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-disagg", help="where each cluster's logs and config go")
    b.add_argument("--sequential", action="store_true", help="one request at a time (TTFT without queueing)")
    b.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes")
    b.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    add_kv_cache_dtype_arg(b)
    b.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="each worker's KV cache budget (default: engine.kv_cache_bytes / gpu_memory_utilization)")
    b.add_argument("--transfer-backend", default="auto", choices=["auto", "tcp", "cuda_ipc", "nixl"],
                   help="the KV data plane between the workers")
    _add_json_arg(b)

    b = _bench_parser(sub, "frontdoor", "tokens/s and requests/s the routers deliver against concurrency, for 1, 2, "
                      "4 routers; router CPU per token; what clients get past saturation (429s, resets)")
    _add_tiny_model_arg(b)
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
    _add_json_arg(b)

    b = _bench_parser(sub, "stall", "a live stream's token gaps while huge text prompts arrive (router loop)")
    _add_tiny_model_arg(b)
    b.add_argument("--big-prompts", type=int, default=4, help="huge prompts sent while the stream runs")
    b.add_argument("--body-bytes", type=int, default=4_000_000, help="each big prompt's JSON body, about")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-stall", help="where the cluster's logs and config go")
    _add_json_arg(b)

    b = _bench_parser(sub, "grammar-stall", "a live stream's token gaps while slow-to-compile grammars arrive "
                                             "(compiles off the engine step)")
    _add_tiny_model_arg(b)
    b.add_argument("--grammars", type=int, default=48,
                   help="requests sent at once, each with its own slow regex (a{1000}){N}, N = 2..K+1")
    b.add_argument("--alone-s", type=float, default=1.0, help="seconds the stream's gaps are measured alone first")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-grammar-stall", help="where the cluster's logs and config go")
    _add_json_arg(b)

    b = _bench_parser(sub, "router-cost", "the router's CPU per streamed token (us/token) at a few concurrencies")
    _add_tiny_model_arg(b)
    b.add_argument("--streams", default="64,256", help="comma list of concurrent streams, one level each")
    b.add_argument("--max-tokens", type=int, default=256, help="tokens per request (ignore_eos)")
    b.add_argument("--rounds", type=int, default=2, help="times each level's streams run, one after the other")
    b.add_argument("--prompt-words", type=int, default=24, help="words in the prompt")
    b.add_argument("--py-spy", default=None, metavar="DIR", help="also record the router with py-spy (raw "
                   "folded stacks in DIR) and print the top of the profile")
    b.add_argument("--top", type=int, default=15, help="--py-spy: functions printed per level")
    b.add_argument("--run-dir", default="/tmp/pdd-bench-router-cost", help="where the cluster's logs and config go")
    _add_json_arg(b)

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
    _add_json_arg(b)

    b = _bench_parser(sub, "transfer", "KV page transfer of one request per backend (nixl, cuda_ipc, tcp, local), "
                                        "layer by layer as the data plane sends it")
    b.add_argument("--backends", "--backend", default="auto",
                   help="comma list of nixl, cuda_ipc (GPU), tcp, local (both ends in this process, no socket: "
                        "on a GPU the copy ceiling); auto: every one that runs here")
    b.add_argument("--tokens", default="16384", help="comma list: tokens of the request")
    b.add_argument("--sizes", default=None, help="comma list: MiB of pages per request, instead of --tokens")
    b.add_argument("--shape", default="8b", choices=["8b", "tiny"],
                   help="KV shape: 8b = Llama-3.1-8B (32 layers x 8 KV heads x 128, bf16); tiny = the built-in "
                        "model (4 x 2 x 32, float32 as on a CPU worker)")
    b.add_argument("--layers", type=int, default=None, help="instead of the shape's")
    b.add_argument("--kv-heads", type=int, default=None, help="instead of the shape's")
    b.add_argument("--head-dim", type=int, default=None, help="instead of the shape's")
    b.add_argument("--dtype", default=None, help="instead of the shape's")
    b.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    b.add_argument("--device", default="cpu", help="where the source pool lives: cpu, cuda, cuda:N")
    b.add_argument("--peer-device", default=None, help="where the decode pool lives (default: --device)")
    b.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for both ends of nixl (e.g. tcp: UCX over the same loopback as the tcp backend; "
                        "default: the environment's, else UCX's choice)")
    b.add_argument("--blocks", default="scattered", choices=["scattered", "contiguous", "descending", "shuffled"],
                   help="destination blocks: scattered (no two neighbours in the pool, as after a long churn), "
                        "contiguous (ascending ids), descending or shuffled (one range of the pool, in the "
                        "order a pool that served requests hands it out)")
    b.add_argument("--contiguous", action="store_const", const="contiguous", dest="blocks",
                   help="the same as --blocks contiguous")
    b.add_argument("--nixl-landing", default="on", choices=["on", "off"],
                   help="nixl: the decode side's landing region (on: a layer's pages land contiguously, two "
                        "descriptors, and are copied into the blocks there; off: written straight into the "
                        "blocks, two descriptors per run of neighbouring blocks)")
    b.add_argument("--repeats", type=int, default=5, help="timed transfers per size")
    b.add_argument("--receiver-thread", action="store_true",
                   help="the decode side in a thread of this process instead of its own (not for cuda_ipc)")
    b.add_argument("--zmq-ceilings", action="store_true",
                   help="also time plain ZeroMQ on the same loopback (tcp rows): one buffer, and N acked messages")
    _add_json_arg(b)

    b = _bench_parser(sub, "ipc", "KV transfer over cuda_ipc (peer GPU writes) for one request, vs the IPC ceiling")
    b.add_argument("--tokens", type=int, default=16384, help="tokens of the request whose KV moves")
    b.add_argument("--layers", type=int, default=32, help="layers of the KV layout")
    b.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    b.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    b.add_argument("--head-dim", type=int, default=128, help="head dimension")
    b.add_argument("--dtype", default="bfloat16", help="KV dtype")
    b.add_argument("--device", default="cuda:0", help="the prefill side (sender)")
    b.add_argument("--peer-device", default=None, help="the decode pool (default: cuda:1 if present)")
    b.add_argument("--repeats", type=int, default=10, help="timed transfers")
    b.add_argument("--layer-group", type=int, default=0, help="layers per copy launch during the forward (0: all, after the step)")
    b.add_argument("--copy-ctas", default="0", help="comma list of programs per copy launch (0: one per page chunk)")
    b.add_argument("--overlap-ctas", type=int, default=0, help="programs per copy launch in the overlap run")
    b.add_argument("--overlap-model", default=None, help="config-only checkpoint: also measure prefill overlap")
    b.add_argument("--overlap-tokens", type=int, default=8192, help="prompt tokens of the overlap run")
    b.add_argument("--overlap-chunk", type=int, default=512, help="prefill chunk of the overlap run")
    b.add_argument("--overlap-repeats", type=int, default=5, help="timed prefills of the overlap run")
    b.add_argument("--overlap-kv-bytes", type=int, default=8 << 30, help="KV cache bytes of the overlap run's engine")
    _add_json_arg(b)

    b = _bench_parser(sub, "grammar", "constrained decoding's cost per token: masks (llguidance, xgrammar), "
                                       "their application, the handover; --engine: decode steps with and without")
    b.add_argument("--vocab", type=int, default=128256, help="logits width (the bench tokenizer is padded to it)")
    b.add_argument("--batches", default="1,64", help="comma list of batch sizes")
    b.add_argument("--tokens", type=int, default=200, help="tokens per request in the mask measurement")
    b.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of the 128k one the "
                   "bench trains (and caches) on the standard library")
    b.add_argument("--apply-device", default="cpu", help="where the masks are applied to logits (cpu, cuda)")
    b.add_argument("--engine", action="store_true", help="also time engine decode steps with and without the grammar")
    b.add_argument("--model", default="conf/models/llama-3.1-8b", help="config-only checkpoint for --engine")
    b.add_argument("--load-format", default="dummy", help="--engine: dummy: random weights")
    b.add_argument("--device", default="cuda", help="--engine: the engine's device")
    b.add_argument("--num-blocks", type=int, default=8192, help="--engine: KV cache blocks")
    b.add_argument("--context", type=int, default=1024, help="--engine: context tokens of each decoding request")
    b.add_argument("--steps", type=int, default=60, help="--engine: decode steps timed")
    b.add_argument("--workdir", default=None, help="where --engine writes its checkpoint (config + bench tokenizer)")
    _add_json_arg(b)

    b = _bench_parser(sub, "gemv", "decode-sized linears of the 8B shape: cuBLAS / FP8 scaled_mm vs the GEMV")
    b.add_argument("--m", default="1,4,16", help="comma list of token counts (rows of x)")
    b.add_argument("--reps", type=int, default=64, help="calls captured in each timed CUDA graph")
    b.add_argument("--sweep", action="store_true",
                   help="time one kernel's tile configs for each layer and weight kind instead")
    b.add_argument("--sweep-rows", type=int, default=1, choices=[1, 16],
                   help="--sweep: 1: the one-row kernel; 16: the 2..16-row kernel (timed at 4 and 16 rows)")
    _add_json_arg(b)

    b = _bench_parser(sub, "fp8-error", "FP8 weights / KV cache against the unquantized model: top-1 "
                                        "agreement, KL and logits error of next-token distributions")
    b.add_argument("--model", default=None, help="the unquantized checkpoint (default: the built-in tiny model; "
                   "a config-only one with --load-format dummy)")
    b.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: no weight files read (with --weights checkpoint: random Gaussian 0.02)")
    b.add_argument("--weights", default="llm-like", choices=["llm-like", "gaussian", "checkpoint"],
                   help="the reference's weights: llm-like (heavy-tailed, channel spread, outliers: "
                        "pdd.bench.weight_dist), gaussian (i.i.d.), checkpoint (the model's own)")
    b.add_argument("--variants", default="reference,w-tensor,w-channel,w-block,w-compressed,kv,kv-calibrated,"
                   "w-channel+kv,w-block+kv", help="comma list: w-tensor|channel|block|compressed (FP8 weights as "
                   "that checkpoint format stores them), kv / kv-calibrated (fp8_e4m3 cache, unit / amax scales), "
                   "'+' joins two; reference: the reference against itself")
    b.add_argument("--num-prompts", type=int, default=16, help="prompts (teacher-forced, every position compared)")
    b.add_argument("--prompt-len", type=int, default=128, help="tokens a prompt")
    b.add_argument("--greedy-tokens", type=int, default=32, help="tokens generated greedily a prompt (0: none)")
    b.add_argument("--target-entropy", type=float, default=2.0,
                   help="generated weights: scale the logits to this mean next-token entropy, nats (0: leave)")
    b.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    b.add_argument("--dtype", default="auto", help="the engine's dtype (auto: float32 on CPU, bfloat16 on a GPU)")
    b.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    _add_json_arg(b)

    b = _bench_parser(sub, "gpu", "decode and prefill step times against the H200 roofline")
    b.add_argument("--model", default="conf/models/llama-3.1-8b",
                   help="checkpoint (config-only is enough with dummy weights)")
    b.add_argument("--load-format", default="dummy", help="dummy: random weights of the checkpoint's shapes")
    add_kv_cache_dtype_arg(b)
    b.add_argument("--batches", default="1,32,128", help="comma list of decode batch sizes")
    b.add_argument("--context", type=int, default=1024, help="context tokens of each decoding request")
    b.add_argument("--steps", type=int, default=60, help="decode steps timed per batch size")
    b.add_argument("--prefill", default="4096,16384", help="comma list of prompt lengths timed")
    b.add_argument("--prefill-reps", type=int, default=3, help="timed prefills per length")
    b.add_argument("--mixed-chunks", default="", help="comma list of chunk sizes: a prompt computed in chunks "
                   "beside --mixed-batch decodes, step time by depth (e.g. 128,256,512)")
    b.add_argument("--mixed-batch", type=int, default=64, help="decodes beside the chunked prompt")
    b.add_argument("--mixed-prompt", type=int, default=16384, help="prompt tokens of the mixed run")
    b.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    b.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before scheduling the next")
    b.add_argument("--warm-up", action="store_true",
                   help="run the engine's warm-up first, as a worker does, and print each kernel compiled after it")
    b.add_argument("--profile", action="store_true",
                   help="also print where a decode step's time goes (GPU kernels, host gaps)")
    _add_json_arg(b)
