"""Where a run's token-gap tail comes from: `python -m benchmarks.gaps rate-12.json ...` reads the
per-request records `pdd bench serve` saves and splits the ITL samples into each
request's first gap (first token -> second: in a disaggregated request, the hand-over
from the prefill worker to the decode worker) and the later ones (decode steps), and
counts which kind makes up the gaps at or above the pooled p99. The ITL p99 alone cannot
tell a slow hand-over from decode steps slowed by prefill chunks riding beside them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from benchmarks.cli import run_as_main
from pdd.bench.metrics_calc import latency_stats


@dataclass
class GapAnatomy:
    requests: int
    itl_p99_ms: float | None
    first_median_ms: float | None
    first_p90_ms: float | None
    first_max_ms: float | None
    later_median_ms: float | None
    later_p99_ms: float | None
    tail_gaps: int                 # gaps at or above the pooled p99
    tail_first_share: float | None  # of those, the share that are first gaps


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def anatomy(records: list[dict]) -> GapAnatomy:
    """`records`: the "requests" list of a saved result (itl_ms per request)."""
    done = [r for r in records if r.get("success") and r.get("itl_ms")]
    first = [r["itl_ms"][0] / 1e3 for r in done]
    later = [g / 1e3 for r in done for g in r["itl_ms"][1:]]
    # the serving metrics' own percentile definition (pdd.bench.metrics_calc), in ms
    f, lt, pooled = latency_stats(first), latency_stats(later), latency_stats(first + later)
    p99 = _r(pooled.p99)
    tail = [g for g in first + later if p99 is not None and 1e3 * g >= p99]
    tail_first = sum(1 for g in first if p99 is not None and 1e3 * g >= p99)
    return GapAnatomy(requests=len(done), itl_p99_ms=p99,
                      first_median_ms=_r(f.median), first_p90_ms=_r(f.p90),
                      first_max_ms=_r(1e3 * max(first)) if first else None,
                      later_median_ms=_r(lt.median), later_p99_ms=_r(lt.p99),
                      tail_gaps=len(tail), tail_first_share=round(tail_first / len(tail), 3) if tail else None)


def add_args(p) -> None:
    p.add_argument("files", nargs="*", help="result JSON files written by `pdd bench serve` or benchmarks.sweep")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")


def main(args) -> int:
    if not args.files:
        raise ValueError("no result files: name the JSON files `pdd bench serve` wrote")
    rows = []
    for path in args.files:
        with open(path) as f:
            result = json.load(f)
        rows.append((path, anatomy(result.get("requests", []))))
    if args.json:
        print(json.dumps({p: asdict(a) for p, a in rows}, indent=1))
        return 0
    print("| file | requests | ITL p99 | first gap p50 / p90 / max | later gaps p50 / p99 | "
          "gaps ≥ p99 | of them first gaps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path, a in rows:
        share = "–" if a.tail_first_share is None else f"{100 * a.tail_first_share:.0f}%"
        print(f"| {path} | {a.requests} | {a.itl_p99_ms} | {a.first_median_ms} / {a.first_p90_ms} / "
              f"{a.first_max_ms} | {a.later_median_ms} / {a.later_p99_ms} | {a.tail_gaps} | {share} |")
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
