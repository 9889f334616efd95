"""Serving metrics from request records, defined as common serving benchmarks
(vLLM's benchmark_serving) define them, so figures compare across servers:

    TTFT   request sent -> first content chunk
    ITL    gap between successive content chunks (all requests' gaps pooled)
    TPOT   per request (E2E - TTFT) / (output tokens - 1); requests of one token left out
    E2E    request sent -> end of the stream

Throughputs divide by the run's duration (first send -> last answer). Goodput
counts the completed requests that meet every given SLO (ttft, tpot, e2el, in
ms; a request of one token has no TPOT and so cannot miss a TPOT SLO);
slo_attainment is that count over every request sent, failed ones included.
Percentiles interpolate linearly between ranks (numpy's default, as vLLM).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from pdd.bench.serve_client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
MAX_ERRORS = 20     # distinct error texts kept in a result


@dataclass
class LatencyStats:
    """Milliseconds; None where there is no sample."""
    count: int
    mean: float | None
    median: float | None
    std: float | None
    p90: float | None
    p99: float | None
    percentiles: dict[str, float | None] = field(default_factory=dict)   # "p50": ..., the requested ones


@dataclass
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    goodput: float | None = None              # requests/s meeting every SLO; None without SLOs
    slo_attainment: float | None = None       # fraction of the requests sent meeting every SLO
    slos_ms: dict[str, float] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)   # {"error": text, "count": n}, most frequent first

    def to_json(self) -> dict:
        return asdict(self)


def tpot_s(r: RequestRecord) -> float | None:
    if not r.success or r.output_tokens < 2:
        return None
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1)


def latency_stats(seconds: list[float], percentiles: list[float] = ()) -> LatencyStats:
    if not seconds:
        return LatencyStats(0, None, None, None, None, None, {_label(p): None for p in percentiles})
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    pct = lambda p: float(np.percentile(ms, p))  # noqa: E731
    return LatencyStats(len(ms), float(ms.mean()), pct(50), float(ms.std()), pct(90), pct(99),
                        {_label(p): pct(p) for p in percentiles})


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft_s, "tpot": tpot_s(r), "e2el": r.e2el_s}
    return all(values[k] is None or 1e3 * values[k] <= limit for k, limit in slos_ms.items())


def compute(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None,
            percentiles: list[float] = ()) -> Metrics:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    m = Metrics(
        completed=len(ok), failed=len(failed), duration_s=duration_s, total_input_tokens=n_in,
        total_output_tokens=n_out, request_throughput=per_s(len(ok)), output_throughput=per_s(n_out),
        total_token_throughput=per_s(n_in + n_out),
        ttft_ms=latency_stats([r.ttft_s for r in ok], percentiles),
        tpot_ms=latency_stats(tpots, percentiles),
        itl_ms=latency_stats([g for r in ok for g in r.itl_s], percentiles),
        e2el_ms=latency_stats([r.e2el_s for r in ok], percentiles),
        errors=[{"error": e, "count": c} for e, c in Counter(r.error for r in failed).most_common(MAX_ERRORS)])
    if slos_ms:
        unknown = set(slos_ms) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"--goodput: unknown metric(s) {sorted(unknown)}; choose from {', '.join(SLO_METRICS)}")
        good = sum(meets_slos(r, slos_ms) for r in ok)
        m.goodput, m.slos_ms = per_s(good), dict(slos_ms)
        m.slo_attainment = good / len(records) if records else None
    return m


def _label(p: float) -> str:
    return f"p{p:g}"
