"""pdd, an LLM serving daemon with prefill/decode disaggregation: the one executable.

    pdd up [--mode disagg|colocated]           a local cluster (router + workers) in one command
    pdd serve --role ROLE | --instance ROLE-N  one process of a cluster (what a systemd unit runs)
    pdd admin COMMAND                          operate a running cluster (pdd admin --help)
    pdd make-model --preset tiny --out DIR     random-weight HF checkpoint, no download
    pdd generate --prompt TEXT [--model DIR]   offline generation with the engine
    pdd bench serve|chaos|frontdoor|gpu        load tests, fault scenarios, router capacity, GPU steps
    pdd keys generate DIR                      CURVE keys of a cluster (router, worker, admin)

Each subcommand imports what it needs lazily so `pdd admin` and the router
never pay for importing torch.
"""
from __future__ import annotations

import argparse
import sys

from pdd import __version__, build_info, logs
from pdd.admin.commands import add_admin_parser, log_level_type
from pdd.argparsing import Parser
from pdd.config import LOG_LEVELS
from pdd.engine.args import add_engine_args, engine_kwargs


def cmd_make_model(args) -> int:
    from pdd.model.make_model import dequantized_copy, make_model

    try:
        out = make_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed, fp8=args.fp8,
                         kv_scales=args.kv_scales, kv_scale_naming=args.kv_scale_names,
                         chat_template=args.chat_template)
    except ValueError as e:  # e.g. --kv-scales without --fp8
        raise SystemExit(f"pdd make-model: {e}") from None
    print(out)
    if args.dequantized_copy:
        print(dequantized_copy(out, args.dequantized_copy))
    return 0


def cmd_generate(args) -> int:
    from pdd.engine.llm import LLM
    from pdd.api import SamplingParams

    kw = engine_kwargs(args)
    llm = LLM(kw.pop("model"), **kw)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or [],
                        ignore_eos=args.ignore_eos)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp)
    else:
        out = llm.generate([args.prompt], sp)[0]
    print(out.text)
    if args.verbose:
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, ids={out.token_ids}]",
              file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from pdd.lifetime import follow_supervisor
    from pdd.serve import parse_instance, serve

    follow_supervisor()   # started by `pdd up`: ends with it
    try:
        if args.instance:   # a worker unit's instance name: pdd-worker@decode-0
            if args.worker_id:
                raise ValueError("--instance ROLE-N is the worker id too: drop --worker-id")
            args.role, args.worker_id = parse_instance(args.instance)
        cfg = _serve_config(args)
    except ValueError as e:   # a bad instance name, config file, key, value or --set
        print(f"pdd serve: {e}", file=sys.stderr)
        from pdd.config import EXIT_REFUSED
        return EXIT_REFUSED   # the systemd units do not restart on it: a retry fails the same way
    logs.configure_from(cfg.log, "router" if args.role == "router" else cfg.worker.worker_id or args.role,
                        level=args.log_level)
    return serve(args.role, cfg)


def _serve_config(args):
    from pdd.config_loader import load_cluster_config

    overrides = {"worker": {"role": args.role if args.role != "router" else "colocated"}}
    if args.worker_id:
        overrides["worker"]["worker_id"] = args.worker_id
    for item in args.set or []:
        key, eq, value = item.partition("=")
        *tables, name = key.split(".")
        if not eq or not tables or not all(tables) or not name:
            raise ValueError(f"--set {item!r}: expected TABLE.KEY=VALUE (a table inside one: "
                             "TABLE.SUBTABLE.KEY=VALUE, e.g. router.breaker.window_s=10)")
        node = overrides
        for table in tables:   # router.breaker.window_s: the [router.breaker] table's key
            node = node.setdefault(table, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {'.'.join(tables)} is a key, not a table")
        node[name] = value
    return load_cluster_config(args.config, overrides=overrides, overrides_origin="--set")


def cmd_up(args) -> int:
    from pdd.launcher import main as up

    return up(args)


def cmd_admin(args) -> int:
    from pdd.admin.cli import main as admin

    return admin(args)


def cmd_keys_generate(args) -> int:
    from pdd.security import generate_keys, router_roles

    routers = router_roles(args.routers)
    roles = tuple(args.only.split(",")) if args.only else (*routers, "worker", "admin")
    unknown = set(roles) - {*routers, "worker", "admin"}
    if unknown:
        raise ValueError(f"--only: unknown role(s) {sorted(unknown)}; choose from {', '.join(routers)}, worker, "
                         "admin")
    out = generate_keys(args.dir, roles)
    print(f"pdd keys: {', '.join(roles)} key pair(s) in {out} (secret files 0600, directory 0700); "
          "which host needs which file: README.md, \"Keys\"")
    return 0


def _kv_scales_arg(value: str) -> float | str:
    """An argparse type: a finite number > 0, or "random"."""
    if value == "random":
        return value
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not (0 < scale < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0 or 'random', got {value!r}")
    return scale


def _add_log_level(p: argparse.ArgumentParser, help: str) -> None:
    # SUPPRESS: given after the command it wins, else the one before it (pdd --log-level X serve) holds.
    p.add_argument("--log-level", type=log_level_type, default=argparse.SUPPRESS, metavar="LEVEL", help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdd", description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter, json_switch=False)
    build = build_info()
    parser.add_argument("--version", action="version", help="print pdd's version and exit",
                        version=f"pdd {__version__} (Python {build['python']})")
    parser.add_argument("--log-level", type=log_level_type, default=None, metavar="LEVEL",
                        help=f"{', '.join(LOG_LEVELS)} (default: warning; serve and up: the config's log.level)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-weight HF checkpoint")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "8b"], help="model size")
    p.add_argument("--arch", default="llama",
                   choices=["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"],
                   help="architecture of the checkpoint (qwen3_moe, mixtral: mixtures of experts)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write it to")
    p.add_argument("--fp8", choices=["tensor", "channel", "block", "compressed"], default=None,
                   help="write an FP8 checkpoint: quant_method fp8 with per-tensor, per-channel or 128x128 "
                        "block scales, or compressed-tensors (per-channel weights, dynamic per-token activations)")
    p.add_argument("--kv-scales", type=_kv_scales_arg, default=None, metavar="VALUE|random",
                   help="with --fp8: also write per-layer FP8 KV-cache scales, all VALUE or seeded random "
                        "values near what calibrating the tiny model gives")
    p.add_argument("--kv-scale-names", choices=["attn", "proj", "output", "legacy"], default=None,
                   help="with --kv-scales: named as llm-compressor (self_attn.k_scale), ModelOpt (k_proj.k_scale), "
                        "AutoFP8 (k_proj.output_scale) or early AutoFP8 (one self_attn.kv_scale for both); "
                        "default: output for the fp8 method, attn for compressed")
    p.add_argument("--dequantized-copy", metavar="DIR", default=None,
                   help="with --fp8: also write the same weights dequantized to bfloat16 (a plain checkpoint) in DIR")
    p.add_argument("--chat-template", choices=["chatml", "thinking"], default="chatml",
                   help="the checkpoint's chat template: ChatML, or thinking (a reasoning model's, DeepSeek-R1 "
                        "style: the generation prompt opens <think>; enable_thinking false leaves it out)")
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("generate", help="generate text offline")
    add_engine_args(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest (0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: random)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the token ids and finish reason")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="run one process of a cluster (what a systemd unit runs)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--role", choices=["router", "colocated", "prefill", "decode"], help="the process to run")
    who.add_argument("--instance", metavar="ROLE-N",
                     help="a worker named as its systemd unit's instance (pdd-worker@decode-0): role decode, "
                          "worker id decode-0; another name exits 78")
    p.add_argument("--config", default=None, help="TOML config (conf/*.toml); PDD_<TABLE>__<KEY> env overrides")
    p.add_argument("--worker-id", default=None, help="a worker's id (default: worker.worker_id, else ROLE-HOST-PID)")
    p.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE", help="override one config value")
    _add_log_level(p, "this process's log level (default: log.level, PDD_LOG__LEVEL; info)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="start a local cluster (router + workers) in one command")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: built-in tiny model)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may put in \"model\", the first the one reported (router.served_model_name; "
                        "default: --model as given)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML config the cluster starts from (default: built-in defaults)")
    p.add_argument("--mode", default="disagg", choices=["disagg", "colocated"],
                   help="disagg: --prefill + --decode workers; colocated: --workers")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disagg)")
    p.add_argument("--workers", type=int, default=1, help="colocated workers")
    p.add_argument("--adaptive", action="store_true",
                   help="router.mode = adaptive: per request, remote or local prefill by measured cost; "
                        "colocated workers also prefill for others, leaning to prefill or decode with the load")
    p.add_argument("--routers", type=int, default=1, metavar="N",
                   help="N routers serving the cluster side by side on --port (SO_REUSEPORT spreads the "
                        "connections); each places its own requests, and one's death loses only its own")
    p.add_argument("--port", type=int, default=8000, help="the router's HTTP port (refused in one line if in use)")
    p.add_argument("--tool-call-parser", default=None, choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the format the model writes tool calls in (router.tool_call_parser; default auto: "
                        "read from the chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=["auto", "none", "deepseek_r1", "qwen3"],
                   help="how a reasoning model's <think>...</think> goes into reasoning_content "
                        "(router.reasoning_parser; default auto: read from the chat template)")
    p.add_argument("--run-dir", default=None,
                   help="where logs, keys and the generated config go (default ~/.cache/pdd/run/up-PORT): "
                        "made 0700 if new; an existing one is used as it is, its keys kept, if only you can write it")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds for every worker to register before giving up")
    p.add_argument("--api-key-file", action="append", metavar="FILE",
                   help="require 'Authorization: Bearer KEY' on the HTTP API for the keys in FILE, one a line "
                        "(blank lines and # comments skipped; repeatable); or PDD_SECURITY__API_KEYS=KEY1,KEY2")
    _add_log_level(p, "the router's and workers' log level (default: log.level, PDD_LOG__LEVEL; info)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="as --api-key-file, but on the command line, where other users can read it (warned)")
    p.set_defaults(func=cmd_up)

    add_admin_parser(sub).set_defaults(func=cmd_admin)

    p = sub.add_parser("keys", help="CURVE keys that authenticate every socket of a cluster")
    keys_sub = p.add_subparsers(dest="keys_command", required=True)
    k = keys_sub.add_parser("generate", help="new key pairs and authorized-key directories in DIR")
    k.add_argument("dir", metavar="DIR", help="directory to write the keys to (made 0700; never overwritten)")
    k.add_argument("--only", default=None, metavar="ROLES",
                   help="comma list of router, worker, admin (default: all three); "
                        "e.g. --only worker: a pair for one more worker host")
    k.add_argument("--routers", type=int, default=1, metavar="N",
                   help="a pair for each of N routers (router, router-1, ...): each router of the cluster "
                        "proves itself with its own key")
    k.set_defaults(func=cmd_keys_generate)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    from pdd.bench.commands import add_bench_parsers
    add_bench_parsers(bench_sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level or "warning")   # serve: again, once its config is read
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # Config/checkpoint/request errors carry a message meant for the user.
        print(f"pdd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
