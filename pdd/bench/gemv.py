"""Decode-sized linears on the GPU: the library GEMMs against the weight-only GEMV.

For each Llama-3.1-8B linear (qkv_proj, o_proj, gate_up_proj with SiLU-and-mul,
down_proj) and M tokens: microseconds per call and the bandwidth achieved on the
bytes the layer must move (weight and its scales, x, y), for
- cublas-bf16: F.linear on bf16 weights (what an nn.Linear runs);
- scaled_mm-fp8-channel / scaled_mm-fp8-block: the FP8 path before the GEMV
  (activation quantize kernel, then torch._scaled_mm / F.scaled_mm on rows
  padded to 4), what an Fp8Linear runs from 2 rows up (ops.use_gemv);
- gemv-bf16, gemv-fp8-channel, gemv-fp8-block: pdd.ops.triton_gemv.
gate_up_proj's library paths include the separate SiLU-and-mul kernel the GEMV fuses.

Each variant is timed as one CUDA graph of many calls (no launch gaps, as in a
captured decode step), cycling over enough weight copies that they do not fit
in L2: every call reads its weights from HBM, as a decode step's layers do.

    pdd bench gemv --m 1,4,16 [--json FILE]     # on the device
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdd.bench.gpu import HBM_BYTES_S

SHAPES_8B = {   # name: (N, K, SiLU-and-mul of [gate; up] follows)
    "qkv_proj": (6144, 4096, False),
    "o_proj": (4096, 4096, False),
    "gate_up_proj": (28672, 4096, True),
    "down_proj": (4096, 14336, False),
}
_COLD_BYTES = 256 << 20   # weight copies cycled per variant: well past the H200's 50 MB L2


def _graph_us(calls: list, rounds: int) -> float:
    """Device time per call of `calls`, captured in one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (rounds * len(calls))


def _weights(kind: str, n: int, k: int, copies: int) -> list[tuple]:
    """`copies` random (weight, scale, block) of one kind: bf16, fp8-channel, fp8-block."""
    from pdd.ops.fp8_linear import FP8_DTYPE

    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        if kind == "bf16":
            out.append((w, None, None))
        elif kind == "fp8-channel":
            out.append(((w * 2 ** 10).to(FP8_DTYPE), torch.rand(n, device="cuda") * 2 ** -10, None))
        else:
            s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 2 ** -10
            out.append(((w * 2 ** 10).to(FP8_DTYPE), s, (128, 128)))
    return out


def _library_call(kind: str, x: torch.Tensor, w, s, block, silu: bool):
    from pdd import ops
    from pdd.ops import fp8_linear

    if kind == "bf16":
        def gemm():
            return F.linear(x, w)
    elif kind == "fp8-channel":
        row_scale = s.view(1, -1)

        def gemm():
            return fp8_linear.rowwise(x, w, row_scale, None, torch.bfloat16)
    else:
        def gemm():
            return fp8_linear.blockwise(x, w, s, torch.bfloat16)
    return (lambda: ops.silu_and_mul(gemm())) if silu else gemm


def _gemv_call(x: torch.Tensor, w, s, block, silu: bool):
    from pdd.ops import triton_gemv

    return lambda: triton_gemv.gemv(x, w, s, block, silu=silu)


def bench_shape(name: str, n: int, k: int, silu: bool, m: int, kinds: list[str], reps: int) -> list[dict]:
    rows = []
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out_n = n // 2 if silu else n
    for kind in kinds:
        w_bytes = n * k * (2 if kind == "bf16" else 1)
        copies = max(2, -(-_COLD_BYTES // w_bytes))
        weights = _weights(kind, n, k, copies)
        scale_bytes = weights[0][1].numel() * 4 if weights[0][1] is not None else 0
        moved = w_bytes + scale_bytes + 2 * m * k + 2 * m * out_n
        paths = [("gemv", _gemv_call)]
        if kind != "fp8-block" or _block_gemm():
            paths.insert(0, ("cublas" if kind == "bf16" else "scaled_mm", functools.partial(_library_call, kind)))
        for path, make in paths:
            calls = [make(x, w, s, b, silu) for w, s, b in weights]
            us = _graph_us(calls * max(1, -(-reps // len(calls))), rounds=5)
            rows.append({"layer": name, "n": n, "k": k, "m": m, "path": f"{path}-{kind}", "us": us,
                         "gb_s": moved / us / 1e3, "fraction_of_hbm": moved / (us * 1e-6) / HBM_BYTES_S})
        del weights
        torch.cuda.empty_cache()
    return rows


def _block_gemm() -> bool:
    from pdd.ops import fp8_linear

    return fp8_linear.block_gemm_supported()


def main(args) -> int:
    ms = [int(v) for v in args.m.split(",") if v]
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    kinds = ["bf16"] + (["fp8-channel", "fp8-block"] if fp8 else [])
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
           "hbm_bytes_s": HBM_BYTES_S, "rows": []}
    print(f"{'layer':<13} {'N x K':>12} {'M':>3}  {'path':<24} {'us':>8} {'GB/s':>7} {'of HBM':>7}", flush=True)
    for name, (n, k, silu) in SHAPES_8B.items():
        for m in ms:
            for r in bench_shape(name, n, k, silu, m, kinds, args.reps):
                out["rows"].append(r)
                label = f"{name}{'+silu' if silu else ''}"
                print(f"{label:<13} {f'{n}x{k}':>12} {m:>3}  {r['path']:<24} {r['us']:>8.1f} {r['gb_s']:>7.0f} "
                      f"{100 * r['fraction_of_hbm']:>6.0f}%", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
