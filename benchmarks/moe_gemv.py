"""A mixture of experts' sparse MLP at decode sizes, against the bytes it must read.

For each model's expert shapes and T tokens (T x top_k (token, expert) pairs, the
per-pair GEMV path up to GEMV_MAX_PAIRS): microseconds per `fused_moe` call
(routing, gate_up with SiLU-and-mul, down, the weighted sum), and the share of
the HBM floor: the chosen experts' weight bytes (each expert once, however many
of the T tokens chose it) over 4.26 TB/s. Each call routes fresh logits over a
set of layers' weights larger than L2, captured in one CUDA graph, so every
call reads its experts from HBM as a decode step's layers do.

    python -m benchmarks.moe_gemv                          # the rule's tiles, T = 1, 2, 4, 8
    python -m benchmarks.moe_gemv --sweep --models qwen3-30b-a3b --tokens 1   # every candidate tile (~3 min)
    python -m benchmarks.moe_gemv --both-paths --tokens 1,2,4,8,16,32   # where the grouped GEMM should take over
    python -m benchmarks.moe_gemv --dry-run                # no GPU: the cases and the rule's tiles

The per-pair GEMV's rule (pdd.ops.triton_moe.pair_tiles) came from this sweep
(docs/benchmarks.md, "Mixture of experts on one H200" and after).
"""
from __future__ import annotations

import itertools
import json

import torch

from benchmarks.cli import run_as_main
from benchmarks.gemv import _COLD_BYTES, _graph_us

from pdd.bench.gpu import HBM_BYTES_S

SHAPES = {   # name: (experts, hidden, expert intermediate, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
# Around the rule's tiles (16 columns, K steps of 128/256: the first sweep's best, at
# the edge of its grid of 16-64 columns and 64-256 K steps).
BLOCK_N = (8, 16, 32)
BLOCK_K = (128, 256, 512)
WARPS = (4, 8)
STAGES = (2, 3, 4)


def add_args(p) -> None:
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="1,2,4,8", help="comma list of decode batch sizes")
    p.add_argument("--sweep", action="store_true", help="time every candidate tile of each GEMM (slow)")
    p.add_argument("--reps", type=int, default=64, help="calls per CUDA graph")
    p.add_argument("--both-paths", action="store_true",
                   help="also time the grouped GEMM where the rule takes the per-pair GEMV, and the reverse")
    p.add_argument("--dry-run", action="store_true", help="list the cases and the rule's tiles; no GPU needed")
    p.add_argument("--json", default=None, help="write the rows here")


def floor_bytes(experts: int, hidden: int, inter: int, top_k: int, tokens: int, elem: int = 2) -> float:
    """The expected weight bytes T tokens' experts are (each chosen expert read once,
    routing uniform): E * (1 - (1 - k/E)^T) experts of 3 * H * I elements."""
    chosen = experts * (1 - (1 - top_k / experts) ** tokens)
    return chosen * 3 * hidden * inter * elem


def _candidates(n: int, k: int):
    from pdd.ops.triton_moe import ExpertTiles
    for bn, bk, w, st in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES):
        if bn <= max(16, n) and bk <= max(16, k):
            yield ExpertTiles(bn, bk, w, st)


def _timer(name: str, tokens: int, reps: int):
    """tiles -> microseconds a call, over weights and logits made once."""
    from pdd.ops import triton_moe
    e, h, inter, k = SHAPES[name]
    layer_bytes = e * 3 * h * inter * 2
    layers = max(2, -(-_COLD_BYTES // layer_bytes))
    weights = [(torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02,
                torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    logits = [torch.randn(tokens, e, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]

    def time_tiles(tiles=None, gemv_max_pairs: int = triton_moe.GEMV_MAX_PAIRS) -> float:
        calls = [lambda g=g, d=d, lg=lg: triton_moe.fused_moe(x, lg, g, d, k, True, tiles=tiles,
                                                              gemv_max_pairs=gemv_max_pairs)
                 for (g, d), lg in zip(itertools.cycle(weights), logits)]
        return _graph_us(calls, rounds=5)
    return time_tiles


def main(args) -> int:
    from pdd.ops.triton_moe import GEMV_MAX_PAIRS, expert_tiles, pair_tiles, tiles_spec
    if not args.dry_run and not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU (--dry-run lists the cases without one)")
    models = args.models.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in models:
        e, h, inter, k = SHAPES[name]
        for t in tokens:
            if t * k <= GEMV_MAX_PAIRS:
                rule = (pair_tiles(inter, h, False, silu=True), pair_tiles(h, inter, False, silu=False))
            else:
                rule = (expert_tiles(inter, h, False), expert_tiles(h, inter, False))
            row = {"model": name, "tokens": t, "pairs": t * k, "gemv_path": t * k <= GEMV_MAX_PAIRS,
                   "floor_us": round(floor_bytes(e, h, inter, k, t) / HBM_BYTES_S * 1e6, 2),
                   "rule_tiles": [tuple(x) for x in rule]}
            if not args.dry_run:
                time_tiles = _timer(name, t, args.reps)
                us = time_tiles()
                row.update(us=round(us, 2), of_floor=round(row["floor_us"] / us, 3))
                if args.both_paths:   # the other path at the same size, with its own rule's tiles
                    other = time_tiles(gemv_max_pairs=0 if row["gemv_path"] else t * k)
                    row.update(other_path_us=round(other, 2), other_of_floor=round(row["floor_us"] / other, 3))
                if args.sweep:   # gate_up's best with the rule's down, then down's beside it
                    best_up = min(((time_tiles((c, rule[1])), c) for c in _candidates(inter, h)), key=lambda r: r[0])
                    best_down = min(((time_tiles((best_up[1], c)), c) for c in _candidates(h, inter)),
                                    key=lambda r: r[0])
                    row.update(best_tiles=[tuple(best_up[1]), tuple(best_down[1])], best_us=round(best_down[0], 2),
                               best_of_floor=round(row["floor_us"] / best_down[0], 3),
                               env=f"PDD_MOE_GEMV_TILES={tiles_spec((best_up[1], best_down[1]))}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
