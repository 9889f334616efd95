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

    python -m benchmarks.gemv --m 1,4,16 [--json FILE]     # on the device
    python -m benchmarks.gemv --sweep [--sweep-rows 1|16] [--json FILE]   # a kernel's tile configs
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from benchmarks.cli import run_as_main
from pdd.bench.commands import add_json_arg, write_json
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


def _elem_bytes(kind: str) -> int:
    """Bytes of one weight element of a kind: bf16, or FP8 (fp8-channel, fp8-block)."""
    return 2 if kind == "bf16" else 1


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
        w_bytes = n * k * _elem_bytes(kind)
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


def add_args(p) -> None:
    p.add_argument("--m", default="1,4,16", help="comma list of token counts (rows of x)")
    p.add_argument("--reps", type=int, default=64, help="calls captured in each timed CUDA graph")
    p.add_argument("--sweep", action="store_true",
                   help="time one kernel's tile configs for each layer and weight kind instead")
    p.add_argument("--sweep-rows", type=int, default=1, choices=[1, 16],
                   help="--sweep: 1: the one-row kernel; 16: the 2..16-row kernel (timed at 4 and 16 rows)")
    add_json_arg(p)


def main(args) -> int:
    if args.sweep:
        return sweep(args)
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
    write_json(args.json, out)
    return 0


# ---------------------------------------------------------------------------
# --sweep: tile configs of one kernel (--sweep-rows 1: the row kernel; 16: the
# dot kernel of 2..16 rows, timed at 4 and 16), each layer and weight kind
# ---------------------------------------------------------------------------

_SWEEP_KINDS = ("bf16", "fp8-block", "fp8-channel")
_SWEEP_BLOCK_N = (4, 8, 16)
_SWEEP_TILE_BYTES = (8 << 10, 16 << 10, 32 << 10)
_SWEEP_WARPS = (4, 8)
_SWEEP_STAGES = (1, 3)
_SWEEP_DOT_BLOCK_N = (16, 32, 64)
_SWEEP_DOT_BLOCK_K = (64, 128, 256)
_SWEEP_DOT_STAGES = (2, 4, 6)
_SWEEP_DOT_MAX_TILE = 32768   # W elements of a step (gate and up together): more spills


def _sweep_configs(n: int, k: int, silu: bool, w_bytes: int, bucket: int = 1, block_scales: bool = False):
    from pdd.ops import GEMV_MAX_M
    from pdd.ops.triton_gemv import GemvConfig

    tiles = 2 if silu else 1
    out_n = n // 2 if silu else n
    if bucket != 1:
        for block_n in _SWEEP_DOT_BLOCK_N:
            # Block scales: one scale column a K step, every program inside one block row.
            for block_k in (128,) if block_scales else _SWEEP_DOT_BLOCK_K:
                if out_n % block_n or tiles * block_n * block_k > _SWEEP_DOT_MAX_TILE:
                    continue
                for warps in _SWEEP_WARPS:
                    for stages in _SWEEP_DOT_STAGES:
                        yield GemvConfig(GEMV_MAX_M, block_n, block_k, warps, stages)
        return
    for block_n in _SWEEP_BLOCK_N:
        if out_n % block_n:
            continue
        for tile in _SWEEP_TILE_BYTES:
            block_k = min(max(64, tile // (tiles * block_n * w_bytes)), 4096)
            for warps in _SWEEP_WARPS:
                for stages in _SWEEP_STAGES:
                    yield GemvConfig(1, block_n, block_k, warps, stages)


def _kind_configs(kind: str, n: int, k: int, silu: bool, bucket: int):
    return _sweep_configs(n, k, silu, _elem_bytes(kind), bucket, kind == "fp8-block")


def _sweep_cases(bucket: int):
    for kind in _SWEEP_KINDS:
        for name, (n, k, silu) in SHAPES_8B.items():
            for cfg in _kind_configs(kind, n, k, silu, bucket):
                yield kind, name, n, k, silu, cfg


def _compile_some(cases: list) -> int:
    """Run each case once (a child process: fills Triton's on-disk cache)."""
    failed = 0
    x_cache, w_cache = {}, {}
    for kind, name, n, k, silu, cfg in cases:
        m = 1 if cfg.block_m == 1 else 4
        x = x_cache.setdefault((m, k), torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        if (kind, n, k) not in w_cache:     # one copy a layer shape: a sweep builds hundreds of variants of each
            w_cache.clear()
            w_cache[(kind, n, k)] = _weights(kind, n, k, 1)[0]
        w, s, b = w_cache[(kind, n, k)]
        try:
            _gemv_call_cfg(x, w, s, b, silu, cfg)()
        except Exception:   # noqa: BLE001 - a config that does not build is reported, not fatal
            failed += 1
    torch.cuda.synchronize()
    return failed


def _gemv_call_cfg(x, w, s, block, silu, cfg):
    from pdd.ops import triton_gemv

    return lambda: triton_gemv.gemv(x, w, s, block, silu=silu, config=cfg)


def sweep(args) -> int:
    import multiprocessing as mp

    from pdd.ops import triton_gemv

    bucket = args.sweep_rows
    ms = (1,) if bucket == 1 else (4, 16)
    cases = list(_sweep_cases(bucket))
    procs = max(1, min(14, (mp.cpu_count() or 2) - 2))
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.map(_compile_some, [cases[i::procs] for i in range(procs)]))
    print(f"compiled {len(cases)} variants in {time.monotonic() - t0:.0f} s on {procs} processes "
          f"({failed} did not build); timed at M = {', '.join(map(str, ms))}, us summed over those", flush=True)
    rows = []
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for kind in _SWEEP_KINDS:
        for name, (n, k, silu) in SHAPES_8B.items():
            w_bytes = n * k * _elem_bytes(kind)
            weights = _weights(kind, n, k, max(2, -(-_COLD_BYTES // w_bytes)))
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms]
            table = triton_gemv.gemv_config(bucket, n // 2 if silu else n, k, _elem_bytes(kind), 2, silu,
                                            weights[0][2], sms)
            results = []
            for cfg in [table, *_kind_configs(kind, n, k, silu, bucket)]:
                if cfg is None:
                    continue
                try:
                    per_m = [_graph_us([_gemv_call_cfg(x, w, s, b, silu, cfg) for w, s, b in weights]
                                       * max(1, -(-args.reps // len(weights))), rounds=5) for x in xs]
                except Exception as e:   # noqa: BLE001
                    print(f"  {kind} {name} {cfg}: {type(e).__name__}", flush=True)
                    continue
                us = sum(per_m)
                results.append((us, cfg))
                rows.append({"kind": kind, "layer": name, "config": cfg._asdict(), "table": cfg is table,
                             "m": list(ms), "us_per_m": per_m, "us": us})
            results.sort(key=lambda r: r[0])
            table_us = next((us for us, cfg in results if cfg is table), float("nan"))
            best = ", ".join(f"{us:.1f} us n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"
                             for us, c in results[:3])
            print(f"{kind:<12} {name:<13} table {table_us:6.1f} us | best: {best}", flush=True)
            del weights
            torch.cuda.empty_cache()
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                           "rows_bucket": bucket, "rows": rows})
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
