"""FP8 linears at decode batch sizes: the W8A16 GEMV against scaled_mm and bf16 cuBLAS.

For each Llama-3.1-8B linear (qkv_proj, o_proj, gate_up_proj with SiLU-and-mul,
down_proj) and M tokens (1..256): microseconds per call and the fraction of the
path's HBM floor (bytes of W and its scales, x and y over 4.26 TB/s) for
- cublas-bf16: F.linear on bf16 weights;
- scaled_mm-block / scaled_mm-row: activation quantize kernel, then cuBLASLt
  (F.scaled_mm 128x128 block scales / torch._scaled_mm rowwise);
- gemv-block / gemv-row: pdd.ops.triton_gemv (FP8 weights, bf16 x, the scales
  in registers) with the tiles of M's row bucket (pdd.ops.limits.GEMV_BUCKETS);
- gemv32-block / gemv32-row at M <= 16: the same kernel on the 17..32 bucket's
  tiles (whether the skinny rule beats the 2..16 one there);
- w8a8-block / w8a8-row at M > 1: the same tiles with x quantized to FP8 per row
  and K step inside the kernel, the dot on the FP8 tensor cores (GemvConfig.w8a8).
gate_up_proj's library paths include the separate SiLU-and-mul kernel the GEMV
fuses. Each variant is timed as in benchmarks.gemv: a CUDA graph of many calls
cycling over weight copies larger than L2 (weights come from HBM). The last
lines say which path wins each layer and M, and the FP8_GEMV_BUCKETS
(pdd/ops/__init__.py) that the layers' summed times pick.

    python -m benchmarks.fp8_skinny [--m 1,2,4,...] [--json FILE]      # on the device, < 3 min
    python -m benchmarks.fp8_skinny --sweep [--m 32,64] [--json FILE]   # the skinny tiles
    python -m benchmarks.fp8_skinny --dry-run                           # CPU: the cases and tiles
"""
from __future__ import annotations

import time

import torch

from benchmarks.cli import run_as_main
from benchmarks.gemv import SHAPES_8B, _COLD_BYTES, _compile_some, _graph_us, _library_call, _weights
from pdd.bench.commands import add_json_arg, write_json
from pdd.bench.gpu import HBM_BYTES_S

_MS = "1,2,4,8,16,32,64,128,256"
_KINDS = {"block": "fp8-block", "row": "fp8-channel"}   # this table's names: benchmarks.gemv's weight kinds
_SMS_H200 = 132


def _moved(kind: str, n: int, k: int, m: int, silu: bool) -> int:
    """The fewest bytes a call must move: W (and its scales), x, y."""
    out_n = n // 2 if silu else n
    if kind == "bf16":
        w = 2 * n * k
    elif kind == "block":
        w = n * k + 4 * -(-n // 128) * -(-k // 128)
    else:
        w = n * k + 4 * n
    return w + 2 * m * k + 2 * m * out_n


def _config(bucket: int, n: int, k: int, silu: bool, kind: str, sms: int):
    from pdd.ops.gemv_tiles import gemv_config

    return gemv_config(bucket, n // 2 if silu else n, k, 1, 2, silu, (128, 128) if kind == "block" else None, sms)


def _paths(m: int) -> list[tuple[str, str, int | None]]:
    """(path, weight kind, the GEMV's bucket or None) timed at M rows."""
    from pdd.ops.limits import GEMV_MAX_M, gemv_bucket

    out = [("cublas-bf16", "bf16", None)]
    for kind in _KINDS:
        out += [(f"scaled_mm-{kind}", kind, None), (f"gemv-{kind}", kind, gemv_bucket(m))]
        if 1 < m <= GEMV_MAX_M:
            out.append((f"gemv32-{kind}", kind, 32))
        if m > 1:
            out.append((f"w8a8-{kind}", kind, gemv_bucket(m)))
    return out


def _path_config(path: str, bucket: int | None, n: int, k: int, silu: bool, kind: str, sms: int):
    if bucket is None:
        return None
    cfg = _config(bucket, n, k, silu, kind, sms)
    return cfg._replace(w8a8=True) if path.startswith("w8a8") and cfg is not None else cfg


def _cases(ms: list[int], sms: int):
    for name, (n, k, silu) in SHAPES_8B.items():
        for m in ms:
            for path, kind, bucket in _paths(m):
                cfg = _path_config(path, bucket, n, k, silu, kind, sms)
                yield name, n, k, silu, m, path, kind, cfg


def _precompile(ms: list[int], sms: int) -> None:
    """Every GEMV variant once, in parallel child processes (Triton's disk cache)."""
    import multiprocessing as mp

    cases = sorted({(_KINDS[kind], name, n, k, silu, cfg) for name, n, k, silu, _, _, kind, cfg in _cases(ms, sms)
                    if cfg is not None}, key=str)
    procs = max(1, min(14, (mp.cpu_count() or 2) - 2))
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.map(_compile_some, [cases[i::procs] for i in range(procs)]))
    print(f"compiled {len(cases)} GEMV variants in {time.monotonic() - t0:.0f} s ({failed} failed)", flush=True)


def _call(path: str, kind: str, x, w, s, block, silu: bool, cfg):
    from pdd.ops import triton_gemv

    if cfg is not None:
        return lambda: triton_gemv.gemv(x, w, s, block, silu=silu, config=cfg)
    return _library_call("bf16" if kind == "bf16" else _KINDS[kind], x, w, s, block, silu)


def _time_layer(name: str, n: int, k: int, silu: bool, ms: list[int], sms: int, reps: int) -> list[dict]:
    rows = []
    for kind in ("bf16", *_KINDS):
        wkind = "bf16" if kind == "bf16" else _KINDS[kind]
        copies = max(2, -(-_COLD_BYTES // (n * k * (2 if kind == "bf16" else 1))))
        weights = _weights(wkind, n, k, copies)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for path, pkind, bucket in _paths(m):
                if pkind != kind:
                    continue
                cfg = _path_config(path, bucket, n, k, silu, kind, sms)
                calls = [_call(path, kind, x, w, s, b, silu, cfg) for w, s, b in weights]
                try:
                    us = _graph_us(calls * max(1, -(-reps // len(calls))), rounds=5)
                except Exception as e:   # noqa: BLE001 - a path this torch lacks is reported, not fatal
                    print(f"  {name} M={m} {path}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                floor_us = _moved(kind, n, k, m, silu) / HBM_BYTES_S * 1e6
                rows.append({"layer": name, "n": n, "k": k, "m": m, "path": path, "us": us,
                             "floor_us": floor_us, "of_floor": floor_us / us,
                             "config": cfg._asdict() if cfg is not None else None})
        del weights
        torch.cuda.empty_cache()
    return rows


def _winners(rows: list[dict], ms: list[int]) -> None:
    """Per layer and M: us and % of floor per path, the fastest FP8 path per scale
    kind; then the buckets where the GEMV wins the four layers' sum."""
    from pdd.ops.limits import gemv_bucket

    by = {(r["layer"], r["m"], r["path"]): r for r in rows}
    paths = ["cublas-bf16", "scaled_mm-block", "gemv-block", "w8a8-block", "scaled_mm-row", "gemv-row",
             "w8a8-row"]
    print(f"\n{'layer':<13} {'M':>3}  " + " ".join(f"{p:>17}" for p in paths) + "  best block / row", flush=True)
    for name in SHAPES_8B:
        for m in ms:
            cells, best = [], []
            for p in paths:
                r = by.get((name, m, p))
                cells.append(f"{r['us']:7.1f} ({100 * r['of_floor']:3.0f}%)" if r else "-")
            for kind in _KINDS:
                cand = [by[(name, m, p)] for p in (f"scaled_mm-{kind}", f"gemv-{kind}", f"gemv32-{kind}", f"w8a8-{kind}")
                        if (name, m, p) in by]
                best.append(min(cand, key=lambda r: r["us"])["path"] if cand else "-")
            print(f"{name:<13} {m:>3}  " + " ".join(f"{c:>17}" for c in cells) + "  " + " / ".join(best), flush=True)
    for kind in _KINDS:
        verdicts: dict[int, list[bool]] = {}
        for m in ms:
            total = {p: sum(by[(n, m, p)]["us"] for n in SHAPES_8B if (n, m, p) in by)
                     for p in (f"scaled_mm-{kind}", f"gemv-{kind}", f"w8a8-{kind}")}
            if total[f"scaled_mm-{kind}"] and total[f"gemv-{kind}"]:
                verdicts.setdefault(gemv_bucket(m), []).append(total[f"gemv-{kind}"] < total[f"scaled_mm-{kind}"])
            print(f"{kind:<5} M={m:>3}: a layer's four linears  scaled_mm {total[f'scaled_mm-{kind}']:7.1f} us, "
                  f"gemv {total[f'gemv-{kind}']:7.1f} us, w8a8 {total[f'w8a8-{kind}']:7.1f} us", flush=True)
        wins = sorted(b for b, v in verdicts.items() if all(v))
        print(f"{kind}: the GEMV wins the summed layer at every M measured of buckets {wins} "
              "(pdd.ops.FP8_GEMV_BUCKETS)", flush=True)


def add_args(p) -> None:
    p.add_argument("--m", default=None, help=f"comma list of token counts (default {_MS}; --sweep: 32,64)")
    p.add_argument("--reps", type=int, default=48, help="calls captured in each timed CUDA graph")
    p.add_argument("--sweep", action="store_true", help="time the skinny buckets' tile configs instead")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their GEMV tiles; no GPU needed")
    add_json_arg(p)


def main(args) -> int:
    ms = [int(v) for v in (args.m or ("32,64" if args.sweep else _MS)).split(",") if v]
    if args.dry_run:
        return dry_run(ms, args.sweep)
    if not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU (--dry-run lists the cases without one)")
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if args.sweep:
        return sweep(ms, sms, args)
    t0 = time.monotonic()
    _precompile(ms, sms)
    rows = []
    for name, (n, k, silu) in SHAPES_8B.items():
        rows += _time_layer(name, n, k, silu, ms, sms, args.reps)
        print(f"timed {name} ({time.monotonic() - t0:.0f} s)", flush=True)
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                           "hbm_bytes_s": HBM_BYTES_S, "rows": rows})
    _winners(rows, ms)
    return 0


def dry_run(ms: list[int], sweep_tiles: bool) -> int:
    """The cases (and the GEMV's tiles for a 132-SM H200) without a GPU."""
    count = 0
    for name, n, k, silu, m, path, kind, cfg in _cases(ms, _SMS_H200):
        floor_us = _moved(kind, n, k, m, silu) / HBM_BYTES_S * 1e6
        tiles = f"  {tuple(cfg)}" if cfg is not None else ""
        print(f"{name:<13} M={m:<3} {path:<16} floor {floor_us:6.1f} us{tiles}")
        count += 1
    if sweep_tiles:
        for name, (n, k, silu) in SHAPES_8B.items():
            for kind in _KINDS:
                for m in ms:
                    print(f"sweep {name} {kind} M={m}: {len(_sweep_configs(m, n, k, silu, kind))} configs")
    print(f"{count} cases")
    return 0


# ---------------------------------------------------------------------------
# --sweep: the skinny buckets' tiles (the M given is timed; its bucket's tiles)
# ---------------------------------------------------------------------------

_SWEEP_BLOCK_N = (32, 64, 128)
_SWEEP_BLOCK_K = (64, 128, 256)
_SWEEP_WARPS = (4, 8)
_SWEEP_STAGES = (3, 4, 6)
_SWEEP_SMEM = 200 << 10


def _sweep_configs(m: int, n: int, k: int, silu: bool, kind: str) -> list:
    from pdd.ops.gemv_tiles import GemvConfig
    from pdd.ops.limits import gemv_bucket

    tiles, out_n = (2, n // 2) if silu else (1, n)
    block_m = min(gemv_bucket(m), 128)
    out = []
    for bn in _SWEEP_BLOCK_N:
        for bk in (128,) if kind == "block" else _SWEEP_BLOCK_K:
            if out_n % bn or tiles * bn * bk > 2 * 16384:
                continue
            for warps in _SWEEP_WARPS:
                if tiles * bn * block_m > 64 * 32 * warps:     # accumulators past 64 registers a thread
                    continue
                for stages in _SWEEP_STAGES:
                    if stages * (tiles * bn * bk + 2 * bk * block_m) <= _SWEEP_SMEM:
                        out.append(GemvConfig(block_m, bn, bk, warps, stages))
    return out


def sweep(ms: list[int], sms: int, args) -> int:
    import multiprocessing as mp

    from pdd.ops.limits import gemv_bucket

    cases = [(_KINDS[kind], name, n, k, silu, cfg) for name, (n, k, silu) in SHAPES_8B.items()
             for kind in _KINDS for m in ms for cfg in _sweep_configs(m, n, k, silu, kind)]
    procs = max(1, min(14, (mp.cpu_count() or 2) - 2))
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.map(_compile_some, [cases[i::procs] for i in range(procs)]))
    print(f"compiled {len(cases)} variants in {time.monotonic() - t0:.0f} s ({failed} did not build)", flush=True)
    rows = []
    for name, (n, k, silu) in SHAPES_8B.items():
        for kind in _KINDS:
            weights = _weights(_KINDS[kind], n, k, max(2, -(-_COLD_BYTES // (n * k))))
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                table = _config(gemv_bucket(m), n, k, silu, kind, sms) if m > 16 else None
                results = []
                for cfg in [c for c in [table] if c] + _sweep_configs(m, n, k, silu, kind):
                    calls = [_call("gemv", kind, x, w, s, b, silu, cfg) for w, s, b in weights]
                    try:
                        us = _graph_us(calls * max(1, -(-args.reps // len(calls))), rounds=5)
                    except Exception as e:   # noqa: BLE001
                        print(f"  {kind} {name} {tuple(cfg)}: {type(e).__name__}", flush=True)
                        continue
                    results.append((us, cfg))
                    rows.append({"kind": kind, "layer": name, "m": m, "config": cfg._asdict(), "us": us,
                                 "table": cfg == table})
                results.sort(key=lambda r: r[0])
                table_us = next((us for us, c in results if c == table), float("nan"))
                floor = _moved(kind, n, k, m, silu) / HBM_BYTES_S * 1e6
                best = ", ".join(f"{us:.1f} us {tuple(c)[1:]}" for us, c in results[:3])
                print(f"{kind:<5} {name:<13} M={m:<3} floor {floor:5.1f} | table {table_us:6.1f} | best: {best}",
                      flush=True)
            del weights
            torch.cuda.empty_cache()
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
