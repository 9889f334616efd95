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
    python -m benchmarks.fp8_skinny --sweep [--m 1,16,...] [--kinds block,row] [--w8a8] [--json FILE]
        # every bucket's candidate tiles (split-K among them; with --w8a8 each also as W8A8)
        # per layer against scaled_mm, < 4 min
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
    p.add_argument("--m", default=None, help=f"comma list of token counts (default {_MS}; --sweep: {_SWEEP_MS})")
    p.add_argument("--kinds", default=None, help="--sweep: comma list of scale kinds out of block,row (default both)")
    p.add_argument("--reps", type=int, default=48, help="calls captured in each timed CUDA graph")
    p.add_argument("--sweep", action="store_true", help="time the skinny buckets' tile configs instead")
    p.add_argument("--w8a8", action="store_true", help="--sweep: each candidate also as W8A8 (GemvConfig.w8a8)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their GEMV tiles; no GPU needed")
    add_json_arg(p)


def main(args) -> int:
    ms = [int(v) for v in (args.m or (_SWEEP_MS if args.sweep else _MS)).split(",") if v]
    if args.dry_run:
        return dry_run(ms, args.sweep, args.w8a8)
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


def dry_run(ms: list[int], sweep_tiles: bool, w8a8: bool = False) -> int:
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
                    print(f"sweep {name} {kind} M={m}: {len(_sweep_configs(m, n, k, silu, kind, w8a8=w8a8))} configs")
        from pdd.ops.limits import gemv_bucket
        variants = {(kind, name, cfg) for name, (n, k, silu) in SHAPES_8B.items() for kind in _KINDS for m in ms
                    for cfg in _sweep_configs(m, n, k, silu, kind, w8a8=w8a8) + [_config(gemv_bucket(m), n, k, silu, kind,
                                                                               _SMS_H200)]}
        print(f"sweep: {len(variants)} distinct variants to compile")
    print(f"{count} cases")
    return 0


# ---------------------------------------------------------------------------
# --sweep: every bucket's candidate tiles (the M given is timed with its bucket's
# tiles) per 8B layer and scale kind, against scaled_mm and the HBM floor
# ---------------------------------------------------------------------------

_SWEEP_MS = "1,16,32,64,128,256"    # each bucket's largest row count, as the warm-up runs them
_SWEEP_BLOCK_N = (32, 64, 128)
_SWEEP_STAGES = (3, 5)
_SWEEP_SPLITS = (1, 2, 4, 8)
_SWEEP_SMEM = 200 << 10


def _sweep_splits(programs: int, k_steps: int, sms: int) -> list[int]:
    """K slices worth trying for a grid of `programs` (M tiles x N tiles): more only
    while the grid stays within two programs an SM and each slice keeps 8+ K steps
    (a slice's pipeline fills and drains once: short slices spend it filling)."""
    return [sk for sk in _SWEEP_SPLITS if sk == 1 or (programs * sk <= 2 * sms and k_steps // sk >= 8)]


def _sweep_configs(m: int, n: int, k: int, silu: bool, kind: str, sms: int = _SMS_H200,
                   w8a8: bool = False) -> list:
    """The dot kernel's candidates at m rows (2..256; none at 1 row: benchmarks.gemv
    --sweep covers the row kernel): BLOCK_N, BLOCK_K (block scales: 128, one scale a
    K step), stages, split-K; 8 warps only where 4 would hold over 64 fp32
    accumulators a thread. With w8a8 each also as W8A8 (x quantized per row and K
    step in the kernel, as scaled_mm's activations are; the FP8 tensor cores)."""
    from pdd.ops.gemv_tiles import GemvConfig
    from pdd.ops.limits import gemv_bucket

    if m == 1:
        return []
    tiles, out_n = (2, n // 2) if silu else (1, n)
    bucket = gemv_bucket(m)
    block_m = min(bucket, 128)
    m_tiles = -(-bucket // block_m)
    out = []
    for bn in _SWEEP_BLOCK_N:
        for bk in (128,) if kind == "block" else (128, 256) if block_m <= 32 else (128,):
            if out_n % bn or tiles * bn * bk > 2 * 16384:
                continue
            warps = 4 if tiles * bn * block_m <= 64 * 32 * 4 else 8
            if tiles * bn * block_m > 64 * 32 * warps:
                continue
            for stages in _SWEEP_STAGES:
                if stages * (tiles * bn * bk + 2 * bk * block_m) > _SWEEP_SMEM:
                    continue
                for sk in _sweep_splits(m_tiles * -(-out_n // bn), -(-k // bk), sms):
                    out.append(GemvConfig(block_m, bn, bk, warps, stages, split_k=sk))
    return (out + [c._replace(w8a8=True) for c in out]) if w8a8 else out


def _table_entry(cfg) -> tuple:
    """A config as gemv_tiles' tables write it: (BLOCK_N, BLOCK_K, warps, stages[, K slices]),
    W8A8 ones marked (the tables have no field for it yet)."""
    entry = (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    entry = entry + (cfg.split_k,) if cfg.split_k > 1 else entry
    return entry + ("w8a8",) if cfg.w8a8 else entry


def sweep(ms: list[int], sms: int, args) -> int:
    import multiprocessing as mp

    from pdd.ops.limits import gemv_bucket

    kinds = [v for v in args.kinds.split(",") if v] if args.kinds else list(_KINDS)
    t0 = time.monotonic()
    table = {(kind, name, m): _config(gemv_bucket(m), n, k, silu, kind, sms)
             for name, (n, k, silu) in SHAPES_8B.items() for kind in kinds for m in ms}
    cases = sorted({(_KINDS[kind], name, n, k, silu, cfg) for name, (n, k, silu) in SHAPES_8B.items()
                    for kind in kinds for m in ms
                    for cfg in [c for c in [table[(kind, name, m)]] if c]
                    + _sweep_configs(m, n, k, silu, kind, sms, args.w8a8)},
                   key=str)
    procs = max(1, min(14, (mp.cpu_count() or 2) - 2))
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.map(_compile_some, [cases[i::procs] for i in range(procs)]))
    print(f"compiled {len(cases)} variants in {time.monotonic() - t0:.0f} s ({failed} did not build)", flush=True)
    rows, best_of = [], {}
    print(f"{'kind':<5} {'layer':<13} {'M':>3} {'floor':>6} {'scaled_mm':>10} {'table':>14} {'best':>14}  best config"
          " (BLOCK_N, BLOCK_K, warps, stages, split)", flush=True)
    for name, (n, k, silu) in SHAPES_8B.items():
        for kind in kinds:
            weights = _weights(_KINDS[kind], n, k, max(2, -(-_COLD_BYTES // (n * k))))
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                floor = _moved(kind, n, k, m, silu) / HBM_BYTES_S * 1e6

                def timed(path, cfg):
                    calls = [_call(path, kind, x, w, s, b, silu, cfg) for w, s, b in weights]
                    return _graph_us(calls * max(1, -(-args.reps // len(calls))), rounds=5)

                try:
                    lib_us = timed(f"scaled_mm-{kind}", None)
                except Exception as e:   # noqa: BLE001 - a path this torch lacks is reported, not fatal
                    print(f"  {kind} {name} M={m} scaled_mm: {type(e).__name__}", flush=True)
                    lib_us = float("nan")
                rows.append({"kind": kind, "layer": name, "m": m, "path": f"scaled_mm-{kind}", "us": lib_us,
                             "floor_us": floor})
                tab = table[(kind, name, m)]
                results = []
                for cfg in dict.fromkeys([c for c in [tab] if c] + _sweep_configs(m, n, k, silu, kind, sms, args.w8a8)):
                    try:
                        us = timed("gemv", cfg)
                    except Exception as e:   # noqa: BLE001 - a config that does not build or run is skipped
                        print(f"  {kind} {name} M={m} {tuple(cfg)}: {type(e).__name__}", flush=True)
                        continue
                    results.append((us, cfg))
                    rows.append({"kind": kind, "layer": name, "m": m, "path": "gemv", "config": cfg._asdict(),
                                 "us": us, "floor_us": floor, "of_floor": floor / us, "table": cfg == tab})
                if not results:
                    continue
                results.sort(key=lambda r: r[0])
                best_us, best = results[0]
                best_of[(kind, name, m)] = (best_us, best, lib_us)
                table_us = next((us for us, c in results if c == tab), float("nan"))
                print(f"{kind:<5} {name:<13} {m:>3} {floor:6.1f} {lib_us:10.1f} {table_us:7.1f} ({100 * floor / table_us:3.0f}%)"
                      f" {best_us:7.1f} ({100 * floor / best_us:3.0f}%)  {_table_entry(best)}", flush=True)
            weights = None     # freed before the next layer's copies
            torch.cuda.empty_cache()
    _sweep_verdicts(best_of, kinds, ms)
    print(f"sweep took {time.monotonic() - t0:.0f} s", flush=True)
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "sms": sms,
                           "hbm_bytes_s": HBM_BYTES_S, "rows": rows})
    return 0


def _sweep_verdicts(best_of: dict, kinds: list[str], ms: list[int]) -> None:
    """Per kind and M: a layer's four linears summed, each at its best config, against
    scaled_mm (the FP8_GEMV_BUCKETS verdict), and the table entries to paste into
    gemv_tiles (_DOT_TUNED_132 for 2..16 rows, _SKINNY_TUNED_132 past 16)."""
    from pdd.ops.limits import gemv_bucket

    wins = {kind: set() for kind in kinds}
    for kind in kinds:
        for m in ms:
            got = [best_of[(kind, name, m)] for name in SHAPES_8B if (kind, name, m) in best_of]
            if len(got) < len(SHAPES_8B):
                continue
            gemv_us, lib_us = sum(g[0] for g in got), sum(g[2] for g in got)
            if gemv_us < lib_us:
                wins[kind].add(gemv_bucket(m))
            print(f"{kind:<5} M={m:>3}: a layer's four linears, each at its best tiles: gemv {gemv_us:7.1f} us, "
                  f"scaled_mm {lib_us:7.1f} us", flush=True)
        print(f"{kind}: the GEMV at its best tiles wins the summed layer in buckets {sorted(wins[kind])}", flush=True)
    both = sorted(set.intersection(*wins.values())) if wins else []
    print(f"FP8_GEMV_BUCKETS the sweep supports for every kind swept: {both}", flush=True)
    print("table entries (bucket, w_bytes, block scales, N or I, K, silu): best", flush=True)
    for (kind, name, m), (_, cfg, _) in sorted(best_of.items(), key=str):
        if m == 1:
            continue
        n, k, silu = SHAPES_8B[name]
        print(f"    ({gemv_bucket(m)}, 1, {kind == 'block'}, {n // 2 if silu else n}, {k}, {silu}): "
              f"{_table_entry(cfg)},", flush=True)


if __name__ == "__main__":
    run_as_main(__name__)
